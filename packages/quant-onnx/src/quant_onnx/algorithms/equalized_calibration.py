"""Activation equalization measured in the calibration pass: one float pass where the
equalization and calibration took two.

Equalization divides some activations by positive per-channel scales (its sites, and
what a scale folded into a Conv passes through) and adds ``Mul`` nodes whose outputs hold
such a tensor times a per-channel factor; every other activation keeps its values. Under
min-max observers the range of a tensor scaled per channel follows exactly from its
per-channel ranges: ``min_c(low_c * f_c)``, ``max_c(high_c * f_c)``. So one pass over the
float model keeps each observed tensor's range, the per-channel ranges of every tensor an
equalization may scale, and the analytic bias correction's input means; the equalization
is decided from them, and the equalized model's observers are filled without running it
(PP-OCRv4's recogniser at ``a8w8``: 2.11x -> 1.38x the time of the preset without
its algorithms; ``docs/benchmarks.md``).

Where the equalized plan observes any other way (percentile, MSE, moving averages, per
channel), or observes a tensor this pass did not keep, the caller calibrates the equalized
model as before (:attr:`EqualizedCalibration.calibrated` is ``None`` and ``reason`` says
why).

Example:
    See ``tests/test_algorithms_equalized_calibration.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any

import attrs
import numpy as np
import onnx

from quant_algos.drivers.activation_equalization import (
    ActivationEqualizationReport,
    EqualizationCandidates,
    equalization_candidates,
    equalize,
)
from quant_core.algorithm_config import ActivationEqualizationConfig, samples_to_use
from quant_core.config import QuantConfig
from quant_core.errors import DataError
from quant_core.observers.minmax import MinMaxObserver
from quant_core.onnx_qdq.graph import GraphIndex, plan_graph
from quant_core.plan import QuantPlan, fresh_observers, observer_feeds
from quant_core.spec import QuantSpec
from quant_onnx.algorithms.activation_equalization import TensorSource, write_equalization
from quant_onnx.algorithms.layerwise import input_mean_request
from quant_onnx.pipeline.calibrate import (
    CalibratedModel,
    FirstSamples,
    InputMeans,
    MeansTaken,
    from_filled_observers,
    observe_tensors,
)

__all__ = [
    "EqualizationMeasures",
    "EqualizationPass",
    "EqualizedCalibration",
    "calibrate_with_equalization",
    "equalization_pass",
    "equalized_calibration",
    "measure_equalization",
    "one_pass_observers",
]

_RANGE_KEY = "range of "
_CHANNELS_KEY = "channel ranges of "
MEASURED = "measured in the calibration pass"
NOTE = f"{MEASURED}; the equalized model's ranges follow from per-channel ranges"


def one_pass_observers(plan: QuantPlan) -> bool:
    """Whether every observer of ``plan`` keeps only a per-tensor min and max (min-max or a
    fixed range), the case where the equalized model's ranges follow from per-channel ones."""
    return all(_follows(observer) for observer in fresh_observers(plan).values())


def _follows(observer: object) -> bool:
    return isinstance(observer, MinMaxObserver) and observer.spec.per_channel_axis is None


class _ChannelRanges:
    """Per-channel (axis 1) min and max of a tensor over every sample, and over the batches
    ``window`` marks as the first samples (what the equalization itself measures)."""

    def __init__(self, window: FirstSamples) -> None:
        self.window = window
        self.all: tuple[np.ndarray, np.ndarray] | None = None
        self.first: tuple[np.ndarray, np.ndarray] | None = None

    def update(self, value: np.ndarray) -> None:
        a = np.asarray(value)
        if a.ndim < 2:
            raise DataError(f"shape {list(a.shape)} has no channel axis")
        if a.size == 0:  # as the observers do: an empty batch adds nothing
            return
        rows = a.reshape(a.shape[0], a.shape[1], -1)
        lows, highs = rows.min(axis=2), rows.max(axis=2)  # [rows, channels]
        if not (np.isfinite(lows).all() and np.isfinite(highs).all()):
            raise DataError("contains NaN or Inf")
        self.all = _folded(self.all, lows, highs)
        if self.window.inside:
            self.first = _folded(self.first, lows, highs)


def _folded(
    known: tuple[np.ndarray, np.ndarray] | None, lows: np.ndarray, highs: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    low, high = lows.min(axis=0).astype(np.float64), highs.max(axis=0).astype(np.float64)
    return (low, high) if known is None else (np.minimum(known[0], low), np.maximum(known[1], high))


@attrs.frozen(eq=False)
class EqualizedCalibration:
    """The equalized float model, the equalization's report, and its calibration when it
    followed from the one pass (``None``: calibrate ``model``; ``reason`` says why)."""

    model: onnx.ModelProto
    report: ActivationEqualizationReport
    calibrated: CalibratedModel | None
    reason: str | None = None


@attrs.frozen(eq=False)
class EqualizationPass:
    """What the one pass over a float model measures for a plan and config: each tensor of
    ``ranges`` its range, each of ``channels`` its per-channel ranges (and those over the
    first ``window`` samples, which the equalization reads), the analytic bias correction's
    ``means`` (a request, or ``None``). The float model's outputs in the pass are these
    tensors, which decide its runs and values (onnxruntime fuses around what is not an
    output), so two passes with equal :meth:`key` on the same float model measure the same,
    bit for bit (the search shares one between candidates)."""

    candidates: EqualizationCandidates
    window: int
    channels: tuple[str, ...]
    ranges: tuple[str, ...]
    means: InputMeans | None

    def key(self) -> Hashable:
        means = None if self.means is None else (self.means.samples, tuple(self.means.conv.items()))
        return self.window, self.channels, self.ranges, means


@attrs.frozen(eq=False)
class EqualizationMeasures:
    """What an :class:`EqualizationPass` measured (read, never changed, by
    :func:`equalized_calibration`)."""

    channels: Mapping[str, _ChannelRanges]
    ranges: Mapping[str, MinMaxObserver]
    means: InputMeans | None


def equalization_pass(
    model: onnx.ModelProto, plan: QuantPlan, config: QuantConfig, algorithm: ActivationEqualizationConfig
) -> EqualizationPass:
    """The one pass :func:`calibrate_with_equalization` makes over ``model`` (pre-processed
    float model, planned as ``plan`` under ``config``)."""
    index = GraphIndex(model.graph)
    candidates = equalization_candidates(
        plan_graph(model, index), config, lambda name: index.initializer_proto(name) is not None
    )
    channels = tuple(dict.fromkeys(candidates.channel_tensors()))
    ranges = tuple(t for t in observer_feeds(plan) if t not in channels)
    return EqualizationPass(candidates, samples_to_use(algorithm), channels, ranges, input_mean_request(model, config))


def measure_equalization(
    model: onnx.ModelProto,
    request: EqualizationPass,
    batches: Iterable[Mapping[str, np.ndarray]],
    *,
    total_batches: int | None = None,
    quiet: bool = False,
) -> EqualizationMeasures:
    """``request``'s pass over ``batches`` through ``model``."""
    window = FirstSamples(request.window)
    channels = {t: _ChannelRanges(window) for t in request.channels}
    ranges = {t: MinMaxObserver(QuantSpec(dtype="int8")) for t in request.ranges}
    means = MeansTaken(request.means)
    feeds_of: dict[str, list[str]] = {t: [_RANGE_KEY + t] for t in ranges}
    for t in channels:
        feeds_of.setdefault(t, []).append(_CHANNELS_KEY + t)
    for t, key in means.keys.items():
        feeds_of.setdefault(t, []).append(key)
    filled: dict[str, Any] = {
        **{_RANGE_KEY + t: o for t, o in ranges.items()},
        **{_CHANNELS_KEY + t: c for t, c in channels.items()},
        **means.accumulators,
    }
    observe_tensors(
        model, feeds_of, filled, means.marked(window.marked(batches)), total_batches=total_batches, quiet=quiet
    )
    return EqualizationMeasures(channels, ranges, means.result())


def equalized_calibration(
    model: onnx.ModelProto,
    config: QuantConfig,
    request: EqualizationPass,
    measures: EqualizationMeasures,
    plan_of: Callable[[onnx.ModelProto], QuantPlan],
) -> EqualizedCalibration:
    """The equalization of ``model`` decided from ``measures`` (of ``request``'s pass), the
    equalized model and its calibration followed from the same measures. ``plan_of`` plans
    the equalized model as the quantizer does."""
    channels, ranges = measures.channels, measures.ranges
    equalization = equalize(request.candidates, lambda tensors: {t: _measured(channels[t].first) for t in tensors})
    equalized, sources = write_equalization(model, equalization)
    equalized_plan = plan_of(equalized)
    observers, reason = _followed_observers(equalized, equalized_plan, sources, ranges, channels)
    note = NOTE if reason is None else f"{MEASURED}; the equalized model is calibrated again: {reason}"
    report = attrs.evolve(equalization.report, notes=(*equalization.report.notes, note))
    if observers is None:
        return EqualizedCalibration(equalized, report, None, reason)
    calibrated = from_filled_observers(equalized, equalized_plan, observers)
    if measures.means is not None:
        calibrated = calibrated.evolve(input_means=_followed_means(equalized, config, measures.means, sources))
    return EqualizedCalibration(equalized, report, calibrated)


def calibrate_with_equalization(
    model: onnx.ModelProto,
    plan: QuantPlan,
    config: QuantConfig,
    algorithm: ActivationEqualizationConfig,
    batches: Iterable[Mapping[str, np.ndarray]],
    plan_of: Callable[[onnx.ModelProto], QuantPlan],
    *,
    total_batches: int | None = None,
    quiet: bool = False,
) -> EqualizedCalibration:
    """Equalize ``model`` (pre-processed float model, planned as ``plan`` under ``config``)
    and calibrate the result, in one pass over ``batches``. ``plan_of`` plans the equalized
    model as the quantizer does."""
    request = equalization_pass(model, plan, config, algorithm)
    measures = measure_equalization(model, request, batches, total_batches=total_batches, quiet=quiet)
    return equalized_calibration(model, config, request, measures, plan_of)


def _measured(value: tuple[np.ndarray, np.ndarray] | None) -> tuple[np.ndarray, np.ndarray]:
    if value is None:
        raise DataError("calibration data: no samples")
    return value


def _followed_observers(
    model: onnx.ModelProto,
    plan: QuantPlan,
    sources: Mapping[str, TensorSource],
    ranges: Mapping[str, MinMaxObserver],
    channels: Mapping[str, _ChannelRanges],
) -> tuple[dict[str, Any] | None, str | None]:
    """The equalized plan's observers, filled from the one pass's ranges, or ``None`` and
    why they cannot be."""
    observers = fresh_observers(plan)
    unfit = sorted(key for key, observer in observers.items() if not _follows(observer))
    if unfit:
        return None, f"{unfit[0]} observes otherwise than by min and max"
    index = GraphIndex(model.graph)
    for tensor, keys in observer_feeds(plan).items():
        constant = index.constant(tensor)
        for key in keys:
            observer = observers[key]
            if constant is not None:
                observer.update(constant)
                continue
            found = _range_of(tensor, sources, ranges, channels)
            if found is None:
                return None, f"{tensor} was not observed in the pass"
            assert isinstance(observer, MinMaxObserver)  # every observer follows (checked above)
            observer.update_range(*found)
    return observers, None


def _range_of(
    tensor: str,
    sources: Mapping[str, TensorSource],
    ranges: Mapping[str, MinMaxObserver],
    channels: Mapping[str, _ChannelRanges],
) -> tuple[float, float] | None:
    source, factor = sources.get(tensor, (tensor, None))
    per_channel = channels.get(source)
    if per_channel is not None and per_channel.all is not None:
        low, high = per_channel.all
        if factor is not None:  # positive factors: each channel's bounds scale in place
            low, high = low * factor, high * factor
        return float(low.min()), float(high.max())
    observed = ranges.get(source)
    if factor is not None or observed is None or observed.empty:
        return None
    low, high = observed.range()
    return float(low), float(high)


def _followed_means(
    model: onnx.ModelProto, config: QuantConfig, found: InputMeans, sources: Mapping[str, TensorSource]
) -> InputMeans | None:
    """The equalized model's input means for the analytic correction, from the float
    model's: a tensor scaled per channel has its mean map scaled alike. A request the
    float means cannot answer is left out (the correction measures it itself)."""
    request = input_mean_request(model, config)
    if request is None:
        return None
    values: dict[str, np.ndarray] = {}
    for tensor, conv in request.conv.items():
        source, factor = sources.get(tensor, (tensor, None))
        mean = found.of(source, conv, found.samples)
        if mean is None or (factor is not None and not conv):
            continue
        values[tensor] = mean if factor is None else mean * factor.reshape(-1, *([1] * (mean.ndim - 1)))
    return InputMeans(found.samples, request.conv, values)
