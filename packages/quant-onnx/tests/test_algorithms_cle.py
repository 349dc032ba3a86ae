"""Cross-layer equalization on ONNX graphs: chains found, float function kept,
Relu6 replacement reported, high-bias absorption."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from algorithms_models import batches_for, conv_relu_conv, gemm_mlp, make_model, mobilenet_block, run
from onnx import TensorProto, helper, numpy_helper

from quant_algos.drivers.cle import ChannelMoments
from quant_algos.drivers.cle_chains import find_chains
from quant_algos.layer import Layer, input_ranges, output_ranges
from quant_core.algorithm_config import CLEConfig
from quant_onnx.algorithms.cle import apply_cle
from quant_onnx.pipeline.annotate import plan_graph


def _weight(model: onnx.ModelProto, name: str) -> np.ndarray:
    return next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == name)


def _assert_same_function(a: onnx.ModelProto, b: onnx.ModelProto, batches) -> None:
    ya, yb = run(a, batches), run(b, batches)
    np.testing.assert_allclose(yb, ya, rtol=1e-5, atol=1e-5 * float(np.abs(ya).max()))


def test_conv_relu_conv_keeps_function_and_equalizes_ranges():
    model = conv_relu_conv()
    before = model.SerializeToString()
    out, report = apply_cle(model, CLEConfig(absorb_high_bias=False))
    assert model.SerializeToString() == before  # input untouched
    assert report.chains == (("conv1", "conv2"),)
    assert report.replaced_relu6 == ()
    _assert_same_function(model, out, batches_for(model))
    r1 = output_ranges(Layer(_weight(out, "w1")))
    r2 = input_ranges(Layer(_weight(out, "w2")))
    np.testing.assert_allclose(r1, r2, rtol=1e-5)
    assert not np.allclose(output_ranges(Layer(_weight(model, "w1"))), input_ranges(Layer(_weight(model, "w2"))))


def test_mobilenet_block_triple_with_relu6_replacement_keeps_the_relu_function():
    model = mobilenet_block(relu6=True)
    out, report = apply_cle(model, CLEConfig(absorb_high_bias=False, steps=0))
    assert report.chains == (("conv1", "dw", "conv3"),)
    assert report.replaced_relu6 == ("clip1", "clip2")
    assert [n.op_type for n in out.graph.node if n.name in ("clip1", "clip2")] == ["Relu", "Relu"]
    # Equalization itself is exact: compare with the same network built with Relu.
    _assert_same_function(mobilenet_block(relu6=False), out, batches_for(model))
    ranges = [output_ranges(Layer(_weight(out, "w1"))), output_ranges(Layer(_weight(out, "wd"), None, groups=16))]
    np.testing.assert_allclose(ranges[0], ranges[1], rtol=1e-4)
    np.testing.assert_allclose(ranges[1], input_ranges(Layer(_weight(out, "w3"))), rtol=1e-4)


@pytest.mark.parametrize("gain", [0.01, 100.0])
def test_relu6_replacement_checked_on_data_keeps_the_float_function(gain):
    """With calibration data, only Clip(0, 6) nodes that clip nothing become Relu."""
    model = mobilenet_block(relu6=True)
    batches = [{k: v * np.float32(gain) for k, v in b.items()} for b in batches_for(model)]
    out, report = apply_cle(model, CLEConfig(absorb_high_bias=False, steps=0), batches)
    if gain < 1:  # clip1's inputs stay below 6 (clip2's biases still reach it)
        assert "clip1" in report.replaced_relu6 and report.chains
    else:  # both clip: kept, and nothing crosses them
        assert report.replaced_relu6 == () and report.chains == ()
        assert any("kept 2 Clip(0, 6) of 2" in note for note in report.notes)
    _assert_same_function(model, out, batches)


def test_relu6_without_replacement_forms_no_chain():
    model = mobilenet_block(relu6=True)
    out, report = apply_cle(model, CLEConfig(replace_relu6_with_relu=False))
    assert report.chains == () and report.notes
    _assert_same_function(model, out, batches_for(model))


def test_gemm_chain_with_both_weight_layouts():
    model = gemm_mlp()
    out, report = apply_cle(model, CLEConfig(absorb_high_bias=False, steps=3))
    assert report.chains == (("fc1", "fc2"),) and report.steps == 3
    _assert_same_function(model, out, batches_for(model))


def test_shared_weight_is_not_rescaled():
    model = conv_relu_conv()
    model.graph.node[2].input[1] = "w1_shared"
    w1 = _weight(model, "w1")
    model.graph.initializer.append(numpy_helper.from_array(np.zeros((6, 8, 3, 3), np.float32), "w1_shared"))
    model.graph.node.append(helper.make_node("Conv", ["r1", "w1_shared"], ["y2"], name="other", pads=[1, 1, 1, 1]))
    model.graph.output.append(helper.make_tensor_value_info("y2", TensorProto.FLOAT, None))
    assert w1.shape == (8, 3, 3, 3)
    assert find_chains(plan_graph(model), replace_relu6=True).chains == []  # r1 has two readers


def _padded_between(pads: list[int]) -> onnx.ModelProto:
    model = conv_relu_conv()
    nodes = list(model.graph.node)
    nodes[2].input[0] = "padded"
    nodes[2].attribute.pop()  # drop its own pads
    pad_value = numpy_helper.from_array(np.array(pads, np.int64), "pads")
    nodes.insert(2, helper.make_node("Pad", ["r1", "pads"], ["padded"], name="pad"))
    return make_model(nodes, list(model.graph.input), list(model.graph.output), [*model.graph.initializer, pad_value])


def test_zero_pad_between_layers_is_crossed():
    padded = _padded_between([0, 0, 1, 1, 0, 0, 1, 1])
    out, report = apply_cle(padded, CLEConfig(absorb_high_bias=False))
    assert report.chains == (("conv1", "conv2"),)
    _assert_same_function(padded, out, batches_for(padded))


def test_a_pad_that_shifts_the_channels_ends_the_chain():
    """Channel i of the first layer reaches input channel i + 1 of the second: a scale
    moved through it would land on the wrong channel."""
    shifted = _padded_between([0, 1, 0, 0, 0, -1, 0, 0])
    out, report = apply_cle(shifted, CLEConfig(absorb_high_bias=False))
    assert report.chains == ()
    _assert_same_function(shifted, out, batches_for(shifted))


def _high_bias_model() -> onnx.ModelProto:
    rng = np.random.default_rng(3)
    inits = [
        numpy_helper.from_array(rng.normal(size=(6, 4, 1, 1)).astype(np.float32) * 0.1, "w1"),
        numpy_helper.from_array(np.full(6, 5.0, np.float32), "b1"),
        numpy_helper.from_array(rng.normal(size=(3, 6, 1, 1)).astype(np.float32), "w2"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu"),
        helper.make_node("Conv", ["r1", "w2"], ["y"], name="conv2"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 5, 5])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3, 5, 5])
    return make_model(nodes, [x], [y], inits)


def test_high_bias_absorption_moves_bias_and_keeps_function():
    model = _high_bias_model()
    batches = batches_for(model)
    out, report = apply_cle(model, CLEConfig(), batches)
    assert report.absorbed == ("conv1",)
    conv2 = next(n for n in out.graph.node if n.name == "conv2")
    assert len(conv2.input) == 3 and conv2.input[2]  # conv2 got a bias
    assert np.abs(_weight(out, conv2.input[2])).max() > 1.0  # a sizeable amount moved
    # Exact wherever the pre-activation stays above the absorbed amount (mean - 3 std):
    # nearly everywhere on its own calibration data (1x1 convs: no padded borders).
    ya, yb = run(model, batches), run(out, batches)
    close = np.isclose(yb, ya, rtol=1e-5, atol=1e-5 * float(np.abs(ya).max()))
    assert close.mean() > 0.98


@pytest.mark.parametrize("second", ["padded conv", "pad node", "bias-free matmul"])
def test_no_absorption_where_the_second_layer_cannot_make_up_for_it(second: str):
    # A zero-padded border never held the absorbed amount (the float model changed by 18%
    # on 8x8 maps); a MatMul has no bias input (the written model did not load).
    model = _high_bias_model()
    graph = model.graph
    if second == "padded conv":
        conv2 = next(n for n in graph.node if n.name == "conv2")
        w2 = next(i for i in graph.initializer if i.name == "w2")
        w2.CopyFrom(
            numpy_helper.from_array(np.random.default_rng(4).normal(size=(3, 6, 3, 3)).astype(np.float32), "w2")
        )
        conv2.attribute.append(helper.make_attribute("pads", [1, 1, 1, 1]))
    elif second == "pad node":
        relu = next(n for n in graph.node if n.name == "relu")
        relu.output[0] = "r0"
        pads = numpy_helper.from_array(np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64), "pads")
        graph.initializer.append(pads)
        index = list(graph.node).index(relu) + 1
        graph.node.insert(index, helper.make_node("Pad", ["r0", "pads"], ["r1"], name="pad"))
        graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3, 7, 7]))
    else:
        rng = np.random.default_rng(5)
        inits = [
            numpy_helper.from_array(rng.normal(size=(4, 6)).astype(np.float32) * 0.1, "w1"),
            numpy_helper.from_array(np.full(6, 5.0, np.float32), "b1"),
            numpy_helper.from_array(rng.normal(size=(6, 3)).astype(np.float32), "w2"),
        ]
        nodes = [
            helper.make_node("Gemm", ["x", "w1", "b1"], ["c1"], name="fc1"),
            helper.make_node("Relu", ["c1"], ["r1"], name="relu"),
            helper.make_node("MatMul", ["r1", "w2"], ["y"], name="fc2"),
        ]
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])
        model = make_model(nodes, [x], [y], inits)
    batches = batches_for(model)
    out, report = apply_cle(model, CLEConfig(), batches)
    assert report.absorbed == ()
    ya, yb = run(model, batches), run(out, batches)
    np.testing.assert_allclose(yb, ya, rtol=1e-4, atol=1e-4 * float(np.abs(ya).max()))


def test_absorption_without_data_is_skipped_and_reported():
    model = _high_bias_model()
    _, report = apply_cle(model, CLEConfig())
    assert report.absorbed == () and any("no calibration data" in n for n in report.notes)


def test_channel_moments_match_numpy():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 3, 5, 5)) * [[[[1.0]], [[2.0]], [[3.0]]]]
    m = ChannelMoments(axis=1)
    m.update(x[:2].astype(np.float32))
    m.update(x[2:].astype(np.float32))
    np.testing.assert_allclose(m.mean(), x.mean(axis=(0, 2, 3)), atol=1e-6)
    np.testing.assert_allclose(m.std(), x.std(axis=(0, 2, 3)), rtol=1e-5)


def test_report_is_json_ready():
    _, report = apply_cle(conv_relu_conv(), CLEConfig(absorb_high_bias=False))
    import json

    assert json.loads(json.dumps(report.to_dict()))["chains"] == [["conv1", "conv2"]]


@pytest.mark.parametrize("steps", [1, 0])
def test_cle_is_deterministic(steps):
    model = mobilenet_block()
    a, _ = apply_cle(model, CLEConfig(steps=steps))
    b, _ = apply_cle(model, CLEConfig(steps=steps))
    assert a.SerializeToString() == b.SerializeToString()


@pytest.mark.parametrize("pool", ["MaxPool", "AveragePool"])
def test_scales_do_not_cross_a_pool_over_a_dense_layers_channels(pool: str):
    # A MatMul's channels are the last axis, which a 4-D pool mixes: CLE chained such
    # layers (relative error 0.58-0.97) and SmoothQuant folded across the pool (0.04-0.45).
    from quant_core.algorithm_config import SmoothQuantConfig
    from quant_onnx.algorithms.smoothquant import apply_smoothquant_with_report

    rng = np.random.default_rng(0)
    spread = np.array([1, 40, 1, 0.3, 10, 1, 2, 5], np.float32)
    inits = [
        numpy_helper.from_array((rng.normal(size=(6, 8)) * spread).astype(np.float32), "w0"),
        numpy_helper.from_array(rng.normal(size=(8, 3)).astype(np.float32), "w1"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w0"], ["h"], name="mm0"),
        helper.make_node(pool, ["h"], ["p"], name="pool", kernel_shape=[1, 3], pads=[0, 1, 0, 1]),
        helper.make_node("MatMul", ["p", "w1"], ["y"], name="mm1"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 5, 6])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 5, 3])
    model = make_model(nodes, [x], [y], inits)
    batches = [{"x": rng.normal(size=(2, 3, 5, 6)).astype(np.float32)} for _ in range(3)]
    cle_out, report = apply_cle(model, CLEConfig(absorb_high_bias=False))
    assert report.chains == ()
    smoothed, _ = apply_smoothquant_with_report(model, batches, SmoothQuantConfig())
    for out in (cle_out, smoothed):
        np.testing.assert_allclose(run(out, batches), run(model, batches), rtol=1e-4, atol=1e-4)
