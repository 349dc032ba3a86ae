"""Small ONNX model builders (onnx.helper) and onnxruntime comparison helpers for quant-onnx tests."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

FLOAT = TensorProto.FLOAT


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def tensor(name: str, array: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(array), name)


def weight(name: str, shape: Sequence[int], seed: int = 0, scale: float = 0.5) -> onnx.TensorProto:
    return tensor(name, (rng(seed).standard_normal(shape) * scale).astype(np.float32))


def bn_params(prefix: str, channels: int, seed: int = 1) -> list[onnx.TensorProto]:
    """gamma, beta, mean, var initializers named <prefix>_{gamma,beta,mean,var}, non-trivial values."""
    g = rng(seed)
    return [
        tensor(f"{prefix}_gamma", g.uniform(0.5, 1.5, channels).astype(np.float32)),
        tensor(f"{prefix}_beta", g.normal(0, 0.3, channels).astype(np.float32)),
        tensor(f"{prefix}_mean", g.normal(0, 0.3, channels).astype(np.float32)),
        tensor(f"{prefix}_var", g.uniform(0.5, 2.0, channels).astype(np.float32)),
    ]


def bn_node(prefix: str, x: str, y: str, eps: float = 1e-5) -> onnx.NodeProto:
    names = [f"{prefix}_{p}" for p in ("gamma", "beta", "mean", "var")]
    return helper.make_node("BatchNormalization", [x, *names], [y], name=prefix, epsilon=eps)


def make_model(
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[onnx.ValueInfoProto],
    outputs: Sequence[onnx.ValueInfoProto],
    initializers: Sequence[onnx.TensorProto] = (),
    opset: int = 13,
) -> onnx.ModelProto:
    graph = helper.make_graph(list(nodes), "test", list(inputs), list(outputs), list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8 if opset <= 18 else 9
    onnx.checker.check_model(model)
    return model


def vi(name: str, shape: Sequence[int | str | None] | None, elem: int = FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, None if shape is None else list(shape))


# --- model builders ------------------------------------------------------------------------------
def conv_bn_relu_model(opset: int = 13, channels: int = 8, bias: bool = True) -> onnx.ModelProto:
    """x[N,3,8,8] -> Conv(3x3, pad 1) -> BN -> Relu -> y."""
    inits = [weight("w", [channels, 3, 3, 3]), *bn_params("bn", channels)]
    conv_inputs = ["x", "w"]
    if bias:
        inits.append(weight("b", [channels], seed=3))
        conv_inputs.append("b")
    nodes = [
        helper.make_node("Conv", conv_inputs, ["c"], name="conv", pads=[1, 1, 1, 1]),
        bn_node("bn", "c", "n"),
        helper.make_node("Relu", ["n"], ["y"], name="relu"),
    ]
    return make_model(nodes, [vi("x", ["N", 3, 8, 8])], [vi("y", ["N", channels, 8, 8])], inits, opset)


def constant_weight_model() -> onnx.ModelProto:
    """Conv whose weight and bias come from Constant nodes (value tensor and value_floats forms)."""
    w = (rng(4).standard_normal((4, 3, 3, 3)) * 0.3).astype(np.float32)
    nodes = [
        helper.make_node("Constant", [], ["w"], name="w_const", value=tensor("w_value", w)),
        helper.make_node("Constant", [], ["b"], name="b_const", value_floats=[0.1, -0.2, 0.3, 0.0]),
        helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv"),
    ]
    return make_model(nodes, [vi("x", [1, 3, 6, 6])], [vi("y", [1, 4, 4, 4])])


def identity_weight_model() -> onnx.ModelProto:
    """Two Convs reading one Identity-wrapped weight (torch export style) plus an Identity graph output."""
    inits = [weight("w", [3, 3, 3, 3]), weight("b", [3], seed=2)]
    nodes = [
        helper.make_node("Identity", ["w"], ["w_id"], name="id_w"),
        helper.make_node("Identity", ["w_id"], ["w_id2"], name="id_w2"),
        helper.make_node("Conv", ["x", "w_id", "b"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w_id2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Identity", ["c2"], ["y"], name="id_out"),
    ]
    return make_model(nodes, [vi("x", ["N", 3, 5, 5])], [vi("y", ["N", 3, 5, 5])], inits)


def clip6_model(opset: int = 13) -> onnx.ModelProto:
    """Conv -> Clip(min=0, max=6 as initializer inputs) -> y (MobileNet Relu6)."""
    inits = [
        weight("w", [4, 3, 1, 1], scale=2.0),
        tensor("zero", np.array(0, np.float32)),
        tensor("six", np.array(6, np.float32)),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node("Clip", ["c", "zero", "six"], ["y"], name="relu6"),
    ]
    return make_model(nodes, [vi("x", ["N", 3, 4, 4])], [vi("y", ["N", 4, 4, 4])], inits, opset)


def pad_conv_model(
    pads: Sequence[int] = (0, 0, 1, 2, 0, 0, 2, 1), conv_pads: Sequence[int] = (1, 0, 0, 1)
) -> onnx.ModelProto:
    """x -> Pad(constant 0, explicit pads) -> Conv(3x3, own pads) -> y."""
    inits = [weight("w", [4, 3, 3, 3]), tensor("pads", np.array(pads, np.int64))]
    nodes = [
        helper.make_node("Pad", ["x", "pads"], ["p"], name="pad", mode="constant"),
        helper.make_node("Conv", ["p", "w"], ["y"], name="conv", pads=list(conv_pads)),
    ]
    return make_model(nodes, [vi("x", ["N", 3, 8, 8])], [vi("y", ["N", 4, None, None])], inits)


def same_pad_model(size: int = 9, kernel: int = 3, stride: int = 2) -> onnx.ModelProto:
    """EfficientNet-style TF 'same' padding computed at run time from Shape(x), then Pad -> Conv.

    pad_total = max((ceil(H / s) - 1) * s + k - H, 0); begin = total // 2; end = total - begin,
    computed for H and W via Shape -> Gather -> Cast -> Div -> Ceil -> ... -> Concat -> Pad.
    """
    inits = [
        weight("w", [8, 3, kernel, kernel]),
        tensor("idx_height", np.array(2, np.int64)),
        tensor("idx_width", np.array(3, np.int64)),
        tensor("stride_f", np.array(stride, np.float32)),
        tensor("stride_i", np.array(stride, np.int64)),
        tensor("k_minus_s", np.array(kernel - stride, np.int64)),
        tensor("zero_i", np.array(0, np.int64)),
        tensor("two_i", np.array(2, np.int64)),
        tensor("zeros2", np.zeros(2, np.int64)),
        tensor("unsq_axes", np.array([0], np.int64)),
    ]
    nodes = [helper.make_node("Shape", ["x"], ["shape"], name="shape")]
    for dim in ("height", "width"):
        nodes += [
            helper.make_node("Gather", ["shape", f"idx_{dim}"], [f"{dim}"], name=f"gather_{dim}", axis=0),
            helper.make_node("Cast", [dim], [f"{dim}_f"], name=f"cast_{dim}", to=FLOAT),
            helper.make_node("Div", [f"{dim}_f", "stride_f"], [f"{dim}_div"], name=f"div_{dim}"),
            helper.make_node("Ceil", [f"{dim}_div"], [f"{dim}_ceil"], name=f"ceil_{dim}"),
            helper.make_node("Cast", [f"{dim}_ceil"], [f"{dim}_out"], name=f"cast2_{dim}", to=TensorProto.INT64),
            helper.make_node("Mul", [f"{dim}_out", "stride_i"], [f"{dim}_span"], name=f"mul_{dim}"),
            helper.make_node("Add", [f"{dim}_span", "k_minus_s"], [f"{dim}_need"], name=f"add_{dim}"),
            helper.make_node("Sub", [f"{dim}_need", dim], [f"{dim}_tot0"], name=f"sub_{dim}"),
            helper.make_node("Max", [f"{dim}_tot0", "zero_i"], [f"{dim}_tot"], name=f"max_{dim}"),
            helper.make_node("Div", [f"{dim}_tot", "two_i"], [f"{dim}_beg"], name=f"half_{dim}"),
            helper.make_node("Sub", [f"{dim}_tot", f"{dim}_beg"], [f"{dim}_end"], name=f"rest_{dim}"),
            helper.make_node("Unsqueeze", [f"{dim}_beg", "unsq_axes"], [f"{dim}_beg1"], name=f"unsq_b_{dim}"),
            helper.make_node("Unsqueeze", [f"{dim}_end", "unsq_axes"], [f"{dim}_end1"], name=f"unsq_e_{dim}"),
        ]
    nodes += [
        helper.make_node(
            "Concat",
            ["zeros2", "height_beg1", "width_beg1", "zeros2", "height_end1", "width_end1"],
            ["pads"],
            name="concat",
            axis=0,
        ),
        helper.make_node("Pad", ["x", "pads"], ["p"], name="pad"),
        helper.make_node("Conv", ["p", "w"], ["c"], name="conv", strides=[stride, stride]),
        helper.make_node("Relu", ["c"], ["y"], name="relu"),
    ]
    out = (size + stride - 1) // stride
    return make_model(nodes, [vi("x", ["N", 3, size, size])], [vi("y", ["N", 8, out, out])], inits)


def depthwise_bn_model(channels: int = 16) -> onnx.ModelProto:
    """Depthwise Conv (group=C, no bias) -> BN -> Clip(0,6) -> pointwise Conv -> y."""
    inits = [
        weight("dw", [channels, 1, 3, 3]),
        *bn_params("bn", channels),
        tensor("lo", np.array(0, np.float32)),
        tensor("hi", np.array(6, np.float32)),
        weight("pw", [4, channels, 1, 1], seed=5),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "dw"], ["d"], name="dw", group=channels, pads=[1, 1, 1, 1]),
        bn_node("bn", "d", "n"),
        helper.make_node("Clip", ["n", "lo", "hi"], ["a"], name="relu6"),
        helper.make_node("Conv", ["a", "pw"], ["y"], name="pw"),
    ]
    return make_model(nodes, [vi("x", ["N", channels, 6, 6])], [vi("y", ["N", 4, 6, 6])], inits)


def conv_transpose_bn_model(group: int = 2) -> onnx.ModelProto:
    """ConvTranspose(stride 2, group) with bias -> BN -> y."""
    c_in, c_out = 4, 6
    inits = [weight("w", [c_in, c_out // group, 3, 3]), weight("b", [c_out], seed=7), *bn_params("bn", c_out)]
    nodes = [
        helper.make_node("ConvTranspose", ["x", "w", "b"], ["t"], name="deconv", group=group, strides=[2, 2]),
        bn_node("bn", "t", "y"),
    ]
    return make_model(nodes, [vi("x", ["N", c_in, 4, 4])], [vi("y", ["N", c_out, 9, 9])], inits)


def gemm_bn_model(trans_b: int = 1, beta: float = 0.5, bias_shape: Sequence[int] = (5,)) -> onnx.ModelProto:
    """Flatten -> Gemm(alpha 0.7, beta, transB) -> BN over 2D -> y."""
    k, n = 12, 5
    w_shape = [n, k] if trans_b else [k, n]
    inits = [weight("w", w_shape), weight("c", list(bias_shape), seed=9), *bn_params("bn", n)]
    nodes = [
        helper.make_node("Flatten", ["x"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "w", "c"], ["g"], name="gemm", transB=trans_b, alpha=0.7, beta=beta),
        bn_node("bn", "g", "y"),
    ]
    return make_model(nodes, [vi("x", ["N", 3, 2, 2])], [vi("y", ["N", n])], inits)


def opset11_model() -> onnx.ModelProto:
    """Opset-11 classifier: Conv -> BN -> Relu -> GlobalAveragePool -> Squeeze(axes attr) -> Gemm."""
    inits = [weight("w", [8, 3, 3, 3]), *bn_params("bn", 8), weight("fc", [10, 8], seed=4), weight("fcb", [10], seed=6)]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        bn_node("bn", "c", "n"),
        helper.make_node("Relu", ["n"], ["r"], name="relu"),
        helper.make_node("GlobalAveragePool", ["r"], ["gap"], name="gap"),
        helper.make_node("Squeeze", ["gap"], ["s"], name="squeeze", axes=[2, 3]),
        helper.make_node("Gemm", ["s", "fc", "fcb"], ["y"], name="fc", transB=1),
    ]
    return make_model(nodes, [vi("x", ["N", 3, 8, 8])], [vi("y", ["N", 10])], inits, opset=11)


# --- onnxruntime helpers -------------------------------------------------------------------------
def random_feeds(model: onnx.ModelProto, batch: int = 2, seed: int = 0) -> dict[str, np.ndarray]:
    """Standard-normal float32 feeds for every real graph input (symbolic dims -> `batch`)."""
    inits = {t.name for t in model.graph.initializer}
    feeds = {}
    g = rng(seed)
    for inp in model.graph.input:
        if inp.name in inits:
            continue
        dims = [d.dim_value if d.HasField("dim_value") else batch for d in inp.type.tensor_type.shape.dim]
        feeds[inp.name] = g.standard_normal(dims).astype(np.float32)
    return feeds


def run_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3  # old-exporter models warn about initializers listed as inputs
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def assert_same_outputs(
    reference: onnx.ModelProto, candidate: onnx.ModelProto, batch: int = 2, tol: float = 1e-4
) -> None:
    """Both models give the same outputs on random inputs (max abs diff < tol * output scale)."""
    feeds = random_feeds(reference, batch)
    expected = run_ort(reference, feeds)
    got = run_ort(candidate, feeds)
    assert len(expected) == len(got)
    for e, g in zip(expected, got, strict=True):
        assert e.shape == g.shape
        scale = max(float(np.abs(e).max()), 1.0)
        assert float(np.abs(e - g).max()) < tol * scale


def op_types(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


@pytest.fixture
def tmp_model_path(tmp_path):
    return tmp_path / "model.onnx"


# --- counts of the hardening tests (fuzzing, faults), shown whether or not output is captured ----
_COUNTS = pytest.StashKey[list[str]]()


@pytest.fixture
def record_count(request):
    """``record_count(line)``: a hardening test's count, printed in the terminal summary."""
    lines = request.config.stash.setdefault(_COUNTS, [])

    def record(line: str) -> None:
        lines.append(f"{request.node.name}: {line}")
        print(line)

    return record


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "big_model: writes and quantizes a model over 2 GiB (run on its own)")


def pytest_terminal_summary(terminalreporter, config) -> None:
    lines = config.stash.get(_COUNTS, [])
    if lines:
        terminalreporter.section("hardening counts")
        for line in lines:
            terminalreporter.write_line(line)
