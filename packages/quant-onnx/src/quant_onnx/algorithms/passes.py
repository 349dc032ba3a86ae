"""Run the accuracy-recovery algorithms a :class:`~quant_core.config.QuantConfig` asks
for, in a fixed order, so that the quantizer needs two calls:

- :func:`run_pre_passes` on the pre-processed float model, before calibration (CLE,
  SmoothQuant);
- :func:`run_post_passes` on the written QDQ model and the calibrated plan it came from
  (mixed precision, which hands on the plan it chose, GPTQ, AdaRound, AdaQuant, bias
  correction).

The order is :func:`quant_algos.drivers.schedule.schedule`'s, the same on both backends.

Each returns the new model and a JSON-ready report per algorithm kind.

Example:
    >>> import numpy as np
    >>> from onnx import TensorProto, helper
    >>> from quant_core.presets import get_preset
    >>> g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="r")], "g",
    ...     [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
    ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])])
    >>> result = run_pre_passes(helper.make_model(g), get_preset("xint8"), None)
    >>> result.reports
    {}
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs
import onnx

from quant_algos.drivers.schedule import schedule
from quant_core.algorithm_config import (
    ActivationEqualizationConfig,
    AdaQuantConfig,
    AdaRoundConfig,
    BiasCorrectionConfig,
    CLEConfig,
    GPTQConfig,
    MixedPrecisionConfig,
    SmoothQuantConfig,
    samples_to_use,
)
from quant_core.config import QuantConfig
from quant_core.errors import DataError
from quant_onnx.algorithms.activation_equalization import apply_activation_equalization_with_report
from quant_onnx.algorithms.capture import Feeds, count_samples, prepare_batches
from quant_onnx.algorithms.cle import apply_cle
from quant_onnx.algorithms.layerwise import apply_bias_correction, apply_reconstruction
from quant_onnx.algorithms.mixed_precision import EvaluateFn, apply_mixed_precision
from quant_onnx.algorithms.smoothquant import apply_smoothquant_with_report
from quant_onnx.pipeline.calibrate import CalibratedModel
from quant_onnx.pipeline.qdq_writer import WriterOptions


@attrs.frozen(eq=False)
class PassesResult:
    """The model after the passes, a report per algorithm kind that ran, and (post-passes)
    the calibrated plan the model now follows (mixed precision changes it).

    Example:
        >>> PassesResult(onnx.ModelProto(), {}).reports
        {}
    """

    model: onnx.ModelProto
    reports: dict[str, Any]
    calibrated: CalibratedModel | None = None


def _reusable(batches: Iterable[Feeds] | None, needed: bool, what: str) -> list[dict] | None:
    """The batches as a list (each pass reads them several times)."""
    if batches is None:
        if needed:
            raise DataError(f"calibration data: {what} needs calibration batches")
        return None
    return prepare_batches(batches)


def run_pre_passes(
    model: onnx.ModelProto, config: QuantConfig, batches: Iterable[Feeds] | None, *, quiet: bool = False
) -> PassesResult:
    """CLE, activation equalization and SmoothQuant as configured in ``config.algorithms``,
    in the order :func:`quant_algos.drivers.schedule.schedule` gives."""
    reports: dict[str, Any] = {}
    scheduled = schedule(config).before_calibration
    measured = [a.kind for a in scheduled if a.kind != CLEConfig.kind]
    feeds = _reusable(batches, bool(measured), ", ".join(measured))
    for algorithm in scheduled:
        if isinstance(algorithm, ActivationEqualizationConfig):
            model, eq_report = apply_activation_equalization_with_report(model, feeds or [], algorithm, config)
            reports[algorithm.kind] = eq_report.to_dict()
        elif isinstance(algorithm, CLEConfig):
            model, report = apply_cle(model, algorithm, feeds)
            reports["cle"] = report.to_dict()
        elif isinstance(algorithm, SmoothQuantConfig):
            model, sq_report = apply_smoothquant_with_report(model, feeds or [], algorithm)
            reports["smoothquant"] = sq_report.to_dict()
    return PassesResult(model, reports)


def run_post_passes(
    calibrated: CalibratedModel,
    qdq_model: onnx.ModelProto,
    config: QuantConfig,
    batches: Iterable[Feeds] | None,
    *,
    writer_options: WriterOptions | None = None,
    share_concat_scales: bool = True,
    evaluate: EvaluateFn | None = None,
    quiet: bool = False,
) -> PassesResult:
    """Mixed precision, GPTQ, AdaRound, AdaQuant and bias correction as configured.

    Args:
        calibrated: the calibrated plan ``qdq_model`` was written from (float model after
            the pre-passes, qparams, observers): every pass takes its qparams from here.
        qdq_model: the quantizer's QDQ model.
        config: the quantization config (its ``algorithms``).
        batches: calibration feeds (needed by every post-pass).
        writer_options, share_concat_scales: how the quantizer writes and plans (mixed
            precision writes its candidates the same way).
        evaluate: the user's score for mixed precision's ``evaluate`` metric.
        quiet: no progress bars.
    """
    reports: dict[str, Any] = {}
    scheduled = schedule(config).after_calibration
    feeds = _reusable(batches, bool(scheduled), ", ".join(a.kind for a in scheduled))
    model = qdq_model
    learned = False  # a reconstruction pass has written the weight codes
    for algorithm in scheduled:
        assert feeds is not None
        if isinstance(algorithm, MixedPrecisionConfig):
            model, calibrated, mp_report = apply_mixed_precision(
                calibrated,
                config,
                feeds,
                algorithm,
                writer_options=writer_options,
                share_concat_scales=share_concat_scales,
                evaluate=evaluate,
                quiet=quiet,
            )
            reports["mixed_precision"] = mp_report.to_dict()
        elif isinstance(algorithm, (AdaRoundConfig, AdaQuantConfig, GPTQConfig)):
            model, rec_report = apply_reconstruction(
                calibrated, model, feeds, algorithm, learned_codes=learned, quiet=quiet
            )
            reports[algorithm.kind] = rec_report.to_dict()
            learned = True
        elif isinstance(algorithm, BiasCorrectionConfig):
            model, notes = apply_bias_correction(
                calibrated, model, feeds, algorithm, learned_codes=learned, quiet=quiet
            )
            used = min(samples_to_use(algorithm), count_samples(feeds))  # what it read, not what it may
            reports["bias_correction"] = {"num_samples": used, "notes": notes}
    return PassesResult(model, reports, calibrated)
