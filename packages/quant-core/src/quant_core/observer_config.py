"""Typed calibration-method settings: which statistic an observer keeps and how it
turns that statistic into a range.

Each class is one method; its ``method`` tag names it in JSON. They are frozen and
validated at construction, so a wrong value fails where it is written, naming the
field and the allowed values.

Example:
    >>> from quant_core.observer_config import Percentile
    >>> Percentile(percentile=99.99).percentile
    99.99
    >>> Percentile(percentile=120)
    Traceback (most recent call last):
    ...
    quant_core.errors.ConfigError: percentile: 120 is out of range; allowed: 50 < percentile <= 100
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import attrs

from quant_core.errors import ConfigError

#: The largest finite float32: a range end beyond it has no float32 scale.
FLOAT32_MAX = 3.4028234663852886e38


def _check(cond: bool, field: str, value: Any, allowed: str) -> None:
    if not cond:
        raise ConfigError(f"{field}: {value!r} is out of range; allowed: {allowed}")


def _number(value: Any) -> bool:
    """A Python ``int`` or ``float``, not a ``bool``."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_finite_number(value: Any) -> bool:
    """A finite Python ``int`` or ``float``, not a ``bool`` (what a config file can hold:
    a string, a numpy scalar or an infinity would be accepted here and fail when saved).
    An integer beyond float's range is not one: no float field can hold it."""
    if not _number(value):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large to convert to a float
        return False


def _float_if_number(value: Any) -> Any:
    """``float(value)`` for an ``int`` or ``float`` that has one; anything else as it is, for
    the check to refuse (``float()`` would turn a string or a bool into a number, and raise
    on an integer beyond float's range)."""
    return float(value) if is_finite_number(value) else value


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _validate_bins(_inst: Any, attribute: attrs.Attribute, value: int) -> None:  # type: ignore[type-arg]
    _check(
        _integer(value) and 16 <= value <= 1 << 16 and value % 2 == 0,
        attribute.name,
        value,
        "an even integer from 16 to 65536",
    )


@attrs.frozen
class MinMax:
    """Running minimum and maximum: exact, cheap, sensitive to outliers.

    Example:
        >>> MinMax().method
        'minmax'
    """

    method: ClassVar[str] = "minmax"


@attrs.frozen
class MovingAverageMinMax:
    """Exponential moving average of each batch's min and max (``momentum`` is the
    weight kept by the old value), as QAT frameworks use for activations.

    Args:
        momentum: weight the running range keeps at each batch (0 < momentum < 1).

    Example:
        >>> MovingAverageMinMax(momentum=0.99).momentum
        0.99
    """

    method: ClassVar[str] = "moving_average"
    momentum: float = attrs.field(default=0.9)

    @momentum.validator
    def _v(self, attribute: attrs.Attribute, value: float) -> None:  # type: ignore[type-arg]
        _check(is_finite_number(value) and 0.0 < value < 1.0, attribute.name, value, "0 < momentum < 1")


@attrs.frozen
class Percentile:
    """Histogram, then clip to the ``percentile``-th percentile of |x| (symmetric
    specs) or of each tail (asymmetric specs).

    Args:
        percentile: the percentile kept (50 < percentile <= 100: at 50 or below an
            asymmetric range's ends would cross).
        bins: histogram bins (even, 16 to 65536).

    Example:
        >>> Percentile(percentile=99.9, bins=1024).bins
        1024
    """

    method: ClassVar[str] = "percentile"
    percentile: float = attrs.field(default=99.999)
    bins: int = attrs.field(default=2048, validator=_validate_bins)

    @percentile.validator
    def _v(self, attribute: attrs.Attribute, value: float) -> None:  # type: ignore[type-arg]
        _check(is_finite_number(value) and 50.0 < value <= 100.0, attribute.name, value, "50 < percentile <= 100")


@attrs.frozen
class Entropy:
    """Histogram, then the clipping threshold minimising the KL divergence between the
    float and the quantized distribution (TensorRT's method).

    Args:
        bins: histogram bins (even, 16 to 65536).
        num_quantized_bins: bins of the quantized distribution compared with the float one.

    Example:
        >>> Entropy().num_quantized_bins
        128
    """

    method: ClassVar[str] = "entropy"
    bins: int = attrs.field(default=2048, validator=_validate_bins)
    num_quantized_bins: int = attrs.field(default=128)

    @num_quantized_bins.validator
    def _v(self, attribute: attrs.Attribute, value: int) -> None:  # type: ignore[type-arg]
        _check(_integer(value) and 2 <= value <= self.bins, attribute.name, value, "2 <= num_quantized_bins <= bins")


@attrs.frozen
class MSE:
    """Histogram, then the clipping range minimising the expected squared
    quantization error over ``num_candidates`` evenly spaced thresholds.

    Args:
        bins: histogram bins (even, 16 to 65536).
        num_candidates: thresholds tried, evenly spaced up to the observed range.

    Example:
        >>> MSE(num_candidates=50).num_candidates
        50
    """

    method: ClassVar[str] = "mse"
    bins: int = attrs.field(default=2048, validator=_validate_bins)
    num_candidates: int = attrs.field(default=100)

    @num_candidates.validator
    def _v(self, attribute: attrs.Attribute, value: int) -> None:  # type: ignore[type-arg]
        _check(_integer(value) and 2 <= value <= 10000, attribute.name, value, "2 <= num_candidates <= 10000")


@attrs.frozen
class PowerOfTwoMSE:
    """Quark's MinMSE for power-of-two scales: histogram, then try fix positions
    from ``search_below`` under to ``search_above`` over the min-max position and keep
    the one with the lowest expected squared error.

    Args:
        bins: histogram bins (even, 16 to 65536).
        search_below: positions tried below the min-max position (coarser steps, 0 to 16).
        search_above: positions tried above it (finer steps that clip, 0 to 16).

    Example:
        >>> PowerOfTwoMSE().search_above
        3
    """

    method: ClassVar[str] = "minmse_pow2"
    bins: int = attrs.field(default=2048, validator=_validate_bins)
    search_below: int = attrs.field(default=1)
    search_above: int = attrs.field(default=3)

    @search_below.validator
    def _vb(self, attribute: attrs.Attribute, value: int) -> None:  # type: ignore[type-arg]
        _check(_integer(value) and 0 <= value <= 16, attribute.name, value, "0 <= value <= 16")

    @search_above.validator
    def _va(self, attribute: attrs.Attribute, value: int) -> None:  # type: ignore[type-arg]
        _check(_integer(value) and 0 <= value <= 16, attribute.name, value, "0 <= value <= 16")


@attrs.frozen
class FixedRange:
    """A range an op guarantees by construction (softmax: ``[0, 1]``), whatever the
    calibration data holds: the tensor is still observed (for reports), its qparams come
    from ``[min_val, max_val]`` only. Per tensor; the planner's transformer recipe puts
    Softmax outputs on it (``docs/transformers.md``).

    Args:
        min_val: lower end (<= 0, so that zero is representable).
        max_val: upper end (> min_val, >= 0).

    Example:
        >>> FixedRange(0.0, 1.0).max_val
        1.0
        >>> FixedRange(0.5, 1.0)
        Traceback (most recent call last):
        ...
        quant_core.errors.ConfigError: min_val: 0.5 is out of range; allowed: min_val <= 0 <= max_val, min_val < max_val
    """

    method: ClassVar[str] = "fixed_range"
    min_val: float = attrs.field(default=0.0, converter=_float_if_number)
    max_val: float = attrs.field(default=1.0, converter=_float_if_number)

    def __attrs_post_init__(self) -> None:
        for name in ("min_val", "max_val"):
            value = getattr(self, name)
            finite = is_finite_number(value) and abs(value) <= FLOAT32_MAX
            _check(finite, name, value, "a finite number within float32's range")
        allowed = "min_val <= 0 <= max_val, min_val < max_val"
        _check(self.min_val <= 0.0 and self.min_val < self.max_val, "min_val", self.min_val, allowed)
        _check(self.max_val >= 0.0, "max_val", self.max_val, allowed)


ObserverConfig = MinMax | MovingAverageMinMax | Percentile | Entropy | MSE | PowerOfTwoMSE | FixedRange

OBSERVER_CONFIGS: dict[str, type] = {
    cls.method: cls
    for cls in (
        MinMax,
        MovingAverageMinMax,
        Percentile,
        Entropy,
        MSE,
        PowerOfTwoMSE,
        FixedRange,
    )
}

HISTOGRAM_METHODS = frozenset({"percentile", "entropy", "mse", "minmse_pow2"})


def observer_config(method: str, **params: Any) -> ObserverConfig:
    """Build an observer config from its method name (as the CLI does).

    Example:
        >>> observer_config("percentile", percentile=99.9)
        Percentile(percentile=99.9, bins=2048)
    """
    cls = OBSERVER_CONFIGS.get(method) if isinstance(method, str) else None
    if cls is None:
        raise ConfigError(f"observer.method: {method!r} is not a known method; allowed: {', '.join(OBSERVER_CONFIGS)}")
    fields = [f.name for f in attrs.fields(cls)]
    unknown = sorted(set(params) - set(fields))
    if unknown:  # cls(**params) would raise a bare TypeError
        allowed = ", ".join(fields) if fields else "none"
        raise ConfigError(f"observer.{unknown[0]}: not a parameter of {method!r}; allowed: {allowed}")
    result: ObserverConfig = cls(**params)
    return result
