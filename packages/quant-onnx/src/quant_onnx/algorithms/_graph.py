"""Small graph helpers shared by the algorithm passes: copies, attributes, activation
kinds, and replacing initializers in a copied model.

Example:
    >>> import numpy as np
    >>> from onnx import TensorProto, helper, numpy_helper
    >>> w = numpy_helper.from_array(np.ones(2, np.float32), "w")
    >>> g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="r")], "g",
    ...     [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
    ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])], [w])
    >>> m = copy_model(helper.make_model(g))
    >>> set_initializer(m, "w", np.zeros(2, np.float32))
    >>> numpy_helper.to_array(m.graph.initializer[0]).tolist()
    [0.0, 0.0]
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from quant_onnx.errors import ModelError
from quant_onnx.graph import GraphIndex, is_default_domain

# Activations f with f(x / s) == f(x) / s for every s > 0: scaling can cross them.
HOMOGENEOUS_ACTIVATIONS = ("Relu", "LeakyRelu", "PRelu")


def copy_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """A deep copy (the passes never edit their input)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def attr(node: onnx.NodeProto, name: str, default: object = None) -> object:
    """Value of attribute ``name`` of ``node`` (ints/floats/lists decoded), else ``default``."""
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def clip_bounds(node: onnx.NodeProto, index: GraphIndex) -> tuple[float, float] | None:
    """``(min, max)`` of a Clip (attributes before opset 11, constant inputs after);
    None when a bound is computed at run time."""
    lo, hi = float("-inf"), float("inf")
    if attr(node, "min") is not None or attr(node, "max") is not None:
        return float(attr(node, "min", lo)), float(attr(node, "max", hi))  # type: ignore[arg-type]
    bounds = [lo, hi]
    for i in (1, 2):
        if len(node.input) > i and node.input[i]:
            value = index.constant(node.input[i])
            if value is None:
                return None
            bounds[i - 1] = float(np.asarray(value).reshape(-1)[0])
    return bounds[0], bounds[1]


def activation_kind(node: onnx.NodeProto, index: GraphIndex) -> str | None:
    """'relu' for Relu and Clip(0, inf), 'relu6' for Clip(0, 6), else None."""
    if not is_default_domain(node):
        return None
    if node.op_type == "Relu":
        return "relu"
    if node.op_type == "Clip":
        bounds = clip_bounds(node, index)
        if bounds == (0.0, float("inf")):
            return "relu"
        if bounds == (0.0, 6.0):
            return "relu6"
    return None


def sole_consumer(index: GraphIndex, tensor: str) -> onnx.NodeProto | None:
    """The only node reading ``tensor`` (None if several, none, or it is a graph output)."""
    consumers = index.consumers(tensor)
    if len(consumers) != 1 or index.is_graph_output(tensor):
        return None
    return consumers[0]


def nodes_by_name(graph: onnx.GraphProto, what: str) -> dict[str, onnx.NodeProto]:
    """Node name -> node; ModelError when a Conv/Gemm/MatMul has no or a duplicate name
    (the passes match float and quantized layers by node name)."""
    out: dict[str, onnx.NodeProto] = {}
    for node in graph.node:
        if node.op_type in ("Conv", "Gemm", "MatMul") and (not node.name or node.name in out):
            problem = "has no name" if not node.name else f"name {node.name!r} is used twice"
            raise ModelError(f"{what}: a {node.op_type} node {problem}; layers are matched by node name")
        if node.name:
            out[node.name] = node
    return out


def initializer_index(graph: onnx.GraphProto) -> dict[str, int]:
    return {t.name: i for i, t in enumerate(graph.initializer)}


def int_attr(node: onnx.NodeProto, name: str, default: int) -> int:
    """An integer attribute (``group``, ``axis``, ``transB``...)."""
    value = attr(node, name, default)
    return int(value) if isinstance(value, (int, np.integer)) else default


def set_initializer(model: onnx.ModelProto, name: str, value: np.ndarray | np.generic) -> None:
    """Replace the initializer ``name`` of ``model`` (a copy the pass owns) by ``value``,
    keeping its position; appended when it does not exist yet."""
    tensor = numpy_helper.from_array(np.ascontiguousarray(value), name)
    for i, t in enumerate(model.graph.initializer):
        if t.name == name:
            model.graph.initializer[i].CopyFrom(tensor)
            return
    model.graph.initializer.append(tensor)


def initializer_users(graph: onnx.GraphProto, name: str) -> int:
    """How many node inputs read ``name`` (a shared weight cannot be rescaled for one node)."""
    return sum(1 for node in graph.node for i in node.input if i == name)
