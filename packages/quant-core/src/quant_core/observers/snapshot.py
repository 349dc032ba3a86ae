"""``Histogram``: an immutable view of a histogram observer's statistic, the input of
the range searches in :mod:`quant_core.observers.selection`."""

from __future__ import annotations

import attrs
import numpy as np

from quant_core.observers.grid import HistogramGrid, rebin


@attrs.frozen(eq=False)
class Histogram:
    """int64 ``counts`` on ``grid`` plus the exact ``min_val``/``max_val`` of the data.

    Example:
        >>> import numpy as np
        >>> h = Histogram(np.array([1, 0, 2, 1]), HistogramGrid(exponent=0, offset=-2, bins=4), -1.5, 1.25)
        >>> h.quantile(0.5)  # 2 of 4 values lie below; bin [0, 1) holds 2, interpolate halfway
        0.5
        >>> h.folded().counts.tolist()  # |x|: 0 <= |x| < 1 holds the 0.x values, 1 <= |x| < 2 the rest
        [2, 2, 0, 0]
    """

    counts: np.ndarray
    grid: HistogramGrid
    min_val: float
    max_val: float

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def bin_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """Each bin's value interval, its outer bins cut to the exact data range (so a
        bin holding only the minimum is not spread over its whole width)."""
        edges = self.grid.edges()
        lower = np.maximum(edges[:-1], self.min_val)
        upper = np.minimum(edges[1:], self.max_val)
        return lower, upper

    def quantile(self, q: float) -> float:
        """Value below which a fraction ``q`` of the data lies, interpolating linearly
        inside the bin where the cumulative count crosses ``q * total`` (so it is
        within one bin of the exact quantile)."""
        cum = np.cumsum(self.counts)
        target = q * float(cum[-1])
        i = min(int(np.searchsorted(cum, target, side="left")), self.counts.size - 1)
        before = float(cum[i - 1]) if i > 0 else 0.0
        count = float(self.counts[i])
        lower, upper = self.bin_bounds()
        frac = (target - before) / count if count > 0 else 0.0
        value = float(lower[i]) + min(max(frac, 0.0), 1.0) * float(upper[i] - lower[i])
        return min(max(value, self.min_val), self.max_val)

    def clamped(self, lo: float, hi: float) -> Histogram:
        """The histogram of ``clip(x, lo, hi)``: the counts of the bins wholly beyond a
        bound moved into the bin that holds it, the exact range clipped. A bound outside
        the data, or one every value lies beyond, changes nothing (the grid must hold the
        clipped data, and a histogram of one value selects nothing).

        Example:
            >>> h = Histogram(np.array([3, 1, 2, 1]), HistogramGrid(exponent=0, offset=-2, bins=4), -1.5, 1.25)
            >>> c = h.clamped(-0.5, float("inf"))
            >>> c.counts.tolist(), c.min_val, c.max_val
            ([0, 4, 2, 1], -0.5, 1.25)
        """
        counts = self.counts.copy()
        min_val, max_val = self.min_val, self.max_val
        edges = self.grid.edges()
        if min_val < lo < max_val:
            i = int(np.searchsorted(edges, lo, side="right")) - 1  # the bin [edge_i, edge_i+1) holding lo
            counts[i] += counts[:i].sum()
            counts[:i] = 0
            min_val = float(lo)
        if min_val < hi < max_val:
            i = int(np.searchsorted(edges, hi, side="right")) - 1
            counts[i] += counts[i + 1 :].sum()
            counts[i + 1 :] = 0
            max_val = float(hi)
        return Histogram(counts, self.grid, min_val, max_val)

    def folded(self) -> Histogram:
        """Histogram of ``|x|`` on a grid starting at 0 with the same bin count.

        The grid is coarsened (exactly) until its bins from 0 cover the data, so data far
        from 0 loses resolution here, as it does in any symmetric quantizer.
        """
        grid, bins = self.grid, self.grid.bins
        coarse = grid
        while max(coarse.offset + bins, -coarse.offset) > bins:
            coarse = coarse.coarsened(coarse.exponent + 1)
        counts = rebin(self.counts, grid, coarse) if coarse != grid else self.counts
        k = coarse.offset
        out = np.zeros(bins, np.int64)
        g = np.arange(k, k + bins)
        positive = g >= 0
        out[g[positive]] += counts[positive]
        # A negative bin [g*w, (g+1)*w) holds |x| in (-(g+1)*w, -g*w]: abs bin -g-1.
        np.add.at(out, -g[~positive] - 1, counts[~positive])
        lo, hi = self.min_val, self.max_val
        abs_max = max(abs(lo), abs(hi))
        abs_min = 0.0 if lo <= 0.0 <= hi else min(abs(lo), abs(hi))
        return Histogram(out, HistogramGrid(exponent=coarse.exponent, offset=0, bins=bins), abs_min, abs_max)
