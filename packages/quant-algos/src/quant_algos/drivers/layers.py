"""How a quantized layer is described to the drivers, once for every backend.

A backend reads the facts of a layer from its own model (the float weight, the plan's
weight qparams, the bias it holds, whether its input is quantized) and the layer's
attributes in the planner's vocabulary (ONNX conventions: ``strides``, ``pads``,
``dilations``, ``group``, ``auto_pad``: quant-onnx from the ONNX node, quant-torch-fx from
the planner's view of the ATen call); :func:`describe_layer` derives the rest: the 2-D
convolution geometry, the output channel axis and whether a bias may be written.

Example:
    >>> import numpy as np
    >>> from quant_core.qparams import QParams
    >>> qp = QParams.per_tensor(0.1, 0, "int8")
    >>> conv = describe_layer("c", "Conv", {"strides": [2, 2], "pads": [1, 1, 1, 1]}, np.ones((4, 3, 3, 3), np.float32),
    ...                       qp, None, None, input_quantized=True)
    >>> conv.geometry.strides, conv.output_channel_axis, conv.bias_allowed
    ((2, 2), 1, True)
    >>> describe_layer("m", "MatMul", {}, np.ones((4, 3), np.float32), qp, None, None, input_quantized=True).bias_allowed
    False
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from quant_algos.drivers.runner import QuantLayer
from quant_algos.reconstruction_data import ConvGeometry
from quant_core.errors import ModelError
from quant_core.qparams import QParams


class GeometryUnknown(ModelError):
    """A convolution's padding needs an input size that is not known (``auto_pad`` SAME);
    a backend that cannot infer the size leaves the layer alone with a note."""


def _ints(value: object, default: list[int]) -> list[int]:
    return [int(v) for v in value] if isinstance(value, list | tuple) else list(default)


def conv_geometry(
    attributes: Mapping[str, Any], kernel: Sequence[int], input_hw: Sequence[int] | None = None
) -> ConvGeometry:
    """Strides, explicit pads, dilations and groups of a 2-D convolution from its
    ONNX-convention attributes (``auto_pad`` resolved against ``input_hw``).

    Raises:
        GeometryUnknown: ``auto_pad`` SAME and ``input_hw`` is ``None``.
    """
    strides = _ints(attributes.get("strides"), [1, 1])
    dilations = _ints(attributes.get("dilations"), [1, 1])
    pads = _ints(attributes.get("pads"), [0, 0, 0, 0])
    auto_pad = attributes.get("auto_pad", "NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else str(auto_pad)
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        if input_hw is None:
            raise GeometryUnknown("auto_pad needs the input size, which is not known")
        pads = [0, 0, 0, 0]
        for i in range(2):
            out = -(-int(input_hw[i]) // strides[i])
            total = max(0, (out - 1) * strides[i] + dilations[i] * (int(kernel[i]) - 1) + 1 - int(input_hw[i]))
            small, big = total // 2, total - total // 2
            pads[i], pads[i + 2] = (small, big) if auto_pad == "SAME_UPPER" else (big, small)
    elif auto_pad == "VALID":
        pads = [0, 0, 0, 0]
    return ConvGeometry(strides=strides, pads=pads, dilations=dilations, groups=int(attributes.get("group", 1)))


def bias_allowed(op_type: str, *, input_quantized: bool, float_bias: bool) -> bool:
    """Whether a bias may be written for a layer (:func:`describe_layer`): a Conv/Gemm whose
    input is quantized (a MatMul has no bias input), or one whose bias the backend holds as
    a float constant added to the output (``float_bias``: a MatMul then Add).

    Example:
        >>> bias_allowed("MatMul", input_quantized=True, float_bias=False)
        False
    """
    return float_bias or (op_type != "MatMul" and input_quantized)


def describe_layer(
    name: str,
    op_type: str,
    attributes: Mapping[str, Any],
    float_weight: np.ndarray,
    weight_qparams: QParams,
    bias: np.ndarray | None,
    activation: str | None,
    *,
    input_quantized: bool,
    input_hw: Sequence[int] | None = None,
    float_bias: bool = False,
) -> QuantLayer:
    """The drivers' view of one Conv/Gemm/MatMul (``float_weight`` in ``[out, in, ...]``
    layout). A 2-D convolution gets its geometry; the output channels are axis 1 of a
    Conv's NCHW output and the last axis otherwise (a Gemm's ``[N, C]``, a linear layer
    over tokens); a bias may be written for a Conv/Gemm whose input is quantized (a
    MatMul has no bias input), or where the backend holds it as a float constant added to
    the output (``float_bias``: a MatMul then Add), whatever the input.

    Raises:
        GeometryUnknown: as :func:`conv_geometry`.
    """
    geometry = None
    if op_type == "Conv" and float_weight.ndim == 4:
        geometry = conv_geometry(attributes, float_weight.shape[2:], input_hw)
    return QuantLayer(
        name=name,
        op_type=op_type,
        float_weight=float_weight,
        weight_qparams=weight_qparams,
        bias=bias,
        geometry=geometry,
        activation=activation,
        output_channel_axis=1 if op_type == "Conv" else -1,
        bias_allowed=bias_allowed(op_type, input_quantized=input_quantized, float_bias=float_bias),
        bias_added_after=float_bias and bias is not None,
    )
