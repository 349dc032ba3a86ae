"""Empirical bias correction (quant_algos' driver over the ONNX runner) on QDQ models."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from algorithms_models import (
    batches_for,
    conv_relu_conv,
    gemm_mlp,
    initializer,
    mobilenet_block,
    quantize_for_passes,
    stored_bias_scale,
)

from quant_core.algorithm_config import BiasCorrectionConfig
from quant_core.qparams import sqnr_db
from quant_core.spec import QuantSpec
from quant_onnx.algorithms import OnnxLayerRunner, apply_bias_correction
from quant_onnx.algorithms.capture import TensorCapture


def _mean_errors(calibrated, qdq_model, batches):
    """Per layer: per-channel mean of (quantized - float) output before the activation."""
    runner = OnnxLayerRunner(calibrated, qdq_model, batches)
    out = {}
    for layer in runner.layers():
        q = np.concatenate(list(runner.quantized_outputs(layer))).astype(np.float64)
        f = np.concatenate(list(runner.float_outputs(layer)))
        axis = layer.output_channel_axis % q.ndim
        reduce = tuple(i for i in range(q.ndim) if i != axis)
        out[layer.name] = (q - f).mean(axis=reduce)
    return out


@pytest.mark.parametrize("builder", [conv_relu_conv, mobilenet_block, gemm_mlp])
@pytest.mark.parametrize("per_channel", [True, False])
def test_bias_correction_zeroes_the_mean_error_of_every_layer(builder, per_channel):
    model = builder()
    batches = batches_for(model, count=3)
    calibrated, qdq = quantize_for_passes(model, batches, per_channel=per_channel, power_of_two=not per_channel)
    before = qdq.SerializeToString()
    corrected, notes = apply_bias_correction(calibrated, qdq, batches, BiasCorrectionConfig(), quiet=True)
    assert qdq.SerializeToString() == before and notes == []
    errors_before = _mean_errors(calibrated, qdq, batches)
    for name, err in _mean_errors(calibrated, corrected, batches).items():
        # Only the rounding of the new int32 codes (half a bias step) and float noise remain.
        step = stored_bias_scale(corrected, name)
        assert np.all(np.abs(err) <= 0.5 * step + 1e-5), name
        assert np.abs(err).max() <= np.abs(errors_before[name]).max() + 1e-6
    assert [n.op_type for n in corrected.graph.node] == [n.op_type for n in qdq.graph.node]


def test_bias_correction_improves_a_biased_model():
    model = mobilenet_block()
    batches = batches_for(model, count=4)
    calibrated, qdq = quantize_for_passes(model, batches, per_channel=False, power_of_two=True)
    corrected, _ = apply_bias_correction(calibrated, qdq, batches, BiasCorrectionConfig(), quiet=True)
    f = TensorCapture(model, ["y"]).collect(batches)["y"]
    q0 = TensorCapture(qdq, ["y"]).collect(batches)["y"]
    q1 = TensorCapture(corrected, ["y"]).collect(batches)["y"]
    assert sqnr_db(f, q1) > sqnr_db(f, q0) + 1.0


def test_layer_without_bias_gets_an_int32_bias_by_the_bias_rule():
    model = conv_relu_conv()
    conv2 = next(n for n in model.graph.node if n.name == "conv2")
    del conv2.input[2]
    batches = batches_for(model, count=2)
    calibrated, qdq = quantize_for_passes(model, batches)
    assert calibrated.plan.bias_of("conv2").tensor == ""  # the plan's slot for a bias to come
    corrected, _ = apply_bias_correction(calibrated, qdq, batches, BiasCorrectionConfig(num_samples=8), quiet=True)
    node = next(n for n in corrected.graph.node if n.name == "conv2")
    assert len(node.input) == 3
    dq = next(n for n in corrected.graph.node if node.input[2] in n.output)
    assert dq.op_type == "DequantizeLinear"
    codes = initializer(corrected, dq.input[0])
    assert codes.dtype == np.int32 and np.any(codes != 0)
    slot = calibrated.plan.bias_of("conv2")
    in_scale = calibrated.input_qparams("conv2", slot.input_tensor).scale
    np.testing.assert_allclose(initializer(corrected, dq.input[1]), in_scale * calibrated.weight_qparams["conv2"].scale)
    err = _mean_errors(calibrated, corrected, batches[:1])["conv2"]
    assert np.all(np.abs(err) <= 0.5 * stored_bias_scale(corrected, "conv2") + 1e-5)


def test_an_int8_bias_spec_stays_int8_through_bias_correction():
    # Device formats store the bias as int8 at its own power-of-two scale (the NPU profile's
    # default): the corrected codes keep that format, so the model still loads and runs.
    model = conv_relu_conv()
    batches = batches_for(model, count=2)
    spec = QuantSpec(dtype="int8", scale_type="power_of_two")
    calibrated, qdq = quantize_for_passes(model, batches, per_channel=False, power_of_two=True, bias=spec)
    corrected, _ = apply_bias_correction(calibrated, qdq, batches, BiasCorrectionConfig(), quiet=True)
    for name in ("conv1", "conv2"):
        node = next(n for n in corrected.graph.node if n.name == name)
        dq = next(n for n in corrected.graph.node if node.input[2] in n.output)
        assert {initializer(corrected, dq.input[i]).dtype for i in (0, 2)} == {np.dtype(np.int8)}, name
    out = TensorCapture(corrected, ["y"]).collect(batches)["y"]  # onnxruntime loads and runs it
    assert np.all(np.isfinite(out))


def test_num_samples_limits_the_data_used():
    model = conv_relu_conv()
    batches = batches_for(model, count=4)
    calibrated, qdq = quantize_for_passes(model, batches)
    a, _ = apply_bias_correction(calibrated, qdq, batches, BiasCorrectionConfig(num_samples=8), quiet=True)
    b, _ = apply_bias_correction(calibrated, qdq, batches[:1], BiasCorrectionConfig(), quiet=True)
    assert a.SerializeToString() == b.SerializeToString()


def _with_float_bias(qdq, layer: str, value: np.ndarray):
    """``qdq`` with ``layer``'s bias replaced by a float initializer holding ``value``."""
    out = onnx.ModelProto()
    out.CopyFrom(qdq)
    node = next(n for n in out.graph.node if n.name == layer)
    node.input[2] = f"{layer}_float_bias"
    out.graph.initializer.append(onnx.numpy_helper.from_array(value, node.input[2]))
    return out


@pytest.mark.parametrize("bias_shape", [(1,), (), (1, 1)])
def test_a_broadcast_float_gemm_bias_is_corrected_per_channel(bias_shape):
    # A Gemm C of one value broadcast over the channels once reached the driver as shape (1,):
    # "bias: shape (1,) does not match 4 output channels", naming no node.
    model = gemm_mlp()
    batches = batches_for(model, count=2)
    calibrated, qdq = quantize_for_passes(model, batches)
    broadcast = _with_float_bias(qdq, "fc2", np.full(bias_shape, 0.25, np.float32))
    fc2 = next(layer for layer in OnnxLayerRunner(calibrated, broadcast, batches).layers() if layer.name == "fc2")
    np.testing.assert_array_equal(fc2.bias, np.full(4, 0.25, np.float32))
    corrected, _ = apply_bias_correction(calibrated, broadcast, batches, BiasCorrectionConfig(), quiet=True)
    node = next(n for n in corrected.graph.node if n.name == "fc2")
    dq = next(n for n in corrected.graph.node if node.input[2] in n.output)
    assert dq.op_type == "DequantizeLinear" and initializer(corrected, dq.input[0]).shape == (4,)
    assert "fc2_float_bias" not in {t.name for t in corrected.graph.initializer}
    out = TensorCapture(corrected, ["y"]).collect(batches)["y"]  # onnxruntime loads and runs it
    assert np.all(np.isfinite(out))
