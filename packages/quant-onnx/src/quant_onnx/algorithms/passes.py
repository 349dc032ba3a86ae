"""Run the accuracy-recovery algorithms a :class:`~quant_core.config.QuantConfig` asks
for, in a fixed order, so that the quantizer needs two calls:

- :func:`run_pre_passes` on the pre-processed float model, before calibration:
  CLE, then SmoothQuant (SmoothQuant measures the activations of the equalized model).
- :func:`run_post_passes` on the written QDQ model and the calibrated plan it came from:
  mixed precision first (it chooses the formats and hands on the plan it chose), then
  AdaRound, AdaQuant, and bias correction last (it removes the mean error the others
  leave).

Each returns the new model and a JSON-ready report per algorithm kind.

Example:
    >>> import numpy as np
    >>> from onnx import TensorProto, helper
    >>> from quant_core.presets import get_preset
    >>> g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="r")], "g",
    ...     [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
    ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])])
    >>> result = run_pre_passes(helper.make_model(g), get_preset("a8w8"), None)
    >>> result.reports
    {}
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs
import onnx

from quant_core.algorithm_config import (
    AdaQuantConfig,
    AdaRoundConfig,
    BiasCorrectionConfig,
    CLEConfig,
    MixedPrecisionConfig,
    SmoothQuantConfig,
    samples_to_use,
)
from quant_core.config import QuantConfig
from quant_onnx.algorithms.capture import Feeds, prepare_batches
from quant_onnx.algorithms.cle import apply_cle
from quant_onnx.algorithms.layerwise import apply_bias_correction, apply_reconstruction
from quant_onnx.algorithms.mixed_precision import EvaluateFn, apply_mixed_precision
from quant_onnx.algorithms.smoothquant import apply_smoothquant_with_report
from quant_onnx.pipeline.calibrate import CalibratedModel
from quant_onnx.pipeline.qdq_writer import WriterOptions

PRE_PASSES = ("cle", "smoothquant")
POST_PASSES = ("mixed_precision", "adaround", "adaquant", "bias_correction")


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


def _configured(config: QuantConfig, kind: str) -> list[Any]:
    return [a for a in config.algorithms if type(a).kind == kind]


def _reusable(batches: Iterable[Feeds] | None, needed: bool, what: str) -> list[dict] | None:
    """The batches as a list (each pass reads them several times)."""
    if batches is None:
        if needed:
            raise ValueError(f"calibration data: {what} needs calibration batches")
        return None
    return prepare_batches(batches)


def run_pre_passes(
    model: onnx.ModelProto, config: QuantConfig, batches: Iterable[Feeds] | None, *, quiet: bool = False
) -> PassesResult:
    """CLE and SmoothQuant as configured in ``config.algorithms`` (each at most once)."""
    reports: dict[str, Any] = {}
    smooth = _configured(config, SmoothQuantConfig.kind)
    feeds = _reusable(batches, bool(smooth), "SmoothQuant")
    for cle in _configured(config, CLEConfig.kind):
        model, report = apply_cle(model, cle, feeds)
        reports["cle"] = report.to_dict()
    for sq in smooth:
        model, sq_report = apply_smoothquant_with_report(model, feeds or [], sq)
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
    """Mixed precision, AdaRound, AdaQuant and bias correction as configured.

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
    kinds = [type(a).kind for a in config.algorithms if type(a).kind in POST_PASSES]
    feeds = _reusable(batches, bool(kinds), ", ".join(kinds))
    model = qdq_model
    for mp in _configured(config, MixedPrecisionConfig.kind):
        assert feeds is not None
        model, calibrated, mp_report = apply_mixed_precision(
            calibrated,
            config,
            feeds,
            mp,
            writer_options=writer_options,
            share_concat_scales=share_concat_scales,
            evaluate=evaluate,
            quiet=quiet,
        )
        reports["mixed_precision"] = mp_report.to_dict()
    for kind, cls in (("adaround", AdaRoundConfig), ("adaquant", AdaQuantConfig)):
        for cfg in _configured(config, cls.kind):
            assert feeds is not None
            model, rec_report = apply_reconstruction(calibrated, model, feeds, cfg, quiet=quiet)
            reports[kind] = rec_report.to_dict()
    for bc in _configured(config, BiasCorrectionConfig.kind):
        assert feeds is not None
        model, notes = apply_bias_correction(calibrated, model, feeds, bc, quiet=quiet)
        reports["bias_correction"] = {"num_samples": samples_to_use(bc), "notes": notes}
    return PassesResult(model, reports, calibrated)
