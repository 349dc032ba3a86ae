"""The bias rule: how a Conv/Gemm bias is stored once the layer's scales are known.

A bias is added to the accumulator of ``input x weight`` products, so integer kernels
(onnxruntime's QLinearConv/QGemm, NPU datapaths) read it as int32 at exactly
``input_scale * weight_scale``; onnxruntime never checks the stored scale, so a bias at
any other scale would be silently wrong there. That product scale is tiny when the
activations are 16-bit (``s_in`` ~1e-5) and an ordinary bias overflows int32. The rule,
decided here once for every backend:

- :attr:`BiasRule.PRODUCT`: int32 at ``s_in * s_w`` whenever every value fits. For a
  layer an integer kernel reads (8-bit activations, weights of at most 8 bits) the
  product scale is the only one allowed, so :func:`fit_weight_to_bias` first raises the
  weight scale of any channel whose bias would not fit: such channels have weights
  orders of magnitude below their bias (``|b| / max|w| > s_in * 2**30 / 127``), and the
  coarser weight step costs them about ``|b| * 2**-22`` of output, far below one
  output step. (EfficientNet-Lite0's near-zero depthwise channels at ``a8w8``.)

  "Fits" leaves room for the products: the kernel adds ``sum (x - zx) * (w - zw)`` to the
  bias codes in an int32 accumulator that wraps (onnxruntime's QLinearConv/QGemm: a
  channel that should read +996083 read -996083 when its bias code sat 2400 below
  2**31). So the bias codes keep ``|b_code| + headroom <= 2**31 - 1``, where
  :func:`accumulation_headroom` gives the worst case ``K * max|x - zx| * max|w - zw|``
  of the layer's ``K`` products per output; without it :data:`DEFAULT_HEADROOM`
  (``2**30``) is reserved, which covers every layer with ``K <= 32896``.
- :attr:`BiasRule.WIDENED`: it does not fit and no integer kernel reads the layer (its
  activations or weights are wider than 8 bits: it runs as DequantizeLinear -> float op):
  int32 at ``s_in * s_w * 2**k`` per channel, with the smallest ``k`` that fits. The
  weights keep their precision, which 16-bit layers are for.
- :attr:`BiasRule.FLOAT`: the config asks for a float bias on a layer no integer kernel
  reads (or, as a last resort, an integer-kernel layer whose weight scale was not fitted
  to its bias, or, when :func:`encode_bias` is given the headroom, not with room for its
  products: float rather than a saturated, wrapping or silently mis-scaled int32). A writer must
  store it so that runtimes keep it exact (onnxruntime re-quantizes a float bias next to
  quantized inputs and weights at ``s_in * s_w``, overflow included). Where an integer
  kernel reads the layer, a float bias cannot survive: the product rule applies, with a
  note.
- :attr:`BiasRule.OWN`: the config gives the bias its own integer spec (e.g. int8 like a
  weight): qparams of its own from its values.

Example:
    >>> import numpy as np
    >>> from quant_core.qparams import QParams
    >>> w = QParams.per_tensor(1e-3, 0, "int8")
    >>> x16 = QParams.per_tensor(1e-5, 0, "uint16")
    >>> small = encode_bias(np.array([0.5], np.float32), x16.scale, w, None, integer_kernel=False)
    >>> small.rule.value, small.codes.tolist()
    ('product', [50000000])
    >>> big = encode_bias(np.array([30.0], np.float32), x16.scale, w, None, integer_kernel=False)
    >>> big.rule.value, int(big.shift[0]) if big.shift.ndim else int(big.shift)
    ('widened', 1)
    >>> x8 = QParams.per_tensor(0.02, 128, "uint8")
    >>> tiny = QParams(np.array([1e-9, 0.01], np.float32), np.zeros(2, np.int64), w.dtype, axis=0)
    >>> room = accumulation_headroom((2, 16, 3, 3), 2, x8, tiny)  # a 3x3 Conv, 16 inputs: K = 144
    >>> room.tolist()
    [2359296.0, 2359296.0]
    >>> fitted, note = fit_weight_to_bias(np.array([5.0, 1.0], np.float32), x8.scale, tiny, headroom=room)
    >>> [float(f"{s:.3g}") for s in fitted.scale], note
    ([1.17e-07, 0.01], 'weight scale raised on 1 of 2 channels so that the int32 bias fits at input_scale * weight_scale with room for the products of the layer')
    >>> encode_bias(np.array([5.0, 1.0], np.float32), x8.scale, fitted, None, integer_kernel=True, headroom=room).rule.value
    'product'
"""

from __future__ import annotations

import enum

import attrs
import numpy as np
import numpy.typing as npt

from quant_core.dtypes import DType
from quant_core.errors import ConfigError, ModelError
from quant_core.qparams import (
    QParams,
    bias_qparams,
    pow2_fix_pos,
    quantize,
    round_values,
    scale_from_fix_pos,
    symmetric_zero_point,
)
from quant_core.spec import QuantSpec
from quant_core.weights import constant_qparams

_INT32 = np.iinfo(np.int32)

DEFAULT_HEADROOM = 2**30
"""Accumulator room (in bias codes) that :func:`fit_weight_to_bias` reserves for a layer's
products when its caller does not give the layer's own :func:`accumulation_headroom`.

Half the int32 range: the products of 8-bit inputs (``|x - zx| <= 255``, uint8 at zero
point 0) and 8-bit weights (``|w - zw| <= 128``) cannot exceed it with up to 32,896
products per output (a 3x3 Conv over 3,655 input channels, a Gemm over 32,896 inputs), so
it is safe for every layer that does not say otherwise. Its cost falls only on channels
whose bias fills more than half of int32 at ``s_in * s_w``: their weight scale comes out
at most twice what the exact headroom would give, still ``|b| * 2**-22`` of output."""

MIN_BIAS_BUDGET = 2**24
"""Bias codes always allowed, whatever the headroom. Past about 65,000 products per
output the worst case of the products alone reaches the int32 limit, and no weight scale
makes the sum provably safe; rather than crush the weights to zero, the bias keeps 2**24
codes (typical biases take 10**3-10**5) and the note says the worst case is not covered."""


class BiasRule(enum.Enum):
    """How a bias is stored (see the module docstring)."""

    PRODUCT = "product"
    WIDENED = "widened"
    FLOAT = "float"
    OWN = "own"


@attrs.frozen(eq=False)
class EncodedBias:
    """A bias as it will be stored: ``codes`` and ``qparams`` (``None`` for a float bias),
    the ``rule`` applied, the per-channel power-of-two widening ``shift`` (zeros unless
    :attr:`BiasRule.WIDENED`) and a ``note`` for reports when the rule had to leave the
    product scale.

    Example:
        >>> EncodedBias(BiasRule.FLOAT, None, None, np.zeros(1, np.int64), "kept float").is_float
        True
    """

    rule: BiasRule
    codes: np.ndarray | None
    qparams: QParams | None
    shift: np.ndarray
    note: str | None = None

    @property
    def is_float(self) -> bool:
        return self.codes is None

    def values(self) -> np.ndarray | None:
        """The real values the stored codes stand for (``None`` for a float bias)."""
        if self.codes is None or self.qparams is None:
            return None
        from quant_core.qparams import dequantize

        return dequantize(self.codes, self.qparams)


def _product_codes(value: np.ndarray, qp: QParams) -> np.ndarray:
    """Unclipped codes at ``qp``'s scale (float64, rounded like ``qp``)."""
    scale = qp.scale.astype(np.float64)
    return round_values(value.astype(np.float64) / scale, qp.rounding)


def _fits(codes: np.ndarray) -> np.ndarray:
    return (codes >= _INT32.min) & (codes <= _INT32.max)


def _widening_shift(value: np.ndarray, qp: QParams) -> np.ndarray:
    """Smallest ``k >= 0`` per channel (one for a per-tensor scale) such that the bias
    fits int32 at ``scale * 2**k``."""
    magnitude = np.abs(value.astype(np.float64))
    if qp.scale.ndim == 0:
        magnitude = np.asarray(magnitude.max(initial=0.0))
    ratio = magnitude / (qp.scale.astype(np.float64) * float(_INT32.max))
    with np.errstate(divide="ignore"):
        shift = np.where(ratio > 1.0, np.ceil(np.log2(np.maximum(ratio, 1.0))), 0.0).astype(np.int64)
    # Rounding can still land one code past the limit: widen once more where it does.
    while True:
        widened = attrs.evolve(qp, scale=(qp.scale * scale_from_fix_pos(-shift)).astype(np.float32))
        codes = _product_codes(value, widened)
        too_big = ~_fits(codes)
        if not too_big.any():
            return shift
        shift = shift + (too_big.any() if qp.scale.ndim == 0 else too_big).astype(np.int64)


def _max_offset(qp: QParams, any_zero_point: bool) -> np.ndarray:
    """Largest ``|code - zero_point|`` that ``qp`` can store (per channel where its zero
    point is); with ``any_zero_point``, for any zero point it may be moved to."""
    if any_zero_point:
        return np.asarray(float(qp.qmax - qp.qmin))
    zero_point = np.asarray(qp.zero_point, np.float64)
    return np.maximum(qp.qmax - zero_point, zero_point - qp.qmin)


def accumulation_headroom(
    weight_shape: tuple[int, ...], outputs: int, input_qp: QParams, weight_qp: QParams
) -> np.ndarray:
    """The largest ``|sum (x - zx) * (w - zw)|`` one output of a Conv/Gemm/MatMul can reach
    in its int32 accumulator, in bias codes: ``K * max|x - zx| * max|w - zw|``, per weight
    channel (a scalar for a per-tensor weight). Pass it as ``headroom`` to
    :func:`fit_weight_to_bias` and :func:`encode_bias`.

    Args:
        weight_shape: the weight's shape as the kernel reads it (any layout).
        outputs: how many values the bias holds (its ``size``): the output channels.
        input_qp: the qparams of the layer's input (its zero point and format).
        weight_qp: the weight's qparams.

    ``K``, the products per output, is the weight's size over its output channels: Conv
    ``[Cout, Cin/g, kh, kw]`` gives ``Cin/g * kh * kw``, Gemm/MatMul ``[K, N]`` or
    ``[N, K]`` give ``K``. When ``outputs`` is not one of the weight's dimensions (a
    scalar or broadcast bias, ConvTranspose's grouped channels) every weight element is
    counted: never less than the truth. A symmetric weight's codes lie within half its
    range of the zero point; an asymmetric one's zero point may move when
    :func:`fit_weight_to_bias` raises its scale, so its whole range is counted, and the
    headroom computed before and after the fit agree.

    Example:
        >>> from quant_core.qparams import QParams
        >>> x = QParams.per_tensor(0.02, 0, "uint8")  # after a Relu: codes 0..255
        >>> w = QParams.per_tensor(0.01, 0, "int8")
        >>> float(accumulation_headroom((64, 32, 3, 3), 64, x, w))  # 288 * 255 * 128
        9400320.0
    """
    size = int(np.prod(weight_shape, dtype=np.int64))
    channels = outputs if outputs > 0 and outputs in weight_shape else 1
    products = max(size // channels, 1)
    symmetric = bool(np.all(weight_qp.zero_point == symmetric_zero_point(weight_qp.dtype)))
    x_reach = float(_max_offset(input_qp, any_zero_point=False).max(initial=0.0))
    w_reach = _max_offset(weight_qp, any_zero_point=not symmetric)
    # float64 holds these products exactly (< 2**53 for any real layer).
    headroom = float(products) * x_reach * w_reach.astype(np.float64)
    return np.broadcast_to(headroom, np.shape(weight_qp.scale)).astype(np.float64)


def _bias_budget(headroom: npt.ArrayLike | None) -> tuple[np.ndarray, bool]:
    """Largest ``|bias code|`` a headroom leaves (float64), and whether the floor
    :data:`MIN_BIAS_BUDGET` had to replace it (the worst case is then not covered)."""
    room = np.asarray(DEFAULT_HEADROOM if headroom is None else headroom, np.float64)
    if np.any(room < 0) or not np.all(np.isfinite(room)):
        raise ConfigError(f"headroom: {room.tolist()!r} is not allowed; allowed: finite values >= 0")
    budget = float(_INT32.max) - room
    return np.maximum(budget, float(MIN_BIAS_BUDGET)), bool(np.any(budget < MIN_BIAS_BUDGET))


def fit_weight_to_bias(
    bias: npt.ArrayLike,
    input_scale: npt.ArrayLike,
    weight_qp: QParams,
    *,
    headroom: npt.ArrayLike | None = None,
) -> tuple[QParams, str | None]:
    """``weight_qp`` with each channel's scale raised (never lowered) just enough that
    ``bias`` fits int32 at ``input_scale * weight_scale`` with ``headroom`` codes to spare
    for the layer's products (``|b_code| <= 2**31 - 1 - headroom``), and a note when any
    was raised. Power-of-two scales stay powers of two; a per-tensor scale rises for its
    largest channel. For layers whose bias must sit at the product scale (module
    docstring); the weights must then be quantized with the returned qparams.

    ``headroom``: the layer's :func:`accumulation_headroom` (per channel or a scalar);
    ``None`` reserves :data:`DEFAULT_HEADROOM`, enough for up to 32,896 products per
    output. The bias always keeps :data:`MIN_BIAS_BUDGET` codes (the note then says the
    worst case of the products is not covered)."""
    value = np.abs(np.asarray(bias, np.float64)).reshape(-1)
    in_scale = float(np.asarray(input_scale, np.float64).reshape(-1)[0])
    budget, floored = _bias_budget(headroom)
    if budget.ndim and weight_qp.scale.ndim == 0:
        budget = np.asarray(budget.min(initial=float(_INT32.max)))
    # The margin keeps the rounded code strictly inside the budget after float32 scale rounding.
    needed = value / (in_scale * (budget - 1.0)) * (1.0 + 1e-6)
    if weight_qp.scale.ndim == 0:
        needed = np.asarray(needed.max(initial=0.0))
    elif needed.shape != weight_qp.scale.shape:
        raise ModelError(f"bias: {needed.size} values but the weight has {weight_qp.scale.shape[0]} channel scales")
    current = weight_qp.scale.astype(np.float64)
    raise_mask = needed > current
    if not raise_mask.any():
        return weight_qp, None
    fix_pos = weight_qp.fix_pos
    if fix_pos is not None:
        fix_pos = np.where(raise_mask, np.minimum(fix_pos, pow2_fix_pos(needed)), fix_pos).astype(np.int64)
        scale = scale_from_fix_pos(fix_pos)
    else:
        scale = np.where(raise_mask, np.nextafter(needed.astype(np.float32), np.float32(np.inf)), weight_qp.scale)
        scale = scale.astype(np.float32)
    zero_point = weight_qp.zero_point
    if np.any(zero_point != symmetric_zero_point(weight_qp.dtype)):
        # An asymmetric weight keeps its lower range end where it was.
        low = (weight_qp.qmin - zero_point) * weight_qp.scale.astype(np.float64)
        zero_point = np.clip(np.rint(weight_qp.qmin - low / scale), weight_qp.qmin, weight_qp.qmax).astype(np.int64)
    channels = int(raise_mask.sum())
    total = 1 if weight_qp.scale.ndim == 0 else int(weight_qp.scale.shape[0])
    note = (
        f"weight scale raised on {channels} of {total} channels so that the int32 bias fits at "
        "input_scale * weight_scale with room for the products of the layer"
    )
    if floored:
        note += f" (the products alone can reach the int32 limit; the bias keeps {MIN_BIAS_BUDGET} codes)"
    return attrs.evolve(weight_qp, scale=np.asarray(scale, np.float32), zero_point=zero_point, fix_pos=fix_pos), note


def encode_layer_bias(
    node: str,
    bias: npt.ArrayLike | None,
    input_scale: npt.ArrayLike | None,
    weight_qp: QParams,
    spec: QuantSpec | None,
    *,
    integer_kernel: bool,
) -> tuple[EncodedBias | None, tuple[str, ...]]:
    """The bias rule for one layer as both backends apply it: ``bias`` (``None``: not a
    constant) encoded with :func:`encode_bias`, or ``None`` when it stays float, and the
    notes for the report (naming ``node``). A layer whose input is not quantized
    (``input_scale`` ``None``) keeps its bias float; so does a bias that is not one value
    per channel where the rule wants int32 per channel (:func:`bias_to_encode`).

    Example:
        >>> w = QParams(scale=np.full(2, 0.01, np.float32), zero_point=np.zeros(2, np.int64), dtype="int8", axis=0)
        >>> encoded, notes = encode_layer_bias("fc", np.array([0.5, -1.0]), 0.1, w, None, integer_kernel=True)
        >>> encoded.rule.value, encoded.codes.tolist(), notes
        ('product', [500, -1000], ())
        >>> encode_layer_bias("fc", np.array([0.5, -1.0]), None, w, None, integer_kernel=True)
        (None, ("node 'fc': bias kept float (its input is not quantized)",))
    """
    if bias is None or input_scale is None:
        return None, (f"node {node!r}: bias kept float (its input is not quantized)",)
    value, kept_float = bias_to_encode(bias, weight_qp, spec, integer_kernel=integer_kernel)
    if value is None:
        return None, (f"node {node!r}: {kept_float}",)
    encoded = encode_bias(value, input_scale, weight_qp, spec, integer_kernel=integer_kernel)
    return encoded, () if encoded.note is None else (f"node {node!r}: {encoded.note}",)


def bias_to_encode(
    bias: npt.ArrayLike, weight_qp: QParams, spec: QuantSpec | None, *, integer_kernel: bool
) -> tuple[np.ndarray | None, str | None]:
    """A layer's bias as :func:`encode_bias` takes it, or ``None`` and why it stays float.

    Where the rule stores the bias as int32 per channel (no spec, an int32 spec, or a float
    spec an integer kernel overrides), it must hold one value per weight channel: a bias
    broadcast as ``[1, N]`` is flattened to ``[N]``; any other shape (one bias per row of a
    Gemm, say) is not a per-channel bias, and stays float.

    Example:
        >>> w = QParams(scale=np.ones(4, np.float32), zero_point=np.zeros(4, np.int64), dtype="int8", axis=0)
        >>> bias_to_encode(np.ones((1, 4)), w, None, integer_kernel=True)[0].shape
        (4,)
        >>> bias_to_encode(np.ones((2, 4)), w, None, integer_kernel=True)
        (None, 'bias of shape [2, 4] kept float (not one per channel)')
        >>> bias_to_encode(np.ones((4, 1)), w, None, integer_kernel=True)[1]  # one per row
        'bias of shape [4, 1] kept float (not one per channel)'
    """
    value = np.asarray(bias, np.float32)
    integer = spec is None or spec.dtype is DType.INT32 or (not spec.is_quantized and integer_kernel)
    channels = np.shape(weight_qp.scale)
    if integer and channels:
        per_channel = one_per_channel(value, channels[0])
        if per_channel is None:
            return None, f"bias of shape {list(value.shape)} kept float (not one per channel)"
        value = per_channel
    return value, None


def one_per_channel(bias: npt.ArrayLike, channels: int) -> np.ndarray | None:
    """``bias`` as one value per output channel (1-D), or ``None`` when it is not that:
    its last axis must hold the channels and every other axis be 1. A Gemm bias of shape
    ``[M, 1]`` adds one value per row and, with ``M == N``, has the size of a per-column
    bias without being one.

    Example:
        >>> one_per_channel(np.ones((1, 3)), 3).shape, one_per_channel(np.ones((3, 1)), 3)
        ((3,), None)
    """
    value = np.asarray(bias)
    if value.ndim == 0 or value.shape[-1] != channels or any(d != 1 for d in value.shape[:-1]):
        return None
    return value.reshape(-1)


def encode_bias(
    bias: npt.ArrayLike,
    input_scale: npt.ArrayLike,
    weight_qp: QParams,
    spec: QuantSpec | None,
    *,
    integer_kernel: bool,
    headroom: npt.ArrayLike | None = None,
) -> EncodedBias:
    """Apply the bias rule (module docstring) to ``bias`` (``[Cout]``, or a scalar for a
    per-tensor weight) of a layer whose input has scale ``input_scale`` and whose weight
    has ``weight_qp``. ``spec`` is the config's bias spec (``None``: int32 by the rule);
    ``integer_kernel`` whether the layer's formats are those integer kernels consume
    (8-bit activations and weights of at most 8 bits: the planner's
    :attr:`~quant_core.plan.BiasSlot.integer_kernel`).

    ``headroom`` (integer-kernel layers only; the others run as DequantizeLinear -> float
    op, with no int32 accumulator): the layer's :func:`accumulation_headroom`. Given, an
    int32 bias must also leave that much of the accumulator free, as
    :func:`fit_weight_to_bias` arranged, or it stays float like one that does not fit;
    pass it wherever the bias may have changed since the weight scale was fitted (bias
    correction, AdaQuant). ``None`` checks only that the codes fit int32: this function
    does not know the layer's products, and a stricter default than the fit's would turn
    biases the fit placed into float ones.
    """
    value = np.asarray(bias, np.float32)
    no_shift = np.zeros(np.shape(weight_qp.scale), np.int64)
    overridden = None
    if spec is not None and not spec.is_quantized:
        if not integer_kernel:
            return EncodedBias(BiasRule.FLOAT, None, None, no_shift)
        overridden = (
            f"the config keeps this bias {spec.dtype.value}, but an integer kernel reads the layer and takes its "
            "bias only as int32 at input_scale * weight_scale; stored so"
        )
        spec = None
    if spec is not None and spec.dtype is not DType.INT32:
        qp = constant_qparams(value, spec)
        return EncodedBias(BiasRule.OWN, quantize(value, qp), qp, no_shift)
    qp = bias_qparams(input_scale, weight_qp, DType.INT32)
    if qp.scale.ndim and (value.ndim != 1 or qp.scale.shape[0] != value.shape[0]):
        raise ModelError(f"bias: shape {list(value.shape)} but the weight has {qp.scale.shape[0]} channel scales")
    codes = _product_codes(value, qp)
    if integer_kernel and headroom is not None:
        budget, _ = _bias_budget(headroom)
        crowded = int(np.count_nonzero(np.abs(codes) > budget))
        if crowded:
            note = (
                f"{crowded} bias values leave less than the layer's products need of the int32 accumulator at "
                "input_scale * weight_scale and the weight scale was not fitted to the bias (fit_weight_to_bias); "
                "the bias stays float, so this layer runs in float"
            )
            return EncodedBias(BiasRule.FLOAT, None, None, no_shift, note)
    if _fits(codes).all():
        return EncodedBias(BiasRule.PRODUCT, codes.astype(np.int32), qp, no_shift, overridden)
    overflow = int(np.count_nonzero(~_fits(codes)))
    if integer_kernel:
        note = (
            f"{overflow} bias values exceed int32 at input_scale * weight_scale and the weight scale was not fitted "
            "to the bias (fit_weight_to_bias); the bias stays float, so this layer runs in float"
        )
        return EncodedBias(BiasRule.FLOAT, None, None, no_shift, note)
    shift = _widening_shift(value, qp)
    widened = attrs.evolve(
        qp,
        scale=(qp.scale * scale_from_fix_pos(-shift)).astype(np.float32),
        fix_pos=None if qp.fix_pos is None else qp.fix_pos - shift,
    )
    note = (
        f"{overflow} bias values exceed int32 at input_scale * weight_scale; stored as int32 at that scale "
        f"x 2**{int(shift.max())} (no integer kernel reads this layer's formats)"
    )
    codes = _product_codes(value, widened).astype(np.int32)
    return EncodedBias(BiasRule.WIDENED, codes, widened, shift, note)
