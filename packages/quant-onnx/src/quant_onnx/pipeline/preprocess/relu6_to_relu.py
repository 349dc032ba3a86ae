"""Optional: replace Clip(0, 6) (Relu6) and Clip(0, inf) by Relu.

Clip(0, 6) -> Relu changes results for inputs above 6; it is opt-in, for targets whose quantized
range already saturates there or that only fuse Relu.  Clip with min 0 and no max is exactly Relu.
"""

from __future__ import annotations

import math

import onnx
from onnx import helper

from quant_core.onnx_qdq.graph import GraphIndex, is_default_domain, plan_node
from quant_core.plan import clip_bounds
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
        bounds = clip_bounds(plan_node(node), index.constant)
        if bounds is None:
            continue
        lo, hi = bounds
        if lo != 0.0 or hi not in (max_value, math.inf):
            continue
        relu = helper.make_node("Relu", [node.input[0]], [node.output[0]], name=node.name)
        graph.node[i].CopyFrom(relu)
        count += 1
    return count
