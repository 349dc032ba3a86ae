"""Differentiable fake quantization for QAT, with the forward values of
:func:`quant_torch_fx.fake_quantize.fake_quantize` (bit for bit on finite inputs).

- :func:`ste_fake_quantize`: fixed qparams, straight-through estimator (gradient 1 where
  the value lies inside the quantization range, 0 where it saturates).
- :func:`lsq_fake_quantize`: a learnable float scale with LSQ's gradient
  (Esser et al., 2020): ``d out / d s`` is ``round(x/s) - x/s`` inside the range and the
  clipped code outside, scaled by ``1 / sqrt(numel * Qp)``.
- :func:`tqt_fake_quantize`: a learnable log2 threshold (Jain et al., "Trained
  Quantization Thresholds", 2020): ``scale = 2**ceil(log2_t) / 2**(bits - 1)``, a power
  of two at every step; the ceiling passes gradients straight through.

Rounding follows the spec's mode in every case (the values equal the exact function's);
only the gradient is a straight-through one.

Example:
    >>> import torch
    >>> from quant_core.spec import RoundMode
    >>> x = torch.tensor([0.3, 0.74, 9.0], requires_grad=True)
    >>> s = torch.tensor(0.5, requires_grad=True)
    >>> y = lsq_fake_quantize(x, s, torch.tensor(0.0), -8, 7, RoundMode.HALF_EVEN, grad_scale=1.0)
    >>> y.tolist()
    [0.5, 0.5, 3.5]
    >>> y.sum().backward()
    >>> x.grad.tolist(), round(float(s.grad), 4)
    ([1.0, 1.0, 0.0], 6.92)
"""

from __future__ import annotations

from typing import Any

import torch

from quant_core.spec import RoundMode
from quant_torch_fx.fake_quantize import fake_quantize_tensors, round_tensor

_TINY_SCALE = float(torch.finfo(torch.float32).tiny) * 2.0**24


class _SteFakeQuantize(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        scale: torch.Tensor,
        zero_point: torch.Tensor,
        qmin: int,
        qmax: int,
        rounding: RoundMode,
    ) -> torch.Tensor:
        rounded = round_tensor(x.to(torch.float32) / scale, rounding).to(zero_point.dtype) + zero_point
        inside = (rounded >= qmin) & (rounded <= qmax)
        ctx.save_for_backward(inside)
        q = torch.clamp(torch.where(torch.isnan(rounded), torch.full_like(rounded, float(qmin)), rounded), qmin, qmax)
        return (q - zero_point).to(torch.float32) * scale

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        (inside,) = ctx.saved_tensors
        return grads[0] * inside, None, None, None, None, None


def ste_fake_quantize(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int, rounding: RoundMode
) -> torch.Tensor:
    """Fake quantization with fixed (broadcastable) qparams and a straight-through gradient.

    Example:
        >>> x = torch.tensor([0.26, 100.0], requires_grad=True)
        >>> y = ste_fake_quantize(x, torch.tensor(0.5), torch.tensor(0.0), -128, 127, RoundMode.HALF_EVEN)
        >>> y.sum().backward(); y.tolist(), x.grad.tolist()
        ([0.5, 63.5], [1.0, 0.0])
    """
    if not (torch.is_grad_enabled() and x.requires_grad):
        return fake_quantize_tensors(x, scale, zero_point, qmin, qmax, rounding)
    out: torch.Tensor = _SteFakeQuantize.apply(x, scale, zero_point, qmin, qmax, rounding)
    return out


def _round_ste(v: torch.Tensor, rounding: RoundMode) -> torch.Tensor:
    # ``round(v) - v`` is exact in float32 (the two are within a factor of two, or round(v)
    # is 0), so ``v + (round(v) - v)`` is round(v) itself: the forward values stay exact.
    return v + (round_tensor(v, rounding) - v).detach()


def _scaled_gradient(value: torch.Tensor, factor: float) -> torch.Tensor:
    """``value`` in the forward pass, gradient times ``factor`` in the backward pass."""
    scaled = value * factor
    return (value - scaled).detach() + scaled


def learnable_fake_quantize(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int, rounding: RoundMode
) -> torch.Tensor:
    """Fake quantization whose scale takes gradients (LSQ's estimator): the scale must
    already broadcast against ``x`` and be positive."""
    v = _round_ste(x / scale, rounding)
    q = torch.clamp(v + zero_point, qmin, qmax)
    return (q - zero_point) * scale


def lsq_fake_quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    qmin: int,
    qmax: int,
    rounding: RoundMode,
    *,
    grad_scale: float,
) -> torch.Tensor:
    """LSQ: ``scale`` (broadcastable, learnable) with its gradient multiplied by
    ``grad_scale`` (LSQ uses ``1 / sqrt(numel_per_scale * Qp)``)."""
    positive = _scaled_gradient(scale.clamp_min(_TINY_SCALE), grad_scale)
    return learnable_fake_quantize(x, positive, zero_point.to(torch.float32), qmin, qmax, rounding)


def tqt_scale(log2_threshold: torch.Tensor, bits: int) -> torch.Tensor:
    """``2**ceil(log2_t) / 2**(bits - 1)`` with a straight-through ceiling.

    Example:
        >>> tqt_scale(torch.tensor(2.3), 8).item()
        0.0625
    """
    ceiled = log2_threshold + (torch.ceil(log2_threshold) - log2_threshold).detach()
    return torch.exp2(ceiled - (bits - 1))


def tqt_fake_quantize(
    x: torch.Tensor,
    log2_threshold: torch.Tensor,
    zero_point: torch.Tensor,
    qmin: int,
    qmax: int,
    rounding: RoundMode,
    *,
    bits: int,
) -> torch.Tensor:
    """TQT: power-of-two scale from a learnable log2 threshold (broadcastable)."""
    return learnable_fake_quantize(
        x, tqt_scale(log2_threshold, bits), zero_point.to(torch.float32), qmin, qmax, rounding
    )
