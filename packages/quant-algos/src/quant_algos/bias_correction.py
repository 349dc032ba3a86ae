"""Bias correction: a quantized layer's output is biased (its mean differs from the
float output's mean per channel); subtracting the per-channel mean error from the bias
removes that shift.

Empirical: the backend runs calibration batches through the float and the quantized
model, captures one layer's float and quantized outputs (pre-activation, the tensor the
bias is added to), and feeds them to :class:`MeanErrorAccumulator` batch by batch.
Analytic: the shift a layer's own weight rounding adds is ``(W_q - W) E[x]``;
:class:`InputMeanAccumulator` keeps the float model's mean input and
:func:`weight_rounding_shift` applies the rounding error to it. Memory does not grow
with the number of samples in either.

Example:
    >>> import numpy as np
    >>> acc = MeanErrorAccumulator(channel_axis=1)
    >>> float_out = np.zeros((2, 3, 4, 4), np.float32)
    >>> acc.update(float_out, float_out + np.array([0.5, 0.0, -1.0]).reshape(1, 3, 1, 1))
    >>> acc.mean_error().tolist()
    [0.5, 0.0, -1.0]
    >>> acc.corrected_bias(np.zeros(3)).tolist()
    [-0.5, 0.0, 1.0]
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from quant_algos._channel_stats import channels_last, check_channels
from quant_algos.layer import Layer, response_to_constant
from quant_algos.reconstruction_data import ConvGeometry
from quant_core.algorithm_config import BiasCorrectionConfig
from quant_core.errors import DataError, ModelError


class MeanErrorAccumulator:
    """Streaming per-channel sums of ``quantized - float`` outputs of one layer.

    Args:
        channel_axis: the channel axis of the captured outputs: 1 for NCHW and
            ``[N, C]``, -1 for NHWC or ``[..., C]`` MatMul outputs.

    Example:
        >>> import numpy as np
        >>> a, b = MeanErrorAccumulator(), MeanErrorAccumulator()
        >>> a.update(np.zeros((1, 2)), np.ones((1, 2)))
        >>> b.update(np.zeros((3, 2)), np.zeros((3, 2)))
        >>> a.merge(b).mean_error().tolist()
        [0.25, 0.25]
    """

    def __init__(self, channel_axis: int = 1) -> None:
        self.channel_axis = channel_axis
        self._sum: np.ndarray | None = None
        self._count = 0

    @property
    def count(self) -> int:
        """Values seen per channel."""
        return self._count

    def update(self, float_output: np.ndarray, quantized_output: np.ndarray) -> None:
        f = np.asarray(float_output)
        q = np.asarray(quantized_output)
        if f.shape != q.shape:
            raise DataError(f"quantized_output: shape {q.shape} differs from float_output {f.shape}")
        diff = channels_last(q, self.channel_axis, "quantized_output") - channels_last(
            f, self.channel_axis, "float_output"
        )
        check_channels(None if self._sum is None else self._sum.shape[0], diff.shape[1], "quantized_output")
        batch_sum = diff.sum(axis=0)
        self._sum = batch_sum if self._sum is None else self._sum + batch_sum
        self._count += diff.shape[0]

    def merge(self, other: MeanErrorAccumulator) -> MeanErrorAccumulator:
        """Combine two accumulators (e.g. from parallel workers) into a new one."""
        out = MeanErrorAccumulator(self.channel_axis)
        sums = [s for s in (self._sum, other._sum) if s is not None]
        if len(sums) == 2:
            check_channels(sums[0].shape[0], sums[1].shape[0], "merge")
        out._sum = None if not sums else np.sum(sums, axis=0)
        out._count = self._count + other._count
        return out

    def mean_error(self) -> np.ndarray:
        """Per-channel mean of ``quantized - float`` (float64)."""
        if self._sum is None or self._count == 0:
            raise DataError("bias correction: no outputs were accumulated")
        return self._sum / self._count

    def corrected_bias(self, bias: np.ndarray | None) -> np.ndarray:
        """``bias - mean_error`` (:func:`shifted_bias`)."""
        return shifted_bias(bias, self.mean_error())


def shifted_bias(bias: np.ndarray | None, shift: np.ndarray) -> np.ndarray:
    """``bias - shift`` in the bias's dtype (float32 from a zero bias when ``bias`` is None):
    what either correction writes.

    Example:
        >>> import numpy as np
        >>> shifted_bias(None, np.array([0.5, -1.0])).tolist()
        [-0.5, 1.0]
    """
    s = np.asarray(shift)
    if bias is None:
        return (-s).astype(np.float32)
    b = np.asarray(bias)
    if b.shape != s.shape:
        raise ModelError(f"bias: shape {b.shape} does not match {s.shape[0]} output channels")
    return (b - s).astype(b.dtype)


def correct_bias(
    bias: np.ndarray | None,
    batches: Iterable[tuple[np.ndarray, np.ndarray]],
    config: BiasCorrectionConfig | None = None,
    channel_axis: int = 1,
) -> np.ndarray:
    """Corrected bias from ``(float_output, quantized_output)`` batches; stops after
    ``config.num_samples`` samples (first-axis entries) when set.

    Example:
        >>> import numpy as np
        >>> f = np.zeros((4, 2)); q = f + [0.25, -0.5]
        >>> correct_bias(np.ones(2), [(f, q)]).tolist()
        [0.75, 1.5]
    """
    acc = MeanErrorAccumulator(channel_axis)
    limit = None if config is None else config.num_samples
    seen = 0
    for float_out, quant_out in batches:
        if limit is not None:
            take = limit - seen
            if take <= 0:
                break
            float_out, quant_out = np.asarray(float_out)[:take], np.asarray(quant_out)[:take]
        acc.update(float_out, quant_out)
        seen += len(float_out)
    return acc.corrected_bias(bias)


class InputMeanAccumulator:
    """Streaming mean of one layer's float input over the calibration samples.

    A convolution's input (``[N, C, ...]``) keeps its mean map ``[C, ...]``, position by
    position: near a zero-padded border a filter tap reads padding, so the taps' means
    differ from the channel's (:func:`weight_rounding_shift` uses them). Where the map's
    size changes between samples (a text line's width), there is no map to keep: from then
    on it keeps each channel's mean over every value, ``[C]`` (exact away from padded
    borders). A dense layer's input (``[..., K]``) keeps the mean of each feature over
    every leading axis (samples and tokens alike: one bias serves every token).

    Example:
        >>> import numpy as np
        >>> acc = InputMeanAccumulator(conv=False)
        >>> acc.update(np.array([[[1.0, 2.0], [3.0, 4.0]]]))
        >>> acc.mean().tolist()
        [2.0, 3.0]
        >>> acc = InputMeanAccumulator(conv=True)
        >>> acc.update(np.ones((1, 2, 1, 2))); acc.update(np.zeros((1, 2, 1, 6)))
        >>> acc.mean().tolist()  # 2 ones among 8 values per channel
        [0.25, 0.25]
    """

    def __init__(self, conv: bool) -> None:
        self.conv = conv
        self._sum: np.ndarray | None = None  # float64
        self._count = 0
        # Float32 rows (a calibration run's tensors) add into a float32 partial sum, which
        # folds into the float64 total every _PARTIAL_ROWS rows: adding float32 into float64
        # in place costs numpy twice a same-type add, and 64 float32 additions lose nothing
        # a bias correction can see (relative error ~1e-6).
        self._partial: np.ndarray | None = None
        self._partial_rows = 0
        self._channels_only = False  # a convolution's map changed size: per-channel sums

    def update(self, inputs: np.ndarray) -> None:
        x = np.asarray(inputs)
        if x.ndim < (3 if self.conv else 1):
            raise DataError(f"input: rank {x.ndim} is too small for a {'convolution' if self.conv else 'dense'} layer")
        rows = x if self.conv else x.reshape(-1, x.shape[-1])
        if len(rows) == 1 and rows.dtype == np.float32:  # one sample: its own sum
            self._add_partial(rows[0])
            return
        self.add(rows.sum(axis=0, dtype=np.float64), rows.shape[0])

    def add(self, total: np.ndarray, rows: int) -> None:
        """Add the sum of ``rows`` rows reduced elsewhere (e.g. inside onnxruntime)."""
        total = np.asarray(total)
        if self.conv and (self._channels_only or self._changes_size(total)):
            self._to_channels()
            rows *= int(np.prod(total.shape[1:]))
            total = total.reshape(total.shape[0], -1).sum(axis=1, dtype=np.float64)
        self._check_shape(total)
        if self._sum is None:
            self._sum = total.astype(np.float64)  # its own buffer: later sums add into it in place
        else:
            np.add(self._sum, total, out=self._sum)
        self._count += rows

    def _add_partial(self, row: np.ndarray) -> None:
        if self._channels_only or self._changes_size(row):
            self.add(row, 1)
            return
        self._check_shape(row)
        if self._partial is None:
            self._partial = row.copy()
        else:
            np.add(self._partial, row, out=self._partial)
        self._partial_rows += 1
        if self._partial_rows == _PARTIAL_ROWS:
            self._fold()

    def _fold(self) -> None:
        if self._partial is not None:
            partial, rows = self._partial, self._partial_rows
            self._partial, self._partial_rows = None, 0
            self.add(partial, rows)

    def _changes_size(self, total: np.ndarray) -> bool:
        """Whether a convolution's per-sample map ``total`` has the known channels at
        another size."""
        known = self._known
        return (
            known is not None
            and known.ndim == total.ndim
            and known.shape[0] == total.shape[0]
            and known.shape != total.shape
        )

    def _to_channels(self) -> None:
        """Fold the mean map so far into per-channel sums (counting every position)."""
        if self._channels_only:
            return
        self._channels_only = True
        kept = ((self._sum, self._count), (self._partial, self._partial_rows))
        self._sum, self._count, self._partial, self._partial_rows = None, 0, None, 0
        for total, rows in kept:
            if total is not None and rows:
                self.add(total, rows)

    @property
    def _known(self) -> np.ndarray | None:
        """The running sum whose shape later rows must match (total or partial)."""
        return self._sum if self._sum is not None else self._partial

    def _check_shape(self, total: np.ndarray) -> None:
        known = self._known
        if known is not None and known.shape != total.shape:
            raise DataError(f"input: shape {list(total.shape)} per sample, but earlier batches had {list(known.shape)}")

    def mean(self) -> np.ndarray:
        """``[C, ...]`` for a convolution (``[C]`` once its size changed), ``[K]`` for a
        dense layer (float64)."""
        self._fold()
        if self._sum is None or self._count == 0:
            raise DataError("bias correction: no inputs were accumulated")
        # A NaN or Inf in any sample stays in the sum: one check here serves every batch.
        if not np.all(np.isfinite(self._sum)):
            raise DataError("input: contains NaN or Inf")
        return self._sum / self._count


#: Rows of float32 partial sum before it folds into an input mean's float64 total.
_PARTIAL_ROWS = 64


def _tap_means(mean_map: np.ndarray, geometry: ConvGeometry, kernel_hw: tuple[int, int]) -> np.ndarray:
    """``[C, kh, kw]``: the mean, over a 2-D convolution's output positions, of the value
    each filter tap reads (zero where it reads padding)."""
    height, width = int(mean_map.shape[1]), int(mean_map.shape[2])
    out_h, out_w = geometry.output_size((height, width), kernel_hw)
    taps = np.zeros((mean_map.shape[0], *kernel_hw))
    for i in range(kernel_hw[0]):
        rows = np.arange(out_h) * geometry.strides[0] + i * geometry.dilations[0] - geometry.pads[0]
        rows = rows[(rows >= 0) & (rows < height)]
        for j in range(kernel_hw[1]):
            cols = np.arange(out_w) * geometry.strides[1] + j * geometry.dilations[1] - geometry.pads[1]
            cols = cols[(cols >= 0) & (cols < width)]
            taps[:, i, j] = mean_map[:, rows][:, :, cols].sum(axis=(1, 2))
    return taps / (out_h * out_w)


def weight_rounding_shift(
    delta_weight: np.ndarray, mean_input: np.ndarray, geometry: ConvGeometry | None = None
) -> np.ndarray:
    """What a weight error ``delta_weight`` (``W_q - W``, ``[out, in, ...]``) adds to the
    mean of each output channel, given the layer's mean input (:class:`InputMeanAccumulator`).

    A 2-D convolution with its ``geometry`` is exact, padding included; another
    convolution takes each channel's mean for every tap (exact away from padded borders),
    its groups read from the input's channel count.

    Example:
        >>> import numpy as np
        >>> weight_rounding_shift(np.array([[0.5, -1.0]]), np.array([2.0, 1.0])).tolist()
        [0.0]
        >>> # a 3x3 filter of ones over a 2x2 map of ones, padded by 1: each output sums
        >>> # the four values, not nine
        >>> g = ConvGeometry(pads=(1, 1, 1, 1))
        >>> weight_rounding_shift(np.ones((1, 1, 3, 3)), np.ones((1, 2, 2)), g).tolist()
        [4.0]
    """
    delta = np.asarray(delta_weight, np.float64)
    mean = np.asarray(mean_input, np.float64)
    if delta.ndim == 2:
        if mean.shape != (delta.shape[1],):
            raise ModelError(f"mean input: {list(mean.shape)} does not match a weight of {delta.shape[1]} inputs")
        return delta @ mean
    channels = int(mean.shape[0])
    if channels % delta.shape[1]:
        raise ModelError(f"mean input: {channels} channels do not fit a weight of {delta.shape[1]} inputs per group")
    groups = channels // delta.shape[1]
    if geometry is None or delta.ndim != 4 or mean.ndim != 3:
        channel_means = mean.reshape(channels, -1).mean(axis=1)
        return response_to_constant(Layer(delta, None, groups=groups), channel_means)
    taps = _tap_means(mean, geometry, (int(delta.shape[2]), int(delta.shape[3])))
    grouped = delta.reshape(groups, delta.shape[0] // groups, delta.shape[1], -1)
    return np.einsum("goik,gik->go", grouped, taps.reshape(groups, delta.shape[1], -1)).reshape(-1)
