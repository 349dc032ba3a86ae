"""Small float ONNX models and QDQ helpers for the quant-npu tests.

Float models are built with onnx.helper (seeded weights, dynamic batch) and quantized by
``quant_onnx`` exactly as users do; a few QDQ graphs are written by hand where a test
needs positions no calibrator would choose.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import quant_onnx


class GraphBuilder:
    """Accumulates nodes and initializers; ``model()`` checks and returns the model."""

    def __init__(self, seed: int = 0, opset: int = 13) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.opset = opset
        self._count = 0

    def name(self, prefix: str) -> str:
        self._count += 1
        return f"{prefix}{self._count}"

    def input(self, name: str, shape: list[int | str | None]) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shape))
        return name

    def const(self, value: np.ndarray, prefix: str = "c") -> str:
        name = self.name(prefix)
        self.initializers.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def node(self, op: str, inputs: list[str], name: str | None = None, **attrs: object) -> str:
        node_name = name or self.name(op.lower())
        output = f"{node_name}_out"
        self.nodes.append(helper.make_node(op, inputs, [output], name=node_name, **attrs))
        return output

    def conv(self, x: str, cin: int, cout: int, k: int = 3, group: int = 1, **attrs: object) -> str:
        scale = (2.0 / (cin // group * k * k)) ** 0.5
        w = self.const((self.rng.normal(size=(cout, cin // group, k, k)) * scale).astype(np.float32), "w")
        b = self.const((self.rng.normal(size=cout) * 0.1).astype(np.float32), "b")
        attrs.setdefault("pads", [k // 2] * 4)
        return self.node("Conv", [x, w, b], kernel_shape=[k, k], group=group, **attrs)

    def gemm(self, x: str, k: int, n: int) -> str:
        w = self.const((self.rng.normal(size=(n, k)) / k**0.5).astype(np.float32), "w")
        b = self.const((self.rng.normal(size=n) * 0.1).astype(np.float32), "b")
        return self.node("Gemm", [x, w, b], transB=1)

    def model(self, outputs: list[str], rank: int = 2) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes,
            "test",
            self.inputs,
            [helper.make_tensor_value_info(o, TensorProto.FLOAT, [None] * rank) for o in outputs],
            self.initializers,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)])
        model.ir_version = 8
        onnx.checker.check_model(model)
        return model


def conv_chain(seed: int = 0) -> onnx.ModelProto:
    """Ops that round the same on the NPU and in onnxruntime: Conv+Relu chains, MaxPool,
    Concat, Add, Flatten, Gemm. Input ``x`` [N, 3, 8, 8] -> logits [N, 10]."""
    b = GraphBuilder(seed)
    x = b.input("x", ["N", 3, 8, 8])
    a = b.node("Relu", [b.conv(x, 3, 8)])
    r = b.node("Relu", [b.conv(a, 8, 8)])
    s = b.node("Relu", [b.node("Add", [b.conv(r, 8, 8), a])])
    p = b.node("MaxPool", [s], kernel_shape=[2, 2], strides=[2, 2])
    c = b.node("Concat", [b.node("Relu", [b.conv(p, 8, 4, k=1)]), b.node("Relu", [b.conv(p, 8, 4)])], axis=1)
    d = b.node("Relu", [b.conv(c, 8, 8, group=8)])
    f = b.node("Flatten", [b.node("MaxPool", [d], kernel_shape=[4, 4], strides=[4, 4])])
    return b.model([b.gemm(f, 8, 10)])


def mobile_block(seed: int = 0) -> onnx.ModelProto:
    """What a MobileNet/EfficientNet-Lite needs beyond ``conv_chain``: Clip(0, 6), depthwise
    stride 2, GlobalAveragePool. Input ``x`` [N, 3, 16, 16] -> logits [N, 5]."""
    b = GraphBuilder(seed)
    x = b.input("x", ["N", 3, 16, 16])
    lo, hi = b.const(np.array(0.0, np.float32)), b.const(np.array(6.0, np.float32))
    h = b.node("Clip", [b.conv(x, 3, 16, strides=[2, 2]), lo, hi])
    h = b.node("Clip", [b.conv(h, 16, 16, group=16, strides=[2, 2]), lo, hi])
    h = b.conv(h, 16, 8, k=1)
    g = b.node("Flatten", [b.node("GlobalAveragePool", [h])])
    return b.model([b.gemm(g, 8, 5)])


def activation_net(seed: int = 0, count_include_pad: int = 1) -> onnx.ModelProto:
    """LeakyRelu after a Conv, HardSwish, AveragePool 3x3 (padded: the device counts the
    padding, ``count_include_pad=1``), Mul, Softmax: input ``x`` [N, 4, 8, 8]."""
    b = GraphBuilder(seed, opset=14)
    x = b.input("x", ["N", 4, 8, 8])
    h = b.node("LeakyRelu", [b.conv(x, 4, 8)], alpha=0.1)
    s = b.node("HardSwish", [b.conv(h, 8, 8)])
    m = b.node("Mul", [s, h])
    p = b.node(
        "AveragePool", [m], kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1], count_include_pad=count_include_pad
    )
    g = b.node("Flatten", [b.node("GlobalAveragePool", [p])])
    return b.model([b.node("Softmax", [b.gemm(g, 8, 6)], axis=1)])


def random_inputs(model: onnx.ModelProto, n: int, seed: int = 1) -> np.ndarray:
    """``n`` samples for a single-input model (batch axis replaced by ``n``)."""
    dims = model.graph.input[0].type.tensor_type.shape.dim
    shape = [n] + [d.dim_value for d in dims[1:]]
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def quantize(
    model: onnx.ModelProto, config: object = "xint8", n: int = 64, encoding: str = "x86_uint8"
) -> onnx.ModelProto:
    """``model`` quantized by quant_onnx on ``n`` seeded samples (``encoding``: the writer's
    activation encoding, ``x86_uint8`` or ``as_spec``)."""
    data = random_inputs(model, n)
    if encoding == "x86_uint8":
        return quant_onnx.quantize(model, None, config, data, quiet=True).model
    options = quant_onnx.WriterOptions(activation_encoding=encoding)  # type: ignore[arg-type]
    quantizer = quant_onnx.ModelQuantizer(config, writer_options=options, quiet=True)
    return quantizer.quantize(model, None, data).model


def ort_run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    """Every output of ``model`` in onnxruntime with graph optimisations off (each Q/DQ as written)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})


def qdq_model(
    nodes: Sequence[onnx.NodeProto],
    initializers: dict[str, np.ndarray],
    inputs: Sequence[tuple[str, list[int | str | None]]],
    outputs: Sequence[str],
    opset: int = 13,
) -> onnx.ModelProto:
    """A hand-written QDQ model (float inputs and outputs; output shapes from shape inference)."""
    graph = helper.make_graph(
        list(nodes),
        "hand",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in inputs],
        [],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in initializers.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    inferred = {v.name: v for v in onnx.shape_inference.infer_shapes(model).graph.value_info}
    rank = len(inputs[0][1])
    for name in outputs:
        info = inferred.get(name)
        shape = [None] * rank if info is None or not info.type.tensor_type.HasField("shape") else None
        model.graph.output.append(
            info if shape is None else helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)
        )
    onnx.checker.check_model(model)
    return model


class QDQWriter:
    """Writes hand-made QDQ graphs: activations int8 at chosen positions."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: dict[str, np.ndarray] = {}
        self._count = 0

    def _name(self, prefix: str) -> str:
        self._count += 1
        return f"{prefix}{self._count}"

    def qparams(self, position: int, dtype: type = np.int8, zero_point: int = 0) -> tuple[str, str]:
        s, z = self._name("s"), self._name("z")
        self.inits[s] = np.array(2.0**-position, np.float32)
        self.inits[z] = np.array(zero_point, dtype)
        return s, z

    def quantize(self, x: str, position: int, scale: float | None = None) -> str:
        """Q -> DQ of ``x`` at ``position`` (or a float ``scale``); returns the DQ output."""
        s, z = self.qparams(position)
        if scale is not None:
            self.inits[s] = np.array(scale, np.float32)
        q, d = self._name("q"), self._name("d")
        self.nodes.append(helper.make_node("QuantizeLinear", [x, s, z], [q], name=f"{q}_Q"))
        self.nodes.append(helper.make_node("DequantizeLinear", [q, s, z], [d], name=f"{d}_DQ"))
        return d

    def constant(self, codes: np.ndarray, position: int) -> str:
        """Integer ``codes`` behind a DequantizeLinear at ``position``."""
        name, d = self._name("k"), self._name("kd")
        self.inits[name] = np.asarray(codes)
        s, z = self.qparams(position, np.asarray(codes).dtype.type)
        self.nodes.append(helper.make_node("DequantizeLinear", [name, s, z], [d], name=f"{d}_DQ"))
        return d

    def op(self, op: str, inputs: list[str], name: str, **attrs: object) -> str:
        out = f"{name}_out"
        self.nodes.append(helper.make_node(op, inputs, [out], name=name, **attrs))
        return out

    def model(self, inputs: Sequence[tuple[str, list[int | str | None]]], outputs: Sequence[str]) -> onnx.ModelProto:
        return qdq_model(self.nodes, self.inits, inputs, outputs)
