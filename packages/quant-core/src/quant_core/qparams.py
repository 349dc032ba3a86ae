"""Quantization parameters and the numpy reference arithmetic.

Every backend takes its scales and zero points from :func:`qparams_from_range` and is
tested against :func:`quantize`, :func:`dequantize` and :func:`fake_quantize` here.
The arithmetic follows ONNX ``QuantizeLinear``: ``q = saturate(round(x / scale) + zp)``
computed in float32.

Example:
    >>> import numpy as np
    >>> from quant_core.spec import QuantSpec
    >>> spec = QuantSpec(dtype="int8", scale_type="power_of_two")
    >>> qp = qparams_from_range(-1.0, 3.0, spec)
    >>> float(qp.scale), int(qp.fix_pos)
    (0.03125, 5)
    >>> quantize(np.array([0.5, 5.0], np.float32), qp)
    array([ 16, 127], dtype=int8)
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from quant_core.dtypes import DType
from quant_core.errors import ConfigError, DataError
from quant_core.spec import QuantSpec, RoundMode, ScaleType

FloatArray = npt.NDArray[np.floating[Any]]
ArrayLike = npt.ArrayLike

# Keeps every scale a normal float32 and 2**-fix_pos exactly representable.
_MIN_SCALE = float(np.finfo(np.float32).tiny) * 2.0**24
_MAX_FIX_POS = 100
_SQRT_HALF = float(np.sqrt(0.5))  # mantissas below it are nearer the lower power of two


def _eq_arrays(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and bool(np.array_equal(a, b))


@attrs.frozen(eq=False)
class QParams:
    """Everything needed to reproduce one tensor's integer codes: scale and zero point
    (arrays: shape ``()`` per tensor, ``(C,)`` per channel along ``axis``), the storage
    format, whether the lowest code is dropped (``narrow_range``), the power-of-two
    position (``fix_pos``, ``None`` for float scales) and the rounding mode. Every
    quantizer (weights, biases, AdaRound, mixed precision, the NPU simulator) takes its
    rounding from here.

    Example:
        >>> qp = QParams.per_tensor(0.5, 0, "int8", rounding="half_up")
        >>> qp.qmin, qp.qmax, qp.rounding.value, qp.scale_type.value
        (-128, 127, 'half_up', 'float')
    """

    scale: np.ndarray
    zero_point: np.ndarray
    dtype: DType
    axis: int | None = None
    narrow_range: bool = False
    fix_pos: np.ndarray | None = None
    rounding: RoundMode = attrs.field(default=RoundMode.HALF_EVEN, converter=RoundMode)

    @staticmethod
    def per_tensor(
        scale: float,
        zero_point: int,
        dtype: DType | str,
        narrow_range: bool = False,
        fix_pos: int | None = None,
        rounding: RoundMode | str = RoundMode.HALF_EVEN,
    ) -> QParams:
        return QParams(
            scale=np.asarray(scale, np.float32),
            zero_point=np.asarray(zero_point, np.int64),
            dtype=DType.parse(dtype),
            narrow_range=narrow_range,
            fix_pos=None if fix_pos is None else np.asarray(fix_pos, np.int64),
            rounding=RoundMode(rounding),
        )

    @property
    def qmin(self) -> int:
        return self.dtype.qrange(self.narrow_range)[0]

    @property
    def qmax(self) -> int:
        return self.dtype.qrange(self.narrow_range)[1]

    @property
    def is_power_of_two(self) -> bool:
        return self.fix_pos is not None

    @property
    def scale_type(self) -> ScaleType:
        return ScaleType.POWER_OF_TWO if self.fix_pos is not None else ScaleType.FLOAT

    def broadcast_shape(self, ndim: int) -> tuple[int, ...]:
        """Shape that broadcasts the per-channel arrays against a rank-``ndim`` tensor."""
        if self.axis is None:
            return ()
        shape = [1] * ndim
        shape[self.axis] = -1
        return tuple(shape)

    def evolve(self, **changes: Any) -> QParams:
        """A copy with ``changes`` applied.

        Example:
            >>> QParams.per_tensor(0.5, 0, "int8").evolve(dtype=DType.INT16).dtype.value
            'int16'
        """
        result: QParams = attrs.evolve(self, **changes)
        return result

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, QParams):
            return NotImplemented
        return (
            self.dtype is other.dtype
            and self.axis == other.axis
            and self.narrow_range == other.narrow_range
            and self.rounding is other.rounding
            and _eq_arrays(self.scale, other.scale)
            and _eq_arrays(self.zero_point, other.zero_point)
            and _eq_arrays(self.fix_pos, other.fix_pos)
        )

    __hash__ = None  # type: ignore[assignment]


def qparams_to_data(qp: QParams) -> dict[str, Any]:
    """Every field of ``qp`` as JSON-ready values (float32 scales print exactly as JSON
    numbers and come back bit for bit): what checkpoints and state files store.

    Example:
        >>> qp = QParams.per_tensor(0.25, 0, "int8", rounding="half_up")
        >>> qparams_from_data(qparams_to_data(qp)) == qp
        True
    """
    return {
        "scale": np.asarray(qp.scale, np.float32).tolist(),
        "zero_point": np.asarray(qp.zero_point).tolist(),
        "dtype": qp.dtype.value,
        "axis": qp.axis,
        "narrow_range": qp.narrow_range,
        "fix_pos": None if qp.fix_pos is None else np.asarray(qp.fix_pos).tolist(),
        "rounding": qp.rounding.value,
    }


def qparams_from_data(data: dict[str, Any]) -> QParams:
    """The :class:`QParams` :func:`qparams_to_data` wrote (arrays in place of lists work too)."""
    return QParams(
        scale=np.asarray(data["scale"], np.float32),
        zero_point=np.asarray(data["zero_point"], np.int64),
        dtype=DType.parse(data["dtype"]),
        axis=data["axis"],
        narrow_range=bool(data["narrow_range"]),
        fix_pos=None if data["fix_pos"] is None else np.asarray(data["fix_pos"], np.int64),
        rounding=data["rounding"],
    )


def symmetric_zero_point(dtype: DType) -> int:
    """Zero point of a symmetric spec: 0 for signed formats, the mid-code for unsigned."""
    return 0 if dtype.signed else (dtype.qmax + 1) // 2


def positive_levels(dtype: DType, narrow_range: bool = False) -> int:
    """How many codes lie above the symmetric zero point (int8: 127, uint8 at 128: 127)."""
    return dtype.qrange(narrow_range)[1] - symmetric_zero_point(dtype)


def pow2_fix_pos(scale: ArrayLike) -> np.ndarray:
    """Smallest power-of-two scale >= ``scale``, as its fix position ``p`` (scale ``2**-p``):
    for scales that must not clip (a bias moved to fit, a position covering a format's
    whole range); calibrated formats take :func:`nearest_pow2_fix_pos`.

    Example:
        >>> pow2_fix_pos([0.03, 0.25, 1.5]).tolist()
        [5, 2, -1]
    """
    s = np.maximum(np.asarray(scale, np.float64), _MIN_SCALE)
    mantissa, exponent = np.frexp(s)  # s = m * 2**e with m in [0.5, 1)
    ceil_log2 = np.where(mantissa == 0.5, exponent - 1, exponent)
    return np.clip(-ceil_log2, -_MAX_FIX_POS, _MAX_FIX_POS).astype(np.int64)


def nearest_pow2_fix_pos(scale: ArrayLike) -> np.ndarray:
    """The power-of-two scale nearest to ``scale`` on a log2 scale, as its fix position:
    ``round(-log2(scale))``, the rule of Quark's and Vitis AI's power-of-two quantizers.

    The rule every calibrated power-of-two format takes (:func:`qparams_from_range`). It
    may clip: the largest value of a min-max range can lose up to ``1 - 2**-0.5`` (29%)
    of itself. Rounding up instead (:func:`pow2_fix_pos`, nothing clips) leaves up to
    half of the codes unused; on per-tensor weights that is the worse trade by far
    (EfficientNet-Lite0's top-1 agreement under ``xint8`` with min-max activations 0.23
    rounding up, 0.43 to the nearest; ``docs/benchmarks.md``, "Power-of-two positions").

    Example:
        >>> nearest_pow2_fix_pos([0.03, 0.25, 0.7, 1.5]).tolist()  # 0.7 -> 2**-1, 1.5 -> 2**1
        [5, 2, 1, -1]
    """
    s = np.maximum(np.asarray(scale, np.float64), _MIN_SCALE)
    mantissa, exponent = np.frexp(s)  # log2(s) = exponent + log2(mantissa), log2(mantissa) in [-1, 0)
    nearest_log2 = np.where(mantissa < _SQRT_HALF, exponent - 1, exponent)
    return np.clip(-nearest_log2, -_MAX_FIX_POS, _MAX_FIX_POS).astype(np.int64)


def scale_from_fix_pos(fix_pos: ArrayLike) -> np.ndarray:
    """``2**-fix_pos`` exactly, as float32."""
    return np.ldexp(np.float32(1.0), -np.asarray(fix_pos, np.int64).astype(np.int32)).astype(np.float32)


def qparams_from_range(min_val: ArrayLike, max_val: ArrayLike, spec: QuantSpec, *, covering: bool = False) -> QParams:
    """Scale and zero point covering ``[min_val, max_val]`` (scalars, or per-channel
    arrays when the spec is per channel). The range is widened to include 0 so that
    zero is exactly representable. A power-of-two scale is the one nearest the float
    scale (:func:`nearest_pow2_fix_pos`), so it may clip the ends of the range; with
    ``covering`` it is the next one up (:func:`pow2_fix_pos`), for a range whose ends the
    grid must reach (a masked score's fill, a reader's saturation point).

    Example:
        >>> from quant_core.spec import QuantSpec
        >>> qp = qparams_from_range(-2.0, 6.0, QuantSpec(dtype="uint8", symmetric=False))
        >>> round(float(qp.scale), 6), int(qp.zero_point)
        (0.031373, 64)
        >>> pow2 = QuantSpec(dtype="int8", scale_type="power_of_two")
        >>> [float(qparams_from_range(-5.0, 5.0, pow2, covering=c).scale) for c in (False, True)]
        [0.03125, 0.0625]
    """
    if not spec.is_quantized:
        raise ConfigError(f"dtype: {spec.dtype.value} is a float format; it has no quantization parameters")
    lo = np.minimum(np.asarray(min_val, np.float64), 0.0)
    hi = np.maximum(np.asarray(max_val, np.float64), 0.0)
    if lo.shape != hi.shape:
        raise DataError(f"min_val and max_val shapes differ: {lo.shape} vs {hi.shape}")
    if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi))):
        raise DataError("range: min_val and max_val must be finite")
    axis = spec.channel_axis
    if axis is None and lo.ndim != 0:
        raise DataError(f"per-tensor spec got a range of shape {lo.shape}; expected scalars")
    if axis is not None and lo.ndim != 1:
        raise DataError(f"per-channel spec got a range of shape {lo.shape}; expected one value per channel")
    qmin, qmax = spec.qrange
    pow2 = spec.scale_type is ScaleType.POWER_OF_TWO
    if spec.symmetric:
        amax = np.maximum(-lo, hi)
        scale = amax / positive_levels(spec.dtype, spec.narrow_range)
        zero_point = np.full(amax.shape, symmetric_zero_point(spec.dtype), np.int64)
    else:
        scale = (hi - lo) / (qmax - qmin)
    empty = scale <= 0.0
    scale = np.where(empty, 1.0, np.maximum(scale, _MIN_SCALE))
    fix_pos = None
    if pow2:
        position = pow2_fix_pos(scale) if covering else nearest_pow2_fix_pos(scale)
        fix_pos = np.where(empty, 0, position).astype(np.int64)
        scale = scale_from_fix_pos(fix_pos).astype(np.float64)
    scale32 = scale.astype(np.float32)
    if not spec.symmetric:
        zero_point = np.clip(np.rint(qmin - lo / scale32.astype(np.float64)), qmin, qmax).astype(np.int64)
    return QParams(
        scale=scale32,
        zero_point=zero_point,
        dtype=spec.dtype,
        axis=axis,
        narrow_range=spec.narrow_range,
        fix_pos=fix_pos,
        rounding=spec.rounding,
    )


def _half_up(x: np.ndarray) -> np.ndarray:
    # ``floor(x + 0.5)`` rounds the sum first (0.49999997 + 0.5 == 1.0 in float32);
    # the fraction ``x - floor(x)`` is exact, so compare it with 0.5 instead.
    low: np.ndarray = np.floor(x)
    with np.errstate(invalid="ignore"):  # inf - inf: the result is low (inf) anyway
        out: np.ndarray = low + (x - low >= 0.5).astype(x.dtype)
    return out


def round_values(x: np.ndarray, mode: RoundMode | str) -> np.ndarray:
    """Round to integers (as floats) with the given mode.

    Example:
        >>> import numpy as np
        >>> round_values(np.array([-2.5, -0.5, 0.5, 1.5]), "half_up").tolist()
        [-2.0, 0.0, 1.0, 2.0]
    """
    mode = RoundMode(mode) if not isinstance(mode, RoundMode) else mode
    out: np.ndarray
    if mode is RoundMode.HALF_EVEN:
        out = np.rint(x)
    elif mode is RoundMode.HALF_UP:
        out = _half_up(x)
    elif mode is RoundMode.HALF_AWAY:
        out = np.copysign(_half_up(np.abs(x)), x)
    elif mode is RoundMode.FLOOR:
        out = np.floor(x)
    elif mode is RoundMode.CEIL:
        out = np.ceil(x)
    else:
        out = np.trunc(x)
    return out


def _reshaped(qp: QParams, ndim: int) -> tuple[np.ndarray, np.ndarray]:
    shape = qp.broadcast_shape(ndim)
    return qp.scale.reshape(shape), qp.zero_point.reshape(shape)


def quantize(x: ArrayLike, qp: QParams) -> np.ndarray:
    """Integer codes of ``x`` (float32 arithmetic, ``qp.rounding``, saturating; NaN gives
    the lowest code), in ``qp.dtype``'s numpy type.

    Example:
        >>> import numpy as np
        >>> quantize(np.array([0.26, -99.0], np.float32), QParams.per_tensor(0.5, 0, "int8", narrow_range=True))
        array([   1, -127], dtype=int8)
    """
    xf = np.asarray(x, np.float32)
    scale, zero_point = _reshaped(qp, xf.ndim)
    if xf.ndim == 0 or xf.size <= _BLOCK_ELEMENTS or xf.shape[0] < 2:
        return _quantize_block(xf, scale, zero_point, qp)
    # Block by block along axis 0: the float64 temporaries of a multi-GB weight would
    # otherwise take several times its size (the codes are the same, element by element).
    codes = np.empty(xf.shape, qp.dtype.numpy_dtype)
    rows = max(1, _BLOCK_ELEMENTS // (xf.size // xf.shape[0]))
    per_row = scale.ndim == xf.ndim and scale.shape[0] > 1  # per channel along axis 0
    for start in range(0, xf.shape[0], rows):
        block = slice(start, start + rows)
        codes[block] = _quantize_block(
            xf[block], scale[block] if per_row else scale, zero_point[block] if per_row else zero_point, qp
        )
    return codes


#: Elements above which :func:`quantize` works in blocks of about this many.
_BLOCK_ELEMENTS = 1 << 22


def _quantize_block(xf: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, qp: QParams) -> np.ndarray:
    # Divide and round in float32 as ONNX does; add the zero point and saturate in
    # float64, where int32's limits (and uint16/int32 zero points) are exact. NaN becomes
    # the lowest code, as onnxruntime's QuantizeLinear makes it.
    with np.errstate(invalid="ignore", over="ignore"):  # inf and NaN saturate below
        q = round_values(xf / scale, qp.rounding).astype(np.float64) + zero_point
    q = np.where(np.isnan(q), qp.qmin, q)
    codes: np.ndarray = np.clip(q, qp.qmin, qp.qmax).astype(qp.dtype.numpy_dtype)
    return codes


def dequantize(q: ArrayLike, qp: QParams) -> np.ndarray:
    """Real values of integer codes: ``(q - zp) * scale`` in float32."""
    qa = np.asarray(q)
    scale, zero_point = _reshaped(qp, qa.ndim)
    values: np.ndarray = ((qa.astype(np.int64) - zero_point).astype(np.float32) * scale).astype(np.float32)
    return values


def fake_quantize(x: ArrayLike, qp: QParams) -> np.ndarray:
    """``dequantize(quantize(x))``: the float values a quantized model computes with."""
    return dequantize(quantize(x, qp), qp)


def quantization_error(x: ArrayLike, qp: QParams) -> float:
    """Mean squared error of fake-quantizing ``x``."""
    xf = np.asarray(x, np.float32)
    diff = fake_quantize(xf, qp).astype(np.float64) - xf
    return float(np.mean(diff * diff)) if diff.size else 0.0


def sqnr_db(reference: ArrayLike, approx: ArrayLike) -> float:
    """Signal-to-quantization-noise ratio in dB (inf when identical).

    Example:
        >>> import numpy as np
        >>> round(sqnr_db(np.ones(4), np.ones(4) * 1.1), 2)
        20.0
    """
    ref = np.asarray(reference, np.float64)
    noise = ref - np.asarray(approx, np.float64)
    noise_power = float(np.mean(noise * noise)) if noise.size else 0.0
    signal_power = float(np.mean(ref * ref)) if ref.size else 0.0
    if noise_power == 0.0:
        return float("inf")
    if signal_power == 0.0:
        return float("-inf")
    return 10.0 * float(np.log10(signal_power / noise_power))


def bias_qparams(input_scale: ArrayLike, weight_qp: QParams, dtype: DType | str = DType.INT32) -> QParams:
    """Bias qparams fixed by the conv/gemm it feeds: scale ``input_scale * weight_scale``
    (per channel when the weight is), zero point 0, as onnxruntime's integer kernels
    and NPUs require. Power-of-two positions add; the bias rounds like its weight.
    Whether a bias fits at this scale is :mod:`quant_core.bias`'s decision.

    Example:
        >>> w = QParams.per_tensor(0.25, 0, "int8", fix_pos=2)
        >>> b = bias_qparams(0.5, w)
        >>> float(b.scale), int(b.fix_pos)
        (0.125, 3)
    """
    dt = DType.parse(dtype)
    in_scale = np.asarray(input_scale, np.float32)
    scale = (in_scale * weight_qp.scale).astype(np.float32)
    fix_pos = None
    if weight_qp.fix_pos is not None:
        in_pos = pow2_fix_pos(in_scale)
        if np.array_equal(scale_from_fix_pos(in_pos), in_scale):
            fix_pos = (in_pos + weight_qp.fix_pos).astype(np.int64)
    return QParams(
        scale=scale,
        zero_point=np.zeros(scale.shape, np.int64),
        dtype=dt,
        axis=None if scale.ndim == 0 else 0,
        fix_pos=fix_pos,
        rounding=weight_qp.rounding,
    )
