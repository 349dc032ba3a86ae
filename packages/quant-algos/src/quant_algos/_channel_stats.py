"""Per-channel reductions shared by the streaming accumulators (bias correction,
SmoothQuant): move the channel axis last and reduce everything else."""

from __future__ import annotations

import numpy as np

from quant_core.errors import DataError


def channels_last(x: np.ndarray, axis: int, name: str) -> np.ndarray:
    """``x`` as ``[rows, C]`` float64 with the channels of ``axis`` in the last dimension."""
    a = np.asarray(x)
    if a.ndim == 0:
        raise DataError(f"{name}: a scalar has no channel axis")
    if not -a.ndim <= axis < a.ndim:
        raise DataError(f"channel_axis: {axis} is out of range for {name} of rank {a.ndim}")
    if not np.all(np.isfinite(a)):
        raise DataError(f"{name}: contains NaN or Inf")
    return np.moveaxis(a, axis, -1).reshape(-1, a.shape[axis]).astype(np.float64, copy=False)


def check_channels(expected: int | None, got: int, name: str) -> int:
    if expected is not None and expected != got:
        raise DataError(f"{name}: {got} channels, but earlier batches had {expected}")
    return got
