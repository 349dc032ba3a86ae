"""Torch fake quantization with exactly the arithmetic of ``quant_core.qparams``.

Example:
    >>> import torch
    >>> from quant_core.qparams import QParams
    >>> qp = QParams.per_tensor(0.5, 0, "int8")
    >>> fake_quantize(torch.tensor([0.26, 0.74, 100.0]), qp).tolist()
    [0.5, 0.5, 63.5]
"""

from __future__ import annotations

import torch

from quant_core.qparams import QParams
from quant_core.spec import RoundMode


def qparams_to_tensors(qp: QParams, ndim: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Scale (float32) and zero point (float32) shaped to broadcast against a rank-``ndim`` tensor."""
    shape = qp.broadcast_shape(ndim)
    scale = torch.as_tensor(qp.scale, dtype=torch.float32, device=device).reshape(shape)
    zero_point = torch.as_tensor(qp.zero_point, dtype=torch.float32, device=device).reshape(shape)
    return scale, zero_point


def _round(x: torch.Tensor, mode: RoundMode) -> torch.Tensor:
    if mode is RoundMode.HALF_EVEN:
        return torch.round(x)
    if mode is RoundMode.HALF_UP:
        return torch.floor(x + 0.5)
    if mode is RoundMode.HALF_AWAY:
        return torch.sign(x) * torch.floor(torch.abs(x) + 0.5)
    if mode is RoundMode.FLOOR:
        return torch.floor(x)
    if mode is RoundMode.CEIL:
        return torch.ceil(x)
    return torch.trunc(x)


def fake_quantize(x: torch.Tensor, qp: QParams, rounding: RoundMode | str = RoundMode.HALF_EVEN) -> torch.Tensor:
    """``dequantize(quantize(x))`` in float32 on ``x``'s device, matching
    ``quant_core.qparams.fake_quantize`` bit for bit."""
    mode = rounding if isinstance(rounding, RoundMode) else RoundMode(rounding)
    scale, zero_point = qparams_to_tensors(qp, x.dim(), x.device)
    xf = x.to(torch.float32)
    q = torch.clamp(_round(xf / scale, mode) + zero_point, qp.qmin, qp.qmax)
    return (q - zero_point) * scale
