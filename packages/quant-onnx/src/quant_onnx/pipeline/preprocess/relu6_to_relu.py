"""Optional: replace Clip(0, 6) (Relu6) and Clip(0, inf) by Relu.

Clip(0, 6) -> Relu changes results for inputs above 6; it is opt-in, for targets whose quantized
range already saturates there or that only fuse Relu.  Clip with min 0 and no max is exactly Relu.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from quant_onnx.graph import GraphIndex, is_default_domain, node_attribute
from quant_onnx.graph_edit import copy_model


def relu6_to_relu(model: onnx.ModelProto, *, max_value: float = 6.0) -> onnx.ModelProto:
    """Return a copy of `model` where Clip(0, max_value) and Clip(0, none) nodes are Relu nodes."""
    out = copy_model(model)
    relu6_to_relu_inplace(out, max_value=max_value)
    return out


def relu6_to_relu_inplace(model: onnx.ModelProto, *, max_value: float = 6.0) -> int:
    """In-place version; returns the number of Clip nodes replaced."""
    graph = model.graph
    index = GraphIndex(graph)
    count = 0
    for i, node in enumerate(graph.node):
        if node.op_type != "Clip" or not is_default_domain(node):
            continue
        bounds = clip_bounds(node, index)
        if bounds is None:
            continue
        lo, hi = bounds
        if lo != 0.0 or hi not in (max_value, None):
            continue
        relu = helper.make_node("Relu", [node.input[0]], [node.output[0]], name=node.name)
        graph.node[i].CopyFrom(relu)
        count += 1
    return count


def clip_bounds(node: onnx.NodeProto, index: GraphIndex) -> tuple[float | None, float | None] | None:
    """(min, max) of a Clip node (None for an absent bound); None when a bound is computed at run time.

    Handles both forms: inputs (opset >= 11) and attributes (opset < 11).
    """
    if len(node.input) == 1 and any(a.name in ("min", "max") for a in node.attribute):
        lo_attr, hi_attr = node_attribute(node, "min", None), node_attribute(node, "max", None)
        return (
            None if lo_attr is None else float(lo_attr),  # type: ignore[arg-type]
            None if hi_attr is None else float(hi_attr),  # type: ignore[arg-type]
        )
    bounds: list[float | None] = []
    for pos in (1, 2):
        name = node.input[pos] if len(node.input) > pos else ""
        if not name:
            bounds.append(None)
            continue
        value = index.constant(name)
        if value is None or np.asarray(value).size != 1:
            return None
        bounds.append(float(np.asarray(value).reshape(-1)[0]))
    return bounds[0], bounds[1]
