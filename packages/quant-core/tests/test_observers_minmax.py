"""Min-max and moving-average min-max observers."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from quant_core.observer_config import MinMax, MovingAverageMinMax, Percentile
from quant_core.observers import MinMaxObserver, MovingAverageMinMaxObserver, Observer, make_observer
from quant_core.qparams import qparams_from_range
from quant_core.spec import QuantSpec

finite32 = st.floats(allow_nan=False, allow_infinity=False, width=32)
batches = hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=3, max_side=6), elements=finite32)


def per_tensor() -> QuantSpec:
    return QuantSpec(dtype="int8")


@given(a=batches, b=batches)
@settings(max_examples=60, deadline=None)
def test_merge_equals_single_pass_exactly(a: np.ndarray, b: np.ndarray) -> None:
    left, right, single = (MinMaxObserver(per_tensor()) for _ in range(3))
    left.update(a)
    right.update(b)
    left.merge(right)
    single.update(np.concatenate([a.ravel(), b.ravel()]))
    assert [float(v) for v in left.range()] == [float(v) for v in single.range()]
    assert left.qparams() == single.qparams()


@given(
    x=hnp.arrays(np.float32, st.tuples(st.integers(1, 4), st.integers(1, 5), st.integers(1, 3)), elements=finite32),
    axis=st.integers(0, 2),
    split=st.integers(0, 4),
)
@settings(max_examples=60, deadline=None)
def test_per_channel_matches_numpy_and_merges_exactly(x: np.ndarray, axis: int, split: int) -> None:
    spec = QuantSpec(dtype="int8", per_channel_axis=axis)
    other_axes = tuple(i for i in range(3) if i != axis)
    whole = MinMaxObserver(spec)
    whole.update(x)
    lo, hi = whole.range()
    np.testing.assert_array_equal(lo, x.min(axis=other_axes))
    np.testing.assert_array_equal(hi, x.max(axis=other_axes))
    # Split along a non-channel axis, observe the parts separately and merge.
    cut_axis = other_axes[0]
    cut = min(split, x.shape[cut_axis])
    parts = np.split(x, [cut], axis=cut_axis)
    merged = MinMaxObserver(spec)
    for part in parts:
        obs = MinMaxObserver(spec)
        obs.update(part)
        merged.merge(obs)
    assert merged.qparams() == whole.qparams()


def test_update_range_feeds_device_statistics() -> None:
    spec = QuantSpec(dtype="int8", per_channel_axis=1)
    x = np.random.default_rng(0).normal(size=(8, 3, 5)).astype(np.float32)
    direct, fed = MinMaxObserver(spec), MinMaxObserver(spec)
    direct.update(x)
    fed.update_range(x.min(axis=(0, 2)), x.max(axis=(0, 2)))
    assert direct.qparams() == fed.qparams()
    with pytest.raises(ValueError, match="one value per channel"):
        fed.update_range(0.0, 1.0)
    with pytest.raises(ValueError, match="min_val must be <= max_val"):
        fed.update_range([1.0, 1.0, 1.0], [0.0, 2.0, 2.0])
    with pytest.raises(ValueError, match="NaN"):
        fed.update_range([np.nan, 0.0, 0.0], [1.0, 1.0, 1.0])


def test_moving_average_formula() -> None:
    momentum = 0.75
    spec = QuantSpec(dtype="uint8", symmetric=False, observer=MovingAverageMinMax(momentum=momentum))
    obs = MovingAverageMinMaxObserver(spec)
    rng = np.random.default_rng(1)
    batches = [rng.normal(size=100) * rng.uniform(0.5, 3.0) for _ in range(5)]
    expected_lo, expected_hi = float(batches[0].min()), float(batches[0].max())
    for x in batches[1:]:
        expected_lo = momentum * expected_lo + (1 - momentum) * float(x.min())
        expected_hi = momentum * expected_hi + (1 - momentum) * float(x.max())
    for x in batches:
        obs.update(x)
    lo, hi = obs.range()
    assert float(lo) == pytest.approx(expected_lo, rel=1e-12)
    assert float(hi) == pytest.approx(expected_hi, rel=1e-12)
    assert obs.qparams() == qparams_from_range(lo, hi, spec)


def test_moving_average_merge_weights_by_batches() -> None:
    spec = QuantSpec(dtype="int8", per_channel_axis=0, observer=MovingAverageMinMax(momentum=0.5))
    a, b = MovingAverageMinMaxObserver(spec), MovingAverageMinMaxObserver(spec)
    a.update(np.array([[-1.0, 1.0], [-2.0, 2.0]]))
    b.update(np.array([[-3.0, 3.0], [-4.0, 4.0]]))
    b.update(np.array([[-3.0, 3.0], [-4.0, 4.0]]))
    a.merge(b)
    assert a.num_batches == 3
    np.testing.assert_allclose(a.range()[1], [(1 * 1 + 2 * 3) / 3, (1 * 2 + 2 * 4) / 3])
    empty = MovingAverageMinMaxObserver(spec)
    empty.merge(a)
    np.testing.assert_array_equal(empty.range()[0], a.range()[0])


@pytest.mark.parametrize(
    "spec",
    [
        QuantSpec(dtype="int8"),
        QuantSpec(dtype="uint8", symmetric=False, per_channel_axis=0),
        QuantSpec(dtype="int8", per_channel_axis=1, observer=MovingAverageMinMax()),
    ],
)
def test_state_dict_round_trip_is_exact(spec: QuantSpec) -> None:
    obs = make_observer(spec)
    fresh = Observer.from_state_dict(obs.state_dict())
    assert fresh.empty
    obs.update(np.random.default_rng(2).normal(size=(3, 4)))
    restored = Observer.from_state_dict(obs.state_dict())
    assert type(restored) is type(obs) and restored.spec == spec
    assert restored.qparams() == obs.qparams()
    for mine, theirs in zip(obs.range(), restored.range(), strict=True):
        np.testing.assert_array_equal(mine, theirs)


def test_state_size_is_constant() -> None:
    obs = MinMaxObserver(QuantSpec(dtype="int8", per_channel_axis=0))
    rng = np.random.default_rng(3)
    sizes = []
    for _ in range(50):
        obs.update(rng.normal(size=(4, 100)))
        sizes.append(sum(np.asarray(v).nbytes for v in obs.state_dict().values() if isinstance(v, np.ndarray)))
    assert len(set(sizes)) == 1


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_is_rejected(bad: float) -> None:
    obs = MinMaxObserver(per_tensor())
    with pytest.raises(ValueError, match=r"NaN|infinite"):
        obs.update(np.array([0.0, bad], np.float32))
    assert obs.empty


def test_invalid_use_raises_clear_errors() -> None:
    obs = MinMaxObserver(QuantSpec(dtype="int8", per_channel_axis=3))
    with pytest.raises(ValueError, match="per_channel_axis: 3 is out of range"):
        obs.update(np.zeros((2, 2)))
    ch = MinMaxObserver(QuantSpec(dtype="int8", per_channel_axis=0))
    ch.update(np.zeros((2, 2)))
    with pytest.raises(ValueError, match="channels"):
        ch.update(np.zeros((3, 2)))
    with pytest.raises(ValueError, match="no data observed"):
        MinMaxObserver(per_tensor()).qparams()
    with pytest.raises(ValueError, match="allowed: minmax"):
        MinMaxObserver(QuantSpec(dtype="int8", observer=Percentile()))
    with pytest.raises(ValueError, match="different specs"):
        MinMaxObserver(per_tensor()).merge(MinMaxObserver(QuantSpec(dtype="int16")))
    with pytest.raises(TypeError, match="cannot merge"):
        MinMaxObserver(per_tensor()).merge(make_observer(QuantSpec(dtype="int8", observer=MovingAverageMinMax())))


def test_from_state_dict_rejects_unknown_kind() -> None:
    state = MinMaxObserver(per_tensor()).state_dict()
    with pytest.raises(
        ValueError, match="kind: 'nope' is not a known observer; allowed: fixed_range, histogram, minmax"
    ):
        Observer.from_state_dict({**state, "kind": "nope"})


def test_empty_batches_are_ignored() -> None:
    obs = MinMaxObserver(per_tensor())
    obs.update(np.zeros((0, 3), np.float32))
    assert obs.empty


def test_make_observer_dispatch() -> None:
    assert type(make_observer(QuantSpec(dtype="int8", dynamic=True))) is MinMaxObserver
    assert type(make_observer(QuantSpec(dtype="int8", observer=MinMax()))) is MinMaxObserver
    assert type(make_observer(QuantSpec(dtype="int8", observer=MovingAverageMinMax()))) is MovingAverageMinMaxObserver
