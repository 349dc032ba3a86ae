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
    assert fx.startswith("transformer recipe: 3 LayerNorm, 1 GELU, 1 Softmax; 3 residual-stream tensors (float")
    # Q.K^T and attn.V quantized on both (the ONNX export writes the four Linears as MatMuls too)
    assert sum(op == "MatMul" for _name, op in fx_plan.quantized_nodes) == 2
    assert sum(op == "MatMul" for _name, op in onnx_plan.quantized_nodes) == 2 + 4


class TinyViT(torch.nn.Module):
    """Patch embedding, class and distillation tokens joined by a Concat, position
    embedding, one block, the final norm, the class token into a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.patch = torch.nn.Conv2d(3, D, 4, stride=4)
        self.tokens = torch.nn.Parameter(torch.randn(1, 2, D) * 0.02)
        self.pos = torch.nn.Parameter(torch.randn(1, 6, D) * 0.02)
        self.block, self.head = Block(), torch.nn.Linear(D, 5)
        for linear in (self.block.qkv, self.block.proj, self.block.fc1, self.block.fc2):
            torch.nn.init.normal_(linear.bias, std=0.1)

    def forward(self, img):  # type: ignore[no-untyped-def]
        x = self.patch(img).flatten(2).transpose(1, 2)
        x = torch.cat([self.tokens.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.head(self.block(x)[:, 0])


def _dequantized_reads(model: onnx.ModelProto) -> tuple[list[str], set[str]]:
    """Compute-node inputs (Conv/Gemm/MatMul) no DequantizeLinear feeds, and the tensors
    any QuantizeLinear reads."""
    producers = {o: n for n in model.graph.node for o in n.output}
    unfed = [
        f"{n.name}:{i}"
        for n in model.graph.node
        if n.op_type in ("Conv", "Gemm", "MatMul")
        for i in n.input[:2]
        if getattr(producers.get(i), "op_type", None) != "DequantizeLinear"
    ]
    return unfed, {n.input[0] for n in model.graph.node if n.op_type == "QuantizeLinear"}


def test_both_files_feed_every_layer_from_a_dequantize_and_keep_the_stream_float(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """a8w8: every Conv/Gemm/MatMul input of both backends' files (both attention matmuls,
    the head) is DequantizeLinear-fed, while no residual Add output, learned token or linear
    bias is quantized (float, as PT2E leaves them)."""
    import numpy as np

    import quant_onnx

    model, images = TinyViT().eval(), torch.randn(8, 3, 8, 8)
    q = ModelQuantizer("a8w8", quiet=True)
    fx_path = q.export_onnx(q.quantize_model(model, images[:1], [images]), images[:1], tmp_path / "fx.onnx")
    buffer = io.BytesIO()
    torch.onnx.export(model, (images[:1],), buffer, dynamo=False, opset_version=17)
    onnx_file = quant_onnx.quantize(buffer.getvalue(), None, "a8w8", images.numpy(), quiet=True).model
    for name, proto in (("quant-torch-fx", onnx.load(str(fx_path))), ("quant-onnx", onnx_file)):
        unfed, quantized = _dequantized_reads(proto)
        assert unfed == [], (name, unfed)
        producers = {o: n for n in proto.graph.node for o in n.output}
        residual = [t for t in quantized if getattr(producers.get(t), "op_type", None) == "Add"
                    and any(c.op_type == "LayerNormalization" for c in proto.graph.node if t in c.input)]  # fmt: skip
        assert residual == [], (name, residual)
        initializers = {i.name: onnx.numpy_helper.to_array(i) for i in proto.graph.initializer}
        stored = [initializers[n.input[0]] for n in proto.graph.node
                  if n.op_type == "DequantizeLinear" and n.input[0] in initializers]  # fmt: skip
        # Weights (int8, 2-D and up), int32 Conv/Gemm biases, scalars; no 8/16-bit bias or token.
        assert all((a.ndim >= 2 and a.dtype == np.int8) or a.dtype == np.int32 or a.size == 1 for a in stored), name


class MaskedAttention(torch.nn.Module):
    """Self-attention under a causal or a boolean mask, through scaled_dot_product_attention:
    torch's ONNX export writes the mask as ``Where(..., 0, -inf)`` added to the scores (and a
    ``Where(IsNaN(p), 0, p)`` guard after the softmax for the boolean one)."""

    def __init__(self, causal: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.proj, self.causal = torch.nn.Linear(8, 24), torch.nn.Linear(8, 8), causal
        self.register_buffer("pattern", (torch.rand(6, 6) > 0.5) | torch.eye(6, dtype=torch.bool))

    def forward(self, x):  # type: ignore[no-untyped-def]
        F = torch.nn.functional
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
        mask = None if self.causal else self.pattern.expand(b, 1, n, n)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(b, n, c))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bool_mask"])
@pytest.mark.parametrize("preset, bound", [("xint8", 17.0), ("a8w8", 36.0)])
def test_quant_onnx_quantizes_torchs_export_of_masked_attention(causal: bool, preset: str, bound: float) -> None:
    """The -inf fill of torch's export is never observed: float with the scores under a8w8
    (calibration refused the file before: infinite values), and under xint8 the masked
    scores and the mask are quantized on ranges derived from the scores before the mask
    (29-30 dB against 30 dB with every position visible when weights were rounded up to a
    power of two; 18.8-19.5 dB with the nearest power, which costs this 8x24 toy as much
    unmasked)."""
    import numpy as np
    import onnxruntime as ort

    import quant_onnx

    model, x = MaskedAttention(causal).eval(), torch.randn(16, 6, 8, generator=torch.Generator().manual_seed(1))
    buffer = io.BytesIO()
    torch.onnx.export(model, (x[:1],), buffer, dynamo=False, opset_version=17, input_names=["input"],
                      dynamic_axes={"input": {0: "batch"}})  # fmt: skip
    result = quant_onnx.quantize(buffer.getvalue(), None, preset, x.numpy(), quiet=True)
    assert len(result.calibrated.plan.derived) == (2 if preset == "xint8" else 0)
    session = ort.InferenceSession(result.model.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {"input": x.numpy()})
    with torch.no_grad():
        expected = model(x).numpy()
    sqnr = 10 * np.log10((expected**2).sum() / ((expected - got) ** 2).sum())
    assert sqnr > bound, sqnr


class OutlierMLP(torch.nn.Module):
    """Two Linears whose second weight holds one element 100 standard deviations out (as
    timm's trunc_normal_ init draws in random-weight Swin-Tiny)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(64, 384), torch.nn.Linear(384, 384)
        with torch.no_grad():
            for fc in (self.fc1, self.fc2):
                fc.weight.normal_(0, 0.02)
            self.fc2.weight[5, 7] = 2.0

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.fc2(torch.relu(self.fc1(x)))


def test_both_backends_give_an_outlier_weight_its_range_by_squared_error() -> None:
    """Under xint8 (int8 per-tensor power-of-two weights) both backends' plans give fc2's
    weight the MSE position search, fc1's the preset's min-max, and the same qparams."""
    from quant_core.observer_config import MinMax
    from quant_core.weights import constant_qparams

    example = torch.randn(2, 64)
    gm = ModelQuantizer("xint8", quiet=True).prepare(OutlierMLP().eval(), example)
    buffer = io.BytesIO()
    torch.onnx.export(OutlierMLP().eval(), (example,), buffer, dynamo=False, opset_version=17)
    model = onnx.load_from_string(buffer.getvalue())
    graph = plan_graph(model)
    plans = {"torch-fx": (graph_info(gm).plan, None), "onnx": (plan_quantization(graph, get_preset("xint8")), graph)}
    fc2 = OutlierMLP().fc2.weight.detach().numpy()
    for backend, (plan, onnx_graph) in plans.items():
        searched = [slot for slot in plan.weights if slot.spec.observer != MinMax()]
        assert len(searched) == 1 and len(plan.weights) == 2, backend
        assert any("its position by squared error" in note for note in plan.notes), backend
        value = fc2 if onnx_graph is None else onnx_graph.constant(searched[0].tensor)
        assert abs(value).max() == 2.0, backend
        assert constant_qparams(value, searched[0].spec) == constant_qparams(fc2, searched[0].spec), backend
