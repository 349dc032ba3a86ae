"""Facts of the QDQ form every backend writes (ONNX QuantizeLinear/DequantizeLinear pairs),
shared so that the ONNX writer and the torch exporter make the same choices:

- :func:`required_opset`: the default-domain opset the stored formats need;
- :func:`encode_activation`: int8 activations stored as uint8 with the zero point moved
  by 128 (identical real values; the encoding onnxruntime's x86 integer kernels take);
- :func:`activation_is_absorbed`: whether quantizing with the post-activation qparams
  already applies a fused Relu/Clip exactly, so a writer may drop the activation node;
- :func:`guard_matmul_weight`: whether a MatMul's weight must be written in the form
  onnxruntime's MatMulNBits rewrite refuses (:data:`MATMUL_WEIGHT_AXIS`).

Example:
    >>> from quant_core.qparams import QParams
    >>> qp = encode_activation(QParams.per_tensor(0.5, 0, "int8"), "x86_uint8")
    >>> qp.dtype.value, int(qp.zero_point), required_opset([qp.dtype])
    ('uint8', 128, 13)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import attrs
import numpy as np

from quant_core.dtypes import DType
from quant_core.errors import ConfigError
from quant_core.qparams import QParams, quantize

ActivationEncoding = Literal["x86_uint8", "as_spec"]
ACTIVATION_ENCODINGS: tuple[str, ...] = ("x86_uint8", "as_spec")


def check_activation_encoding(value: str) -> None:
    """Refuse an activation encoding that is not one of :data:`ACTIVATION_ENCODINGS`
    (both backends' writers ask).

    Example:
        >>> check_activation_encoding("x86_int8")
        Traceback (most recent call last):
        ...
        quant_core.errors.ConfigError: activation_encoding: 'x86_int8' is not allowed; allowed: x86_uint8, as_spec
    """
    if value not in ACTIVATION_ENCODINGS:
        raise ConfigError(f"activation_encoding: {value!r} is not allowed; allowed: {', '.join(ACTIVATION_ENCODINGS)}")


# QuantizeLinear/DequantizeLinear accept these formats from this default-domain opset on.
_OPSET_FOR_DTYPE = {DType.INT4: 21, DType.UINT4: 21, DType.INT16: 21, DType.UINT16: 21}
BASE_QDQ_OPSET = 13
"""Per-channel DequantizeLinear (``axis``) needs opset 13."""


def required_opset(dtypes: Iterable[DType]) -> int:
    """The default-domain opset a QDQ model with these formats needs.

    Example:
        >>> required_opset([DType.UINT8, DType.INT8]), required_opset([DType.INT16])
        (13, 21)
    """
    return max([BASE_QDQ_OPSET, *(_OPSET_FOR_DTYPE.get(d, BASE_QDQ_OPSET) for d in dtypes)])


def encode_activation_dtype(dtype: DType, encoding: ActivationEncoding) -> DType:
    """The stored format of an activation spec's dtype (int8 -> uint8 for x86).

    Example:
        >>> encode_activation_dtype(DType.INT8, "x86_uint8").value
        'uint8'
    """
    return DType.UINT8 if encoding == "x86_uint8" and dtype is DType.INT8 else dtype


def encode_activation(qp: QParams, encoding: ActivationEncoding) -> QParams:
    """``qp`` in the stored encoding: int8 -> uint8 with ``zero_point + 128`` for x86.

    Example:
        >>> qp = encode_activation(QParams.per_tensor(0.5, 0, "int8"), "x86_uint8")
        >>> qp.dtype.value, int(qp.zero_point)
        ('uint8', 128)
    """
    if encode_activation_dtype(qp.dtype, encoding) is qp.dtype:
        return qp
    return attrs.evolve(qp, zero_point=qp.zero_point + 128, dtype=DType.UINT8)


def bound_is_absorbed(qp: QParams, bound: float, code: int) -> bool:
    """True when ``bound`` (infinite: nothing to apply) quantizes to ``code`` (qmin for a
    lower bound, qmax for an upper one): saturation then applies the bound exactly.

    Example:
        >>> bound_is_absorbed(QParams.per_tensor(0.1, 0, "uint8"), 0.0, 0)
        True
    """
    return not np.isfinite(bound) or int(quantize(np.array(bound, np.float32), qp)) == code


def activation_is_absorbed(qp: QParams, bounds: tuple[float, float]) -> bool:
    """True when quantizing with ``qp`` already applies ``clip(x, lo, hi)``: every value
    below ``lo`` maps to the code of ``lo`` (= qmin) and every value above ``hi`` to the
    code of ``hi`` (= qmax).

    Example:
        >>> activation_is_absorbed(QParams.per_tensor(0.1, 0, "uint8"), (0.0, float("inf")))
        True
        >>> activation_is_absorbed(QParams.per_tensor(0.1, 128, "uint8"), (0.0, float("inf")))
        False
    """
    lo, hi = bounds
    return bound_is_absorbed(qp, lo, qp.qmin) and bound_is_absorbed(qp, hi, qp.qmax)


MATMUL_WEIGHT_AXIS = -1
"""The ``axis`` a guarded MatMul weight's DequantizeLinear is written with (the last axis of
its 2-D ``[K, N]`` weight, per tensor as one-element scale and zero point): onnxruntime's
DequantizeLinear -> MatMul to ``MatMulNBits`` rewrite (level EXTENDED, every default session)
matches only a scalar scale or ``axis`` 1 written or by default."""


def guard_matmul_weight(activation: DType | None, weight: DType) -> bool:
    """Whether a MatMul (or ``Gemm`` without transposes) reading a 2-D quantized weight must
    be kept from onnxruntime's ``MatMulNBits`` rewrite: every format but 8-bit activations
    with 8-bit weights, which an integer kernel takes first. ``MatMulNBits`` quantizes its
    input to int8 blocks on the fly, so a 16-bit or float input would compute far from the
    file (hundreds of output steps at a16w8).

    Example:
        >>> guard_matmul_weight(DType.UINT16, DType.INT8), guard_matmul_weight(DType.UINT8, DType.INT8)
        (True, False)
    """
    return not (activation is not None and activation.bits == 8 and weight.bits == 8)
