"""Modules the prepared graph calls where a captured graph would bake in a training flag.

``torch.export`` records batch norm and dropout with their mode fixed at capture time, so
``train()``/``eval()`` on the captured graph changes nothing (a known failure of PT2E
graphs). The prepared graph calls these modules instead, which follow the module's mode:

- :class:`GraphBatchNorm`: batch norm of any rank (batch statistics in training, running
  statistics in eval; ``SyncBatchNorm.convert_sync_batchnorm`` converts it);
- :class:`ConvBn`: a convolution followed by batch norm during QAT, simulating the fold
  (weights fake-quantized as ``w * gamma / sqrt(running_var + eps)``, as the frozen model
  will hold them; the batch norm still normalises with batch statistics in training)
  and folded by :func:`fold_batch_norm` at freeze;
- ``torch.nn.Dropout`` for dropout.

Example:
    >>> import torch
    >>> bn = GraphBatchNorm(3)
    >>> bn.train()(torch.randn(4, 3, 2, 2)).shape, bn.eval()(torch.randn(4, 3)).shape
    (torch.Size([4, 3, 2, 2]), torch.Size([4, 3]))
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from quant_core.errors import DataError
from quant_torch_fx.quantizer import FakeQuantizer


class GraphBatchNorm(nn.modules.batchnorm._BatchNorm):
    """``nn.BatchNorm*d`` for inputs of any rank (the captured op does not say which).

    Example:
        >>> GraphBatchNorm(8, eps=1e-3).eps
        0.001
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise DataError(f"batch norm: expected an input of rank >= 2, got {input.dim()}")


def batch_norm_factors(bn: nn.modules.batchnorm._BatchNorm) -> tuple[np.ndarray, np.ndarray]:
    """``(scale, shift)`` (float64) with ``bn(y) == scale * y + shift`` per channel in
    eval mode: ``scale = gamma / sqrt(var + eps)``, ``shift = beta - mean * scale``, computed
    as the ONNX backend folds BatchNormalization, so both backends get the same weights.

    Example:
        >>> bn = GraphBatchNorm(2).eval()
        >>> [v.tolist() for v in batch_norm_factors(bn)]
        [[0.9999950000374997, 0.9999950000374997], [0.0, 0.0]]
    """
    assert bn.running_mean is not None and bn.running_var is not None
    gamma = np.ones(bn.num_features) if bn.weight is None else bn.weight.detach().double().cpu().numpy()
    beta = np.zeros(bn.num_features) if bn.bias is None else bn.bias.detach().double().cpu().numpy()
    mean = bn.running_mean.detach().double().cpu().numpy()
    var = bn.running_var.detach().double().cpu().numpy()
    scale = gamma / np.sqrt(var + float(bn.eps))
    return scale, beta - mean * scale


def fold_batch_norm(
    weight: torch.Tensor, bias: torch.Tensor | None, bn: nn.modules.batchnorm._BatchNorm
) -> tuple[torch.Tensor, torch.Tensor]:
    """Conv weight ``[Cout, ...]`` and bias with ``bn`` (eval statistics) folded in, in
    float64 then float32 (the ONNX backend's arithmetic).

    Example:
        >>> w, b = fold_batch_norm(torch.ones(2, 1, 1, 1), None, GraphBatchNorm(2).eval())
        >>> w.flatten().tolist(), b.tolist()
        ([0.9999949932098389, 0.9999949932098389], [0.0, 0.0])
    """
    scale, shift = batch_norm_factors(bn)
    w = weight.detach().double().cpu().numpy()
    b = np.zeros(w.shape[0]) if bias is None else bias.detach().double().cpu().numpy()
    new_w = w * scale.reshape((-1,) + (1,) * (w.ndim - 1))
    new_b = b * scale + shift
    device = weight.device
    return (
        torch.from_numpy(new_w.astype(np.float32)).to(device),
        torch.from_numpy(new_b.astype(np.float32)).to(device),
    )


def aten_op_name(op: Any) -> str:
    """``"conv2d.default"`` for ``torch.ops.aten.conv2d.default`` (see :func:`aten_op`).

    Example:
        >>> aten_op_name(torch.ops.aten.conv2d.padding)
        'conv2d.padding'
    """
    return f"{op._schema.name.split('::', 1)[-1]}.{op._overloadname}"


def aten_op(name: str) -> Any:
    """The ATen op overload named ``"packet.overload"``.

    Example:
        >>> aten_op("conv2d.default") is torch.ops.aten.conv2d.default
        True
    """
    packet, overload = name.rsplit(".", 1)
    return getattr(getattr(torch.ops.aten, packet), overload)


class ConvBn(nn.Module):
    """Convolution + batch norm during QAT, with the fold simulated (see the module docstring).

    Args:
        op: the captured convolution op (``aten.conv2d.default``...), called as
            ``op(x, weight, bias, *conv_args)``.
        weight, bias: the convolution's parameters (``bias`` may be ``None``).
        conv_args: the convolution's remaining arguments (stride, padding...).
        bn: the batch norm (its statistics and affine parameters).

    ``weight_quantizer`` (set by the preparer) fake-quantizes the folded weight. In eval
    mode the output is ``conv(x, q(w_fold)) + b_fold``, what the frozen model computes.

    Example:
        >>> import torch
        >>> m = ConvBn(torch.ops.aten.conv2d.default, torch.randn(4, 3, 1, 1), None, (), GraphBatchNorm(4)).eval()
        >>> w, b = m.folded()
        >>> x = torch.randn(2, 3, 5, 5)
        >>> bool(torch.allclose(m(x), torch.nn.functional.conv2d(x, w, b), atol=1e-5))
        True
    """

    def __init__(
        self,
        op: Any,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        conv_args: tuple[Any, ...],
        bn: nn.modules.batchnorm._BatchNorm,
    ) -> None:
        super().__init__()
        # Kept by name: ATen op objects do not pickle (torch.save of the prepared model).
        self.op_name = aten_op_name(op)
        self.weight = nn.Parameter(weight.detach().clone())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())
        # Plain lists: torch.compile cannot pass torch.fx's immutable_list (the graph's own
        # argument type) to an ATen op and breaks the graph at every layer.
        self.conv_args: tuple[Any, ...] = tuple(list(a) if isinstance(a, list | tuple) else a for a in conv_args)
        self.bn = bn
        self.weight_quantizer: FakeQuantizer | None = None

    def batch_norm_factor(self, divisible: bool = True) -> torch.Tensor:
        """What the simulated fold multiplies the weight by, per output channel:
        ``gamma / sqrt(running_var + eps)``. With ``divisible`` (the training branch, which
        divides the convolution by it again) 1 where that is 0: a zero gamma zeroes the
        folded weight, and scaling by 1 there keeps the output finite (the batch norm then
        writes beta, as the folded bias does)."""
        bn = self.bn
        assert bn.running_var is not None
        gamma = bn.weight if bn.weight is not None else torch.ones_like(bn.running_var)
        # A copy of the running variance: the training-mode batch norm below updates it in
        # place, and a compiled backward that kept the buffer itself would find it changed.
        factor = gamma / torch.sqrt(bn.running_var.clone() + bn.eps)
        return torch.where(factor == 0, torch.ones_like(factor), factor) if divisible else factor

    def folded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight and bias the frozen model will hold (eval statistics, float64 fold)."""
        return fold_batch_norm(self.weight, self.bias, self.bn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bn = self.bn
        # Eval: the real factor (zeros kept), so that a zero-gamma channel writes beta, as the
        # frozen model's fold does; nothing divides by it on this branch.
        factor = self.batch_norm_factor(divisible=bn.training)
        shape = (-1,) + (1,) * (self.weight.dim() - 1)
        weight = self.weight * factor.reshape(shape)
        if self.weight_quantizer is not None:
            weight = self.weight_quantizer(weight, False)
        conv = aten_op(self.op_name)
        if not bn.training:
            # Running statistics: the batch norm is the fold's affine map, so the output is
            # conv(x, q(w_fold)) + b_fold exactly as the frozen model computes it.
            assert bn.running_mean is not None
            bias = torch.zeros_like(factor) if self.bias is None else self.bias
            beta = torch.zeros_like(factor) if bn.bias is None else bn.bias
            return conv(x, weight, (bias - bn.running_mean) * factor + beta, *self.conv_args)
        y = conv(x, weight, None, *self.conv_args)
        out_shape = (1, -1) + (1,) * (y.dim() - 2)
        y = y * (1.0 / factor).reshape(out_shape)
        if self.bias is not None:
            y = y + self.bias.reshape(out_shape)
        return bn(y)
