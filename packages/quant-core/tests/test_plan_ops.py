"""The planner's op table (ONNX operator vocabulary) and its attribute refinements."""

from __future__ import annotations

import numpy as np
import pytest

from quant_core.plan import POLICIES, OpKind, PlanNode, clip_bounds, policy_for, weight_channel_axis


def node(op: str, inputs: list[str], outputs: list[str], domain: str = "", **attributes: object) -> PlanNode:
    return PlanNode(f"{op}_0", op, tuple(inputs), tuple(outputs), attributes, standard=domain == "")


REQUIRED = {
    "Conv": OpKind.WEIGHTED,
    "ConvTranspose": OpKind.WEIGHTED,
    "Gemm": OpKind.WEIGHTED,
    "MatMul": OpKind.WEIGHTED,
    "Add": OpKind.GENERAL,
    "Mul": OpKind.GENERAL,
    "Concat": OpKind.CONCAT,
    "MaxPool": OpKind.PASS_THROUGH,
    "AveragePool": OpKind.GENERAL,
    "GlobalAveragePool": OpKind.GENERAL,
    "Relu": OpKind.ACTIVATION,
    "Clip": OpKind.ACTIVATION,
    "LeakyRelu": OpKind.GENERAL,
    "PRelu": OpKind.GENERAL,
    "Sigmoid": OpKind.GENERAL,
    "HardSigmoid": OpKind.GENERAL,
    "HardSwish": OpKind.GENERAL,
    "Resize": OpKind.PASS_THROUGH,
    "Pad": OpKind.PASS_THROUGH,
    "Reshape": OpKind.PASS_THROUGH,
    "Flatten": OpKind.PASS_THROUGH,
    "Transpose": OpKind.PASS_THROUGH,
    "Squeeze": OpKind.PASS_THROUGH,
    "Unsqueeze": OpKind.PASS_THROUGH,
    "Split": OpKind.PASS_THROUGH,
    "Slice": OpKind.PASS_THROUGH,
}


@pytest.mark.parametrize(("op", "kind"), sorted(REQUIRED.items()))
def test_required_ops_have_a_policy(op: str, kind: OpKind) -> None:
    assert POLICIES[op].kind is kind
    assert policy_for(node(op, ["x"], ["y"])).kind is kind


def test_shape_inputs_are_not_data_inputs() -> None:
    for op in ("Reshape", "Slice", "Resize", "Pad", "Split", "Squeeze", "Unsqueeze", "Clip", "PRelu"):
        assert POLICIES[op].data_inputs == (0,), op


def test_weighted_ops_name_weight_and_bias_inputs() -> None:
    conv = POLICIES["Conv"]
    assert (conv.weight_input, conv.bias_input, conv.data_inputs) == (1, 2, (0,))
    assert POLICIES["MatMul"].bias_input is None


@pytest.mark.parametrize(
    ("layer", "rank", "axis"),
    [
        (node("Conv", ["x", "w"], ["y"]), 4, 0),
        (node("ConvTranspose", ["x", "w"], ["y"]), 4, 1),
        (node("ConvTranspose", ["x", "w"], ["y"], group=2), 4, None),
        (node("Gemm", ["x", "w"], ["y"], transB=1), 2, 0),
        (node("Gemm", ["x", "w"], ["y"]), 2, 1),
        (node("MatMul", ["x", "w"], ["y"]), 2, 1),
        (node("MatMul", ["x", "w"], ["y"]), 3, None),  # stacked: per tensor (onnxruntime)
        (node("MatMul", ["x", "w"], ["y"]), 1, None),
    ],
)
def test_weight_channel_axis(layer: PlanNode, rank: int, axis: int) -> None:
    assert weight_channel_axis(layer, rank) == axis


def test_weight_axis_of_unweighted_op_is_an_error() -> None:
    with pytest.raises(ValueError, match="Relu"):
        weight_channel_axis(node("Relu", ["x"], ["y"]), 4)


def test_unknown_ops_and_other_domains_have_no_policy() -> None:
    assert policy_for(node("NonMaxSuppression", ["a", "b"], ["c"])) is None
    assert policy_for(node("Conv", ["x", "w"], ["y"], domain="com.microsoft")) is None


def test_cubic_resize_gets_its_own_qparams() -> None:
    assert policy_for(node("Resize", ["x", "", "s"], ["y"], mode="cubic")).kind is OpKind.GENERAL
    assert policy_for(node("Resize", ["x", "", "s"], ["y"], mode="linear")).kind is OpKind.PASS_THROUGH


def test_pad_with_non_zero_constant_gets_its_own_qparams() -> None:
    values = {"zero": np.array(0.0, np.float32), "one": np.array(1.0, np.float32)}
    pad = node("Pad", ["x", "p", "zero"], ["y"])
    assert policy_for(pad, values.get).kind is OpKind.PASS_THROUGH
    pad_one = node("Pad", ["x", "p", "one"], ["y"])
    assert policy_for(pad_one, values.get).kind is OpKind.GENERAL
    runtime_value = node("Pad", ["x", "p", "v"], ["y"])
    assert policy_for(runtime_value, values.get).kind is OpKind.GENERAL
    assert policy_for(node("Pad", ["x", "p"], ["y"], mode="reflect")).kind is OpKind.PASS_THROUGH


def test_clip_bounds_from_inputs_and_attributes() -> None:
    values = {"lo": np.array(0.0, np.float32), "hi": np.array(6.0, np.float32)}
    assert clip_bounds(node("Clip", ["x", "lo", "hi"], ["y"]), values.get) == (0.0, 6.0)
    assert clip_bounds(node("Clip", ["x", "", "hi"], ["y"]), values.get) == (float("-inf"), 6.0)
    assert clip_bounds(node("Clip", ["x"], ["y"], min=-1.0, max=1.0), values.get) == (-1.0, 1.0)
    assert clip_bounds(node("Clip", ["x", "dyn"], ["y"]), values.get) is None
    assert policy_for(node("Clip", ["x", "dyn"], ["y"]), values.get).kind is OpKind.GENERAL
