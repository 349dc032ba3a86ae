"""The two custom ops a model calls in its export form (``torch.library``), one per QDQ
construct the ONNX file holds, so that ``torch.export`` records each as one node:

- ``quant_torch_fx::quantize_dequantize(x, scale, zero_point, qmin, qmax, rounding, dtype)``:
  an activation's ``QuantizeLinear -> DequantizeLinear`` (per tensor), computing exactly the
  frozen model's fake quantization;
- ``quant_torch_fx::dequantize(codes, scale, zero_point, axis, dtype)``: integer codes (a
  weight or a bias) behind a ``DequantizeLinear``, per tensor (``axis=None``) or per channel.

``dtype`` is the stored format's name (``quant_core.dtypes.DType`` value: ``"uint8"``,
``"uint16"``, ``"int4"``...): torch holds codes and zero points in the nearest wider type
(int8 for int4, int32 for uint16), the ONNX file in this one. Both ops have fake kernels
(shapes only), so ``torch.export`` traces them with the batch dimension symbolic.

Example:
    >>> import torch
    >>> scale, zero_point = torch.tensor(0.5), torch.tensor(128, dtype=torch.int32)
    >>> quantize_dequantize(torch.tensor([0.26, -100.0]), scale, zero_point, 0, 255, "half_even", "uint8").tolist()
    [0.5, -64.0]
    >>> dequantize(torch.tensor([[4, -8]], dtype=torch.int8), torch.tensor([0.25]), torch.zeros(1, dtype=torch.int32), 0, "int8").tolist()
    [[1.0, -2.0]]
"""

from __future__ import annotations

import torch

from quant_core.spec import RoundMode
from quant_torch_fx.fake_quantize import fake_quantize_tensors

NAMESPACE = "quant_torch_fx"


@torch.library.custom_op(f"{NAMESPACE}::quantize_dequantize", mutates_args=())
def quantize_dequantize(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int, rounding: str, dtype: str
) -> torch.Tensor:
    """``x`` fake-quantized per tensor, bit-exact with the frozen model's quantizer."""
    codes_type = torch.float64 if qmax - qmin >= 2**16 else torch.float32
    return fake_quantize_tensors(x, scale, zero_point.to(codes_type), qmin, qmax, RoundMode(rounding))


@quantize_dequantize.register_fake
def _quantize_dequantize_fake(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int, rounding: str, dtype: str
) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op(f"{NAMESPACE}::dequantize", mutates_args=())
def dequantize(
    codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int | None, dtype: str
) -> torch.Tensor:
    """``(codes - zero_point) * scale`` in float32 (the difference exact in float64), with
    scale and zero point along ``axis`` (``None``: per tensor)."""
    shape = [1] * codes.dim()
    if axis is not None and scale.dim() > 0:
        shape[axis] = -1
    centred = codes.to(torch.float64) - zero_point.to(torch.float64).reshape(shape if scale.dim() else ())
    return centred.to(torch.float32) * scale.reshape(shape if scale.dim() else ())


@dequantize.register_fake
def _dequantize_fake(
    codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int | None, dtype: str
) -> torch.Tensor:
    return torch.empty(codes.shape, dtype=torch.float32, device=codes.device)


QUANTIZE_DEQUANTIZE = torch.ops.quant_torch_fx.quantize_dequantize.default
DEQUANTIZE = torch.ops.quant_torch_fx.dequantize.default
