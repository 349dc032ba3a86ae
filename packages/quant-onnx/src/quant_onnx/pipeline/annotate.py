"""The ONNX side of planning: map an ``onnx.ModelProto`` onto the planner's graph
protocol (:mod:`quant_core.plan`) and ask the planner which tensor gets which spec.

Every decision (shared-scale groups, fusions, weight axes, bias slots, float nodes) is
the planner's; this module only translates: ONNX nodes of the default domain become
:class:`~quant_core.plan.PlanNode` s with their attributes decoded (strings as ``str``,
lists as tuples), other domains are marked non-standard, integer tensors (from the
model's types, or shape inference when they are missing) are marked non-float, and
constants are read from initializers and ``Constant`` nodes.

Example:
    >>> import numpy as np, onnx
    >>> from onnx import helper, numpy_helper, TensorProto
    >>> from quant_core.presets import get_preset
    >>> w = numpy_helper.from_array(np.ones((4, 3, 1, 1), np.float32), "w")
    >>> g = helper.make_graph(
    ...     [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"), helper.make_node("Relu", ["c"], ["y"], name="relu")],
    ...     "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
    ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    >>> plan = plan_model(helper.make_model(g), get_preset("a8w8"))
    >>> [(grp.members, grp.observed) for grp in plan.groups]
    [(('x',), ('x',)), (('c', 'y'), ('y',))]
    >>> plan.weights[0].spec.per_channel_axis, [f.node for f in plan.fused]
    (0, ['relu'])
"""

from __future__ import annotations

import onnx

from quant_core.config import QuantConfig
from quant_core.onnx_qdq.graph import plan_graph as onnx_plan_graph
from quant_core.plan import PlanGraph, QuantPlan, plan_quantization
from quant_onnx.pipeline.preprocess.shape_inference import typed_index


def plan_graph(model: onnx.ModelProto) -> PlanGraph:
    """``model``'s main graph as the planner's :class:`~quant_core.plan.PlanGraph`, its
    integer tensors known from the model's types or shape inference."""
    return onnx_plan_graph(model, typed_index(model))


def plan_model(
    model: onnx.ModelProto, config: QuantConfig, *, share_concat_scales: bool = True, graph: PlanGraph | None = None
) -> QuantPlan:
    """The planner's :class:`~quant_core.plan.QuantPlan` for ``model`` (not modified; its
    nodes must be named, see :func:`ensure_node_names`) under ``config``. ``graph``: the
    model's :func:`plan_graph` when the caller already has it (it depends on the model
    only, so one serves every config)."""
    graph = plan_graph(model) if graph is None else graph
    return plan_quantization(graph, config, share_concat_scales=share_concat_scales)


def ensure_node_names(model: onnx.ModelProto) -> None:
    """Give every unnamed node a unique, deterministic name (in place; used on the
    quantizer's own copy) so that name globs and reports can refer to it."""
    taken = {node.name for node in model.graph.node if node.name}
    for index, node in enumerate(model.graph.node):
        if not node.name:
            candidate = f"{node.op_type}_{index}"
            while candidate in taken:
                candidate += "_"
            node.name = candidate
            taken.add(candidate)
