"""Elementwise ops on signed integer tensors (numpy broadcasting).

- Add/Sub: inputs aligned exactly on the finest input grid, one rounding to the output
  (a fused Relu applies before it).
- Mul: the exact product at ``pa + pb``, one rounding. Div: the exact quotient, one rounding.
- HardSigmoid: ``relu6(x + 3) * m >> (shift + ipos - opos)``; HardSwish multiplies ``x``
  by that hardsigmoid rounded to int8 at ``hard_swish_sigmoid_position``.
- Tanh, Sigmoid: a table over every input code (the device's own implementation is not
  public; the table is the function rounded once at the output position).
- Softmax: ``exp`` of ``q - max(q)`` from a 16-bit table, an exact integer sum, one rounded
  division per element (an assumption, see ``docs/npu.md``).

Example:
    >>> from quant_core.spec import RoundMode
    >>> add = AddKernel((3, 1), 2, RoundMode.HALF_EVEN, (-128, 127))
    >>> add(np.array([4], np.int8), np.array([3], np.int8)).tolist()  # 0.5 + 1.5 = 2.0 -> code 8
    [8]
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from quant_core.qparams import round_values
from quant_core.spec import RoundMode
from quant_npu.profile import NPUProfile
from quant_npu.sim.arith import (
    align,
    code_bound,
    divide_round,
    exact_dtype,
    requantize,
    storage_dtype,
    working_dtype,
)
from quant_npu.sim.epilogue import Activation


class AddKernel:
    """``a + b`` (or ``a - b``) of inputs at ``positions``, written at ``out_pos``."""

    def __init__(
        self,
        positions: tuple[int, int],
        out_pos: int,
        mode: RoundMode,
        out_range: tuple[int, int],
        subtract: bool = False,
        activation: Activation | None = None,
        bounds: tuple[int, int] = (128, 128),
    ):
        self.finest = max(positions)
        self.ups = [self.finest - p for p in positions]
        self.shift = self.finest - out_pos
        self.sign = -1.0 if subtract else 1.0
        self.mode = mode
        self.out_range = out_range
        self.saturation = out_range if activation is None else activation.saturation(out_pos, mode, out_range)
        self.dtype = exact_dtype(sum(b * 2.0**u for b, u in zip(bounds, self.ups, strict=True)))

    def __call__(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        total = align(a, self.ups[0], self.dtype) + self.sign * align(b, self.ups[1], self.dtype)
        return requantize(total, self.shift, self.mode, *self.saturation, storage_dtype(*self.out_range))


class MulKernel:
    """``a * b``: exact product at ``pa + pb``, rounded to ``out_pos``.

    Example:
        >>> MulKernel((4, 4), 4, RoundMode.HALF_UP, (-128, 127))(np.array([24]), np.array([40])).tolist()  # 1.5 * 2.5
        [60]
    """

    def __init__(self, positions: tuple[int, int], out_pos: int, mode: RoundMode, out_range: tuple[int, int]):
        self.shift = sum(positions) - out_pos
        self.mode = mode
        self.out_range = out_range

    def __call__(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        # float32 holds every product of int8 codes exactly; wider codes multiply in float64
        product = np.multiply(a, b, dtype=working_dtype(float(code_bound(a.dtype)) * code_bound(b.dtype)))
        return requantize(product, self.shift, self.mode, *self.out_range, storage_dtype(*self.out_range))


class Tabulated:
    """An elementwise kernel of one integer input, computed once for every int8 (int16)
    code and then looked up: the same integers as ``kernel`` itself, in one gather.

    Example:
        >>> double = Tabulated(lambda x: (x.astype(np.int16) * 2).astype(np.int16))
        >>> double(np.array([-128, -1, 0, 5], np.int8)).tolist()
        [-256, -2, 0, 10]
    """

    def __init__(self, kernel: Callable[[np.ndarray], np.ndarray]):
        self.kernel = kernel
        self.tables: dict[np.dtype, np.ndarray] = {}

    def table(self, dtype: np.dtype) -> np.ndarray:
        """``kernel`` of every code of ``dtype``, indexed by the code's unsigned bit pattern."""
        if dtype not in self.tables:
            info = np.iinfo(dtype)
            codes = np.arange(int(info.min), int(info.max) + 1).astype(dtype)
            # code c sits at index c mod 2**bits: what c.view(unsigned) reads
            self.tables[dtype] = np.roll(self.kernel(codes), -int(info.min))
        return self.tables[dtype]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if x.dtype == np.int8:
            return self.table(x.dtype)[x.view(np.uint8)]
        if x.dtype == np.int16:
            return self.table(x.dtype)[x.view(np.uint16)]
        return self.kernel(x)


class DivKernel:
    """``a / b``: ``a * 2**(opos - pa + pb) / b`` rounded once (see ``arith.divide_round``).

    Example:
        >>> DivKernel((0, 0), 2, RoundMode.HALF_EVEN, (-128, 127))(np.array([1, 5]), np.array([3, 0])).tolist()
        [1, 127]
    """

    def __init__(self, positions: tuple[int, int], out_pos: int, mode: RoundMode, out_range: tuple[int, int]):
        self.up = out_pos - positions[0] + positions[1]
        self.mode = mode
        self.out_range = out_range

    def __call__(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        numerator = np.ldexp(a.astype(np.float64), max(self.up, 0))
        denominator = np.ldexp(b.astype(np.float64), max(-self.up, 0))
        quotient = divide_round(numerator, denominator, self.mode)
        return requantize(quotient, 0, self.mode, *self.out_range, storage_dtype(*self.out_range))


class ActivationKernel:
    """A standalone Relu/Clip/LeakyRelu on the input codes, then one rounding shift.

    Example:
        >>> kernel = ActivationKernel(Activation("leaky", numerator=26, bits=8), 0, 0, RoundMode.HALF_UP, (-128, 127))
        >>> kernel(np.array([-100, 7])).tolist()  # -100 * 26 / 256 = -10.16
        [-10, 7]
    """

    def __init__(self, activation: Activation, in_pos: int, out_pos: int, mode: RoundMode, out_range: tuple[int, int]):
        self.activation = activation
        leaky = activation.kind == "leaky"
        self.shift = in_pos + activation.bits - out_pos if leaky else in_pos - out_pos
        self.mode = mode
        self.out_range = out_range
        self.saturation = out_range if leaky else activation.saturation(out_pos, mode, out_range)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        values = x.astype(np.float64)
        if self.activation.kind == "leaky":
            values = self.activation.apply(values)
        return requantize(values, self.shift, self.mode, *self.saturation, storage_dtype(*self.out_range))


class HardSigmoidKernel:
    """``max(x + 3, 0) * m >> (shift + g - opos)`` on the grid ``g = max(ipos, 0)``: the
    device clamps below only (Vitis AI's reference runner, ``hard_sigmoid_fix``); above, int8
    saturation does it where the output position is >= 7, which the profile requires.

    Example:
        >>> from quant_npu.profile import NPUProfile
        >>> HardSigmoidKernel(NPUProfile(), 0, 7, RoundMode.HALF_UP, (-128, 127))(np.array([-3, 0, 3])).tolist()
        [0, 64, 127]
    """

    def __init__(self, profile: NPUProfile, in_pos: int, out_pos: int, mode: RoundMode, out_range: tuple[int, int]):
        self.grid = max(in_pos, 0)
        self.up = self.grid - in_pos
        self.three = 3 * 2**self.grid
        self.multiplier = profile.hard_sigmoid_multiplier
        self.shift = profile.hard_sigmoid_shift + self.grid - out_pos
        self.mode = mode
        self.out_range = out_range

    def __call__(self, x: np.ndarray) -> np.ndarray:
        shifted = np.ldexp(x.astype(np.float64), self.up) + self.three
        clipped = np.maximum(shifted, 0)
        return requantize(
            clipped * self.multiplier, self.shift, self.mode, *self.out_range, storage_dtype(*self.out_range)
        )


class HardSwishKernel:
    """``x * hardsigmoid(x)`` with the hardsigmoid rounded to int8 at ``hard_swish_sigmoid_position``.

    Example:
        >>> from quant_npu.profile import NPUProfile
        >>> HardSwishKernel(NPUProfile(), 0, 0, RoundMode.HALF_UP, (-128, 127))(np.array([-4, 1, 4])).tolist()
        [0, 1, 4]
    """

    def __init__(self, profile: NPUProfile, in_pos: int, out_pos: int, mode: RoundMode, out_range: tuple[int, int]):
        hpos = profile.hard_swish_sigmoid_position
        self.sigmoid = HardSigmoidKernel(profile, in_pos, hpos, mode, (-128, 127))
        self.mul = MulKernel((in_pos, hpos), out_pos, mode, out_range)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.mul(x, self.sigmoid(x))


class PReluKernel:
    """``x`` where ``x >= 0``, else ``x * slope`` with int8 slope codes at ``slope_pos``
    (broadcast like ONNX's PRelu), one rounding to ``out_pos`` (the DPU's ``prelu_in`` codes
    and ``shift_prelu`` shifts).

    Example:
        >>> PReluKernel(np.array([[[26]]]), 8, 0, 0, RoundMode.HALF_UP, (-128, 127))(np.array([[[[-100, 7]]]])).tolist()
        [[[[-10, 7]]]]
    """

    def __init__(
        self, slope: np.ndarray, slope_pos: int, in_pos: int, out_pos: int, mode: RoundMode, out_range: tuple[int, int]
    ):
        self.slope = slope.astype(np.float64)
        self.up = slope_pos
        self.shift = in_pos + slope_pos - out_pos
        self.mode = mode
        self.out_range = out_range

    def __call__(self, x: np.ndarray) -> np.ndarray:
        values = x.astype(np.float64)
        scaled = np.where(values >= 0, np.ldexp(values, self.up), values * self.slope)
        return requantize(scaled, self.shift, self.mode, *self.out_range, storage_dtype(*self.out_range))


class TableKernel:
    """``f`` through a table over every input code: ``round(f(q * 2**-ipos) * 2**opos)``.

    Example:
        >>> TableKernel(np.tanh, 4, 7, RoundMode.HALF_UP, (-128, 127), (-128, 127))(np.array([0, 16])).tolist()
        [0, 97]
    """

    def __init__(
        self,
        function: Callable[[np.ndarray], np.ndarray],
        in_pos: int,
        out_pos: int,
        mode: RoundMode,
        in_range: tuple[int, int],
        out_range: tuple[int, int],
    ):
        codes = np.arange(in_range[0], in_range[1] + 1, dtype=np.float64)
        values = np.ldexp(function(np.ldexp(codes, -in_pos)), out_pos)
        self.low = in_range[0]
        self.table = np.clip(round_values(values, mode), *out_range).astype(storage_dtype(*out_range))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.table[x.astype(np.int64) - self.low]


class SoftmaxKernel:
    """Integer softmax along ``axis`` (see the module docstring).

    Example:
        >>> kernel = SoftmaxKernel(-1, 0, 7, RoundMode.HALF_EVEN, (-128, 127), (-128, 127))
        >>> kernel(np.array([[0, 0], [1, 0]])).tolist()  # 0.5, 0.5 and 0.73, 0.27
        [[64, 64], [94, 34]]
    """

    EXP_BITS = 15

    def __init__(
        self,
        axis: int,
        in_pos: int,
        out_pos: int,
        mode: RoundMode,
        in_range: tuple[int, int],
        out_range: tuple[int, int],
    ):
        span = in_range[1] - in_range[0]
        differences = -np.arange(span + 1, dtype=np.float64)
        self.exp_table = round_values(np.ldexp(np.exp(np.ldexp(differences, -in_pos)), self.EXP_BITS), mode)
        self.axis = axis
        self.out_pos = out_pos
        self.mode = mode
        self.out_range = out_range

    def __call__(self, x: np.ndarray) -> np.ndarray:
        values = x.astype(np.int64)
        exps = self.exp_table[values.max(axis=self.axis, keepdims=True) - values]
        total = exps.sum(axis=self.axis, keepdims=True)
        quotient = divide_round(np.ldexp(exps, self.out_pos), total, self.mode)
        return requantize(quotient, 0, self.mode, *self.out_range, storage_dtype(*self.out_range))
