"""legalize: every fixable rule is fixed, the model keeps computing what it computed,
the input is never modified, the same input gives the same bytes."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from builders import QDQWriter, activation_net, conv_chain, mobile_block, ort_run, quantize, random_inputs
from test_check import add_model, conv_model

from quant_core.onnx_qdq.reader import QDQGraph
from quant_core.presets import get_preset, list_presets
from quant_core.qparams import nearest_pow2_fix_pos, pow2_fix_pos
from quant_npu.check import check
from quant_npu.legalize import legalize, legalize_model
from quant_npu.profile import NPUProfile


def sqnr(reference: np.ndarray, value: np.ndarray) -> float:
    noise = float(np.mean((reference - value) ** 2))
    return float("inf") if noise == 0 else 10 * np.log10(float(np.mean(reference**2)) / noise)


@pytest.mark.parametrize("build", [conv_chain, mobile_block, activation_net])
@pytest.mark.parametrize("encoding", ["x86_uint8", "as_spec"])
@pytest.mark.parametrize("target", ["xint8", "xint8_int32_bias", "dpu"])
def test_quant_onnx_output_legalises_and_keeps_its_function(build, encoding: str, target: str) -> None:
    float_model = build()
    model = quantize(float_model, encoding=encoding)
    result = legalize_model(model, target)
    assert result.remaining.ok, result.remaining.format_text()
    x = random_inputs(float_model, 64, seed=7)
    before, after = ort_run(model, x)[0], ort_run(result.model, x)[0]
    assert sqnr(before, after) > 15  # the same network, requantized (int8 biases cost a little)
    stored = {QDQGraph(result.model).tensors[k].numpy_dtype for k in QDQGraph(result.model).activation_keys()}
    assert stored == {np.dtype(np.uint8 if encoding == "x86_uint8" else np.int8)}


def test_changes_name_what_moved() -> None:
    result = legalize_model(quantize(mobile_block()))
    kinds = {c.kind for c in result.changes}
    assert kinds == {"bias", "activation"}
    moved = [c for c in result.changes if c.kind == "activation"]
    assert all("GlobalAveragePool" in c.reason or "Flatten" in c.reason for c in moved)
    data = result.to_dict()
    assert data["ok"] and data["changes_by_kind"]["bias"] == 4


@pytest.mark.parametrize(
    ("model", "rule"),
    [
        (conv_model(5, 7, -5), "shift_cut"),
        (conv_model(2, 1, 4), "shift_cut"),
        (conv_model(5, 7, 4, np.array([1, -2, 3, 0], np.int8), bpos=-4), "shift_bias"),
        (conv_model(5, 7, 4, np.array([1, -2, 3, 0], np.int8), bpos=21), "shift_bias"),
        (add_model((12, 3), 3), "shift_read"),
        (add_model((5, 3), 11), "shift_write"),
        (add_model((5, 3), -23, "Sub"), "shift_write"),
        (add_model((5, 3), 9, "Mul"), "mul_shift"),
    ],
)
def test_each_shift_rule_is_fixed(model: onnx.ModelProto, rule: str) -> None:
    assert rule in check(model).counts()
    result = legalize_model(model)
    assert result.remaining.ok, result.remaining.format_text()


def test_shift_cut_moves_the_weight_position_and_requantizes() -> None:
    model = conv_model(5, 7, -5)  # shift_cut 17
    result = legalize_model(model, "xint8_int32_bias")
    (change,) = [c for c in result.changes if c.kind == "weight"]
    assert (change.before, change.after) == ("int8@7", "int8@6")
    weight = next(t for t in QDQGraph(result.model).tensors.values() if t.is_constant and t.codes.ndim == 4)
    # code 1 at 2**-7 is 0.5 at 2**-6: a tie, rounded to even (the profile's weight rounding)
    assert weight.position == 6 and set(np.unique(weight.codes)) == {0}


def test_a8w8_output_becomes_an_npu_model() -> None:
    model = quantize(conv_chain(), "a8w8")
    result = legalize_model(model)
    assert result.remaining.ok, result.remaining.format_text()
    qdq = QDQGraph(result.model)
    for key in qdq.activation_keys():
        tensor = qdq.tensors[key]
        assert tensor.position is not None and tensor.is_symmetric
    x = random_inputs(conv_chain(), 64, seed=3)
    assert sqnr(ort_run(model, x)[0], ort_run(result.model, x)[0]) > 10


@pytest.mark.parametrize("target", ["xint8", "dpu"])
def test_converted_weights_take_the_planners_nearest_position(target: str) -> None:
    """A float-scale weight converted to the device format gets quant_core's position for
    it, the power of two nearest ``max|w| / 127`` (as the xint8 preset), not the covering
    one; its codes stay within the profile's weight range and the file passes check."""
    model = quantize(conv_chain(), "a8w8")
    result = legalize_model(model, target)
    assert check(result.model, target).ok
    before, after = QDQGraph(model), QDQGraph(result.model)
    qmin = -127 if target == "xint8" else -128
    converted = {c.target for c in result.changes if c.kind == "weight" and c.reason.startswith("device weight format")}
    differing = 0
    for node in model.graph.node:
        if node.name not in converted:
            continue
        key = before.dequantized[node.input[1]]
        largest = float(np.abs(before.tensors[key].real_values()).max())
        weight = after.tensors[key]
        assert weight.position == int(nearest_pow2_fix_pos(largest / 127)), node.name
        assert qmin <= int(weight.codes.min()) and int(weight.codes.max()) <= 127
        differing += weight.position != int(pow2_fix_pos(largest / 127))
    assert differing >= 2  # the case where the rules differ is exercised (4 of conv_chain's 7 layers)


@pytest.mark.parametrize("preset", list_presets())
def test_every_preset_passes_or_is_named(preset: str) -> None:
    config = get_preset(preset).evolve(algorithms=())  # the formats matter here, not AdaRound's rounding
    model = quantize(mobile_block(), config)
    before = check(model)
    if preset.startswith("xint8") or preset == "int8_cnn_cle":
        assert set(before.counts()) <= {"bias_format", "shared_position"}  # NPU presets: formats are right
    else:
        assert {"power_of_two", "symmetric"} & set(before.counts())  # names why it is not an NPU config
    after = legalize_model(model)
    assert after.remaining.ok, after.remaining.format_text()


def test_unfixable_violations_remain_and_are_reported() -> None:
    w = QDQWriter()
    y = w.op("Exp", [w.quantize("x", 4)], "exp")  # no device op, no conversion
    model = w.model([("x", [1, 4])], [w.quantize(y, 2)])
    result = legalize_model(model)
    assert result.remaining.counts() == {"unsupported_op": 1}
    assert "not fixed:" in result.format_text()


def test_leaky_relu_gets_the_device_alpha_and_loses_the_inner_qdq() -> None:
    model = quantize(activation_net())
    result = legalize_model(model, "xint8_int32_bias")
    assert result.remaining.ok
    leaky = next(n for n in result.model.graph.node if n.op_type == "LeakyRelu")
    assert onnx.helper.get_attribute_value(leaky.attribute[0]) == pytest.approx(26 / 256)
    producer = next(n for n in result.model.graph.node if leaky.input[0] in n.output)
    assert producer.op_type == "Conv"  # no QuantizeLinear/DequantizeLinear between them any more
    assert {"leaky_relu_alpha", "fused_qdq"} <= {c.kind for c in result.changes}


def test_input_untouched_output_deterministic_and_never_over_the_input(tmp_path) -> None:
    source = tmp_path / "in.onnx"
    source.write_bytes(quantize(conv_chain(), "a8w8").SerializeToString())
    before = source.read_bytes()
    legalize(source, tmp_path / "a.onnx", report_path=tmp_path / "r.json")
    legalize(source, tmp_path / "b.onnx")
    assert source.read_bytes() == before
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()
    assert '"ok": true' in (tmp_path / "r.json").read_text()
    with pytest.raises(ValueError, match="is the input model"):
        legalize(source, source)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.onnx", "b.onnx", "in.onnx", "r.json"]


def test_conflicting_rules_are_reported_not_looped_forever() -> None:
    # a HardSigmoid input that must be >= 0 while a Concat shares it with a tensor at -3
    w = QDQWriter()
    a, b = w.quantize("a", -3), w.quantize("b", 4)
    c = w.op("Concat", [a, b], "concat", axis=1)
    h = w.op("HardSigmoid", [w.quantize(c, 4)], "hsig", alpha=1 / 6, beta=0.5)
    model = w.model([("a", [1, 2]), ("b", [1, 2])], [w.quantize(h, 7)])
    profile = NPUProfile(ops=[*NPUProfile().ops, "HardSigmoid"])
    result = legalize_model(model, profile)
    assert result.remaining.ok, result.remaining.format_text()  # the group moved to 0: both rules hold


def test_outlier_biases_are_limited_where_the_output_saturates() -> None:
    # one channel's bias (100) is far beyond what the output can hold: on any input that
    # channel saturates, so legalisation may clip it there and give the others a finer position
    w = QDQWriter()
    x = w.quantize("x", 5)
    bias = np.array([100 * 2**10, 3, -5, 7], np.int32)  # int32 at ipos + wpos = 10
    conv = w.op("Conv", [x, w.constant(np.ones((4, 3, 1, 1), np.int8), 5), w.constant(bias, 10)], "conv")
    model = w.model([("x", ["N", 3, 4, 4])], [w.quantize(conv, 4)])
    result = legalize_model(model)
    assert result.remaining.ok
    (change,) = [c for c in result.changes if c.kind == "bias"]
    assert "1 value(s) limited to where the output saturates anyway" in change.reason
    # limited to 127/16 + 4 * 3/32 + 1/16 = 8.375: position 3 (127/8 covers it); 100 would have needed 0
    assert change.after == "int8@3"
    data = np.random.default_rng(0).uniform(-4, 4, (16, 3, 4, 4)).astype(np.float32)
    before, after = ort_run(model, data)[0], ort_run(result.model, data)[0]
    np.testing.assert_array_equal(after[:, 0], before[:, 0])  # the outlier channel: saturated either way
    assert np.all(after[:, 0] == 127 / 16)
