"""Feeding ``quant_core`` observers from torch tensors, on the tensor's own device.

A batch is reduced where it lives: ``torch.aminmax`` (per tensor, or per channel after
moving the channel axis first) for the min-max observers, and a histogram on the grid
the observer picks (:meth:`HistogramObserver.update_counted`) for the histogram methods
(percentile, entropy, MSE, power-of-two MinMSE). On the CPU, where quant_core's native
count could be built (:mod:`quant_core.observers.native`), the observer reads the tensor's
own memory and takes its range and counts in one pass on one thread; otherwise the counts
come from ``torch.bincount``: on an accelerator the crowded bin of the zeros spread out
first (:data:`DEVICE_COUNTING`), on the CPU consecutive values spread over interleaved
copies of the counts (:data:`COUNT_LANES`), on one thread, after elementwise steps on
torch's threads, or on one while the machine is busy
(:func:`quant_torch_fx.shared_cores.observer_threads`). Only the reduction (two
numbers, one per channel, or ``bins`` counts) crosses to the host, and a min-max
observer's running range only when it is read (:func:`observe_later`); the observer then
makes its decision with ``quant_core``'s one implementation of the math, so
the statistics, and the qparams, are those the numpy path gives for the same data.

Under ``torch.distributed`` each rank observes its own batches; calibration then merges
the observers across ranks (:mod:`quant_torch_fx.distributed`).

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

import threading

import numpy as np
import torch

from quant_core.errors import DataError
from quant_core.observer_config import FLOAT32_MAX
from quant_core.observers import HistogramObserver, MinMaxObserver, Observer
from quant_core.observers.grid import HistogramGrid
from quant_core.observers.native import native_counter
from quant_torch_fx.shared_cores import observer_threads


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
        raise DataError(
            f"per_channel_axis: {axis} is out of range for a tensor of shape {list(x.shape)}; "
            f"allowed: 0 <= per_channel_axis < {x.dim()}"
        )
    flat = x.movedim(axis, 0).reshape(x.shape[axis], -1)
    return torch.aminmax(flat, dim=1)


# Values binned per pass on the CPU: the buffers of the scaled values and their bin indices
# (:func:`_chunk_buffers`) are reused, where whole-tensor temporaries of a large activation
# (hundreds of MB) would be fresh, page-faulting memory on every call.
CPU_CHUNK = 1 << 18

#: How an accelerator counts bins: ``"bincount"`` (``torch.bincount`` of the bins as they
#: are) or ``"zero_spread"`` (the values in the bin that holds 0 spread over
#: :data:`ZERO_SPREAD` extra bins first, summed back after). On a GPU a histogram kernel's
#: atomic additions to one bin wait for each other, and after a ReLU half the values are
#: exactly 0: on an H100, ResNet-50's largest activation (51 M values) counts in 1.1 ms spread
#: against 4.1 ms as is, and its ``xint8`` calibration takes 75 against 158 ms a batch of 64.
#: Both give the same counts.
DEVICE_COUNTING_WAYS = ("bincount", "zero_spread")
DEVICE_COUNTING = "zero_spread"

#: Extra bins the zero bin's values are spread over on an accelerator (a power of two).
ZERO_SPREAD = 1024

#: Interleaved copies of the counts a CPU count spreads consecutive values over (value ``i``
#: counts in copy ``i mod COUNT_LANES``), summed at the end. ``torch.bincount`` adds one to
#: a count per value, and when consecutive values share a bin (the runs of zeros after a
#: ReLU, 43-50% of the values) each addition waits for the last one's store. Spread over 8
#: copies the additions are independent: 0.48-0.53 against 0.9 ns per value on one thread,
#: whatever the data (docs/benchmarks.md).
COUNT_LANES = 8

#: Unused counts between two copies. Copies exactly ``bins`` apart (a power of two) put one
#: bin's 8 counts in the same L1 cache set, and a run of zeros then missed the cache on every
#: addition (2.4 against 0.5 ns per value); one 64-byte line apart they do not.
LANE_GAP = 8

#: Below this many values a chunk is counted without copies: zeroing and summing the copies
#: costs more than the waits it saves (crossover measured at 12-16 Ki values).
LANE_MIN_VALUES = 1 << 14


def histogram_counts(x: torch.Tensor, grid: HistogramGrid) -> torch.Tensor:
    """int64 counts of ``x``'s values on ``grid`` (all inside it), computed on ``x``'s device.

    A value's bin is ``floor(x * 2**-e) - offset``: exact in float32 when
    ``grid.float32_exact`` (float32 data), exact in float64 always, so the counts equal
    ``quant_core.observers.binning.bin_counts`` on the same values. On the CPU the binning's
    elementwise steps run on torch's threads and one thread counts the bins with
    ``torch.bincount`` (:func:`_cpu_counts`): no parallel region waits on another thread
    per chunk, which is what collapsed when other work shared the cores, and the copies of
    the counts make the one thread faster than the two-thread scatter-add it replaced.

    Example:
        >>> g = HistogramGrid(exponent=-1, offset=-2, bins=4)  # edges -1, -0.5, 0, 0.5, 1
        >>> histogram_counts(torch.tensor([-1.0, -0.01, 0.0, 0.99]), g).tolist()
        [1, 1, 1, 1]
    """
    flat = x.reshape(-1)
    if not (flat.dtype == torch.float32 and grid.float32_exact):
        flat = flat.to(torch.float64)
    if flat.device.type != "cpu":
        return _device_counts(bin_indices(flat, grid), grid)
    return torch.from_numpy(_cpu_counts(flat, grid))


def _host_counts(x: torch.Tensor, grid: HistogramGrid) -> np.ndarray:
    """:func:`histogram_counts` as the numpy array an observer takes."""
    return histogram_counts(x, grid).cpu().numpy()


def _device_counts(index: torch.Tensor, grid: HistogramGrid) -> torch.Tensor:
    """Counts of the int64 ``index`` (all in ``[0, bins)``) on an accelerator
    (:data:`DEVICE_COUNTING`). Spread, the value at position ``i`` of the zero bin counts in
    extra bin ``bins + i mod ZERO_SPREAD``: whole rows of ``ZERO_SPREAD`` values take their
    lanes by broadcasting one row of them, the last partial row by a second count."""
    zero_bin = -grid.offset  # 0.0 lands in bin -offset (scaled_bins)
    if DEVICE_COUNTING != "zero_spread" or not 0 <= zero_bin < grid.bins:
        return torch.bincount(index, minlength=grid.bins)
    lanes = _spread_lanes(grid.bins, index.device)
    whole = index.numel() - index.numel() % ZERO_SPREAD
    rows = index[:whole].view(-1, ZERO_SPREAD)
    spread = torch.bincount(torch.where(rows == zero_bin, lanes, rows).view(-1), minlength=grid.bins + ZERO_SPREAD)
    if whole < index.numel():
        rest = index[whole:]
        spread += torch.bincount(
            torch.where(rest == zero_bin, lanes[: rest.numel()], rest), minlength=grid.bins + ZERO_SPREAD
        )
    counts = spread[: grid.bins].clone()
    counts[zero_bin] += spread[grid.bins :].sum()
    return counts


_lanes: dict[tuple[torch.device, int], torch.Tensor] = {}


def _spread_lanes(bins: int, device: torch.device) -> torch.Tensor:
    """The extra bins ``bins + j`` for ``j < ZERO_SPREAD`` on ``device``, made once."""
    held = _lanes.get((device, bins))
    if held is None:
        held = torch.arange(bins, bins + ZERO_SPREAD, device=device)
        _lanes[(device, bins)] = held
    return held


def _cpu_counts(flat: torch.Tensor, grid: HistogramGrid) -> np.ndarray:
    """Counts on the CPU, ``CPU_CHUNK`` values at a time: the bins as int16 (int32 when they
    do not fit; 0.2 ns per value less to convert and read than int64), offset by their copy
    (:data:`COUNT_LANES`) in tensors of at least :data:`LANE_MIN_VALUES` values, and counted
    by ``torch.bincount`` into one running total.

    Example:
        >>> g = HistogramGrid(exponent=0, offset=0, bins=3)
        >>> _cpu_counts(torch.zeros(LANE_MIN_VALUES), g).tolist()  # one long run: spread
        [16384, 0, 0]
    """
    stride = grid.bins + LANE_GAP
    # Copies only while their bins fit int16 (up to 4088 bins): wider counts cost more to
    # zero and sum per chunk than the waits they save.
    lanes = COUNT_LANES if flat.numel() >= LANE_MIN_VALUES and COUNT_LANES * stride <= 1 << 15 else 1
    width = lanes * stride if lanes > 1 else grid.bins
    dtype = torch.int16 if width <= 1 << 15 else torch.int32
    scaled, narrow = _chunk_buffers(flat.dtype, dtype)
    offsets = _lane_offsets(stride, dtype) if lanes > 1 else None
    total: torch.Tensor | None = None
    for start in range(0, flat.numel(), CPU_CHUNK):
        values = flat if flat.numel() <= CPU_CHUNK else flat[start : start + CPU_CHUNK]
        m = values.numel()
        index = narrow[:m].copy_(scaled_bins(values, grid, scaled[:m]))
        if offsets is not None:
            index.add_(offsets[:m])
        counts = torch.bincount(index, minlength=width)
        if counts.numel() != width:  # bincount grows past minlength for an index >= width
            raise AssertionError("histogram: values fall outside the grid")
        total = counts if total is None else total.add_(counts)
    assert total is not None  # histogram_counts is never called with an empty tensor
    if lanes == 1:
        return total.numpy()
    # Summed over whole copies, gaps included, and checked on the host: one torch call.
    summed = total.view(lanes, stride).sum(0).numpy()
    if summed[grid.bins :].any():  # a bin past the grid landed in a gap: the grid is wrong
        raise AssertionError("histogram: values fall outside the grid")
    return summed[: grid.bins]


_offsets: dict[tuple[int, torch.dtype], torch.Tensor] = {}


def _lane_offsets(stride: int, dtype: torch.dtype) -> torch.Tensor:
    """``(i mod COUNT_LANES) * stride`` for ``i < CPU_CHUNK``, made once per stride."""
    held = _offsets.get((stride, dtype))
    if held is None or held.numel() < CPU_CHUNK:
        held = (torch.arange(CPU_CHUNK) % COUNT_LANES * stride).to(dtype)
        _offsets[(stride, dtype)] = held
    return held


_buffers = threading.local()


def _chunk_buffers(values: torch.dtype, bins: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """This thread's ``CPU_CHUNK``-long buffers of scaled ``values`` and of ``bins``, made
    once. Fresh buffers of a few MB are fresh pages, and faulting them in cost more than the
    binning itself on tensors of 100-200 K values (up to 5 ns per value)."""
    held: dict[str, torch.Tensor] = _buffers.__dict__
    for kind in (values, bins):
        key = str(kind)
        if key not in held or held[key].numel() < CPU_CHUNK:
            held[key] = torch.empty(CPU_CHUNK, dtype=kind)
    return held[str(values)], held[str(bins)]


def scaled_bins(values: torch.Tensor, grid: HistogramGrid, out: torch.Tensor | None = None) -> torch.Tensor:
    """The bin of each of the 1-d ``values`` on ``grid`` as a float of the values' dtype
    that converts to the integer bin by truncation (computed in ``out`` when given).

    Example:
        >>> scaled_bins(torch.tensor([-1.0, -0.25, 0.0, 0.75]), HistogramGrid(exponent=-1, offset=-2, bins=4)).tolist()
        [0.0, 1.0, 2.0, 3.0]
        >>> scaled_bins(torch.tensor([0.0, 0.75]), HistogramGrid(exponent=-1, offset=0, bins=4)).tolist()  # truncated later
        [0.0, 1.5]
    """
    scaled = torch.mul(values, grid.inv_width, out=out)  # exact: a power of two that cannot underflow here
    if grid.offset < 0:
        scaled.floor_()  # for values >= 0 the integer conversion's truncation is the floor
        if grid.exponent > 0:
            # A tiny negative value underflows to -0.0, whose floor is 0; its bin is -1's
            # (quant_core.observers.binning's rule, which the counts must match).
            scaled.masked_fill_((scaled == 0) & (values < 0), -1.0)
    if grid.offset != 0:
        # Exact: ``scaled`` and the integer ``offset`` are multiples of min(ulp(scaled), 1) and
        # differ by less than ``bins``, so the difference needs no rounding (the numpy path
        # subtracts the same way); it is >= 0, where conversion truncates to the floor.
        scaled.sub_(grid.offset)
    return scaled


def bin_indices(values: torch.Tensor, grid: HistogramGrid) -> torch.Tensor:
    """int64 bin of each of the 1-d ``values`` on ``grid``.

    Example:
        >>> bin_indices(torch.tensor([-1.0, -0.01, 0.0, 0.99]), HistogramGrid(exponent=-1, offset=-2, bins=4)).tolist()
        [0, 1, 2, 3]
    """
    return scaled_bins(values, grid).to(torch.int64)


def _finite_pair(lo: torch.Tensor, hi: torch.Tensor) -> tuple[float, float]:
    if lo.device.type == "cpu":  # float32/float64 to a Python float is exact
        return float(lo.item()), float(hi.item())
    values = torch.stack((lo.to(torch.float64), hi.to(torch.float64))).tolist()
    return float(values[0]), float(values[1])


def observe(observer: Observer, x: torch.Tensor) -> None:
    """Fold one batch of ``x`` into ``observer`` (any kind), reducing it on its device.

    Empty tensors are ignored; NaN or infinite values raise ``DataError`` (from the
    observer's range check).
    """
    with observer_threads():
        _observe(observer, x)


def _as_float(x: torch.Tensor) -> torch.Tensor:
    data = x.detach() if x.requires_grad else x
    if not data.is_floating_point():
        return data.to(torch.float64)
    if data.dtype not in (torch.float32, torch.float64):
        return data.to(torch.float32)  # float16/bfloat16 widen exactly
    return data


def _observe(observer: Observer, x: torch.Tensor) -> None:
    data = _as_float(x)
    if data.numel() == 0:
        return
    if isinstance(observer, HistogramObserver):
        if data.device.type == "cpu" and native_counter() is not None:
            observer.update(data.numpy())  # one native pass: range and counts (quant_core)
            return
        lo, hi = _finite_pair(*torch.aminmax(data))
        # The observer checks the range (finite) before it asks for the counts.
        observer.update_counted(lo, hi, lambda grid: _host_counts(data, grid))
        return
    axis = observer.spec.channel_axis
    lo_t, hi_t = channel_min_max(data, axis)
    if axis is None:
        lo, hi = _finite_pair(lo_t, hi_t)
        observer.update_range(lo, hi)  # type: ignore[attr-defined]
    else:
        _update_range(observer, lo_t, hi_t)


def _update_range(observer: Observer, lo: torch.Tensor, hi: torch.Tensor) -> None:
    """Hand a range reduced on the device (0-d or per channel) to ``observer``, one transfer."""
    both = torch.stack((lo, hi)).to(torch.float64).cpu().numpy()
    observer.update_range(np.asarray(both[0]), np.asarray(both[1]))  # type: ignore[attr-defined]


class PendingRange:
    """A min-max observer's running min and max (0-d, or one per channel) kept on the
    batches' device, so that observing a batch needs no host round trip: on a GPU each
    ``.item()`` or copy to the host waits for the device's queue to empty, once per observed
    tensor and batch. The fold is exact in any grouping (:class:`MinMaxObserver`). A batch
    whose range holds NaN, an infinity or a value beyond float32 is left out of the fold
    and counted, on the device; :meth:`flush_into` hands the other batches' range over and
    then refuses, as the observer refuses such a batch when fed directly.

    Example:
        >>> from quant_core.observers import make_observer
        >>> from quant_core.spec import QuantSpec
        >>> pending = PendingRange()
        >>> pending.add(torch.tensor(-1.0), torch.tensor(0.5)), pending.add(torch.tensor(-0.5), torch.tensor(2.0))
        (True, True)
        >>> obs = make_observer(QuantSpec(dtype="int8"))
        >>> pending.flush_into(obs)
        >>> [float(v) for v in obs.range()]
        [-1.0, 2.0]
    """

    def __init__(self) -> None:
        self.lo: torch.Tensor | None = None  # the batches folded so far, finite ones only
        self.hi: torch.Tensor | None = None
        self.refused: torch.Tensor | None = None  # how many batches were left out
        # Batches not folded yet, folded FOLD_EVERY at a time: the check and the fold are a
        # few small ops, which a batch at a time would cost as much as the reduction.
        self._los: list[torch.Tensor] = []
        self._his: list[torch.Tensor] = []

    def add(self, lo: torch.Tensor, hi: torch.Tensor) -> bool:
        """Fold one batch's range in; False (nothing folded) when its shape differs from the
        earlier batches' (a change of channel count: the observer must see it and refuse it),
        it lies on another device or has another dtype (the caller then hands over and
        observes at once)."""
        first = self._los[0] if self._los else self.lo
        if first is not None and (lo.shape != first.shape or lo.device != first.device or lo.dtype != first.dtype):
            return False
        self._los.append(lo)
        self._his.append(hi)
        if len(self._los) >= FOLD_EVERY:
            self._fold()
        return True

    def _fold(self) -> None:
        if not self._los:
            return
        los, his = torch.stack(self._los), torch.stack(self._his)
        self._los, self._his = [], []
        rows = los.shape[0]
        # NaN compares False, so one test refuses NaN, infinities and values beyond float32.
        kept = (los.reshape(rows, -1).abs() <= FLOAT32_MAX).all(1) & (his.reshape(rows, -1).abs() <= FLOAT32_MAX).all(1)
        kept_rows = kept.reshape(rows, *([1] * (los.dim() - 1)))
        lo = torch.where(kept_rows, los, torch.inf).amin(0)  # no batch kept: +inf > -inf
        hi = torch.where(kept_rows, his, -torch.inf).amax(0)
        refused = (~kept).sum()
        if self.lo is None or self.hi is None or self.refused is None:
            self.lo, self.hi, self.refused = lo, hi, refused
        else:
            self.lo, self.hi = torch.minimum(self.lo, lo), torch.maximum(self.hi, hi)
            self.refused = self.refused + refused

    def flush_into(self, observer: Observer) -> None:
        """Hand the range to ``observer`` (one transfer); then raise DataError when batches
        were left out for NaN, infinities or values beyond float32."""
        self._fold()
        if self.lo is None or self.hi is None or self.refused is None:
            return
        both = torch.stack((self.lo, self.hi)).to(torch.float64).cpu().numpy()
        refused = int(self.refused)
        if bool((both[0] <= both[1]).all()):  # some batch was kept
            observer.update_range(np.asarray(both[0]), np.asarray(both[1]))  # type: ignore[attr-defined]
        if refused:
            raise DataError(
                f"range: {refused} batch(es) held NaN, infinite values or values beyond the float32 range "
                "and were left out; calibration data must be finite"
            )


#: The most batches' ranges a :class:`PendingRange` holds before folding them (a bound on
#: what it keeps alive between reads).
FOLD_EVERY = 64


#: Where :func:`observe_later` keeps a running range until the observer is read: ``"all"``
#: devices, ``"accelerators"`` (every device but the CPU) or ``"none"`` (batch by batch
#: everywhere: what ``tools/bench/cuda.py`` compares against). On an accelerator each batch's
#: transfer would wait for the device; on the CPU handing each batch's range to the observer
#: (two ``.item()`` calls, the observer's checks) cost about 60 us of Python an observed
#: tensor in place, where the interpreter runs with caches the convolutions just filled:
#: 15 ms of a 4-batch pass of the 32-pixel reference model, 13% of its calibration
#: (docs/benchmarks.md).
KEEP_STATISTICS_ON = "all"


def observe_later(observer: Observer, x: torch.Tensor, pending: PendingRange | None) -> PendingRange | None:
    """Fold ``x`` into ``pending`` (started when None), the running range of ``observer``
    kept on ``x``'s device, and return it; :meth:`PendingRange.flush_into` hands it over.
    Returns None, folding nothing, when ``x`` is to be observed at once instead: a device
    :data:`KEEP_STATISTICS_ON` leaves out, an observer that is not a min-max one (a
    histogram's grid follows the range on the host; a moving average folds in order), a
    change of channel count. The caller then flushes ``pending`` and calls :func:`observe`.
    The reduction runs on one thread while the machine is busy, as :func:`observe`'s.

    Example:
        >>> from quant_core.observers import make_observer
        >>> from quant_core.spec import QuantSpec
        >>> observer = make_observer(QuantSpec(dtype="int8"))
        >>> pending = observe_later(observer, torch.tensor([1.0, -2.0]), None)
        >>> pending.flush_into(observer)
        >>> [float(v) for v in observer.range()]
        [-2.0, 1.0]
    """
    keep = KEEP_STATISTICS_ON == "all" or (KEEP_STATISTICS_ON == "accelerators" and x.device.type != "cpu")
    if not keep or not isinstance(observer, MinMaxObserver):
        return None  # before any conversion: observe() converts the batch itself
    data = _as_float(x)
    if data.numel() == 0:
        return pending
    with observer_threads():
        lo, hi = channel_min_max(data, observer.spec.channel_axis)
    running = pending if pending is not None else PendingRange()
    return running if running.add(lo, hi) else None
