"""Min-max observers: the running range of a tensor, per tensor or per channel.

Both keep one ``(min, max)`` pair (per channel: one per channel), so memory never
depends on how many batches were seen. A backend that already reduced a tensor on its
own device (``torch.aminmax``) feeds the result through ``update_range`` instead of
moving the tensor.
"""

from __future__ import annotations

import abc

import numpy as np

from quant_core.errors import ConfigError, DataError
from quant_core.observer_config import FixedRange, MinMax, MovingAverageMinMax
from quant_core.observers._input import as_float_array, check_finite_range, min_max
from quant_core.observers.base import Observer, StateDict
from quant_core.spec import QuantSpec


class _RangeObserver(Observer):
    """Shared plumbing of the min-max observers: input checks and shape bookkeeping.
    Subclasses decide how a batch's range folds into the running one."""

    def __init__(self, spec: QuantSpec) -> None:
        super().__init__(spec)
        if not spec.is_quantized:
            raise ConfigError(f"dtype: {spec.dtype.value} keeps the tensor in float; it needs no observer")
        self.min_val: np.ndarray | None = None
        self.max_val: np.ndarray | None = None

    @property
    def empty(self) -> bool:
        return self.min_val is None

    def update(self, x: np.ndarray) -> None:
        """Fold one batch in. Per channel, every axis but ``spec.per_channel_axis`` is
        reduced. Empty batches are ignored; NaN or infinite values raise DataError."""
        a = as_float_array(x)
        if a.size == 0:
            return
        lo, hi = min_max(a, self.spec.channel_axis)
        self._fold(lo, hi)

    def update_range(self, min_val: object, max_val: object) -> None:
        """Fold in a batch's range computed elsewhere (e.g. ``torch.aminmax`` on the
        GPU): scalars per tensor, one value per channel per channel.

        Example:
            >>> from quant_core.spec import QuantSpec
            >>> obs = MinMaxObserver(QuantSpec(dtype="int8", per_channel_axis=0))
            >>> obs.update_range([-1.0, -2.0], [1.0, 0.5])
            >>> obs.range()[0].tolist()
            [-1.0, -2.0]
        """
        lo = np.array(min_val, np.float64)
        hi = np.array(max_val, np.float64)
        check_finite_range(lo, hi, "range")
        expected = "scalars" if self.spec.per_channel_axis is None else "1-D arrays, one value per channel"
        if lo.shape != hi.shape or lo.ndim != (0 if self.spec.per_channel_axis is None else 1):
            raise DataError(f"range: min_val/max_val of shapes {lo.shape}/{hi.shape}; expected {expected}")
        if (lo > hi).any():
            raise DataError("range: min_val must be <= max_val")
        self._fold(lo, hi)

    def _check_channels(self, lo: np.ndarray) -> None:
        if self.min_val is not None and self.min_val.shape != lo.shape:
            raise DataError(
                f"per_channel_axis: batch has {lo.shape[0] if lo.ndim else 1} channels, "
                f"earlier batches had {self.min_val.shape[0] if self.min_val.ndim else 1}"
            )

    @abc.abstractmethod
    def _fold(self, lo: np.ndarray, hi: np.ndarray) -> None:
        """Combine one batch's checked float64 range with the running one."""

    def range(self, spec: QuantSpec | None = None) -> tuple[np.ndarray, np.ndarray]:
        if self.min_val is None or self.max_val is None:
            raise DataError(f"{type(self).__name__}: no data observed; call update() first")
        return self.min_val.copy(), self.max_val.copy()

    def clamped(self, lo: float, hi: float) -> Observer:
        copy = Observer.from_state_dict(self.state_dict())
        assert isinstance(copy, _RangeObserver)
        if copy.min_val is not None and copy.max_val is not None:
            copy.min_val, copy.max_val = np.clip(copy.min_val, lo, hi), np.clip(copy.max_val, lo, hi)
        return copy

    def _state(self) -> StateDict:
        return {
            "min_val": None if self.min_val is None else self.min_val.copy(),
            "max_val": None if self.max_val is None else self.max_val.copy(),
        }

    def _load_state(self, state: StateDict) -> None:
        lo, hi = state["min_val"], state["max_val"]
        self.min_val = None if lo is None else np.array(lo, np.float64)
        self.max_val = None if hi is None else np.array(hi, np.float64)


class MinMaxObserver(_RangeObserver):
    """Exact running minimum and maximum, per tensor or (when ``spec.per_channel_axis``
    is set) per channel. Merging is exact: ``merge(obs(a), obs(b)) == obs(a ++ b)``.

    Example:
        >>> import numpy as np
        >>> from quant_core.spec import QuantSpec
        >>> obs = MinMaxObserver(QuantSpec(dtype="int8"))
        >>> obs.update(np.array([-1.0, 0.5], np.float32))
        >>> obs.update(np.array([2.54], np.float32))
        >>> [float(v) for v in obs.range()]
        [-1.0, 2.5399999618530273]
        >>> round(float(obs.qparams().scale), 6)
        0.02
    """

    kind = "minmax"

    def __init__(self, spec: QuantSpec) -> None:
        super().__init__(spec)
        if not isinstance(spec.observer, MinMax):
            raise ConfigError(
                f"observer.method: {spec.observer.method!r} is not allowed for MinMaxObserver; allowed: minmax"
            )

    def _fold(self, lo: np.ndarray, hi: np.ndarray) -> None:
        self._check_channels(lo)
        if self.min_val is None or self.max_val is None:
            self.min_val, self.max_val = lo.copy(), hi.copy()
        else:
            self.min_val = np.minimum(self.min_val, lo)
            self.max_val = np.maximum(self.max_val, hi)

    def merge(self, other: Observer) -> None:
        self._check_mergeable(other)
        assert isinstance(other, MinMaxObserver)
        if other.min_val is not None and other.max_val is not None:
            self._fold(other.min_val, other.max_val)


class MovingAverageMinMaxObserver(_RangeObserver):
    """Exponential moving average of each batch's min and max, as QAT frameworks keep
    for activations: ``min = momentum * min + (1 - momentum) * batch_min`` (the first
    batch sets the value). Per channel when ``spec.per_channel_axis`` is set.

    ``merge`` averages two observers weighted by how many batches each saw, which is
    the plain average for data-parallel ranks that stepped together.

    Example:
        >>> import numpy as np
        >>> from quant_core.observer_config import MovingAverageMinMax
        >>> from quant_core.spec import QuantSpec
        >>> obs = MovingAverageMinMaxObserver(QuantSpec(dtype="int8", observer=MovingAverageMinMax(momentum=0.5)))
        >>> obs.update(np.array([-1.0, 1.0]))
        >>> obs.update(np.array([-3.0, 2.0]))
        >>> [float(v) for v in obs.range()]
        [-2.0, 1.5]
    """

    kind = "moving_average_minmax"

    def __init__(self, spec: QuantSpec) -> None:
        super().__init__(spec)
        if not isinstance(spec.observer, MovingAverageMinMax):
            raise ConfigError(
                f"observer.method: {spec.observer.method!r} is not allowed for "
                "MovingAverageMinMaxObserver; allowed: moving_average"
            )
        self.momentum = float(spec.observer.momentum)
        self.num_batches = 0

    def _fold(self, lo: np.ndarray, hi: np.ndarray) -> None:
        self._check_channels(lo)
        if self.min_val is None or self.max_val is None:
            self.min_val, self.max_val = lo.copy(), hi.copy()
        else:
            m = self.momentum
            self.min_val = m * self.min_val + (1.0 - m) * lo
            self.max_val = m * self.max_val + (1.0 - m) * hi
        self.num_batches += 1

    def merge(self, other: Observer) -> None:
        self._check_mergeable(other)
        assert isinstance(other, MovingAverageMinMaxObserver)
        if other.min_val is None or other.max_val is None:
            return
        if self.min_val is None or self.max_val is None:
            self._load_state(other._state())
            return
        self._check_channels(other.min_val)
        n, n_other = self.num_batches, other.num_batches
        self.min_val = (n * self.min_val + n_other * other.min_val) / (n + n_other)
        self.max_val = (n * self.max_val + n_other * other.max_val) / (n + n_other)
        self.num_batches = n + n_other

    def _state(self) -> StateDict:
        return {**super()._state(), "num_batches": self.num_batches}

    def _load_state(self, state: StateDict) -> None:
        super()._load_state(state)
        self.num_batches = int(state["num_batches"])


class FixedRangeObserver(MinMaxObserver):
    """The range of a :class:`~quant_core.observer_config.FixedRange` spec, whatever was
    observed (the observed min and max are still kept, and merge, as a min-max
    observer's). Per tensor only.

    Example:
        >>> import numpy as np
        >>> from quant_core.spec import QuantSpec
        >>> obs = FixedRangeObserver(QuantSpec(dtype="uint8", symmetric=False, observer=FixedRange(0.0, 1.0)))
        >>> obs.update(np.array([0.01, 0.2], np.float32))
        >>> [float(v) for v in obs.range()], round(float(obs.qparams().scale), 6), int(obs.qparams().zero_point)
        ([0.0, 1.0], 0.003922, 0)
    """

    kind = "fixed_range"

    def __init__(self, spec: QuantSpec) -> None:
        _RangeObserver.__init__(self, spec)
        if not isinstance(spec.observer, FixedRange):
            raise ConfigError(
                f"observer.method: {spec.observer.method!r} is not allowed for FixedRangeObserver; allowed: fixed_range"
            )

    def range(self, spec: QuantSpec | None = None) -> tuple[np.ndarray, np.ndarray]:
        super().range(spec)  # raises before the first update, like every observer
        bounds = self.spec.observer
        assert isinstance(bounds, FixedRange)
        return np.array(bounds.min_val, np.float64), np.array(bounds.max_val, np.float64)
