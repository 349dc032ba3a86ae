"""Disabled autocast regions (timm's EfficientViT attention) are captured as one flat graph."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from quant_core.errors import CaptureError
from quant_torch_fx import ModelQuantizer, named_quantizers


class _Region(nn.Module):
    def __init__(self, enabled: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 1)
        self.linear = nn.Linear(8, 8)
        self.enabled = enabled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        with torch.autocast("cpu", enabled=self.enabled):
            y = y.float() * 2  # the tensor ``to``: also a ModuleDict attribute's name
            return self.linear(y.permute(0, 2, 3, 1))


def test_a_disabled_autocast_region_is_inlined_and_quantized() -> None:
    torch.manual_seed(0)
    model, x = _Region(enabled=False).eval(), torch.randn(16, 3, 4, 4)
    quantizer = ModelQuantizer("a8w8", quiet=True)
    quantized = quantizer.quantize_model(model, (x[:1],), [x])
    targets = {str(n.target) for n in quantized.graph.nodes if n.op == "call_function"}
    assert not any("wrap_with_autocast" in t for t in targets)
    assert "aten.linear.default" in targets
    weights = sorted(name for name in named_quantizers(quantized)[0] if name.startswith("weight:"))
    assert [w.split("/")[0] for w in weights] == ["weight:conv", "weight:linear"]  # the region's linear too
    with torch.no_grad():
        error = ((quantized(x) - model(x)) ** 2).mean() / (model(x) ** 2).mean()
    assert float(error) < 1e-3


def test_an_enabled_autocast_region_is_refused_by_name() -> None:
    model, x = _Region(enabled=True).eval(), torch.randn(4, 3, 4, 4)
    with pytest.raises(CaptureError, match=r"node '.*': an enabled torch.autocast\('cpu'"):
        ModelQuantizer("a8w8", quiet=True).quantize_model(model, (x[:1],), [x])
