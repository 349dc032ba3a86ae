"""What the device does to an exact accumulator: add the bias shifted into it, apply the
fused activation to the unrounded value, then one rounding shift to the output position
and saturation.

Positions may be per channel (``acc_pos``/``bias_pos`` arrays along ``channel_axis``).
A bias finer than the accumulator (negative shift_bias) moves the accumulator onto the
bias's grid first, so the sum stays exact and is still rounded once. Relu and Clip are
applied as part of the final saturation, which gives exactly the rounding of the clamped
value (see :meth:`Activation.saturation`); LeakyRelu scales the negative values exactly.

Example:
    >>> from quant_core.spec import RoundMode
    >>> relu = Activation("relu")
    >>> e = Epilogue(acc_pos=4, out_pos=2, mode=RoundMode.HALF_UP, out_range=(-128, 127),
    ...              bias=np.array([3]), bias_pos=2, activation=relu, channel_axis=1, acc_bound=100)
    >>> e(np.array([[-20.0], [2.0], [-13.0]])).ravel().tolist()  # (acc + 3 * 4) / 4, relu, half-up
    [0, 4, 0]
"""

from __future__ import annotations

import math

import attrs
import numpy as np

from quant_core.errors import ModelError
from quant_core.qparams import round_values
from quant_core.spec import RoundMode
from quant_npu.sim.arith import exact_dtype, requantize, storage_dtype


@attrs.frozen
class Activation:
    """A fused (or standalone) activation on exact values: ``relu``, ``clip`` (real bounds
    ``lo``/``hi``) or ``leaky`` (slope ``numerator / 2**bits`` below zero).

    Example:
        >>> Activation("leaky", numerator=26, bits=8).scale
        256
    """

    kind: str = attrs.field()
    lo: float = -math.inf
    hi: float = math.inf
    numerator: int = 0
    bits: int = 0

    @kind.validator
    def _check(self, _attribute: object, value: str) -> None:
        if value not in ("relu", "clip", "leaky"):
            raise ModelError(f"activation: {value!r} is not allowed; allowed: relu, clip, leaky")

    @property
    def bounds(self) -> tuple[float, float]:
        """Real bounds of a relu/clip."""
        return (0.0, math.inf) if self.kind == "relu" else (self.lo, self.hi)

    def saturation(self, position: int, mode: RoundMode, out_range: tuple[int, int]) -> tuple[int, int]:
        """A relu/clip folded into the final saturation: rounding is monotone, so
        ``round(clip(v, lo, hi)) == clip(round(v), round(lo), round(hi))`` exactly, with the
        real bounds rounded at the output ``position`` by the same ``mode``.

        Example:
            >>> Activation("clip", lo=0.0, hi=0.7).saturation(6, RoundMode.HALF_UP, (-128, 127))
            (0, 45)
        """
        if self.kind == "leaky":
            raise AssertionError("a leaky activation is not a clamp")
        lo, hi = out_range
        bounds = [round_values(np.array(math.ldexp(b, position)), mode) for b in self.bounds if math.isfinite(b)]
        low = max(lo, int(bounds[0])) if math.isfinite(self.bounds[0]) else lo
        high = min(hi, int(bounds[-1])) if math.isfinite(self.bounds[1]) else hi
        return low, high

    @property
    def scale(self) -> int:
        """Factor the activation moves the grid by (leaky: ``2**bits``)."""
        return 2**self.bits if self.kind == "leaky" else 1

    def apply(self, values: np.ndarray) -> np.ndarray:
        """A leaky activation on exact integers: the result is at ``bits`` more fraction bits."""
        if self.kind != "leaky":
            raise AssertionError(f"{self.kind} folds into saturation (see saturation)")
        return np.where(values >= 0, values * self.scale, values * self.numerator)


class Epilogue:
    """Bias, activation, one rounding shift, saturation (see the module docstring)."""

    def __init__(
        self,
        *,
        acc_pos: int | np.ndarray,
        out_pos: int,
        mode: RoundMode,
        out_range: tuple[int, int],
        bias: np.ndarray | None = None,
        bias_pos: int | np.ndarray | None = None,
        activation: Activation | None = None,
        channel_axis: int = 1,
        acc_bound: float = 0.0,
        ndim: int = 4,
    ) -> None:
        self.mode = mode
        self.lo, self.hi = out_range
        self.dtype = storage_dtype(*out_range)
        self.activation = activation
        acc = np.asarray(acc_pos, np.int64)
        extra = np.zeros_like(acc)
        self.bias_term: np.ndarray | None = None
        bias_bound = 0.0
        if bias is not None and bias_pos is not None:
            bpos = np.asarray(bias_pos, np.int64)
            extra = np.maximum(bpos - acc, 0)
            self.bias_term = np.ldexp(np.asarray(bias, np.float64), (acc + extra - bpos).astype(np.int32))
            bias_bound = float(np.max(np.abs(self.bias_term), initial=0.0))
        grid = acc + extra
        self.extra = self._shape(extra, channel_axis, ndim) if extra.any() else None
        if self.bias_term is not None:
            self.bias_term = self._shape(self.bias_term, channel_axis, ndim)
        scale = activation.scale if activation is not None else 1
        self.shift = self._shape(grid + int(math.log2(scale)) - out_pos, channel_axis, ndim)
        self.work_dtype = exact_dtype((acc_bound * 2.0 ** float(np.max(extra, initial=0)) + bias_bound) * scale)
        if activation is not None and activation.kind != "leaky":
            self.lo, self.hi = activation.saturation(out_pos, mode, out_range)
            self.activation = None

    @staticmethod
    def _shape(values: np.ndarray, axis: int, ndim: int) -> np.ndarray:
        if values.ndim == 0 or values.size == 1:
            return values.reshape(())
        shape = [1] * ndim
        shape[axis] = -1
        return values.reshape(shape)

    def __call__(self, acc: np.ndarray) -> np.ndarray:
        values = acc if acc.dtype == self.work_dtype else acc.astype(self.work_dtype)
        if self.extra is not None:
            values = np.ldexp(values, self.extra.astype(np.int32))
        bias = self.bias_term
        if self.activation is not None:  # leaky: scales the biased value before the one rounding
            if bias is not None:
                values = values + bias.astype(self.work_dtype)
            values, bias = self.activation.apply(values), None
        # the bias is added with the rounding offset (exact: work_dtype holds the biased sum)
        return requantize(values, self.shift, self.mode, self.lo, self.hi, self.dtype, offset=bias)
