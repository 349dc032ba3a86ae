"""check: each rule fires on a model that breaks it and stays silent on one that meets it."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from builders import GraphBuilder, QDQWriter, activation_net, conv_chain, mobile_block, ort_run, quantize, random_inputs

from quant_core.onnx_qdq.reader import QDQGraph
from quant_npu.check import check
from quant_npu.legalize import legalize_model
from quant_npu.profile import NPUProfile
from quant_npu.sim import simulate


def rules(model, target=None) -> dict[str, int]:
    return check(model, target).counts()


def conv_model(ipos: int, wpos: int, opos: int, bias: np.ndarray | None = None, bpos: int = 0, follow: str | None = None,
               kernel: int = 3, stride: int = 1) -> object:  # fmt: skip
    w = QDQWriter()
    x = w.quantize("x", ipos)
    inputs = [x, w.constant(np.ones((4, 3, kernel, kernel), np.int8), wpos)]
    if bias is not None:
        inputs.append(w.constant(bias, bpos))
    y = w.op("Conv", inputs, "conv", kernel_shape=[kernel, kernel], strides=[stride, stride])
    if follow == "LeakyRelu":
        y = w.op("LeakyRelu", [w.quantize(y, opos)], "leaky", alpha=0.1015625)
    return w.model([("x", ["N", 3, 8, 8])], [w.quantize(y, opos)])


def test_xint8_output_breaks_only_the_bias_format() -> None:
    # quant_onnx's xint8 writes int32 biases at ipos + wpos; the default target stores int8 at their own position
    assert rules(quantize(conv_chain())) == {"bias_format": 7}
    assert rules(quantize(conv_chain()), "xint8_int32_bias") == {}
    assert rules(quantize(conv_chain(), encoding="as_spec"), "xint8_int32_bias") == {}


def test_global_pool_positions_must_match() -> None:
    counts = rules(quantize(mobile_block()), "xint8_int32_bias")
    assert counts == {"shared_position": 1}


def test_a8w8_is_named_as_not_an_npu_config() -> None:
    counts = rules(quantize(conv_chain(), "a8w8"))
    assert {"symmetric", "power_of_two", "per_channel"} <= set(counts)
    assert all(v.fixable for v in check(quantize(conv_chain(), "a8w8")).violations)


@pytest.mark.parametrize(
    ("ipos", "wpos", "opos", "expected"), [(5, 7, 4, {}), (5, 7, -5, {"shift_cut": 1}), (2, 1, 4, {"shift_cut": 1})]
)
def test_shift_cut(ipos: int, wpos: int, opos: int, expected: dict) -> None:
    assert rules(conv_model(ipos, wpos, opos), "xint8_int32_bias") == expected


def test_shift_bias_and_its_leaky_relu_bound() -> None:
    bias = np.array([1, -2, 3, 0], np.int8)
    # shift_cut = 5 + 7 - 4 = 8: shift_bias must lie in [min(0, 8 - 16), 15] = [-8, 15]
    assert rules(conv_model(5, 7, 4, bias, bpos=6)) == {}
    assert rules(conv_model(5, 7, 4, bias, bpos=-4)) == {"shift_bias": 1}  # 16
    assert rules(conv_model(5, 7, 4, bias, bpos=21)) == {"shift_bias": 1}  # -9
    assert rules(conv_model(5, 7, 4, bias, bpos=13)) == {}  # -1
    assert rules(conv_model(5, 7, 4, bias, bpos=13, follow="LeakyRelu")) == {"shift_bias": 1, "fused_position": 1}
    assert rules(conv_model(5, 7, 4, bias, bpos=-4), "dpu") == {}  # older DPUs allow 16


def test_bias_format_rules() -> None:
    int32 = np.array([100, -200, 3, 0], np.int32)
    assert rules(conv_model(5, 7, 4, int32, bpos=12)) == {"bias_format": 1}
    assert rules(conv_model(5, 7, 4, int32, bpos=12), "xint8_int32_bias") == {}
    assert rules(conv_model(5, 7, 4, int32, bpos=11), "xint8_int32_bias") == {"bias_format": 1}


def test_engine_limits() -> None:
    assert rules(conv_model(5, 7, 4, kernel=9), "xint8_int32_bias") == {"engine_limit": 1}
    assert rules(conv_model(5, 7, 4, stride=3), "xint8_int32_bias") == {"engine_limit": 1}


def add_model(positions: tuple[int, int], opos: int, op: str = "Add") -> object:
    w = QDQWriter()
    a, b = w.quantize("a", positions[0]), w.quantize("b", positions[1])
    return w.model([("a", [1, 4]), ("b", [1, 4])], [w.quantize(w.op(op, [a, b], "op"), opos)])


@pytest.mark.parametrize(
    ("positions", "opos", "expected"),
    [
        ((5, 3), 3, {}),
        ((12, 3), 3, {"shift_read": 1}),  # 9 > 7
        ((5, 3), 11, {"shift_write": 1}),  # 3 - 11 = -8
        ((5, 3), -23, {"shift_write": 1}),  # 26
    ],
)
def test_add_shifts(positions: tuple[int, int], opos: int, expected: dict) -> None:
    assert rules(add_model(positions, opos)) == expected
    assert rules(add_model(positions, opos, "Sub")) == expected


def test_add_position_sharing_is_a_field() -> None:
    assert rules(add_model((5, 3), 3), NPUProfile(add_inputs_share_position=True)) == {"shared_position": 1}


def test_mul_shift() -> None:
    assert rules(add_model((5, 3), 4, "Mul")) == {}
    assert rules(add_model((5, 3), 9, "Mul")) == {"mul_shift": 1}  # -1


def test_unsupported_and_float_ops() -> None:
    w = QDQWriter()
    y = w.op("Sigmoid", [w.quantize("x", 4)], "sig")
    z = w.op("Relu", [y], "relu")  # reads the float Sigmoid output
    counts = rules(w.model([("x", [1, 4])], [w.quantize(z, 4)]))
    assert counts == {"unsupported_op": 1, "not_quantized": 2}


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Concat"])
def test_a_float_constant_operand_is_not_quantized(op: str) -> None:
    """A float constant an Add/Mul/Concat reads is float arithmetic: the device cannot run
    it and the simulator refuses it, so check must not pass it (a Clip bound, a shape or a
    Conv weight has its own rule)."""
    w = QDQWriter()
    w.inits["half"] = np.full((1, 3, 1, 1), 0.5, np.float32)
    y = w.op(op, [w.quantize("x", 4), "half"], "node", **({"axis": 1} if op == "Concat" else {}))
    model = w.model([("x", [1, 3, 2, 2])], [w.quantize(y, 4)])
    result = check(model)
    assert result.counts() == {"not_quantized": 1}
    assert "'half'" in result.violations[0].message and not result.violations[0].fixable
    w = QDQWriter()
    y = w.op(op, [w.quantize("x", 4), w.constant(np.full((1, 3, 1, 1), 8, np.int8), 4)], "node",
             **({"axis": 1} if op == "Concat" else {}))  # fmt: skip
    assert rules(w.model([("x", [1, 3, 2, 2])], [w.quantize(y, 4)])) == {}


def test_non_power_of_two_and_asymmetric_activations() -> None:
    w = QDQWriter()
    x = w.quantize("x", 0, scale=0.3)
    counts = rules(w.model([("x", [1, 4])], [w.quantize(w.op("Relu", [x], "relu"), 4)]))
    assert counts == {"power_of_two": 1}


def test_hard_sigmoid_rules() -> None:
    def model(ipos: int, opos: int, alpha: float = 1 / 6) -> object:
        w = QDQWriter()
        y = w.op("HardSigmoid", [w.quantize("x", ipos)], "hsig", alpha=alpha, beta=0.5)
        return w.model([("x", [1, 4])], [w.quantize(y, opos)])

    target = NPUProfile(ops=[*NPUProfile().ops, "HardSigmoid"])
    assert rules(model(4, 7), target) == {}
    assert rules(model(-1, 7), target) == {"hard_sigmoid": 1}
    assert rules(model(4, 6), target) == {"hard_sigmoid": 1}
    assert rules(model(0, 15), target) == {"hard_sigmoid": 1}  # shift 14 + 0 - 15 < 0
    assert rules(model(4, 7, alpha=0.2), target) == {"unsupported_attribute": 1}
    assert rules(model(4, 7)) == {}  # in the DPU tables and Quark's NPU rules
    without = NPUProfile(ops=NPUProfile().ops - {"HardSigmoid"})
    assert rules(model(4, 7), without) == {"unsupported_op": 1}


def test_activation_net_violations() -> None:
    counts = rules(quantize(activation_net()), "xint8_int32_bias")
    # LeakyRelu 0.1 runs as 26/256, it is fused into its Conv behind a QDQ pair; pools in/out differ
    assert counts["leaky_relu_alpha"] == 1 and counts["fused_position"] == 1
    assert set(counts) <= {"leaky_relu_alpha", "fused_position", "shared_position"}


def test_an_average_the_device_does_not_divide_alike_is_refused() -> None:
    """ONNX divides a window over padding by its real pixels (``count_include_pad=0``) and
    a ``ceil_mode`` window past the end by its part inside; the device divides every window
    by the kernel's size, so the simulator would compute another function."""
    counts = rules(quantize(activation_net(count_include_pad=0)), "xint8_int32_bias")
    assert counts["unsupported_attribute"] == 1
    pooled = activation_net()
    for node in pooled.graph.node:
        if node.op_type == "AveragePool":  # 8 + 2 pads at stride 2: ceil_mode adds a fifth window
            kept = [a for a in node.attribute if a.name != "strides"]
            del node.attribute[:]
            node.attribute.extend([*kept, onnx.helper.make_attribute("strides", [2, 2])])
            node.attribute.append(onnx.helper.make_attribute("ceil_mode", 1))
    assert rules(quantize(pooled), "xint8_int32_bias")["unsupported_attribute"] == 1


@pytest.mark.parametrize(("size", "kernel", "pads", "refused"), [(8, 2, 0, False), (9, 3, 1, False), (7, 2, 0, True)])
def test_ceil_mode_is_refused_only_where_it_adds_a_window(size: int, kernel: int, pads: int, refused: bool) -> None:
    """Where every window fits (a ResNet-D shortcut's 2x2 pool at stride 2 on even sizes,
    ``ceil_mode=1, count_include_pad=0`` as PyTorch writes it), ceil_mode changes nothing:
    the model passes and the simulator gives onnxruntime's codes; a window past the end
    is refused."""
    b = GraphBuilder(3)
    conv = b.conv(b.input("x", ["N", 4, size, size]), 4, 4)
    pool = b.node("AveragePool", [conv], kernel_shape=[kernel] * 2, strides=[2, 2], pads=[pads] * 4, ceil_mode=1,
                  count_include_pad=int(pads > 0))  # fmt: skip
    model = b.model([pool], rank=4)
    result = legalize_model(quantize(model), "xint8")
    assert result.remaining.counts() == ({"unsupported_attribute": 1} if refused else {})
    if not refused and kernel == 2:  # 1/4: exact
        x = random_inputs(model, 16)
        (got,) = simulate(result.model, x, rounding="onnx", quiet=True).values()
        np.testing.assert_array_equal(got, ort_run(result.model, x)[0])


def test_check_reads_the_file_without_changing_it(tmp_path) -> None:
    model = quantize(conv_chain())
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString())
    before = path.read_bytes()
    result = check(path)
    assert path.read_bytes() == before
    assert not result.ok and result.to_dict()["counts"] == {"bias_format": 7}
    assert "7 violation(s) of target 'xint8' (7 fixable by legalize): bias_format 7" in result.format_text()


def test_qdq_view_of_both_encodings() -> None:
    for encoding, dtype in (("x86_uint8", np.uint8), ("as_spec", np.int8)):
        qdq = QDQGraph(quantize(conv_chain(), encoding=encoding))
        activations = [qdq.tensors[k] for k in qdq.activation_keys()]
        assert activations and all(t.numpy_dtype == dtype and t.is_symmetric for t in activations)
        assert all(t.value_range == (-128, 127) and t.position is not None for t in activations)
        conv = next(n for n in qdq.compute_nodes if n.op_type == "Conv")
        weight = qdq.tensors[conv.data_inputs[1]]
        assert weight.is_constant and weight.numpy_dtype == np.int8 and weight.position is not None


@pytest.mark.parametrize(("size", "refused"), [(8, False), (7, True)])
def test_same_padding_is_counted_only_where_it_pads(size: int, refused: bool) -> None:
    """``auto_pad=SAME_UPPER`` with the default ``count_include_pad=0`` pads nothing where
    the stride divides the size: every window is whole, ONNX's average is the device's."""
    b = GraphBuilder(3)
    conv = b.conv(b.input("x", ["N", 4, size, size]), 4, 4)
    model = b.model([b.node("AveragePool", [conv], kernel_shape=[2, 2], strides=[2, 2], auto_pad="SAME_UPPER")], rank=4)
    result = legalize_model(quantize(model), "xint8")
    assert result.remaining.counts() == ({"unsupported_attribute": 1} if refused else {})
    if not refused:
        x = random_inputs(model, 16)
        (got,) = simulate(result.model, x, rounding="onnx", quiet=True).values()
        np.testing.assert_array_equal(got, ort_run(result.model, x)[0])
