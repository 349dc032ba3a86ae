"""Counting a batch into a :class:`~quant_core.observers.grid.HistogramGrid`, fast
and exactly.

A value's bin is ``floor(x * 2**-e) - offset``. Scaling by a power of two is exact
unless the result underflows, ``floor`` of a float is an integer float, and ``offset`` is
exact in float32 (``|offset| <= 2**24``), so the subtraction of two integers whose
difference lies in ``[0, bins)`` is exact too. Float32 data is therefore binned exactly
in float32 arithmetic (float64 data in float64). Underflow happens only for widths
above 1 and tiny values; the one case it changes a bin is a tiny negative value scaled
to ``-0.0``, which belongs to bin ``-1``, not ``0``, and is fixed explicitly.

:func:`bin_counts` counts in one native pass where the C kernel could be built
(:mod:`quant_core.observers.native`); otherwise, and in :func:`numpy_bin_counts`, the
batch is processed in chunks that stay in cache, with preallocated buffers: a handful of
vectorised passes over L2-resident data plus ``np.bincount``. Both give the same counts.
"""

from __future__ import annotations

import threading

import numpy as np

from quant_core.observers.grid import HistogramGrid, work_dtype
from quant_core.observers.native import native_counter

# 64 Ki elements: 256 KiB of float32 plus 768 KiB of indices stay in L2 (measured in
# tools/bench/observers.py; 16 Ki-256 Ki all perform alike).
CHUNK = 1 << 16


def bin_counts(x: np.ndarray, grid: HistogramGrid) -> np.ndarray:
    """int64 counts of the values of ``x`` (float32 or float64, all inside the grid).

    Example:
        >>> import numpy as np
        >>> g = HistogramGrid(exponent=-1, offset=-2, bins=4)  # edges -1, -0.5, 0, 0.5, 1
        >>> bin_counts(np.array([-1.0, -0.01, 0.0, 0.99], np.float32), g).tolist()
        [1, 1, 1, 1]
    """
    counter = native_counter()
    if counter is not None and x.dtype in (np.float32, np.float64):
        counts, _, _ = counter.count(np.ascontiguousarray(x).reshape(-1), grid)
        if counts is None:
            raise AssertionError("histogram: values fall outside the grid")
        return counts
    return numpy_bin_counts(x, grid)


def numpy_bin_counts(x: np.ndarray, grid: HistogramGrid) -> np.ndarray:
    """:func:`bin_counts` in numpy's vectorised passes (the path without the native kernel).

    Example:
        >>> g = HistogramGrid(exponent=0, offset=0, bins=2)
        >>> numpy_bin_counts(np.array([0.5, 1.5, 1.0]), g).tolist()
        [1, 2]
    """
    flat = x.reshape(-1)
    work = work_dtype(flat.dtype, grid)
    fix_underflow = grid.exponent > 0
    scale = work(grid.inv_width)
    offset = work(grid.offset)
    buf, narrow, idx = _chunk_buffers(work)
    counts = np.zeros(grid.bins, np.int64)
    for start in range(0, flat.size, CHUNK):
        seg = flat[start : start + CHUNK]
        m = seg.size
        b, ix32, ix = buf[:m], narrow[:m], idx[:m]
        np.multiply(seg, scale, out=b)
        np.floor(b, out=b)
        if fix_underflow:
            b[(b == 0) & (seg < 0)] = -1
        np.subtract(b, offset, out=b)
        # Through int32: numpy converts float to int32 about 7x faster than to intp, and
        # widening into our own buffer is cheap (np.bincount would widen into fresh memory).
        ix32[...] = b
        ix[...] = ix32
        chunk_counts = np.bincount(ix, minlength=grid.bins)
        if chunk_counts.size != grid.bins:
            raise AssertionError("histogram: values fall outside the grid")
        counts += chunk_counts
    return counts


_buffers = threading.local()


def _chunk_buffers(work: type[np.floating]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """This thread's ``CHUNK``-long buffers (values of ``work``, int32 and intp indices), made
    once: fresh buffers of this size are fresh pages on many calls, and faulting them in
    costs more than the binning (up to 7 ns per value on a 64 Ki-value batch)."""
    held: dict[type[np.floating], tuple[np.ndarray, np.ndarray, np.ndarray]] | None
    held = getattr(_buffers, "by_work_type", None)
    if held is None:
        held = _buffers.by_work_type = {}
    buffers = held.get(work)
    if buffers is None or buffers[0].size < CHUNK:
        buffers = held[work] = (np.empty(CHUNK, work), np.empty(CHUNK, np.int32), np.empty(CHUNK, np.intp))
    return buffers
