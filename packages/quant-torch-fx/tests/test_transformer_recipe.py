"""The planner's transformer recipe on quant-torch-fx's graph (aten layer_norm, softmax,
gelu, matmul, residual adds): a tiny attention block gets the recipe's formats.
tests-integration/test_transformer_two_backends.py compares it with quant-onnx's plan."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quant_core.observer_config import FixedRange, MinMax
from quant_torch_fx import ModelQuantizer
from quant_torch_fx.prepare import graph_info

D = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm1, self.norm2, self.norm = nn.LayerNorm(D), nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        attn = F.softmax((q * D**-0.5) @ k.transpose(-2, -1), dim=-1)
        x = x + self.proj(attn @ v)
        x = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return self.norm(x)


def example() -> torch.Tensor:
    return torch.randn(2, 5, D)


def test_torch_fx_plan_follows_the_recipe() -> None:
    gm = ModelQuantizer("a8w8", quiet=True).prepare(Block().eval(), example())
    plan = graph_info(gm).plan
    by_dtype: dict[str, int] = {}
    for group in plan.groups:
        by_dtype[group.spec.dtype.value] = by_dtype.get(group.spec.dtype.value, 0) + 1
    assert set(by_dtype) == {"uint8"}  # the residual stream float, as PT2E leaves it
    assert not any(m.startswith("add") for g in plan.groups for m in g.members)
    softmax = [g for g in plan.groups if any(m.startswith("softmax") for m in g.members)]
    assert len(softmax) == 1 and softmax[0].spec.observer == MinMax()  # its observed range
    # Under power-of-two formats (an NPU runs no float op): the stream at 16 bits, the softmax
    # on the fixed [0, 1] grid.
    npu = graph_info(ModelQuantizer("xint8", quiet=True).prepare(Block().eval(), example())).plan
    assert sum(g.spec.dtype.value == "int16" for g in npu.groups) >= 2
    assert sum(g.spec.observer == FixedRange(0.0, 1.0) for g in npu.groups) == 1
    # The two activation-activation matmuls (Q.K^T, attn.V): both inputs quantized at 8 bits.
    graph_nodes = {name: op for name, op in plan.quantized_nodes}
    assert sum(op == "MatMul" for op in graph_nodes.values()) == 2
    norm_outputs = [g for g in plan.groups if any("layer_norm" in m for m in g.members)]
    assert norm_outputs and all(g.spec.dtype.value == "uint8" for g in norm_outputs)
