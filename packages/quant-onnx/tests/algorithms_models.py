"""Small float models and a minimal reference QDQ writer for the algorithm tests.

The writer follows ONNXRUNTIME-INT8.md: each Conv/Gemm/MatMul reads its data input
through QuantizeLinear -> DequantizeLinear (uint8 asymmetric from the calibrated
min/max, or int8 symmetric power-of-two), an int8 symmetric weight initializer behind a
DequantizeLinear (per-channel on the output axis or per-tensor) and an int32 bias
initializer with scale ``input_scale * weight_scale``. It exists so that the passes
are tested against standard QDQ structure independently of the package's own writer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from quant_core.qparams import QParams, bias_qparams, qparams_from_range, quantize
from quant_core.spec import QuantSpec
from quant_onnx.algorithms.capture import TensorCapture
from quant_onnx.graph import GraphIndex

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


def batches_for(model: onnx.ModelProto, count: int = 4, batch: int = 8, seed: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    vi = model.graph.input[0]
    dims = [d.dim_value for d in vi.type.tensor_type.shape.dim[1:]]
    return [{vi.name: rng.normal(size=(batch, *dims)).astype(np.float32)} for _ in range(count)]


def run(model: onnx.ModelProto, batches: Sequence[dict], tensor: str | None = None) -> np.ndarray:
    name = tensor or model.graph.output[0].name
    return TensorCapture(model, [name]).collect(batches)[name]


def _weighted(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type in ("Conv", "Gemm", "MatMul")]


def write_qdq(
    float_model: onnx.ModelProto,
    batches: Sequence[dict],
    *,
    per_channel: bool = True,
    power_of_two: bool = False,
    weight_bits: int = 8,
    wide_inputs: Sequence[str] = (),
) -> onnx.ModelProto:
    """Standard QDQ version of ``float_model`` (weighted layers' inputs, weights, biases).
    The inputs of the layers named in ``wide_inputs`` get int16 Q/DQ (com.microsoft)."""
    index = GraphIndex(float_model.graph)
    layers = _weighted(float_model)
    act_tensors = sorted({n.input[0] for n in layers})
    ranges = TensorCapture(float_model, act_tensors).collect(batches)
    scale_type = "power_of_two" if power_of_two else "float"
    act_spec = (
        QuantSpec(dtype="int8", symmetric=True, scale_type=scale_type)
        if power_of_two
        else QuantSpec(dtype="uint8", symmetric=False)
    )
    model = onnx.ModelProto()
    model.CopyFrom(float_model)
    graph = model.graph
    new_nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    act_qp: dict[str, QParams] = {}
    wide_tensors = {n.input[0] for n in layers if n.name in wide_inputs}
    for t in act_tensors:
        v = ranges[t]
        wide = t in wide_tensors
        spec = QuantSpec(dtype="int16", symmetric=False) if wide else act_spec
        qp = qparams_from_range(float(v.min()), float(v.max()), spec)
        act_qp[t] = qp
        inits += [_init(f"{t}_s", qp.scale), _init(f"{t}_zp", qp.zero_point.astype(qp.dtype.numpy_dtype))]
        domain = {"domain": "com.microsoft"} if wide else {}
        new_nodes += [
            helper.make_node("QuantizeLinear", [t, f"{t}_s", f"{t}_zp"], [f"{t}_q"], name=f"{t}_Q", **domain),
            helper.make_node(
                "DequantizeLinear", [f"{t}_q", f"{t}_s", f"{t}_zp"], [f"{t}_dq"], name=f"{t}_DQ", **domain
            ),
        ]
    for node in graph.node:
        if node not in layers:
            new_nodes.append(node)
            continue
        w = index.constant(node.input[1])
        transposed = node.op_type == "MatMul" or (
            node.op_type == "Gemm" and not any(a.name == "transB" and a.i for a in node.attribute)
        )
        axis = (1 if transposed else 0) if per_channel else None
        dtype = "int8" if weight_bits == 8 else "int4"
        spec = QuantSpec(dtype=dtype, symmetric=True, per_channel_axis=axis, scale_type=scale_type, narrow_range=True)
        if axis is None:
            wqp = qparams_from_range(float(w.min()), float(w.max()), spec)
        else:
            reduce = tuple(i for i in range(w.ndim) if i != axis)
            wqp = qparams_from_range(w.min(axis=reduce), w.max(axis=reduce), spec)
        codes = quantize(w, wqp)
        if weight_bits != 8:
            import ml_dtypes

            codes = codes.astype(ml_dtypes.int4)
        n = node.name
        inits += [
            _init(f"{n}_wq", codes),
            _init(f"{n}_ws", wqp.scale),
            _init(f"{n}_wzp", np.zeros_like(wqp.scale, codes.dtype)),
        ]
        dq_attrs = {"axis": axis} if axis is not None else {}
        new_nodes.append(
            helper.make_node(
                "DequantizeLinear", [f"{n}_wq", f"{n}_ws", f"{n}_wzp"], [f"{n}_w"], name=f"{n}_wDQ", **dq_attrs
            )
        )
        inputs = [f"{node.input[0]}_dq", f"{n}_w"]
        if len(node.input) > 2 and node.input[2]:
            bqp = bias_qparams(act_qp[node.input[0]].scale, wqp)
            b = index.constant(node.input[2])
            bcodes = np.rint(b / np.broadcast_to(bqp.scale, b.shape)).astype(np.int32)
            inits += [
                _init(f"{n}_bq", bcodes),
                _init(f"{n}_bs", bqp.scale),
                _init(f"{n}_bzp", np.zeros_like(bqp.scale, np.int32)),
            ]
            new_nodes.append(
                helper.make_node(
                    "DequantizeLinear",
                    [f"{n}_bq", f"{n}_bs", f"{n}_bzp"],
                    [f"{n}_b"],
                    name=f"{n}_bDQ",
                    **({"axis": 0} if axis is not None else {}),
                )
            )
            inputs.append(f"{n}_b")
        q = helper.make_node(node.op_type, inputs, list(node.output), name=n)
        q.attribute.extend(node.attribute)
        new_nodes.append(q)
    del graph.node[:]
    graph.node.extend(new_nodes)
    graph.initializer.extend(inits)
    used = {i for node in graph.node for i in node.input}
    kept = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    from quant_onnx.graph import topological_sort

    ordered = topological_sort(
        graph.node, available={t.name for t in graph.initializer} | {i.name for i in graph.input}
    )
    del graph.node[:]
    graph.node.extend(ordered)
    if weight_bits != 8:
        model.opset_import[0].version = 21
    if wide_tensors:
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    onnx.checker.check_model(model)
    return model


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
