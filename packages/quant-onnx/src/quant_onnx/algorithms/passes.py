"""Run the accuracy-recovery algorithms a :class:`~quant_core.config.QuantConfig` asks
for, in a fixed order, so that the quantizer needs two calls:

- :func:`run_pre_passes` on the pre-processed float model, before calibration:
  CLE, then SmoothQuant (SmoothQuant measures the activations of the equalized model).
- :func:`run_post_passes` on the written QDQ model: mixed precision first (it chooses
  the formats, so it needs the quantizer as ``quantize_fn``), then AdaRound, AdaQuant,
  and bias correction last (it removes the mean error the others leave).

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

from collections.abc import Iterable, Sequence
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
)
from quant_core.config import QuantConfig
from quant_onnx.algorithms.adaround import apply_adaquant_with_report, apply_adaround_with_report
from quant_onnx.algorithms.bias_correction import apply_bias_correction
from quant_onnx.algorithms.capture import Feeds, prepare_batches
from quant_onnx.algorithms.cle import apply_cle
from quant_onnx.algorithms.mixed_precision import EvaluateFn, QuantizeFn, apply_mixed_precision
from quant_onnx.algorithms.smoothquant import apply_smoothquant_with_report

PRE_PASSES = ("cle", "smoothquant")
POST_PASSES = ("mixed_precision", "adaround", "adaquant", "bias_correction")


@attrs.frozen(eq=False)
class PassesResult:
    """The model after the passes and a report per algorithm kind that ran.

    Example:
        >>> PassesResult(onnx.ModelProto(), {}).reports
        {}
    """

    model: onnx.ModelProto
    reports: dict[str, Any]


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
    float_model: onnx.ModelProto,
    qdq_model: onnx.ModelProto,
    config: QuantConfig,
    batches: Iterable[Feeds] | None,
    *,
    quantize_fn: QuantizeFn | None = None,
    evaluate: EvaluateFn | None = None,
    quiet: bool = False,
) -> PassesResult:
    """Mixed precision, AdaRound, AdaQuant and bias correction as configured.

    Args:
        float_model: the float model ``qdq_model`` was written from (after the pre-passes).
        qdq_model: the quantizer's QDQ model.
        config: the quantization config (its ``algorithms``).
        batches: calibration feeds (needed by every post-pass).
        quantize_fn: ``overrides -> QDQ model`` for mixed precision's final model; without
            it the search's rewrite of ``qdq_model`` is returned.
        evaluate: the user's score for mixed precision's ``evaluate`` metric.
        quiet: no progress bars.
    """
    reports: dict[str, Any] = {}
    kinds = [type(a).kind for a in config.algorithms if type(a).kind in POST_PASSES]
    feeds = _reusable(batches, bool(kinds), ", ".join(kinds))
    model = qdq_model
    for mp in _configured(config, MixedPrecisionConfig.kind):
        assert feeds is not None
        model, mp_report = apply_mixed_precision(
            float_model, quantize_fn, feeds, mp, base=model, evaluate=evaluate, quiet=quiet
        )
        reports["mixed_precision"] = mp_report.to_dict()
    steps: Sequence[tuple[str, Any]] = [
        ("adaround", apply_adaround_with_report),
        ("adaquant", apply_adaquant_with_report),
    ]
    for kind, apply in steps:
        for cfg in _configured(config, AdaRoundConfig.kind if kind == "adaround" else AdaQuantConfig.kind):
            model, rec_report = apply(float_model, model, feeds, cfg, quiet=quiet)
            reports[kind] = rec_report.to_dict()
    for bc in _configured(config, BiasCorrectionConfig.kind):
        assert feeds is not None
        model = apply_bias_correction(float_model, model, feeds, bc, quiet=quiet)
        reports["bias_correction"] = {"num_samples": bc.num_samples}
    return PassesResult(model, reports)
