"""Small models the tests share: every op family the backend maps, conv + BN, residuals."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ConvBnNet(nn.Module):
    """conv + BN + ReLU6, residual add, concat, SiLU, pooling, flatten, dropout, linear."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Sequential(nn.Dropout(0.5), nn.Linear(16, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu6(self.bn1(self.conv1(x)))
        z = self.bn2(self.conv2(y))
        y = F.relu(y + z)
        y = torch.cat([y, F.silu(y)], dim=1)
        y = F.adaptive_avg_pool2d(F.max_pool2d(y, 2), 1).flatten(1)
        return self.head(y)


def randomize_batch_norms(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial running statistics and affine parameters (fresh BNs are identities)."""
    generator = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            n = module.num_features
            module.running_mean.copy_(torch.rand(n, generator=generator) * 0.4 - 0.2)
            module.running_var.copy_(torch.rand(n, generator=generator) + 0.5)
            module.weight.data.copy_(torch.rand(n, generator=generator) + 0.5)
            module.bias.data.copy_(torch.rand(n, generator=generator) * 0.2 - 0.1)
    return model


def conv_bn_net(seed: int = 0) -> ConvBnNet:
    torch.manual_seed(seed)
    return randomize_batch_norms(ConvBnNet(), seed).eval()


def images(batches: int, batch: int = 8, seed: int = 1, shape: tuple[int, ...] = (3, 8, 8)) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, *shape, generator=generator) for _ in range(batches)]


class MobileBlockNet(nn.Module):
    """A MobileNetV2-like chain: conv + BN + ReLU6, depthwise conv + BN + ReLU6, 1x1 conv +
    BN + ReLU, global pooling, linear: CLE finds a depthwise triple here."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.pw = nn.Conv2d(8, 16, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu6(self.bn1(self.conv1(x)))
        y = F.relu6(self.bn2(self.dw(y)))
        y = F.relu(self.bn3(self.pw(y)))
        return self.fc(F.adaptive_avg_pool2d(y, 1).flatten(1))


def mobile_block_net(seed: int = 0) -> MobileBlockNet:
    """Channels of very different ranges (what CLE evens out), BN statistics randomised."""
    torch.manual_seed(seed)
    model = randomize_batch_norms(MobileBlockNet(), seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        model.bn1.weight.mul_(torch.logspace(-1.5, 0, 8)[torch.randperm(8, generator=generator)])
        model.bn2.weight.mul_(torch.logspace(-1, 0.5, 8)[torch.randperm(8, generator=generator)])
    return model.eval()
