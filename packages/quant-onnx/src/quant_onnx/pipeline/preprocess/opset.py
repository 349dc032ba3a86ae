"""Raise the default-domain opset (per-channel QuantizeLinear/DequantizeLinear need opset 13)."""

from __future__ import annotations

import onnx
from onnx import version_converter

from quant_core.errors import ModelError, one_line
from quant_core.onnx_qdq.graph import DEFAULT_DOMAINS
from quant_core.onnx_qdq.model_io import opset_version
from quant_onnx.graph_edit import copy_model

MIN_QDQ_OPSET = 13


def default_target_opset(model: onnx.ModelProto) -> int:
    """max(13, the model's opset): never downgrade, always reach per-channel QDQ."""
    return max(MIN_QDQ_OPSET, opset_version(model))


def upgrade_opset(model: onnx.ModelProto, target_opset: int | None = None) -> onnx.ModelProto:
    """Return a copy of `model` converted to `target_opset` (default: default_target_opset).

    A model already at or above the target is returned as an unchanged copy; downgrades are refused.
    """
    current = opset_version(model)
    target = default_target_opset(model) if target_opset is None else int(target_opset)
    if target < current:
        raise ModelError(f"target_opset {target} is below the model's opset {current}; downgrading is not supported")
    if target == current:
        return copy_model(model)
    try:
        converted = version_converter.convert_version(model, target)
    except Exception as exc:  # the C++ converter raises RuntimeError/ValueError/ConvertError
        raise ModelError(f"cannot convert model from opset {current} to {target}: {one_line(exc)}") from exc
    # The converter keeps the old IR version; opset >= 13 needs IR >= 7.
    converted.ir_version = max(converted.ir_version, 7)
    # It also updates only the first of a model's two spellings of the default domain ('' and
    # 'ai.onnx'), leaving the model declaring two opsets for it.
    for opset in converted.opset_import:
        if opset.domain in DEFAULT_DOMAINS:
            opset.version = target
    return converted
