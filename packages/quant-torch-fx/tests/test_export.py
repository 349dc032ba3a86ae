"""QDQ ONNX export, checked with onnx's reference evaluator (no onnxruntime here)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from models import conv_bn_net, images
from onnx import TensorProto, numpy_helper
from onnx.reference import ReferenceEvaluator

import quant_torch_fx.export
from quant_torch_fx import ModelQuantizer
from quant_torch_fx.export import onnx_model
from quant_torch_fx.prepare import activation_quantizers

EXAMPLE = torch.randn(1, 3, 8, 8)


@pytest.fixture(scope="module", params=["a8w8", "xint8"])
def frozen(request: pytest.FixtureRequest) -> tuple[str, torch.nn.Module]:
    q = ModelQuantizer(request.param, quiet=True)
    return request.param, q.freeze(q.quantize_model(conv_bn_net(), EXAMPLE, images(3)))


def _inits(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in model.graph.initializer}


def _assert_within_one_output_step(
    proto: onnx.ModelProto, frozen: torch.nn.Module, x: torch.Tensor, output: str | None = None
) -> np.ndarray:
    """Run ``proto`` with onnx's reference evaluator on ``x`` and check it against the frozen
    model within one step of its output quantizer (``output``, or the last one); returns the
    evaluator's output."""
    (got,) = ReferenceEvaluator(proto).run(None, {"input": x.numpy()})
    with torch.no_grad():
        expected = frozen(x).numpy()
    quantizers = list(activation_quantizers(frozen))
    fq = dict(quantizers)[output] if output is not None else quantizers[-1][1]
    step = float(fq.current_qparams().scale)
    assert got.shape == expected.shape
    assert np.max(np.abs(got - expected)) <= step * (1 + 1e-6)
    return got


def test_weights_are_integer_initializers_and_bias_is_int32_at_the_product_scale(frozen) -> None:
    _preset, model = frozen
    proto = onnx_model(model, (EXAMPLE,))
    inits = _inits(proto)
    producers = {out: n for n in proto.graph.node for out in n.output}
    weighted = [n for n in proto.graph.node if n.op_type in ("Conv", "Gemm", "MatMul")]
    assert [n.op_type for n in weighted] == ["Conv", "Conv", "Gemm"]
    for node in weighted:
        x_dq, w_dq = producers[node.input[0]], producers[node.input[1]]
        assert x_dq.op_type == "DequantizeLinear" and w_dq.op_type == "DequantizeLinear"
        assert inits[w_dq.input[0]].data_type == TensorProto.INT8
        b_dq = producers[node.input[2]]
        assert b_dq.op_type == "DequantizeLinear" and inits[b_dq.input[0]].data_type == TensorProto.INT32
        in_scale = numpy_helper.to_array(inits[x_dq.input[1]])
        w_scale = numpy_helper.to_array(inits[w_dq.input[1]])
        b_scale = numpy_helper.to_array(inits[b_dq.input[1]])
        np.testing.assert_array_equal(b_scale, (in_scale * w_scale).astype(np.float32))
        users = [n for n in proto.graph.node if node.output[0] in n.input]
        assert [u.op_type for u in users] == [
            "QuantizeLinear"
        ]  # each conv writes one Q (ReLU/Clip absorbed or kept after)
    assert all(o.type.tensor_type.elem_type == TensorProto.FLOAT for o in proto.graph.output)


def test_activations_are_uint8_for_x86_or_as_the_spec_says(frozen) -> None:
    preset, model = frozen
    x86 = onnx_model(model, (EXAMPLE,))
    as_spec = onnx_model(model, (EXAMPLE,), activation_encoding="as_spec")
    for proto, expected in (
        (x86, TensorProto.UINT8),
        (as_spec, TensorProto.INT8 if preset == "xint8" else TensorProto.UINT8),
    ):
        inits = _inits(proto)
        quantize = [n for n in proto.graph.node if n.op_type == "QuantizeLinear"]
        assert quantize and {inits[n.input[2]].data_type for n in quantize} == {expected}


def test_reference_evaluator_matches_the_frozen_model_within_one_output_step(frozen) -> None:
    _preset, model = frozen
    proto = onnx_model(model, (EXAMPLE,), opset=19)  # the reference evaluator's DequantizeLinear starts at 19
    x = images(1, batch=5, seed=11)[0]  # another batch size than the example's
    got = _assert_within_one_output_step(proto, model, x, "linear")
    assert got.shape == (5, 5)


def test_export_writes_atomically_and_nothing_on_failure(frozen, tmp_path: Path, monkeypatch) -> None:
    _preset, model = frozen
    q = ModelQuantizer(quiet=True)
    target = q.export_onnx(model, EXAMPLE, tmp_path / "m.onnx")
    onnx.checker.check_model(onnx.load(target))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]

    def broken(*_args, **_kwargs):
        raise RuntimeError("exporter failed")

    monkeypatch.setattr(quant_torch_fx.export, "emit_onnx", broken)
    with pytest.raises(RuntimeError, match="exporter failed"):
        q.export_onnx(model, EXAMPLE, tmp_path / "other.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_unfrozen_models_are_frozen_for_export(tmp_path: Path) -> None:
    q = ModelQuantizer("a8w8", quiet=True)
    qmodel = q.quantize_model(conv_bn_net(), EXAMPLE, images(2))
    path = q.export_onnx(qmodel, EXAMPLE, tmp_path / "m.onnx")
    assert any(n.op_type == "QuantizeLinear" for n in onnx.load(path).graph.node)
    with pytest.raises(ValueError, match="not frozen"):
        onnx_model(qmodel, (EXAMPLE,))


def test_excluded_modules_export_float() -> None:
    q = ModelQuantizer("a8w8", exclude_modules=["head*"], quiet=True)
    frozen = q.freeze(q.quantize_model(conv_bn_net(), EXAMPLE, images(2)))
    proto = onnx_model(frozen, (EXAMPLE,))
    producers = {out: n for n in proto.graph.node for out in n.output}
    gemm = next(n for n in proto.graph.node if n.op_type == "Gemm")
    assert gemm.input[1] not in producers  # a float weight initializer
    assert not any(n.op_type == "QuantizeLinear" and n.input[0] == gemm.output[0] for n in proto.graph.node)


def test_16_bit_activations_export_as_uint16_and_run_as_the_frozen_model() -> None:
    # The TorchScript exporter cannot type uint16; the export must still write it.
    q = ModelQuantizer("a16w8", quiet=True)
    model = q.freeze(q.quantize_model(conv_bn_net(), EXAMPLE, images(3)))
    proto = onnx_model(model, (EXAMPLE,))
    onnx.checker.check_model(proto, full_check=True)
    inits = _inits(proto)
    quantize = [n for n in proto.graph.node if n.op_type == "QuantizeLinear"]
    assert quantize and {inits[n.input[2]].data_type for n in quantize} == {TensorProto.UINT16}
    assert {n.domain for n in proto.graph.node} == {""}
    assert [o.domain for o in proto.opset_import] == [""] and proto.opset_import[0].version >= 21
    assert all(t.data_type != TensorProto.INT32 or "bias" in t.name for t in proto.graph.initializer)
    x = images(1, batch=5, seed=11)[0]
    _assert_within_one_output_step(proto, model, x, "linear")


class _ChannelSplit(torch.nn.Module):
    """ShuffleNet/GhostNet-style: one tensor both split (a Shape read) and sliced."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.chunk(x, 2, 1)[1] * x[:, :1]


def test_shape_reads_keep_the_graph_in_topological_order() -> None:
    torch.manual_seed(0)
    q = ModelQuantizer("a8w8", quiet=True)
    example = torch.randn(1, 8, 4, 4)
    frozen = q.freeze(q.quantize_model(_ChannelSplit().eval(), example, [torch.randn(32, 8, 4, 4)]))
    proto = onnx_model(frozen, (example,), opset=19)
    onnx.checker.check_model(proto, full_check=True)
    x = torch.randn(3, 8, 4, 4)
    _assert_within_one_output_step(proto, frozen, x)


def test_a_model_never_quantized_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.ReLU()).eval()
    with pytest.raises(ValueError, match="no quantized graph"):
        ModelQuantizer("a8w8", quiet=True).export_onnx(net, EXAMPLE, tmp_path / "m.onnx")
    with pytest.raises(ValueError, match="no quantized graph"):
        onnx_model(net, (EXAMPLE,))
    assert not list(tmp_path.iterdir())


class _GatedPool(torch.nn.Module):
    """PReLU, ``1 - x`` (aten.rsub), adaptive max pooling and ``expand_as``: ops the
    planner has rules for, which the ONNX backend quantizes too."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.act = torch.nn.PReLU(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.conv(x))
        gate = torch.nn.functional.adaptive_max_pool2d(y * (1.0 - torch.sigmoid(y)), 1)
        pooled = torch.nn.functional.adaptive_max_pool2d(y, 2)
        return pooled + gate.expand_as(pooled)


def test_prelu_rsub_adaptive_max_pool_and_expand_as_are_quantized_and_export() -> None:
    torch.manual_seed(0)
    q = ModelQuantizer("xint8", quiet=True)
    qmodel = q.quantize_model(_GatedPool().eval(), EXAMPLE, [torch.randn(32, 3, 8, 8)])
    assert q.report(qmodel)["0"]["float_nodes"] == []
    frozen = q.freeze(qmodel)
    proto = onnx_model(frozen, (EXAMPLE,), opset=19)
    producers = {out: n for n in proto.graph.node for out in n.output}
    for node in proto.graph.node:
        if node.op_type in ("PRelu", "Sub", "MaxPool", "GlobalMaxPool"):
            assert producers[node.input[0]].op_type == "DequantizeLinear", node.name
    x = torch.randn(3, 3, 8, 8)
    _assert_within_one_output_step(proto, frozen, x)


def test_a16w8_linear_over_tokens_reads_its_weight_in_the_form_matmulnbits_refuses() -> None:
    # onnxruntime would fold Transpose(DequantizeLinear(W)) and rewrite the MatMul into
    # MatMulNBits, which quantizes the 16-bit input to int8 on the fly.
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 8)).eval()
    q = ModelQuantizer("a16w8", quiet=True)
    frozen = q.freeze(q.quantize_model(net, torch.zeros(1, 4, 16), [torch.randn(32, 4, 16)]))
    proto = onnx_model(frozen, (torch.zeros(1, 4, 16),))
    producers = {out: n for n in proto.graph.node for out in n.output}
    (matmul,) = [n for n in proto.graph.node if n.op_type == "MatMul"]
    dq = producers[matmul.input[1]]
    assert dq.op_type == "DequantizeLinear" and {a.name: a.i for a in dq.attribute} == {"axis": -1}
    assert list(_inits(proto)[dq.input[0]].dims) == [16, 8]
    assert not any(n.op_type == "Transpose" for n in proto.graph.node)
    x = torch.randn(3, 4, 16)
    _assert_within_one_output_step(proto, frozen, x)
