"""Small float ONNX models for the quant-onnx tests, built with onnx.helper.

Each builder returns a checked ``onnx.ModelProto`` with a dynamic batch axis and
seeded random weights, so tests are deterministic.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


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

    def node(self, op: str, inputs: list[str], n_out: int = 1, name: str | None = None, **attrs: object) -> str:
        node_name = name or self.name(op.lower())
        outputs = [f"{node_name}_out{i}" if n_out > 1 else f"{node_name}_out" for i in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=node_name, **attrs))
        return outputs[0]

    def conv(self, x: str, cin: int, cout: int, k: int = 3, group: int = 1, bias: bool = True, **attrs: object) -> str:
        w = self.const(
            (self.rng.normal(size=(cout, cin // group, k, k)) * (2.0 / (cin * k * k)) ** 0.5).astype(np.float32), "w"
        )
        inputs = [x, w]
        if bias:
            inputs.append(self.const((self.rng.normal(size=cout) * 0.1).astype(np.float32), "b"))
        return self.node("Conv", inputs, kernel_shape=[k, k], pads=[k // 2] * 4, group=group, **attrs)

    def gemm(self, x: str, k: int, n: int, trans_b: int = 1, **attrs: object) -> str:
        shape = (n, k) if trans_b else (k, n)
        w = self.const((self.rng.normal(size=shape) / k**0.5).astype(np.float32), "w")
        b = self.const((self.rng.normal(size=n) * 0.1).astype(np.float32), "b")
        return self.node("Gemm", [x, w, b], transB=trans_b, **attrs)

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


def small_cnn(seed: int = 0, opset: int = 13) -> onnx.ModelProto:
    """Conv-Relu, residual Add-Relu, MaxPool, Concat, Clip(0,6), depthwise conv,
    GlobalAveragePool, Flatten, Gemm: input ``x`` [N, 3, 16, 16] -> logits [N, 10]."""
    b = GraphBuilder(seed, opset)
    x = b.input("x", ["N", 3, 16, 16])
    a = b.node("Relu", [b.conv(x, 3, 16)])
    r = b.node("Relu", [b.conv(a, 16, 16)])
    s = b.node("Relu", [b.node("Add", [b.conv(r, 16, 16), a])])
    p = b.node("MaxPool", [s], kernel_shape=[2, 2], strides=[2, 2])
    lo, hi = b.const(np.array(0.0, np.float32)), b.const(np.array(6.0, np.float32))
    d = b.node("Clip", [b.conv(p, 16, 16, group=16), lo, hi])
    c = b.node("Concat", [d, b.node("Relu", [b.conv(p, 16, 16, k=1)])], axis=1)
    g = b.node("Flatten", [b.node("GlobalAveragePool", [b.conv(c, 32, 32, k=1)])])
    return b.model([b.gemm(g, 32, 10)])


def hardswish_se_cnn(seed: int = 0, opset: int = 17) -> onnx.ModelProto:
    """MobileNetV3-style ops: Conv-HardSwish stem (3 input channels), depthwise Conv-Clip(0,6),
    squeeze-excite (GlobalAveragePool, 1x1 Conv-Relu named ``se_reduce``, 1x1 Conv-HardSigmoid,
    Mul), residual Add, strided Conv-HardSwish, GlobalAveragePool, Flatten, Gemm:
    input ``x`` [N, 3, 16, 16] -> logits [N, 10]."""
    b = GraphBuilder(seed, opset)
    x = b.input("x", ["N", 3, 16, 16])
    stem = b.node("HardSwish", [b.conv(x, 3, 16)])
    lo, hi = b.const(np.array(0.0, np.float32)), b.const(np.array(6.0, np.float32))
    d = b.node("Clip", [b.conv(stem, 16, 16, group=16), lo, hi])
    s = b.node("Relu", [b.conv(b.node("GlobalAveragePool", [d]), 16, 8, k=1, name="se_reduce")])
    s = b.node("HardSigmoid", [b.conv(s, 8, 16, k=1)], alpha=1.0 / 6.0, beta=0.5)
    r = b.node("Add", [b.conv(b.node("Mul", [d, s]), 16, 16, k=1), stem])
    h = b.node("HardSwish", [b.conv(r, 16, 32, strides=[2, 2])])
    return b.model([b.gemm(b.node("Flatten", [b.node("GlobalAveragePool", [h])]), 32, 10)])


def mlp(seed: int = 0) -> onnx.ModelProto:
    """MatMul + Add + Relu + Gemm (transB=0, alpha/beta != 1): input ``x`` [N, 8] -> [N, 4]."""
    b = GraphBuilder(seed)
    x = b.input("x", ["N", 8])
    w = b.const((b.rng.normal(size=(8, 16)) / 8**0.5).astype(np.float32), "w")
    h = b.node("MatMul", [x, w])
    h = b.node("Relu", [b.node("Add", [h, b.const((b.rng.normal(size=16) * 0.1).astype(np.float32), "b")])])
    return b.model([b.gemm(h, 16, 4, trans_b=0, alpha=0.5, beta=2.0)])


def float_island_net(seed: int = 0) -> onnx.ModelProto:
    """Conv -> HardSwish -> Conv -> Sigmoid * x (SE-style Mul) -> Resize -> ConvTranspose -> Softmax-free
    output, plus an op without a policy (Sin): input ``x`` [N, 4, 8, 8]."""
    b = GraphBuilder(seed, opset=14)
    x = b.input("x", ["N", 4, 8, 8])
    h = b.node("HardSwish", [b.conv(x, 4, 8)])
    gate = b.node("Sigmoid", [b.conv(h, 8, 8, k=1)])
    m = b.node("Mul", [h, gate])
    scales = b.const(np.array([1, 1, 2, 2], np.float32), "scales")
    up = b.node("Resize", [m, "", scales], mode="nearest")
    wt = b.const((b.rng.normal(size=(8, 4, 2, 2)) * 0.3).astype(np.float32), "wt")
    ct = b.node("ConvTranspose", [up, wt, b.const(np.zeros(4, np.float32), "bt")], strides=[2, 2], kernel_shape=[2, 2])
    return b.model([b.node("Sin", [ct])], rank=4)


def random_inputs(model: onnx.ModelProto, n: int, seed: int = 1) -> np.ndarray:
    """``n`` samples for a single-input model (batch axis replaced by ``n``)."""
    dims = model.graph.input[0].type.tensor_type.shape.dim
    shape = [n] + [d.dim_value for d in dims[1:]]
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def conv_transpose_net(seed: int = 0) -> onnx.ModelProto:
    """Conv -> Relu -> ConvTranspose(stride 2, per-channel weight axis 1): x [N, 3, 8, 8] -> [N, 5, 16, 16]."""
    b = GraphBuilder(seed)
    x = b.input("x", ["N", 3, 8, 8])
    h = b.node("Relu", [b.conv(x, 3, 8)])
    wt = b.const(
        (b.rng.normal(size=(8, 5, 2, 2)) * np.array([0.1, 0.5, 1.0, 2.0, 4.0]).reshape(1, 5, 1, 1)).astype(np.float32),
        "wt",
    )
    bias = b.const((b.rng.normal(size=5) * 0.1).astype(np.float32), "bt")
    return b.model([b.node("ConvTranspose", [h, wt, bias], strides=[2, 2], kernel_shape=[2, 2])], rank=4)


def cpu_has_vnni() -> bool:
    """True where onnxruntime's u8s8 integer kernels cannot saturate (AVX-VNNI / AVX512-VNNI).

    Without VNNI, MLAS multiplies u8 x s8 pairs with ``vpmaddubsw`` into saturating int16, so
    the integer kernels' results depend on the CPU; accuracy tests therefore run the QDQ graph
    emulated and only kernel-fidelity tests need this."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = f.read()
    except OSError:
        return False
    return any(flag in flags for flag in ("avx512_vnni", "avx_vnni", "amx_int8"))


_LEVELS = {"emulated": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "all": "ORT_ENABLE_ALL"}


def ort_run(
    model: onnx.ModelProto,
    feeds: dict[str, np.ndarray] | np.ndarray,
    level: str = "emulated",
    disabled_optimizers: tuple[str, ...] = (),
) -> list[np.ndarray]:
    """Run ``model`` in onnxruntime (CPU).

    ``emulated`` (no graph optimisation) runs every Q/DQ pair as written, so results are the
    same on every CPU; ``all`` fuses QDQ groups into onnxruntime's integer kernels, whose
    u8s8 products saturate on CPUs without VNNI (see :func:`cpu_has_vnni`).
    ``disabled_optimizers``: onnxruntime graph transformers to leave out (by name)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, _LEVELS[level])
    options.log_severity_level = 3
    session = ort.InferenceSession(
        model.SerializeToString(),
        options,
        providers=["CPUExecutionProvider"],
        disabled_optimizers=list(disabled_optimizers),
    )
    if isinstance(feeds, np.ndarray):
        feeds = {session.get_inputs()[0].name: feeds}
    return session.run(None, feeds)


def optimized_op_types(model: onnx.ModelProto, tmp_path: object) -> list[str]:
    """``domain:op_type`` of every node in onnxruntime's optimised graph (level ALL)."""
    import os

    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    options.optimized_model_filepath = os.path.join(str(tmp_path), "optimized.onnx")
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    optimized = onnx.load(options.optimized_model_filepath)
    return [f"{n.domain}:{n.op_type}" for n in optimized.graph.node]


FLOAT_COMPUTE_OPS = frozenset({"Conv", "FusedConv", "Gemm", "FusedGemm", "MatMul", "FusedMatMul", "ConvTranspose"})


def float_compute_nodes(op_types: list[str]) -> list[str]:
    """The optimised-graph nodes that are float Conv/Gemm/MatMul (any domain, e.g. nchwc)."""
    return [t for t in op_types if t.split(":")[1] in FLOAT_COMPUTE_OPS - {"ConvTranspose"}]


def quantize_in_memory(
    model: onnx.ModelProto, config: object, data: np.ndarray, batch_size: int = 16, **writer: object
):
    """(calibrated, qdq model) for ``model`` quantized on ``data`` without pre-processing."""
    from quant_onnx.api import resolve_config
    from quant_onnx.pipeline.annotate import ensure_node_names, plan_model
    from quant_onnx.pipeline.calibrate import calibrate
    from quant_onnx.pipeline.qdq_writer import WriterOptions, write_qdq

    model_copy = onnx.ModelProto()
    model_copy.CopyFrom(model)
    ensure_node_names(model_copy)
    name = model_copy.graph.input[0].name
    batches = [{name: data[i : i + batch_size]} for i in range(0, len(data), batch_size)]
    calibrated = calibrate(model_copy, plan_model(model_copy, resolve_config(config)), batches, quiet=True)
    return calibrated, write_qdq(calibrated, WriterOptions(**writer))  # type: ignore[arg-type]


def reference_run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Run ``model`` with onnx.reference.ReferenceEvaluator (its Q/DQ implementations start
    at opset 19, so older models are converted first)."""
    from onnx import version_converter
    from onnx.reference import ReferenceEvaluator

    version = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    if version < 19:
        model = version_converter.convert_version(model, 19)
    return ReferenceEvaluator(model).run(None, feeds)


def op_zoo(seed: int = 0, opset: int = 13) -> onnx.ModelProto:
    """Split, Slice, Transpose, Reshape, Squeeze/Unsqueeze, Pad (constant and reflect),
    Resize (linear), AveragePool, LeakyRelu, PRelu, HardSigmoid, Sub, MatMul of two
    activations, Softmax: input ``x`` [N, 8, 8, 8] -> [N, 8] probabilities."""
    b = GraphBuilder(seed, opset)
    x = b.input("x", ["N", 8, 8, 8])
    h = b.node("LeakyRelu", [b.conv(x, 8, 8)], alpha=0.1)
    left = b.node("Split", [h], n_out=2, axis=1)
    right = b.nodes[-1].output[1]
    pads = b.const(np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64))
    left = b.node("Pad", [left, pads], mode="reflect")
    left = b.node(
        "Slice",
        [
            left,
            b.const(np.array([1, 1], np.int64)),
            b.const(np.array([9, 9], np.int64)),
            b.const(np.array([2, 3], np.int64)),
        ],
    )
    slope = b.const(np.full((4, 1, 1), 0.2, np.float32))
    right = b.node("PRelu", [b.conv(right, 4, 4), slope])
    right = b.node("Pad", [right, pads, b.const(np.array(0.0, np.float32))])
    right = b.node("AveragePool", [right], kernel_shape=[3, 3])
    cat = b.node("Concat", [left, right], axis=1)
    h = b.node("Sub", [cat, b.node("HardSigmoid", [cat])])
    h = b.node("Resize", [h, "", b.const(np.array([1, 1, 0.5, 0.5], np.float32))], mode="linear")
    h = b.node("Transpose", [h], perm=[0, 2, 3, 1])
    h = b.node("Reshape", [h, b.const(np.array([0, 16, 8], np.int64))])
    t = b.node("Transpose", [h], perm=[0, 2, 1])
    attn = b.node("Softmax", [b.node("MatMul", [t, h])], axis=-1)
    h = b.node("Unsqueeze", [b.node("ReduceMean", [attn], axes=[1], keepdims=0), b.const(np.array([1], np.int64))])
    return b.model([b.node("Squeeze", [h, b.const(np.array([1], np.int64))])])
