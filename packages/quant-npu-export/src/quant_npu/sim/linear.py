"""Exact integer Conv, ConvTranspose, Gemm and MatMul: int8 x int8 products summed by BLAS in float32
where a bound proves every partial sum below ``2**24``, else in float64 (exact below
``2**53``), then the :class:`~quant_npu.sim.epilogue.Epilogue`.

The bound is ``max |x| * max over output channels of sum |w|``, which no partial sum of
any summation order exceeds.

Example:
    >>> from quant_core.spec import RoundMode
    >>> from quant_npu.sim.epilogue import Epilogue
    >>> from quant_npu.sim.spatial import Geometry
    >>> w = np.ones((1, 1, 2, 2), np.int64)
    >>> e = Epilogue(acc_pos=0, out_pos=0, mode=RoundMode.HALF_UP, out_range=(-128, 127), acc_bound=4 * 128)
    >>> conv = ConvKernel(w, 1, Geometry((2, 2)), e, input_bound=128)
    >>> conv(np.arange(9, dtype=np.int8).reshape(1, 1, 3, 3))[0, 0].tolist()
    [[8, 12], [20, 24]]
"""

from __future__ import annotations

import numpy as np

from quant_core.conversions import ConvTransposeAsConv, conv_weight, zero_insert
from quant_npu.sim.arith import exact_dtype
from quant_npu.sim.epilogue import Epilogue
from quant_npu.sim.spatial import Geometry


def accumulator_bound(weights: np.ndarray, input_bound: int, channel_axis: int = 0) -> float:
    """``input_bound * max_c sum |w_c|``: no partial sum of a channel's dot product exceeds it."""
    moved = np.moveaxis(np.abs(weights.astype(np.float64)), channel_axis, 0)
    return float(input_bound) * float(moved.reshape(moved.shape[0], -1).sum(axis=1).max(initial=0.0))


class ConvKernel:
    """2-D Conv (any group, stride, padding, dilation) on signed integer NCHW inputs."""

    def __init__(self, weights: np.ndarray, group: int, geometry: Geometry, epilogue: Epilogue, input_bound: int):
        self.group = group
        self.geometry = geometry
        self.epilogue = epilogue
        self.out_channels, self.channels_per_group = weights.shape[0], weights.shape[1]
        self.dtype = exact_dtype(accumulator_bound(weights, input_bound))
        self.weights = weights.astype(self.dtype)
        self.depthwise = group > 1 and self.channels_per_group == 1
        self.taps = np.ascontiguousarray(self.weights[:, 0].transpose(1, 2, 0))  # (kh, kw, M)
        g, m = group, self.out_channels // group
        # per group: (C/g * kh * kw, M/g), the right operand of the im2col product
        self.matrices = [np.ascontiguousarray(self.weights[i * m : (i + 1) * m].reshape(m, -1).T) for i in range(g)]
        self.pointwise = geometry.kernel == (1, 1) and geometry.strides == (1, 1) and geometry.padding(1, 1) == (0,) * 4

    def accumulate(self, x: np.ndarray) -> np.ndarray:
        if self.pointwise and self.group == 1:
            return self._pointwise(x)
        if self.depthwise:
            return self._depthwise(x)
        windows = self.geometry.windows(x, fill=0)
        n, _c, ho, wo = windows.shape[:4]
        outputs = []
        for i, matrix in enumerate(self.matrices):
            part = windows[:, i * self.channels_per_group : (i + 1) * self.channels_per_group]
            cols = np.array(part.transpose(0, 2, 3, 1, 4, 5), dtype=self.dtype, order="C").reshape(n * ho * wo, -1)
            outputs.append((cols @ matrix).reshape(n, ho, wo, -1))
        joined = outputs[0] if len(outputs) == 1 else np.concatenate(outputs, axis=3)
        return joined.transpose(0, 3, 1, 2)

    def _pointwise(self, x: np.ndarray) -> np.ndarray:
        n, c, h, w = x.shape
        channels_last = x.transpose(0, 2, 3, 1)
        if channels_last.flags.c_contiguous or h * w < 16:
            cols = np.asarray(channels_last, dtype=self.dtype).reshape(-1, c)
            return (cols @ self.matrices[0]).reshape(n, h, w, -1).transpose(0, 3, 1, 2)
        # one (M, C) x (C, H*W) product per sample: no transposes
        return np.matmul(self.matrices[0].T, x.reshape(n, c, h * w).astype(self.dtype)).reshape(n, -1, h, w)

    def _depthwise(self, x: np.ndarray) -> np.ndarray:
        """Channels-last taps (the channel axis innermost keeps numpy's loops long)."""
        multiplier = self.out_channels // self.group
        if multiplier > 1:
            x = np.repeat(x, multiplier, axis=1)
        geometry = self.geometry
        n, c, h, w = x.shape
        top, left, bottom, right = geometry.padding(h, w)
        padded = np.zeros((n, h + top + bottom, w + left + right, c), self.dtype)
        padded[:, top : top + h, left : left + w, :] = x.transpose(0, 2, 3, 1)
        (kh, kw), (sh, sw), (dh, dw) = geometry.kernel, geometry.strides, geometry.dilations
        ho = (padded.shape[1] - geometry.extent(0)) // sh + 1
        wo = (padded.shape[2] - geometry.extent(1)) // sw + 1
        acc = np.zeros((n, ho, wo, c), self.dtype)
        product = np.empty_like(acc)
        for i in range(kh):
            for j in range(kw):
                tap = padded[:, i * dh : i * dh + (ho - 1) * sh + 1 : sh, j * dw : j * dw + (wo - 1) * sw + 1 : sw, :]
                np.multiply(tap, self.taps[i, j], out=product)
                acc += product
        return acc.transpose(0, 3, 1, 2)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.epilogue(self.accumulate(x))


class ConvTransposeKernel:
    """2-D ConvTranspose as the DPU computes it: ``stride - 1`` zeros inserted after every
    input pixel, then a stride-1 convolution with the flipped kernel (exact, like ``Conv``).
    ``weights`` are in ConvTranspose's layout ``[Cin, Cout/g, kh, kw]``.

    Example:
        >>> from quant_core.spec import RoundMode
        >>> from quant_npu.sim.epilogue import Epilogue
        >>> e = Epilogue(acc_pos=0, out_pos=0, mode=RoundMode.HALF_UP, out_range=(-128, 127), acc_bound=512)
        >>> up = ConvTransposeKernel(np.ones((1, 1, 2, 2), np.int64), {"strides": (2, 2)}, e, input_bound=128)
        >>> up(np.array([[[[1, 2]]]], np.int8))[0, 0].tolist()
        [[1, 1, 2, 2], [1, 1, 2, 2]]
    """

    def __init__(self, weights: np.ndarray, attributes: dict, epilogue: Epilogue, input_bound: int):
        self.form = ConvTransposeAsConv.from_attributes(attributes, weights.shape)
        conv = conv_weight(weights, self.form.group)
        geometry = Geometry(
            (int(conv.shape[2]), int(conv.shape[3])), dilations=self.form.dilations, pads=self.form.pads
        )
        self.conv = ConvKernel(conv, self.form.group, geometry, epilogue, input_bound)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        z = zero_insert(x, self.form.strides)
        (top, left), (bottom, right) = self.form.crop_begin, self.form.crop_end
        return self.conv(z[:, :, top : z.shape[2] - bottom, left : z.shape[3] - right])


def conv_transpose_bound(weights: np.ndarray, group: int, input_bound: int) -> float:
    """:func:`accumulator_bound` of a ConvTranspose (``[Cin, Cout/g, kh, kw]`` weights)."""
    return accumulator_bound(conv_weight(weights, group), input_bound)


class MatMulKernel:
    """``x @ w`` with a constant ``w`` of shape ``(K, N)`` (Gemm's B after transB), for
    inputs of any leading shape; the channel axis of the epilogue is the last one.

    Example:
        >>> from quant_core.spec import RoundMode
        >>> e = Epilogue(acc_pos=2, out_pos=0, mode=RoundMode.HALF_UP, out_range=(-128, 127), channel_axis=-1, ndim=2)
        >>> MatMulKernel(np.array([[1], [2]]), e, 128)(np.array([[3, 4]])).tolist()  # (3 + 8) / 4
        [[3]]
    """

    def __init__(self, weights: np.ndarray, epilogue: Epilogue, input_bound: int):
        self.epilogue = epilogue
        self.dtype = exact_dtype(accumulator_bound(weights, input_bound, channel_axis=1))
        self.weights = np.ascontiguousarray(weights.astype(self.dtype))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.epilogue(np.matmul(x.astype(self.dtype), self.weights))


class ActivationMatMulKernel:
    """``a @ b`` of two integer activations (one rounding shift at the end).

    Example:
        >>> from quant_core.spec import RoundMode
        >>> e = Epilogue(acc_pos=1, out_pos=0, mode=RoundMode.HALF_EVEN, out_range=(-128, 127), ndim=2)
        >>> ActivationMatMulKernel(e, 2, 128, 128)(np.array([[1, 2]]), np.array([[3], [0]])).tolist()  # 3 / 2
        [[2]]
    """

    def __init__(self, epilogue: Epilogue, depth: int, bound_a: int, bound_b: int):
        self.epilogue = epilogue
        self.dtype = exact_dtype(float(depth) * bound_a * bound_b)

    def __call__(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return self.epilogue(np.matmul(a.astype(self.dtype), b.astype(self.dtype)))
