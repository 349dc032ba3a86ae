"""Feeding ``quant_core`` observers from torch tensors, on the tensor's own device.

A batch is reduced where it lives: ``torch.aminmax`` (per tensor, or per channel after
moving the channel axis first) for the min-max observers, and a histogram on the grid
the observer hands out (:meth:`HistogramObserver.grid_for`) for the histogram methods
(percentile, entropy, MSE, power-of-two MinMSE): ``torch.bincount`` on an accelerator,
``quant_core``'s binning on the CPU tensor's own memory. Only the reduction (two
numbers, one per channel, or ``bins`` counts) crosses to the host; the
observer then makes its decision with ``quant_core``'s one implementation of the math, so
the statistics, and the qparams, are those the numpy path gives for the same data.

Under ``torch.distributed`` a :class:`BatchSync` makes every rank feed the union of the
ranks' batches: min and max are all-reduced before the grid is chosen, histogram counts
are summed, so every rank's observer sees identical statistics.

Example:
    >>> import torch
    >>> from quant_core.observers import make_observer
    >>> from quant_core.observer_config import Percentile
    >>> from quant_core.spec import QuantSpec
    >>> obs = make_observer(QuantSpec(dtype="int8", observer=Percentile(99.0, bins=64)))
    >>> observe(obs, torch.linspace(-1.0, 1.0, 1001))
    >>> int(obs.counts.sum()), obs.min_val, obs.max_val
    (1001, -1.0, 1.0)
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from quant_core.observers import HistogramObserver, Observer
from quant_core.observers.binning import bin_counts
from quant_core.observers.grid import HistogramGrid


class BatchSync(Protocol):
    """Combines one batch's statistics across processes (see :mod:`quant_torch_fx.distributed`)."""

    def min_max(self, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The element-wise min of ``lo`` and max of ``hi`` over every process."""
        ...

    def counts(self, counts: torch.Tensor) -> torch.Tensor:
        """The sum of ``counts`` over every process."""
        ...


def channel_min_max(x: torch.Tensor, axis: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(min, max)`` of ``x`` as 0-d tensors (``axis=None``) or one value per index of ``axis``.

    Example:
        >>> lo, hi = channel_min_max(torch.tensor([[1.0, -2.0], [3.0, 4.0]]), 0)
        >>> lo.tolist(), hi.tolist()
        ([-2.0, 3.0], [1.0, 4.0])
    """
    if axis is None:
        return torch.aminmax(x)
    if not 0 <= axis < x.dim():
        raise ValueError(
            f"per_channel_axis: {axis} is out of range for a tensor of shape {list(x.shape)}; "
            f"allowed: 0 <= per_channel_axis < {x.dim()}"
        )
    flat = x.movedim(axis, 0).reshape(x.shape[axis], -1)
    return torch.aminmax(flat, dim=1)


def histogram_counts(x: torch.Tensor, grid: HistogramGrid) -> torch.Tensor:
    """int64 counts of ``x``'s values on ``grid`` (all inside it), computed on ``x``'s device.

    A value's bin is ``floor(x * 2**-e) - offset``: exact in float32 when
    ``grid.float32_exact`` (float32 data), exact in float64 always, so the counts equal
    ``quant_core.observers.binning.bin_counts`` on the same values.

    Example:
        >>> g = HistogramGrid(exponent=-1, offset=-2, bins=4)  # edges -1, -0.5, 0, 0.5, 1
        >>> histogram_counts(torch.tensor([-1.0, -0.01, 0.0, 0.99]), g).tolist()
        [1, 1, 1, 1]
    """
    flat = x.reshape(-1)
    if flat.device.type == "cpu" and flat.dtype in (torch.float32, torch.float64):
        # On the CPU the numpy view is the tensor's own memory (no copy), and quant_core's
        # cache-blocked binning is about 10x faster than the same arithmetic as torch ops.
        return torch.from_numpy(bin_counts(flat.contiguous().numpy(), grid))
    return torch_histogram_counts(flat, grid)


def torch_histogram_counts(x: torch.Tensor, grid: HistogramGrid) -> torch.Tensor:
    """:func:`histogram_counts` as torch ops on any device (what accelerators run).

    Example:
        >>> g = HistogramGrid(exponent=-1, offset=-2, bins=4)
        >>> torch_histogram_counts(torch.tensor([-1.0, -0.01, 0.0, 0.99]), g).tolist()
        [1, 1, 1, 1]
    """
    flat = x.reshape(-1)
    if not (flat.dtype == torch.float32 and grid.float32_exact):
        flat = flat.to(torch.float64)
    index = torch.floor(flat * grid.inv_width).sub_(grid.offset)
    return torch.bincount(index.to(torch.int64), minlength=grid.bins)


def _finite_pair(lo: torch.Tensor, hi: torch.Tensor) -> tuple[float, float]:
    values = torch.stack((lo.to(torch.float64), hi.to(torch.float64))).tolist()
    return float(values[0]), float(values[1])


def observe(observer: Observer, x: torch.Tensor, sync: BatchSync | None = None) -> None:
    """Fold one batch of ``x`` into ``observer`` (any kind), reducing it on its device.

    Empty tensors are ignored; NaN or infinite values raise ``ValueError`` (from the
    observer's range check). With ``sync``, the statistics are those of every process's
    batch together.
    """
    data = x.detach()
    if data.numel() == 0:
        if sync is not None:
            raise ValueError("observe: an empty batch on one process would leave the others waiting; skip it on all")
        return
    if not data.is_floating_point():
        data = data.to(torch.float64)
    elif data.dtype not in (torch.float32, torch.float64):
        data = data.to(torch.float32)  # float16/bfloat16 widen exactly
    if isinstance(observer, HistogramObserver):
        lo_t, hi_t = torch.aminmax(data)
        if sync is not None:
            lo_t, hi_t = sync.min_max(lo_t, hi_t)
        lo, hi = _finite_pair(lo_t, hi_t)
        grid = observer.grid_for(lo, hi)  # checks finiteness first
        counts = histogram_counts(data, grid)
        if sync is not None:
            counts = sync.counts(counts)
        observer.update_histogram(counts.cpu().numpy(), grid, lo, hi)
        return
    axis = observer.spec.channel_axis
    lo_t, hi_t = channel_min_max(data, axis)
    if sync is not None:
        lo_t, hi_t = sync.min_max(lo_t, hi_t)
    if axis is None:
        lo, hi = _finite_pair(lo_t, hi_t)
        observer.update_range(lo, hi)  # type: ignore[attr-defined]
    else:
        both = torch.stack((lo_t, hi_t)).to(torch.float64).cpu().numpy()
        observer.update_range(np.asarray(both[0]), np.asarray(both[1]))  # type: ignore[attr-defined]
