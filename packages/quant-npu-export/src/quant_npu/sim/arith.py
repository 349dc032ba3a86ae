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

from quant_core.errors import ModelError
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
    raise ModelError(f"accumulator bound {bound:.3g} exceeds 2**53: integer results would not be exact")


def working_dtype(bound: float) -> type[np.floating]:
    """:func:`exact_dtype` for values known exact in float64 (integer codes, products of
    them): float32 below ``2**24``, float64 otherwise, never a refusal.

    Example:
        >>> working_dtype(128 * 128), working_dtype(2.0**63)
        (<class 'numpy.float32'>, <class 'numpy.float64'>)
    """
    return np.float32 if bound < FLOAT32_EXACT else np.float64


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


def code_bound(dtype: np.dtype) -> int:
    """The largest magnitude a value of integer ``dtype`` may have (floats: ``2**53``, the
    exact range the simulator keeps them in).

    Example:
        >>> code_bound(np.dtype(np.int8)), code_bound(np.dtype(np.float32))
        (128, 9007199254740992)
    """
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return max(abs(int(info.min)), int(info.max))
    return 2**53


def requantize(
    values: np.ndarray,
    shift: int | np.ndarray,
    mode: RoundMode,
    lo: int,
    hi: int,
    dtype: type[np.signedinteger] | np.dtype,
    offset: np.ndarray | None = None,
) -> np.ndarray:
    """``(values + offset) * 2**-shift`` (``values`` and ``offset`` exact integers whose sum
    is exact in ``values``' dtype, ``shift`` a scalar or an array broadcasting against them)
    rounded once with ``mode``, saturated to ``[lo, hi]``.

    Half-up right shifts run in integers (``(v + 2**(s-1)) >> s``, :func:`_shift_half_up`);
    other cases scale by ``2**-shift`` in floating point (exact) and round there. A result
    that needs no change is ``values`` itself, not a copy."""
    values = np.asarray(values)
    shifts = np.asarray(shift)
    if offset is None and not shifts.any():
        target = np.dtype(dtype)
        if values.dtype == target and _covers(lo, hi, target):
            return values
        return np.clip(values, lo, hi).astype(dtype)
    if mode is RoundMode.HALF_UP and shifts.min(initial=0) >= 0 and shifts.max(initial=0) <= MAX_INTEGER_SHIFT:
        return _shift_half_up(values, shifts, lo, hi, dtype, offset)
    floats = values if np.issubdtype(values.dtype, np.floating) else values.astype(np.float64)
    if offset is not None:
        floats = floats + np.asarray(offset, floats.dtype)
    scaled = np.ldexp(floats, -shifts.astype(np.int32))  # a fresh array: rounded and clipped in place
    if (shifts > 0).any():
        if mode is RoundMode.HALF_EVEN:
            np.rint(scaled, out=scaled)
        else:
            scaled = round_values(scaled, mode)
    return np.clip(scaled, lo, hi, out=scaled).astype(dtype)


MAX_INTEGER_SHIFT = 30
"""Largest right shift :func:`_shift_half_up` takes: with values below ``2**24`` (int8/int16
codes, float32-exact sums) the rounded sum stays below ``2**31`` in int32."""


def _covers(lo: int, hi: int, dtype: np.dtype) -> bool:
    info = np.iinfo(dtype) if dtype.kind in "iu" else None
    return info is not None and lo <= info.min and hi >= info.max


def _shift_half_up(
    values: np.ndarray,
    shifts: np.ndarray,
    lo: int,
    hi: int,
    dtype: type[np.signedinteger] | np.dtype,
    offset: np.ndarray | None,
) -> np.ndarray:
    """Half-up right shift in integer arithmetic: ``floor((v + offset + 2**(s-1)) / 2**s)``
    is ``(v + offset + 2**(s-1)) >> s`` (numpy shifts signed integers arithmetically).
    int32 holds float32-exact values (below ``2**24``) plus ``2**29`` of rounding; anything
    wider works in int64 (float64-exact values are below ``2**53``)."""
    narrow = values.dtype in (np.float32, np.int8, np.int16, np.uint8, np.uint16)
    info = np.iinfo(np.int32) if narrow else np.iinfo(np.int64)
    work = np.dtype(info.dtype)
    ints = values.astype(work)  # a fresh array, changed in place below
    wide = shifts.astype(np.int64)
    rounding = np.where(wide > 0, np.left_shift(np.int64(1), np.maximum(wide, 1) - 1), 0)
    if offset is not None:
        rounding = rounding + np.asarray(offset).astype(np.int64)
    np.add(ints, rounding.astype(work), out=ints)
    np.right_shift(ints, wide.astype(work), out=ints)
    np.clip(ints, max(lo, int(info.min)), min(hi, int(info.max)), out=ints)
    return ints.astype(dtype, copy=False)


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
        raise ModelError("division: numerator reaches 2**52; the rounded quotient would not be exact")
    with np.errstate(divide="ignore", invalid="ignore"):
        quotient = np.divide(numerator, denominator)
    quotient = np.where(np.isnan(quotient), 0.0, quotient)
    return round_values(quotient, mode)
