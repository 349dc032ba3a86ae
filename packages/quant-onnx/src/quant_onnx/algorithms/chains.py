"""Find cross-layer-equalization chains in a float ONNX graph.

A link ``A -> B`` joins two weighted layers when A's output reaches B's data input
through single-consumer tensors and ops that commute with a positive per-channel
scale (Relu, LeakyRelu, PRelu, Clip(0, inf), MaxPool, AveragePool, a zero Pad), plus
Clip(0, 6) when it may be replaced by Relu. A and B are both Conv (NCHW channels) or
both Gemm/MatMul (``[.., C]``), and their weights (and biases) are initializers no
other node reads. Links ``A -> depthwise -> C`` become triples, the rest pairs.

Example:
    >>> import numpy as np
    >>> from onnx import TensorProto, helper, numpy_helper
    >>> inits = [numpy_helper.from_array(np.ones((4, 3, 1, 1), np.float32), "w1"),
    ...          numpy_helper.from_array(np.ones((2, 4, 1, 1), np.float32), "w2")]
    >>> nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], name="c1"), helper.make_node("Relu", ["a"], ["r"], name="r"),
    ...          helper.make_node("Conv", ["r", "w2"], ["y"], name="c2")]
    >>> g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 2, 2])],
    ...                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 2, 2])], inits)
    >>> found = find_chains(helper.make_model(g), replace_relu6=True)
    >>> found.chains, [link.activations for link in found.links.values()]
    ([('c1', 'c2')], [('r',)])
"""

from __future__ import annotations

from collections.abc import Collection

import attrs
import numpy as np
import onnx

from quant_algos.layer import Layer
from quant_onnx.algorithms._graph import (
    HOMOGENEOUS_ACTIVATIONS,
    activation_kind,
    attr,
    initializer_users,
    int_attr,
    is_default_domain,
    sole_consumer,
)
from quant_onnx.graph import GraphIndex

# Ops between two layers that commute with a positive per-channel scale.
_CHANNEL_WISE = ("MaxPool", "AveragePool")
# ... and those across which a constant can also be moved (high-bias absorption):
# relu(x - c) + c == relu(x) for x >= c; max/avg pool and zero pads are (nearly) linear.
_ABSORBABLE = ("Relu", "MaxPool", "AveragePool", "Pad")


@attrs.frozen(eq=False)
class LayerRef:
    """A weighted node whose weight CLE may rescale.

    Attributes:
        node: the Conv/Gemm/MatMul node.
        weight_name, bias_name: initializer names (bias_name None when absent).
        transposed: the weight is stored ``[in, out]`` (MatMul, Gemm with transB=0).
        layer: weight and bias in quant_algos' ``[out, in, ...]`` layout.
    """

    node: onnx.NodeProto
    weight_name: str
    bias_name: str | None
    transposed: bool
    layer: Layer

    @property
    def family(self) -> str:
        return "conv" if self.node.op_type == "Conv" else "dense"


@attrs.frozen
class Link:
    """Path from one layer's output to the next layer's input.

    Attributes:
        first, second: layer node names.
        activations: nodes between them (in order).
        relu6: the Clip(0, 6) nodes among them (to be replaced by Relu).
        absorbable: a constant can be moved across the path (high-bias absorption).
    """

    first: str
    second: str
    activations: tuple[str, ...]
    relu6: tuple[str, ...]
    absorbable: bool


@attrs.frozen(eq=False)
class ChainSearch:
    """Result of :func:`find_chains`: the layers by node name, the links by first
    layer, and the chains (pairs and depthwise triples) to equalize."""

    layers: dict[str, LayerRef]
    links: dict[str, Link]
    chains: list[tuple[str, ...]]


def layer_ref(node: onnx.NodeProto, index: GraphIndex, graph: onnx.GraphProto) -> LayerRef | None:
    """The node as a rescalable layer, or None (not Conv/Gemm/MatMul, weight not an
    owned initializer, unsupported Gemm attributes)."""
    if not is_default_domain(node) or node.op_type not in ("Conv", "Gemm", "MatMul") or len(node.input) < 2:
        return None
    weight_name = node.input[1]
    weight = index.constant(weight_name)
    if index.initializer_proto(weight_name) is None or weight is None or initializer_users(graph, weight_name) != 1:
        return None
    if weight.dtype != np.float32 or weight.ndim < 2:
        return None
    bias_name = node.input[2] if len(node.input) > 2 and node.input[2] else None
    bias = None
    if bias_name is not None:
        bias = index.constant(bias_name)
        if index.initializer_proto(bias_name) is None or bias is None or initializer_users(graph, bias_name) != 1:
            return None
    transposed = False
    if node.op_type == "Conv":
        groups = int_attr(node, "group", 1)
    else:
        groups = 1
        if weight.ndim != 2:
            return None
        if node.op_type == "Gemm":
            if attr(node, "transA", 0) or attr(node, "alpha", 1.0) != 1.0 or attr(node, "beta", 1.0) != 1.0:
                return None
            transposed = not attr(node, "transB", 0)
        else:
            transposed = True
        if transposed:
            weight = weight.T
    if bias is not None and bias.shape != (weight.shape[0],):
        return None
    try:
        layer = Layer(weight, bias, groups=groups)
    except ValueError:
        return None
    return LayerRef(node, weight_name, bias_name, transposed, layer)


def _zero_pad(node: onnx.NodeProto, index: GraphIndex) -> bool:
    mode = attr(node, "mode", b"constant")
    if (mode.decode() if isinstance(mode, bytes) else mode) != "constant":
        return False
    if len(node.input) > 2 and node.input[2]:
        value = index.constant(node.input[2])
        return value is not None and bool(np.all(np.asarray(value) == 0))
    return True


def _may_replace(node: onnx.NodeProto, replace_relu6: bool | Collection[str]) -> bool:
    return replace_relu6 if isinstance(replace_relu6, bool) else node.name in replace_relu6


def _follow(
    ref: LayerRef, index: GraphIndex, layers: dict[str, LayerRef], replace_relu6: bool | Collection[str]
) -> tuple[str, tuple[str, ...], tuple[str, ...], bool] | None:
    """The next layer reached from ``ref`` through commuting single-consumer ops."""
    tensor = ref.node.output[0]
    passed: list[str] = []
    relu6: list[str] = []
    absorbable = True
    while True:
        node = sole_consumer(index, tensor)
        if node is None or not is_default_domain(node) or node.input[0] != tensor:
            return None
        if node.name in layers:
            nxt = layers[node.name]
            if nxt.family != ref.family or any(i == tensor for i in nxt.node.input[1:]):
                return None
            return node.name, tuple(passed), tuple(relu6), absorbable
        kind = activation_kind(node, index)
        if kind == "relu6" and _may_replace(node, replace_relu6):
            relu6.append(node.name)
        elif kind == "relu" or node.op_type in _CHANNEL_WISE:
            pass
        elif node.op_type in HOMOGENEOUS_ACTIVATIONS:
            absorbable = False
        elif node.op_type == "Pad" and ref.family == "conv" and _zero_pad(node, index):
            pass
        else:
            return None
        if node.op_type not in _ABSORBABLE and kind is None:
            absorbable = False
        if len(node.output) != 1 or not node.name:
            return None
        passed.append(node.name)
        tensor = node.output[0]


def find_chains(model: onnx.ModelProto, replace_relu6: bool | Collection[str]) -> ChainSearch:
    """Layers, links and chains of ``model`` (see the module docstring); chains come in
    topological order and every link belongs to exactly one chain. ``replace_relu6``: whether
    chains may pass Clip(0, 6) nodes (to be replaced by Relu), or the names of those that may."""
    graph = model.graph
    index = GraphIndex(graph)
    order = index.topological_order()
    layers: dict[str, LayerRef] = {}
    for node in order:
        ref = layer_ref(node, index, graph) if node.name else None
        if ref is not None:
            layers[node.name] = ref
    links: dict[str, Link] = {}
    for name, ref in layers.items():
        found = _follow(ref, index, layers, replace_relu6)
        if found is not None:
            second, passed, relu6, absorbable = found
            if layers[second].layer.in_channels == ref.layer.out_channels:
                links[name] = Link(name, second, passed, relu6, absorbable)
    chains: list[tuple[str, ...]] = []
    used: set[str] = set()  # first layers of links already in a chain
    for node in order:
        first = node.name
        if first not in links or first in used:
            continue
        middle = links[first].second
        if layers[middle].layer.is_depthwise and middle in links:
            chains.append((first, middle, links[middle].second))
            used.update((first, middle))
        else:
            chains.append((first, middle))
            used.add(first)
    return ChainSearch(layers, links, chains)
