"""Choosing a clipping range from a histogram: percentile, entropy (KL), MSE and
power-of-two MinMSE.

Every search builds its candidates with :func:`quant_core.qparams.qparams_from_range`
(all candidates at once, as if they were channels) and scores them with the closed-form
error model of :mod:`quant_core.observers.error_model`, so the dtype, symmetry, narrow
range, scale type and rounding mode of the spec all enter exactly as the real quantizer
applies them. Ties go to the larger range.
"""

from __future__ import annotations

import numpy as np

from quant_core.errors import ConfigError
from quant_core.observer_config import MSE, Entropy, MinMax, Percentile, PowerOfTwoMSE
from quant_core.observers.error_model import expected_squared_error
from quant_core.observers.snapshot import Histogram
from quant_core.qparams import QParams, qparams_from_range
from quant_core.spec import QuantSpec

Range = tuple[float, float]


def candidate_qparams(lo: np.ndarray, hi: np.ndarray, spec: QuantSpec) -> QParams:
    """qparams of many candidate ranges at once (one per entry), computed by the same
    vectorised code path that per-channel specs use."""
    as_channels = spec.evolve(per_channel_axis=0, observer=MinMax(), dynamic=False)
    return qparams_from_range(np.asarray(lo, np.float64), np.asarray(hi, np.float64), as_channels)


def candidate_errors(hist: Histogram, lo: np.ndarray, hi: np.ndarray, spec: QuantSpec) -> np.ndarray:
    """Expected total squared error of the histogram's values for each candidate range."""
    lower, upper = hist.bin_bounds()
    return expected_squared_error(hist.counts, lower, upper, candidate_qparams(lo, hi, spec), spec.rounding)


def last_argmin(errors: np.ndarray) -> int:
    """Index of the smallest error, the last one on ties (candidates are ordered from
    the smallest range up, so ties go to the larger range)."""
    return int(errors.size - 1 - np.argmin(errors[::-1]))


def _abs_max(hist: Histogram) -> float:
    return max(abs(hist.min_val), abs(hist.max_val))


def _symmetric_or_clipped(t: float, hist: Histogram, spec: QuantSpec) -> Range:
    """A threshold on ``|x|`` as a range: ``(-t, t)`` for symmetric specs, else cut to
    the data so an asymmetric spec does not spend codes on values never seen."""
    if spec.symmetric:
        return -t, t
    return max(hist.min_val, -t), min(hist.max_val, t)


def percentile_range(hist: Histogram, spec: QuantSpec, config: Percentile) -> Range:
    """Symmetric specs: the ``percentile``-th percentile of ``|x|``; asymmetric: that
    many percent kept in each tail (both within one bin of the exact percentiles).

    Example:
        >>> import numpy as np
        >>> from quant_core.observers.grid import HistogramGrid
        >>> h = Histogram(np.ones(8, np.int64), HistogramGrid(exponent=0, offset=-4, bins=8), -4.0, 3.99)
        >>> percentile_range(h, QuantSpec(dtype="int8", observer=Percentile(75.0)), Percentile(75.0))
        (-3.0, 3.0)
    """
    q = config.percentile / 100.0
    if spec.symmetric:
        t = hist.folded().quantile(q)
        return -t, t
    return hist.quantile(1.0 - q), hist.quantile(q)


# MXNet / onnxruntime smooth zero bins with this many counts before the KL divergence.
_KL_EPS = 1e-4
# Candidates scored together: a (block x bins) matrix of float64 stays a few MiB.
_KL_BLOCK = 128


def entropy_threshold(hist: Histogram, num_quantized_bins: int) -> float:
    """TensorRT's KL-divergence threshold on the histogram of ``|x|``, computed as
    MXNet and onnxruntime do.

    For every candidate ``i >= num_quantized_bins``, the reference ``P`` is the first
    ``i`` bins with all larger values added to the last; ``Q`` merges those ``i`` bins
    (without the outliers) into ``num_quantized_bins`` groups and spreads each group's
    count evenly over the bins where ``P`` is non-zero. Both are smoothed (empty bins get
    1e-4 counts, taken evenly from the others) and the threshold is the right edge of
    the candidate with the smallest ``KL(P || Q)`` (ties: the larger). Candidates are
    scored in blocks as matrices rather than one by one.
    """
    folded = hist.folded()
    nonzero = np.flatnonzero(folded.counts)
    n = int(nonzero[-1]) + 1 if nonzero.size else 0
    if n <= num_quantized_bins:
        return folded.max_val
    h = folded.counts[:n].astype(np.float64)
    total = float(h.sum())
    candidates = np.arange(num_quantized_bins, n + 1)
    blocks = [candidates[b : b + _KL_BLOCK] for b in range(0, candidates.size, _KL_BLOCK)]
    # A block only needs the bins below its largest candidate.
    kl = np.concatenate([_kl_divergences(h[: block[-1]], total, block, num_quantized_bins) for block in blocks])
    if not np.isfinite(kl).any():
        return folded.max_val
    best = last_argmin(np.where(np.isfinite(kl), kl, np.inf))
    return min(float(candidates[best]) * folded.grid.width, folded.max_val)


def _smooth(v: np.ndarray, inside: np.ndarray) -> np.ndarray:
    """MXNet's ``smooth_distribution`` applied row-wise to the entries where ``inside``:
    zeros become eps, non-zeros give up the same total evenly. Rows with no non-zero
    entry come back as NaN (not comparable)."""
    nonzero = (v != 0) & inside
    n_nonzero = nonzero.sum(axis=1, keepdims=True)
    n_zero = inside.sum(axis=1, keepdims=True) - n_nonzero
    with np.errstate(divide="ignore", invalid="ignore"):
        take = np.where(n_nonzero > 0, _KL_EPS * n_zero / n_nonzero, np.nan)
    return np.where(inside, np.where(nonzero, v - take, _KL_EPS), 0.0)


def _kl_divergences(h: np.ndarray, total: float, candidates: np.ndarray, num_quantized_bins: int) -> np.ndarray:
    """``KL(P || Q)`` of each candidate (see :func:`entropy_threshold`), one row each;
    ``h`` holds the bins below the largest candidate, ``total`` counts all values."""
    j = np.arange(h.size)
    i = candidates[:, None]
    inside = j < i
    cum = np.concatenate([[0.0], np.cumsum(h)])
    outliers = total - cum[i]
    p = np.where(inside, h, 0.0) + np.where(j == i - 1, outliers, 0.0)
    p_nonzero = (p != 0) & inside
    # Groups of i // Q bins, the last one taking the rest; sums from prefix sums.
    per_group = i // num_quantized_bins
    starts = np.arange(num_quantized_bins) * per_group
    ends = np.concatenate([starts[:, 1:], i], axis=1)
    cum_nonzero = np.concatenate([np.zeros((candidates.size, 1)), np.cumsum(p_nonzero, axis=1)], axis=1)
    group_sum = cum[ends] - cum[starts]
    group_nonzero = np.take_along_axis(cum_nonzero, ends, 1) - np.take_along_axis(cum_nonzero, starts, 1)
    group = np.minimum(j // per_group, num_quantized_bins - 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        spread = np.take_along_axis(group_sum / group_nonzero, group, axis=1)
    q = np.where(p_nonzero, spread, 0.0)
    ps, qs = _smooth(p, inside), _smooth(q, inside)
    ps /= ps.sum(axis=1, keepdims=True)
    qs /= qs.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(inside, ps * np.log(ps / qs), 0.0)
    result: np.ndarray = terms.sum(axis=1)
    return result


def entropy_range(hist: Histogram, spec: QuantSpec, config: Entropy) -> Range:
    """:func:`entropy_threshold` as a range for the spec."""
    return _symmetric_or_clipped(entropy_threshold(hist, config.num_quantized_bins), hist, spec)


def mse_range(hist: Histogram, spec: QuantSpec, config: MSE) -> Range:
    """The range with the lowest expected squared error among ``num_candidates``
    evenly spaced thresholds.

    Symmetric specs scan ``(-t, t)`` for ``t = max|x| * j / num_candidates``.
    Asymmetric specs first shrink ``[min, max]`` towards 0 by the same fractions, then
    refine the lower end with the upper fixed and the upper end with the lower fixed
    (one round of coordinate descent), so one-sided outliers are clipped on their side.
    """
    n = config.num_candidates
    fractions = np.arange(1, n + 1, dtype=np.float64) / n
    if spec.symmetric:
        t = _abs_max(hist) * fractions
        best = last_argmin(candidate_errors(hist, -t, t, spec))
        return float(-t[best]), float(t[best])
    lo_all, hi_all = min(hist.min_val, 0.0), max(hist.max_val, 0.0)
    best = last_argmin(candidate_errors(hist, lo_all * fractions, hi_all * fractions, spec))
    lo, hi = lo_all * fractions[best], hi_all * fractions[best]
    scan = np.concatenate([[0.0], fractions])
    ones = np.ones_like(scan)
    lo = float(lo_all * scan[last_argmin(candidate_errors(hist, lo_all * scan, hi * ones, spec))])
    hi = float(hi_all * scan[last_argmin(candidate_errors(hist, lo * ones, hi_all * scan, spec))])
    return lo, hi


def pow2_mse_range(hist: Histogram, spec: QuantSpec, config: PowerOfTwoMSE) -> Range:
    """Quark's MinMSE: starting from the min-max fix position ``pos``, try positions
    ``pos - search_below .. pos + search_above`` and keep the lowest expected squared
    error (ties: the larger range). Each candidate is the min-max range scaled by
    ``2**(pos - p)``, whose qparams have exactly fix position ``p``."""
    lo, hi = min(hist.min_val, 0.0), max(hist.max_val, 0.0)
    if spec.symmetric:
        lo, hi = -max(-lo, hi), max(-lo, hi)
    # Smallest range (largest position) first, so last_argmin breaks ties to the larger range.
    shifts = np.arange(config.search_above, -config.search_below - 1, -1)
    factors = np.ldexp(1.0, -shifts)
    best = last_argmin(candidate_errors(hist, lo * factors, hi * factors, spec))
    return float(lo * factors[best]), float(hi * factors[best])


def select_range(hist: Histogram, spec: QuantSpec) -> Range:
    """The range the spec's histogram method selects.

    Example:
        >>> import numpy as np
        >>> from quant_core.observers.grid import HistogramGrid
        >>> h = Histogram(np.ones(8, np.int64), HistogramGrid(exponent=0, offset=-4, bins=8), -4.0, 3.99)
        >>> select_range(h, QuantSpec(dtype="int8", observer=Percentile(75.0)))
        (-3.0, 3.0)
    """
    config = spec.observer
    if isinstance(config, Percentile):
        return percentile_range(hist, spec, config)
    if isinstance(config, Entropy):
        return entropy_range(hist, spec, config)
    if isinstance(config, MSE):
        return mse_range(hist, spec, config)
    if isinstance(config, PowerOfTwoMSE):
        return pow2_mse_range(hist, spec, config)
    raise ConfigError(
        f"observer.method: {config.method!r} does not select from a histogram; allowed: percentile, entropy, mse, minmse_pow2"
    )
