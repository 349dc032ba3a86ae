"""Pooling as the device computes it: max pooling exactly; average pooling as the
window sum times ``N`` shifted right by ``M`` (``N / 2**M ~ 1 / (kh * kw)``, the profile's
table or search, see :func:`quant_npu.approximations.average_pool_factor`), padding
counted as zeros; global pooling the same over the whole plane, in two stages (each
row, then the column of row results, each stage rounded) above the profile's element limit.

Example:
    >>> from quant_core.spec import RoundMode
    >>> from quant_npu.profile import NPUProfile
    >>> gap = GlobalAveragePoolKernel(NPUProfile(), shift=0, mode=RoundMode.HALF_UP, out_range=(-128, 127))
    >>> x = np.full((1, 1, 3, 3), 10, np.int8)
    >>> int(gap(x)[0, 0, 0, 0])  # 90 * 7 / 64 = 9.84 -> 10
    10
"""

from __future__ import annotations

import numpy as np

from quant_core.spec import RoundMode
from quant_npu.approximations import average_pool_factor
from quant_npu.profile import NPUProfile
from quant_npu.sim.arith import requantize, storage_dtype
from quant_npu.sim.spatial import Geometry


class MaxPoolKernel:
    """Max over each window (padding never wins: it is filled with the lowest code).

    Example:
        >>> kernel = MaxPoolKernel(Geometry((2, 2), strides=(2, 2)), 0, RoundMode.HALF_UP, (-128, 127), (-128, 127))
        >>> kernel(np.arange(16, dtype=np.int8).reshape(1, 1, 4, 4))[0, 0].tolist()
        [[5, 7], [13, 15]]
    """

    def __init__(
        self, geometry: Geometry, shift: int, mode: RoundMode, in_range: tuple[int, int], out_range: tuple[int, int]
    ):
        self.geometry = geometry
        self.shift = shift
        self.mode = mode
        self.fill = in_range[0]
        self.out_range = out_range
        self.dtype = storage_dtype(*out_range)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        windows = self.geometry.windows(x, fill=self.fill)
        # tap by tap: numpy's reduction over the two innermost (tiny, strided) axes is slow
        pooled = windows[..., 0, 0].copy()
        for i in range(windows.shape[-2]):
            for j in range(windows.shape[-1]):
                if i or j:
                    np.maximum(pooled, windows[..., i, j], out=pooled)
        return requantize(pooled, self.shift, self.mode, *self.out_range, self.dtype)


class AveragePoolKernel:
    """``sum(window) * N >> (M + shift)``, one rounding.

    Example:
        >>> kernel = AveragePoolKernel(Geometry((3, 3)), NPUProfile(), 0, RoundMode.HALF_UP, (-128, 127))
        >>> kernel(np.full((1, 1, 3, 3), 9, np.int8)).ravel().tolist()  # 81 * 7 / 64 = 8.86
        [9]
    """

    def __init__(
        self, geometry: Geometry, profile: NPUProfile, shift: int, mode: RoundMode, out_range: tuple[int, int]
    ):
        self.geometry = geometry
        self.factor, self.factor_shift = average_pool_factor(*geometry.kernel, profile)
        self.shift = shift
        self.mode = mode
        self.out_range = out_range
        self.dtype = storage_dtype(*out_range)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        sums = self.geometry.windows(x, fill=0).sum(axis=(-2, -1), dtype=np.float64)
        return requantize(sums * self.factor, self.factor_shift + self.shift, self.mode, *self.out_range, self.dtype)


class GlobalAveragePoolKernel:
    """Average over the axes from ``first_axis`` on (GlobalAveragePool: 2, every spatial
    axis; ReduceMean over H and W: -2); see the module example. Spatial axes other than
    two are pooled as a plane: the leading ones merged into its rows (one row for 1-D)."""

    def __init__(
        self,
        profile: NPUProfile,
        shift: int,
        mode: RoundMode,
        out_range: tuple[int, int],
        keepdims: bool = True,
        first_axis: int = -2,
    ):
        self.profile = profile
        self.shift = shift
        self.mode = mode
        self.out_range = out_range
        self.dtype = storage_dtype(*out_range)
        self.keepdims = keepdims
        self.first_axis = first_axis

    def _stage(
        self, values: np.ndarray, axis: int, count: tuple[int, int], shift: int, out: tuple[int, int]
    ) -> np.ndarray:
        factor, factor_shift = average_pool_factor(*count, self.profile)
        sums = values.sum(axis=axis, keepdims=True, dtype=np.float64)
        return requantize(sums * factor, factor_shift + shift, self.mode, *out, storage_dtype(*out))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        lead = x.shape[: self.first_axis % x.ndim]
        spatial = x.shape[len(lead) :]
        height, width = int(np.prod(spatial[:-1], dtype=np.int64)), int(spatial[-1])
        x = x.reshape(*lead, height, width)
        if height * width <= self.profile.global_pool_max_elements:
            factor, factor_shift = average_pool_factor(height, width, self.profile)
            sums = x.sum(axis=(-2, -1), keepdims=True, dtype=np.float64)
            result = requantize(sums * factor, factor_shift + self.shift, self.mode, *self.out_range, self.dtype)
        else:
            info = np.iinfo(x.dtype)
            rows = self._stage(x, -1, (1, width), 0, (int(info.min), int(info.max)))
            result = self._stage(rows, -2, (height, 1), self.shift, self.out_range)
        return result.reshape(*lead, *[1] * len(spatial)) if self.keepdims else result.reshape(lead)
