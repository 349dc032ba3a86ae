"""Ops a review found checked or simulated wrong: an implicitly padded average pool, a
Resize with opset 18's ``axes``, a ConvTranspose bias clipped on the wrong axis, Softmax
before opset 13, a ConvTranspose ``output_shape``, and refusals that named no node. Each
test fails on the code before its fix."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import quant_onnx
from quant_core.errors import ModelError
from quant_npu.check import check
from quant_npu.legalize import legalize_model
from quant_npu.sim import simulate


def _model(nodes, inits, shape, opset=13, out_rank=4):
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None] * out_rank)]
    initializers = [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()]
    model = helper.make_model(
        helper.make_graph(nodes, "g", inputs, outputs, initializers), opset_imports=[helper.make_opsetid("", opset)]
    )
    model.ir_version = 8
    return model


def _ort(model, x):
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )[0]


def _legal(model, data):
    return legalize_model(quant_onnx.quantize(model, None, "xint8", data, quiet=True).model, "xint8")


def _conv_then(op_nodes, shape=(None, 3, 8, 8), opset=13, out_rank=4):
    rng = np.random.default_rng(0)
    conv = helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1])
    inits = {"w": (rng.normal(size=(4, 3, 3, 3)) * 0.3).astype(np.float32)}
    return _model([conv, *op_nodes], inits, list(shape), opset, out_rank)


def test_an_implicitly_padded_average_pool_dividing_by_real_pixels_is_refused():
    pool = helper.make_node("AveragePool", ["c"], ["y"], name="pool", kernel_shape=[2, 2], auto_pad="SAME_UPPER")
    data = np.random.default_rng(1).normal(size=(8, 3, 8, 8)).astype(np.float32)
    quantized = quant_onnx.quantize(_conv_then([pool]), None, "xint8", data, quiet=True).model
    found = check(quantized, "xint8")
    assert any(v.rule == "unsupported_attribute" and v.node == "pool" for v in found.violations)


@pytest.mark.parametrize("form", ["scales", "sizes"])
def test_a_resize_with_axes_simulates_as_onnxruntime_runs_it(form):
    values = np.array([2.0, 2.0], np.float32) if form == "scales" else np.array([16, 16], np.int64)
    inputs = ["c", "", "s"] if form == "scales" else ["c", "", "", "s"]
    resize = helper.make_node("Resize", inputs, ["y"], name="resize", mode="nearest", axes=[2, 3])
    model = _conv_then([resize], opset=18)
    model.graph.initializer.append(numpy_helper.from_array(values, "s"))
    data = np.random.default_rng(1).normal(size=(8, 3, 8, 8)).astype(np.float32)
    result = _legal(model, data)
    simulated = next(iter(simulate(result.model, data[:3], "xint8", rounding="onnx", quiet=True).values()))
    np.testing.assert_array_equal(simulated, _ort(result.model, data[:3]))  # before: IndexError


def test_a_resize_scale_given_through_axes_is_checked():
    resize = helper.make_node("Resize", ["c", "", "s"], ["y"], name="resize", mode="nearest", axes=[2, 3])
    model = _conv_then([resize], opset=18)
    model.graph.initializer.append(numpy_helper.from_array(np.array([1.5, 1.5], np.float32), "s"))
    data = np.random.default_rng(1).normal(size=(8, 3, 8, 8)).astype(np.float32)
    quantized = quant_onnx.quantize(model, None, "xint8", data, quiet=True).model
    assert any(v.rule == "engine_limit" and v.node == "resize" for v in check(quantized, "xint8").violations)


def test_a_conv_transpose_bias_is_limited_by_its_output_channels_reach():
    # The weight is [Cin, Cout, kh, kw]: output channel 1's large negative weights pull its
    # bias of 10 back into range. Summed over axis 0 (the input channels), the bias looked
    # out of reach and was clipped, moving channel 1 by 2.0.
    weight = np.zeros((2, 2, 3, 3), np.float32)
    weight[0, 0], weight[0, 1], weight[1, :] = 0.1, -1.0, 0.001
    node = helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], name="up", kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    model = _model([node], {"w": weight, "b": np.array([0.0, 10.0], np.float32)}, ["N", 2, 6, 6])
    data = np.random.default_rng(0).uniform(0.5, 1.0, size=(32, 2, 6, 6)).astype(np.float32)
    quantized = quant_onnx.quantize(model, None, "xint8", data, quiet=True).model
    result = legalize_model(quantized, "xint8")
    assert result.remaining.ok
    assert np.abs(_ort(result.model, data) - _ort(quantized, data)).max() < 0.5


def test_softmax_before_opset_13_normalises_every_axis_from_its_axis_on():
    from builders import QDQWriter, qdq_model

    writer = QDQWriter()
    x = writer.quantize("x", 4)
    y = writer.quantize(writer.op("Softmax", [x], "softmax", axis=1), 7)
    model = qdq_model(writer.nodes, writer.inits, [("x", ["N", 3, 2, 2])], [y], opset=12)
    feeds = (np.random.default_rng(0).integers(-128, 128, size=(8, 3, 2, 2)) / 16).astype(np.float32)
    simulated = next(iter(simulate(model, {"x": feeds}, rounding="onnx", quiet=True).values()))
    expected = _ort(model, feeds)
    assert np.abs(simulated - expected).max() * 128 <= 1  # before: up to 127 steps


def test_a_conv_transpose_output_shape_is_refused_like_auto_pad():
    weight = np.random.default_rng(0).normal(size=(3, 4, 3, 3)).astype(np.float32) * 0.3
    node = helper.make_node("ConvTranspose", ["x", "w"], ["y"], name="ct", strides=[2, 2], output_shape=[7, 7])
    model = _model([node], {"w": weight}, [None, 3, 4, 4])
    data = np.random.default_rng(1).normal(size=(8, 3, 4, 4)).astype(np.float32)
    quantized = quant_onnx.quantize(model, None, "xint8", data, quiet=True).model
    found = check(quantized, "xint8")
    assert any(v.node == "ct" and "output_shape" in v.message for v in found.violations)


def test_a_refusal_inside_a_kernel_names_its_node():
    pad = helper.make_node("Pad", ["c", "pads"], ["y"], name="my_node", mode="wrap")
    model = _conv_then([pad], opset=19)
    model.graph.initializer.append(numpy_helper.from_array(np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64), "pads"))
    data = np.random.default_rng(1).normal(size=(8, 3, 8, 8)).astype(np.float32)
    result = _legal(model, data)
    with pytest.raises(ModelError, match=r"^node 'my_node' \(Pad\)"):
        simulate(result.model, data[:2], "xint8", rounding="onnx", quiet=True)
