"""Numeric formats a tensor can be stored in after quantization.

Integer formats carry their code range; float formats (fp16, bf16, fp32) mean
"keep this tensor in float" and carry no range.

Example:
    >>> from quant_core.dtypes import DType
    >>> DType.INT8.qmin, DType.INT8.qmax
    (-128, 127)
    >>> DType.INT8.qrange(narrow_range=True)
    (-127, 127)
    >>> DType.parse("uint4").bits
    4
"""

from __future__ import annotations

import enum

import numpy as np

from quant_core.errors import ConfigError


class DType(enum.Enum):
    """A storage format. The value is the lower-case name used in configs and JSON."""

    INT4 = "int4"
    UINT4 = "uint4"
    INT8 = "int8"
    UINT8 = "uint8"
    INT16 = "int16"
    UINT16 = "uint16"
    INT32 = "int32"
    FP16 = "fp16"
    BF16 = "bf16"
    FP32 = "fp32"

    @classmethod
    def parse(cls, value: str | DType) -> DType:
        """Return the member named ``value``; the error lists every allowed name."""
        if isinstance(value, DType):
            return value
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(m.value for m in cls)
            raise ConfigError(f"dtype: {value!r} is not a known dtype; allowed: {allowed}") from None

    @property
    def is_float(self) -> bool:
        return self in (DType.FP16, DType.BF16, DType.FP32)

    @property
    def is_integer(self) -> bool:
        return not self.is_float

    @property
    def bits(self) -> int:
        return _BITS[self]

    @property
    def signed(self) -> bool:
        return self.is_float or not self.value.startswith("u")

    @property
    def qmin(self) -> int:
        """Smallest integer code (full range)."""
        self._require_integer()
        return -(1 << (self.bits - 1)) if self.signed else 0

    @property
    def qmax(self) -> int:
        """Largest integer code."""
        self._require_integer()
        return (1 << (self.bits - 1)) - 1 if self.signed else (1 << self.bits) - 1

    def qrange(self, narrow_range: bool = False) -> tuple[int, int]:
        """``(qmin, qmax)``; a narrow range drops the lowest code so that the range is
        symmetric around zero (int8: [-127, 127]) or, for unsigned formats, around the
        mid-point (uint8: [1, 255])."""
        lo, hi = self.qmin, self.qmax
        return (lo + 1, hi) if narrow_range else (lo, hi)

    @property
    def numpy_dtype(self) -> np.dtype:
        """The numpy dtype that holds the codes (int4/uint4 codes live in int8/uint8;
        bf16 has no numpy type and is held in float32)."""
        return np.dtype(_NUMPY[self])

    def _require_integer(self) -> None:
        if self.is_float:
            raise ConfigError(f"dtype: {self.value} is a float format and has no integer range")


_BITS = {
    DType.INT4: 4,
    DType.UINT4: 4,
    DType.INT8: 8,
    DType.UINT8: 8,
    DType.INT16: 16,
    DType.UINT16: 16,
    DType.INT32: 32,
    DType.FP16: 16,
    DType.BF16: 16,
    DType.FP32: 32,
}

_NUMPY = {
    DType.INT4: "int8",
    DType.UINT4: "uint8",
    DType.INT8: "int8",
    DType.UINT8: "uint8",
    DType.INT16: "int16",
    DType.UINT16: "uint16",
    DType.INT32: "int32",
    DType.FP16: "float16",
    DType.BF16: "float32",
    DType.FP32: "float32",
}

INTEGER_DTYPES: tuple[DType, ...] = tuple(d for d in DType if d.is_integer)
FLOAT_DTYPES: tuple[DType, ...] = tuple(d for d in DType if d.is_float)
