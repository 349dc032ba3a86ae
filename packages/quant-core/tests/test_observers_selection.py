"""Range selection from histograms, checked against independent references: sampled
quantize-dequantize error, numpy percentiles, a loop transcription of MXNet's KL
calibration, and brute-force error over the raw data."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quant_core.dtypes import DType
from quant_core.observer_config import MSE, Entropy, MinMax, Percentile, PowerOfTwoMSE
from quant_core.observers import Histogram, HistogramGrid, HistogramObserver, make_observer
from quant_core.observers.error_model import expected_squared_error
from quant_core.observers.selection import candidate_qparams, entropy_threshold
from quant_core.qparams import QParams, fake_quantize, qparams_from_range, quantization_error
from quant_core.spec import QuantSpec, RoundMode


def histogram_of(x: np.ndarray, bins: int = 2048) -> Histogram:
    obs = HistogramObserver(QuantSpec(dtype="int8", observer=Percentile(bins=bins)))
    obs.update(x)
    return obs.histogram()


@given(
    mode=st.sampled_from(list(RoundMode)),
    dtype=st.sampled_from([DType.INT4, DType.INT8, DType.UINT8, DType.INT16]),
    seed=st.integers(0, 2**32 - 1),
)
@settings(max_examples=40)
def test_error_model_matches_sampled_fake_quantize(mode: RoundMode, dtype: DType, seed: int) -> None:
    rng = np.random.default_rng(seed)
    lower = np.sort(rng.uniform(-6, 6, size=5))
    upper = lower + rng.choice([1e-4, 0.01, 0.3, 2.0], size=5)
    counts = rng.integers(0, 50, size=5)
    scale = np.float32(rng.choice([0.002, 0.05, 0.4, 1.3]))
    zero_point = int(rng.integers(dtype.qmin, dtype.qmax + 1))
    qp = QParams(np.array([scale], np.float32), np.array([zero_point], np.int64), dtype)
    model = float(expected_squared_error(counts, lower, upper, qp, mode)[0])
    # Jittered (stratified random) samples over each bin: an independent, unbiased
    # estimate that cannot alias with the quantization step the way a regular grid can.
    per = 20000
    t = (np.arange(per) + rng.uniform(size=per)) / per
    samples = lower[:, None] + (upper - lower)[:, None] * t
    one = QParams.per_tensor(float(scale), zero_point, dtype)
    err = (fake_quantize(samples, one.evolve(rounding=mode)).astype(np.float64) - samples.astype(np.float32)) ** 2
    sampled = float(err.mean(axis=1) @ counts)
    assert model == pytest.approx(sampled, rel=5e-3, abs=1e-9 + 1e-6 * float(scale) ** 2 * counts.sum())


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("p", [90.0, 99.0, 99.99])
def test_percentile_within_one_bin_of_numpy(symmetric: bool, p: float) -> None:
    rng = np.random.default_rng(7)
    x = np.concatenate([rng.standard_normal(50_000), rng.exponential(3.0, 10_000)]).astype(np.float32)
    spec = QuantSpec(dtype="int8" if symmetric else "uint8", symmetric=symmetric, observer=Percentile(p, bins=1024))
    obs = make_observer(spec)
    obs.update(x)
    lo, hi = (float(v) for v in obs.range())
    hist = obs.histogram()  # type: ignore[attr-defined]
    if symmetric:
        width = hist.folded().grid.width
        expected = float(np.percentile(np.abs(x.astype(np.float64)), p))
        assert lo == -hi and abs(hi - expected) <= width
    else:
        width = hist.grid.width
        assert abs(lo - float(np.percentile(x, 100 - p))) <= width
        assert abs(hi - float(np.percentile(x, p))) <= width


def test_percentile_100_is_minmax() -> None:
    x = np.random.default_rng(8).standard_normal(1000).astype(np.float32)
    obs = make_observer(QuantSpec(dtype="uint8", symmetric=False, observer=Percentile(100.0)))
    obs.update(x)
    assert [float(v) for v in obs.range()] == [float(x.min()), float(x.max())]


def test_folded_histogram_counts_abs_values() -> None:
    x = np.random.default_rng(9).normal(0.7, 1.0, 20_000)
    folded = histogram_of(x, 256).folded()
    expected, _ = np.histogram(np.abs(x), bins=folded.grid.edges())
    np.testing.assert_array_equal(folded.counts, expected)
    # Data far from zero: the folded grid is coarsened until it starts at 0.
    far = histogram_of(np.array([1000.0, 1000.5, 1001.0]), 64).folded()
    assert far.grid.offset == 0 and far.counts.sum() == 3 and far.grid.upper > 1001.0


def _mxnet_kl_threshold(h: np.ndarray, width: float, q_bins: int, amax: float) -> float:
    """Loop transcription of MXNet's ``_get_optimal_threshold`` on a histogram of |x|
    (smooth_distribution with eps 1e-4, then scipy.stats.entropy's normalised KL)."""

    def entropy(p: np.ndarray, q: np.ndarray) -> float:
        p, q = p / p.sum(), q / q.sum()
        return float(np.sum(p * np.log(p / q)))

    def smooth(p: np.ndarray) -> np.ndarray | None:
        zeros, nonzeros = p == 0, p != 0
        if not nonzeros.any():
            return None
        eps1 = 1e-4 * zeros.sum() / nonzeros.sum()
        return p + 1e-4 * zeros - eps1 * nonzeros

    n = int(np.flatnonzero(h)[-1]) + 1
    h = h[:n].astype(np.float64)
    best, best_i = np.inf, n
    for i in range(q_bins, n + 1):
        p = h[:i].copy()
        p[i - 1] += h[i:].sum()
        nonzero = p != 0
        merged = i // q_bins
        q = np.zeros(i)
        for g in range(q_bins):
            start = g * merged
            stop = i if g == q_bins - 1 else start + merged
            norm = nonzero[start:stop].sum()
            if norm:
                q[start:stop] = np.where(nonzero[start:stop], h[start:stop].sum() / norm, 0.0)
        ps, qs = smooth(p), smooth(q)
        d = np.inf if ps is None or qs is None else entropy(ps, qs)
        if d <= best:
            best, best_i = d, i
    return min(best_i * width, amax)


@pytest.mark.parametrize("case", ["gaussian", "heavy_tail", "outliers", "relu"])
def test_entropy_matches_mxnet_loop(case: str) -> None:
    rng = np.random.default_rng(10)
    x = rng.standard_normal(100_000)
    if case == "heavy_tail":
        x = np.abs(x) ** 3
    elif case == "outliers":
        x[:3] = [30.0, -25.0, 40.0]
    elif case == "relu":
        x = np.maximum(x, 0.0)
    hist = histogram_of(x.astype(np.float32), 256)
    folded = hist.folded()
    expected = _mxnet_kl_threshold(folded.counts, folded.grid.width, 48, folded.max_val)
    assert entropy_threshold(hist, 48) == pytest.approx(expected, rel=1e-12)


def gaussian_with_outlier() -> np.ndarray:
    x = np.random.default_rng(11).standard_normal(200_000).astype(np.float32)
    x[0] = 60.0
    return x


@pytest.mark.parametrize("observer", [Percentile(99.99), Entropy(), MSE()], ids=lambda c: c.method)
@pytest.mark.parametrize("symmetric", [True, False])
def test_histogram_methods_clip_the_outlier_minmax_does_not(observer: object, symmetric: bool) -> None:
    x = gaussian_with_outlier()
    dtype = "int8" if symmetric else "uint8"
    spec = QuantSpec(dtype=dtype, symmetric=symmetric, observer=observer)  # type: ignore[arg-type]
    minmax = make_observer(spec.evolve(observer=MinMax()))
    clipped = make_observer(spec)
    for obs in (minmax, clipped):
        for part in np.array_split(x, 3):
            obs.update(part)
    assert float(minmax.range()[1]) == 60.0
    assert float(clipped.range()[1]) < 0.8 * 60.0
    assert float(clipped.qparams().scale) < float(minmax.qparams().scale)


@pytest.mark.parametrize("symmetric", [True, False])
def test_mse_choice_is_near_the_brute_force_optimum_on_the_data(symmetric: bool) -> None:
    x = gaussian_with_outlier()[:20_000]
    x[0] = 30.0
    spec = QuantSpec(dtype="int8" if symmetric else "uint8", symmetric=symmetric, observer=MSE(num_candidates=50))
    obs = make_observer(spec)
    obs.update(x)
    chosen = quantization_error(x, obs.qparams())
    # Brute force over a dense set of ranges, errors measured on the raw data.
    lo_max, hi_max = float(x.min()), float(x.max())
    fractions = np.linspace(0.02, 1.0, 200)
    if symmetric:
        ranges = [(-t, t) for t in fractions * max(-lo_max, hi_max)]
    else:
        ranges = [(lo_max * a, hi_max * b) for a in fractions[::20] for b in fractions[::5]]
    best = min(quantization_error(x, qparams_from_range(lo, hi, spec)) for lo, hi in ranges)
    minmax_error = quantization_error(x, qparams_from_range(lo_max, hi_max, spec))
    assert chosen <= best * 1.05
    assert chosen < minmax_error


@pytest.mark.parametrize("rounding", ["half_even", "half_up"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_pow2_mse_gives_exact_power_of_two_and_best_position(rounding: str, symmetric: bool) -> None:
    x = gaussian_with_outlier()
    config = PowerOfTwoMSE(search_below=1, search_above=3)
    spec = QuantSpec(dtype="int8", symmetric=symmetric, scale_type="power_of_two", rounding=rounding, observer=config)
    obs = make_observer(spec)
    obs.update(x)
    qp = obs.qparams()
    assert qp.fix_pos is not None
    assert float(qp.scale) == 2.0 ** -int(qp.fix_pos)
    minmax = qparams_from_range(float(x.min()), float(x.max()), spec)
    base = int(minmax.fix_pos)  # type: ignore[arg-type]
    assert base - 1 <= int(qp.fix_pos) <= base + 3
    # The outlier costs the Gaussian bulk less when clipped: never a coarser position than min-max's.
    assert int(qp.fix_pos) >= base and quantization_error(x, qp) <= quantization_error(x, minmax)
    # The chosen position has the lowest error on the raw data among the candidates.
    errors = {}
    for pos in range(base - 1, base + 4):
        factor = 2.0 ** (base - pos)
        cand = qparams_from_range(min(float(x.min()), 0.0) * factor, float(x.max()) * factor, spec)
        assert int(cand.fix_pos) == pos  # type: ignore[arg-type]
        errors[pos] = quantization_error(x, cand)
    assert errors[int(qp.fix_pos)] <= min(errors.values()) * 1.02


def test_pow2_ties_go_to_the_larger_range() -> None:
    # Constant data: a point mass that positions base-2 .. base represent exactly.
    spec = QuantSpec(dtype="int8", scale_type="power_of_two", observer=PowerOfTwoMSE(bins=16, search_below=2))
    obs = make_observer(spec)
    obs.update(np.full(10, 0.5, np.float32))
    base = int(qparams_from_range(0.5, 0.5, spec).fix_pos)  # type: ignore[arg-type]
    assert int(obs.qparams().fix_pos) == base - 2  # type: ignore[arg-type]


def test_candidate_qparams_equal_one_by_one_qparams() -> None:
    spec = QuantSpec(dtype="uint8", symmetric=False, observer=MSE())
    lo, hi = np.array([-1.0, -0.3, 0.0]), np.array([2.0, 0.7, 5.0])
    together = candidate_qparams(lo, hi, spec)
    for c in range(3):
        one = qparams_from_range(lo[c], hi[c], spec)
        assert together.scale[c] == one.scale and together.zero_point[c] == one.zero_point


def test_constant_and_zero_data_give_usable_qparams() -> None:
    for observer, extra in [
        (Percentile(), {}),
        (Entropy(), {}),
        (MSE(), {}),
        (PowerOfTwoMSE(), {"scale_type": "power_of_two"}),
    ]:
        for value in (0.0, 3.0):
            obs = make_observer(QuantSpec(dtype="int8", observer=observer, **extra))  # type: ignore[arg-type]
            obs.update(np.full(10, value, np.float32))
            qp = obs.qparams()
            assert np.isfinite(qp.scale).all() and float(qp.scale) > 0


def test_single_histogram_view_is_independent_of_observer() -> None:
    grid = HistogramGrid(exponent=0, offset=0, bins=16)
    hist = Histogram(np.eye(16, dtype=np.int64)[3], grid, 3.25, 3.25)
    assert hist.quantile(0.5) == 3.25 and hist.folded().counts.sum() == 1
