"""Differentiable fake quantization for QAT, with the forward values of
:func:`quant_torch_fx.fake_quantize.fake_quantize` (bit for bit on finite inputs).

- :func:`ste_fake_quantize`: fixed qparams, straight-through estimator (gradient 1 where
  the value lies inside the quantization range, 0 where it saturates).
- :func:`lsq_fake_quantize`: a learnable float scale with LSQ's gradient
  (Esser et al., 2020): ``d out / d s`` is ``round(x/s) - x/s`` inside the range and the
  clipped code outside, scaled by ``1 / sqrt(numel * Qp)``.
- :func:`tqt_fake_quantize`: a learnable log2 threshold (Jain et al., "Trained
  Quantization Thresholds", 2020): ``scale = 2**ceil(log2_t) / 2**(bits - 1)``, a power
  of two at every step; the ceiling passes gradients straight through, so the
  threshold's gradient is the scale's times ``ln 2 * scale``.

All three run one autograd function built from vectorised tensor ops: torch's own fused
fake-quantize kernels round element by element and are about ten times slower on CPU.
Rounding follows the spec's mode (the values equal the exact function's); only the
gradient is a straight-through one.

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

import warnings
from typing import Any

import torch

from quant_core.spec import RoundMode
from quant_torch_fx.fake_quantize import fake_quantize_tensors, round_tensor

_TINY_SCALE = float(torch.finfo(torch.float32).tiny) * 2.0**24


def _reduce_to(grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Sum ``grad`` down to a broadcast operand's ``shape``."""
    if grad.shape == shape:
        return grad
    if len(shape) == 0:
        return grad.sum()
    lead = grad.dim() - len(shape)
    axes = list(range(lead)) + [lead + i for i, n in enumerate(shape) if n == 1]
    return grad.sum(dim=axes, keepdim=True).reshape(shape) if axes else grad.reshape(shape)


class _FakeQuantize(torch.autograd.Function):
    """Fake quantization with the straight-through input gradient and, when the scale
    takes gradients, LSQ's scale gradient (times ``grad_factor``)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        scale: torch.Tensor,
        zero_point: torch.Tensor,
        qmin: int,
        qmax: int,
        rounding: RoundMode,
        power_of_two: bool,
        grad_factor: float,
    ) -> torch.Tensor:
        # x * (1 / s) equals x / s exactly when s is a power of two, and costs less.
        v = x * (1.0 / scale) if power_of_two else x / scale
        # v is not needed again: round, shift and scale in place (fewer fresh allocations,
        # which on large activations are page-faulting memory).
        rounded = v.round_() if rounding is RoundMode.HALF_EVEN else round_tensor(v, rounding)
        centred_zero = ctx.zero_is_zero
        shifted = rounded if centred_zero else rounded.add_(zero_point)
        q = shifted.clamp(qmin, qmax)
        inside = q == shifted
        codes = q if centred_zero else q.sub_(zero_point)  # integer codes relative to the zero point
        out = codes.mul_(scale)
        # LSQ's d out / d scale is round(v) - v inside the range and the clipped code outside,
        # i.e. codes - v * inside = (out - x * inside) / scale: backward forms its sum from
        # the input and the output, which the neighbouring layers keep for their own
        # gradients anyway, so nothing extra stays alive until the backward pass.
        if ctx.needs_input_grad[1]:
            ctx.save_for_backward(inside, x, out, scale)
        else:
            ctx.save_for_backward(inside)
        ctx.grad_factor = grad_factor
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        grad = grads[0]
        saved = ctx.saved_tensors
        # where() reads the bool mask as is (multiplying by it would first convert it to float)
        grad_x = torch.where(saved[0], grad, 0.0)
        grad_scale = None
        if ctx.needs_input_grad[1]:
            _inside, x, out, scale = saved
            if scale.numel() == 1:
                total = torch.dot(grad.reshape(-1), out.reshape(-1)) - torch.dot(grad_x.reshape(-1), x.reshape(-1))
                total = (total / scale.reshape(())).reshape(scale.shape)
            else:
                total = _reduce_to(grad * out - grad_x * x, scale.shape) / scale
            grad_scale = total * ctx.grad_factor
        return grad_x, grad_scale, None, None, None, None, None, None


class _CentredFakeQuantize(_FakeQuantize):
    """:class:`_FakeQuantize` for a zero point known to be 0 (symmetric signed formats): two
    passes fewer."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        scale: torch.Tensor,
        zero_point: torch.Tensor,
        qmin: int,
        qmax: int,
        rounding: RoundMode,
        power_of_two: bool,
        grad_factor: float,
    ) -> torch.Tensor:
        ctx.zero_is_zero = True
        return _FakeQuantize.forward(ctx, x, scale, zero_point, qmin, qmax, rounding, power_of_two, grad_factor)


class _OffsetFakeQuantize(_FakeQuantize):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        scale: torch.Tensor,
        zero_point: torch.Tensor,
        qmin: int,
        qmax: int,
        rounding: RoundMode,
        power_of_two: bool,
        grad_factor: float,
    ) -> torch.Tensor:
        ctx.zero_is_zero = False
        return _FakeQuantize.forward(ctx, x, scale, zero_point, qmin, qmax, rounding, power_of_two, grad_factor)


def _apply(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    qmin: int,
    qmax: int,
    rounding: RoundMode,
    power_of_two: bool,
    grad_factor: float,
    zero_is_zero: bool = False,
) -> torch.Tensor:
    function = _CentredFakeQuantize if zero_is_zero else _OffsetFakeQuantize
    out: torch.Tensor = function.apply(
        x.to(torch.float32), scale, zero_point.to(torch.float32), qmin, qmax, rounding, power_of_two, grad_factor
    )
    return out


def ste_fake_quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    qmin: int,
    qmax: int,
    rounding: RoundMode,
    power_of_two: bool = False,
    zero_is_zero: bool = False,
) -> torch.Tensor:
    """Fake quantization with fixed (broadcastable) qparams and a straight-through gradient
    (``zero_is_zero``: the caller knows every zero point is 0, which saves two passes).

    Example:
        >>> x = torch.tensor([0.26, 100.0], requires_grad=True)
        >>> y = ste_fake_quantize(x, torch.tensor(0.5), torch.tensor(0.0), -128, 127, RoundMode.HALF_EVEN)
        >>> y.sum().backward(); y.tolist(), x.grad.tolist()
        ([0.5, 63.5], [1.0, 0.0])
    """
    if not (torch.is_grad_enabled() and x.requires_grad):
        return fake_quantize_tensors(x, scale, zero_point, qmin, qmax, rounding)
    return _apply(x, scale.detach(), zero_point, qmin, qmax, rounding, power_of_two, 0.0, zero_is_zero)


def lsq_fake_quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    qmin: int,
    qmax: int,
    rounding: RoundMode,
    *,
    grad_scale: float,
    zero_is_zero: bool = False,
) -> torch.Tensor:
    """LSQ: ``scale`` (broadcastable, learnable) with its gradient multiplied by
    ``grad_scale`` (LSQ uses ``1 / sqrt(numel_per_scale * Qp)``)."""
    positive = scale.clamp_min(_TINY_SCALE)
    return _apply(x, positive, zero_point, qmin, qmax, rounding, False, grad_scale, zero_is_zero)


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
    zero_is_zero: bool = False,
) -> torch.Tensor:
    """TQT: power-of-two scale from a learnable log2 threshold (broadcastable)."""
    return _apply(x, tqt_scale(log2_threshold, bits), zero_point, qmin, qmax, rounding, True, 1.0, zero_is_zero)


def _power_of_two_reference(x: torch.Tensor, scale: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """Power-of-two fake quantization with zero point 0 and half-even rounding as plain
    differentiable torch ops: autograd gives the straight-through input gradient (clamp's
    mask) and LSQ's scale gradient. What :func:`compiled_power_of_two` compiles."""
    v = x / scale
    rounded = v + (torch.round(v) - v).detach()
    return torch.clamp(rounded, qmin, qmax) * scale


_COMPILED: dict[str, Any] = {}


def _channels_by_columns(x: torch.Tensor, scale: torch.Tensor, axis: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as a 2-D ``(channels, columns)`` tensor (one channel per-tensor) and the scale as
    ``(channels, 1)``: the one input form the compiled function sees.

    torch's compiler guards on each input's rank, on the rank of a view's base and on
    whether it is a ``Parameter``, and recompiles when a guard fails; past its limit (8) it
    runs the function eagerly, unfused, which made compiled QAT 18-22x the float step on a
    GPU. ``_unsafe_view`` reshapes without recording a base (the gradient flows all the
    same) and returns a plain tensor: safe here, since the exported graphs never write a
    tensor in place after it is fake-quantized. A channel axis other than the first (rare:
    ConvTranspose weights) costs a copy that brings it first."""
    if axis is None:
        channels = 1
    else:
        x = x.movedim(axis, 0)
        channels = x.shape[0]
    shape = (channels, x.numel() // channels)
    return torch.ops.aten._unsafe_view(x.contiguous(), shape), torch.ops.aten._unsafe_view(scale, (channels, 1))


def compiled_power_of_two(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    qmin: int,
    qmax: int,
    rounding: RoundMode,
    axis: int | None = None,
) -> torch.Tensor | None:
    """:func:`_power_of_two_reference` compiled by ``torch.compile`` (one fused loop each way,
    on CPU), or ``None`` where it does not apply exactly or does not pay: scales must be
    powers of two (then ``x / s`` and ``x * (1 / s)`` agree, whatever the compiler emits),
    rounding half-even, the zero point 0; ``scale`` is one value, or one per channel of
    ``axis``. The first call compiles (seconds); inputs of any rank then share a handful of
    compiled graphs.

    Not on a GPU. Measured on an H100 (ResNet-50, batch 64), the QAT step there is bound by
    the host issuing the small fake-quantize ops, not by the device: 177 ms a step eager
    against 79 ms of device time. Compiled, the fused graph's scale-gradient reduction over
    inputs of every size ran slowly (9.7x the float step, eager 3.1x); compiling only the
    element-wise passes cut the device time to 61 ms but not the step (171 ms)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.numel() == 0:
        return None
    if rounding is not RoundMode.HALF_EVEN or bool(zero_point.any()):
        return None
    if _COMPILED.get("failed"):
        return None
    function = _COMPILED.get("pow2")
    if function is None:
        function = _COMPILED["pow2"] = torch.compile(_power_of_two_reference, dynamic=True)
    values, scales = _channels_by_columns(x, scale, axis)
    try:
        out: torch.Tensor = function(values, scales, qmin, qmax)
    except Exception as exc:  # no C++ compiler, unsupported platform...: the eager path
        warnings.warn(f"compile_fake_quant: torch.compile failed ({type(exc).__name__}); using eager", stacklevel=2)
        _COMPILED["failed"] = True
        return None
    if axis is None:
        return out.reshape(x.shape)
    return out.reshape(x.movedim(axis, 0).shape).movedim(0, axis)
