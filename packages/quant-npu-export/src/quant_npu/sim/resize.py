"""Linear Resize in integers: the interpolation weights are multiples of ``2**-bits``
(``resize_weight_bits`` of the profile), the weighted sum of input codes is exact, and the
result is rounded once to the output position.

For power-of-two upsampling factors the weights are exact binary fractions (``half_pixel``
with factor 2: 1/4 and 3/4), so the result equals ONNX's float interpolation rounded once.
The device's weights for other factors are not public (``docs/npu.md``).

Example:
    >>> from quant_core.spec import RoundMode
    >>> kernel = LinearResizeKernel({"mode": "linear"}, 8, 0, 0, RoundMode.HALF_EVEN, (-128, 127))
    >>> kernel(np.array([[[[0, 8]]]], np.int8), None, np.array([1, 1, 1, 2], np.float32))[0, 0, 0].tolist()
    [0, 2, 6, 8]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from quant_core.qparams import round_values
from quant_core.spec import RoundMode
from quant_npu.sim.arith import code_bound, requantize, storage_dtype, working_dtype
from quant_npu.sim.movement import resize_axes


class LinearResizeKernel:
    """``mode="linear"`` Resize of integer codes (see the module docstring)."""

    def __init__(
        self,
        attributes: dict[str, Any],
        bits: int,
        in_pos: int,
        out_pos: int,
        mode: RoundMode,
        out_range: tuple[int, int],
    ):
        self.attributes = attributes
        self.bits = bits
        self.in_pos = in_pos
        self.out_pos = out_pos
        self.mode = mode
        self.out_range = out_range

    def __call__(self, x: np.ndarray, *params: np.ndarray | None) -> np.ndarray:
        axes = resize_axes(x.shape, self.attributes, params)
        # each axis multiplies by weights below 2**bits: float32 is exact while the sums stay below 2**24
        values = x.astype(working_dtype(float(code_bound(x.dtype)) * 2.0 ** (self.bits * len(axes))))
        for axis, coordinates in axes:
            size = x.shape[axis]
            low = np.floor(coordinates)
            # weights on the device's grid, exact for binary fractions; half-even like ONNX's float
            upper = round_values(np.ldexp(coordinates - low, self.bits), RoundMode.HALF_EVEN)
            first = np.clip(low, 0, size - 1).astype(np.int64)
            second = np.clip(low + 1, 0, size - 1).astype(np.int64)
            shape = [1] * values.ndim
            shape[axis] = -1
            lower_weight = (2.0**self.bits - upper).reshape(shape).astype(values.dtype)
            upper_weight = upper.reshape(shape).astype(values.dtype)
            values = (
                np.take(values, first, axis=axis) * lower_weight + np.take(values, second, axis=axis) * upper_weight
            )
        shift = self.bits * len(axes) + self.in_pos - self.out_pos
        return requantize(values, shift, self.mode, *self.out_range, storage_dtype(*self.out_range))
