"""The NPU conversions of :mod:`quant_core.conversions` on the float graph, before calibration.

With ``QuantConfig.npu_conversions`` the float graph is edited so that calibration, CLE and
AdaRound see the function the NPU computes: Sigmoid and SiLU become the device's
HardSigmoid, HardSwish its ``x * HardSigmoid(x)``, ConvTranspose a zero insertion and a
Conv... The edits are :class:`quant_core.onnx_qdq.conversions.OnnxConversions`, which
``quant_npu.legalize`` applies to QDQ graphs too; this module finds the matches on the
planner's view of the float graph and applies them.

Example:
    >>> import numpy as np
    >>> from onnx import TensorProto, helper
    >>> nodes = [helper.make_node("Sigmoid", ["x"], ["g"], name="sig"), helper.make_node("Mul", ["x", "g"], ["y"], name="m")]
    >>> g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
    ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    >>> model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    >>> apply_npu_conversions_inplace(model, ("silu",))
    1
    >>> [(n.op_type, round(n.attribute[0].f, 6)) for n in model.graph.node[:1]]
    [('HardSigmoid', 0.166687)]
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import onnx

from quant_core.errors import ModelError
from quant_core.onnx_qdq.conversions import OnnxConversions
from quant_core.onnx_qdq.graph import GraphIndex, plan_graph
from quant_core.onnx_qdq.model_io import opset_version
from quant_core.plan.conversions import find_matches, float_view
from quant_onnx.graph_edit import copy_model

_LOG = logging.getLogger(__name__)


def apply_npu_conversions_inplace(
    model: onnx.ModelProto, rules: Iterable[str], converter: OnnxConversions | None = None
) -> int:
    """Apply ``rules`` (names of :data:`quant_core.conversions.RULES`) to a float model in
    place; returns how many nodes were converted (see the module example). Needs opset >= 13
    (the preprocess pipeline upgrades first)."""
    names = tuple(rules)
    if not names:
        return 0
    opset = opset_version(model)
    if opset < 13:
        raise ModelError(f"npu_conversions: the model's opset is {opset}; allowed: 13 or later")
    if "conv_transpose" in names and any(n.op_type == "ConvTranspose" for n in model.graph.node):
        from quant_onnx.pipeline.preprocess.shape_inference import infer_shapes_inplace

        infer_shapes_inplace(model)
    converter = converter or OnnxConversions(model, names)
    matches = find_matches(float_view(plan_graph(model)), names)
    converter.index = GraphIndex(model.graph)
    count = sum(converter.apply(match) for match in matches)
    for note in converter.notes:
        _LOG.warning(note)
    return count


def apply_npu_conversions(model: onnx.ModelProto, rules: Iterable[str]) -> onnx.ModelProto:
    """A converted copy of ``model`` (see :func:`apply_npu_conversions_inplace`)."""
    out = copy_model(model)
    apply_npu_conversions_inplace(out, rules)
    return out


__all__ = ["apply_npu_conversions", "apply_npu_conversions_inplace"]
