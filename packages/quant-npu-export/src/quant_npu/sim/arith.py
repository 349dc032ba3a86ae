"""Integer arithmetic of the simulator.

Integers are held in numpy float arrays where BLAS needs them: every value on the data
path is an integer, and float64 represents every integer below ``2**53`` exactly (float32:
below ``2**24``), so sums of int8 products and shifts by powers of two are exact as long
as the magnitude bound holds. :func:`exact_dtype` picks float32 only where a bound proves
it exact. Rounding goes through :func:`quant_core.qparams.round_values` on values scaled
by ``2**-shift`` (exact), so each requantization rounds once, with the target's mode.

Example:
    >>> requantize(np.array([5, -5, 6, 7]), 1, RoundMode.HALF_UP, -128, 127, np.int8).tolist()
    [3, -2, 3, 4]
    >>> requantize(np.array([5, -5, 6, 7]), 1, RoundMode.HALF_EVEN, -128, 127, np.int8).tolist()
    [2, -2, 3, 4]
"""

from __future__ import annotations

import numpy as np

from quant_core.qparams import round_values
from quant_core.spec import RoundMode

FLOAT32_EXACT = 2.0**24
FLOAT64_EXACT = 2.0**53


def exact_dtype(bound: float) -> type[np.floating]:
    """float32 when every value (and partial sum) is below ``2**24`` in magnitude, else
    float64; above ``2**53`` nothing numpy offers is exact and the simulator refuses.

    Example:
        >>> exact_dtype(9 * 128 * 127), exact_dtype(2**30)
        (<class 'numpy.float32'>, <class 'numpy.float64'>)
    """
    if bound < FLOAT32_EXACT:
        return np.float32
    if bound < FLOAT64_EXACT:
        return np.float64
    raise ValueError(f"accumulator bound {bound:.3g} exceeds 2**53: integer results would not be exact")


def storage_dtype(lo: int, hi: int) -> type[np.signedinteger]:
    """The smallest signed numpy type holding ``[lo, hi]``.

    Example:
        >>> storage_dtype(-128, 127), storage_dtype(0, 255)
        (<class 'numpy.int8'>, <class 'numpy.int16'>)
    """
    for dtype in (np.int8, np.int16, np.int32):
        info = np.iinfo(dtype)
        if info.min <= lo and hi <= info.max:
            return dtype
    return np.int64


def requantize(
    values: np.ndarray,
    shift: int | np.ndarray,
    mode: RoundMode,
    lo: int,
    hi: int,
    dtype: type[np.signedinteger] | np.dtype,
) -> np.ndarray:
    """``values * 2**-shift`` (``values`` exact integers, ``shift`` a scalar or an array
    broadcasting against them) rounded once with ``mode``, saturated to ``[lo, hi]``."""
    shifts = np.asarray(shift)
    if not shifts.any():
        scaled = np.asarray(values)
    else:
        floats = values if np.issubdtype(np.asarray(values).dtype, np.floating) else values.astype(np.float64)
        scaled = np.ldexp(floats, -shifts.astype(np.int32))
        if (shifts > 0).any():
            scaled = round_values(scaled, mode)
    return np.clip(scaled, lo, hi).astype(dtype)


def align(values: np.ndarray, up: int, dtype: type[np.floating] = np.float64) -> np.ndarray:
    """``values * 2**up`` for ``up >= 0`` (exact), as ``dtype``."""
    floats = values.astype(dtype)
    return floats if up == 0 else np.ldexp(floats, up)


def divide_round(numerator: np.ndarray, denominator: np.ndarray, mode: RoundMode) -> np.ndarray:
    """``numerator / denominator`` (integers) rounded with ``mode``, exactly: the float64
    quotient ``q`` is off by at most ``2**-53 * |q|`` while a quotient that is not a tie lies
    at least ``1 / (2 |denominator|)`` from one, so for ``|numerator| < 2**52`` rounding the
    float quotient gives the exact result (larger numerators are refused). Division by
    zero saturates towards the numerator's sign (0 / 0 gives 0).

    Example:
        >>> divide_round(np.array([5.0, -5.0, 7.0, 3.0]), np.array([2.0, 2.0, 0.0, 0.0]), RoundMode.HALF_UP).tolist()
        [3.0, -2.0, inf, inf]
    """
    if numerator.size and float(np.max(np.abs(numerator))) >= 2.0**52:
        raise ValueError("division: numerator reaches 2**52; the rounded quotient would not be exact")
    with np.errstate(divide="ignore", invalid="ignore"):
        quotient = np.divide(numerator, denominator)
    quotient = np.where(np.isnan(quotient), 0.0, quotient)
    return round_values(quotient, mode)
