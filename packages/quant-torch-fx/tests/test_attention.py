"""``scaled_dot_product_attention`` written out in ATen ops (quant_torch_fx.attention):
the rewritten graph computes what the captured one did (scale, boolean and additive masks,
causal, grouped-query), the planner quantizes both inputs of both matmuls as it does the
ONNX backend's, and the exported file feeds them from DequantizeLinear nodes.
(tests-integration/test_torch_fx_attention.py runs the export in onnxruntime.)"""

from __future__ import annotations

import copy
from collections.abc import Callable

import export_models
import numpy as np
import onnx
import pytest
import test_transformer_recipe
import torch
import torch.nn.functional as F
from onnx.reference import ReferenceEvaluator
from torch import nn

from quant_core.errors import ModelError
from quant_core.observer_config import FixedRange
from quant_torch_fx import ModelQuantizer
from quant_torch_fx.aten_map import op_name
from quant_torch_fx.attention import decompose_attention
from quant_torch_fx.capture import capture
from quant_torch_fx.export import onnx_model
from quant_torch_fx.prepare import graph_info


class Attend(nn.Module):
    """Attention over ``x`` split into q, k, v (``[batch, heads, tokens, 4]`` each), with
    ``options`` for scaled_dot_product_attention and an optional mask made by ``mask``."""

    def __init__(
        self,
        mask: Callable[[torch.Tensor], torch.Tensor] | None = None,
        kv_heads: int = 2,
        **options: object,
    ) -> None:
        super().__init__()
        self.mask, self.kv_heads, self.options = mask, kv_heads, options

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = x.reshape(x.shape[0], 6, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
        k, v = k[:, : self.kv_heads], v[:, : self.kv_heads]
        mask = None if self.mask is None else self.mask(x)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **self.options)  # type: ignore[arg-type]


def _ragged_bool(x: torch.Tensor) -> torch.Tensor:
    """Per sample and query a different set of visible keys, at least one each (a padding
    mask); computed from the input, so the mask is a graph tensor, not a constant."""
    keep = x[:, :, :6].reshape(x.shape[0], 1, 6, 6) > 0
    return keep | torch.eye(6, dtype=torch.bool)


CASES: dict[str, Callable[[], nn.Module]] = {
    "plain": lambda: Attend(),
    "scale": lambda: Attend(scale=0.7),
    "causal": lambda: Attend(is_causal=True),
    "bool_mask": lambda: Attend(_ragged_bool),
    "constant_bool_mask": lambda: Attend(lambda x: torch.rand(6, 6, generator=torch.Generator().manual_seed(3)) > 0.3),
    "additive_mask": lambda: Attend(lambda x: x[:, :6, :6].unsqueeze(1) * 3.0),
    "additive_broadcast_mask_and_scale": lambda: Attend(lambda x: torch.linspace(-2, 2, 6).reshape(1, 6), scale=0.25),
    "grouped_query": lambda: Attend(kv_heads=1, enable_gqa=True),
    "grouped_query_causal": lambda: Attend(kv_heads=1, enable_gqa=True, is_causal=True),
}


def _inputs(batch: int, seed: int) -> torch.Tensor:
    return torch.randn(batch, 6, 24, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_written_out_attention_computes_the_captured_graph(name: str) -> None:
    module = CASES[name]().eval()
    captured = capture(module, _inputs(1, 0))
    assert any(op_name(n) == "scaled_dot_product_attention" for n in captured.graph.nodes)
    rewritten = copy.deepcopy(captured)
    assert decompose_attention(rewritten) == 1
    ops = [op_name(n) for n in rewritten.graph.nodes if n.op == "call_function"]
    assert "scaled_dot_product_attention" not in ops
    assert ops.count("matmul") == 2 and ops.count("softmax") == 1
    x = _inputs(5, 1)  # another batch size than the capture's: the batch stays dynamic
    with torch.no_grad():
        expected, got, eager = captured(x), rewritten(x), module(x)
    assert torch.isfinite(expected).all()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)


class CrossAttend(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)


def test_causal_cross_attention_over_other_lengths_and_value_width() -> None:
    """3 queries over 7 keys, values 5 wide: the causal mask is torch's top-left triangle."""
    q, k, v = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 7, 4), torch.randn(2, 2, 7, 5)
    rewritten = capture(CrossAttend(), (q, k, v))
    decompose_attention(rewritten)
    with torch.no_grad():
        torch.testing.assert_close(rewritten(q, k, v), CrossAttend()(q, k, v), rtol=1e-5, atol=1e-5)


def test_attention_dropout_is_refused_naming_the_node() -> None:
    captured = capture(Attend(dropout_p=0.1).eval(), _inputs(1, 0))
    with pytest.raises(ModelError, match=r"node 'scaled_dot_product_attention'.*dropout_p=0\.1.*allowed: 0\.0"):
        decompose_attention(captured)


class Block(test_transformer_recipe.Block):
    """The pre-norm block of test_transformer_recipe, its attention through
    scaled_dot_product_attention (as timm's ViT runs it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, n, 3, 2, c // 2).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c)
        x = x + self.proj(y)
        x = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return self.norm(x)


def test_the_planner_quantizes_both_inputs_of_both_matmuls() -> None:
    gm = ModelQuantizer("a8w8", quiet=True).prepare(Block().eval(), test_transformer_recipe.example())
    info = graph_info(gm)
    matmuls = [name for name, op in info.plan.quantized_nodes if op == "MatMul"]
    assert len(matmuls) == 2  # Q.K^T and attn.V (the Linears are Gemms)
    note = next(n for n in info.plan.notes if n.startswith("transformer recipe:"))
    assert "1 Softmax" in note and "1 Softmax output (observed range" in note
    fx_nodes = {n.name: n for n in gm.graph.nodes}
    for name in matmuls:
        for read in fx_nodes[info.nodes[name]].args[:2]:
            # each input is read through its group's fake quantizer, at 8 bits
            assert read.op == "call_module" and str(read.target).startswith("activation_quantizers."), (name, read)
            assert gm.get_submodule(str(read.target)).spec.dtype.value == "uint8"
    assert sum(g.spec.observer == FixedRange(0.0, 1.0) for g in info.plan.groups) == 0  # a8w8: observed


def _is_weight(tensor: str, producers: dict[str, onnx.NodeProto], initializers: set[str]) -> bool:
    producer = producers.get(tensor)
    return tensor in initializers or (
        producer is not None and producer.op_type == "DequantizeLinear" and producer.input[0] in initializers
    )


@pytest.mark.parametrize("family", ["vit", "swin"])
def test_the_export_feeds_both_inputs_of_every_attention_matmul_from_a_dequantize(family: str) -> None:
    calibration = export_models.images(4)
    q = ModelQuantizer("a8w8", quiet=True)
    frozen = q.freeze(q.quantize_model(export_models.build(family), calibration[0][:1], calibration))
    proto = onnx_model(frozen, (export_models.images(1, batch=1)[0],))
    producers = {o: n for n in proto.graph.node for o in n.output}
    initializers = {i.name for i in proto.graph.initializer}
    attention = [
        n
        for n in proto.graph.node
        if n.op_type == "MatMul" and not any(_is_weight(i, producers, initializers) for i in n.input)
    ]
    assert len(attention) == 4  # two blocks, Q.K^T and attn.V each
    for node in attention:
        fed = [producers[i].op_type if i in producers else "graph input" for i in node.input]
        assert fed == ["DequantizeLinear", "DequantizeLinear"], (node.name, fed)


class MaskedAttention(nn.Module):
    """Self-attention under a causal mask or a boolean mask (a fixed pattern expanded to the
    batch: a graph tensor, as a padding mask would be)."""

    def __init__(self, causal: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.proj, self.causal = nn.Linear(8, 24), nn.Linear(8, 8), causal
        self.register_buffer("pattern", (torch.rand(6, 6) > 0.5) | torch.eye(6, dtype=torch.bool))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
        if self.causal:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            mask = self.pattern.expand(b, 1, n, n)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(b, n, c))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bool_mask"])
def test_masked_attention_quantizes_and_exports_as_the_frozen_model_computes(causal: bool) -> None:
    model = MaskedAttention(causal).eval()
    x = torch.randn(16, 6, 8, generator=torch.Generator().manual_seed(1))
    q = ModelQuantizer("a8w8", quiet=True)
    frozen = q.freeze(q.quantize_model(model, x[:1], [x]))
    with torch.no_grad():
        expected, quantized = model(x), frozen(x)
    sqnr = 10 * torch.log10(expected.pow(2).sum() / (expected - quantized).pow(2).sum())
    assert sqnr > 30, sqnr  # the masked positions stay masked through the quantized graph
    proto = onnx_model(frozen, (x[:1],), opset=19)
    (got,) = ReferenceEvaluator(proto).run(None, {"input": x.numpy()})
    np.testing.assert_allclose(got, quantized.numpy(), rtol=0, atol=1e-4 * float(quantized.abs().max()))


class VisibleAttention(MaskedAttention):
    """The same weights with every position visible: what a masked model's SQNR is held to."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))


def _xint8_sqnr(model: nn.Module, x: torch.Tensor) -> float:
    q = ModelQuantizer("xint8", quiet=True)
    frozen = q.freeze(q.quantize_model(model, x[:1], [x]))
    with torch.no_grad():
        expected, quantized = model(x), frozen(x)
    return float(10 * torch.log10(expected.pow(2).sum() / (expected - quantized).pow(2).sum()))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bool_mask"])
def test_masked_attention_under_xint8_keeps_the_visible_scores_resolution(causal: bool) -> None:
    """Under xint8 the scores are quantized too; the planner derives the masked scores'
    range (and the mask's) from the scores before the mask, so a masked model keeps about
    what the same weights keep with every position visible (when the fill, -3.4e38, set the
    range: 13-15 dB against 32 dB, weights rounded up to a power of two; with the nearest
    power of two this 8x24 toy keeps 20.7 dB unmasked, its masked forms 19.2-19.9 dB)."""
    model = MaskedAttention(causal).eval()
    x = torch.randn(16, 6, 8, generator=torch.Generator().manual_seed(1))
    visible = _xint8_sqnr(VisibleAttention(causal).eval(), x)
    q = ModelQuantizer("xint8", quiet=True)
    prepared = q.quantize_model(model, x[:1], [x])
    plan = graph_info(prepared).plan
    derived = {plan.group_of(t).key for t in plan.observed_tensors} & {d.group for d in plan.derived}  # type: ignore[union-attr]
    assert len(plan.derived) == 2 and not derived  # the masked scores and the mask, neither observed
    frozen = q.freeze(prepared)
    with torch.no_grad():
        expected, quantized = model(x), frozen(x)
    sqnr = float(10 * torch.log10(expected.pow(2).sum() / (expected - quantized).pow(2).sum()))
    assert sqnr > visible - 2.5 and sqnr > 17, (sqnr, visible)
    proto = onnx_model(frozen, (x[:1],), opset=19)
    (got,) = ReferenceEvaluator(proto).run(None, {"input": x.numpy()})
    np.testing.assert_allclose(got, quantized.numpy(), rtol=0, atol=1e-4 * float(quantized.abs().max()))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bool_mask"])
def test_qat_without_a_calibration_loader_derives_the_masked_ranges_from_its_first_batch(causal: bool) -> None:
    """QAT started without a calibration loader calibrates on its first batch as a loader of
    that batch would: the masked scores and the mask (derived groups, never observed) and
    the mask constant get their qparams. Before, they never did: the masked scores stayed
    float in training and freezing failed on the constant."""
    from quant_torch_fx.prepare import qparams_table

    model = MaskedAttention(causal).eval()
    x = torch.randn(16, 6, 8, generator=torch.Generator().manual_seed(1))
    q = ModelQuantizer("xint8", quiet=True)
    calibrated = q.prepare_qat(model, x[:1], calib_loader=[x])
    first_batch = q.prepare_qat(model, x[:1])
    out = first_batch.train()(x)
    out.sum().backward()
    assert qparams_table(first_batch) == qparams_table(calibrated)
    plan = graph_info(first_batch).plan
    assert len(plan.derived) == 2
    frozen = q.freeze(first_batch.eval())
    with torch.no_grad():
        expected, quantized = model(x), frozen(x)
    sqnr = float(10 * torch.log10(expected.pow(2).sum() / (expected - quantized).pow(2).sum()))
    assert sqnr > 17, sqnr


@pytest.mark.parametrize("preset", ["a8w8", "a16w8"])
def test_an_encoder_layer_under_nn_transformers_causal_mask_quantizes_and_exports(preset: str) -> None:
    # nn.MultiheadAttention unsqueezes the -inf mask of generate_square_subsequent_mask; the
    # Unsqueeze quantized the constant and calibration refused its -inf.
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    mask = nn.Transformer.generate_square_subsequent_mask(6)

    class Causal(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = layer
            self.register_buffer("mask", mask)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(x, src_mask=self.mask)

    _quantized_exported_and_checked(Causal().eval(), preset, min_sqnr=30)


def _quantized_exported_and_checked(model: nn.Module, preset: str, min_sqnr: float) -> onnx.ModelProto:
    """``model`` quantized with ``preset`` and frozen, its output SQNR above ``min_sqnr`` dB,
    and its export run by onnx's ReferenceEvaluator equal to the frozen model's output."""
    x = torch.randn(16, 6, 16, generator=torch.Generator().manual_seed(1))
    q = ModelQuantizer(preset, quiet=True)
    frozen = q.freeze(q.quantize_model(model, x[:1], [x]))
    with torch.no_grad():
        expected, quantized = model(x), frozen(x)
    sqnr = 10 * torch.log10(expected.pow(2).sum() / (expected - quantized).pow(2).sum())
    assert sqnr > min_sqnr, sqnr
    proto = onnx_model(frozen, (x[:1],), opset=19)
    (got,) = ReferenceEvaluator(proto).run(None, {"input": x.numpy()})
    np.testing.assert_allclose(got, quantized.numpy(), rtol=0, atol=1e-4 * float(quantized.abs().max()))
    return proto


class AttendWithWeights(nn.Module):
    """nn.MultiheadAttention returning its weights (``need_weights``, the default) under a
    mask: it adds the mask to the scores in one ``baddbmm``."""

    def __init__(self, mask: torch.Tensor) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.register_buffer("mask", mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, weights = self.attn(x, x, x, attn_mask=self.mask)
        return y + weights.sum(-1, keepdim=True)


@pytest.mark.parametrize("preset", ["a8w8", "xint8"])
@pytest.mark.parametrize(
    "mask",
    [nn.Transformer.generate_square_subsequent_mask(6), torch.ones(6, 6, dtype=torch.bool).triu(1)],
    ids=["float_inf", "bool"],
)
def test_attention_returning_its_weights_under_a_mask_quantizes_and_exports(preset: str, mask: torch.Tensor) -> None:
    # baddbmm had no planner policy and no ONNX rule: Q.K^T ran float, the -inf mask was
    # observed (calibration refused it) and the export refused the op.
    proto = _quantized_exported_and_checked(AttendWithWeights(mask).eval(), preset, min_sqnr=25)
    producers = {o: n.op_type for n in proto.graph.node for o in n.output}
    matmuls = [n for n in proto.graph.node if n.op_type in ("MatMul", "Gemm")]
    assert len(matmuls) == 4  # the two projections, Q.K^T and attn.V: every input dequantized
    assert all(producers.get(i) == "DequantizeLinear" for n in matmuls for i in n.input[:2])


class CausalAndPadded(nn.Module):
    """nn.MultiheadAttention under a causal mask and a key-padding mask (a second, boolean
    model input): torch adds the two masks before the scores."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(6))

    def forward(self, x: torch.Tensor, padded: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, attn_mask=self.causal, key_padding_mask=padded, need_weights=False)[0]


@pytest.mark.parametrize(("preset", "min_sqnr"), [("a8w8", 30), ("a16w8", 40), ("xint8", 15)])
def test_attention_under_a_causal_and_a_padding_mask_quantizes_and_exports(preset: str, min_sqnr: float) -> None:
    # The sum of the two masks was no mask to the planner: each -inf summand was observed,
    # and calibration refused it under every preset.
    model = CausalAndPadded().eval()
    x = torch.randn(16, 6, 16, generator=torch.Generator().manual_seed(1))
    padded = torch.zeros(16, 6, dtype=torch.bool)
    padded[:, 5] = True
    padded[::2, 4] = True
    q = ModelQuantizer(preset, quiet=True)
    frozen = q.freeze(q.quantize_model(model, (x[:1], padded[:1]), [(x, padded)]))
    with torch.no_grad():
        expected, quantized = model(x, padded), frozen(x, padded)
    sqnr = 10 * torch.log10(expected.pow(2).sum() / (expected - quantized).pow(2).sum())
    assert sqnr > min_sqnr, sqnr
    proto = onnx_model(frozen, (x[:1], padded[:1]), opset=19)
    feeds = dict(zip([i.name for i in proto.graph.input], (x.numpy(), padded.numpy()), strict=True))
    (got,) = ReferenceEvaluator(proto).run(None, feeds)
    np.testing.assert_allclose(got, quantized.numpy(), rtol=0, atol=1e-4 * float(quantized.abs().max()))


@pytest.mark.parametrize(("beta", "alpha"), [(1, 1), (0.5, 2.0), (0, 1)])
def test_baddbmm_is_written_out_as_the_captured_op_computes(beta: float, alpha: float) -> None:
    class Scores(nn.Module):
        def forward(self, bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.baddbmm(bias, a, b, beta=beta, alpha=alpha)

    args = (torch.randn(2, 3, 5), torch.randn(2, 3, 4), torch.randn(2, 4, 5))
    gm = torch.export.export(Scores(), args).module()
    assert decompose_attention(gm) == 1
    assert "baddbmm" not in [op_name(n) for n in gm.graph.nodes]
    torch.testing.assert_close(gm(*args), Scores()(*args))


class InfMaskedAttention(MaskedAttention):
    """The same weights under an additive causal mask of ``-inf`` (nn.Transformer's)."""

    def __init__(self) -> None:
        super().__init__(causal=True)
        self.register_buffer("additive", nn.Transformer.generate_square_subsequent_mask(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.additive)
        return self.proj(y.transpose(1, 2).reshape(b, n, c))


@pytest.mark.parametrize("calibrated", [True, False], ids=["calib_loader", "first_batch"])
def test_qat_under_an_inf_mask_keeps_finite_gradients_and_derived_qparams(calibrated: bool) -> None:
    # The mask's and masked scores' quantizers learned a TQT threshold like any other: its
    # gradient over the -inf fill was NaN, and one optimizer step made the model NaN.
    model = InfMaskedAttention().eval()
    x = torch.randn(16, 6, 8, generator=torch.Generator().manual_seed(1))
    q = ModelQuantizer("xint8", quiet=True)
    qat = q.prepare_qat(model, x[:1], calib_loader=[x] if calibrated else None)
    optimizer = torch.optim.SGD(qat.parameters(), lr=1e-2)
    for _ in range(2):
        loss = qat(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in qat.parameters() if p.grad is not None)
        optimizer.step()
    frozen = q.freeze(qat.eval())
    with torch.no_grad():
        assert torch.isfinite(frozen(x)).all()
