"""Auto mixed precision for the ONNX backend: the driver
(:func:`quant_algos.drivers.mixed_precision.run_mixed_precision`) over candidates this
module builds and scores.

A candidate is what the quantizer itself writes for the config with the chosen layers
raised (``quant_core.precision.raised_config``): re-planned (a raised layer reads its
own 16-bit requantization of its input; 16-bit weights are quantized from the float
weight), with every qparam from the observers the calibration already filled
(:meth:`~quant_onnx.pipeline.calibrate.CalibratedModel.replan`): one evaluation is a
write and one inference over the scored samples, never a calibration. The score is the
output SQNR (dB) against the float model on the first ``MixedPrecisionConfig.num_samples``
calibration samples, or ``evaluate(model)`` supplied by the user (metric ``evaluate``;
higher is better). 16-bit Q/DQ go in the default ONNX domain from opset 21, in
``com.microsoft`` below (the report says so).

Example:
    See ``tests/test_algorithms_mixed_precision.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import attrs
import numpy as np
import onnx

from quant_algos.drivers.mixed_precision import MixedPrecisionReport, run_mixed_precision
from quant_core.algorithm_config import MixedPrecisionConfig, PrecisionTarget, SensitivityMetric
from quant_core.config import QuantConfig
from quant_core.errors import ConfigError
from quant_core.plan import plan_quantization
from quant_core.precision import raised_config
from quant_core.qparams import sqnr_db
from quant_onnx.algorithms.capture import Feeds, TensorCapture, prepare_batches
from quant_onnx.pipeline.annotate import plan_graph
from quant_onnx.pipeline.calibrate import CalibratedModel
from quant_onnx.pipeline.qdq_writer import WriterOptions, WrittenModel, write_qdq_with_notes

EvaluateFn = Callable[[onnx.ModelProto], float]
Candidate = tuple[WrittenModel, CalibratedModel]


def _output_sqnr(float_outputs: Sequence[np.ndarray], model: onnx.ModelProto, batches: Sequence[Feeds]) -> float:
    names = [o.name for o in model.graph.output]
    got = TensorCapture(model, names).collect(batches)
    ref = np.concatenate([f.reshape(-1) for f in float_outputs])
    return sqnr_db(ref, np.concatenate([got[n].reshape(-1) for n in names]))


def apply_mixed_precision(
    calibrated: CalibratedModel,
    config: QuantConfig,
    batches: Iterable[Feeds],
    mp: MixedPrecisionConfig,
    *,
    writer_options: WriterOptions | None = None,
    share_concat_scales: bool = True,
    evaluate: EvaluateFn | None = None,
    quiet: bool = False,
) -> tuple[onnx.ModelProto, CalibratedModel, MixedPrecisionReport]:
    """Raise the fewest, most sensitive layers to a wider format.

    Args:
        calibrated: the calibrated float model (its observers give the raised formats' qparams).
        config: the quantization config the layers are raised from.
        batches: calibration feeds; the first ``mp.num_samples`` samples are scored.
        mp: target types, accuracy target (dB of output SQNR for metric ``sqnr``, else
            ``evaluate``'s units), size budget, max layers.
        writer_options: the QDQ encoding (as the quantizer writes).
        share_concat_scales: as the quantizer plans.
        evaluate: the user's score of a model, higher is better (metric ``evaluate``).
        quiet: no progress bar.

    Returns:
        The chosen QDQ model, its calibrated plan (for the passes after this one) and the report.
    """
    if mp.metric is SensitivityMetric.EVALUATE and evaluate is None:
        raise ConfigError("evaluate: metric 'evaluate' needs an evaluate(model) -> score function")
    feeds = prepare_batches(batches, mp.num_samples)
    float_model = calibrated.model
    graph = plan_graph(float_model)
    weights = {slot.node: slot for slot in calibrated.plan.weights}
    op_types = {name: slot.op_type for name, slot in weights.items()}
    options = writer_options or WriterOptions()
    cache: dict[tuple[tuple[str, str], ...], Candidate] = {}

    def build(assignment: Mapping[str, PrecisionTarget]) -> Candidate:
        key = tuple(sorted((name, t.value) for name, t in assignment.items()))
        if key not in cache:
            plan = plan_quantization(
                graph, raised_config(config, assignment, op_types), share_concat_scales=share_concat_scales
            )
            candidate = calibrated.replan(plan)
            cache.clear()  # one model at a time: they are as big as the network
            cache[key] = (write_qdq_with_notes(candidate, options), candidate)
        return cache[key]

    outputs = [o.name for o in float_model.graph.output]
    reference = TensorCapture(float_model, outputs).collect(feeds)
    float_outputs = [reference[n] for n in outputs]

    def score(candidate: Candidate) -> float:
        model = candidate[0].model
        if mp.metric is SensitivityMetric.EVALUATE:
            assert evaluate is not None
            return float(evaluate(model))
        return _output_sqnr(float_outputs, model, feeds)

    sizes = {name: float(_weight_size(calibrated, slot.tensor)) for name, slot in weights.items()}
    bits = {name: slot.spec.dtype.bits for name, slot in weights.items()}
    base = build({})[0].model
    total = float(sum(t.ByteSize() for t in base.graph.initializer))
    (written, chosen), report = run_mixed_precision(
        list(weights), build, score, mp, sizes=sizes, total_size=total, base_bits=bits, quiet=quiet
    )
    domain_notes = tuple(note for note in written.notes if "com.microsoft" in note)
    if domain_notes:
        report = attrs.evolve(report, notes=domain_notes)
    return written.model, chosen, report


def _weight_size(calibrated: CalibratedModel, tensor: str) -> int:
    for initializer in calibrated.model.graph.initializer:
        if initializer.name == tensor:
            return int(np.prod(initializer.dims, dtype=np.int64))
    return 0
