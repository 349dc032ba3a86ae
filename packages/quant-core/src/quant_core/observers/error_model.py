"""Expected squared error of quantize-dequantize over a histogram, in closed form.

The real quantizer (:func:`quant_core.qparams.quantize`) computes
``q = clip(round(x / s) + zp, qmin, qmax)``. In units of the step, ``u = x / s``, the
error ``Q(x) - x`` is ``s * d(u)`` with ``d(u) = round(u) - u`` inside
``[L, T] = [qmin - zp, qmax - zp]`` (a periodic sawtooth that depends on the rounding
mode) and the clipping error ``L - u`` / ``T - u`` outside. Values are modelled as
uniform inside each bin, so a bin ``[a, b)`` holding ``c`` values contributes
``c * s**2 * (H(b/s) - H(a/s)) / ((b - a) / s)`` with ``H`` an antiderivative of ``d**2``.

Integrating, rather than evaluating bin centres, keeps the model right when the
quantization step is finer than a bin (int16) as well as coarser (int8, int4).
"""

from __future__ import annotations

import numpy as np

from quant_core.qparams import QParams, round_values
from quant_core.spec import RoundMode

# Below this width (in steps) a bin is treated as a point mass at its centre, where
# the difference quotient of H would lose precision.
_POINT_WIDTH = 1e-3


def _periodic_antiderivative(u: np.ndarray, mode: RoundMode) -> np.ndarray:
    """An antiderivative of ``(round(u) - u)**2`` for unclipped ``u``, with value 0 at 0."""
    if mode in (RoundMode.HALF_EVEN, RoundMode.HALF_UP, RoundMode.HALF_AWAY):
        # Nearest rounding: each period [m - 1/2, m + 1/2) contributes 1/12.
        m = np.floor(u + 0.5)
        v = u - m
        return np.asarray(m / 12.0 + (v**3 + 0.125) / 3.0 - 0.125 / 3.0, np.float64)
    n = np.floor(u)
    f = u - n
    floor_part = n / 3.0 + f**3 / 3.0  # d = -f on each period
    ceil_part = n / 3.0 + (1.0 - (1.0 - f) ** 3) / 3.0  # d = 1 - f on each period
    if mode is RoundMode.FLOOR:
        return np.asarray(floor_part, np.float64)
    if mode is RoundMode.CEIL:
        return np.asarray(ceil_part, np.float64)
    return np.asarray(np.where(u >= 0, floor_part, ceil_part), np.float64)  # toward zero


def _antiderivative(u: np.ndarray, low: np.ndarray, top: np.ndarray, mode: RoundMode) -> np.ndarray:
    """Antiderivative of the full squared error (sawtooth inside ``[low, top]``,
    quadratic clipping error outside)."""
    inside = _periodic_antiderivative(np.clip(u, low, top), mode) - _periodic_antiderivative(low, mode)
    below = np.maximum(low - u, 0.0)
    above = np.maximum(u - top, 0.0)
    return np.asarray(inside - below**3 / 3.0 + above**3 / 3.0, np.float64)


def _point_error(u: np.ndarray, low: np.ndarray, top: np.ndarray, mode: RoundMode) -> np.ndarray:
    clipped = np.clip(u, low, top)
    d = np.clip(round_values(clipped, mode), low, top) - u
    return np.asarray(d * d, np.float64)


def expected_squared_error(
    counts: np.ndarray,
    lower: np.ndarray,
    upper: np.ndarray,
    qp: QParams,
    rounding: RoundMode,
) -> np.ndarray:
    """Total squared error of fake-quantizing the histogram's values with each
    candidate in ``qp`` (per-candidate scale and zero point of shape ``(C,)``).

    ``counts[i]`` values lie uniformly in ``[lower[i], upper[i]]``. Returns shape ``(C,)``.

    Example:
        >>> import numpy as np
        >>> from quant_core.dtypes import DType
        >>> qp = QParams(scale=np.array([1.0, 0.5], np.float32), zero_point=np.zeros(2, np.int64), dtype=DType.INT8)
        >>> err = expected_squared_error(np.array([12]), np.array([0.0]), np.array([1.0]), qp, RoundMode.HALF_EVEN)
        >>> (err / 12).round(6).tolist()  # uniform values: step**2 / 12
        [0.083333, 0.020833]
    """
    keep = counts > 0
    c = counts[keep].astype(np.float64)
    a, b = lower[keep].astype(np.float64), upper[keep].astype(np.float64)
    s = np.asarray(qp.scale, np.float64).reshape(-1, 1)
    zp = np.asarray(qp.zero_point, np.float64).reshape(-1, 1)
    low, top = qp.qmin - zp, qp.qmax - zp
    ua, ub = a / s, b / s
    width = ub - ua
    point = width < _POINT_WIDTH
    safe_width = np.where(point, 1.0, width)
    # A histogram's bins share their edges: the antiderivative at each distinct bound once
    # (the same values as at ``ua`` and ``ub``), then gathered per bin.
    bounds, where = np.unique(np.concatenate([a, b]), return_inverse=True)
    at_bounds = _antiderivative(bounds / s, low, top, rounding)
    mean_sq = np.where(
        point,
        _point_error(0.5 * (ua + ub), low, top, rounding),
        (at_bounds[:, where[a.size :]] - at_bounds[:, where[: a.size]]) / safe_width,
    )
    result: np.ndarray = (mean_sq * (s * s)) @ c
    return result
