"""Small transformers trained on data this repo has or generates (plain torch).

* :func:`fmnist_deit` -- DeiT-Tiny-style classifier on 32x32 Fashion-MNIST: patch-4 conv
  embedding (64 tokens), class token, learned positional embedding, pre-norm blocks.
* :func:`ocr_ctc` -- text-line recogniser: a conv stem that takes a 32 x W line down to one row of
  W/4 positions, transformer blocks over the positions, a Linear to the characters + CTC blank.

``norm="decomposed"`` / ``gelu="tanh"`` build the same network (same ``state_dict``) with
LayerNorm written op by op and GELU in its tanh form (see :mod:`.layers`).

Example:
    >>> import torch
    >>> fmnist_deit()(torch.zeros(2, 1, 32, 32)).shape
    torch.Size([2, 10])
    >>> ocr_ctc()(torch.zeros(2, 1, 32, 256)).shape
    torch.Size([2, 64, 38])
"""

from __future__ import annotations

import torch
from torch import nn

from .layers import ConvBNAct, TransformerBlock, init_transformer, make_norm

__all__ = ["CtcRecognizer", "DeiT", "fmnist_deit", "ocr_ctc"]


class DeiT(nn.Module):
    """ViT/DeiT classifier: conv patch embedding, class token, learned positions, pre-norm blocks."""

    def __init__(
        self,
        image_size: int = 32,
        patch: int = 4,
        in_ch: int = 1,
        num_classes: int = 10,
        dim: int = 64,
        depth: int = 4,
        heads: int = 4,
        mlp_ratio: int = 2,
        norm: str = "layernorm",
        gelu: str = "erf",
        stem_channels: int | None = None,
    ):
        super().__init__()
        tokens = (image_size // patch) ** 2
        if stem_channels is None:  # ViT's patchify: one conv, kernel = stride = patch
            self.patch_embed: nn.Module = nn.Conv2d(in_ch, dim, patch, patch)
        elif patch == 4:  # two stride-2 3x3 convs ("early convolutions"): converges faster on small data
            self.patch_embed = nn.Sequential(
                ConvBNAct(in_ch, stem_channels, 3, 2, act="relu"), nn.Conv2d(stem_channels, dim, 3, 2, 1)
            )
        else:
            raise ValueError(f"patch: {patch} with a conv stem; allowed: 4")
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, tokens + 1, dim))
        self.blocks = nn.Sequential(*(TransformerBlock(dim, heads, mlp_ratio, norm, gelu) for _ in range(depth)))
        self.norm = make_norm(dim, norm)
        self.head = nn.Linear(dim, num_classes)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        init_transformer(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # (B, tokens, dim)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


def fmnist_deit(norm: str = "layernorm", gelu: str = "erf") -> DeiT:
    """The ``fmnist_deit`` reference model on 32x32 inputs: a two-conv stem to 8x8 = 64 tokens (patch 4),
    width 64, 4 blocks, 4 heads, MLP x2."""
    return DeiT(
        image_size=32,
        patch=4,
        in_ch=1,
        num_classes=10,
        dim=64,
        depth=4,
        heads=4,
        mlp_ratio=2,
        norm=norm,
        gelu=gelu,
        stem_channels=32,
    )


class CtcRecognizer(nn.Module):
    """Conv stem (height 32 -> 1, width / 4), transformer blocks over the width, per-position logits.

    Output ``(B, W/4, num_classes)`` raw logits; class 0 is the CTC blank.
    """

    def __init__(
        self,
        width: int = 256,
        num_classes: int = 38,
        dim: int = 96,
        depth: int = 2,
        heads: int = 4,
        mlp_ratio: int = 2,
        norm: str = "layernorm",
        gelu: str = "erf",
    ):
        super().__init__()
        self.stem = nn.Sequential(
            ConvBNAct(1, 32, 3, 2, act="hardswish"),  # 16 x W/2
            ConvBNAct(32, 64, 3, 2, act="hardswish"),  # 8 x W/4
            ConvBNAct(64, dim, 3, (2, 1), act="hardswish"),  # 4 x W/4
            ConvBNAct(dim, dim, 3, (2, 1), act="hardswish"),  # 2 x W/4
            ConvBNAct(dim, dim, (2, 1), 1, act="hardswish"),  # "same" padding of (2,1) is 0: 1 x W/4
        )
        self.pos_embed = nn.Parameter(torch.zeros(1, width // 4, dim))
        self.blocks = nn.Sequential(*(TransformerBlock(dim, heads, mlp_ratio, norm, gelu) for _ in range(depth)))
        self.norm = make_norm(dim, norm)
        self.head = nn.Linear(dim, num_classes)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        init_transformer(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x).squeeze(2).transpose(1, 2) + self.pos_embed  # (B, W/4, dim)
        return self.head(self.norm(self.blocks(x)))


def ocr_ctc(norm: str = "layernorm", gelu: str = "erf") -> CtcRecognizer:
    """The ``ocr_ctc`` reference model: 32x256 lines, width 96, 2 blocks, 37 characters + blank."""
    return CtcRecognizer(width=256, num_classes=38, dim=96, depth=2, heads=4, mlp_ratio=2, norm=norm, gelu=gelu)
