"""``make_observer``: the observer a spec asks for."""

from __future__ import annotations

from quant_core.errors import ConfigError
from quant_core.observer_config import HISTOGRAM_METHODS, FixedRange, MovingAverageMinMax
from quant_core.observers.base import Observer
from quant_core.observers.histogram import HistogramObserver
from quant_core.observers.minmax import FixedRangeObserver, MinMaxObserver, MovingAverageMinMaxObserver
from quant_core.spec import QuantSpec


def make_observer(spec: QuantSpec) -> Observer:
    """A fresh observer for ``spec``: dynamic specs and ``minmax`` get a
    :class:`MinMaxObserver` (per channel when the spec is), ``moving_average`` a
    :class:`MovingAverageMinMaxObserver`, ``fixed_range`` a :class:`FixedRangeObserver`,
    histogram methods a :class:`HistogramObserver`.

    Example:
        >>> from quant_core.observer_config import Entropy
        >>> type(make_observer(QuantSpec(dtype="int8", observer=Entropy()))).__name__
        'HistogramObserver'
        >>> make_observer(QuantSpec(dtype="fp16"))
        Traceback (most recent call last):
        ...
        quant_core.errors.ConfigError: dtype: fp16 keeps the tensor in float; it needs no observer
    """
    if not spec.is_quantized:
        raise ConfigError(f"dtype: {spec.dtype.value} keeps the tensor in float; it needs no observer")
    if spec.dynamic:
        return MinMaxObserver(spec)
    if isinstance(spec.observer, MovingAverageMinMax):
        return MovingAverageMinMaxObserver(spec)
    if isinstance(spec.observer, FixedRange):
        return FixedRangeObserver(spec)
    if spec.observer.method in HISTOGRAM_METHODS:
        return HistogramObserver(spec)
    return MinMaxObserver(spec)
