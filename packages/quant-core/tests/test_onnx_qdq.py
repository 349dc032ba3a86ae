"""The ONNX QDQ layer (quant_core.onnx_qdq): importable with onnx alone; the finishing passes
both backends' files go through, checked against onnx's reference evaluator (onnxruntime's
own behaviour is checked in quant-onnx's tests, where it is installed).

Without onnx (the core-only install) the layer refuses to import with the extra to install."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys

import numpy as np
import pytest

HAS_ONNX = importlib.util.find_spec("onnx") is not None


@pytest.mark.skipif(HAS_ONNX, reason="onnx is installed here; the message is for installs without it")
def test_without_onnx_the_layer_names_the_extra() -> None:
    from quant_core.errors import MissingDependencyError

    with pytest.raises(MissingDependencyError, match=r"quant-core\[onnx\]"):
        importlib.import_module("quant_core.onnx_qdq")


def test_importing_the_layer_imports_neither_onnxruntime_nor_torch() -> None:
    pytest.importorskip("onnx")
    code = (
        "import sys, quant_core.onnx_qdq.finish, quant_core.onnx_qdq.reader, quant_core.onnx_qdq.model_io, "
        "quant_core.onnx_qdq.describe; "
        "bad = [m for m in ('onnxruntime', 'torch') if m in sys.modules]; sys.exit(str(bad) if bad else 0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_import_quant_core_does_not_import_onnx() -> None:
    code = "import sys, quant_core, quant_core.plan, quant_core.presets; sys.exit('onnx' in sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------- finishing
onnx = pytest.importorskip("onnx") if HAS_ONNX else None

if HAS_ONNX:
    from onnx import TensorProto, helper, numpy_helper
    from onnx.reference import ReferenceEvaluator

    from quant_core.errors import ModelError
    from quant_core.onnx_qdq.build import CONTRIB_DOMAIN, QDQBuilder
    from quant_core.onnx_qdq.finish import (
        drop_unread,
        finish_for_onnxruntime,
        keep_float_weights_float,
        keep_matmuls_out_of_matmulnbits,
    )
    from quant_core.qparams import QParams


def _model(nodes: list, inputs: list, outputs: list, initializers: list, opset: int = 19):  # type: ignore[no-untyped-def]
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _init(name: str, value: np.ndarray):  # type: ignore[no-untyped-def]
    return numpy_helper.from_array(np.asarray(value), name)


def _quantized_input_conv(bias: bool):  # type: ignore[no-untyped-def]
    """x -> Q -> DQ -> Conv(float weight [, float bias]) -> y."""
    rng = np.random.default_rng(0)
    inits = [
        _init("s", np.float32(0.05)),
        _init("z", np.uint8(128)),
        _init("w", rng.normal(size=(4, 3, 3, 3)).astype(np.float32)),
    ]
    conv_inputs = ["xd", "w"]
    if bias:
        inits.append(_init("b", rng.normal(size=4).astype(np.float32)))
        conv_inputs.append("b")
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q"),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq"),
        helper.make_node("Conv", conv_inputs, ["c"], name="conv", pads=[1, 1, 1, 1]),
        *_requantized("c", "y"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 5, 5])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 5, 5])
    return _model(nodes, [x], [y], [*inits, *_requantize_params()])


def _requantized(tensor: str, output: str) -> list:  # type: ignore[type-arg]
    """``tensor`` through a QuantizeLinear and DequantizeLinear into ``output``: the QDQ unit
    onnxruntime's WeightBiasQuantization completes needs the QuantizeLinear."""
    return [
        helper.make_node("QuantizeLinear", [tensor, "s_out", "z_out"], [f"{tensor}_q"], name=f"{tensor}_q"),
        helper.make_node("DequantizeLinear", [f"{tensor}_q", "s_out", "z_out"], [output], name=f"{tensor}_dq"),
    ]


def _requantize_params() -> list:  # type: ignore[type-arg]
    return [_init("s_out", np.float32(0.1)), _init("z_out", np.uint8(128))]


@pytest.mark.skipif(not HAS_ONNX, reason="needs onnx")
def test_float_weight_conv_reads_a_per_channel_dequantize_with_the_same_values() -> None:
    model = _quantized_input_conv(bias=True)
    x = np.random.default_rng(1).normal(size=(1, 3, 5, 5)).astype(np.float32)
    before = ReferenceEvaluator(model).run(None, {"x": x})[0]
    keep_float_weights_float(model)
    dq = next(n for n in model.graph.node if n.name == "dq")
    scale = next(t for t in model.graph.initializer if t.name == dq.input[1])
    assert [a.i for a in dq.attribute if a.name == "axis"] == [1]
    assert list(scale.dims) == [3]  # one (repeated) scale per input channel: WeightBiasQuantization skips it
    onnx.checker.check_model(model)
    np.testing.assert_array_equal(ReferenceEvaluator(model).run(None, {"x": x})[0], before)


@pytest.mark.skipif(not HAS_ONNX, reason="needs onnx")
def _quantized_input_gemm(*, quantized_weight: bool, requantized: bool, bits: int = 16):  # type: ignore[no-untyped-def]
    """x -> Q (uint8 or uint16) -> DQ -> Gemm(float or DQ-of-int8 weight, float bias) [-> Q -> DQ] -> y."""
    rng = np.random.default_rng(2)
    inits = [
        _init("s", np.float32(0.05)),
        _init("z", np.uint16(32768) if bits == 16 else np.uint8(128)),
        _init("b", rng.normal(size=4).astype(np.float32)),
        *_requantize_params(),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q"),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq"),
    ]
    if quantized_weight:
        inits += [
            _init("w_codes", rng.integers(-127, 128, size=(3, 4)).astype(np.int8)),
            _init("w_scale", np.float32(0.02)),
            _init("w_zero", np.int8(0)),
        ]
        nodes.append(helper.make_node("DequantizeLinear", ["w_codes", "w_scale", "w_zero"], ["w"], name="w_dq"))
    else:
        inits.append(_init("w", rng.normal(size=(3, 4)).astype(np.float32)))
    nodes.append(helper.make_node("Gemm", ["xd", "w", "b"], ["g" if requantized else "y"], name="gemm"))
    if requantized:
        nodes += _requantized("g", "y")
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        inits,
        opset=21,
    )


@pytest.mark.skipif(not HAS_ONNX, reason="needs onnx")
@pytest.mark.parametrize("quantized_weight", [False, True], ids=["float weight", "quantized weight"])
def test_a_float_bias_of_a_requantized_gemm_is_stored_as_exact_int32_codes(quantized_weight: bool) -> None:
    model = _quantized_input_gemm(quantized_weight=quantized_weight, requantized=True)
    x = np.random.default_rng(4).normal(size=(2, 3)).astype(np.float32)
    before = ReferenceEvaluator(model).run(None, {"x": x})[0]
    finished = finish_for_onnxruntime(model).model
    gemm = next(n for n in finished.graph.node if n.op_type == "Gemm")
    bias_dq = next(n for n in finished.graph.node if n.output[0] == gemm.input[2])
    codes = next(t for t in finished.graph.initializer if t.name == bias_dq.input[0])
    assert bias_dq.op_type == "DequantizeLinear" and codes.data_type == TensorProto.INT32
    onnx.checker.check_model(finished)
    np.testing.assert_array_equal(ReferenceEvaluator(finished).run(None, {"x": x})[0], before)


@pytest.mark.skipif(not HAS_ONNX, reason="needs onnx")
@pytest.mark.parametrize("quantized_weight", [False, True], ids=["float weight", "quantized weight"])
def test_a_float_head_writing_a_graph_output_keeps_its_float_bias(quantized_weight: bool) -> None:
    # onnxruntime 1.32 completes only units with a QuantizeLinear after the node; a float
    # head runs as written, and its bias stays the float tensor quant_info.json can hold.
    model = _quantized_input_gemm(quantized_weight=quantized_weight, requantized=False)
    bias = next(t for t in model.graph.initializer if t.name == "b").SerializeToString()
    finished = finish_for_onnxruntime(model).model
    assert next(n for n in finished.graph.node if n.op_type == "Gemm").input[2] == "b"
    assert next(t for t in finished.graph.initializer if t.name == "b").SerializeToString() == bias
    assert not any(t.data_type == TensorProto.INT32 for t in finished.graph.initializer)


@pytest.mark.skipif(not HAS_ONNX, reason="needs onnx")
def test_a_float_bias_an_integer_kernel_reads_is_left_to_the_product_rule() -> None:
    # uint8 input, int8 weight: QGemm takes the unit and reads its bias at input x weight
    # scale, which onnxruntime's own int32 bias is; per-element exact scales would be misread.
    model = _quantized_input_gemm(quantized_weight=True, requantized=True, bits=8)
    finished = finish_for_onnxruntime(model).model
    assert next(n for n in finished.graph.node if n.op_type == "Gemm").input[2] == "b"


def _matmul(activation_zero_point: np.ndarray, weight_scale: np.ndarray, axis: int | None):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(3)
    inits = [
        _init("s", np.float32(0.01)),
        _init("z", activation_zero_point),
        _init("wq", rng.integers(-127, 128, size=(4, 6)).astype(np.int8)),
        _init("ws", weight_scale),
    ]
    dq_w = helper.make_node(
        "DequantizeLinear", ["wq", "ws"], ["w"], name="dq_w", **({} if axis is None else {"axis": axis})
    )
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q"),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq"),
        dq_w,
        helper.make_node("MatMul", ["xd", "w"], ["y"], name="mm"),
    ]
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, 6])],
        inits,
        opset=21,
    )


@pytest.mark.skipif(not HAS_ONNX, reason="needs onnx")
@pytest.mark.parametrize(
    ("zero_point", "scale", "axis", "guarded"),
    [
        (np.uint16(32768), np.float32(0.02), None, True),  # 16-bit activation, per-tensor weight
        (np.uint16(32768), np.full(6, 0.02, np.float32), 1, True),  # per output channel
        (np.uint8(128), np.float32(0.02), None, False),  # 8-bit x 8-bit: an integer kernel takes it first
    ],
)
def test_matmul_weights_no_integer_kernel_takes_are_kept_from_matmulnbits(
    zero_point: np.ndarray, scale: np.ndarray, axis: int | None, guarded: bool
) -> None:
    model = _matmul(zero_point, scale, axis)
    x = np.random.default_rng(4).normal(size=(2, 5, 4)).astype(np.float32)
    before = ReferenceEvaluator(model).run(None, {"x": x})[0]
    keep_matmuls_out_of_matmulnbits(model)
    dq_w = next(n for n in model.graph.node if n.name == "dq_w")
    axes = [a.i for a in dq_w.attribute if a.name == "axis"]
    assert axes == ([-1] if guarded else ([] if axis is None else [axis]))
    if guarded:
        scale_tensor = next(t for t in model.graph.initializer if t.name == dq_w.input[1])
        assert len(scale_tensor.dims) == 1  # a 1-D scale: the rewrite's selector refuses it
    np.testing.assert_array_equal(ReferenceEvaluator(model).run(None, {"x": x})[0], before)


@pytest.mark.skipif(not HAS_ONNX, reason="needs onnx")
def test_drop_unread_removes_dead_chains_and_their_initializers_only() -> None:
    inits = [_init("used", np.ones(2, np.float32)), _init("dead_w", np.ones(2, np.float32))]
    nodes = [
        helper.make_node("Add", ["x", "used"], ["y"], name="add"),
        helper.make_node("Mul", ["x", "dead_w"], ["dead1"], name="mul"),
        helper.make_node("Relu", ["dead1"], ["dead2"], name="relu"),
    ]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        inits,
    )
    drop_unread(model)
    assert [n.name for n in model.graph.node] == ["add"]
    assert [t.name for t in model.graph.initializer] == ["used"]


@pytest.mark.skipif(not HAS_ONNX, reason="needs onnx")
def test_sixteen_bit_pairs_below_opset_21_go_to_the_contrib_domain_which_is_declared() -> None:
    model = _model([], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])], [], [], opset=13)
    builder = QDQBuilder(model)
    qp = QParams.per_tensor(0.5, 32768, "uint16")
    params = builder.qparam_initializers("x", qp)
    model.graph.node.extend(
        [
            builder.qdq_node("QuantizeLinear", "x", "xq", params, qp),
            builder.qdq_node("DequantizeLinear", "xq", "y", params, qp),
        ]
    )
    model.graph.output.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, [2]))
    finished = finish_for_onnxruntime(model)
    assert {n.domain for n in finished.model.graph.node} == {CONTRIB_DOMAIN}
    assert any(o.domain == CONTRIB_DOMAIN for o in finished.model.opset_import)
    assert finished.notes and "opset 21" in finished.notes[0]


@pytest.mark.skipif(not HAS_ONNX, reason="needs onnx")
def test_a_standard_pair_the_opset_does_not_take_is_refused() -> None:
    inits = [_init("s", np.float32(0.5)), _init("z", np.int16(0))]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"], name="q")]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.INT16, [2])],
        inits,
        opset=13,
    )
    with pytest.raises(ModelError, match="opset 13 is too old"):
        finish_for_onnxruntime(model)
