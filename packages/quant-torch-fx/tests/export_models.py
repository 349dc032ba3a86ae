"""Small models in the shape of the model families the exporter must write faithfully:
ResNet (residual adds), MobileNetV2 (inverted residuals: ReLU6, depthwise convolutions),
MobileNetV3 (hardswish, squeeze-excite with hardsigmoid), MixNet (channels split over
depthwise kernels of several sizes, concatenated, a batch norm after the concatenation,
swish, squeeze-excite with sigmoid), PoolFormer (GroupNorm, average pooling without the
padding minus its input, layer scales, a channels-first LayerNorm in the head), ViT
(LayerNorm, multi-head attention through scaled_dot_product_attention, GELU, linear over
tokens) and Swin (shifted windows: roll, window partition reshapes, a relative position
bias gathered from a table, an attention mask)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from models import randomize_batch_norms
from torch import nn


class _Basic(nn.Module):
    def __init__(self, channels: int, stride: int = 1) -> None:
        super().__init__()
        out = channels * stride
        self.conv1 = nn.Conv2d(channels, out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out)
        self.conv2 = nn.Conv2d(out, out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.down = (
            nn.Sequential(nn.Conv2d(channels, out, 1, stride, bias=False), nn.BatchNorm2d(out)) if stride > 1 else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNetLike(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
        )
        self.layer1 = _Basic(8)
        self.layer2 = _Basic(8, 2)
        self.fc = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(y, 1), 1))


class _SqueezeExcite(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.reduce = nn.Conv2d(channels, channels // 4, 1)
        self.expand = nn.Conv2d(channels // 4, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = F.adaptive_avg_pool2d(x, 1)
        return x * F.hardsigmoid(self.expand(F.relu(self.reduce(s))))


class MobileNetV3Like(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.Hardswish())
        self.dw = nn.Sequential(nn.Conv2d(8, 8, 3, 1, 1, groups=8, bias=False), nn.BatchNorm2d(8), nn.Hardswish())
        self.se = _SqueezeExcite(8)
        self.project = nn.Sequential(nn.Conv2d(8, 16, 1, bias=False), nn.BatchNorm2d(16))
        self.head = nn.Sequential(nn.Linear(16, 32), nn.Hardswish(), nn.Dropout(0.2), nn.Linear(32, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.project(self.se(self.dw(self.stem(x))))
        return self.head(F.adaptive_avg_pool2d(y, 1).flatten(1))


class _InvertedResidual(nn.Module):
    def __init__(self, channels: int, expand: int = 4) -> None:
        super().__init__()
        hidden = channels * expand
        self.expand = nn.Sequential(nn.Conv2d(channels, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6())
        self.dw = nn.Sequential(
            nn.Conv2d(hidden, hidden, 3, 1, 1, groups=hidden, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6()
        )
        self.project = nn.Sequential(nn.Conv2d(hidden, channels, 1, bias=False), nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.project(self.dw(self.expand(x)))


class MobileNetV2Like(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU6())
        self.blocks = nn.Sequential(_InvertedResidual(8), _InvertedResidual(8))
        self.head = nn.Sequential(nn.Conv2d(8, 32, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU6())
        self.fc = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.adaptive_avg_pool2d(self.head(self.blocks(self.stem(x))), 1).flatten(1))


class _MixedDepthwise(nn.Module):
    """timm's MixedConv2d: the channels split over depthwise kernels of 3, 5 and 7."""

    def __init__(self, splits: tuple[int, ...]) -> None:
        super().__init__()
        self.splits = list(splits)
        self.convs = nn.ModuleList(
            nn.Conv2d(c, c, 2 * i + 3, 1, i + 1, groups=c, bias=False) for i, c in enumerate(splits)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = torch.split(x, self.splits, 1)
        return torch.cat([conv(part) for conv, part in zip(self.convs, parts, strict=True)], 1)


class MixNetLike(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 12, 3, 2, 1, bias=False), nn.BatchNorm2d(12), nn.SiLU())
        self.mixed = _MixedDepthwise((4, 4, 4))
        self.bn = nn.BatchNorm2d(12)
        self.reduce = nn.Conv2d(12, 4, 1)
        self.expand = nn.Conv2d(4, 12, 1)
        self.project = nn.Sequential(nn.Conv2d(12, 16, 1, bias=False), nn.BatchNorm2d(16))
        self.fc = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.silu(self.bn(self.mixed(self.stem(x))))
        y = y * torch.sigmoid(self.expand(F.silu(self.reduce(y.mean((2, 3), keepdim=True)))))
        return self.fc(F.adaptive_avg_pool2d(self.project(y), 1).flatten(1))


class _PoolFormerBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(1, dim)
        self.pool = nn.AvgPool2d(3, 1, 1, count_include_pad=False)
        self.scale1 = nn.Parameter(torch.linspace(0.2, 1.0, dim).reshape(dim, 1, 1))
        self.norm2 = nn.GroupNorm(1, dim)
        self.mlp = nn.Sequential(nn.Conv2d(dim, 2 * dim, 1), nn.GELU(), nn.Conv2d(2 * dim, dim, 1))
        self.scale2 = nn.Parameter(torch.linspace(1.0, 0.2, dim).reshape(dim, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm1(x)
        x = x + self.scale1 * (self.pool(y) - y)
        return x + self.scale2 * self.mlp(self.norm2(x))


class PoolFormerLike(nn.Module):
    def __init__(self, classes: int = 10, dim: int = 16) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, dim, 7, 4, 2)
        self.blocks = nn.Sequential(_PoolFormerBlock(dim), _PoolFormerBlock(dim))
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1)
        y = self.norm(y.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)  # timm's LayerNorm2d
        return self.fc(y.flatten(1))


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.proj(y.transpose(1, 2).reshape(b, n, c))


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = _Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.fc1 = nn.Linear(dim, dim * 2)
        self.fc2 = nn.Linear(dim * 2, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class ViTLike(nn.Module):
    def __init__(self, classes: int = 10, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 4, 4)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.1)
        self.pos_embed = nn.Parameter(torch.randn(1, 17, dim) * 0.1)
        self.blocks = nn.Sequential(_Block(dim, heads), _Block(dim, heads))
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


class _WindowBlock(nn.Module):
    """A Swin block: cyclic shift, window partition, windowed attention with a relative
    position bias (and, shifted, a mask), window reverse, shift back, MLP."""

    def __init__(self, dim: int, heads: int, window: int, shift: int, size: int) -> None:
        super().__init__()
        self.window, self.shift, self.heads = window, shift, heads
        self.norm1 = nn.LayerNorm(dim)
        self.attn = _Attention(dim, heads)
        self.table = nn.Parameter(torch.randn((2 * window - 1) ** 2, heads) * 0.1)
        coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
        relative = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)
        self.register_buffer("index", relative[..., 0] * (2 * window - 1) + relative[..., 1], persistent=False)
        mask = torch.zeros(size, size)
        if shift:
            regions = torch.zeros(size, size)
            for i, hs in enumerate((slice(0, -window), slice(-window, -shift), slice(-shift, None))):
                for j, ws in enumerate((slice(0, -window), slice(-window, -shift), slice(-shift, None))):
                    regions[hs, ws] = i * 3 + j
            windows = self._partition(regions[None, :, :, None]).squeeze(-1)
            mask = (windows[:, None, :] != windows[:, :, None]).float() * -100.0
        count = (size // window) ** 2
        self.register_buffer(
            "mask", mask if shift else torch.zeros(count, window * window, window * window), persistent=False
        )
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim * 2), nn.GELU(), nn.Linear(dim * 2, dim))

    def _partition(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        s = self.window
        return x.view(b, h // s, s, w // s, s, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, s * s, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        y = self.norm1(x)
        if self.shift:
            y = torch.roll(y, shifts=(-self.shift, -self.shift), dims=(1, 2))
        windows = self._partition(y)
        count = windows.shape[0] // b
        bias = self.table[self.index.view(-1)].view(self.window**2, self.window**2, -1).permute(2, 0, 1)
        bias = bias.unsqueeze(0) + self.mask.unsqueeze(1).repeat(b, 1, 1, 1).view(b * count, 1, *self.mask.shape[-2:])
        attended = self.attn(windows, bias)
        s = self.window
        y = attended.view(b, h // s, w // s, s, s, c).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)
        if self.shift:
            y = torch.roll(y, shifts=(self.shift, self.shift), dims=(1, 2))
        x = x + y
        return x + self.mlp(self.norm2(x))


class SwinLike(nn.Module):
    def __init__(self, classes: int = 10, dim: int = 16) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 4, 4)
        self.norm0 = nn.LayerNorm(dim)
        self.blocks = nn.Sequential(_WindowBlock(dim, 2, 2, 0, 4), _WindowBlock(dim, 2, 2, 1, 4))
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm0(self.patch(x).permute(0, 2, 3, 1))
        return self.head(self.blocks(x).mean((1, 2)))


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    families = {
        "resnet": ResNetLike,
        "mobilenetv2": MobileNetV2Like,
        "mobilenetv3": MobileNetV3Like,
        "mixnet": MixNetLike,
        "poolformer": PoolFormerLike,
        "vit": ViTLike,
        "swin": SwinLike,
    }
    model = families[name]()
    return randomize_batch_norms(model, seed).eval()


def images(batches: int, batch: int = 8, seed: int = 1) -> list[torch.Tensor]:
    """Smooth images (random low-resolution patterns upsampled), closer to photos than noise."""
    generator = torch.Generator().manual_seed(seed)
    coarse = [torch.randn(batch, 3, 4, 4, generator=generator) for _ in range(batches)]
    return [F.interpolate(c, size=(16, 16), mode="bilinear", align_corners=False) for c in coarse]
