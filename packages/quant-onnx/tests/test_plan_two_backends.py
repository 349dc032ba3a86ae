"""One planner, two backends: the same small network built once as ONNX and once in a
hand-written stand-in for another backend (its own op names, mapped onto the planner's
vocabulary, run in numpy) gets the identical plan, and the same data gives identical
scales through quant_onnx's calibration and through quant_core observers fed by the
stand-in. Integer-valued weights and inputs make every float sum exact, so both runs see
bit-identical tensors whatever order their kernels add in."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from quant_core.observers import make_observer
from quant_core.plan import PlanGraph, PlanNode, calibrated_qparams, plan_quantization
from quant_core.presets import get_preset
from quant_onnx.pipeline.annotate import plan_model
from quant_onnx.pipeline.calibrate import calibrate

RNG = np.random.default_rng(0)
W1 = RNG.integers(-3, 4, (4, 2, 3, 3)).astype(np.float32)
B1 = RNG.integers(-4, 5, 4).astype(np.float32)
W2 = RNG.integers(-3, 4, (4, 2, 1, 1)).astype(np.float32)
W3 = RNG.integers(-2, 3, (5, 8)).astype(np.float32)  # Linear: [out, in]
B3 = RNG.integers(-4, 5, 5).astype(np.float32)
CONSTANTS = {"w1": W1, "b1": B1, "w2": W2, "w3": W3, "b3": B3}

# The stand-in backend's graph, in its own vocabulary: (name, op, inputs, outputs, attributes).
STAND_IN = [
    ("conv_a", "nn.conv2d", ("x", "w1", "b1"), ("a",), {"padding": 1}),
    ("relu_a", "nn.relu", ("a",), ("ra",), {}),
    ("conv_b", "nn.conv2d", ("x", "w2"), ("b",), {"padding": 0}),
    ("cat", "torch.cat", ("ra", "b"), ("c",), {"dim": 1}),
    ("pool", "nn.max_pool2d", ("c",), ("p",), {"kernel": 2}),
    ("gap", "nn.adaptive_avg_pool2d", ("p",), ("g",), {}),
    ("flat", "torch.flatten", ("g",), ("f",), {}),
    ("fc", "nn.linear", ("f", "w3", "b3"), ("y",), {}),
]
# What the stand-in maps onto the planner's (ONNX) vocabulary, with the attributes it implies.
ONNX_NAMES = {
    "nn.conv2d": ("Conv", {}),
    "nn.relu": ("Relu", {}),
    "torch.cat": ("Concat", {}),
    "nn.max_pool2d": ("MaxPool", {}),
    "nn.adaptive_avg_pool2d": ("GlobalAveragePool", {}),
    "torch.flatten": ("Flatten", {}),
    "nn.linear": ("Gemm", {"transB": 1}),
}


def stand_in_graph() -> PlanGraph:
    nodes = [
        PlanNode(name, ONNX_NAMES[op][0], inputs, outputs, ONNX_NAMES[op][1])
        for name, op, inputs, outputs, _ in STAND_IN
    ]
    return PlanGraph(nodes, inputs=("x",), outputs=("y",), constant=CONSTANTS.get)


def onnx_model():
    inits = [numpy_helper.from_array(v, k) for k, v in CONSTANTS.items()]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["a"], name="conv_a", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["a"], ["ra"], name="relu_a"),
        helper.make_node("Conv", ["x", "w2"], ["b"], name="conv_b"),
        helper.make_node("Concat", ["ra", "b"], ["c"], name="cat", axis=1),
        helper.make_node("MaxPool", ["c"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("GlobalAveragePool", ["p"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], name="flat"),
        helper.make_node("Gemm", ["f", "w3", "b3"], ["y"], name="fc", transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "two_backends",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def _conv(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, pad: int) -> np.ndarray:
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    kh, kw = w.shape[2:]
    h, wd = xp.shape[2] - kh + 1, xp.shape[3] - kw + 1
    out = np.zeros((x.shape[0], w.shape[0], h, wd), np.float32)
    for i in range(kh):
        for j in range(kw):
            out += np.einsum("nchw,oc->nohw", xp[:, :, i : i + h, j : j + wd], w[:, :, i, j])
    return out if b is None else out + b.reshape(1, -1, 1, 1)


def stand_in_run(x: np.ndarray) -> dict[str, np.ndarray]:
    """The stand-in backend's forward pass in numpy: every tensor by name."""
    t = {"x": x}
    t["a"] = _conv(x, W1, B1, 1)
    t["ra"] = np.maximum(t["a"], 0)
    t["b"] = _conv(x, W2, None, 0)
    t["c"] = np.concatenate([t["ra"], t["b"]], axis=1)
    n, ch, h, w = t["c"].shape
    t["p"] = t["c"].reshape(n, ch, h // 2, 2, w // 2, 2).max(axis=(3, 5))
    t["g"] = t["p"].mean(axis=(2, 3), keepdims=True)
    t["f"] = t["g"].reshape(n, -1)
    t["y"] = t["f"] @ W3.T + B3
    return t


@pytest.mark.parametrize("preset", ["a8w8", "xint8", "a8w8_per_tensor", "a16w8"])
def test_same_plan_and_same_scales_from_both_backends(preset):
    config = get_preset(preset)
    model = onnx_model()
    onnx_plan = plan_model(model, config)
    stand_in_plan = plan_quantization(stand_in_graph(), config)
    assert onnx_plan == stand_in_plan
    assert [f.node for f in onnx_plan.fused] == ["relu_a"]
    axis = 0 if preset in ("a8w8", "a16w8") else None  # output channels: axis 0 of Conv and Gemm(transB=1)
    assert {w.node: w.spec.per_channel_axis for w in onnx_plan.weights} == {"conv_a": axis, "conv_b": axis, "fc": axis}

    batches = [RNG.integers(-8, 9, (4, 2, 4, 4)).astype(np.float32) for _ in range(3)]
    onnx_side = calibrate(model, onnx_plan, [{"x": b} for b in batches], quiet=True)

    observers = {group.key: make_observer(group.spec) for group in stand_in_plan.groups}
    for batch in batches:
        tensors = stand_in_run(batch)
        for group in stand_in_plan.groups:
            for name in group.observed:
                observers[group.key].update(tensors[name])
    stand_in = calibrated_qparams(stand_in_plan, observers, CONSTANTS.get)

    assert stand_in.activations.keys() == onnx_side.activation_qparams.keys()
    for key, qp in stand_in.activations.items():
        assert qp == onnx_side.activation_qparams[key], key
    for node, qp in stand_in.weights.items():
        assert qp == onnx_side.weight_qparams[node], node
