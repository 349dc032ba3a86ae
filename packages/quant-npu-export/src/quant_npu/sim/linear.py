"""Exact integer Conv, ConvTranspose, Gemm and MatMul: int8 x int8 products summed by BLAS in float32
where a bound proves every partial sum below ``2**24``, else in float64 (exact below
``2**53``; a convolution sums float32 products of blocks of its reduction axis there, see
:func:`float32_blocks`), then the :class:`~quant_npu.sim.epilogue.Epilogue`.

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
from quant_npu.sim.arith import FLOAT32_EXACT, exact_dtype
from quant_npu.sim.epilogue import Epilogue
from quant_npu.sim.spatial import Geometry

IM2COL_ELEMENTS = 2**24
"""Columns of one im2col product at most (64 MB as float32); more samples go in further chunks."""
FEW_CHANNELS = 16
"""Below this many input channels per group, columns are gathered from NCHW planes."""
PADDED_SHARE = 0.85
"""A convolution whose taps read image pixels for less than this share of its outputs
(padding zeros for the rest) runs tap by tap over the image pixels only."""


def accumulator_bound(weights: np.ndarray, input_bound: int, channel_axis: int = 0) -> float:
    """``input_bound * max_c sum |w_c|``: no partial sum of a channel's dot product exceeds it."""
    moved = np.moveaxis(np.abs(weights.astype(np.float64)), channel_axis, 0)
    return float(input_bound) * float(moved.reshape(moved.shape[0], -1).sum(axis=1).max(initial=0.0))


def float32_blocks(matrices: np.ndarray, input_bound: int) -> list[slice] | None:
    """Consecutive blocks of the rows (``K``) of ``(g, K, M)`` integer matrices in which no
    partial sum of a product with inputs below ``input_bound`` reaches ``2**24``: each block's
    product is exact in float32 (twice BLAS's float64 speed), and their sum, below ``2**53``,
    exact in float64. None when a single row already reaches ``2**24``.

    Example:
        >>> float32_blocks(np.full((1, 6, 2), 2**10), 2**12)  # rows of 2**22: a fourth would reach 2**24
        [slice(0, 3, None), slice(3, 6, None)]
    """
    weights = np.abs(np.asarray(matrices, np.float64)) * float(input_bound)
    sums = np.cumsum(weights, axis=1)  # (g, K, M)
    blocks, start, rows = [], 0, weights.shape[1]
    while start < rows:
        base = sums[:, start - 1 : start, :] if start else 0.0
        reach = (sums[:, start:, :] - base).max(axis=(0, 2))  # per candidate end, nondecreasing
        size = int(np.searchsorted(reach, FLOAT32_EXACT, side="left"))
        if size == 0:
            return None
        blocks.append(slice(start, start + size))
        start += size
    return blocks


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
        # per group: (kh * kw * C/g, M/g), the right operand of the im2col product (taps outer,
        # channels inner: the order the channels-last columns are gathered in)
        self.matrices = np.ascontiguousarray(
            self.weights.reshape(g, m, self.channels_per_group, -1).transpose(0, 3, 2, 1).reshape(g, -1, m)
        )
        self.pointwise = geometry.kernel == (1, 1) and geometry.strides == (1, 1) and geometry.padding(1, 1) == (0,) * 4
        self.blocks = float32_blocks(self.matrices, input_bound) if self.dtype == np.float64 else None
        # the columns' dtype: float32 where every block's partial sums are float32-exact
        self.column_dtype = np.float32 if self.blocks is not None else self.dtype
        if self.blocks is not None:
            self.matrices = self.matrices.astype(np.float32)
        # by taps: each tap's product must be exact in the columns' dtype on its own
        taps = np.abs(self.matrices.astype(np.float64)).reshape(g, -1, self.channels_per_group, m).sum(axis=2)
        self.taps_exact = self.column_dtype == self.dtype or float(taps.max(initial=0.0)) * input_bound < FLOAT32_EXACT

    def _product(self, cols: np.ndarray) -> np.ndarray:
        """``cols @ matrices`` (``(g, P, K) x (g, K, M/g)``), exact: one BLAS product, or a
        float32 product per block of ``K`` summed in float64 (:func:`float32_blocks`)."""
        if self.blocks is None:
            return np.matmul(cols, self.matrices)
        total = np.matmul(cols[..., self.blocks[0]], self.matrices[:, self.blocks[0]]).astype(np.float64)
        for block in self.blocks[1:]:
            total += np.matmul(cols[..., block], self.matrices[:, block])
        return total

    def accumulate(self, x: np.ndarray) -> np.ndarray:
        if self.pointwise and self.group == 1:
            return self._pointwise(x)
        if self.depthwise:
            return self._depthwise(x)
        if self.group == 1 and self.channels_per_group >= FEW_CHANNELS and self.taps_exact:
            spans = self._tap_spans(*x.shape[2:])
            ho, wo = self._output_size_of(*x.shape[2:])
            covered = sum((r[1] - r[0]) * (c[1] - c[0]) for r, c in spans.values())
            if covered < PADDED_SHARE * len(spans) * ho * wo:
                return self._by_taps(x, spans, ho, wo)
        return self._im2col(x)

    def _output_size_of(self, height: int, width: int) -> tuple[int, int]:
        top, left, bottom, right = self.geometry.padding(height, width)
        return self._output_size(np.empty((0, height + top + bottom, width + left + right, 0)))

    def _tap_spans(self, height: int, width: int) -> dict[tuple[int, int], tuple[tuple[int, int], tuple[int, int]]]:
        """Per kernel tap, the output rows and columns ``[begin, end)`` whose input pixel lies
        inside the image (the rest multiply padding zeros)."""
        top, left, _bottom, _right = self.geometry.padding(height, width)
        ho, wo = self._output_size_of(height, width)
        (sh, sw), (dh, dw) = self.geometry.strides, self.geometry.dilations

        def span(offset: int, stride: int, size: int, count: int) -> tuple[int, int]:
            begin = max(0, -(-offset // stride))  # first o with o * stride >= offset
            end = min(count, (size - 1 + offset) // stride + 1) if size - 1 + offset >= 0 else 0
            return begin, max(begin, end)

        kh, kw = self.geometry.kernel
        return {
            (i, j): (span(top - i * dh, sh, height, ho), span(left - j * dw, sw, width, wo))
            for i in range(kh)
            for j in range(kw)
        }

    def _by_taps(
        self, x: np.ndarray, spans: dict[tuple[int, int], tuple[tuple[int, int], tuple[int, int]]], ho: int, wo: int
    ) -> np.ndarray:
        """One ``(pixels, C) x (C, M)`` product per kernel tap over the outputs whose input
        pixel is inside the image, summed in the accumulator (dilated convolutions on small
        planes spend most of an im2col product on padding zeros)."""
        n, c = x.shape[:2]
        top, left = self.geometry.padding(*x.shape[2:])[:2]
        (sh, sw), (dh, dw) = self.geometry.strides, self.geometry.dilations
        planes = np.array(x.transpose(0, 2, 3, 1), dtype=self.column_dtype, order="C")
        acc = np.zeros((n, ho, wo, self.out_channels), self.dtype)
        kw = self.geometry.kernel[1]
        for (i, j), ((r0, r1), (c0, c1)) in spans.items():
            if r0 == r1 or c0 == c1:
                continue
            rows = slice(r0 * sh + i * dh - top, (r1 - 1) * sh + i * dh - top + 1, sh)
            cols = slice(c0 * sw + j * dw - left, (c1 - 1) * sw + j * dw - left + 1, sw)
            pixels = np.ascontiguousarray(planes[:, rows, cols, :]).reshape(-1, c)
            tap = (i * kw + j) * c
            product = pixels @ self.matrices[0, tap : tap + c]
            acc[:, r0:r1, c0:c1, :] += product.reshape(n, r1 - r0, c1 - c0, -1)
        return acc.transpose(0, 3, 1, 2)

    def _channels_last_padded(self, x: np.ndarray) -> np.ndarray:
        """``x`` as ``(N, H + pads, W + pads, C)`` in the columns' dtype, zero-padded."""
        n, c, h, w = x.shape
        top, left, bottom, right = self.geometry.padding(h, w)
        padded = np.zeros((n, h + top + bottom, w + left + right, c), self.column_dtype)
        padded[:, top : top + h, left : left + w, :] = x.transpose(0, 2, 3, 1)
        return padded

    def _output_size(self, padded: np.ndarray) -> tuple[int, int]:
        geometry = self.geometry
        ho = (padded.shape[1] - geometry.extent(0)) // geometry.strides[0] + 1
        wo = (padded.shape[2] - geometry.extent(1)) // geometry.strides[1] + 1
        return ho, wo

    def _tap(self, padded: np.ndarray, i: int, j: int, ho: int, wo: int) -> np.ndarray:
        """The ``(N, Ho, Wo, C)`` input pixels kernel tap ``(i, j)`` multiplies."""
        (sh, sw), (dh, dw) = self.geometry.strides, self.geometry.dilations
        return padded[:, i * dh : i * dh + (ho - 1) * sh + 1 : sh, j * dw : j * dw + (wo - 1) * sw + 1 : sw, :]

    def _im2col(self, x: np.ndarray) -> np.ndarray:
        """Columns gathered with long contiguous copies, one matrix product per group, a batch
        of samples at a time (the columns are ``kh * kw`` times the input: chunks bound their
        memory). Many channels per group: channels-last rows (each copy moves C/g values);
        few (a stem on RGB): planes of the NCHW input, one column row per (tap, channel)."""
        few = self.channels_per_group < FEW_CHANNELS
        padded = self._padded_planes(x).transpose(0, 2, 3, 1) if few else self._channels_last_padded(x)
        n = len(padded)
        ho, wo = self._output_size(padded)
        (kh, kw), g, cpg = self.geometry.kernel, self.group, self.channels_per_group
        m = self.out_channels // g
        out = np.empty((n, ho, wo, self.out_channels), self.dtype)
        chunk = max(1, IM2COL_ELEMENTS // max(ho * wo * kh * kw * cpg * g, 1))
        for start in range(0, n, chunk):
            part = padded[start : start + chunk]
            b = len(part)
            if few:  # (g, taps x C/g, pixels): each copy moves a row of Wo pixels; BLAS reads it transposed
                rows = np.empty((g, kh, kw, cpg, b, ho, wo), self.column_dtype)
                for i in range(kh):
                    for j in range(kw):
                        tap = self._tap(part, i, j, ho, wo).reshape(b, ho, wo, g, cpg)
                        rows[:, i, j] = tap.transpose(3, 4, 0, 1, 2)
                cols = rows.reshape(g, -1, b * ho * wo).transpose(0, 2, 1)
            else:  # (g, pixels, taps x C/g): each copy moves C/g channels of a pixel
                gathered = np.empty((g, b, ho, wo, kh, kw, cpg), self.column_dtype)
                for i in range(kh):
                    for j in range(kw):
                        tap = self._tap(part, i, j, ho, wo).reshape(b, ho, wo, g, cpg)
                        gathered[:, :, :, :, i, j, :] = tap.transpose(3, 0, 1, 2, 4)
                cols = gathered.reshape(g, b * ho * wo, -1)
            product = self._product(cols)  # (g, b*ho*wo, m)
            out[start : start + b] = product.transpose(1, 0, 2).reshape(b, ho, wo, g * m)
        return out.transpose(0, 3, 1, 2)

    def _padded_planes(self, x: np.ndarray) -> np.ndarray:
        """``x`` as ``(N, C, H + pads, W + pads)`` in the columns' dtype, zero-padded."""
        n, c, h, w = x.shape
        top, left, bottom, right = self.geometry.padding(h, w)
        padded = np.zeros((n, c, h + top + bottom, w + left + right), self.column_dtype)
        padded[:, :, top : top + h, left : left + w] = x
        return padded

    def _pointwise(self, x: np.ndarray) -> np.ndarray:
        """One ``(N*H*W, C) x (C, M)`` product on the channels-last input (one copy)."""
        n, c, h, w = x.shape
        cols = np.array(x.transpose(0, 2, 3, 1), dtype=self.column_dtype, order="C").reshape(1, -1, c)
        return self._product(cols).reshape(n, h, w, -1).transpose(0, 3, 1, 2)

    def _depthwise(self, x: np.ndarray) -> np.ndarray:
        """Channels-last taps (the channel axis innermost keeps numpy's loops long)."""
        multiplier = self.out_channels // self.group
        if multiplier > 1:
            x = np.repeat(x, multiplier, axis=1)
        padded = self._channels_last_padded(x)
        ho, wo = self._output_size(padded)
        (kh, kw) = self.geometry.kernel
        acc = np.zeros((len(padded), ho, wo, padded.shape[3]), self.dtype)
        product = np.empty_like(acc)
        for i in range(kh):
            for j in range(kw):
                np.multiply(self._tap(padded, i, j, ho, wo), self.taps[i, j], out=product)
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
