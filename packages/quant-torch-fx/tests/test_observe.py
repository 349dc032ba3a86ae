"""Observers fed from torch tensors (on-device reductions) hold exactly the statistics the
numpy path gives for the same data, for every observer kind."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quant_core.errors import DataError
from quant_core.observer_config import MSE, Entropy, MinMax, MovingAverageMinMax, Percentile, PowerOfTwoMSE
from quant_core.observers import HistogramObserver, MinMaxObserver, make_observer, native
from quant_core.observers.binning import bin_counts, numpy_bin_counts
from quant_core.observers.grid import HistogramGrid
from quant_core.spec import QuantSpec
from quant_torch_fx import observe as observe_module
from quant_torch_fx.observe import bin_indices, histogram_counts, observe
from quant_torch_fx.quantizer import FakeQuantizer

SPECS = {
    "minmax": QuantSpec(dtype="uint8", symmetric=False, observer=MinMax()),
    "minmax_per_channel": QuantSpec(dtype="int8", per_channel_axis=1, observer=MinMax()),
    "moving_average": QuantSpec(dtype="int8", observer=MovingAverageMinMax(0.8)),
    "percentile": QuantSpec(dtype="uint8", symmetric=False, observer=Percentile(99.9, bins=512)),
    "entropy": QuantSpec(dtype="int8", observer=Entropy(bins=512, num_quantized_bins=128)),
    "mse": QuantSpec(dtype="int8", observer=MSE(bins=256, num_candidates=50)),
    "minmse_pow2": QuantSpec(dtype="int8", scale_type="power_of_two", observer=PowerOfTwoMSE(bins=512)),
}


def _batches(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    scales = (0.1, 3.0, 0.5, 40.0)  # the histogram grid has to grow between batches
    return [(rng.standard_normal((4, 6, 5, 5)) * s).astype(np.float32) for s in scales]


@contextmanager
def counting(path: str) -> Iterator[None]:
    """Histograms counted by quant_core's native kernel (``"native"``, skipped where it cannot
    be built) or without it (``"numpy"``: numpy's passes in quant_core, torch's here)."""
    with native.switched(path == "native") as counter:
        if path == "native" and counter is None:
            pytest.skip(native.status())
        yield


@pytest.mark.parametrize("path", ["native", "numpy"])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_torch_feeding_equals_numpy_feeding(name: str, path: str) -> None:
    """Against quant_core's numpy passes: torch's counting, or the native kernel reading the
    tensor's memory (contiguous and channels-last tensors)."""
    spec = SPECS[name]
    reference, fed = make_observer(spec), make_observer(spec)
    batches = _batches(0)
    with counting("numpy"):
        for batch in batches:
            reference.update(batch)
    with counting(path):
        for i, batch in enumerate(batches):
            tensor = torch.from_numpy(batch)
            observe(fed, tensor.contiguous(memory_format=torch.channels_last) if i % 2 else tensor)
    state_ref, state_fed = reference.state_dict(), fed.state_dict()
    assert state_ref.keys() == state_fed.keys()
    for key in state_ref:
        np.testing.assert_array_equal(
            np.asarray(state_fed[key], dtype=object), np.asarray(state_ref[key], dtype=object)
        )
    assert fed.qparams() == reference.qparams()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), exponent=st.integers(-6, 6), bins=st.sampled_from([16, 64, 2048, 65536]))
def test_both_histogram_paths_count_like_quant_core(seed: int, exponent: int, bins: int) -> None:
    # One thread counts int16 bins up to 32768 bins and int32 bins above (65536).
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(3000) * 2.0**exponent).astype(np.float32)
    x[:3] = [0.0, -0.0, -1e-45]  # signed zero and a subnormal next to the zero edge
    obs = HistogramObserver(QuantSpec(dtype="int8", observer=Percentile(99.0, bins=bins)))
    grid = obs.grid_for(float(x.min()), float(x.max()))
    expected = bin_counts(x, grid)
    np.testing.assert_array_equal(histogram_counts(torch.from_numpy(x), grid).numpy(), expected)
    np.testing.assert_array_equal(histogram_counts(torch.from_numpy(x.astype(np.float64)), grid).numpy(), expected)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    zeros=st.floats(0.0, 1.0),
    shift=st.sampled_from([0.0, -0.5, 0.75, 3.0]),
    bins=st.sampled_from([16, 2048]),
)
def test_accelerator_counting_ways_count_like_quant_core(seed: int, zeros: float, shift: float, bins: int) -> None:
    """The accelerator's ways (run here on CPU tensors), with the zero bin crowded or absent
    (a range away from 0): the counts of quant_core's binning, every way."""
    rng = np.random.default_rng(seed)
    x = np.maximum(rng.standard_normal(5000), 0.0).astype(np.float32) + np.float32(shift)
    x[rng.random(5000) < zeros] = 0.0 if shift <= 0 else x.min()
    obs = HistogramObserver(QuantSpec(dtype="int8", observer=Percentile(99.0, bins=bins)))
    grid = obs.grid_for(float(x.min()), float(x.max()))
    expected = bin_counts(x, grid)
    values = torch.from_numpy(x if grid.float32_exact else x.astype(np.float64))  # as histogram_counts bins
    index = observe_module.bin_indices(values, grid)
    default = observe_module.DEVICE_COUNTING
    for way in observe_module.DEVICE_COUNTING_WAYS:
        observe_module.DEVICE_COUNTING = way
        try:
            np.testing.assert_array_equal(observe_module._device_counts(index, grid).numpy(), expected)
        finally:
            observe_module.DEVICE_COUNTING = default


def _deferred_batches(seed: int) -> list[np.ndarray]:
    """Batches whose range grows, shrinks, crosses zero and sits on one side of it."""
    rng = np.random.default_rng(seed)
    out = []
    for scale, shift in ((0.1, 0.0), (3.0, 0.0), (0.5, 2.0), (40.0, -1.0), (1e-3, 5.0)):
        batch = (rng.standard_normal((4, 6, 5, 5)) * scale + shift).astype(np.float32)
        batch[0, 0] = 0.0  # runs of exact zeros, as after a ReLU
        out.append(batch)
    return out


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("fold_every", [2, 64])
def test_statistics_kept_on_the_device_equal_batch_by_batch_feeding(
    name: str, seed: int, fold_every: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A FakeQuantizer keeps a min-max observer's running range on the tensor's device
    (forced here for CPU tensors) and hands it over when its observer is read: the
    observer's state, and its qparams, equal feeding it batch by batch (every other kind is
    fed batch by batch), whether the batches are folded as they come or at the read."""
    monkeypatch.setattr(observe_module, "KEEP_STATISTICS_ON", "all")
    monkeypatch.setattr(observe_module, "FOLD_EVERY", fold_every)
    spec = SPECS[name]
    reference, fq = make_observer(spec), FakeQuantizer(spec, name="x")
    fq.observing = True
    for batch in _deferred_batches(seed):
        observe(reference, torch.from_numpy(batch))
        fq(torch.from_numpy(batch))
    kept_on_device = isinstance(reference, MinMaxObserver)  # a histogram's grid follows the range on the host
    assert (fq._pending is not None) == kept_on_device
    state_ref, state_fed = reference.state_dict(), fq.observer.state_dict()
    assert fq._pending is None
    for key in state_ref:
        np.testing.assert_array_equal(
            np.asarray(state_fed[key], dtype=object), np.asarray(state_ref[key], dtype=object)
        )
    assert fq.observer.qparams() == reference.qparams()


@pytest.mark.parametrize("fold_every", [1, 2, 64])
def test_statistics_kept_on_the_device_refuse_non_finite_values_at_the_read(
    fold_every: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batches with NaN, an infinity or a value beyond float32 are refused when the
    observer is read; the others stay observed, as when each batch is fed directly (a
    review found every batch since the last read dropped with the bad one)."""
    monkeypatch.setattr(observe_module, "KEEP_STATISTICS_ON", "all")
    monkeypatch.setattr(observe_module, "FOLD_EVERY", fold_every)
    cases = (("minmax", float("inf")), ("minmax", float("nan")), ("minmax_per_channel", float("nan")))
    for name, bad in (*cases, ("minmax", 1e39)):
        fq = FakeQuantizer(SPECS[name], name="conv_3")
        fq.observing = True
        dtype = torch.float64 if bad == 1e39 else torch.float32
        fq(torch.ones(2, 3, 4, dtype=dtype))
        fq(torch.tensor([[[1.0, bad, 2.0, 0.0]] * 3] * 2, dtype=dtype))  # kept, not checked yet: no host round trip
        fq(torch.full((2, 3, 4), 5.0, dtype=dtype))
        with pytest.raises(DataError, match=r"calibration: tensor 'conv_3': range: 1 batch\(es\) held NaN, infinite"):
            _ = fq.observer
        lo, hi = fq.observer.range()  # the two finite batches, read again without an error
        assert np.all(np.asarray(lo) == 1.0) and np.all(np.asarray(hi) == 5.0)
    fq = FakeQuantizer(SPECS["minmax"], name="conv_3")
    fq.observing = True
    fq(torch.tensor([float("nan")]))
    with pytest.raises(DataError, match="1 batch"):
        _ = fq.observer
    assert fq.observer.empty  # nothing finite was seen


def test_statistics_kept_on_the_device_keep_each_batch_dtype_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """A later float64 or integer batch is not rounded to the first batch's float32 (a
    review found 16777217 read as 16777216)."""
    monkeypatch.setattr(observe_module, "KEEP_STATISTICS_ON", "all")
    batches = [
        torch.tensor([1.0, 2.0]),
        torch.tensor([0.1], dtype=torch.float64),
        torch.tensor([16777217], dtype=torch.int64),
        torch.tensor([3.0]),
    ]
    fq, reference = FakeQuantizer(SPECS["minmax"], name="x"), make_observer(SPECS["minmax"])
    fq.observing = True
    for batch in batches:
        fq(batch)
        observe(reference, batch)
    assert [float(v) for v in fq.observer.range()] == [float(v) for v in reference.range()] == [0.1, 16777217.0]


def test_a_change_of_channel_count_is_refused_as_batch_by_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(observe_module, "KEEP_STATISTICS_ON", "all")
    fq = FakeQuantizer(SPECS["minmax_per_channel"], name="w")
    fq.observing = True
    fq(torch.randn(2, 6, 3))
    with pytest.raises(DataError, match=r"calibration: tensor 'w': per_channel_axis: batch has 4 channels"):
        fq(torch.randn(2, 4, 3))
    assert fq.observer.range()[0].shape == (6,)  # the first batch's statistics were handed over


def test_a_batch_on_another_device_hands_over_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(observe_module, "KEEP_STATISTICS_ON", "all")
    monkeypatch.setattr(observe_module, "FOLD_EVERY", 1)  # the first batch folded into pending.lo
    fq = FakeQuantizer(SPECS["minmax"], name="x")
    fq.observing = True
    fq(torch.tensor([-1.0, 1.0]))
    pending = fq._pending
    assert pending is not None
    monkeypatch.setattr(pending, "lo", pending.lo.to("meta"))  # stands for another device
    monkeypatch.setattr(pending, "hi", pending.hi.to("meta"))
    monkeypatch.setattr(pending, "flush_into", lambda obs: obs.update_range(-2.0, 0.5))  # meta holds no values
    fq(torch.tensor([0.0, 3.0]))
    assert fq._pending is None
    assert [float(v) for v in fq.observer.range()] == [-2.0, 3.0]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1), shift=st.sampled_from([0.75, 3.0, 1000.0, 2.0**20]), sign=st.sampled_from([1, -1])
)
def test_ranges_away_from_zero_count_like_quant_core(seed: int, shift: float, sign: int) -> None:
    # Grids whose offset is positive (all values above zero) or far below zero: the offset is
    # subtracted in floating point, where a rounding would move values across bin edges.
    rng = np.random.default_rng(seed)
    x = (sign * (shift + rng.random(4000) * shift / 3)).astype(np.float32)
    obs = HistogramObserver(QuantSpec(dtype="int8", observer=Percentile(99.0, bins=2048)))
    grid = obs.grid_for(float(x.min()), float(x.max()))
    x[:64] = np.clip(grid.edges()[1::32][:64], x.min(), x.max()).astype(np.float32)  # values on bin edges
    assert grid.offset != 0
    expected = bin_counts(x, grid)
    np.testing.assert_array_equal(histogram_counts(torch.from_numpy(x), grid).numpy(), expected)
    np.testing.assert_array_equal(histogram_counts(torch.from_numpy(x.astype(np.float64)), grid).numpy(), expected)


def test_tiny_negative_values_on_wide_grids_count_like_quant_core() -> None:
    """Found by a review: on a grid wider than 1 a negative value that underflows to -0.0
    when scaled belongs to the bin below zero (quant_core's rule); torch put it above."""
    x = torch.tensor([-5e-324, -1e-300, 0.0, 5000.0], dtype=torch.float64)
    grid = HistogramGrid(exponent=2, offset=-1, bins=2048)
    expected = numpy_bin_counts(x.numpy(), grid)
    assert expected[0] == 2
    np.testing.assert_array_equal(histogram_counts(x, grid).numpy(), expected)
    np.testing.assert_array_equal(bin_indices(x, grid).numpy(), [0, 0, 1, 1251])


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    size=st.integers(1, 40_000),
    bins=st.sampled_from([16, 2048, 4088, 4090, 20_000]),
    zeros=st.floats(0.0, 0.9),
    chunk=st.sampled_from([None, 5_000]),
)
def test_cpu_counting_equals_the_numpy_binning(
    seed: int, size: int, bins: int, zeros: float, chunk: int | None
) -> None:
    # Sizes on both sides of LANE_MIN_VALUES, bin counts on both sides of what the copies'
    # int16 indices hold (4088), runs of zeros, and several chunks with a ragged last one.
    with pytest.MonkeyPatch.context() as patch:
        if chunk is not None:
            patch.setattr(observe_module, "CPU_CHUNK", chunk)
        _check_counts(seed, size, bins, zeros)


def _check_counts(seed: int, size: int, bins: int, zeros: float) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(size).astype(np.float32)
    x[: int(size * zeros)] = 0.0
    obs = HistogramObserver(QuantSpec(dtype="int8", observer=Percentile(99.0, bins=bins)))
    grid = obs.grid_for(float(x.min()), float(x.max()))
    counts = histogram_counts(torch.from_numpy(x), grid)
    assert counts.dtype == torch.int64
    np.testing.assert_array_equal(counts.numpy(), bin_counts(x, grid))


@pytest.fixture
def torch_threads():
    """Set torch's intra-op thread count for one test, restored after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("chunk", [None, 70_000])
def test_large_batches_count_exactly_on_one_thread_and_on_several(
    chunk: int | None, threads: int, monkeypatch: pytest.MonkeyPatch, torch_threads
) -> None:
    # The elementwise binning on one thread and on several, the count over copies of the
    # counts; skewed data (half of a ReLU's values are one bin) and a length that does not
    # split evenly; with a small chunk, several chunks and a ragged last one.
    torch_threads(threads)
    if chunk is not None:
        monkeypatch.setattr(observe_module, "CPU_CHUNK", chunk)
    rng = np.random.default_rng(5)
    x = np.maximum(rng.standard_normal(200_003), 0).astype(np.float32)
    x[::7] *= -1  # some negative values: the grid's offset is negative
    obs = HistogramObserver(QuantSpec(dtype="int8", observer=Percentile(99.0, bins=2048)))
    grid = obs.grid_for(float(x.min()), float(x.max()))
    np.testing.assert_array_equal(histogram_counts(torch.from_numpy(x), grid).numpy(), bin_counts(x, grid))
    positive = np.abs(x)
    grid = obs.grid_for(float(positive.min()), float(positive.max()))
    np.testing.assert_array_equal(
        histogram_counts(torch.from_numpy(positive), grid).numpy(), bin_counts(positive, grid)
    )


def test_non_finite_values_are_refused_naming_the_problem() -> None:
    obs = make_observer(SPECS["percentile"])
    with pytest.raises(ValueError, match="NaN"):
        observe(obs, torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="infinite"):
        observe(make_observer(SPECS["minmax"]), torch.tensor([1.0, float("inf")]))
    assert obs.empty  # a failed update changes nothing


def test_empty_batches_are_ignored_and_half_precision_widens() -> None:
    obs = make_observer(SPECS["minmax"])
    observe(obs, torch.zeros(0, 3))
    assert obs.empty
    observe(obs, torch.tensor([-1.5, 2.25], dtype=torch.float16))
    assert [float(v) for v in obs.range()] == [-1.5, 2.25]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("way", observe_module.DEVICE_COUNTING_WAYS)
@pytest.mark.parametrize("name", sorted(SPECS))
def test_cuda_feeding_equals_cpu_feeding(name: str, way: str, monkeypatch) -> None:
    monkeypatch.setattr(observe_module, "DEVICE_COUNTING", way)
    spec = SPECS[name]
    cpu, cuda = make_observer(spec), make_observer(spec)
    for batch in _batches(3):
        observe(cpu, torch.from_numpy(batch))
        observe(cuda, torch.from_numpy(batch).cuda())
    assert cuda.qparams() == cpu.qparams()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", sorted(SPECS))
def test_cuda_feeding_kept_until_read_equals_cpu_feeding(name: str) -> None:
    spec = SPECS[name]
    cpu, fq = make_observer(spec), FakeQuantizer(spec, name="x")
    fq.observing = True
    for batch in _deferred_batches(3):
        observe(cpu, torch.from_numpy(batch))
        fq(torch.from_numpy(batch).cuda())
    for key, value in cpu.state_dict().items():
        np.testing.assert_array_equal(
            np.asarray(fq.observer.state_dict()[key], dtype=object), np.asarray(value, dtype=object)
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["minmax", "minmax_per_channel"])
def test_statistics_kept_on_the_gpu_never_wait_for_it(name: str) -> None:
    """Observing a CUDA batch after the first makes no host round trip (torch's sync debug
    mode raises on any): the device's queue is never emptied by calibration."""
    fq = FakeQuantizer(SPECS[name], name="x")
    fq.observing = True
    batches = [torch.from_numpy(b).cuda() for b in _deferred_batches(4)]
    fq(batches[0])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in batches[1:]:
            fq(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    reference = make_observer(SPECS[name])
    for batch in batches:
        observe(reference, batch.cpu())
    assert fq.observer.qparams() == reference.qparams()
