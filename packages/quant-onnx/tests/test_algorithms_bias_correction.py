"""Bias correction, empirical and analytic (quant_algos' driver over the ONNX runner), on QDQ
models."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from algorithms_models import (
    batches_for,
    conv_relu_conv,
    gemm_mlp,
    initializer,
    make_model,
    matmul_mlp,
    mobilenet_block,
    quantize_for_passes,
    run,
    stored_bias_scale,
)
from onnx import TensorProto, helper, numpy_helper

from quant_core.algorithm_config import BiasCorrectionConfig
from quant_core.presets import get_preset
from quant_core.qparams import sqnr_db
from quant_core.spec import QuantSpec
from quant_onnx import ModelQuantizer
from quant_onnx.algorithms import OnnxLayerRunner, apply_bias_correction
from quant_onnx.algorithms.capture import TensorCapture
from quant_onnx.pipeline.calibrate import CalibratedModel


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


def _stored_weight(qdq: onnx.ModelProto, layer: str) -> np.ndarray:
    """``layer``'s weight as the file holds it (codes times the DequantizeLinear's scale), in
    the float model's layout."""
    node = next(n for n in qdq.graph.node if n.name == layer)
    dq = next(n for n in qdq.graph.node if node.input[1] in n.output)
    codes = initializer(qdq, dq.input[0]).astype(np.float64)
    scale = initializer(qdq, dq.input[1]).astype(np.float64)
    axis = next((helper.get_attribute_value(a) for a in dq.attribute if a.name == "axis"), 1)
    return codes * (
        scale.reshape([-1 if i == axis % codes.ndim else 1 for i in range(codes.ndim)]) if scale.ndim else scale
    )


def _mean_response(model, node, delta, batches) -> np.ndarray:
    """onnxruntime's mean output, per channel over samples and positions, of ``node`` with
    weight ``delta`` and no bias, on the float model's inputs of ``node``."""
    inputs = TensorCapture(model, [node.input[0]]).collect(batches)[node.input[0]]
    probe = helper.make_node(node.op_type, ["x", "delta"], ["y"], name="probe")
    probe.attribute.extend(node.attribute)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, inputs.shape)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [None] * inputs.ndim)
    one = make_model([probe], [x], [y], [numpy_helper.from_array(delta.astype(np.float32), "delta")])
    out = TensorCapture(one, ["y"]).collect([{"x": inputs}])["y"].astype(np.float64)
    axis = 1 if node.op_type == "Conv" else out.ndim - 1
    return out.mean(axis=tuple(i for i in range(out.ndim) if i != axis))


def _bias_values(qdq: onnx.ModelProto, layer: str) -> np.ndarray:
    node = next(n for n in qdq.graph.node if n.name == layer)
    dq = next(n for n in qdq.graph.node if node.input[2] in n.output)
    return initializer(qdq, dq.input[0]).astype(np.float64) * initializer(qdq, dq.input[1])


@pytest.mark.parametrize("builder", [conv_relu_conv, mobilenet_block, gemm_mlp])
def test_analytic_bias_correction_subtracts_what_the_weight_rounding_adds_to_the_mean(builder):
    # The reference: onnxruntime runs each layer with the stored-minus-float weight on the
    # float model's inputs (padding and groups as the layer has them) and averages the output.
    model = builder()
    # Inputs of mean 1: what a first layer's rounding shifts is then well above a bias step.
    batches = [{k: v + 1.0 for k, v in batch.items()} for batch in batches_for(model, count=3)]
    calibrated, qdq = quantize_for_passes(model, batches)
    before = qdq.SerializeToString()
    corrected, notes = apply_bias_correction(
        calibrated, qdq, batches, BiasCorrectionConfig(method="analytic"), quiet=True
    )
    assert qdq.SerializeToString() == before and notes == []
    layers = [n.name for n in model.graph.node if n.op_type in ("Conv", "Gemm")]
    for name in layers:
        node = next(n for n in calibrated.model.graph.node if n.name == name)
        float_weight = initializer(calibrated.model, node.input[1]).astype(np.float64)
        delta = _stored_weight(qdq, name) - float_weight
        shift = _mean_response(calibrated.model, node, delta, batches)
        step = stored_bias_scale(corrected, name)
        assert np.any(np.abs(shift) > step), name  # the test would see a correction left out
        np.testing.assert_allclose(
            _bias_values(qdq, name) - _bias_values(corrected, name), shift, atol=float(np.max(step)) + 1e-6
        )
    assert [n.op_type for n in corrected.graph.node] == [n.op_type for n in qdq.graph.node]


def test_analytic_bias_correction_reads_the_codes_a_learned_pass_wrote():
    model = conv_relu_conv()
    batches = batches_for(model, count=2)
    calibrated, qdq = quantize_for_passes(model, batches)
    runner = OnnxLayerRunner(calibrated, qdq, batches)
    layer = runner.layers()[0]
    codes = np.clip(np.round(layer.float_weight / 0.05), -127, 127)  # not the float weight's rounding
    runner.set_weight_codes(layer, codes)
    from quant_core.qparams import dequantize

    np.testing.assert_array_equal(runner.quantized_weight(layer), dequantize(codes, layer.weight_qparams))


def _mean_add_errors(calibrated: CalibratedModel, qdq: onnx.ModelProto, batches) -> dict[str, np.ndarray]:
    """Per Add after a MatMul: the per-channel mean of (quantized - float) over samples and tokens."""
    outputs = ["h", "y"]
    f = TensorCapture(calibrated.model, outputs).collect(batches)
    q = TensorCapture(qdq, outputs).collect(batches)
    return {t: (q[t].astype(np.float64) - f[t]).reshape(-1, f[t].shape[-1]).mean(axis=0) for t in outputs}


@pytest.mark.parametrize("method", ["empirical", "analytic"])
def test_a_matmul_then_add_has_its_float_bias_corrected(method):
    # A linear layer over tokens from an ONNX exporter is MatMul then Add: the bias stays a
    # float constant on the Add (here after fc1's quantized output, and straight after fc2),
    # and bias correction now reaches it (it skipped every one).
    model = matmul_mlp(sizes=(12, 4, 4))
    batches = [{k: v + 1.0 for k, v in batch.items()} for batch in batches_for(model, count=3)]
    calibrated, qdq = quantize_for_passes(model, batches)
    layers = OnnxLayerRunner(calibrated, qdq, batches).layers()
    assert [(layer.name, layer.bias_allowed) for layer in layers] == [("fc1", True), ("fc2", True)]
    corrected, notes = apply_bias_correction(calibrated, qdq, batches, BiasCorrectionConfig(method=method), quiet=True)
    assert notes == []
    constants = {t.name: t for t in corrected.graph.initializer}
    adds = {n.name: n for n in corrected.graph.node if n.op_type == "Add"}
    for add in adds.values():
        assert [constants[i].data_type for i in add.input if i in constants] == [TensorProto.FLOAT]
    assert initializer(corrected, "b2").shape == (1, 4)
    if method == "empirical":  # every mean error gone, float noise apart (the bias is float)
        for tensor, err in _mean_add_errors(calibrated, corrected, batches).items():
            np.testing.assert_allclose(err, 0.0, atol=1e-5, err_msg=tensor)
    else:  # the bias moved by mean(x @ (W_q - W)) over samples and tokens
        for layer, source, bias in (("fc1", "x", "b1"), ("fc2", "r", "b2")):
            x = TensorCapture(calibrated.model, [source]).collect(batches)[source].astype(np.float64)
            node = next(n for n in calibrated.model.graph.node if n.name == layer)
            delta = _stored_weight(qdq, layer) - initializer(calibrated.model, node.input[1])
            shift = (x @ delta).reshape(-1, delta.shape[1]).mean(axis=0)
            assert np.abs(shift).max() > 1e-3, layer  # a shift this test would see left out
            moved = initializer(model, bias).reshape(-1) - initializer(corrected, bias).reshape(-1)
            np.testing.assert_allclose(moved, shift, rtol=1e-4, atol=1e-6)
    f = run(calibrated.model, batches)
    assert sqnr_db(f, run(corrected, batches)) > sqnr_db(f, run(qdq, batches))


@pytest.mark.parametrize("method", ["empirical", "analytic"])
def test_a_matmul_then_add_whose_bias_xint8_quantizes_is_corrected_on_its_grid(method):
    # xint8 quantizes the Add's bias like any other input (codes behind a DequantizeLinear):
    # bias correction used to pass such a MatMul by without a note, its error left whole.
    model = matmul_mlp(sizes=(12, 4, 4))
    batches = [{k: v + 1.0 for k, v in batch.items()} for batch in batches_for(model, count=3)]
    calibrated, qdq = quantize_for_passes(model, batches, power_of_two=True)
    dq_of = {n.output[0]: n for n in qdq.graph.node if n.op_type == "DequantizeLinear"}
    add = next(n for n in qdq.graph.node if n.name == "fc2_bias")
    bias_dq = next(
        dq_of[i] for i in add.input if i in dq_of and dq_of[i].input[0] in {t.name for t in qdq.graph.initializer}
    )
    assert [(layer.name, layer.bias_allowed) for layer in OnnxLayerRunner(calibrated, qdq, batches).layers()] == [
        ("fc1", True),
        ("fc2", True),
    ]
    corrected, notes = apply_bias_correction(calibrated, qdq, batches, BiasCorrectionConfig(method=method), quiet=True)
    assert notes == []
    before, after = (initializer(m, bias_dq.input[0]) for m in (qdq, corrected))
    assert after.dtype == before.dtype and after.shape == before.shape and not np.array_equal(after, before)
    assert np.array_equal(initializer(corrected, bias_dq.input[1]), initializer(qdq, bias_dq.input[1]))
    errors_before = _mean_add_errors(calibrated, qdq, batches)
    errors_after = _mean_add_errors(calibrated, corrected, batches)
    for tensor in ("h", "y"):  # what is left: the outputs' own coarse grid (0.125) and the bias's step
        assert np.abs(errors_after[tensor]).max() < 0.25 * np.abs(errors_before[tensor]).max(), tensor
    f = run(calibrated.model, batches)
    assert sqnr_db(f, run(corrected, batches)) > sqnr_db(f, run(qdq, batches))


def test_a_float_bias_two_adds_read_is_left_alone():
    # Rewriting it for one layer would change the other's.
    model = matmul_mlp(sizes=(12, 4, 4))
    batches = batches_for(model, count=2)
    calibrated, qdq = quantize_for_passes(model, batches)
    next(n for n in qdq.graph.node if n.name == "fc2_bias").input[0] = "b1"  # [4] against b2's [1, 4]
    layers = OnnxLayerRunner(calibrated, qdq, batches).layers()
    assert [(layer.name, layer.bias_allowed) for layer in layers] == [("fc1", False), ("fc2", False)]
    corrected, _ = apply_bias_correction(calibrated, qdq, batches, BiasCorrectionConfig(), quiet=True)
    np.testing.assert_array_equal(initializer(corrected, "b1"), initializer(model, "b1"))


@pytest.mark.parametrize("builder", [conv_relu_conv, mobilenet_block, matmul_mlp])
def test_the_calibration_pass_takes_the_means_the_analytic_correction_reads(builder):
    # The quantizer asks the calibration pass for every layer input's float mean over the
    # correction's first samples; the correction then runs no float pass of its own and
    # writes the biases its own pass would have written.
    model = builder()
    batches = [{k: v + 1.0 for k, v in batch.items()} for batch in batches_for(model, count=3)]
    correction = BiasCorrectionConfig(method="analytic", num_samples=20)  # two batches and a half
    quantizer = ModelQuantizer(get_preset("a8w8").evolve(algorithms=(correction,)), quiet=True)
    calibrated = quantizer.calibrate(quantizer.prepare(model), batches)
    means = calibrated.input_means
    assert means is not None and means.samples == 20 and means.values
    for tensor, mean in means.values.items():  # an independent numpy mean over those samples
        x = TensorCapture(calibrated.model, [tensor]).collect(batches)[tensor][:20].astype(np.float64)
        expected = x.mean(axis=0) if means.conv[tensor] else x.reshape(-1, x.shape[-1]).mean(axis=0)
        np.testing.assert_allclose(mean, expected, rtol=1e-6, atol=1e-7, err_msg=tensor)
    qdq = quantizer.write(calibrated).model
    taken, notes = apply_bias_correction(calibrated, qdq, batches, correction, quiet=True)
    own, own_notes = apply_bias_correction(calibrated.evolve(input_means=None), qdq, batches, correction, quiet=True)
    assert notes == own_notes
    own_values = {t.name: numpy_helper.to_array(t) for t in own.graph.initializer}
    changed = 0
    for tensor in taken.graph.initializer:
        value, reference = numpy_helper.to_array(tensor), own_values[tensor.name]
        changed += not np.array_equal(value, reference)
        if np.issubdtype(value.dtype, np.integer):  # bias codes: float sums in another order, a code at most
            assert np.abs(value.astype(np.int64) - reference.astype(np.int64)).max() <= 1, tensor.name
        else:
            np.testing.assert_allclose(value, reference, rtol=1e-5, atol=1e-7, err_msg=tensor.name)
    assert changed <= 2


def test_no_means_are_taken_without_an_analytic_correction():
    model = conv_relu_conv()
    for algorithms in ((), (BiasCorrectionConfig(),)):
        quantizer = ModelQuantizer(get_preset("a8w8").evolve(algorithms=algorithms), quiet=True)
        assert quantizer.calibrate(quantizer.prepare(model), batches_for(model, count=1)).input_means is None


def test_the_calibration_pass_means_cover_input_samples_where_a_tensor_has_more_rows():
    # A Reshape folds each sample into two rows of the Conv's input: the first 3 samples
    # are its first 6 rows, as the correction's own pass (prepare_batches) takes them.
    from conftest import make_model, tensor, vi

    rng = np.random.default_rng(2)
    inits = [
        tensor("shape", np.array([-1, 4, 5, 5], np.int64)),
        tensor("w", rng.normal(size=(3, 4, 1, 1)).astype(np.float32)),
        tensor("b", np.zeros(3, np.float32)),
    ]
    nodes = [
        helper.make_node("Reshape", ["x", "shape"], ["r"], name="reshape"),
        helper.make_node("Conv", ["r", "w", "b"], ["y"], name="conv"),
    ]
    model = make_model(nodes, [vi("x", ["N", 8, 5, 5])], [vi("y", ["M", 3, 5, 5])], inits, opset=17)
    x = (rng.normal(size=(4, 8, 5, 5)) * np.arange(1, 5, dtype=np.float32)[:, None, None, None] + 1.0).astype(
        np.float32
    )
    batches = [{"x": x}]
    correction = BiasCorrectionConfig(method="analytic", num_samples=3)
    quantizer = ModelQuantizer(get_preset("a8w8").evolve(algorithms=(correction,)), quiet=True)
    means = quantizer.calibrate(quantizer.prepare(model), batches).input_means
    assert means is not None and means.samples == 3
    expected = x[:3].reshape(6, 4, 5, 5).astype(np.float64).mean(axis=0)
    np.testing.assert_allclose(means.values["r"], expected, rtol=1e-6, atol=1e-7)
