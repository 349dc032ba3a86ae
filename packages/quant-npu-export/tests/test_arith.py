"""The simulator's integer arithmetic against exact rational arithmetic."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quant_core.spec import RoundMode
from quant_npu.sim.arith import divide_round, exact_dtype, requantize, storage_dtype


def _round(value: Fraction, mode: RoundMode) -> int:
    """Reference rounding of an exact rational."""
    floor = math.floor(value)
    rest = value - floor
    if rest > Fraction(1, 2):
        return floor + 1
    if rest < Fraction(1, 2):
        return floor
    if mode is RoundMode.HALF_UP:  # floor(x + 0.5): ties towards +inf (-2.5 -> -2)
        return floor + 1
    return floor if floor % 2 == 0 else floor + 1  # half to even


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=20),
    st.integers(-6, 30),
    st.sampled_from([RoundMode.HALF_UP, RoundMode.HALF_EVEN]),
    st.sampled_from([np.float64, np.int64]),
)
def test_requantize_matches_exact_rounding(values: list[int], shift: int, mode: RoundMode, dtype: type) -> None:
    got = requantize(np.array(values, dtype), shift, mode, -(2**62), 2**62, np.int64)
    expected = [_round(Fraction(v) / Fraction(2) ** shift, mode) for v in values]
    assert got.tolist() == expected


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(-(2**23), 2**23), min_size=2, max_size=20),
    st.lists(st.integers(-(2**22), 2**22), min_size=2, max_size=2),
    st.lists(st.integers(-3, 30), min_size=2, max_size=2),
    st.sampled_from([RoundMode.HALF_UP, RoundMode.HALF_EVEN]),
    st.sampled_from([np.float32, np.float64, np.int64]),
)
def test_requantize_adds_an_offset_before_the_one_rounding(
    values: list[int], offsets: list[int], shifts: list[int], mode: RoundMode, dtype: type
) -> None:
    """Per-column shifts and offsets (a bias per channel), float32-exact sums."""
    rows = np.array(values[: len(values) // 2 * 2], np.int64).reshape(-1, 2)
    rows = np.clip(rows, -(2**24) + 1 - np.array(offsets), 2**24 - 1 - np.array(offsets))  # sums below 2**24
    got = requantize(rows.astype(dtype), np.array(shifts), mode, -(2**40), 2**40, np.int64, offset=np.array(offsets))
    expected = [
        [_round(Fraction(int(v) + o) / Fraction(2) ** s, mode) for v, o, s in zip(row, offsets, shifts, strict=True)]
        for row in rows
    ]
    assert got.tolist() == expected


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.uint8])
def test_requantize_narrow_codes(dtype: type) -> None:
    info = np.iinfo(dtype)
    codes = np.arange(int(info.min), int(info.max) + 1, 7).astype(dtype)
    for shift in (0, 1, 3, 9):
        got = requantize(codes, shift, RoundMode.HALF_UP, -100, 100, np.int8)
        expected = [max(-100, min(100, _round(Fraction(int(c), 2**shift), RoundMode.HALF_UP))) for c in codes]
        assert got.tolist() == expected and got.dtype == np.int8
    same = np.arange(-128, 128, dtype=np.int8)
    assert requantize(same, 0, RoundMode.HALF_UP, -128, 127, np.int8) is same  # nothing to do: no copy


def test_requantize_saturates_and_takes_per_channel_shifts() -> None:
    values = np.array([[300.0, -300.0], [3.0, -3.0]])
    got = requantize(values, np.array([[0], [1]]), RoundMode.HALF_UP, -128, 127, np.int8)
    assert got.tolist() == [[127, -128], [2, -1]]
    assert got.dtype == np.int8


def test_float32_values_stay_exact() -> None:
    values = np.array([2**23 + 1, -(2**23) - 3], np.float32)
    got = requantize(values, 1, RoundMode.HALF_EVEN, -(2**30), 2**30, np.int64)
    assert got.tolist() == [_round(Fraction(int(v), 2), RoundMode.HALF_EVEN) for v in values.astype(np.int64)]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(-(2**45), 2**45), st.integers(-(2**20), 2**20)), min_size=1, max_size=20),
    st.sampled_from([RoundMode.HALF_UP, RoundMode.HALF_EVEN]),
)
def test_divide_round_is_exact(pairs: list[tuple[int, int]], mode: RoundMode) -> None:
    numerators = np.array([p[0] for p in pairs], np.float64)
    denominators = np.array([p[1] for p in pairs], np.float64)
    got = divide_round(numerators, denominators, mode)
    for (n, d), value in zip(pairs, got, strict=True):
        if d == 0:
            assert value == (0 if n == 0 else math.copysign(math.inf, n))
        else:
            assert value == _round(Fraction(n, d), mode)


def test_divide_round_refuses_inexact_numerators() -> None:
    with pytest.raises(ValueError, match="2\\*\\*52"):
        divide_round(np.array([2.0**53]), np.array([3.0]), RoundMode.HALF_UP)


def test_dtypes() -> None:
    assert exact_dtype(2**24 - 1) is np.float32 and exact_dtype(2**24) is np.float64
    with pytest.raises(ValueError, match="2\\*\\*53"):
        exact_dtype(2.0**53)
    assert storage_dtype(-128, 127) is np.int8 and storage_dtype(-32768, 32767) is np.int16
    assert storage_dtype(0, 2**31) is np.int64
