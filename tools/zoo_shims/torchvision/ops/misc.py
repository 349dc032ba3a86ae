"""``FrozenBatchNorm2d`` as torchvision defines it: batch norm with fixed statistics and affine terms."""

from __future__ import annotations

from typing import Any

import torch


class FrozenBatchNorm2d(torch.nn.Module):
    """BatchNorm2d whose statistics and affine parameters are buffers (never trained)."""

    def __init__(self, num_features: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.ones(num_features))
        self.register_buffer("bias", torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        state_dict.pop(prefix + "num_batches_tracked", None)  # a BatchNorm2d state dict loads too
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight.reshape(1, -1, 1, 1) * (self.running_var.reshape(1, -1, 1, 1) + self.eps).rsqrt()
        shift = self.bias.reshape(1, -1, 1, 1) - self.running_mean.reshape(1, -1, 1, 1) * scale
        return x * scale + shift

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
