"""Auto mixed precision for QDQ models.

The search itself is ``quant_algos.mixed_precision.search_mixed_precision`` (sensitivity
of each layer raised alone, greedy raise in order of gain until the target is met,
backward pruning). This module supplies its ``evaluate(assignment)``:

- the base QDQ model comes from ``quantize_fn({})`` (the quantizer's own writer);
- an assignment is applied to it by rewriting the raised layers in place of calling
  the quantizer again: A16 replaces the layer's input QuantizeLinear/DequantizeLinear
  pair by a 16-bit pair covering the same range, W16 re-quantizes the float weight to
  16 bits with the same clipping range, and the int32 bias is re-encoded at the new
  ``input_scale * weight_scale``. One evaluation is then one inference over the
  samples instead of a calibration;
- the score is the output SQNR (dB) against the float model on the first
  ``num_samples`` calibration samples, or ``evaluate(model)`` supplied by the user
  (metric ``evaluate``; higher is better).

The returned model is ``quantize_fn(raised)``: the quantizer writes the final formats
(its 16-bit ranges may differ slightly from the rewrite's); the report gives both the
search's score and the final model's.

Example:
    See ``tests/test_algorithms_mixed_precision.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import onnx
from onnx import helper

from quant_algos.mixed_precision import search_mixed_precision
from quant_core.algorithm_config import MixedPrecisionConfig, PrecisionTarget, SensitivityMetric
from quant_core.dtypes import DType
from quant_core.qparams import quantize, sqnr_db
from quant_onnx.algorithms._graph import copy_model, set_initializer
from quant_onnx.algorithms.capture import Feeds, TensorCapture, prepare_batches
from quant_onnx.algorithms.qdq_layers import QDQLayer, bias_codes, match_float_layers
from quant_onnx.graph import GraphIndex

QuantizeFn = Callable[[Mapping[str, PrecisionTarget]], onnx.ModelProto]
EvaluateFn = Callable[[onnx.ModelProto], float]

#: Samples scored per evaluation when not given.
DEFAULT_NUM_SAMPLES = 64
_MS_DOMAIN = "com.microsoft"  # onnxruntime's Q/DQ accept 16-bit types there at any opset
_RAISES_ACTIVATION = {PrecisionTarget.A16W8: True, PrecisionTarget.A8W16: False, PrecisionTarget.A16W16: True}
_RAISES_WEIGHT = {PrecisionTarget.A16W8: False, PrecisionTarget.A8W16: True, PrecisionTarget.A16W16: True}


@attrs.frozen
class MixedPrecisionReport:
    """What :func:`apply_mixed_precision` did.

    Attributes:
        raised: layer -> format value ("a16w8", ...), the layers that changed.
        baseline_score: score of the all-base model (SQNR dB or the user's metric).
        search_score: score of the chosen assignment as evaluated during the search.
        final_score: score of the model ``quantize_fn(raised)`` returned.
        target_met: whether ``final_score >= accuracy_target`` (None without a target).
        size_ratio: weight size relative to the all-base model.
        sensitivity: gain of raising each layer alone.
        evaluations: evaluations the search made.
        notes: layers left out of the search and why.

    Example:
        >>> MixedPrecisionReport({"conv": "a16w8"}, 20.0, 31.0, 30.5, True, 1.0, {}, 5, ()).to_dict()["raised"]
        {'conv': 'a16w8'}
    """

    raised: dict[str, str]
    baseline_score: float
    search_score: float
    final_score: float
    target_met: bool | None
    size_ratio: float
    sensitivity: dict[str, float]
    evaluations: int
    notes: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self, recurse=False) | {"notes": list(self.notes)}


def _ensure_ms_opset(model: onnx.ModelProto) -> None:
    if not any(o.domain == _MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(_MS_DOMAIN, 1))


def _wide_range(scale: float, zero_point: int, dtype: DType) -> tuple[float, int]:
    """int16 scale and zero point covering the range of an 8-bit (scale, zero point)."""
    lo, hi = (dtype.qmin - zero_point) * scale, (dtype.qmax - zero_point) * scale
    wide = DType.INT16
    if zero_point == 0 and dtype.signed:  # symmetric: keep it symmetric
        return scale * dtype.qmax / wide.qmax, 0
    s = (hi - lo) / (wide.qmax - wide.qmin)
    return s, int(np.clip(np.rint(wide.qmin - lo / s), wide.qmin, wide.qmax))


class _Rewriter:
    """Applies an assignment to the base QDQ model (a new model per assignment)."""

    def __init__(self, base: onnx.ModelProto, layers: Mapping[str, tuple[QDQLayer, np.ndarray]]) -> None:
        self.base = base
        self.layers = layers

    def apply(self, assignment: Mapping[str, PrecisionTarget]) -> onnx.ModelProto:
        model = copy_model(self.base)
        for name, target in assignment.items():
            layer, float_weight = self.layers[name]
            index = GraphIndex(model.graph)
            node = next(n for n in model.graph.node if n.name == name)
            in_ratio = self._widen_input(model, index, node, layer) if _RAISES_ACTIVATION[target] else 1.0
            w_ratio = self._widen_weight(model, index, node, layer, float_weight) if _RAISES_WEIGHT[target] else 1.0
            if layer.bias is not None:
                scale = np.broadcast_to(layer.bias.qparams.scale, (layer.out_channels,)) * in_ratio * w_ratio
                set_initializer(model, layer.bias.codes_name, bias_codes(layer.bias.values(), scale))
                self._set_scale(model, index, node.input[2], scale.astype(np.float32), layer.bias.qparams.axis)
        return model

    @staticmethod
    def _set_scale(
        model: onnx.ModelProto, index: GraphIndex, dq_output: str, scale: np.ndarray, axis: int | None
    ) -> None:
        dq = index.producer(dq_output)
        assert dq is not None
        name = index.unique_name(f"{dq.input[1]}_wide")
        set_initializer(model, name, scale if axis is not None else np.float32(scale.reshape(-1)[0]))
        dq.input[1] = name

    def _widen_input(self, model: onnx.ModelProto, index: GraphIndex, node: onnx.NodeProto, layer: QDQLayer) -> float:
        dq = index.producer(node.input[0])
        if dq is None or dq.op_type != "DequantizeLinear" or len(dq.input) < 2:
            return 1.0
        q = index.producer(dq.input[0])
        if q is None or q.op_type != "QuantizeLinear":
            return 1.0
        scale = float(np.asarray(index.constant(dq.input[1])).reshape(-1)[0])
        zp_value = index.constant(dq.input[2]) if len(dq.input) > 2 and dq.input[2] else None
        zp = int(np.asarray(zp_value).reshape(-1)[0]) if zp_value is not None else 0
        dtype = DType.parse(np.dtype(zp_value.dtype).name) if zp_value is not None else DType.UINT8
        wide_scale, wide_zp = _wide_range(scale, zp, dtype)
        s_name, z_name = index.unique_name(f"{node.name}_in16_scale"), index.unique_name(f"{node.name}_in16_zp")
        q_out, dq_out = index.unique_name(f"{node.name}_in16_q"), index.unique_name(f"{node.name}_in16")
        set_initializer(model, s_name, np.float32(wide_scale))
        set_initializer(model, z_name, np.int16(wide_zp))
        _ensure_ms_opset(model)
        position = list(model.graph.node).index(node)
        model.graph.node.insert(
            position,
            helper.make_node("DequantizeLinear", [q_out, s_name, z_name], [dq_out], name=dq_out, domain=_MS_DOMAIN),
        )
        model.graph.node.insert(
            position,
            helper.make_node("QuantizeLinear", [q.input[0], s_name, z_name], [q_out], name=q_out, domain=_MS_DOMAIN),
        )
        node.input[0] = dq_out
        return wide_scale / scale

    def _widen_weight(
        self, model: onnx.ModelProto, index: GraphIndex, node: onnx.NodeProto, layer: QDQLayer, float_weight: np.ndarray
    ) -> float:
        qp = layer.weight_qparams_oi()
        ratio = qp.dtype.qrange(qp.narrow_range)[1] / DType.INT16.qmax
        wide = attrs.evolve(
            qp,
            scale=(qp.scale * ratio).astype(np.float32),
            zero_point=np.zeros_like(qp.zero_point),
            dtype=DType.INT16,
            narrow_range=False,
            fix_pos=None,
        )
        codes = np.ascontiguousarray(layer.to_oi(quantize(float_weight, wide)))  # back to the stored layout
        dq = index.producer(node.input[1])
        assert dq is not None
        codes_name = index.unique_name(f"{layer.weight.codes_name}_w16")
        zp_name = index.unique_name(f"{layer.weight.codes_name}_w16_zp")
        set_initializer(model, codes_name, codes.astype(np.int16))
        set_initializer(model, zp_name, np.zeros_like(np.asarray(wide.scale), np.int16))
        self._set_scale(model, index, node.input[1], wide.scale, wide.axis)
        dq.input[0] = codes_name
        while len(dq.input) < 3:
            dq.input.append("")
        dq.input[2] = zp_name
        dq.domain = _MS_DOMAIN
        _ensure_ms_opset(model)
        return ratio


def _output_sqnr(float_outputs: Sequence[np.ndarray], model: onnx.ModelProto, batches: Sequence[Feeds]) -> float:
    names = [o.name for o in model.graph.output]
    got = TensorCapture(model, names).collect(batches)
    ref = np.concatenate([f.reshape(-1) for f in float_outputs])
    return sqnr_db(ref, np.concatenate([got[n].reshape(-1) for n in names]))


def apply_mixed_precision(
    float_model: onnx.ModelProto,
    quantize_fn: QuantizeFn | None,
    batches: Iterable[Feeds],
    config: MixedPrecisionConfig,
    *,
    base: onnx.ModelProto | None = None,
    evaluate: EvaluateFn | None = None,
    num_samples: int = DEFAULT_NUM_SAMPLES,
    quiet: bool = False,
) -> tuple[onnx.ModelProto, MixedPrecisionReport]:
    """Raise the fewest, most sensitive layers to a wider format.

    Args:
        float_model: the float model the quantizer writes from (same node names).
        quantize_fn: ``overrides (node name -> PrecisionTarget) -> QDQ model``; ``None``
            to start from ``base`` and return the search's own rewrite of it (no second
            calibration).
        base: the QDQ model to start from when ``quantize_fn`` is ``None``.
        batches: calibration feeds; the first ``num_samples`` samples are scored.
        config: target types, accuracy target (dB of output SQNR for metric ``sqnr``,
            else ``evaluate``'s units), size budget, max layers.
        evaluate: the user's score of a model, higher is better (metric ``evaluate``).
        num_samples: samples scored by the SQNR metric.
        quiet: no progress bar.
    """
    if config.metric is SensitivityMetric.EVALUATE and evaluate is None:
        raise ValueError("evaluate: metric 'evaluate' needs an evaluate(model) -> score function")
    if quantize_fn is None and base is None:
        raise ValueError("base: mixed precision needs the QDQ model (base=) or the quantizer (quantize_fn=)")
    feeds = prepare_batches(batches, num_samples)
    if quantize_fn is not None:
        base = quantize_fn({})
    assert base is not None
    pairs, notes = match_float_layers(float_model, base)
    layers = {p.layer.name: (p.layer, p.float_weight) for p in pairs}
    rewriter = _Rewriter(base, layers)
    outputs = [o.name for o in base.graph.output]
    reference = TensorCapture(float_model, outputs).collect(feeds)
    float_outputs = [reference[n] for n in outputs]

    def score(model: onnx.ModelProto) -> float:
        if config.metric is SensitivityMetric.EVALUATE:
            assert evaluate is not None
            return float(evaluate(model))
        return _output_sqnr(float_outputs, model, feeds)

    sizes = {name: float(layer.weight.codes.size) for name, (layer, _) in layers.items()}
    total = float(sum(t.ByteSize() for t in base.graph.initializer))
    result = search_mixed_precision(
        list(layers),
        lambda assignment: score(rewriter.apply(assignment)),
        config,
        sizes=sizes,
        total_size=total,
        quiet=quiet,
    )
    if not result.raised:
        final = base
    else:
        final = quantize_fn(dict(result.raised)) if quantize_fn is not None else rewriter.apply(result.raised)
    final_score = score(final) if result.raised else result.baseline_score
    target = config.accuracy_target
    report = MixedPrecisionReport(
        raised={name: t.value for name, t in result.raised.items()},
        baseline_score=result.baseline_score,
        search_score=result.score,
        final_score=final_score,
        target_met=None if target is None else final_score >= target,
        size_ratio=result.size_ratio,
        sensitivity=dict(result.sensitivity),
        evaluations=result.evaluations,
        notes=tuple(notes),
    )
    return final, report
