"""The histogram observer's canonical grid and exact rebinning.

A grid of ``bins`` bins has width ``2**exponent`` and covers
``[offset * width, (offset + bins) * width)``. Edges are integer multiples of a power
of two, so every edge of a grid is also an edge of each finer grid: doubling the width
merges adjacent bin pairs exactly, and two histograms always meet on a common grid
without interpolation.

The grid for a set of values is a function of their overall min and max only (the
smallest exponent that covers them, with ``offset = floor(min / width)``). Growing the
grid as batches arrive therefore reaches the same grid, and the same counts, as one
pass over all the data, in any order or split: merging is exact.
"""

from __future__ import annotations

import math

import attrs
import numpy as np

from quant_core.errors import DataError

# Bins narrower than the smallest float32 subnormal separate nothing.
MIN_EXPONENT = -149
# |offset| <= 2**24 keeps every offset exact in float32, which lets the fast binning
# path subtract it in float32 without rounding (see ``binning``).
MAX_ABS_OFFSET = 1 << 24


def floor_div_pow2(value: float, exponent: int) -> int:
    """``floor(value / 2**exponent)`` computed exactly in integers (a float division
    could underflow to -0.0 and put a tiny negative value in bin 0)."""
    numerator, denominator = float(value).as_integer_ratio()  # denominator: a power of 2
    if exponent >= 0:
        return numerator // (denominator << exponent)
    return (numerator << -exponent) // denominator


@attrs.frozen
class HistogramGrid:
    """Bin layout of a histogram: ``bins`` bins of width ``2**exponent`` starting at
    ``offset * 2**exponent``.

    A backend that bins on its own device computes a value's bin as
    ``floor(x * inv_width) - offset`` (exact in float64; exact in float32 too when
    :attr:`float32_exact`).

    Example:
        >>> g = HistogramGrid.covering(-1.0, 2.9, bins=16)
        >>> g.width, g.lower, g.upper
        (0.25, -1.0, 3.0)
        >>> g.contains(-1.0, 2.99), g.contains(-1.0, 3.0)
        (True, False)
    """

    exponent: int
    offset: int
    bins: int

    @property
    def width(self) -> float:
        return math.ldexp(1.0, self.exponent)

    @property
    def inv_width(self) -> float:
        return math.ldexp(1.0, -self.exponent)

    @property
    def lower(self) -> float:
        return math.ldexp(float(self.offset), self.exponent)

    @property
    def upper(self) -> float:
        return math.ldexp(float(self.offset + self.bins), self.exponent)

    @property
    def float32_exact(self) -> bool:
        """Whether ``floor(x * inv_width) - offset`` is exact in float32 arithmetic:
        ``inv_width`` is a float32 and scaling cannot underflow (width <= 1)."""
        return -127 <= self.exponent <= 0

    def edges(self) -> np.ndarray:
        """The ``bins + 1`` bin edges as float64 (exact)."""
        return np.ldexp(np.arange(self.offset, self.offset + self.bins + 1, dtype=np.float64), self.exponent)

    def contains(self, lo: float, hi: float) -> bool:
        """Whether ``[lo, hi]`` lies inside ``[lower, upper)``."""
        return floor_div_pow2(lo, self.exponent) >= self.offset and floor_div_pow2(hi, self.exponent) < (
            self.offset + self.bins
        )

    @staticmethod
    def covering(lo: float, hi: float, bins: int, min_exponent: int = MIN_EXPONENT) -> HistogramGrid:
        """The canonical grid of ``[lo, hi]``: the smallest exponent ``>= min_exponent``
        whose grid holds both ends with ``|floor(lo / w)|`` and ``|floor(hi / w)|`` at most
        2**24; ``offset = floor(lo / w)``. Monotone: a wider range never gets a smaller
        exponent, which is what makes the counts independent of how the data is split
        into batches and merged (a limit on the offset alone is not monotone: widening a
        narrow range far from zero towards zero can lower ``|offset|``)."""
        if not lo <= hi:
            raise DataError(f"range: lo={lo!r} must be <= hi={hi!r}")
        span = hi - lo
        magnitude = max(abs(lo), abs(hi))
        # Start just below the answer; the loop below only ever steps a few times.
        guess = min_exponent
        if span / bins > 0:  # a subnormal span divided by bins can underflow to 0: no guess then
            guess = max(guess, math.frexp(span / bins)[1] - 2)
        if magnitude > 0:
            guess = max(guess, math.frexp(magnitude)[1] - 26)
        e = guess
        while True:
            k, top = floor_div_pow2(lo, e), floor_div_pow2(hi, e)
            if top - k < bins and max(abs(k), abs(top)) <= MAX_ABS_OFFSET:
                return HistogramGrid(exponent=e, offset=k, bins=bins)
            e += 1

    def coarsened(self, exponent: int) -> HistogramGrid:
        """This grid's bins merged ``2**(exponent - self.exponent)`` at a time (same
        bin count, offset rounded down), which holds everything this grid holds only
        when the caller has checked it; see :func:`rebin`."""
        shift = exponent - self.exponent
        if shift < 0:
            raise DataError(f"exponent: {exponent} is finer than the grid's {self.exponent}; grids only coarsen")
        return HistogramGrid(exponent=exponent, offset=self.offset >> shift, bins=self.bins)


def rebin(counts: np.ndarray, source: HistogramGrid, target: HistogramGrid) -> np.ndarray:
    """Counts on ``source`` moved exactly onto the coarser ``target`` (int64).

    Raises DataError when a non-empty source bin falls outside ``target``.

    Example:
        >>> src = HistogramGrid(exponent=0, offset=-2, bins=4)
        >>> rebin(np.array([1, 2, 3, 4]), src, HistogramGrid(exponent=1, offset=-1, bins=4)).tolist()
        [3, 7, 0, 0]
    """
    shift = target.exponent - source.exponent
    if shift < 0:
        raise DataError(f"exponent: target {target.exponent} is finer than source {source.exponent}")
    counts = np.asarray(counts, np.int64)
    if source == target:  # the common case in calibration: nothing to move
        if counts.shape != (target.bins,):
            raise DataError(f"counts: shape {counts.shape} does not match the grid's {target.bins} bins")
        return counts.copy()
    out = np.zeros(target.bins, np.int64)
    nonzero = np.flatnonzero(counts)
    if nonzero.size == 0:
        return out
    # Global bin index g = offset + i becomes g >> shift (floor division by 2**shift);
    # |g| < 2**25, so shifting by more than 62 gives the same 0 or -1 and stays defined.
    index = ((nonzero + source.offset) >> min(shift, 62)) - target.offset
    if index[0] < 0 or index[-1] >= target.bins:
        raise DataError("histogram: counts fall outside the target grid")
    # ``index`` is sorted, so runs of equal targets can be summed in int64 exactly.
    starts = np.flatnonzero(np.diff(index, prepend=-1))
    out[index[starts]] = np.add.reduceat(counts[nonzero], starts)
    return out


def work_dtype(dtype: np.dtype, grid: HistogramGrid) -> type[np.floating]:
    """The float type data of ``dtype`` is binned in on ``grid``, by numpy's passes
    (:func:`quant_core.observers.binning.bin_counts`) and by the native count alike: float32
    for float32 data (``2**-e`` is then an exact, possibly subnormal, float32), float64
    otherwise.

    Example:
        >>> work_dtype(np.dtype(np.float32), HistogramGrid(exponent=-7, offset=0, bins=16)).__name__
        'float32'
    """
    return np.float32 if dtype == np.float32 and -127 <= grid.exponent <= 149 else np.float64
