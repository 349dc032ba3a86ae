"""HistogramObserver: exact binning, canonical grid growth, exact merging, state."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from quant_core.observer_config import MSE, Entropy, Percentile, PowerOfTwoMSE
from quant_core.observers import HistogramGrid, HistogramObserver, MinMaxObserver, Observer, make_observer
from quant_core.observers._input import FLOAT32_MAX
from quant_core.observers.binning import bin_counts
from quant_core.observers.grid import rebin
from quant_core.spec import QuantSpec

# Every test here runs with the native count and with numpy's (conftest.each_counting_path).
pytestmark = pytest.mark.usefixtures("each_counting_path")

BINS = 64
finite32 = st.floats(allow_nan=False, allow_infinity=False, width=32)
# Mostly moderate values, with the full float32 range (subnormals, huge) mixed in.
values32 = st.one_of(st.floats(-8.0, 8.0, width=32), finite32)
batches = hnp.arrays(np.float32, st.integers(1, 40), elements=values32)

SPECS = [
    QuantSpec(dtype="int8", observer=Percentile(99.0, bins=BINS)),
    QuantSpec(dtype="uint8", symmetric=False, observer=Percentile(99.0, bins=BINS)),
    QuantSpec(dtype="int8", observer=Entropy(bins=BINS, num_quantized_bins=16)),
    QuantSpec(dtype="uint8", symmetric=False, observer=MSE(bins=BINS, num_candidates=20)),
    QuantSpec(dtype="int8", scale_type="power_of_two", observer=PowerOfTwoMSE(bins=BINS)),
]


def observe(spec: QuantSpec, *parts: np.ndarray) -> HistogramObserver:
    obs = HistogramObserver(spec)
    for part in parts:
        obs.update(part)
    return obs


def reference_counts(x: np.ndarray, grid: HistogramGrid) -> np.ndarray:
    """numpy.histogram on the grid's exact edges (x is inside, below the last edge)."""
    counts, _ = np.histogram(x.astype(np.float64), bins=grid.edges())
    return counts


finite64 = st.one_of(
    st.floats(-3e38, 3e38, allow_nan=False), st.floats(-1e-300, 1e-300), st.floats(-8.0, 8.0, allow_nan=False)
)


@given(
    x=st.one_of(
        hnp.arrays(np.float32, st.integers(1, 200), elements=values32),
        hnp.arrays(np.float64, st.integers(1, 200), elements=finite64),
    )
)
@settings(max_examples=200)
def test_counts_match_numpy_histogram_on_the_canonical_edges(x: np.ndarray) -> None:
    grid = HistogramGrid.covering(float(x.min()), float(x.max()), BINS)
    assert grid.contains(float(x.min()), float(x.max()))
    np.testing.assert_array_equal(bin_counts(x, grid), reference_counts(x, grid))


def test_binning_edge_cases_are_exact() -> None:
    tiny = np.float32(np.finfo(np.float32).smallest_subnormal)
    # Width > 1: a tiny negative value scales to -0.0 but belongs below 0.
    x = np.array([-tiny, tiny, 0.0, 3000.0, -2999.0], np.float32)
    grid = HistogramGrid.covering(float(x.min()), float(x.max()), BINS)
    assert grid.exponent > 0
    np.testing.assert_array_equal(bin_counts(x, grid), reference_counts(x, grid))
    # Values sitting exactly on edges, in float32 and float64.
    edges = HistogramGrid.covering(-1.0, 1.0, 16).edges()[:-1]
    for dtype in (np.float32, np.float64):
        np.testing.assert_array_equal(
            bin_counts(edges.astype(dtype), HistogramGrid.covering(-1.0, 1.0, 16)), np.ones(16)
        )


def test_chunked_binning_matches_one_shot() -> None:
    x = np.random.default_rng(0).standard_normal(300_001).astype(np.float32)
    grid = HistogramGrid.covering(float(x.min()), float(x.max()), 2048)
    np.testing.assert_array_equal(bin_counts(x, grid), reference_counts(x, grid))


@given(lo=finite32, hi=finite32, extra=finite32)
@settings(max_examples=200)
def test_grid_is_minimal_and_monotone(lo: float, hi: float, extra: float) -> None:
    lo, hi = min(lo, hi), max(lo, hi)
    grid = HistogramGrid.covering(lo, hi, BINS)
    assert grid.contains(lo, hi) and abs(grid.offset) <= 1 << 24
    if grid.exponent > -149:
        finer = HistogramGrid.covering(lo, hi, BINS, min_exponent=grid.exponent - 1)
        assert finer.exponent == grid.exponent  # nothing finer covers the range
    wider = HistogramGrid.covering(min(lo, extra), max(hi, extra), BINS)
    assert wider.exponent >= grid.exponent


@given(
    center=st.floats(1.0, 2.0**20),
    sign=st.sampled_from([1.0, -1.0]),
    finer=st.integers(-3, 6),
    steps=st.lists(st.integers(0, 3 * BINS), min_size=2, max_size=6),
)
@settings(max_examples=300)
def test_narrow_ranges_far_from_zero_keep_the_grid_monotone(
    center: float, sign: float, finer: int, steps: list[int]
) -> None:
    """Values in a band a few thousand steps of 2**-24 of their magnitude wide, where the
    offset limit decides the exponent: each sub-range's grid is no coarser than the union's,
    so batches in any order, or merged, count the same."""
    width = 2.0 ** (math.frexp(center)[1] - 24 - finer)
    values = [sign * (center + width * k) for k in steps]
    union = HistogramGrid.covering(min(values), max(values), BINS)
    for i in range(len(values)):
        for j in range(i, len(values)):
            part = values[i : j + 1]
            assert HistogramGrid.covering(min(part), max(part), BINS).exponent <= union.exponent


def test_a_batch_order_far_from_zero_changes_no_count() -> None:
    """Found by a review: 16 + 2**-19 alone took exponent -19, with 16 beside it -20, so
    streaming or merging kept the coarser grid that one pass would not choose."""
    w = 2.0**-20
    a = np.array([16 + 2 * w])
    b = 16 + w * np.array([0.0] * 90 + [1.5] * 10)
    spec = QuantSpec(dtype="uint16", symmetric=False, observer=Percentile(60.0, bins=2048))
    single = observe(spec, np.concatenate([a, b]))
    merged = observe(spec, a)
    merged.merge(observe(spec, b))
    for other in (observe(spec, a, b), observe(spec, b, a), merged):
        assert other.grid == single.grid
        np.testing.assert_array_equal(other.counts, single.counts)
        assert other.qparams() == single.qparams()


def test_rebin_is_exact_pair_merging() -> None:
    counts = np.arange(1, 9, dtype=np.int64)
    src = HistogramGrid(exponent=0, offset=-3, bins=8)  # [-3, 5)
    out = rebin(counts, src, HistogramGrid(exponent=1, offset=-2, bins=8))  # [-4, 12)
    assert out.tolist() == [1, 2 + 3, 4 + 5, 6 + 7, 8, 0, 0, 0]
    with pytest.raises(ValueError, match="outside"):
        rebin(counts, src, HistogramGrid(exponent=1, offset=0, bins=8))


@given(a=batches, b=batches, spec=st.sampled_from(SPECS))
@settings(max_examples=80)
def test_merge_equals_single_pass(a: np.ndarray, b: np.ndarray, spec: QuantSpec) -> None:
    """Stronger than 'within one bin': the grid is a function of the overall min and
    max, so merged, streamed and single-pass histograms are identical."""
    left, right = observe(spec, a), observe(spec, b)
    left.merge(right)
    single = observe(spec, np.concatenate([a, b]))
    streamed = observe(spec, a, b)
    for other in (single, streamed):
        assert left.grid == other.grid
        np.testing.assert_array_equal(left.counts, other.counts)
        assert (left.min_val, left.max_val) == (other.min_val, other.max_val)
    assert int(left.counts.sum()) == a.size + b.size
    lo, hi = left.range()
    single_lo, single_hi = single.range()
    assert single.grid is not None
    width = single.grid.width
    assert abs(float(lo) - float(single_lo)) <= width and abs(float(hi) - float(single_hi)) <= width
    assert left.qparams() == single.qparams()


def test_merge_with_empty_and_into_empty() -> None:
    spec = SPECS[0]
    full = observe(spec, np.linspace(-1, 1, 11, dtype=np.float32))
    empty = HistogramObserver(spec)
    full.merge(empty)
    empty.merge(full)
    assert empty.grid == full.grid and np.array_equal(empty.counts, full.counts)


def test_growth_keeps_counts_and_exact_extremes() -> None:
    spec = SPECS[0]
    obs = observe(spec, np.array([0.0], np.float32))
    assert obs.grid is not None and obs.grid.exponent == -149
    obs.update(np.array([1e-3, -2e-3], np.float32))
    obs.update(np.array([1e4], np.float32))
    assert int(obs.counts.sum()) == 4
    assert (obs.min_val, obs.max_val) == (float(np.float32(-2e-3)), 1e4)
    x = np.array([0.0, 1e-3, -2e-3, 1e4], np.float32)
    np.testing.assert_array_equal(obs.counts, reference_counts(x, obs.grid))


def test_update_histogram_matches_update() -> None:
    spec = QuantSpec(dtype="int8", observer=MSE(bins=256))
    rng = np.random.default_rng(4)
    direct, fed = HistogramObserver(spec), HistogramObserver(spec)
    for scale in (1.0, 3.0, 0.5):
        x = (rng.standard_normal(1000) * scale).astype(np.float32)
        direct.update(x)
        lo, hi = float(x.min()), float(x.max())
        grid = fed.grid_for(lo, hi)
        idx = (np.floor(x.astype(np.float64) * grid.inv_width) - grid.offset).astype(np.int64)
        fed.update_histogram(np.bincount(idx, minlength=grid.bins), grid, lo, hi)
    assert direct.grid == fed.grid and np.array_equal(direct.counts, fed.counts)
    grid = fed.grid_for(0.0, 1.0)
    with pytest.raises(ValueError, match="expected"):
        fed.update_histogram(np.zeros(3, np.int64), grid, 0.0, 1.0)
    with pytest.raises(ValueError, match="non-negative"):
        fed.update_histogram(-np.ones(256, np.int64), grid, 0.0, 1.0)
    with pytest.raises(ValueError, match="outside the grid"):
        fed.update_histogram(np.ones(256, np.int64), grid, 0.0, 1e9)


def test_update_counted_matches_update_and_changes_nothing_when_counting_fails() -> None:
    spec = QuantSpec(dtype="int8", observer=MSE(bins=256))
    rng = np.random.default_rng(5)
    direct, counted = HistogramObserver(spec), HistogramObserver(spec)
    for scale in (1.0, 3.0, 0.5, 40.0):
        x = (rng.standard_normal(1000) * scale).astype(np.float32)
        direct.update(x)
        counted.update_counted(float(x.min()), float(x.max()), lambda grid, x=x: reference_counts(x, grid))
    assert direct.grid == counted.grid and np.array_equal(direct.counts, counted.counts)
    assert (direct.min_val, direct.max_val) == (counted.min_val, counted.max_val)
    before = counted.state_dict()
    for bad, message in (
        (lambda grid: np.zeros(3, np.int64), "expected"),
        (lambda grid: -np.ones(256, np.int64), "non-negative"),
    ):
        with pytest.raises(ValueError, match=message):
            counted.update_counted(-1e3, 1e3, bad)
    with pytest.raises(ValueError, match="finite"):
        counted.update_counted(0.0, float("inf"), lambda grid: np.ones(256, np.int64))
    after = counted.state_dict()
    assert np.array_equal(before["counts"], after["counts"]) and before["min_val"] == after["min_val"]


@settings(max_examples=300, deadline=None)
@given(batches, st.floats(-1e3, 1e3), st.floats(0.0, 1e3), st.booleans())
@example(np.float32([0.0, -3.3496548e38]), 0.0, 0.0, False)  # the grid's lower edge lies beyond float32
@example(np.float32([0.0]), 0.0, 5e-324, False)  # a span whose division by the bins underflows
def test_a_grid_that_already_holds_the_range_is_the_canonical_one(
    seen: np.ndarray, lo: float, span: float, clamp: bool
) -> None:
    """``grid_for`` answers a range inside the current grid without searching; the answer
    equals the search's, also after ``clamped`` narrowed the range inside the grid."""
    obs: Observer = HistogramObserver(QuantSpec(dtype="int8", observer=MSE(bins=BINS)))
    obs.update(seen)
    if clamp:
        obs = obs.clamped(float(np.quantile(seen, 0.3)), float(np.quantile(seen, 0.7)))
    assert isinstance(obs, HistogramObserver) and obs.grid is not None
    assert obs.min_val is not None and obs.max_val is not None
    for a, b in ((lo, lo + span), (obs.min_val, obs.max_val), (obs.grid.lower, obs.grid.lower)):
        if abs(a) > FLOAT32_MAX:  # not a range of float32 data: refused (checked below)
            with pytest.raises(ValueError, match="float32 range"):
                obs.grid_for(a, b)
            continue
        expected = HistogramGrid.covering(
            min(a, obs.min_val), max(b, obs.max_val), BINS, min_exponent=obs.grid.exponent
        )
        assert obs.grid_for(a, b) == expected


@pytest.mark.parametrize("spec", SPECS)
def test_state_dict_round_trip_is_exact(spec: QuantSpec) -> None:
    obs = HistogramObserver(spec)
    assert Observer.from_state_dict(obs.state_dict()).empty
    obs.update(np.random.default_rng(5).standard_normal(5000).astype(np.float32))
    restored = Observer.from_state_dict(obs.state_dict())
    assert isinstance(restored, HistogramObserver)
    assert restored.grid == obs.grid and np.array_equal(restored.counts, obs.counts)
    assert (restored.min_val, restored.max_val) == (obs.min_val, obs.max_val)
    assert restored.qparams() == obs.qparams()


def test_memory_does_not_grow_with_batches() -> None:
    obs = HistogramObserver(QuantSpec(dtype="int8", observer=Percentile(bins=2048)))
    rng = np.random.default_rng(6)
    sizes = set()
    for i in range(200):
        obs.update((rng.standard_normal(1000) * (1 + i)).astype(np.float32))
        state = obs.state_dict()
        sizes.add(sum(v.nbytes for v in state.values() if isinstance(v, np.ndarray)))
    assert sizes == {2048 * 8}
    assert int(obs.counts.sum()) == 200 * 1000


@pytest.mark.parametrize(("bad", "message"), [(np.nan, "NaN"), (np.inf, "infinite"), (-np.inf, "infinite")])
def test_non_finite_input_is_rejected_and_leaves_state_alone(bad: float, message: str) -> None:
    obs = observe(SPECS[0], np.array([1.0, 2.0], np.float32))
    before = obs.counts.copy()
    with pytest.raises(ValueError, match=message):
        obs.update(np.array([0.0, bad], np.float32))
    np.testing.assert_array_equal(obs.counts, before)
    with pytest.raises(ValueError, match="float32 range"):
        obs.update(np.array([1e300]))


def test_invalid_use_raises_clear_errors() -> None:
    with pytest.raises(ValueError, match="allowed: entropy, minmse_pow2, mse, percentile"):
        HistogramObserver(QuantSpec(dtype="int8"))
    with pytest.raises(ValueError, match="no data observed"):
        HistogramObserver(SPECS[0]).qparams()
    with pytest.raises(ValueError, match="different specs"):
        HistogramObserver(SPECS[0]).merge(HistogramObserver(SPECS[1]))
    with pytest.raises(TypeError, match="cannot merge"):
        HistogramObserver(SPECS[0]).merge(MinMaxObserver(QuantSpec(dtype="int8")))
    with pytest.raises(ValueError, match="dtype"):
        make_observer(QuantSpec(dtype="bf16"))


def test_empty_batches_are_ignored_and_other_dtypes_accepted() -> None:
    obs = HistogramObserver(SPECS[0])
    obs.update(np.zeros(0, np.float32))
    assert obs.empty
    obs.update(np.array([1, -2, 3], np.int32))
    obs.update(np.array([0.5], np.float16))
    assert int(obs.counts.sum()) == 4 and (obs.min_val, obs.max_val) == (-2.0, 3.0)


@pytest.mark.parametrize("spec", [QuantSpec(dtype="int8"), SPECS[0]], ids=["minmax", "histogram"])
def test_every_float_layout_keeps_its_precision_and_non_numbers_are_refused(spec: QuantSpec) -> None:
    """Found by a review: big-endian float64 and long double were narrowed to float32
    (16777217 read as 16777216; a finite 1e39 refused as infinite); a timedelta passed as
    an integer; a ragged list raised numpy's ValueError."""
    for layout in ("<f8", ">f8", np.longdouble):
        obs = make_observer(spec)
        obs.update(np.array([0.1, 16777217.0], layout))
        assert (obs.min_val, obs.max_val) == (0.1, 16777217.0), layout
    obs = make_observer(spec)
    obs.update(np.array([0.1, 3.0], ">f4"))
    assert (obs.min_val, obs.max_val) == (float(np.float32(0.1)), 3.0)
    with pytest.raises(ValueError, match="exceed the float32 range"):
        make_observer(spec).update(np.array([1e39], np.longdouble))
    with pytest.raises(ValueError, match="dtype timedelta64"):
        make_observer(spec).update(np.array([3, 7], "timedelta64[s]"))
    with pytest.raises(ValueError, match="x: not an array"):
        make_observer(spec).update([[1.0], [1.0, 2.0]])


def test_make_observer_dispatches_histogram_methods() -> None:
    for spec in SPECS:
        assert type(make_observer(spec)) is HistogramObserver
