"""Small float models for the algorithm tests, and the quantizer's calibrated plan and
QDQ model for them (what the post-passes take: their qparams come from the plan, never
from the file)."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from quant_core.presets import get_preset
from quant_core.spec import QuantSpec
from quant_onnx.algorithms.capture import TensorCapture
from quant_onnx.api import ModelQuantizer
from quant_onnx.pipeline.calibrate import CalibratedModel

OPSET = 17


def make_model(nodes, inputs, outputs, initializers) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "test", inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=9)
    onnx.checker.check_model(model)
    return model


def conv(name, x, w, b, y, **attrs) -> list:
    return [helper.make_node("Conv", [x, w] + ([b] if b else []), [y], name=name, **attrs)]


def clip6(name, x, y, relu6: bool = True) -> list:
    if not relu6:
        return [helper.make_node("Relu", [x], [y], name=name)]
    return [helper.make_node("Clip", [x, "zero", "six"], [y], name=name)]


def _init(name, array) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(array), name)


def _ranged(rng, shape, spread) -> np.ndarray:
    """Weights whose output channels have very different ranges (what CLE fixes)."""
    w = rng.normal(size=shape).astype(np.float32)
    scales = np.exp(rng.uniform(-spread, spread, size=(shape[0],) + (1,) * (len(shape) - 1)))
    return (w * scales).astype(np.float32)


def conv_relu_conv(seed: int = 0, channels=(3, 8, 6)) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    c0, c1, c2 = channels
    inits = [
        _init("w1", _ranged(rng, (c1, c0, 3, 3), 2.0)),
        _init("b1", rng.normal(size=c1).astype(np.float32)),
        _init("w2", _ranged(rng, (c2, c1, 3, 3), 1.0) * 0.3),
        _init("b2", rng.normal(size=c2).astype(np.float32)),
    ]
    nodes = [
        *conv("conv1", "x", "w1", "b1", "c1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        *conv("conv2", "r1", "w2", "b2", "y", pads=[1, 1, 1, 1]),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", c0, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", c2, 8, 8])
    return make_model(nodes, [x], [y], inits)


def mobilenet_block(seed: int = 0, channels=(3, 16, 8), relu6: bool = True) -> onnx.ModelProto:
    """conv -> relu6 -> depthwise -> relu6 -> conv (-> relu -> gemm head); Relu instead
    of Relu6 when ``relu6`` is False (same weights)."""
    rng = np.random.default_rng(seed)
    c0, c1, c2 = channels
    inits = [
        _init("zero", np.array(0.0, np.float32)),
        _init("six", np.array(6.0, np.float32)),
        _init("w1", _ranged(rng, (c1, c0, 3, 3), 1.5) * 0.5),
        _init("b1", rng.normal(size=c1).astype(np.float32)),
        _init("wd", _ranged(rng, (c1, 1, 3, 3), 1.5)),
        _init("bd", rng.normal(size=c1).astype(np.float32)),
        _init("w3", _ranged(rng, (c2, c1, 1, 1), 1.0) * 0.3),
        _init("b3", rng.normal(size=c2).astype(np.float32)),
        _init("wf", rng.normal(size=(5, c2)).astype(np.float32) * 0.3),
        _init("bf", rng.normal(size=5).astype(np.float32)),
    ]
    nodes = [
        *conv("conv1", "x", "w1", "b1", "c1", pads=[1, 1, 1, 1], strides=[2, 2]),
        *clip6("clip1", "c1", "r1", relu6),
        *conv("dw", "r1", "wd", "bd", "c2", pads=[1, 1, 1, 1], group=c1),
        *clip6("clip2", "c2", "r2", relu6),
        *conv("conv3", "r2", "w3", "b3", "c3"),
        helper.make_node("Relu", ["c3"], ["r3"], name="relu3"),
        helper.make_node("GlobalAveragePool", ["r3"], ["p"], name="gap"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "wf", "bf"], ["y"], name="fc", transB=1),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", c0, 16, 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])
    return make_model(nodes, [x], [y], inits)


def gemm_mlp(seed: int = 0, sizes=(12, 16, 4)) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    a, b, c = sizes
    inits = [
        _init("w1", _ranged(rng, (a, b), 0.5).T.copy().T.copy()),  # [in, out] (transB=0)
        _init("b1", rng.normal(size=b).astype(np.float32)),
        _init("w2", rng.normal(size=(c, b)).astype(np.float32) * 0.3),  # [out, in] (transB=1)
        _init("b2", rng.normal(size=c).astype(np.float32)),
    ]
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="fc1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Gemm", ["r", "w2", "b2"], ["y"], name="fc2", transB=1),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", a])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", c])
    return make_model(nodes, [x], [y], inits)


def matmul_mlp(seed: int = 0, sizes=(12, 16, 4), shared_bias: bool = False) -> onnx.ModelProto:
    """A linear layer over tokens as exporters write it, twice: MatMul ``[in, out]`` then an
    Add of the bias (``shared_bias``: both Adds read one constant, so ``out`` must match)."""
    rng = np.random.default_rng(seed)
    a, b, c = sizes
    inits = [
        _init("w1", _ranged(rng, (b, a), 0.5).T.copy()),
        _init("b1", rng.normal(size=b).astype(np.float32)),
        _init("w2", (rng.normal(size=(b, c)) * 0.3).astype(np.float32)),
    ]
    if not shared_bias:
        inits.append(_init("b2", rng.normal(size=(1, c)).astype(np.float32)))
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["m1"], name="fc1"),
        helper.make_node("Add", ["m1", "b1"], ["h"], name="fc1_bias"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w2"], ["m2"], name="fc2"),
        helper.make_node("Add", ["b1" if shared_bias else "b2", "m2"], ["y"], name="fc2_bias"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 5, a])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5, c])
    return make_model(nodes, [x], [y], inits)


def batches_for(model: onnx.ModelProto, count: int = 4, batch: int = 8, seed: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    vi = model.graph.input[0]
    dims = [d.dim_value for d in vi.type.tensor_type.shape.dim[1:]]
    return [{vi.name: rng.normal(size=(batch, *dims)).astype(np.float32)} for _ in range(count)]


def run(model: onnx.ModelProto, batches: Sequence[dict], tensor: str | None = None) -> np.ndarray:
    name = tensor or model.graph.output[0].name
    return TensorCapture(model, [name]).collect(batches)[name]


def quantize_for_passes(
    float_model: onnx.ModelProto,
    batches: Sequence[dict],
    *,
    per_channel: bool = True,
    power_of_two: bool = False,
    weight_bits: int = 8,
    preset: str | None = None,
    bias: QuantSpec | None = None,
) -> tuple[CalibratedModel, onnx.ModelProto]:
    """The quantizer's calibrated plan and QDQ model for ``float_model``: what the
    post-passes take. ``power_of_two``: the ``xint8`` preset (symmetric int8 power-of-two),
    else ``a8w8``; weights per channel or per tensor, int8 or int4; ``bias``: a bias spec
    instead of the bias rule."""
    config = get_preset(preset or ("xint8" if power_of_two else "a8w8"))
    weight = config.global_config.weight
    assert weight is not None
    weight = weight.evolve(
        per_channel_axis="output" if per_channel else None, dtype="int8" if weight_bits == 8 else "int4"
    )
    global_config = attrs.evolve(config.global_config, weight=weight)
    if bias is not None:
        global_config = attrs.evolve(global_config, bias=bias)
    config = config.evolve(global_config=global_config)
    quantizer = ModelQuantizer(config, quiet=True)
    calibrated = quantizer.calibrate(quantizer.prepare(float_model), batches)
    return calibrated, quantizer.write(calibrated).model


def initializer(model: onnx.ModelProto, name: str) -> np.ndarray:
    return next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == name)


def stored_bias_scale(qdq: onnx.ModelProto, layer: str) -> np.ndarray:
    """The scale of the DequantizeLinear feeding ``layer``'s bias (per channel or scalar)."""
    node = next(n for n in qdq.graph.node if n.name == layer)
    dq = next(n for n in qdq.graph.node if node.input[2] in n.output)
    return initializer(qdq, dq.input[1])


def stored_weight_codes(qdq: onnx.ModelProto, layer: str) -> np.ndarray:
    """The integer codes behind ``layer``'s weight, as stored."""
    node = next(n for n in qdq.graph.node if n.name == layer)
    dq = next(n for n in qdq.graph.node if node.input[1] in n.output)
    return initializer(qdq, dq.input[0])


def outlier_mlp(seed: int = 0) -> onnx.ModelProto:
    """fc1 -> relu -> fc2 -> relu -> fc3, where fc2's input has one huge channel that
    matters little to the output: per-tensor 8-bit quantization of that input wipes
    out the other channels, so fc2 is the layer to raise."""
    rng = np.random.default_rng(seed)
    w1 = rng.normal(size=(8, 16)).astype(np.float32) * 0.3
    w1[:, 0] *= 300.0  # output channel 0 of fc1 is an outlier
    w2 = rng.normal(size=(16, 16)).astype(np.float32) * 0.3
    w2[0, :] *= 1e-3  # ... that fc2 barely uses
    inits = [
        _init("w1", w1),
        _init("b1", np.zeros(16, np.float32)),
        _init("w2", w2),
        _init("b2", np.zeros(16, np.float32)),
        _init("w3", rng.normal(size=(16, 4)).astype(np.float32) * 0.3),
        _init("b3", np.zeros(4, np.float32)),
    ]
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h1"], name="fc1"),
        helper.make_node("Relu", ["h1"], ["r1"], name="relu1"),
        helper.make_node("Gemm", ["r1", "w2", "b2"], ["h2"], name="fc2"),
        helper.make_node("Relu", ["h2"], ["r2"], name="relu2"),
        helper.make_node("Gemm", ["r2", "w3", "b3"], ["y"], name="fc3"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])
    return make_model(nodes, [x], [y], inits)
