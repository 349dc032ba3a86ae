"""The transformer recipe is one planner rule for both backends: a tiny attention block
captured by quant-torch-fx and its ONNX export planned by quant-onnx recognise the same
LayerNorms, GELU, attention Softmax and residual-stream tensors under a8w8, with its
attention written as matmuls or through scaled_dot_product_attention. (Their
block-internal float tensors differ in number: the ONNX export spells GELU as Erf
arithmetic and Linear as MatMul + bias Add, which torch-fx sees as single ops.)"""

from __future__ import annotations

import io
import re

import pytest

from quant_core.plan import plan_quantization
from quant_core.presets import get_preset

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
pytest.importorskip("quant_onnx")
pytest.importorskip("quant_torch_fx")
from quant_onnx.pipeline.annotate import plan_graph  # noqa: E402
from quant_torch_fx import ModelQuantizer  # noqa: E402
from quant_torch_fx.prepare import graph_info  # noqa: E402

D = 8


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        nn = torch.nn
        self.norm1, self.norm2, self.norm = nn.LayerNorm(D), nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):  # type: ignore[no-untyped-def]
        F = torch.nn.functional
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        attn = F.softmax((q * D**-0.5) @ k.transpose(-2, -1), dim=-1)
        x = x + self.proj(attn @ v)
        x = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return self.norm(x)


class FusedBlock(Block):
    """The same block, its attention through scaled_dot_product_attention (timm's fused
    attention): quant-torch-fx writes it out before planning."""

    def forward(self, x):  # type: ignore[no-untyped-def]
        F = torch.nn.functional
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, n, 3, 2, c // 2).permute(2, 0, 3, 1, 4).unbind(0)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))
        x = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return self.norm(x)


def recognised(notes: tuple[str, ...]) -> str:
    """The recipe note without its block-internal count."""
    note = next(note for note in notes if note.startswith("transformer recipe:"))
    return re.sub(r"\d+ block-internal tensors? float, ", "", note)


@pytest.mark.parametrize("block", [Block, FusedBlock], ids=["matmuls", "scaled_dot_product_attention"])
def test_both_backends_recognise_the_same_blocks(block: type[Block]) -> None:
    example = torch.randn(2, 5, D)
    gm = ModelQuantizer("a8w8", quiet=True).prepare(block().eval(), example)
    buffer = io.BytesIO()
    torch.onnx.export(block().eval(), (example,), buffer, dynamo=False, opset_version=17)
    model = onnx.load_from_string(buffer.getvalue())
    onnx_plan = plan_quantization(plan_graph(model), get_preset("a8w8"))
    fx_plan = graph_info(gm).plan
    fx = recognised(fx_plan.notes)
    assert fx == recognised(onnx_plan.notes)
    assert fx.startswith("transformer recipe: 3 LayerNorm, 1 GELU, 1 Softmax; 3 residual-stream tensors at 16 bits")
    # Q.K^T and attn.V quantized on both (the ONNX export writes the four Linears as MatMuls too)
    assert sum(op == "MatMul" for _name, op in fx_plan.quantized_nodes) == 2
    assert sum(op == "MatMul" for _name, op in onnx_plan.quantized_nodes) == 2 + 4
