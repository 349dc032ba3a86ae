"""Empirical bias correction: a quantized layer's output is biased (its mean differs
from the float output's mean per channel); subtracting the per-channel mean error
from the bias removes that shift.

The backend runs calibration batches through the float and the quantized model,
captures one layer's float and quantized outputs (pre-activation, the tensor the
bias is added to), and feeds them here batch by batch; memory does not grow with
the number of samples.

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
        """``bias - mean_error`` in the bias's dtype (a zero bias when ``bias`` is None)."""
        err = self.mean_error()
        if bias is None:
            return (-err).astype(np.float32)
        b = np.asarray(bias)
        if b.shape != err.shape:
            raise ModelError(f"bias: shape {b.shape} does not match {err.shape[0]} output channels")
        return (b - err).astype(b.dtype)


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
