"""The model zoo of ``tools/bench/zoo.py``: public vision architectures with random weights.

Most entries are timm models built offline (``pretrained=False``); the rest are written here:
a YOLOv8-style detector (C2f blocks, SPPF, SiLU, a PAN neck, a decoupled head with DFL box
decoding and sigmoid class scores), DeepLabV3-style (ASPP) and LR-ASPP segmentation heads over
timm backbones, a PReLU/LeakyReLU CNN and a ConvTranspose encoder-decoder.

timm imports a few torchvision names at import time, and torchvision's compiled ops do not load
against this torch: :func:`use_torchvision_shim` puts the stand-in under ``tools/zoo_shims`` on
``sys.path`` (only this module does; no package ever sees it).

Every model is built in eval mode with weights from ``torch.manual_seed(seed)``, then what a
fresh model holds at one constant value (batch-norm statistics, norm weights, zero-initialised
heads, layer scales at 1e-6) is drawn too (:func:`randomise_untrained_state`).

Example:
    >>> entry = ZOO["prelu_net"]
    >>> model = entry.build(64)
    >>> import torch
    >>> model(torch.zeros(2, 3, 64, 64)).shape
    torch.Size([2, 10])
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

SHIM_DIR = Path(__file__).resolve().parent / "zoo_shims"


def use_torchvision_shim() -> None:
    """Make ``import torchvision`` find the stand-in in ``tools/zoo_shims`` (timm needs it).

    Refuses when a real torchvision is already imported: two copies would disagree.
    """
    loaded = sys.modules.get("torchvision")
    if loaded is not None and not str(getattr(loaded, "__file__", "")).startswith(str(SHIM_DIR)):
        raise RuntimeError(f"torchvision is already imported from {loaded.__file__}; the zoo's shim cannot replace it")
    if str(SHIM_DIR) not in sys.path:
        sys.path.insert(0, str(SHIM_DIR))


@dataclass(frozen=True)
class ZooModel:
    """One zoo entry.

    ``build(size)`` returns the model (eval mode, seeded random weights) for ``size`` x ``size``
    inputs; ``fixed_size`` is the one input size the architecture accepts (None: any multiple of
    32 from 64 up); ``family`` groups the table; class scores are the output's axis 1 from
    ``classes_from`` on (top-1 agreement is the argmax over them: per image, per pixel or per
    anchor); ``covers`` says what the entry adds to the zoo.
    """

    name: str
    family: str
    covers: str
    builder: Callable[[int], nn.Module] = field(repr=False)
    fixed_size: int | None = None
    classes_from: int = 0

    def input_size(self, size: int) -> int:
        return self.fixed_size or size

    def build(self, size: int, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        model = self.builder(self.input_size(size))
        randomise_untrained_state(model, seed)
        return model.eval()


def randomise_untrained_state(model: nn.Module, seed: int) -> None:
    """Give what a fresh model holds at one constant value seeded values of a trained model's kind.

    Fresh models hide what quantizers must handle: a batch norm at mean 0 / variance 1 is an
    identity, a zero-initialised head (MLP-Mixer) makes the output 0, and a layer scale at 1e-6
    (ConvNeXt) silences every residual branch. So: batch-norm statistics are drawn; a constant
    weight of two or more dimensions gets N(0, 1/fan_in); a constant vector of ones (norm
    weights) U(0.8, 1.2), of zeros (biases) N(0, 0.1^2), of anything else (layer scales) U(0.1, 1).
    Single-element parameters (a PReLU slope) are kept.
    """
    generator = torch.Generator().manual_seed(seed + 1)

    def draw(shape: torch.Size, low: float = 0.0, high: float = 1.0) -> torch.Tensor:
        return low + (high - low) * torch.rand(shape, generator=generator)

    with torch.no_grad():
        for parameter in model.parameters():
            flat = parameter.detach().reshape(-1)
            if not parameter.is_floating_point() or flat.numel() < 2 or not bool((flat == flat[0]).all()):
                continue
            value = float(flat[0])
            if parameter.dim() >= 2:
                fan_in = parameter[0].numel()
                parameter.copy_(torch.randn(parameter.shape, generator=generator) / math.sqrt(fan_in))
            elif value == 1.0:
                parameter.copy_(draw(parameter.shape, 0.8, 1.2))
            elif value == 0.0:
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))
            else:
                parameter.copy_(draw(parameter.shape, 0.1, 1.0))
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.running_mean is not None:
                module.running_mean.copy_(0.1 * torch.randn(module.num_features, generator=generator))
                module.running_var.copy_(draw(module.running_var.shape, 0.5, 1.5))


def timm_model(name: str, **kwargs: Any) -> Callable[[int], nn.Module]:
    """A builder of timm's ``name`` (random weights); ``img_size`` is passed where the model takes one."""

    def build(size: int) -> nn.Module:
        use_torchvision_shim()
        import timm

        extra = dict(kwargs)
        if extra.pop("img_size", False):
            extra["img_size"] = size
        return timm.create_model(name, pretrained=False, **extra)

    return build


def timm_features(name: str, **kwargs: Any) -> nn.Module:
    use_torchvision_shim()
    import timm

    return timm.create_model(name, pretrained=False, features_only=True, **kwargs)


# ------------------------------------------------------------------------------------ building blocks
class ConvBNAct(nn.Module):
    """Conv (no bias) -> BatchNorm -> activation: the YOLO "Conv" and the segmentation heads' unit."""

    def __init__(
        self,
        c_in: int,
        c_out: int,
        k: int = 1,
        s: int = 1,
        *,
        dilation: int = 1,
        act: Callable[[], nn.Module] = nn.SiLU,
        groups: int = 1,
    ) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, k, s, dilation * (k // 2), dilation=dilation, groups=groups, bias=False)
        self.bn = nn.BatchNorm2d(c_out)
        self.act = act()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))


class Bottleneck(nn.Module):
    def __init__(self, c: int, shortcut: bool) -> None:
        super().__init__()
        self.cv1 = ConvBNAct(c, c, 3)
        self.cv2 = ConvBNAct(c, c, 3)
        self.add = shortcut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.cv2(self.cv1(x))
        return x + y if self.add else y


class C2f(nn.Module):
    """YOLOv8's C2f: split in two, a chain of bottlenecks on one half, concat every stage."""

    def __init__(self, c_in: int, c_out: int, n: int = 1, shortcut: bool = False) -> None:
        super().__init__()
        self.c = c_out // 2
        self.cv1 = ConvBNAct(c_in, 2 * self.c)
        self.cv2 = ConvBNAct((2 + n) * self.c, c_out)
        self.m = nn.ModuleList(Bottleneck(self.c, shortcut) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = list(self.cv1(x).chunk(2, 1))
        for block in self.m:
            y.append(block(y[-1]))
        return self.cv2(torch.cat(y, 1))


class SPPF(nn.Module):
    """Spatial pyramid pooling, fast: three chained 5x5 max pools, concatenated."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        hidden = c_in // 2
        self.cv1 = ConvBNAct(c_in, hidden)
        self.cv2 = ConvBNAct(hidden * 4, c_out)
        self.pool = nn.MaxPool2d(5, 1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = [self.cv1(x)]
        for _ in range(3):
            y.append(self.pool(y[-1]))
        return self.cv2(torch.cat(y, 1))


class DFL(nn.Module):
    """Distribution focal loss decoding: softmax over ``bins`` per box side, expectation by a fixed 1x1 conv."""

    def __init__(self, bins: int = 16) -> None:
        super().__init__()
        self.bins = bins
        self.conv = nn.Conv2d(bins, 1, 1, bias=False).requires_grad_(False)
        self.conv.weight.data[:] = torch.arange(bins, dtype=torch.float32).view(1, bins, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, a = x.shape
        return self.conv(x.view(b, 4, self.bins, a).transpose(2, 1).softmax(1)).view(b, 4, a)


class DetectHead(nn.Module):
    """YOLOv8's decoupled head: per level a box branch (4 x ``bins`` logits) and a class branch;
    at inference boxes are decoded (DFL, anchor points, stride) and class scores pass a sigmoid.
    Output ``(N, 4 + classes, anchors)``: xywh in pixels, then class probabilities."""

    def __init__(self, num_classes: int, channels: tuple[int, ...], strides: tuple[int, ...], bins: int = 16) -> None:
        super().__init__()
        self.nc, self.bins, self.strides = num_classes, bins, strides
        c2, c3 = max(16, channels[0] // 4, 4 * bins), max(channels[0], min(num_classes, 100))
        self.box = nn.ModuleList(
            nn.Sequential(ConvBNAct(c, c2, 3), ConvBNAct(c2, c2, 3), nn.Conv2d(c2, 4 * bins, 1)) for c in channels
        )
        self.cls = nn.ModuleList(
            nn.Sequential(ConvBNAct(c, c3, 3), ConvBNAct(c3, c3, 3), nn.Conv2d(c3, num_classes, 1)) for c in channels
        )
        self.dfl = DFL(bins)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        b = features[0].shape[0]
        levels = [torch.cat((box(f), cls(f)), 1) for f, box, cls in zip(features, self.box, self.cls, strict=True)]
        flat = torch.cat([level.view(b, 4 * self.bins + self.nc, -1) for level in levels], 2)
        distances, scores = flat.split((4 * self.bins, self.nc), 1)
        anchors, strides = self._anchors(features)
        lt, rb = self.dfl(distances).chunk(2, 1)
        x1y1, x2y2 = anchors - lt, anchors + rb
        boxes = torch.cat(((x1y1 + x2y2) / 2, x2y2 - x1y1), 1) * strides
        return torch.cat((boxes, scores.sigmoid()), 1)

    def _anchors(self, features: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        points, strides = [], []
        for f, stride in zip(features, self.strides, strict=True):
            h, w = f.shape[2:]
            sy, sx = torch.meshgrid(torch.arange(h) + 0.5, torch.arange(w) + 0.5, indexing="ij")
            points.append(torch.stack((sx, sy), 0).view(2, -1))
            strides.append(torch.full((1, h * w), float(stride)))
        return torch.cat(points, 1).unsqueeze(0), torch.cat(strides, 1).unsqueeze(0)


class YoloV8Style(nn.Module):
    """A YOLOv8-n-shaped detector (width 0.25, depth 0.33): CSP backbone of C2f blocks, SPPF,
    PAN-FPN neck (nearest upsampling, concat), decoupled head over strides 8, 16, 32."""

    def __init__(self, num_classes: int = 80, width: float = 0.25) -> None:
        super().__init__()
        c = [max(8, int(v * width)) for v in (64, 128, 256, 512, 1024)]
        self.stem = nn.Sequential(ConvBNAct(3, c[0], 3, 2), ConvBNAct(c[0], c[1], 3, 2), C2f(c[1], c[1], 1, True))
        self.p3 = nn.Sequential(ConvBNAct(c[1], c[2], 3, 2), C2f(c[2], c[2], 2, True))
        self.p4 = nn.Sequential(ConvBNAct(c[2], c[3], 3, 2), C2f(c[3], c[3], 2, True))
        self.p5 = nn.Sequential(ConvBNAct(c[3], c[4], 3, 2), C2f(c[4], c[4], 1, True), SPPF(c[4], c[4]))
        self.up = nn.Upsample(scale_factor=2.0, mode="nearest")
        self.top_down4 = C2f(c[4] + c[3], c[3])
        self.top_down3 = C2f(c[3] + c[2], c[2])
        self.down3 = ConvBNAct(c[2], c[2], 3, 2)
        self.bottom_up4 = C2f(c[2] + c[3], c[3])
        self.down4 = ConvBNAct(c[3], c[3], 3, 2)
        self.bottom_up5 = C2f(c[3] + c[4], c[4])
        self.head = DetectHead(num_classes, (c[2], c[3], c[4]), (8, 16, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p3 = self.p3(self.stem(x))
        p4 = self.p4(p3)
        p5 = self.p5(p4)
        t4 = self.top_down4(torch.cat((self.up(p5), p4), 1))
        n3 = self.top_down3(torch.cat((self.up(t4), p3), 1))
        n4 = self.bottom_up4(torch.cat((self.down3(n3), t4), 1))
        n5 = self.bottom_up5(torch.cat((self.down4(n4), p5), 1))
        return self.head([n3, n4, n5])


class ASPP(nn.Module):
    """DeepLabV3's atrous spatial pyramid pooling: 1x1, three dilated 3x3, image pooling."""

    def __init__(self, c_in: int, c_out: int, rates: tuple[int, ...]) -> None:
        super().__init__()
        self.branches = nn.ModuleList(
            [ConvBNAct(c_in, c_out, 1, act=nn.ReLU)]
            + [ConvBNAct(c_in, c_out, 3, dilation=r, act=nn.ReLU) for r in rates]
        )
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), ConvBNAct(c_in, c_out, 1, act=nn.ReLU))
        self.project = ConvBNAct(c_out * (len(rates) + 2), c_out, 1, act=nn.ReLU)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = F.interpolate(self.pool(x), size=x.shape[-2:], mode="bilinear", align_corners=False)
        return self.project(torch.cat([*(branch(x) for branch in self.branches), pooled], 1))


class DeepLabV3Style(nn.Module):
    """A timm backbone at output stride 8 (dilated last stages), ASPP, 3x3 head, bilinear upsampling."""

    def __init__(self, backbone: str, num_classes: int = 21) -> None:
        super().__init__()
        self.backbone = timm_features(backbone, out_indices=(4,), output_stride=8)
        channels = self.backbone.feature_info.channels()[-1]
        self.aspp = ASPP(channels, 128, rates=(3, 6, 9))
        self.head = nn.Sequential(ConvBNAct(128, 128, 3, act=nn.ReLU), nn.Conv2d(128, num_classes, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.head(self.aspp(self.backbone(x)[-1]))
        return F.interpolate(y, size=x.shape[-2:], mode="bilinear", align_corners=False)


class LRASPPStyle(nn.Module):
    """MobileNetV3's Lite R-ASPP: the high-level features gated by a sigmoid of their global
    pool, upsampled and added to a classifier of the stride-8 features."""

    def __init__(self, backbone: str, num_classes: int = 21, inter: int = 128) -> None:
        super().__init__()
        self.backbone = timm_features(backbone, out_indices=(2, 4))
        low, high = self.backbone.feature_info.channels()
        self.cbr = ConvBNAct(high, inter, 1, act=nn.ReLU)
        self.scale = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(high, inter, 1, bias=False), nn.Sigmoid())
        self.low_classifier = nn.Conv2d(low, num_classes, 1)
        self.high_classifier = nn.Conv2d(inter, num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low, high = self.backbone(x)
        y = self.cbr(high) * self.scale(high)
        y = F.interpolate(y, size=low.shape[-2:], mode="bilinear", align_corners=False)
        y = self.low_classifier(low) + self.high_classifier(y)
        return F.interpolate(y, size=x.shape[-2:], mode="bilinear", align_corners=False)


class PReLUNet(nn.Module):
    """A small CNN with per-channel PReLU, a single-slope PReLU, LeakyReLU and ELU, average-pooled to 10 classes."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, 2, 1), nn.BatchNorm2d(16), nn.PReLU(16),
            nn.Conv2d(16, 32, 3, 2, 1), nn.BatchNorm2d(32), nn.LeakyReLU(0.1),
            nn.Conv2d(32, 64, 3, 2, 1), nn.BatchNorm2d(64), nn.PReLU(),
            nn.Conv2d(64, 64, 3, 1, 1), nn.ELU(),
        )  # fmt: skip
        self.head = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1))


class ConvTransposeUNet(nn.Module):
    """An encoder-decoder: strided convolutions down, ConvTranspose2d up, concat skip connections."""

    def __init__(self, num_classes: int = 4, width: int = 16) -> None:
        super().__init__()
        w = width
        self.down = nn.ModuleList(
            [ConvBNAct(3, w, 3, 2, act=nn.ReLU), ConvBNAct(w, 2 * w, 3, 2, act=nn.ReLU),
             ConvBNAct(2 * w, 4 * w, 3, 2, act=nn.ReLU)]
        )  # fmt: skip
        self.up = nn.ModuleList(
            [nn.ConvTranspose2d(4 * w, 2 * w, 2, 2), nn.ConvTranspose2d(4 * w, w, 4, 2, 1),
             nn.ConvTranspose2d(2 * w, w, 2, 2)]
        )  # fmt: skip
        self.out = nn.Conv2d(w, num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
        x = F.relu(self.up[0](x))
        x = F.relu(self.up[1](torch.cat((x, skips[1]), 1)))
        x = self.up[2](torch.cat((x, skips[0]), 1))
        return self.out(F.relu(x))


# ----------------------------------------------------------------------------------------------- zoo
def _entries() -> list[ZooModel]:
    cnn, light, vit, dense = "CNN", "mobile CNN", "transformer / hybrid", "segmentation / detection"
    # fmt: off
    return [
        ZooModel("resnet18", cnn, "plain residual CNN", timm_model("resnet18")),
        ZooModel("resnet50", cnn, "bottleneck residual CNN", timm_model("resnet50")),
        ZooModel("repvgg_a0", cnn, "RepVGG multi-branch 3x3 + 1x1 + identity sums", timm_model("repvgg_a0")),
        ZooModel("densenet121", cnn, "dense concatenation", timm_model("densenet121")),
        ZooModel("inception_v3", cnn, "Inception branches, concat, average pools", timm_model("inception_v3")),
        ZooModel("hrnet_w18_small", cnn, "multi-resolution fusion, upsampling", timm_model("hrnet_w18_small")),
        ZooModel("dla34", cnn, "deep layer aggregation trees", timm_model("dla34")),
        ZooModel("cspdarknet53", cnn, "CSP blocks, LeakyReLU", timm_model("cspdarknet53")),
        ZooModel("mobilenetv2_100", light, "inverted residuals, ReLU6", timm_model("mobilenetv2_100")),
        ZooModel("mobilenetv3_large_100", light, "hard-swish, hard-sigmoid SE", timm_model("mobilenetv3_large_100")),
        ZooModel("efficientnet_b0", light, "SiLU, sigmoid SE", timm_model("efficientnet_b0")),
        ZooModel("regnety_002", light, "grouped convs, sigmoid SE", timm_model("regnety_002")),
        ZooModel("ghostnet_100", light, "ghost modules (cheap ops concat), SE", timm_model("ghostnet_100")),
        ZooModel("mixnet_s", light, "mixed kernel sizes (channel split), Swish", timm_model("mixnet_s")),
        ZooModel("convnext_atto", light, "LayerNorm2d, GELU, 7x7 depthwise, layer scale", timm_model("convnext_atto")),
        ZooModel("vit_tiny", vit, "ViT: LayerNorm, GELU, softmax attention, cls token",
                 timm_model("vit_tiny_patch16_224", img_size=True)),
        ZooModel("deit_tiny_distilled", vit, "DeiT: distillation token, two heads averaged",
                 timm_model("deit_tiny_distilled_patch16_224", img_size=True)),
        ZooModel("swin_tiny", vit, "shifted windows (roll, window partition), relative position bias",
                 timm_model("swin_tiny_patch4_window7_224", img_size=True, window_size=6)),
        ZooModel("mobilevit_xxs", vit, "MobileViT: unfold/fold patches, attention in a CNN",
                 timm_model("mobilevit_xxs")),
        ZooModel("levit_128s", vit, "LeViT: attention with hard-swish, BatchNorm linears",
                 timm_model("levit_128s", img_size=True)),
        ZooModel("efficientformer_l1", vit, "EfficientFormer: pooling mixers, attention bias fixed at 7x7",
                 timm_model("efficientformer_l1"), fixed_size=224),
        ZooModel("mixer_s16", vit, "MLP-Mixer: token-mixing MLPs (transposes)", timm_model("mixer_s16_224", img_size=True)),
        ZooModel("edgenext_xx_small", vit, "EdgeNeXt: L2-normalised cross-covariance attention (XCA)",
                 timm_model("edgenext_xx_small")),
        ZooModel("poolformer_s12", vit, "PoolFormer: GroupNorm, average pool minus identity",
                 timm_model("poolformer_s12")),
        ZooModel("fastvit_t8", vit, "FastViT: RepMixer, large-kernel train-time branches",
                 timm_model("fastvit_t8")),
        ZooModel("efficientvit_b0", vit, "EfficientViT (MIT): ReLU linear attention, division",
                 timm_model("efficientvit_b0")),
        ZooModel("deeplabv3_resnet18", dense, "ASPP (dilated convs, image pooling), bilinear upsampling",
                 lambda size: DeepLabV3Style("resnet18")),
        ZooModel("lraspp_mobilenetv3", dense, "LR-ASPP: sigmoid gate, bilinear upsampling, two classifiers",
                 lambda size: LRASPPStyle("mobilenetv3_large_100")),
        ZooModel("yolov8n_style", dense, "C2f, SPPF, SiLU, PAN neck, DFL softmax, sigmoid scores",
                 lambda size: YoloV8Style(), classes_from=4),
        ZooModel("prelu_net", cnn, "PReLU (per channel and single), LeakyReLU, ELU", lambda size: PReLUNet()),
        ZooModel("convtranspose_unet", dense, "ConvTranspose2d decoder, skip concats", lambda size: ConvTransposeUNet()),
    ]
    # fmt: on


ZOO: dict[str, ZooModel] = {entry.name: entry for entry in _entries()}


def describe_size(size: int) -> str:
    """The input sizes a run at ``size`` uses (entries with a fixed size keep theirs)."""
    fixed = sorted({(e.fixed_size, e.name) for e in ZOO.values() if e.fixed_size})
    others = ", ".join(f"{name} at {s}" for s, name in fixed)
    return f"{size} x {size}" + (f" ({others})" if others else "")


def check_size(size: int) -> None:
    """Refuse an input size the zoo's architectures cannot all take (strides up to 32)."""
    if size < 64 or size % 32:
        raise ValueError(f"size: {size} is not allowed; allowed: a multiple of 32, at least 64")
