"""Small conv nets for the trained task models (plain torch, BatchNorm unfused).

* :func:`fmnist_hardswish_se` -- MobileNetV3-style Fashion-MNIST classifier (hard-swish,
  squeeze-excite with a hard sigmoid).
* :func:`fmnist_yolo` -- YOLO-style anchor-free detector: Conv-BN-SiLU, C2f blocks, SPPF, an
  upsample + concat neck and a decoupled head; its output ``(B, 4 + classes, cells)`` holds the
  decoded xyxy boxes in pixels and the sigmoid class scores, as YOLOv8 exports do.
* :func:`text_seg` -- DB-net-like text-region segmenter: MobileNetV3-style backbone, FPN decoder
  upsampling with ``F.interpolate`` (ONNX Resize) and ``ConvTranspose2d``, sigmoid probability map.

Example:
    >>> import torch
    >>> fmnist_hardswish_se()(torch.zeros(2, 1, 32, 32)).shape
    torch.Size([2, 10])
    >>> fmnist_yolo()(torch.zeros(2, 1, 96, 96)).shape
    torch.Size([2, 14, 144])
    >>> text_seg()(torch.zeros(2, 3, 128, 128)).shape
    torch.Size([2, 1, 128, 128])
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .layers import Bneck, ConvBNAct

__all__ = ["SPPF", "C2f", "TextSeg", "YoloDetector", "fmnist_hardswish_se", "fmnist_yolo", "text_seg"]


def _init_convs(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, nn.Conv2d | nn.ConvTranspose2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


# ---------------------------------------------------------------- hard-swish + SE classifier
# (input, hidden, output, kernel, stride, se, activation) -- MobileNetV3-Small's pattern for 32x32.
HARDSWISH_SE_SETTING = (
    (16, 16, 16, 3, 1, True, "relu"),
    (16, 64, 24, 3, 2, False, "relu"),
    (24, 72, 24, 3, 1, False, "relu"),
    (24, 96, 40, 5, 2, True, "hardswish"),
    (40, 120, 40, 5, 1, True, "hardswish"),
    (40, 144, 48, 5, 1, True, "hardswish"),
)


class HardSwishSENet(nn.Module):
    """MobileNetV3-Small-style classifier: stem, Bneck blocks, 1x1 conv, pool, hard-swish MLP head."""

    def __init__(self, in_ch: int = 1, num_classes: int = 10, setting=HARDSWISH_SE_SETTING, last: int = 192):
        super().__init__()
        blocks = [ConvBNAct(in_ch, setting[0][0], 3, 2, act="hardswish")]
        blocks += [Bneck(*row) for row in setting]
        blocks.append(ConvBNAct(setting[-1][2], last, 1, act="hardswish"))
        self.features = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Linear(last, 256), nn.Hardswish(), nn.Linear(256, num_classes))
        _init_convs(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


def fmnist_hardswish_se() -> HardSwishSENet:
    """The ``fmnist_hardswish_se`` reference model (32x32 Fashion-MNIST, 1 channel, 10 classes)."""
    return HardSwishSENet(in_ch=1, num_classes=10)


# ------------------------------------------------------------------------------ detector
class Bottleneck(nn.Module):
    def __init__(self, ch: int):
        super().__init__()
        self.cv1 = ConvBNAct(ch, ch, 3, act="silu")
        self.cv2 = ConvBNAct(ch, ch, 3, act="silu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.cv2(self.cv1(x))


class C2f(nn.Module):
    """YOLOv8's C2f: 1x1 conv, split in two, a chain of bottlenecks on one half, concat all, 1x1 conv."""

    def __init__(self, in_ch: int, out_ch: int, n: int = 1):
        super().__init__()
        self.hidden = out_ch // 2
        self.cv1 = ConvBNAct(in_ch, 2 * self.hidden, 1, act="silu")
        self.blocks = nn.ModuleList(Bottleneck(self.hidden) for _ in range(n))
        self.cv2 = ConvBNAct((2 + n) * self.hidden, out_ch, 1, act="silu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = list(self.cv1(x).split(self.hidden, dim=1))
        for block in self.blocks:
            parts.append(block(parts[-1]))
        return self.cv2(torch.cat(parts, dim=1))


class SPPF(nn.Module):
    """Spatial pyramid pooling, fast: three chained 5x5 max pools concatenated with their input."""

    def __init__(self, in_ch: int, out_ch: int):
        super().__init__()
        hidden = in_ch // 2
        self.cv1 = ConvBNAct(in_ch, hidden, 1, act="silu")
        self.pool = nn.MaxPool2d(5, 1, 2)
        self.cv2 = ConvBNAct(4 * hidden, out_ch, 1, act="silu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y1 = self.cv1(x)
        y2 = self.pool(y1)
        y3 = self.pool(y2)
        return self.cv2(torch.cat([y1, y2, y3, self.pool(y3)], dim=1))


class YoloDetector(nn.Module):
    """Single-scale (stride 8) anchor-free detector with a P4 -> P3 upsample + concat neck.

    Per cell: ``ltrb`` distances ``exp(raw) * stride`` from the cell centre and class logits.
    ``forward`` returns ``(B, 4 + num_classes, cells)``: boxes as pixel xyxy, then sigmoid scores;
    :meth:`raw` returns the undecoded ``(box_raw, class_logits)`` for the training loss.
    """

    stride = 8

    def __init__(self, image_size: int = 96, in_ch: int = 1, num_classes: int = 10, width: int = 32):
        super().__init__()
        w = width
        self.num_classes = num_classes
        self.stem = nn.Sequential(ConvBNAct(in_ch, w // 2, 3, 2, act="silu"), ConvBNAct(w // 2, w, 3, 2, act="silu"))
        self.stage3 = nn.Sequential(C2f(w, w), ConvBNAct(w, 2 * w, 3, 2, act="silu"), C2f(2 * w, 2 * w))  # P3 /8
        self.stage4 = nn.Sequential(ConvBNAct(2 * w, 3 * w, 3, 2, act="silu"), C2f(3 * w, 3 * w), SPPF(3 * w, 3 * w))
        self.neck = C2f(5 * w, 2 * w)
        self.box_branch = nn.Sequential(ConvBNAct(2 * w, w, 3, act="silu"), ConvBNAct(w, w, 3, act="silu"))
        self.box_out = nn.Conv2d(w, 4, 1)
        self.cls_branch = nn.Sequential(ConvBNAct(2 * w, w, 3, act="silu"), ConvBNAct(w, w, 3, act="silu"))
        self.cls_out = nn.Conv2d(w, num_classes, 1)
        cells = image_size // self.stride
        centres = (torch.arange(cells, dtype=torch.float32) + 0.5) * self.stride
        cy, cx = torch.meshgrid(centres, centres, indexing="ij")
        # (1, 4, cells^2): the signs turn ltrb distances into x1 y1 x2 y2 around each centre
        self.register_buffer("centres", torch.stack([cx, cy, cx, cy]).reshape(1, 4, -1), persistent=False)
        self.register_buffer("signs", torch.tensor([-1.0, -1.0, 1.0, 1.0]).reshape(1, 4, 1), persistent=False)
        _init_convs(self)
        nn.init.constant_(self.box_out.bias, math.log(2.0))  # initial boxes 2 cells from the centre
        nn.init.constant_(self.cls_out.bias, -math.log(99.0))  # initial score 0.01

    def raw(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p3 = self.stage3(self.stem(x))
        p4 = self.stage4(p3)
        feat = self.neck(torch.cat([F.interpolate(p4, scale_factor=2.0, mode="nearest"), p3], dim=1))
        box = self.box_out(self.box_branch(feat)).flatten(2)
        return box, self.cls_out(self.cls_branch(feat)).flatten(2)

    def decode(self, box_raw: torch.Tensor) -> torch.Tensor:
        """``(B, 4, cells)`` raw box outputs -> pixel xyxy boxes."""
        return self.centres + self.signs * torch.exp(box_raw) * self.stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        box, cls = self.raw(x)
        return torch.cat([self.decode(box), torch.sigmoid(cls)], dim=1)


def fmnist_yolo() -> YoloDetector:
    """The ``fmnist_yolo`` reference model: 96x96 grey scenes, 10 Fashion-MNIST classes, 12x12 cells."""
    return YoloDetector(image_size=96, in_ch=1, num_classes=10, width=32)


# --------------------------------------------------------------------------- segmentation
# MobileNetV3-style backbone: (input, hidden, output, kernel, stride, se, activation); the last row
# of each stage gives the FPN its feature map at strides 4, 8, 16, 32.
TEXT_SEG_STAGES = (
    ((16, 16, 16, 3, 2, True, "relu"),),
    ((16, 64, 24, 3, 2, False, "relu"), (24, 72, 24, 3, 1, False, "relu")),
    ((24, 96, 40, 5, 2, True, "hardswish"), (40, 120, 40, 5, 1, True, "hardswish")),
    ((40, 160, 64, 5, 2, True, "hardswish"), (64, 192, 64, 5, 1, True, "hardswish")),
)


class TextSeg(nn.Module):
    """DB-net-like segmenter: MobileNetV3 backbone, FPN with Resize upsampling, ConvTranspose head."""

    def __init__(self, in_ch: int = 3, fpn: int = 32, stages=TEXT_SEG_STAGES):
        super().__init__()
        self.stem = ConvBNAct(in_ch, stages[0][0][0], 3, 2, act="hardswish")
        self.stages = nn.ModuleList(nn.Sequential(*(Bneck(*row) for row in rows)) for rows in stages)
        outs = [rows[-1][2] for rows in stages]
        self.laterals = nn.ModuleList(nn.Conv2d(c, fpn, 1) for c in outs)
        self.smooth = nn.ModuleList(ConvBNAct(fpn, fpn // 4, 3, act="relu") for _ in outs)
        self.head = nn.Sequential(
            ConvBNAct(fpn, fpn // 2, 3, act="relu"),
            nn.ConvTranspose2d(fpn // 2, fpn // 2, 2, 2),
            nn.BatchNorm2d(fpn // 2),
            nn.ReLU(),
            nn.ConvTranspose2d(fpn // 2, 1, 2, 2),
        )
        _init_convs(self)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The probability map before its sigmoid (what the training loss takes)."""
        feats = []
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
            feats.append(x)
        laterals = [lat(f) for lat, f in zip(self.laterals, feats, strict=True)]
        for i in range(len(laterals) - 2, -1, -1):  # top-down: add the coarser level, upsampled x2
            laterals[i] = laterals[i] + F.interpolate(laterals[i + 1], scale_factor=2.0, mode="nearest")
        # every level to stride 4 and concatenated (DB-net's neck)
        fused = [
            F.interpolate(smooth(lat), scale_factor=float(2**i), mode="nearest") if i else smooth(lat)
            for i, (smooth, lat) in enumerate(zip(self.smooth, laterals, strict=True))
        ]
        return self.head(torch.cat(fused, dim=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logits(x))


def text_seg() -> TextSeg:
    """The ``text_seg`` reference model: 3x128x128 scenes -> 1x128x128 text-region probability."""
    return TextSeg(in_ch=3, fpn=32)
