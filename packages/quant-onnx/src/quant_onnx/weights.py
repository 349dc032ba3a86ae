"""Offline quantization of constant tensors: weights, biases and constant operands.

Pure numpy on top of ``quant_core``: the qparams of a weight come from the same
observers as activations (fed once with the whole tensor), so a weight quantized here
dequantizes to exactly ``quant_core.qparams.fake_quantize(w, qparams)``.

Example:
    >>> import numpy as np
    >>> from quant_core.spec import QuantSpec
    >>> w = np.array([[1.0, -2.0], [0.5, 0.25]], np.float32)
    >>> qp = constant_qparams(w, QuantSpec(dtype="int8", per_channel_axis=0))
    >>> quantize_constant(w, qp, QuantSpec(dtype="int8")).tolist()
    [[64, -127], [127, 64]]
    >>> b = quantize_bias(np.array([0.1, -0.1], np.float32), 0.5, qp)
    >>> b.values.dtype, b.qparams.zero_point.tolist()
    (dtype('int32'), [0, 0])
"""

from __future__ import annotations

import attrs
import numpy as np

from quant_core.dtypes import DType
from quant_core.observers import make_observer
from quant_core.qparams import QParams, bias_qparams, quantize
from quant_core.spec import QuantSpec

_INT32 = np.iinfo(np.int32)


def constant_qparams(value: np.ndarray, spec: QuantSpec) -> QParams:
    """Qparams of a constant tensor under ``spec`` (per channel along ``spec.per_channel_axis``)."""
    observer = make_observer(spec)
    observer.update(np.asarray(value, np.float32))
    return observer.qparams()


def quantize_constant(value: np.ndarray, qparams: QParams, spec: QuantSpec) -> np.ndarray:
    """Integer codes of a constant with ``spec``'s rounding."""
    return quantize(np.asarray(value, np.float32), qparams, spec.rounding)


@attrs.frozen(eq=False)
class QuantizedBias:
    """An integer bias and its qparams; ``saturated`` counts values clipped to the dtype's range.

    Example:
        >>> import numpy as np
        >>> from quant_core.qparams import QParams
        >>> QuantizedBias(np.zeros(2, np.int32), QParams.per_tensor(1.0, 0, "int32"), 0).saturated
        0
    """

    values: np.ndarray
    qparams: QParams
    saturated: int


def quantize_bias(bias: np.ndarray, input_scale: float | np.ndarray, weight_qp: QParams) -> QuantizedBias:
    """int32 bias at ``input_scale * weight_scale`` (per channel when the weight is), zero
    point 0: the only form onnxruntime's integer Conv/Gemm kernels read correctly."""
    qp = bias_qparams(input_scale, weight_qp, DType.INT32)
    value = np.asarray(bias, np.float64)
    scale = qp.scale.astype(np.float64)
    if scale.ndim and (value.ndim != 1 or scale.shape[0] != value.shape[0]):
        raise ValueError(f"bias: shape {list(value.shape)} but the weight has {scale.shape[0]} channel scales")
    codes = np.rint(value / scale)
    saturated = int(np.count_nonzero((codes < _INT32.min) | (codes > _INT32.max)))
    return QuantizedBias(np.clip(codes, _INT32.min, _INT32.max).astype(np.int32), qp, saturated)
