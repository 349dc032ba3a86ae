"""Checking calibration batches before they touch an observer's state.

Every observer reduces a batch to its minimum and maximum first; those two numbers
also tell whether the batch holds NaN or infinities (``min``/``max`` propagate NaN),
so the check costs nothing beyond the reduction the observer needs anyway.
"""

from __future__ import annotations

import math

import numpy as np

from quant_core.errors import DataError

# Observers keep ranges as float64; values a float32 model cannot hold are not
# calibration data (and would overflow the histogram's grid arithmetic).
from quant_core.observer_config import FLOAT32_MAX


def as_float_array(x: object) -> np.ndarray:
    """``x`` as a float32 or float64 array without copying float32/float64 input.

    float16 (and any narrower float) widens to float32 exactly; integers and bools go
    to float64, which holds every int32 exactly; floats in the other byte order become
    the native type of their width, and wider floats (long double) float64.
    """
    try:
        a = np.asarray(x)
    except ValueError as exc:  # a ragged nested list
        raise DataError(f"x: not an array ({exc})") from None
    if a.dtype == np.float32 or a.dtype == np.float64:
        return a
    if a.dtype.kind == "f":
        return a.astype(np.float32 if a.dtype.itemsize <= 4 else np.float64)
    if a.dtype.kind in "iub":  # not "m": a timedelta is not a number to quantize
        return a.astype(np.float64)
    raise DataError(f"x: dtype {a.dtype} is not allowed; allowed: float or integer arrays")


def check_finite_range(lo: np.ndarray, hi: np.ndarray, what: str = "x") -> None:
    """Raise a DataError when a batch's ``min``/``max`` reveal NaN, infinities or
    values beyond float32."""
    if np.ndim(lo) == 0 and np.ndim(hi) == 0:
        # Scalar fast path (one call per tensor per batch): plain floats, no numpy scalars.
        lo_f, hi_f = float(lo), float(hi)
        if math.isfinite(lo_f) and math.isfinite(hi_f) and max(abs(lo_f), abs(hi_f)) <= FLOAT32_MAX:
            return
    if np.isnan(lo).any() or np.isnan(hi).any():
        raise DataError(f"{what}: contains NaN; calibration data must be finite")
    if np.isinf(lo).any() or np.isinf(hi).any():
        raise DataError(f"{what}: contains infinite values; calibration data must be finite")
    if (np.abs(lo) > FLOAT32_MAX).any() or (np.abs(hi) > FLOAT32_MAX).any():
        raise DataError(f"{what}: values exceed the float32 range; calibration data must fit float32")


def min_max(x: np.ndarray, axis: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Checked float64 ``(min, max)`` of a non-empty batch: scalars (shape ``()``), or
    one value per index of ``axis`` when ``axis`` is given (all other axes reduced)."""
    if axis is None:
        # Scalar fast path: calibration calls this once per tensor per run, thousands of
        # times, where numpy's scalar checks would cost as much as the reduction itself.
        lo_f, hi_f = float(x.min()), float(x.max())
        if math.isfinite(lo_f) and math.isfinite(hi_f) and max(-lo_f, hi_f, lo_f, -hi_f) <= FLOAT32_MAX:
            return np.array(lo_f), np.array(hi_f)
        lo, hi = np.asarray(lo_f), np.asarray(hi_f)
    else:
        if not 0 <= axis < x.ndim:
            raise DataError(
                f"per_channel_axis: {axis} is out of range for a batch of shape {x.shape}; "
                f"allowed: 0 <= per_channel_axis < {x.ndim}"
            )
        other = tuple(i for i in range(x.ndim) if i != axis)
        lo, hi = np.min(x, axis=other), np.max(x, axis=other)
    lo64, hi64 = np.asarray(lo, np.float64), np.asarray(hi, np.float64)
    check_finite_range(lo64, hi64)
    return lo64, hi64
