"""The ONNX layer runner: layers described from the calibrated plan (never re-derived
from the file), data through onnxruntime, writes into the copied QDQ model."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from algorithms_models import batches_for, gemm_mlp, mobilenet_block, quantize_for_passes, stored_weight_codes

from quant_core.dtypes import DType
from quant_core.errors import ModelError
from quant_core.qparams import quantize
from quant_onnx.algorithms import OnnxLayerRunner
from quant_onnx.algorithms.capture import TensorCapture


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("power_of_two", [True, False])
def test_layers_carry_the_plans_qparams(per_channel, power_of_two):
    model = mobilenet_block()
    batches = batches_for(model, count=2)
    calibrated, qdq = quantize_for_passes(model, batches, per_channel=per_channel, power_of_two=power_of_two)
    runner = OnnxLayerRunner(calibrated, qdq, batches)
    layers = runner.layers()
    assert [layer.name for layer in layers] == ["conv1", "dw", "conv3", "fc"]
    assert [layer.activation for layer in layers] == ["relu6", "relu6", "relu", None]
    for layer in layers:
        qp = layer.weight_qparams
        assert qp is calibrated.weight_qparams[layer.name] or qp.axis == 0  # transposed layers swap the axis
        assert qp.dtype is DType.INT8 and qp.is_power_of_two == power_of_two
        assert (qp.axis == 0) if per_channel else (qp.axis is None)
        stored = stored_weight_codes(qdq, layer.name)
        codes = quantize(layer.float_weight, qp)
        np.testing.assert_array_equal(codes, stored.T if stored.shape != codes.shape else stored)
        assert layer.bias is not None and layer.bias_allowed


def test_gemm_layouts_and_axes():
    model = gemm_mlp()
    batches = batches_for(model, count=2)
    calibrated, qdq = quantize_for_passes(model, batches)
    fc1, fc2 = OnnxLayerRunner(calibrated, qdq, batches).layers()
    assert calibrated.weight_qparams["fc1"].axis == 1 and fc1.weight_qparams.axis == 0  # [in, out] stored
    assert fc2.weight_qparams.axis == 0 and fc1.float_weight.shape == (16, 12) and fc1.out_channels == 16


def test_writes_keep_the_stored_dtype_and_layout():
    model = gemm_mlp()
    batches = batches_for(model, count=2)
    calibrated, qdq = quantize_for_passes(model, batches, weight_bits=4)
    runner = OnnxLayerRunner(calibrated, qdq, batches)
    fc1 = runner.layers()[0]
    assert fc1.weight_qparams.dtype is DType.INT4
    codes = np.clip(quantize(fc1.float_weight, fc1.weight_qparams).astype(np.int64) + 1, -8, 7)
    runner.set_weight_codes(fc1, codes)
    stored = stored_weight_codes(runner.model, "fc1")
    assert stored.dtype == stored_weight_codes(qdq, "fc1").dtype and stored.shape == (12, 16)
    np.testing.assert_array_equal(stored.astype(np.int64).T, codes)


def test_quantized_inputs_match_the_whole_model():
    model = mobilenet_block()
    batches = batches_for(model, count=3, batch=4)
    calibrated, qdq = quantize_for_passes(model, batches)
    runner = OnnxLayerRunner(calibrated, qdq, batches)
    nodes = {n.name: n for n in qdq.graph.node}
    for layer in runner.layers():
        tensor = nodes[layer.name].input[0]
        expected = TensorCapture(qdq, [tensor]).collect(batches)[tensor]
        np.testing.assert_allclose(np.concatenate(list(runner.quantized_inputs(layer))), expected, atol=1e-6)


def test_a_different_float_model_is_rejected():
    model = mobilenet_block(seed=0)
    batches = batches_for(model, count=1)
    calibrated, _qdq = quantize_for_passes(model, batches)
    _, other = quantize_for_passes(mobilenet_block(seed=7), batches)
    with pytest.raises(ModelError, match=r"conv1.*does not quantize"):
        OnnxLayerRunner(calibrated, other, batches)


def test_codes_a_learned_pass_moved_far_are_accepted_only_as_learned():
    """AdaQuant learns the weights themselves: on EfficientNet-Lite0 it moved more than a
    step in over a tenth of a layer's codes, and bias correction after it refused the model
    as "not written from this float model" after five minutes of AdaQuant."""
    model = mobilenet_block(seed=0)
    batches = batches_for(model, count=1)
    calibrated, qdq = quantize_for_passes(model, batches)
    moved = onnx.ModelProto()
    moved.CopyFrom(qdq)
    name = next(n for n in moved.graph.node if n.name == "conv1").input[1]
    dq = next(n for n in moved.graph.node if name in n.output)
    codes = next(i for i in moved.graph.initializer if i.name == dq.input[0])
    values = onnx.numpy_helper.to_array(codes)
    shifted = np.clip(values.astype(np.int64) + 3, -127, 127).astype(values.dtype)
    codes.CopyFrom(onnx.numpy_helper.from_array(shifted, codes.name))
    with pytest.raises(ModelError, match=r"conv1.*does not quantize"):
        OnnxLayerRunner(calibrated, moved, batches)
    runner = OnnxLayerRunner(calibrated, moved, batches, learned_codes=True)
    assert "conv1" in [layer.name for layer in runner.layers()]


def test_a_gemm_alpha_folded_by_the_writer_is_in_the_layers_float_weight():
    # The writer quantizes alpha * B (integer Gemm needs alpha 1); the runner once compared
    # the stored codes with B itself and refused the model ("does not quantize").
    model = gemm_mlp()
    fc1 = next(n for n in model.graph.node if n.name == "fc1")
    fc1.attribute.append(onnx.helper.make_attribute("alpha", 0.5))
    batches = batches_for(model, count=2)
    calibrated, qdq = quantize_for_passes(model, batches)
    layer = OnnxLayerRunner(calibrated, qdq, batches).layers()[0]
    w1 = next(onnx.numpy_helper.to_array(t) for t in model.graph.initializer if t.name == "w1")
    np.testing.assert_array_equal(layer.float_weight, (w1 * np.float32(0.5)).T)
    np.testing.assert_array_equal(quantize(layer.float_weight, layer.weight_qparams), stored_weight_codes(qdq, "fc1").T)
