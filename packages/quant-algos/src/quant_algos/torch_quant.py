"""Torch quantization arithmetic, bit-exact with ``quant_core.qparams``: what AdaRound,
AdaQuant and the torch backend (``quant_torch_fx``) compute with. Imports torch, so only
torch-using code imports this module (``pip install 'quant-algos[torch]'``).

Bit for bit, on every input (ties and their float neighbours, huge values, subnormals,
infinities, NaN) and every rounding mode: divide in float32, round with the qparams'
own mode, add the zero point and saturate where it is exact (float32 up to 16-bit
codes, float64 for 32-bit ones), NaN to the lowest code (as onnxruntime does), then
``(q - zero_point) * scale`` in float32.

Example:
    >>> import torch
    >>> from quant_core.qparams import QParams
    >>> qp = QParams.per_tensor(0.5, 0, "int8")
    >>> fake_quantize(torch.tensor([0.26, 0.74, 100.0]), qp).tolist()
    [0.5, 0.5, 63.5]
    >>> fake_quantize(torch.tensor([0.24999999]), QParams.per_tensor(0.5, 0, "int8", rounding="half_up")).tolist()
    [0.0]
"""

from __future__ import annotations

import torch

from quant_core.qparams import QParams
from quant_core.spec import RoundMode


def code_dtype(qp: QParams) -> torch.dtype:
    """The float type that holds ``qp``'s codes exactly: float32 up to 16 bits, float64 above."""
    return torch.float64 if qp.dtype.bits > 16 else torch.float32


def qparams_to_tensors(qp: QParams, ndim: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Scale (float32) and zero point (:func:`code_dtype`) shaped to broadcast against a
    rank-``ndim`` tensor."""
    shape = qp.broadcast_shape(ndim)
    scale = torch.as_tensor(qp.scale, dtype=torch.float32, device=device).reshape(shape)
    zero_point = torch.as_tensor(qp.zero_point, dtype=code_dtype(qp), device=device).reshape(shape)
    return scale, zero_point


def _half_up(x: torch.Tensor) -> torch.Tensor:
    # ``floor(x + 0.5)`` rounds the sum first (0.49999997 + 0.5 == 1.0 in float32); the
    # fraction ``x - floor(x)`` is exact, so compare it with 0.5 (quant_core's method).
    low = torch.floor(x)
    return low + (x - low >= 0.5).to(x.dtype)


def round_tensor(x: torch.Tensor, mode: RoundMode) -> torch.Tensor:
    """``quant_core.qparams.round_values`` on a tensor (same results, bit for bit)."""
    if mode is RoundMode.HALF_EVEN:
        return torch.round(x)
    if mode is RoundMode.HALF_UP:
        return _half_up(x)
    if mode is RoundMode.HALF_AWAY:
        return torch.copysign(_half_up(torch.abs(x)), x)
    if mode is RoundMode.FLOOR:
        return torch.floor(x)
    if mode is RoundMode.CEIL:
        return torch.ceil(x)
    return torch.trunc(x)


def codes_from_tensors(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int, rounding: RoundMode
) -> torch.Tensor:
    """Integer codes of ``x`` (as floats of ``zero_point``'s dtype) for qparams already
    shaped to broadcast against ``x``: ``quant_core.qparams.quantize``'s arithmetic."""
    rounded = round_tensor(x.to(torch.float32) / scale, rounding)
    q = rounded.to(zero_point.dtype) + zero_point
    q = torch.where(torch.isnan(q), torch.full_like(q, float(qmin)), q)
    return torch.clamp(q, qmin, qmax)


def fake_quantize_tensors(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int, rounding: RoundMode
) -> torch.Tensor:
    """:func:`fake_quantize` for qparams held as broadcastable tensors (no host round trip:
    what fake-quantize modules call every batch)."""
    q = codes_from_tensors(x, scale, zero_point, qmin, qmax, rounding)
    return (q - zero_point).to(torch.float32) * scale


class FakeQuantizer:
    """Fake quantization with one :class:`~quant_core.qparams.QParams`, its scale and zero
    point placed on ``device`` once (what a training loop calls every step).

    Example:
        >>> import torch
        >>> from quant_core.qparams import QParams
        >>> fq = FakeQuantizer(QParams.per_tensor(0.5, 0, "int8", rounding="half_up"), ndim=1)
        >>> fq(torch.tensor([0.25, -0.25, 0.24999999])).tolist()
        [0.5, 0.0, 0.0]
    """

    def __init__(self, qp: QParams, ndim: int, device: torch.device | str = "cpu") -> None:
        self.qp = qp
        self.scale, self.zero_point = qparams_to_tensors(qp, ndim, device)

    def codes(self, x: torch.Tensor) -> torch.Tensor:
        """Integer codes as a float tensor (:func:`code_dtype`), like ``quant_core.qparams.quantize``."""
        return codes_from_tensors(x, self.scale, self.zero_point, self.qp.qmin, self.qp.qmax, self.qp.rounding)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``dequantize(quantize(x))`` in float32, like ``quant_core.qparams.fake_quantize``."""
        return (self.codes(x) - self.zero_point).to(torch.float32) * self.scale


def quantize_codes(x: torch.Tensor, qp: QParams) -> torch.Tensor:
    """Integer codes of ``x`` as a float tensor (float32 for codes of up to 16 bits, where
    it is exact; float64 above), matching ``quant_core.qparams.quantize``."""
    return FakeQuantizer(qp, x.dim(), x.device).codes(x)


def fake_quantize(x: torch.Tensor, qp: QParams) -> torch.Tensor:
    """``dequantize(quantize(x))`` in float32 on ``x``'s device, matching
    ``quant_core.qparams.fake_quantize`` bit for bit (rounding from ``qp``)."""
    return FakeQuantizer(qp, x.dim(), x.device)(x)
