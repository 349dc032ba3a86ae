"""QDQ ONNX export, checked with onnx's reference evaluator (no onnxruntime here)."""

from __future__ import annotations

import copy
from pathlib import Path

import export_models
import numpy as np
import onnx
import pytest
import torch
from models import conv_bn_net, images
from onnx import TensorProto, numpy_helper
from onnx.reference import ReferenceEvaluator

import quant_torch_fx.export
from quant_core.errors import ConfigError
from quant_torch_fx import ModelQuantizer
from quant_torch_fx.export import onnx_model
from quant_torch_fx.export_fidelity import first_departure, node_by_node, output_tolerance, record, reference_runner
from quant_torch_fx.export_form import export_form
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


def _tolerance(proto: onnx.ModelProto) -> float:
    """One input step through the last layer (the logits are float)."""
    tolerance = output_tolerance(proto)
    assert tolerance is not None
    return tolerance


def _assert_float_output_matches(proto: onnx.ModelProto, frozen: torch.nn.Module, x: torch.Tensor) -> np.ndarray:
    """The output of ``proto`` is float (the result tail: the planner leaves what follows the
    last layer float outside power-of-two formats): every quantized tensor of the file run by
    onnx's reference evaluator on ``x`` within one step of the frozen model's, and the output,
    which the last layer computes in float from those tensors, equal to it up to float
    rounding; returns the evaluator's output."""
    fidelity = node_by_node(proto, frozen, (x,), reference_runner)
    assert fidelity.chain and not fidelity.unmatched
    assert max(fidelity.chain.values()) <= 1 and max(fidelity.isolated.values()) <= 1
    with torch.no_grad():
        expected = frozen(x).numpy()
    assert fidelity.output.shape == expected.shape
    assert np.max(np.abs(fidelity.output - expected)) <= _tolerance(proto)
    return fidelity.output


def test_weights_are_integer_initializers_and_bias_is_int32_at_the_product_scale(frozen) -> None:
    preset, model = frozen
    proto = onnx_model(model, (EXAMPLE,))
    inits = _inits(proto)
    outputs = {o.name for o in proto.graph.output}
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
        if node.op_type == "Gemm" and preset == "a8w8":  # the logits: the result tail, float
            assert users == [] and node.output[0] in outputs
            continue
        # each layer writes one Q (ReLU/Clip absorbed or kept after)
        assert [u.op_type for u in users] == ["QuantizeLinear"]
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
    preset, model = frozen
    proto = onnx_model(model, (EXAMPLE,), opset=19)  # the reference evaluator's DequantizeLinear starts at 19
    x = images(1, batch=5, seed=11)[0]  # another batch size than the example's
    if preset == "xint8":  # power-of-two: the logits keep their 8 bits
        got = _assert_within_one_output_step(proto, model, x, "linear")
    else:  # the logits are float: the quantized tensors before them are compared
        got = _assert_float_output_matches(proto, model, x)
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
    _assert_float_output_matches(proto, model, x)  # the uint16 tensors within one step, the logits float


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


# --- the emitter: model families, naming, determinism, errors ---------------------------------------
def _frozen_family(family: str, preset: str = "a8w8") -> torch.nn.Module:
    calibration = export_models.images(4)
    q = ModelQuantizer(preset, quiet=True)
    return q.freeze(q.quantize_model(export_models.build(family), calibration[0][:1], calibration))


@pytest.mark.parametrize("family", ["resnet", "mobilenetv2", "mobilenetv3", "mixnet", "poolformer", "vit", "swin"])
def test_model_families_compute_the_frozen_model_node_by_node(family: str) -> None:
    frozen = _frozen_family(family)
    proto = onnx_model(frozen, (export_models.images(1, batch=1)[0],), opset=19)
    onnx.checker.check_model(proto, full_check=True)
    x = export_models.images(1, batch=3, seed=9)[0]
    fidelity = node_by_node(proto, frozen, (x,), reference_runner)
    assert not fidelity.unmatched and len(fidelity.chain) >= 12  # resnet's 12; its logits are float
    assert max(fidelity.isolated.values()) <= 1  # each quantized tensor from the frozen model's own inputs
    assert max(fidelity.chain.values()) <= 1  # and end to end
    with torch.no_grad():
        expected = frozen(x).numpy()
    assert np.array_equal(fidelity.output.argmax(-1), expected.argmax(-1))


def test_first_departure_names_the_first_tensor_whose_codes_differ_and_its_distance_from_the_tie() -> None:
    frozen = _frozen_family("mobilenetv2")
    proto = onnx_model(frozen, (export_models.images(1, batch=1)[0],), opset=19)
    x = export_models.images(1, batch=2, seed=9)[0]
    assert first_departure(proto, frozen, (x,)) is None  # this input puts no value at a tie
    quantize = [n for n in proto.graph.node if n.op_type == "QuantizeLinear"][3]
    target, before = quantize.output[0], quantize.input[0]
    scale = float(numpy_helper.to_array(_inits(proto)[quantize.input[1]]))
    zero = int(numpy_helper.to_array(_inits(proto)[quantize.input[2]]))
    changed: dict[str, np.ndarray] = {}

    def one_code_up(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        # a runtime that rounds one value of the fourth quantized tensor up, its value before
        # rounding at the half step between the two codes
        got = reference_runner(model, feeds)
        changed["codes"] = got[target].copy()
        codes, value = got[target].copy(), got[before].copy()
        element = int(np.argmax(codes.reshape(-1) < 255))
        codes.reshape(-1)[element] += 1
        value.reshape(-1)[element] = (int(codes.reshape(-1)[element]) - 0.5 - zero) * scale
        changed["element"] = np.array(element)
        return got | {target: codes, before: value}

    departure = first_departure(proto, frozen, (x,), one_code_up)
    assert departure is not None
    assert (departure.tensor, departure.elements, departure.steps) == (target, 1, 1)
    seen, _ = record(frozen, (x,), keep_before=True)
    frozen_side = next(r for r in seen if np.array_equal(r.codes, changed["codes"]))
    assert frozen_side.before is not None
    frozen_value = float(frozen_side.before.reshape(-1)[int(changed["element"])])
    half = int(changed["codes"].reshape(-1)[int(changed["element"])]) - zero + 0.5
    assert departure.tie_distance == pytest.approx(abs(frozen_value / scale - half), abs=1e-4)


def test_linear_over_tokens_is_a_matmul_reading_its_int8_codes_behind_a_dequantize() -> None:
    frozen = _frozen_family("vit")
    proto = onnx_model(frozen, (export_models.images(1, batch=1)[0],))
    inits = _inits(proto)
    producers = {out: n for n in proto.graph.node for out in n.output}
    readers = {name: [n for n in proto.graph.node if name in n.input] for n in proto.graph.node for name in n.output}
    weighted = []
    for node in proto.graph.node:
        if node.op_type != "MatMul" or node.input[1] not in producers:
            continue
        dq = producers[node.input[1]]
        if dq.op_type != "DequantizeLinear" or dq.input[0] not in inits:
            continue  # attention's activation x activation MatMuls
        weighted.append(node)
        codes = inits[dq.input[0]]
        assert codes.data_type == TensorProto.INT8 and {a.name: a.i for a in dq.attribute} == {"axis": 1}
        (add,) = readers[node.output[0]]  # the bias: int32 at input scale x weight scale
        bias_dq = producers[add.input[1]]
        assert add.op_type == "Add" and inits[bias_dq.input[0]].data_type == TensorProto.INT32
        x_scale = numpy_helper.to_array(inits[producers[node.input[0]].input[1]])
        w_scale = numpy_helper.to_array(inits[dq.input[1]])
        np.testing.assert_array_equal(
            numpy_helper.to_array(inits[bias_dq.input[1]]), (x_scale * w_scale).astype(np.float32)
        )
    assert len(weighted) == 8  # two blocks: qkv, proj, fc1, fc2
    assert list(inits["blocks.0.fc1.weight"].dims) == [16, 32]  # stored [in, out] under its state_dict name
    weight_dqs = {
        n.output[0] for n in proto.graph.node if n.op_type == "DequantizeLinear" and n.input[0].endswith("weight")
    }
    assert not [n for n in proto.graph.node if n.op_type == "Transpose" and n.input[0] in weight_dqs]
    (head,) = [n for n in proto.graph.node if n.op_type == "Gemm"]  # the 2-D head
    assert {a.name: a.i for a in head.attribute} == {"transB": 1}


def test_the_same_model_gives_the_same_bytes_with_names_from_the_model() -> None:
    frozen = _frozen_family("swin")
    example = (export_models.images(1, batch=1)[0],)
    first = onnx_model(frozen, example).SerializeToString()
    assert onnx_model(copy.deepcopy(frozen), example).SerializeToString() == first
    proto = onnx.load_from_string(first)
    names = {t.name for t in proto.graph.initializer}
    assert {"patch.weight", "blocks.0.attn.qkv.weight", "blocks.1.mlp.2.bias_encoded"} <= names  # state_dict paths
    assert {"conv2d", "layer_norm", "roll", "linear"} <= {n.name for n in proto.graph.node}  # FX node names


class _CumulativeHead(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cumprod(x, 1)  # ONNX has no cumulative product


def test_an_op_without_translation_names_its_node_op_and_module() -> None:
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), _CumulativeHead()).eval()
    q = ModelQuantizer("a8w8", quiet=True)
    frozen = q.freeze(q.quantize_model(net, EXAMPLE, images(1)))
    with pytest.raises(
        ValueError, match=r"^export: node 'cumprod' \(aten\.cumprod\.default in module '1'\): no ONNX"
    ) as info:
        onnx_model(frozen, (EXAMPLE,))
    assert "\n" not in str(info.value)


class _Regions(torch.nn.Module):
    """Two quantized regions and float Python between them (pooling, a scale, a concat)."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU())
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.backbone(x)
        pooled = torch.cat([features.mean((2, 3)), features.amax((2, 3)) * 0.5], 1)
        return self.head(pooled)


def test_a_model_quantized_by_regions_exports_with_the_python_around_them() -> None:
    torch.manual_seed(0)
    q = ModelQuantizer("a8w8", regions=["backbone", "head"], quiet=True)
    frozen = q.freeze(q.quantize_model(_Regions().eval(), EXAMPLE, images(3)))
    proto = onnx_model(frozen, (EXAMPLE,), opset=19)
    assert {"ReduceMean", "ReduceMax", "Concat", "Gemm", "Conv"} <= {n.op_type for n in proto.graph.node}
    x = images(1, batch=5, seed=11)[0]
    fidelity = node_by_node(proto, frozen, (x,), reference_runner)
    assert max(fidelity.chain.values()) <= 1 and max(fidelity.isolated.values()) <= 1


class _TwoInTwoOut(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.fc = torch.nn.Linear(4 + 2, 3)

    def forward(self, image: torch.Tensor, extra: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = torch.relu(self.conv(image))
        pooled = features.mean((2, 3))
        return self.fc(torch.cat([pooled, extra], 1)), features


def test_multi_input_multi_output_models_export_with_their_names() -> None:
    torch.manual_seed(0)
    example = (torch.randn(1, 3, 8, 8), torch.randn(1, 2))
    data = [(torch.randn(8, 3, 8, 8), torch.randn(8, 2)) for _ in range(3)]
    q = ModelQuantizer("a8w8", quiet=True)
    frozen = q.freeze(q.quantize_model(_TwoInTwoOut().eval(), example, data))
    default = onnx_model(frozen, example, opset=19)
    assert [i.name for i in default.graph.input] == ["input_0", "input_1"]
    assert [o.name for o in default.graph.output] == ["output_0", "output_1"]
    named = onnx_model(frozen, example, opset=19, input_names=["image", "extra"], output_names=["logits", "features"])
    assert [o.name for o in named.graph.output] == ["logits", "features"]
    inputs = (torch.randn(5, 3, 8, 8), torch.randn(5, 2))
    got = ReferenceEvaluator(named).run(None, {"image": inputs[0].numpy(), "extra": inputs[1].numpy()})
    with torch.no_grad():
        expected = frozen(*inputs)
    assert [g.shape for g in got] == [tuple(e.shape) for e in expected]
    # The features are quantized: within one step. The logits are float (the result tail),
    # computed from quantized tensors that must each be within one step: then equal up to rounding.
    step = float(dict(activation_quantizers(frozen))["conv2d"].current_qparams().scale)  # relu(conv)
    assert np.max(np.abs(got[1] - expected[1].numpy())) <= step * (1 + 1e-6)
    fidelity = node_by_node(named, frozen, inputs, reference_runner)
    assert fidelity.chain and not fidelity.unmatched and max(fidelity.chain.values()) <= 1
    assert np.max(np.abs(got[0] - expected[0].numpy())) <= _tolerance(named)


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (
            {"input_names": ["image", "extra", "more"]},
            "input_names: 3 name(s) for 2 tensor input(s); allowed: one per input",
        ),
        (
            {"output_names": ["logits", "features", "x"]},
            "output_names: 3 name(s) for 2 tensor output(s); allowed: one per output",
        ),
        ({"input_names": ["image", "image"]}, "input_names: 'image' is given twice; allowed: a unique name per input"),
        ({"output_names": ["y", "y"]}, "output_names: 'y' is given twice; allowed: a unique name per output"),
        (
            {"output_names": ["input_0", "y"]},
            "output_names: 'input_0' is an input's name; allowed: a unique name per output",
        ),
        ({"input_names": ["image", ""]}, "input_names: '' is not allowed; allowed: non-empty strings"),
        ({"output_names": ["", "y"]}, "output_names: '' is not allowed; allowed: non-empty strings"),
        ({"input_names": "image"}, "input_names: 'image' is not allowed; allowed: a list of 2 name(s), one per input"),
    ],
)
def test_input_and_output_names_are_one_unique_non_empty_name_each(
    tmp_path: Path, names: dict[str, object], message: str
) -> None:
    example = (torch.randn(1, 3, 8, 8), torch.randn(1, 2))
    q = ModelQuantizer("a8w8", quiet=True)
    frozen = q.freeze(q.quantize_model(_TwoInTwoOut().eval(), example, [example]))
    with pytest.raises(ConfigError) as error:
        q.export_onnx(frozen, example, tmp_path / "m.onnx", **names)  # type: ignore[arg-type]
    assert str(error.value) == message
    assert not (tmp_path / "m.onnx").exists()


def test_int4_weights_export_at_opset_21() -> None:
    frozen = _frozen_family("resnet", "w4a8")
    proto = onnx_model(frozen, (export_models.images(1, batch=1)[0],))
    onnx.checker.check_model(proto, full_check=True)
    assert proto.opset_import[0].version == 21 and proto.ir_version >= 10
    weights = [t for t in proto.graph.initializer if t.name.endswith("weight_folded") or t.name == "fc.weight"]
    assert weights and {t.data_type for t in weights} == {TensorProto.INT4}
    x = export_models.images(1, batch=3, seed=9)[0]
    fidelity = node_by_node(proto, frozen, (x,), reference_runner)
    assert max(fidelity.isolated.values()) <= 1 and max(fidelity.chain.values()) <= 1


def test_a_fixed_batch_is_written_as_such() -> None:
    frozen = _frozen_family("resnet")
    proto = onnx_model(frozen, (export_models.images(1, batch=2)[0],), dynamic_batch=False)
    dims = [d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim]
    assert dims == [2, 3, 16, 16]


def test_an_excluded_layer_leaves_onnxruntime_nothing_to_quantize() -> None:
    # WeightBiasQuantization would quantize the float weight of a layer that reads a
    # per-tensor DequantizeLinear and feeds a QuantizeLinear: a multi-channel Conv reads a
    # per-channel DequantizeLinear, a Gemm gets its float bias as exact int32 codes. A float
    # head writing the graph output is no such unit and stays as it is.
    calibration = export_models.images(3)
    q = ModelQuantizer("a8w8", exclude_modules=["project.0", "head.0", "head.3"], quiet=True)
    frozen = q.freeze(q.quantize_model(export_models.build("mobilenetv3"), calibration[0][:1], calibration))
    proto = onnx_model(frozen, (calibration[0][:1],), opset=19)
    inits = _inits(proto)
    producers = {out: n for n in proto.graph.node for out in n.output}
    (project,) = [n for n in proto.graph.node if n.op_type == "Conv" and n.input[1] in inits]
    reader = producers[project.input[0]]
    assert reader.op_type == "DequantizeLinear" and {a.name: a.i for a in reader.attribute} == {"axis": 1}
    assert list(inits[reader.input[1]].dims) == [8]
    hidden, head = [n for n in proto.graph.node if n.op_type == "Gemm"]
    for gemm in (hidden, head):
        assert inits[gemm.input[1]].data_type == TensorProto.FLOAT
        assert producers[gemm.input[0]].op_type == "DequantizeLinear"
    bias = producers[hidden.input[2]]
    assert bias.op_type == "DequantizeLinear" and inits[bias.input[0]].data_type == TensorProto.INT32
    assert inits[head.input[2]].data_type == TensorProto.FLOAT  # writes the output: left as it is
    x = export_models.images(1, batch=5, seed=11)[0]
    fidelity = node_by_node(proto, frozen, (x,), reference_runner)
    assert max(fidelity.chain.values()) <= 1
    (got,) = ReferenceEvaluator(proto).run(None, {"input": x.numpy()})
    with torch.no_grad():
        np.testing.assert_allclose(got, frozen(x).numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["mobilenetv3", "swin"])
@pytest.mark.parametrize("preset", ["a8w8", "a16w8", "w4a8"])
def test_the_export_form_computes_the_frozen_model_bit_for_bit(family: str, preset: str) -> None:
    frozen = _frozen_family(family, preset)
    form = export_form(frozen, "x86_uint8")
    x = export_models.images(1, batch=3, seed=9)[0]
    with torch.no_grad():
        assert torch.equal(form.model(x), frozen(x))


class _FixedBatch(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU())
        self.fc = torch.nn.Linear(4 * 64, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(x).reshape(2, -1))  # Python around the region fixes the batch at 2


def test_python_that_fixes_the_batch_size_exports_that_batch_size_with_a_warning() -> None:
    q = ModelQuantizer("a8w8", regions=["body"], quiet=True)
    example = torch.randn(2, 3, 8, 8)
    frozen = q.freeze(q.quantize_model(_FixedBatch().eval(), example, [torch.randn(2, 3, 8, 8) for _ in range(3)]))
    with pytest.warns(UserWarning, match=r"^export: the model fixes its batch size .* batches of 2 only"):
        proto = onnx_model(frozen, (example,))
    assert [d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim] == [2, 3, 8, 8]
