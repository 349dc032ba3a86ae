"""Building blocks shared by the trained task models (plain torch, no repo packages).

* :class:`ConvBNAct` -- Conv2d + BatchNorm2d (unfused) + an activation.
* :class:`SqueezeExcite` -- MobileNetV3's ``x * hardsigmoid(fc2(relu(fc1(pool(x)))))``.
* :class:`Bneck` -- MobileNetV3's inverted residual with optional squeeze-excite.
* :class:`SelfAttention`, :class:`TransformerBlock` -- pre-norm encoder block with the attention
  written out (q/k/v Linear, Q·K^T, scale, Softmax, attn·V) so that both backends see the MatMuls.
* :class:`DecomposedLayerNorm` -- LayerNorm as older exporters wrote it (ReduceMean, Sub, Pow,
  ReduceMean, Add, Sqrt, Div, Mul, Add); ``norm="decomposed"`` and ``gelu="tanh"`` build a model
  with the same ``state_dict`` as the fused forms, so one set of trained weights serves both.

Example:
    >>> import torch
    >>> block = TransformerBlock(32, heads=4, mlp_ratio=2)
    >>> block(torch.zeros(2, 5, 32)).shape
    torch.Size([2, 5, 32])
"""

from __future__ import annotations

import torch
from torch import nn

NORMS = ("layernorm", "decomposed")
GELUS = ("erf", "tanh")
ACTIVATIONS = {"relu": nn.ReLU, "hardswish": nn.Hardswish, "silu": nn.SiLU, "gelu": nn.GELU}


class DecomposedLayerNorm(nn.Module):
    """LayerNorm over the last axis, computed op by op as opset < 17 exports wrote it.

    Same parameters (``weight``, ``bias``) as :class:`torch.nn.LayerNorm`.

    Example:
        >>> x = torch.randn(2, 3, 8)
        >>> ref = nn.LayerNorm(8)
        >>> torch.allclose(DecomposedLayerNorm(8)(x), ref(x), atol=1e-5)
        True
    """

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        centred = x - x.mean(-1, keepdim=True)
        variance = centred.pow(2).mean(-1, keepdim=True)
        return centred / torch.sqrt(variance + self.eps) * self.weight + self.bias


def make_norm(dim: int, norm: str) -> nn.Module:
    if norm not in NORMS:
        raise ValueError(f"norm: {norm!r} is not known; allowed: {', '.join(NORMS)}")
    return nn.LayerNorm(dim) if norm == "layernorm" else DecomposedLayerNorm(dim)


def make_gelu(gelu: str) -> nn.Module:
    if gelu not in GELUS:
        raise ValueError(f"gelu: {gelu!r} is not known; allowed: {', '.join(GELUS)}")
    return nn.GELU() if gelu == "erf" else nn.GELU(approximate="tanh")


class ConvBNAct(nn.Sequential):
    """Conv2d (no bias) + BatchNorm2d + activation (``None`` for a linear projection)."""

    def __init__(self, in_ch: int, out_ch: int, kernel=3, stride=1, groups: int = 1, act: str | None = "relu"):
        kernel_hw = (kernel, kernel) if isinstance(kernel, int) else tuple(kernel)
        padding = tuple((k - 1) // 2 for k in kernel_hw)
        layers: list[nn.Module] = [
            nn.Conv2d(in_ch, out_ch, kernel_hw, stride, padding, groups=groups, bias=False),
            nn.BatchNorm2d(out_ch),
        ]
        if act is not None:
            layers.append(ACTIVATIONS[act]())
        super().__init__(*layers)


class SqueezeExcite(nn.Module):
    """MobileNetV3 squeeze-excite: channel gates from a hard sigmoid (ONNX ``HardSigmoid``)."""

    def __init__(self, channels: int, reduction: int = 4):
        super().__init__()
        hidden = max(8, channels // reduction)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, hidden, 1)
        self.relu = nn.ReLU()
        self.fc2 = nn.Conv2d(hidden, channels, 1)
        self.gate = nn.Hardsigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gate(self.fc2(self.relu(self.fc1(self.pool(x)))))


class Bneck(nn.Module):
    """MobileNetV3 inverted residual: 1x1 expand, depthwise kxk, optional SE, 1x1 project."""

    def __init__(self, in_ch: int, hidden: int, out_ch: int, kernel: int, stride: int, se: bool, act: str):
        super().__init__()
        self.use_res = stride == 1 and in_ch == out_ch
        layers: list[nn.Module] = []
        if hidden != in_ch:
            layers.append(ConvBNAct(in_ch, hidden, 1, act=act))
        layers.append(ConvBNAct(hidden, hidden, kernel, stride, groups=hidden, act=act))
        if se:
            layers.append(SqueezeExcite(hidden))
        layers.append(ConvBNAct(hidden, out_ch, 1, act=None))
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x) if self.use_res else self.block(x)


class SelfAttention(nn.Module):
    """Multi-head self-attention with explicit q/k/v projections and MatMuls (no fused SDPA)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        if dim % heads:
            raise ValueError(f"heads: {heads} does not divide the width {dim}")
        self.heads, self.head_dim = heads, dim // heads
        self.scale = self.head_dim**-0.5
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)

    def _split(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, C) -> (B, heads, N, head_dim)
        return x.reshape(x.shape[0], x.shape[1], self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._split(self.q(x)), self._split(self.k(x)), self._split(self.v(x))
        attn = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * self.scale, dim=-1)
        out = torch.matmul(attn, v).transpose(1, 2)
        return self.proj(out.reshape(x.shape[0], x.shape[1], -1))


class TransformerBlock(nn.Module):
    """Pre-norm encoder block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))`` with a GELU MLP."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 2, norm: str = "layernorm", gelu: str = "erf"):
        super().__init__()
        self.norm1 = make_norm(dim, norm)
        self.attn = SelfAttention(dim, heads)
        self.norm2 = make_norm(dim, norm)
        self.fc1 = nn.Linear(dim, dim * mlp_ratio)
        self.act = make_gelu(gelu)
        self.fc2 = nn.Linear(dim * mlp_ratio, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


def init_transformer(module: nn.Module) -> None:
    """ViT-style init: truncated-normal Linear weights (std 0.02), zero biases, unit norms."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm | DecomposedLayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
