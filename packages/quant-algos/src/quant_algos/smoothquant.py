"""SmoothQuant (Xiao et al. 2023): migrate activation outliers into the weights.

For ``y = X @ W`` (input channel ``j`` of X meets row ``j`` of W), ``X @ W ==
(X / s) @ (s * W)`` for any positive per-input-channel ``s``. With
``s_j = max|X_j|**alpha / max|W_j|**(1 - alpha)`` outlier activation channels shrink
and the weights absorb them. The backend folds ``1 / s`` into the op that produces X
(the previous layer's output channels, a LayerNorm/BatchNorm scale, or a new Mul).

Example:
    >>> import numpy as np
    >>> x = np.array([[1.0, 100.0], [-2.0, 50.0]])
    >>> w = np.array([[1.0, 1.0], [1.0, 1.0]])     # [in, out]: input axis 0
    >>> acc = ActivationAbsMax(channel_axis=-1); acc.update(x)
    >>> s = smoothquant_scales(acc.absmax(), weight_absmax(w, in_axis=0), alpha=0.5)
    >>> s.tolist()
    [1.4142135623730951, 10.0]
    >>> np.allclose((x / s) @ scale_weight_inputs(w, s, in_axis=0), x @ w)
    True
"""

from __future__ import annotations

import attrs
import numpy as np

from quant_algos._channel_stats import channels_last, check_channels
from quant_core.algorithm_config import SmoothQuantConfig
from quant_core.errors import ConfigError, DataError, ModelError

# Scales are clamped so that a dead channel (all-zero activation or weight) neither
# divides by zero nor blows the other tensor up.
_MIN_STAT = 1e-5


class ActivationAbsMax:
    """Streaming per-channel max |x| of a layer's input activation.

    Args:
        channel_axis: -1 for MatMul/Gemm inputs ``[..., K]``, 1 for NCHW Conv inputs.

    Example:
        >>> import numpy as np
        >>> acc = ActivationAbsMax(channel_axis=1)
        >>> acc.update(np.array([[-3.0, 1.0]])); acc.update(np.array([[2.0, -4.0]]))
        >>> acc.absmax().tolist()
        [3.0, 4.0]
    """

    def __init__(self, channel_axis: int = -1) -> None:
        self.channel_axis = channel_axis
        self._max: np.ndarray | None = None
        self.count = 0

    def update(self, x: np.ndarray) -> None:
        rows = channels_last(x, self.channel_axis, "activation")
        check_channels(None if self._max is None else self._max.shape[0], rows.shape[1], "activation")
        m = np.abs(rows).max(axis=0) if rows.shape[0] else np.zeros(rows.shape[1])
        self._max = m if self._max is None else np.maximum(self._max, m)
        self.count += int(np.asarray(x).shape[0]) if np.asarray(x).ndim > 1 else 1

    def merge(self, other: ActivationAbsMax) -> ActivationAbsMax:
        out = ActivationAbsMax(self.channel_axis)
        maxes = [m for m in (self._max, other._max) if m is not None]
        if len(maxes) == 2:
            check_channels(maxes[0].shape[0], maxes[1].shape[0], "merge")
        out._max = None if not maxes else np.max(maxes, axis=0)
        out.count = self.count + other.count
        return out

    def absmax(self) -> np.ndarray:
        if self._max is None:
            raise DataError("smoothquant: no activations were accumulated")
        return self._max.copy()


def weight_absmax(weight: np.ndarray, in_axis: int) -> np.ndarray:
    """Max |w| per input channel: ``in_axis`` 0 for a MatMul ``[in, out]`` weight, 1 for
    ``Gemm(transB=1)`` ``[out, in]`` and for ``[Cout, Cin, 1, 1]`` convs (groups=1)."""
    return np.abs(channels_last(weight, in_axis, "weight")).max(axis=0)


def smoothquant_scales(act_absmax: np.ndarray, w_absmax: np.ndarray, alpha: float) -> np.ndarray:
    """``s_j = max|X_j|**alpha / max|W_j|**(1 - alpha)``, 1 for dead channels."""
    a = np.asarray(act_absmax, np.float64)
    w = np.asarray(w_absmax, np.float64)
    if a.shape != w.shape:
        raise DataError(f"act_absmax: {a.shape[0]} channels but the weight has {w.shape[0]} input channels")
    if not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"alpha: {alpha!r} is out of range; allowed: a number from 0 to 1")
    dead = (a <= 0) | (w <= 0)
    s = np.maximum(a, _MIN_STAT) ** alpha / np.maximum(w, _MIN_STAT) ** (1.0 - alpha)
    return np.where(dead, 1.0, s)


def scale_weight_inputs(weight: np.ndarray, scales: np.ndarray, in_axis: int) -> np.ndarray:
    """``weight`` with input channel ``j`` multiplied by ``scales[j]`` (same dtype)."""
    w = np.asarray(weight)
    shape = [1] * w.ndim
    shape[in_axis] = -1
    return (w * np.asarray(scales, np.float64).reshape(shape)).astype(w.dtype)


@attrs.frozen(eq=False)
class SmoothQuantResult:
    """New weights of the layers reading the activation, and ``input_multiplier``
    (``1 / s``) that the backend folds into the activation's producer."""

    weights: tuple[np.ndarray, ...]
    scales: np.ndarray
    input_multiplier: np.ndarray


def smooth_layers(
    act_absmax: np.ndarray,
    weights: list[tuple[np.ndarray, int]],
    config: SmoothQuantConfig,
) -> SmoothQuantResult:
    """SmoothQuant for one activation read by one or more layers (``(weight, in_axis)``
    each, e.g. the Q, K and V projections); the weight statistic is their joint max.

    Example:
        >>> import numpy as np
        >>> r = smooth_layers(np.array([4.0, 1.0]), [(np.ones((2, 3)), 0)], SmoothQuantConfig(alpha=1.0))
        >>> r.input_multiplier.tolist(), r.weights[0][:, 0].tolist()
        ([0.25, 1.0], [4.0, 1.0])
    """
    if not weights:
        raise ModelError("weights: at least one (weight, in_axis) is needed")
    w_max = np.max([weight_absmax(w, axis) for w, axis in weights], axis=0)
    s = smoothquant_scales(act_absmax, w_max, config.alpha)
    return SmoothQuantResult(
        weights=tuple(scale_weight_inputs(w, s, axis) for w, axis in weights),
        scales=s,
        input_multiplier=1.0 / s,
    )
