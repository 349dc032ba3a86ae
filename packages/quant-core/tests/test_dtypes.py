from __future__ import annotations

import numpy as np
import pytest

from quant_core.dtypes import FLOAT_DTYPES, INTEGER_DTYPES, DType


@pytest.mark.parametrize("dtype", INTEGER_DTYPES)
def test_integer_range_matches_bit_width(dtype: DType) -> None:
    # Independent formula: a signed n-bit format is two's complement, unsigned is [0, 2**n).
    n = dtype.bits
    expected = (-(2 ** (n - 1)), 2 ** (n - 1) - 1) if dtype.value.startswith("int") else (0, 2**n - 1)
    assert (dtype.qmin, dtype.qmax) == expected
    assert dtype.qrange() == expected
    assert dtype.qrange(narrow_range=True) == (expected[0] + 1, expected[1])


@pytest.mark.parametrize("dtype", INTEGER_DTYPES)
def test_numpy_dtype_holds_every_code(dtype: DType) -> None:
    info = np.iinfo(dtype.numpy_dtype)
    assert info.min <= dtype.qmin and dtype.qmax <= info.max


def test_int8_narrow_range_is_symmetric() -> None:
    assert DType.INT8.qrange(narrow_range=True) == (-127, 127)
    assert DType.UINT8.qrange(narrow_range=True) == (1, 255)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_float_dtypes_have_no_integer_range(dtype: DType) -> None:
    assert dtype.is_float and not dtype.is_integer
    with pytest.raises(ValueError, match=r"dtype: .* float format"):
        _ = dtype.qmin
    with pytest.raises(ValueError, match="float format"):
        dtype.qrange()


def test_parse_accepts_members_and_names() -> None:
    assert DType.parse("int4") is DType.INT4
    assert DType.parse(DType.UINT16) is DType.UINT16


@pytest.mark.parametrize("bad", ["int7", "INT8", "", 8])
def test_parse_rejects_unknown_names_listing_allowed(bad: object) -> None:
    with pytest.raises(ValueError, match=r"^dtype: .*allowed: int4, uint4, int8"):
        DType.parse(bad)  # type: ignore[arg-type]


def test_partition_of_members() -> None:
    assert set(INTEGER_DTYPES) | set(FLOAT_DTYPES) == set(DType)
    assert not set(INTEGER_DTYPES) & set(FLOAT_DTYPES)
