"""``HistogramObserver``: a fixed-size histogram on a canonical power-of-two grid that
grows by exact rebinning, plus the exact min and max; ranges are selected from it by
percentile, entropy (KL), MSE or power-of-two MinMSE (see ``selection``)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from quant_core.errors import ConfigError, DataError
from quant_core.observer_config import HISTOGRAM_METHODS
from quant_core.observers._input import as_float_array, check_finite_range, min_max
from quant_core.observers.base import Observer, StateDict
from quant_core.observers.binning import bin_counts
from quant_core.observers.grid import MAX_ABS_OFFSET, MIN_EXPONENT, HistogramGrid, rebin
from quant_core.observers.native import native_counter
from quant_core.observers.selection import select_range
from quant_core.observers.snapshot import Histogram
from quant_core.spec import QuantSpec


class HistogramObserver(Observer):
    """Histogram of ``bins`` int64 counts (``bins`` from the spec's method config) on a
    grid of power-of-two width whose edges are integer multiples of the width; the grid
    doubles its width (merging bin pairs exactly) whenever data falls outside. The grid
    depends only on the overall min and max, so ``merge``, streaming and one pass over
    all the data give identical counts. Memory is ``bins`` counts, whatever the data.

    ``update`` rejects NaN and infinities. A backend that bins on its own device uses
    :meth:`grid_for` and :meth:`update_histogram` instead (see there).

    Example:
        >>> import numpy as np
        >>> from quant_core.observer_config import Percentile
        >>> from quant_core.spec import QuantSpec
        >>> obs = HistogramObserver(QuantSpec(dtype="int8", observer=Percentile(99.0, bins=64)))
        >>> obs.update(np.linspace(-1.0, 1.0, 1001, dtype=np.float32))
        >>> obs.update(np.array([50.0], np.float32))  # one outlier: the grid grows
        >>> obs.grid.width, int(obs.counts.sum())
        (1.0, 1002)
        >>> lo, hi = obs.range()
        >>> float(hi) < 2.0  # the 99th percentile of |x| ignores the outlier
        True
    """

    kind = "histogram"

    def __init__(self, spec: QuantSpec) -> None:
        super().__init__(spec)
        if spec.observer.method not in HISTOGRAM_METHODS:
            raise ConfigError(
                f"observer.method: {spec.observer.method!r} is not allowed for HistogramObserver; "
                f"allowed: {', '.join(sorted(HISTOGRAM_METHODS))}"
            )
        if not spec.is_quantized:
            raise ConfigError(f"dtype: {spec.dtype.value} keeps the tensor in float; it needs no observer")
        self.bins: int = spec.observer.bins  # type: ignore[union-attr]
        self.grid: HistogramGrid | None = None
        self.counts = np.zeros(self.bins, np.int64)
        self.min_val: float | None = None
        self.max_val: float | None = None
        # Ranges already selected from the current counts, by spec: a search derives the
        # same observer for many candidates, and entropy/MSE selection is the slow part.
        self._selected: dict[QuantSpec, tuple[float, float]] = {}

    @property
    def empty(self) -> bool:
        return self.min_val is None

    def update(self, x: np.ndarray) -> None:
        """Count one batch (any shape). Empty batches are ignored.

        float32 input is binned in float32 (exact; see ``binning``), float64 in
        float64; other numeric types are converted first.
        """
        a = as_float_array(x)
        if a.size == 0:
            return
        counter = native_counter()
        if counter is None:
            lo, hi = min_max(a)
            grid = self.grid_for(float(lo), float(hi))
            self._commit(grid, bin_counts(a, grid), float(lo), float(hi))
            return
        # One native pass: the range, and the counts on the current grid, which the batch
        # keeps when every value falls inside it (the common case after the first batches).
        flat = np.ascontiguousarray(a).reshape(-1)
        counts, lo_f, hi_f = counter.count(flat, self.grid)
        check_finite_range(np.asarray(lo_f), np.asarray(hi_f))
        grid = self._covering(lo_f, hi_f, MIN_EXPONENT)
        if counts is None or grid != self.grid:
            counts = bin_counts(flat, grid)
        self._commit(grid, counts, lo_f, hi_f)

    def grid_for(self, min_val: float, max_val: float) -> HistogramGrid:
        """The grid that counts for data in ``[min_val, max_val]`` must use: the
        canonical grid of everything seen plus that range (the observer is not changed).
        The first half of feeding statistics computed elsewhere, e.g. on a GPU with
        torch::

            lo, hi = (v.item() for v in torch.aminmax(x))
            grid = obs.grid_for(lo, hi)
            # float64 is always exact; float32 is exact too when grid.float32_exact
            idx = torch.floor(x.double() * grid.inv_width) - grid.offset
            counts = torch.bincount(idx.long().flatten(), minlength=grid.bins)
            obs.update_histogram(counts.cpu().numpy(), grid, lo, hi)

        ``torch.histc`` computes ``(x - min) * bins / (max - min)``, which rounds, so its
        counts do not land exactly on the grid's bins; use the formula above.
        """
        lo, hi = float(min_val), float(max_val)
        check_finite_range(np.asarray(lo), np.asarray(hi), "range")
        return self._covering(lo, hi, MIN_EXPONENT)

    def _covering(self, lo: float, hi: float, min_exponent: int) -> HistogramGrid:
        if self.min_val is not None and self.max_val is not None:
            lo, hi = min(lo, self.min_val), max(hi, self.max_val)
        grid = self.grid
        if grid is None:
            return HistogramGrid.covering(lo, hi, self.bins, min_exponent=min_exponent)
        # The common case once calibration has seen a batch or two, answered without the
        # search and with the same grid: when the grid holds the range, its minimum lies in
        # the lowest bin and every bin of it is within the offset limit, the canonical grid
        # at an exponent no finer is this one.
        if (
            min_exponent <= grid.exponent
            and grid.lower <= lo < grid.lower + grid.width
            and hi < grid.upper
            and grid.offset + grid.bins <= MAX_ABS_OFFSET
        ):
            return grid
        min_exponent = max(min_exponent, grid.exponent)
        return HistogramGrid.covering(lo, hi, self.bins, min_exponent=min_exponent)

    def update_counted(self, min_val: float, max_val: float, count_on: Callable[[HistogramGrid], np.ndarray]) -> None:
        """Fold one batch whose exact range is ``[min_val, max_val]`` and whose counts
        ``count_on(grid)`` computes elsewhere on the grid this observer picks:
        :meth:`grid_for` and :meth:`update_histogram` in one call, for a backend that
        bins on its own device and observes once per tensor and batch (the range is
        checked once, the grid chosen once). ``count_on`` counts every value of the batch,
        each in bin ``floor(x * grid.inv_width) - grid.offset``.

        Example (numpy's binning standing in for a device's):
            >>> from quant_core.observer_config import Percentile
            >>> from quant_core.spec import QuantSpec
            >>> obs = HistogramObserver(QuantSpec(dtype="int8", observer=Percentile(99.0, bins=32)))
            >>> batch = np.float32([0.0, 0.5, 3.0])
            >>> obs.update_counted(0.0, 3.0, lambda grid: bin_counts(batch, grid))
            >>> obs.grid.width, int(obs.counts.sum())
            (0.125, 3)
        """
        lo, hi = self._checked_range(min_val, max_val)
        grid = self._covering(lo, hi, MIN_EXPONENT)
        counts = self._checked_counts(count_on(grid), grid)
        self._commit(grid, counts, lo, hi)

    def update_histogram(self, counts: np.ndarray, grid: HistogramGrid, min_val: float, max_val: float) -> None:
        """Add counts computed elsewhere on ``grid`` (normally the one :meth:`grid_for`
        returned; any power-of-two grid with the observer's bin count works) for data
        whose exact range is ``[min_val, max_val]``.

        Example:
            >>> import numpy as np
            >>> from quant_core.observer_config import MSE
            >>> from quant_core.spec import QuantSpec
            >>> obs = HistogramObserver(QuantSpec(dtype="int8", observer=MSE(bins=16)))
            >>> x = np.array([-0.5, 0.25, 0.75])
            >>> grid = obs.grid_for(x.min(), x.max())
            >>> counts = np.bincount((np.floor(x * grid.inv_width) - grid.offset).astype(int), minlength=grid.bins)
            >>> obs.update_histogram(counts, grid, x.min(), x.max())
            >>> int(obs.counts.sum()), obs.min_val, obs.max_val
            (3, -0.5, 0.75)
        """
        c = self._checked_counts(counts, grid)
        lo, hi = self._checked_range(min_val, max_val)
        if not grid.contains(lo, hi):
            raise DataError(f"range: [{lo}, {hi}] lies outside the grid [{grid.lower}, {grid.upper})")
        self._absorb(c, grid, lo, hi)

    @staticmethod
    def _checked_range(min_val: float, max_val: float) -> tuple[float, float]:
        lo, hi = float(min_val), float(max_val)
        check_finite_range(np.asarray(lo), np.asarray(hi), "range")
        if not lo <= hi:
            raise DataError("range: min_val must be <= max_val")
        return lo, hi

    def _checked_counts(self, counts: np.ndarray, grid: HistogramGrid) -> np.ndarray:
        """``counts`` as int64 (never the caller's array), checked to fit ``grid``."""
        c = np.asarray(counts)
        if c.shape != (self.bins,) or grid.bins != self.bins:
            raise DataError(f"counts: shape {c.shape} on a {grid.bins}-bin grid; expected ({self.bins},)")
        if not (np.issubdtype(c.dtype, np.integer) and bool((c >= 0).all())):
            raise DataError("counts: must be non-negative integers")
        return c.astype(np.int64)

    def _absorb(self, counts: np.ndarray, grid: HistogramGrid, lo: float, hi: float) -> None:
        if not counts.any():
            return
        target = self._covering(lo, hi, grid.exponent)
        self._commit(target, rebin(counts, grid, target), lo, hi)

    def _commit(self, target: HistogramGrid, new_counts: np.ndarray, lo: float, hi: float) -> None:
        """Move the counts to ``target``, add ``new_counts`` and widen the range; called
        only once everything that can fail has succeeded, so a failed update changes
        nothing."""
        if self.grid is not None and target != self.grid:
            self.counts = rebin(self.counts, self.grid, target)
        self._selected.clear()
        self.grid = target
        self.counts += new_counts
        self.min_val = lo if self.min_val is None else min(self.min_val, lo)
        self.max_val = hi if self.max_val is None else max(self.max_val, hi)

    def merge(self, other: Observer) -> None:
        """Add another histogram observer's counts (same spec), exactly."""
        self._check_mergeable(other)
        assert isinstance(other, HistogramObserver)
        if other.grid is None or other.min_val is None or other.max_val is None:
            return
        self._absorb(other.counts, other.grid, other.min_val, other.max_val)

    def histogram(self) -> Histogram:
        """The statistic as an immutable :class:`Histogram`."""
        if self.grid is None or self.min_val is None or self.max_val is None:
            raise DataError("HistogramObserver: no data observed; call update() first")
        return Histogram(self.counts.copy(), self.grid, self.min_val, self.max_val)

    def clamped(self, lo: float, hi: float) -> Observer:
        """A copy holding :meth:`Histogram.clamped`'s counts and range."""
        copy = Observer.from_state_dict(self.state_dict())
        assert isinstance(copy, HistogramObserver)
        if self.grid is not None and self.min_val is not None and self.max_val is not None:
            clipped = self.histogram().clamped(lo, hi)
            copy.counts, copy.min_val, copy.max_val = clipped.counts, clipped.min_val, clipped.max_val
        return copy

    def range(self, spec: QuantSpec | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The range the spec's method selects (float64 scalars), selected once per spec
        until the counts change."""
        target = self.spec if spec is None else spec
        if target not in self._selected:
            self._selected[target] = select_range(self.histogram(), target)
        lo, hi = self._selected[target]
        return np.asarray(lo, np.float64), np.asarray(hi, np.float64)

    def _state(self) -> StateDict:
        grid = self.grid
        return {
            "counts": self.counts.copy(),
            "exponent": None if grid is None else grid.exponent,
            "offset": None if grid is None else grid.offset,
            "min_val": self.min_val,
            "max_val": self.max_val,
        }

    def _load_state(self, state: StateDict) -> None:
        self._selected.clear()
        counts = np.asarray(state["counts"], np.int64)
        if counts.shape != (self.bins,):
            raise DataError(f"counts: shape {counts.shape} does not match the spec's {self.bins} bins")
        self.counts = counts.copy()
        exponent, offset = state["exponent"], state["offset"]
        self.grid = (
            None if exponent is None else HistogramGrid(exponent=int(exponent), offset=int(offset), bins=self.bins)
        )
        self.min_val = None if state["min_val"] is None else float(state["min_val"])
        self.max_val = None if state["max_val"] is None else float(state["max_val"])
