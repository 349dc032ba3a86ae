"""The ``--report`` JSON: every quantized tensor's spec, the range its qparams were chosen
from (``range``: the observer's selection, so about 0 for a symmetric spec and clipped for
percentile or MSE observers), scale and zero point in the spec's format and, where the
file stores them otherwise (int8 activations as uint8 on x86), as stored (``stored``); the
nodes left in float and why, and the per-layer SQNR against the float model.

Example:
    >>> import json

    >>> from quant_core.plan import QuantPlan
    >>> from quant_onnx.pipeline.calibrate import CalibratedModel
    >>> import onnx
    >>> empty = QuantPlan(groups=(), weights=(), biases=(), fused=(), quantized_nodes=(), float_nodes=())
    >>> report = build_report(CalibratedModel(onnx.ModelProto(), empty, {}, {}, {}))
    >>> sorted(report)[:3]
    ['activations', 'biases', 'comparison']
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from quant_core.atomic_io import atomic_write
from quant_core.bias import EncodedBias
from quant_core.config import QuantConfig
from quant_core.qdq import ActivationEncoding, encode_activation
from quant_core.qparams import QParams
from quant_core.serialization import report_json, to_data
from quant_onnx.pipeline.calibrate import CalibratedModel
from quant_onnx.reporting.compare import Comparison

REPORT_VERSION = 1


def _plain(value: Any) -> Any:
    array = np.asarray(value)
    if array.ndim == 0:
        item = array.item()
        return item if not isinstance(item, float) or np.isfinite(item) else str(item)
    return [_plain(v) for v in array]


def qparams_data(qp: QParams) -> dict[str, Any]:
    """JSON-ready qparams (per-channel values as lists).

    Example:
        >>> qparams_data(QParams.per_tensor(0.5, 3, "uint8"))["zero_point"]
        3
    """
    return {
        "dtype": qp.dtype.value,
        "axis": qp.axis,
        "scale": _plain(qp.scale),
        "zero_point": _plain(qp.zero_point),
        "fix_pos": None if qp.fix_pos is None else _plain(qp.fix_pos),
    }


def build_report(
    calibrated: CalibratedModel,
    *,
    config: QuantConfig | None = None,
    comparison: Comparison | None = None,
    notes: Sequence[str] = (),
    files: dict[str, Any] | None = None,
    biases: Mapping[str, EncodedBias] | None = None,
    activation_encoding: ActivationEncoding = "as_spec",
) -> dict[str, Any]:
    """The report as a JSON-ready dict (see the module docstring). ``biases``: how the
    writer stored each layer's bias (the bias rule's decision, ``quant_core.bias``);
    ``activation_encoding``: how it stored activations (``WriterOptions``)."""
    ann = calibrated.plan
    stored = biases or {}
    activations = []
    for group in ann.groups:
        lo, hi = calibrated.activation_ranges.get(group.key, (None, None))
        qp = calibrated.activation_qparams[group.key]
        entry = {
            "tensors": list(group.members),
            "observed": list(group.observed),
            "spec": to_data(group.spec),
            "range": None if lo is None else [_plain(lo), _plain(hi)],
            **qparams_data(qp),
        }
        written = encode_activation(qp, activation_encoding)
        if written is not qp:
            entry["stored"] = {"dtype": written.dtype.value, "zero_point": _plain(written.zero_point)}
        activations.append(entry)
    weights = [
        {
            "node": slot.node,
            "op_type": slot.op_type,
            "tensor": slot.tensor,
            "spec": to_data(slot.spec),
            **qparams_data(calibrated.weight_qparams[slot.node]),
        }
        for slot in ann.weights
    ]
    bias_entries = [_bias_entry(b.node, b.tensor, b.spec, stored.get(b.node)) for b in ann.biases if b.tensor]
    return {
        "report_version": REPORT_VERSION,
        "files": files or {},
        "config": None if config is None else to_data(config),
        "summary": {
            "quantized_nodes": len(ann.quantized_nodes),
            "float_nodes": len(ann.float_nodes),
            "activation_groups": len(ann.groups),
            "weights": len(ann.weights),
        },
        "activations": activations,
        "weights": weights,
        "biases": bias_entries,
        "fused_activations": [
            {"node": f.node, "op_type": f.op_type, "producer": f.producer, "bounds": [_plain(b) for b in f.bounds]}
            for f in ann.fused
        ],
        "quantized_nodes": [{"name": n, "op_type": t} for n, t in ann.quantized_nodes],
        "float_nodes": [{"name": f.name, "op_type": f.op_type, "reason": f.reason} for f in ann.float_nodes],
        "comparison": None if comparison is None else comparison.to_data(),
        "notes": list(run_notes(calibrated, notes)),
    }


def run_notes(calibrated: CalibratedModel, written: Iterable[str] = ()) -> tuple[str, ...]:
    """Every note of one quantization run, in the order it was made: the plan's, the
    calibration's, then writing's."""
    return (*calibrated.plan.notes, *calibrated.notes, *written)


def _bias_entry(node: str, tensor: str, spec: Any, encoded: EncodedBias | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"node": node, "tensor": tensor, "spec": None if spec is None else to_data(spec)}
    if encoded is None:
        return {**entry, "rule": None}
    entry["rule"] = encoded.rule.value
    entry["scale"] = {
        "product": "input*weight",
        "widened": "input*weight*2**shift",
        "own": "own",
        "float": None,
    }[encoded.rule.value]
    entry["shift"] = _plain(encoded.shift)
    if encoded.note is not None:
        entry["note"] = encoded.note
    return entry


def write_report(report: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write ``report`` as JSON atomically (temp file in the same folder + rename)."""
    return atomic_write(path, report_json(report))
