"""Plain torch reference model definitions (no dependency on the repo packages).

BatchNorm is intentionally left unfused -- the quantizer folds BN itself.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "BasicBlock",
    "InvertedResidual",
    "MobileNetV2",
    "ResNet",
    "make_divisible",
    "mobilenetv2_shape",
    "resnet18_224",
    "resnet18_shape",
]


# --------------------------------------------------------------------------- ResNet
class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_ch: int, out_ch: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.relu2 = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride, bias=False),
                nn.BatchNorm2d(out_ch),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + identity)


class ResNet(nn.Module):
    def __init__(
        self,
        layers=(2, 2, 2, 2),
        num_classes: int = 10,
        width: int = 64,
        in_ch: int = 3,
        stem: str = "imagenet",
        zero_init_residual: bool = False,
    ):
        super().__init__()
        widths = [width, width * 2, width * 4, width * 8]
        if stem == "imagenet":  # 7x7/2 conv + 3x3/2 maxpool
            self.conv1 = nn.Conv2d(in_ch, width, 7, 2, 3, bias=False)
            self.maxpool: nn.Module = nn.MaxPool2d(3, 2, 1)
        elif stem == "small":  # 3x3/2 conv, no maxpool (32x32 inputs)
            self.conv1 = nn.Conv2d(in_ch, width, 3, 2, 1, bias=False)
            self.maxpool = nn.Identity()
        else:
            raise ValueError(f"unknown stem {stem!r}")
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        stages = []
        c = width
        for i, (w, n) in enumerate(zip(widths, layers, strict=False)):
            blocks = []
            for j in range(n):
                stride = 2 if (i > 0 and j == 0) else 1
                blocks.append(BasicBlock(c, w, stride))
                c = w
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, num_classes)
        self._init_weights(zero_init_residual)

    def _init_weights(self, zero_init_residual: bool) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if not zero_init_residual:
            return
        # zero-init the last BN of each residual branch (helps short schedules)
        for m in self.modules():
            if isinstance(m, BasicBlock):
                nn.init.zeros_(m.bn2.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


def resnet18_shape(num_classes: int = 10, width: int = 16, in_ch: int = 1) -> ResNet:
    """ResNet-18 topology for 32x32 inputs: 3x3/2 stem conv + BN + ReLU (no maxpool),
    BasicBlocks [2,2,2,2] with widths width*{1,2,4,8}, global avg pool, Linear.
    Feature maps for 32x32 input: 16 -> 16 -> 8 -> 4 -> 2."""
    return ResNet(
        (2, 2, 2, 2), num_classes=num_classes, width=width, in_ch=in_ch, stem="small", zero_init_residual=True
    )


def resnet18_224(num_classes: int = 1000) -> ResNet:
    """Standard ImageNet ResNet-18 (3-channel input, 7x7/2 stem, maxpool), random weights.
    Used only for speed benchmarks."""
    return ResNet((2, 2, 2, 2), num_classes=num_classes, width=64, in_ch=3, stem="imagenet")


# ---------------------------------------------------------------------- MobileNetV2
def make_divisible(v: float, divisor: int = 8, min_value: int | None = None) -> int:
    """Round channels to a multiple of ``divisor`` (never going down by more than 10%)."""
    min_value = divisor if min_value is None else min_value
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


class ConvBNReLU6(nn.Sequential):
    def __init__(self, in_ch: int, out_ch: int, kernel: int = 3, stride: int = 1, groups: int = 1):
        super().__init__(
            nn.Conv2d(in_ch, out_ch, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(out_ch),
            nn.ReLU6(inplace=True),
        )


class InvertedResidual(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, stride: int, expand_ratio: int):
        super().__init__()
        hidden = round(in_ch * expand_ratio)
        self.use_res = stride == 1 and in_ch == out_ch
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(ConvBNReLU6(in_ch, hidden, 1))  # expand 1x1
        layers += [
            ConvBNReLU6(hidden, hidden, 3, stride, groups=hidden),  # depthwise 3x3
            nn.Conv2d(hidden, out_ch, 1, 1, 0, bias=False),  # linear bottleneck
            nn.BatchNorm2d(out_ch),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_res else self.conv(x)


# (expansion t, channels c, repeats n, stride s).  ImageNet strides are
# [1,2,2,2,1,2,1] (x32 with the stride-2 stem -> 7x7 at 224).  For 32x32 inputs the
# 160-channel stage keeps stride 1, so total downsampling is x16 and the final feature
# map is 2x2 (32 -> stem 16 -> 8 -> 4 -> 2).  Downsampling early rather than dropping
# the 24-channel stage's stride keeps CPU training ~1.7x faster at similar accuracy.
MBV2_SETTING_32 = [
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 1),
    (6, 320, 1, 1),
]
# ImageNet: the 160-channel stage downsamples too.
MBV2_SETTING_IMAGENET = [*MBV2_SETTING_32[:5], (6, 160, 3, 2), MBV2_SETTING_32[6]]


class MobileNetV2(nn.Module):
    def __init__(
        self,
        num_classes: int = 10,
        width_mult: float = 1.0,
        in_ch: int = 3,
        setting=MBV2_SETTING_IMAGENET,
        last_channel: int = 1280,
        dropout: float = 0.0,
        round_nearest: int = 8,
    ):
        super().__init__()
        c = make_divisible(32 * width_mult, round_nearest)
        self.last_channel = make_divisible(last_channel * max(1.0, width_mult), round_nearest)
        features: list[nn.Module] = [ConvBNReLU6(in_ch, c, 3, 2)]  # stride-2 stem
        for t, ch, n, s in setting:
            out = make_divisible(ch * width_mult, round_nearest)
            for i in range(n):
                features.append(InvertedResidual(c, out, s if i == 0 else 1, t))
                c = out
        features.append(ConvBNReLU6(c, self.last_channel, 1))
        self.features = nn.Sequential(*features)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier: nn.Module = (
            nn.Sequential(nn.Dropout(dropout), nn.Linear(self.last_channel, num_classes))
            if dropout > 0
            else nn.Linear(self.last_channel, num_classes)
        )
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = torch.flatten(self.avgpool(x), 1)
        return self.classifier(x)


def mobilenetv2_shape(
    num_classes: int = 10, width_mult: float = 0.5, in_ch: int = 1, last_channel: int = 1280
) -> MobileNetV2:
    """MobileNetV2 (expansion 6, ReLU6, depthwise 3x3, linear bottlenecks, residual adds)
    adapted to 32x32 inputs: stride-2 stem, one fewer stride-2 stage (x16 total, final
    feature map 2x2 for 32x32 input), channels rounded to multiples of 8, global avg pool, dropout-free
    Linear classifier."""
    return MobileNetV2(
        num_classes=num_classes,
        width_mult=width_mult,
        in_ch=in_ch,
        setting=MBV2_SETTING_32,
        last_channel=last_channel,
        dropout=0.0,
    )
