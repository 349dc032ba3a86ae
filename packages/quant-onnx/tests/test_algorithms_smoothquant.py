"""SmoothQuant on ONNX graphs: function kept, 1/s folded exactly where possible."""

from __future__ import annotations

import numpy as np
import pytest
from algorithms_models import make_model, run
from onnx import TensorProto, helper, numpy_helper

from quant_core.algorithm_config import SmoothQuantConfig
from quant_onnx.algorithms.capture import TensorCapture
from quant_onnx.algorithms.smoothquant import apply_smoothquant, apply_smoothquant_with_report

RNG = np.random.default_rng(0)
OUTLIERS = np.array([1.0, 50.0, 1.0, 0.5, 20.0, 1.0], np.float32)


def _init(name, value):
    return numpy_helper.from_array(np.asarray(value, np.float32), name)


def _dense(name, x, w, y, b=None, **attrs):
    return helper.make_node("Gemm", [x, w] + ([b] if b else []), [y], name=name, **attrs)


def _model(nodes, inits, in_shape, out_shape):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, in_shape)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)
    return make_model(nodes, [x], [y], inits)


def _batches(shape, scale=None, count=3):
    out = []
    for _ in range(count):
        x = RNG.normal(size=(8, *shape)).astype(np.float32)
        if scale is not None:
            x = x * scale
        out.append({"x": x})
    return out


def gemm_producer_model():
    w0 = RNG.normal(size=(4, 6)).astype(np.float32) * OUTLIERS  # [in, out]: outlier output channels
    inits = [_init("w0", w0), _init("b0", np.ones(6)), _init("w1", RNG.normal(size=(3, 6))), _init("b1", np.zeros(3))]
    nodes = [
        _dense("fc0", "x", "w0", "h", "b0"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        _dense("fc1", "r", "w1", "y", "b1", transB=1),
    ]
    return _model(nodes, inits, ["N", 4], ["N", 3]), _batches((4,))


def input_model():
    inits = [_init("w", RNG.normal(size=(6, 3)))]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
    return _model(nodes, inits, ["N", 5, 6], ["N", 5, 3]), _batches((5, 6), OUTLIERS)


def mul_model():
    inits = [_init("c", OUTLIERS), _init("w", RNG.normal(size=(6, 3)))]
    nodes = [
        helper.make_node("Mul", ["x", "c"], ["m"], name="mul"),
        helper.make_node("MatMul", ["m", "w"], ["y"], name="mm"),
    ]
    return _model(nodes, inits, ["N", 6], ["N", 3]), _batches((6,))


def layernorm_model():
    inits = [_init("g", OUTLIERS), _init("beta", RNG.normal(size=6)), _init("w", RNG.normal(size=(6, 3)))]
    nodes = [
        helper.make_node("LayerNormalization", ["x", "g", "beta"], ["n"], name="ln", axis=-1),
        helper.make_node("MatMul", ["n", "w"], ["y"], name="mm"),
    ]
    return _model(nodes, inits, ["N", 4, 6], ["N", 4, 3]), _batches((4, 6))


def conv_model():
    w0 = RNG.normal(size=(6, 3, 3, 3)).astype(np.float32) * OUTLIERS.reshape(6, 1, 1, 1)
    inits = [_init("w0", w0), _init("w1", RNG.normal(size=(4, 6, 1, 1)))]
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["c"], name="conv0", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("Conv", ["r", "w1"], ["y"], name="conv1"),
    ]
    return _model(nodes, inits, ["N", 3, 5, 5], ["N", 4, 5, 5]), _batches((3, 5, 5))


def stem_depthwise_model():
    """A BN-folded stem Conv straight into a depthwise Conv (PP-LCNetV3's stem): output
    channels whose ranges differ ~100x, read by one 3x3 filter each."""
    w0 = RNG.normal(size=(6, 3, 3, 3)).astype(np.float32) * OUTLIERS.reshape(6, 1, 1, 1)
    inits = [_init("w0", w0), _init("b0", RNG.normal(size=6)), _init("wd", RNG.normal(size=(6, 1, 3, 3)))]
    nodes = [
        helper.make_node("Conv", ["x", "w0", "b0"], ["c"], name="stem", pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["c", "wd"], ["y"], name="dw", pads=[1, 1, 1, 1], group=6),
    ]
    return _model(nodes, inits, ["N", 3, 5, 5], ["N", 6, 5, 5]), _batches((3, 5, 5))


def hardswish_depthwise_model():
    """A depthwise Conv after a HardSwish: ``1/s`` cannot cross it, so a Mul is inserted."""
    w0 = RNG.normal(size=(6, 3, 1, 1)).astype(np.float32) * OUTLIERS.reshape(6, 1, 1, 1)
    inits = [_init("w0", w0), _init("wd", RNG.normal(size=(6, 1, 3, 3)))]
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["c"], name="pw"),
        helper.make_node("HardSigmoid", ["c"], ["g"], name="hsig", alpha=1 / 6, beta=0.5),
        helper.make_node("Mul", ["c", "g"], ["h"], name="hswish"),
        helper.make_node("Conv", ["h", "wd"], ["y"], name="dw", pads=[1, 1, 1, 1], group=6),
    ]
    return _model(nodes, inits, ["N", 3, 5, 5], ["N", 6, 5, 5]), _batches((3, 5, 5))


@pytest.mark.parametrize(
    ("builder", "tensor", "folded"),
    [
        (gemm_producer_model, "r", "into:fc0"),
        (input_model, "x", "mul:"),
        (mul_model, "m", "into:mul"),
        (layernorm_model, "n", "into:ln"),
        (conv_model, "r", "into:conv0"),
        (stem_depthwise_model, "c", "into:stem"),
        (hardswish_depthwise_model, "h", "mul:"),
    ],
)
def test_smoothquant_keeps_function_and_flattens_channels(builder, tensor, folded):
    model, batches = builder()
    before = model.SerializeToString()
    out, report = apply_smoothquant_with_report(model, batches, SmoothQuantConfig(alpha=0.5))
    assert model.SerializeToString() == before
    smoothed = next(s for s in report.smoothed if s.tensor == tensor)
    assert smoothed.folded.startswith(folded)
    ya, yb = run(model, batches), run(out, batches)
    np.testing.assert_allclose(yb, ya, rtol=1e-4, atol=1e-4 * float(np.abs(ya).max()))

    def spread(m, name):
        value = TensorCapture(m, [name]).collect(batches)[name]
        axis = 1 if value.ndim == 4 else value.ndim - 1
        absmax = np.abs(np.moveaxis(value, axis, -1)).reshape(-1, value.shape[axis]).max(axis=0)
        return absmax.max() / absmax.min()

    reader_input = tensor if not folded.startswith("mul:") else f"{tensor}_smoothed"
    assert spread(out, reader_input) < spread(model, tensor) / 2


def test_alpha_zero_is_a_no_op_on_the_activation_side():
    model, batches = input_model()
    out = apply_smoothquant(model, batches, SmoothQuantConfig(alpha=0.0))
    np.testing.assert_allclose(run(out, batches), run(model, batches), rtol=1e-4, atol=1e-4)


def test_activation_with_a_non_dense_reader_is_left_alone():
    model, batches = input_model()
    model.graph.node.append(helper.make_node("Relu", ["x"], ["x_relu"], name="other"))
    model.graph.output.append(helper.make_tensor_value_info("x_relu", TensorProto.FLOAT, None))
    out, report = apply_smoothquant_with_report(model, batches, SmoothQuantConfig())
    assert report.smoothed == () and report.notes
    assert out.SerializeToString() == model.SerializeToString()


def test_smoothing_indexes_the_graph_once_per_activation_and_infers_no_shapes(monkeypatch):
    """Each smoothed activation reads the weights as earlier smoothing left them from one
    fresh index (plus one to find the candidates and one to add the in-graph reductions
    that measure them); folding into the producer needs no element types, so neither a
    second index nor shape inference per activation."""
    from quant_core.onnx_qdq.graph import GraphIndex
    from quant_onnx.algorithms import reductions, smoothquant
    from quant_onnx.pipeline.preprocess import shape_inference

    builds: list[int] = []

    class CountingIndex(GraphIndex):
        def __init__(self, *args, **kwargs):
            builds.append(1)
            super().__init__(*args, **kwargs)

    model, batches = gemm_producer_model()
    monkeypatch.setattr(smoothquant, "GraphIndex", CountingIndex)
    monkeypatch.setattr(reductions, "GraphIndex", CountingIndex)
    monkeypatch.setattr(shape_inference, "GraphIndex", CountingIndex)
    _, report = apply_smoothquant_with_report(model, batches, SmoothQuantConfig(alpha=0.5))
    assert report.smoothed and any(s.folded.startswith("into:") for s in report.smoothed)
    groups, _ = smoothquant._candidates(model)
    builds.clear()
    apply_smoothquant_with_report(model, batches, SmoothQuantConfig(alpha=0.5))
    assert len(builds) == 2 + len(groups)


def test_an_inserted_scale_joins_the_activation_chain_and_only_its_output_is_quantized(tmp_path):
    """The smoothed tensor is what the depthwise Conv reads at 8 bits; the HardSwish output
    before the inserted Mul stays float (quantizing it too would round the unsmoothed
    channels first)."""
    from quant_core.presets import get_preset
    from quant_onnx import quantize

    model, batches = hardswish_depthwise_model()
    config = get_preset("a8w8").evolve(algorithms=(SmoothQuantConfig(alpha=0.5),))
    result = quantize(model, tmp_path / "q.onnx", config, batches, quiet=True)
    quantized = {n.input[0] for n in result.model.graph.node if n.op_type == "QuantizeLinear"}
    assert "h" not in quantized and "h_smoothed" in quantized
    assert any("activation chain" in note for note in result.calibrated.plan.notes)


@pytest.mark.parametrize("opset", [13, 18])  # ReduceMax takes its axes as an input from opset 18
@pytest.mark.parametrize("builder", [stem_depthwise_model, input_model, conv_model])
def test_in_graph_channel_absmax_equals_numpy(builder, opset):
    from quant_onnx.algorithms import smoothquant

    model, batches = builder()
    model.opset_import[0].version = opset
    groups, _ = smoothquant._candidates(model)
    absmax, ranks = smoothquant._measure(model, groups, batches)
    for tensor in groups:
        value = TensorCapture(model, [tensor]).collect(batches)[tensor]
        axis = 1 if value.ndim == 4 else value.ndim - 1
        expected = np.abs(np.moveaxis(value, axis, -1)).reshape(-1, value.shape[axis]).max(axis=0)
        np.testing.assert_array_equal(absmax[tensor], expected.astype(np.float64))
        assert ranks[tensor] == value.ndim
