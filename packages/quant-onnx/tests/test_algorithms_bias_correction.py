"""Empirical bias correction on standard QDQ models."""

from __future__ import annotations

import numpy as np
import pytest
from algorithms_models import batches_for, conv_relu_conv, gemm_mlp, mobilenet_block, write_qdq
from onnx import numpy_helper

from quant_core.algorithm_config import BiasCorrectionConfig
from quant_core.qparams import sqnr_db
from quant_onnx.algorithms.bias_correction import apply_bias_correction
from quant_onnx.algorithms.capture import TensorCapture
from quant_onnx.algorithms.qdq_layers import bias_scale, find_qdq_layers
from quant_onnx.errors import ModelError


def _mean_errors(float_model, qdq_model, batches):
    """Per layer: per-channel mean of (quantized - float) pre-activation output."""
    layers = find_qdq_layers(qdq_model)
    names = [layer.output_tensor for layer in layers]
    q = TensorCapture(qdq_model, names).collect(batches)
    f = TensorCapture(float_model, names).collect(batches)
    out = {}
    for layer in layers:
        axis = layer.channel_axis % q[layer.output_tensor].ndim
        reduce = tuple(i for i in range(q[layer.output_tensor].ndim) if i != axis)
        diff = q[layer.output_tensor].astype(np.float64) - f[layer.output_tensor]
        out[layer.name] = (diff.mean(axis=reduce), bias_scale(layer))
    return out


@pytest.mark.parametrize("builder", [conv_relu_conv, mobilenet_block, gemm_mlp])
@pytest.mark.parametrize("per_channel", [True, False])
def test_bias_correction_zeroes_the_mean_error_of_every_layer(builder, per_channel):
    model = builder()
    batches = batches_for(model, count=3)
    qdq = write_qdq(model, batches, per_channel=per_channel, power_of_two=not per_channel)
    before = qdq.SerializeToString()
    corrected = apply_bias_correction(model, qdq, batches, BiasCorrectionConfig(), quiet=True)
    assert qdq.SerializeToString() == before
    errors_before = _mean_errors(model, qdq, batches)
    for name, (err, scale) in _mean_errors(model, corrected, batches).items():
        # Only the rounding of the new int32 codes (half a bias step) and float noise remain.
        assert np.all(np.abs(err) <= 0.5 * scale + 1e-5), name
        assert np.abs(err).max() <= np.abs(errors_before[name][0]).max() + 1e-6
    assert [n.op_type for n in corrected.graph.node] == [n.op_type for n in qdq.graph.node]


def test_bias_correction_improves_a_biased_model():
    model = mobilenet_block()
    batches = batches_for(model, count=4)
    qdq = write_qdq(model, batches, per_channel=False, power_of_two=True)
    corrected = apply_bias_correction(model, qdq, batches, BiasCorrectionConfig(), quiet=True)
    y = "y"
    f = TensorCapture(model, [y]).collect(batches)[y]
    q0 = TensorCapture(qdq, [y]).collect(batches)[y]
    q1 = TensorCapture(corrected, [y]).collect(batches)[y]
    assert sqnr_db(f, q1) > sqnr_db(f, q0) + 1.0


def test_layer_without_bias_gets_an_int32_bias():
    model = conv_relu_conv()
    conv2 = next(n for n in model.graph.node if n.name == "conv2")
    del conv2.input[2]
    batches = batches_for(model, count=2)
    qdq = write_qdq(model, batches)
    corrected = apply_bias_correction(model, qdq, batches, BiasCorrectionConfig(num_samples=8), quiet=True)
    node = next(n for n in corrected.graph.node if n.name == "conv2")
    assert len(node.input) == 3
    dq = next(n for n in corrected.graph.node if node.input[2] in n.output)
    assert dq.op_type == "DequantizeLinear"
    codes = next(numpy_helper.to_array(t) for t in corrected.graph.initializer if t.name == dq.input[0])
    assert codes.dtype == np.int32 and np.any(codes != 0)
    (layer,) = [layer for layer in find_qdq_layers(corrected) if layer.name == "conv2"]
    in_scale = float(layer.input_scale)
    np.testing.assert_allclose(layer.bias.qparams.scale, in_scale * layer.weight.qparams.scale, rtol=1e-6)
    err, scale = _mean_errors(model, corrected, batches[:1])["conv2"]
    assert np.all(np.abs(err) <= 0.5 * scale + 1e-5)


def test_num_samples_limits_the_data_used():
    model = conv_relu_conv()
    batches = batches_for(model, count=4)
    qdq = write_qdq(model, batches)
    a = apply_bias_correction(model, qdq, batches, BiasCorrectionConfig(num_samples=8), quiet=True)
    b = apply_bias_correction(model, qdq, batches[:1], BiasCorrectionConfig(), quiet=True)
    assert a.SerializeToString() == b.SerializeToString()


def test_float_model_that_does_not_match_is_rejected():
    model = conv_relu_conv(seed=0)
    batches = batches_for(model, count=1)
    qdq = write_qdq(model, batches)
    with pytest.raises(ModelError, match=r"conv1.*does not quantize"):
        apply_bias_correction(conv_relu_conv(seed=7), qdq, batches, BiasCorrectionConfig(), quiet=True)
