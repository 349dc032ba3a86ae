"""The QDQ writer: numerics against quant_core and onnxruntime, structure, encodings."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis.extra.numpy import arrays
from model_builders import (
    GraphBuilder,
    conv_transpose_net,
    cpu_has_vnni,
    float_island_net,
    mlp,
    optimized_op_types,
    ort_run,
    quantize_in_memory,
    random_inputs,
    reference_run,
    small_cnn,
)
from onnx import numpy_helper

from quant_core.onnx_qdq.build import exact_int32
from quant_core.qdq import activation_is_absorbed, encode_activation
from quant_core.qparams import QParams, bias_qparams, fake_quantize, sqnr_db
from quant_onnx.pipeline.qdq_writer import WriterOptions

COMPUTE = ("Conv", "Gemm", "MatMul")


def _index(model: onnx.ModelProto):
    producers = {o: n for n in model.graph.node for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    return producers, consumers, inits


def _dq_value(node: onnx.NodeProto, inits) -> np.ndarray:
    q, scale, zp = (inits[name] for name in node.input[:3])
    axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
    shape = [1] * q.ndim
    if scale.ndim:
        shape[axis] = -1
    return ((q.astype(np.int64) - zp.reshape(shape)) * scale.reshape(shape)).astype(np.float32)


@pytest.fixture(scope="module")
def cnn():
    model = small_cnn()
    x = random_inputs(model, 32)
    calibrated, quantized = quantize_in_memory(model, "a8w8", x)
    return model, x, calibrated, quantized


def test_weights_dequantize_to_the_quant_core_reference(cnn) -> None:
    model, _x, calibrated, quantized = cnn
    producers, _consumers, inits = _index(quantized)
    floats = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for slot in calibrated.plan.weights:
        node = next(n for n in quantized.graph.node if n.name == slot.node)
        dq = producers[node.input[1]]
        assert dq.op_type == "DequantizeLinear"
        assert inits[dq.input[0]].dtype == np.int8
        reference = fake_quantize(floats[slot.tensor], calibrated.weight_qparams[slot.node])
        np.testing.assert_array_equal(_dq_value(dq, inits), reference)
        assert slot.tensor not in inits  # the float weight is gone: ~4x smaller file


def test_bias_is_int32_at_input_times_weight_scale(cnn) -> None:
    _model, _x, calibrated, quantized = cnn
    producers, _consumers, inits = _index(quantized)
    for bias in calibrated.plan.biases:
        node = next(n for n in quantized.graph.node if n.name == bias.node)
        dq = producers[node.input[2]]
        codes, scale, zp = (inits[name] for name in dq.input)
        assert codes.dtype == np.int32 and not zp.any()
        input_scale = encode_activation(calibrated.qparams_of(bias.input_tensor), "x86_uint8").scale
        expected = bias_qparams(input_scale, calibrated.weight_qparams[bias.node]).scale
        np.testing.assert_array_equal(scale, expected)


def test_each_compute_node_reads_private_dqs_and_writes_one_q(cnn) -> None:
    """Every compute node reads its own dequantized inputs and writes one quantize, except the
    classifier's Gemm: its logits are the result tail (float, the graph output itself)."""
    _model, _x, calibrated, quantized = cnn
    producers, consumers, _inits = _index(quantized)
    outputs = {o.name for o in quantized.graph.output}
    for node in quantized.graph.node:
        if node.op_type in COMPUTE:
            for name in node.input:
                if name:
                    assert producers[name].op_type == "DequantizeLinear", (node.name, name)
                    assert len(consumers[name]) == 1
            if calibrated.plan.group_of(node.output[0]) is None:
                assert node.op_type == "Gemm" and node.output[0] in outputs
                continue
            assert [c.op_type for c in consumers[node.output[0]]] == ["QuantizeLinear"]
            assert node.output[0] not in outputs
    assert [producers[output].op_type for output in outputs] == ["Gemm"]


def test_activations_are_uint8_and_fused_relus_are_dropped(cnn) -> None:
    _model, _x, calibrated, quantized = cnn
    _producers, _consumers, inits = _index(quantized)
    q_types = {inits[n.input[2]].dtype for n in quantized.graph.node if n.op_type == "QuantizeLinear"}
    assert q_types == {np.dtype(np.uint8)}
    assert [n.op_type for n in quantized.graph.node].count("Relu") == 0
    kept_clips = [n for n in quantized.graph.node if n.op_type == "Clip"]
    for clip in kept_clips:  # kept only where saturation cannot reproduce it
        fused = next(f for f in calibrated.plan.fused if f.node == clip.name)
        assert not activation_is_absorbed(calibrated.qparams_of(fused.post_tensor), fused.bounds)


def test_quantized_output_is_close_to_float_in_onnxruntime_and_reference(cnn) -> None:
    model, x, _calibrated, quantized = cnn
    expected = ort_run(model, x)[0]
    actual = ort_run(quantized, x)[0]
    assert sqnr_db(expected, actual) > 30
    reference = reference_run(quantized, {"x": x[:4]})[0]
    assert sqnr_db(ort_run(quantized, x[:4], "basic")[0], reference) > 40


def test_symmetric_int8_activations_are_written_as_uint8_zero_point_128() -> None:
    model = small_cnn()
    x = random_inputs(model, 16)
    _cal, x86 = quantize_in_memory(model, "xint8", x)
    _cal, spec = quantize_in_memory(model, "xint8", x, activation_encoding="as_spec")
    _p, _c, inits = _index(x86)
    zps = {(inits[n.input[2]].dtype, int(inits[n.input[2]])) for n in x86.graph.node if n.op_type == "QuantizeLinear"}
    assert zps == {(np.dtype(np.uint8), 128)}
    _p, _c, inits = _index(spec)
    zps = {(inits[n.input[2]].dtype, int(inits[n.input[2]])) for n in spec.graph.node if n.op_type == "QuantizeLinear"}
    assert zps == {(np.dtype(np.int8), 0)}
    # zero point 128 cannot absorb Relu: it stays, between a DQ and a Q with the same qparams.
    assert "Relu" in [n.op_type for n in x86.graph.node]
    ref_x86 = reference_run(x86, {"x": x})[0]
    ref_spec = reference_run(spec, {"x": x})[0]
    np.testing.assert_allclose(ref_x86, ref_spec, rtol=0, atol=1e-5)


@pytest.mark.skipif(not cpu_has_vnni(), reason="onnxruntime's u8 x s8 kernels saturate on CPUs without VNNI")
def test_integer_kernels_compute_what_the_qdq_graph_says(cnn) -> None:
    _model, x, _calibrated, quantized = cnn
    assert sqnr_db(ort_run(quantized, x, "emulated")[0], ort_run(quantized, x, "all")[0]) > 35


def test_gemm_alpha_beta_are_folded_and_matmul_is_per_column() -> None:
    model = mlp()
    x = random_inputs(model, 32)
    calibrated, quantized = quantize_in_memory(model, "a8w8", x)
    gemm = next(n for n in quantized.graph.node if n.op_type == "Gemm")
    assert {a.name for a in gemm.attribute} <= {"transA", "transB"}
    assert sqnr_db(ort_run(model, x)[0], ort_run(quantized, x)[0]) > 30
    matmul = next(s for s in calibrated.plan.weights if s.op_type == "MatMul")
    assert calibrated.weight_qparams[matmul.node].scale.shape == (16,)


def test_conv_transpose_weights_are_per_channel_on_axis_1() -> None:
    model = conv_transpose_net()
    x = random_inputs(model, 16)
    calibrated, quantized = quantize_in_memory(model, "a8w8", x)
    slot = next(s for s in calibrated.plan.weights if s.op_type == "ConvTranspose")
    qp = calibrated.weight_qparams[slot.node]
    assert qp.axis == 1 and qp.scale.shape == (5,)
    producers, _c, _i = _index(quantized)
    node = next(n for n in quantized.graph.node if n.op_type == "ConvTranspose")
    assert next(a.i for a in producers[node.input[1]].attribute if a.name == "axis") == 1
    assert sqnr_db(ort_run(model, x)[0], ort_run(quantized, x)[0]) > 30


def test_float_islands_and_unsupported_ops() -> None:
    model = float_island_net()
    x = random_inputs(model, 16)
    _cal, quantized = quantize_in_memory(model, "a8w8", x)
    producers, _c, _i = _index(quantized)
    hswish = next(n for n in quantized.graph.node if n.op_type == "HardSwish")
    assert producers[hswish.input[0]].op_type == "DequantizeLinear"
    mul = next(n for n in quantized.graph.node if n.op_type == "Mul")
    assert [producers[i].op_type for i in mul.input] == ["DequantizeLinear"] * 2  # float consumer
    # After the last layer (ConvTranspose, no integer kernel) the result tail runs float.
    conv_t = next(n for n in quantized.graph.node if n.op_type == "ConvTranspose")
    assert producers[conv_t.input[0]].op_type == "DequantizeLinear"
    sin = next(n for n in quantized.graph.node if n.op_type == "Sin")
    assert producers[sin.input[0]].op_type == "ConvTranspose"
    assert sqnr_db(ort_run(model, x)[0], ort_run(quantized, x)[0]) > 25


def test_int16_activations_raise_the_opset_and_beat_8_bit() -> None:
    from quant_onnx.api import ModelQuantizer

    model = small_cnn()
    x = random_inputs(model, 16)
    results = {}
    for preset in ("a8w8", "a16w8"):
        quantizer = ModelQuantizer(preset, quiet=True)
        prepared = quantizer.prepare(model)
        quantized = quantizer.write(quantizer.calibrate(prepared, x)).model
        results[preset] = sqnr_db(ort_run(model, x)[0], ort_run(quantized, x)[0])
        if preset == "a16w8":
            assert quantized.opset_import[0].version >= 21
    assert results["a16w8"] > results["a8w8"]


def test_writing_is_deterministic() -> None:
    model = small_cnn()
    x = random_inputs(model, 16)
    first = quantize_in_memory(model, "a8w8", x)[1].SerializeToString(deterministic=True)
    second = quantize_in_memory(model, "a8w8", x)[1].SerializeToString(deterministic=True)
    assert first == second


def test_activation_is_absorbed_needs_exact_saturation() -> None:
    qp = QParams.per_tensor(6.0 / 255, 0, "uint8")
    assert activation_is_absorbed(qp, (0.0, 6.0))
    assert not activation_is_absorbed(QParams.per_tensor(8.0 / 255, 0, "uint8"), (0.0, 6.0))
    assert not activation_is_absorbed(QParams.per_tensor(0.1, 10, "uint8"), (0.0, float("inf")))


def test_writer_options_are_validated() -> None:
    with pytest.raises(ValueError, match="activation_encoding"):
        WriterOptions(activation_encoding="int8")  # type: ignore[arg-type]


@pytest.mark.parametrize("preset", ["a8w8", "xint8"])
def test_no_initializer_is_left_unread(preset: str) -> None:
    # A dropped Clip's bounds and a kept Clip's dropped bound go with it: onnxruntime warns
    # about (and every reader carries) initializers no node reads.
    model = small_cnn()
    _cal, quantized = quantize_in_memory(model, preset, random_inputs(model, 16))
    read = {name for node in quantized.graph.node for name in node.input} | {o.name for o in quantized.graph.output}
    assert [t.name for t in quantized.graph.initializer if t.name not in read] == []


def test_kept_clip_loses_the_bound_saturation_applies() -> None:
    """Symmetric activations (zero point 128) cannot absorb Clip(0, 6)'s lower bound; when
    the upper bound saturates anyway the Clip becomes a Relu (onnxruntime overflows
    converting huge bound/scale ratios of a kept Clip)."""
    b = GraphBuilder()
    x = b.input("x", ["N", 3, 4, 4])
    lo, hi = b.const(np.array(0.0, np.float32)), b.const(np.array(6.0, np.float32))
    y = b.node("Clip", [b.conv(x, 3, 8, bias=False), lo, hi])
    model = b.model([b.conv(y, 8, 8, bias=False)], rank=4)
    data = random_inputs(model, 16) * 1e-9  # tiny activations: 6 / scale overflows int32
    _cal, quantized = quantize_in_memory(model, "xint8", data)
    ops = [n.op_type for n in quantized.graph.node]
    assert "Clip" not in ops and ops.count("Relu") == 1
    read = {name for node in quantized.graph.node for name in node.input}
    assert {lo, hi}.isdisjoint(t.name for t in quantized.graph.initializer) and not {lo, hi} & read
    expected = ort_run(model, data)[0]
    # 31 dB when weight positions rounded up; these random weights' ranges sit 1.31x above
    # the nearest power of two, which clips 5% of them (docs/benchmarks.md, "Power-of-two
    # positions"): 19 dB. A broken Relu rewrite or an overflow gives far less.
    assert sqnr_db(expected, ort_run(quantized, data)[0]) > 15
    assert sqnr_db(expected, ort_run(quantized, data, "basic")[0]) > 15


def test_int4_weights_use_opset_21_int4_initializers() -> None:
    from quant_onnx.api import ModelQuantizer

    model = small_cnn()
    x = random_inputs(model, 16)
    quantizer = ModelQuantizer("w4a8", quiet=True)
    quantized = quantizer.write(quantizer.calibrate(quantizer.prepare(model), x)).model
    assert quantized.opset_import[0].version >= 21
    int4 = [t for t in quantized.graph.initializer if t.data_type == onnx.TensorProto.INT4]
    assert len(int4) == 2 * 7  # weight codes and zero points of 6 convs + 1 gemm
    assert sqnr_db(ort_run(model, x)[0], ort_run(quantized, x)[0]) > 12


def _torch_style_flatten_net() -> onnx.ModelProto:
    """Conv -> GlobalAveragePool -> Reshape to [x.size(0), -1] -> Gemm, the batch size read
    from the model input (torch's ``x.view(x.size(0), -1)`` as exported)."""
    b = GraphBuilder(3)
    x = b.input("x", ["N", 3, 8, 8])
    pooled = b.node("GlobalAveragePool", [b.node("Relu", [b.conv(x, 3, 8)])])
    batch = b.node(
        "Unsqueeze", [b.node("Gather", [b.node("Shape", [x]), b.const(np.array(0))]), b.const(np.array([0]))]
    )
    shape = b.node("Concat", [batch, b.const(np.array([-1]))], axis=0)
    return b.model([b.gemm(b.node("Reshape", [pooled, shape]), 8, 4)])


def test_shape_readers_read_the_quantized_tensor_not_a_dequantized_copy(tmp_path) -> None:
    model = _torch_style_flatten_net()
    x = random_inputs(model, 20)
    _calibrated, quantized = quantize_in_memory(model, "a8w8", x)
    producers, _consumers, _inits = _index(quantized)
    shape_node = next(n for n in quantized.graph.node if n.op_type == "Shape")
    assert producers[shape_node.input[0]].op_type == "QuantizeLinear"
    assert "DequantizeLinear" not in optimized_op_types(quantized, tmp_path)[:-1]  # only the output's DQ
    reference = ort_run(quantized, x[:7])[0]
    np.testing.assert_array_equal(reference_run(quantized, {"x": x[:7]})[0], reference)
    assert reference.shape == (7, 4)
    assert sqnr_db(ort_run(model, x[:7])[0], reference) > 20


def _float_weight_net() -> onnx.ModelProto:
    """x [N, 1, 8, 8] -> Conv(1 -> 4, bias) -> Relu -> Conv(4 -> 4, no bias) -> GlobalAveragePool ->
    Flatten -> Gemm(4 -> 3): a one-channel and a multi-channel conv input, and a Gemm."""
    b = GraphBuilder(5)
    x = b.input("x", ["N", 1, 8, 8])
    h = b.conv(b.node("Relu", [b.conv(x, 1, 4, name="one_channel")]), 4, 4, bias=False, name="four_channels")
    return b.model([b.gemm(b.node("Flatten", [b.node("GlobalAveragePool", [h])]), 4, 3)])


@pytest.mark.parametrize("preset", ["a16w8", "a8w8"])
def test_float_weights_stay_float_in_the_default_onnxruntime_session(preset: str) -> None:
    """onnxruntime's WeightBiasQuantization would quantize these weights (see
    ``keep_float_weights_float``); the writer's graph gives it nothing to take."""
    import attrs

    from quant_core.presets import get_preset
    from quant_onnx.api import ModelQuantizer

    model = _float_weight_net()
    config = get_preset(preset)
    config = config.evolve(global_config=attrs.evolve(config.global_config, weight=None))
    x = random_inputs(model, 16)
    quantizer = ModelQuantizer(config, quiet=True)
    quantized = quantizer.write(quantizer.calibrate(quantizer.prepare(model), x)).model
    producers, _consumers, inits = _index(quantized)
    floats = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    nodes = {n.name: n for n in quantized.graph.node}

    for node in (n for n in quantized.graph.node if n.op_type in ("Conv", "Gemm")):
        np.testing.assert_array_equal(inits[node.input[1]], floats[model_weight(model, node.name)])
    # Multi-channel input: a per-channel DequantizeLinear repeating the activation's one scale.
    dq = producers[nodes["four_channels"].input[0]]
    assert next(a.i for a in dq.attribute if a.name == "axis") == 1
    assert inits[dq.input[1]].shape == (4,) and len(set(inits[dq.input[1]].tolist())) == 1
    assert len(nodes["four_channels"].input) == 2
    # One-channel input: the float bias, bit-exact, behind a DequantizeLinear. The Gemm writes
    # the result tail (a float output): onnxruntime fuses nothing there, its bias stays as it was.
    bias_dq = producers[nodes["one_channel"].input[2]]
    assert bias_dq.op_type == "DequantizeLinear" and inits[bias_dq.input[0]].dtype == np.int32
    np.testing.assert_array_equal(_dq_value(bias_dq, inits), floats[model_bias(model, "one_channel")])
    gemm = next(n for n in nodes.values() if n.op_type == "Gemm")
    np.testing.assert_array_equal(inits[gemm.input[2]], floats[model_bias(model, gemm.name)])

    # The Gemm's output is float (the result tail): the sessions agree to float rounding
    # (1e-4 of the largest output).
    node_by_node = ort_run(quantized, x)[0]
    tolerance = 1e-4 * float(np.abs(node_by_node).max())
    optimised = ort_run(quantized, x, "all", disabled_optimizers=("NchwcTransformer",))[0]
    np.testing.assert_allclose(optimised, node_by_node, rtol=0, atol=tolerance)
    np.testing.assert_allclose(reference_run(quantized, {"x": x})[0], node_by_node, rtol=0, atol=tolerance)


def model_weight(model: onnx.ModelProto, node_name: str) -> str:
    return next(n.input[1] for n in model.graph.node if n.name == node_name)


def model_bias(model: onnx.ModelProto, node_name: str) -> str:
    return next(n.input[2] for n in model.graph.node if n.name == node_name)


@settings(max_examples=200, deadline=None)
@given(arrays(np.float32, st.integers(1, 16), elements=st.floats(width=32, allow_nan=False, allow_infinity=False)))
def test_exact_int32_dequantizes_to_the_same_float32(values: np.ndarray) -> None:
    codes, qp = exact_int32(values)
    assert codes.dtype == np.int32 and qp.axis == 0 and not qp.zero_point.any()
    np.testing.assert_array_equal(codes.astype(np.float32) * qp.scale, values)


def _broadcast_bias_gemm(bias_shape: tuple[int, ...]) -> onnx.ModelProto:
    """Gemm(transB=1) [N, 8] -> [N, 4] whose bias C is one value broadcast over the channels."""
    rng = np.random.default_rng(0)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1, name="gemm_bb")],
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 8])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 4])],
        [
            numpy_helper.from_array(rng.normal(size=(4, 8)).astype(np.float32), "w"),
            numpy_helper.from_array(np.full(bias_shape, 0.7, np.float32), "b"),
        ],
    )
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("bias_shape", [(1,), (), (1, 1)])
def test_a_broadcast_gemm_bias_is_stored_per_channel_as_int32(bias_shape, tmp_path) -> None:
    # It was kept float ("not one per channel"), which kept the Gemm out of QGemm.
    model = _broadcast_bias_gemm(bias_shape)
    _calibrated, quantized = quantize_in_memory(model, "a8w8", random_inputs(model, 32))
    producers, _consumers, inits = _index(quantized)
    gemm = next(n for n in quantized.graph.node if n.name == "gemm_bb")
    dq = producers[gemm.input[2]]
    assert dq.op_type == "DequantizeLinear" and inits[dq.input[0]].dtype == np.int32
    assert inits[dq.input[0]].shape == (4,)
    codes, scale = inits[dq.input[0]], inits[dq.input[1]]
    assert np.all(np.abs(codes * scale - 0.7) <= scale / 2 + 1e-7)  # 0.7 to the nearest code, every channel
    if cpu_has_vnni():
        assert "com.microsoft:QGemm" in optimized_op_types(quantized, tmp_path)


def test_a_matmul_vector_weight_is_per_tensor(tmp_path) -> None:
    """``x @ w`` with ``w`` of shape [K] sums over w's one axis: per-channel scales there
    would differ along the reduction, which no integer kernel can accumulate."""
    b = GraphBuilder()
    x = b.input("x", ["N", 5, 8])
    model = b.model([b.node("MatMul", [x, b.const(b.rng.normal(size=8).astype(np.float32), "w")], name="dot")], rank=2)
    data = b.rng.normal(size=(32, 5, 8)).astype(np.float32)
    calibrated, quantized = quantize_in_memory(model, "a8w8", data)
    assert calibrated.weight_qparams["dot"].scale.shape == ()
    assert any("'dot': rank-1 MatMul weight has no single output-channel axis" in n for n in calibrated.plan.notes)
    assert sqnr_db(ort_run(model, data)[0], ort_run(quantized, data)[0]) > 30
    assert ":MatMul" not in optimized_op_types(quantized, tmp_path)  # an integer kernel, not a float MatMul


def _tiny(nodes, inputs, outputs, constants):
    """A float model of ``nodes`` (opset 17) with float32 ``constants``."""
    from conftest import make_model, tensor, vi

    initializers = [tensor(name, np.asarray(value, np.float32)) for name, value in constants.items()]
    return make_model(nodes, [vi(*i) for i in inputs], [vi(*o) for o in outputs], initializers, opset=17)


def _run(model, feeds):
    """The default session's outputs (onnxruntime's integer kernels where it fuses)."""
    return ort_run(model, feeds, level="all")


def test_a_graph_input_that_is_also_an_output_stays_as_fed() -> None:
    from onnx import helper

    from quant_onnx import quantize

    rng = np.random.default_rng(0)
    model = _tiny(
        [helper.make_node("Conv", ["x", "w"], ["y"], name="conv")],
        [("x", [1, 3, 4, 4])],
        [("y", [1, 4, 4, 4]), ("x", [1, 3, 4, 4])],
        {"w": rng.normal(size=(4, 3, 1, 1))},
    )
    feeds = [{"x": rng.normal(size=(1, 3, 4, 4)).astype(np.float32)} for _ in range(8)]
    written = quantize(model, None, "a8w8", feeds, quiet=True).model
    onnx.checker.check_model(written)
    y, x = _run(written, feeds[0])
    np.testing.assert_array_equal(x, feeds[0]["x"])  # passed through, not quantized
    assert sqnr_db(_run(model, feeds[0])[0], y) > 30


def test_a_gemm_bias_per_row_is_not_taken_for_one_per_column() -> None:
    """C of shape [M, 1] adds one value per row; with M == N it has a per-column bias's size."""
    from onnx import helper

    from quant_onnx import quantize

    rng = np.random.default_rng(0)
    model = _tiny(
        [helper.make_node("Gemm", ["x", "W", "C"], ["y"], name="g")],
        [("x", [4, 8])],
        [("y", [4, 4])],
        {"W": rng.normal(size=(8, 4)), "C": [[10.0], [-10.0], [5.0], [-5.0]]},
    )
    feeds = [{"x": rng.normal(size=[4, 8]).astype(np.float32)} for _ in range(16)]
    for preset in ("a8w8", "a16w8", "xint8"):
        written = quantize(model, None, preset, feeds, quiet=True).model
        assert sqnr_db(_run(model, feeds[0])[0], _run(written, feeds[0])[0]) > 25, preset


def test_a_concat_input_the_recipe_keeps_float_joins_no_group() -> None:
    """A residual stream kept float beside a LayerNorm output, concatenated for a MatMul."""
    from onnx import helper

    from quant_onnx import quantize

    rng = np.random.default_rng(0)
    model = _tiny(
        [
            helper.make_node("MatMul", ["x", "W"], ["h"], name="mm1"),
            helper.make_node("Add", ["x", "h"], ["r"], name="res"),
            helper.make_node("LayerNormalization", ["r", "g", "b"], ["n"], name="ln", axis=-1),
            helper.make_node("Concat", ["r", "n"], ["c"], name="cat", axis=1),
            helper.make_node("MatMul", ["c", "W2"], ["y"], name="mm2"),
        ],
        [("x", [1, 3, 8])],
        [("y", [1, 6, 4])],
        {"W": rng.normal(size=(8, 8)), "W2": rng.normal(size=(8, 4)), "g": np.ones(8), "b": np.zeros(8)},
    )
    feeds = [{"x": rng.normal(size=[1, 3, 8]).astype(np.float32)} for _ in range(8)]
    for preset in ("a8w8", "xint8"):
        written = quantize(model, None, preset, feeds, quiet=True).model
        onnx.checker.check_model(written)
        assert _run(written, feeds[0])[0].shape == (1, 6, 4)
