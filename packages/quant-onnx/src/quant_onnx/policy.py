"""Per-op-type annotation policy: which inputs of an operator carry activations,
which carry a weight and a bias, and how its output's quantization parameters relate
to its inputs'.

The table is the single place that knows ONNX operator semantics; :mod:`annotate`
applies it to a graph. Ops that are not in the table stay float and are reported.

Example:
    >>> import onnx
    >>> node = onnx.helper.make_node("Conv", ["x", "w", "b"], ["y"])
    >>> rule = policy_for(node)
    >>> rule.kind is OpKind.WEIGHTED, rule.weight_input, rule.bias_input
    (True, 1, 2)
    >>> weight_channel_axis(node, weight_rank=4)
    0
    >>> policy_for(onnx.helper.make_node("NonMaxSuppression", ["a", "b"], ["c"])) is None
    True
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping

import attrs
import numpy as np
import onnx

from quant_onnx.graph import is_default_domain

ConstantLookup = Callable[[str], "np.ndarray | None"]


class OpKind(enum.Enum):
    """How an operator's output qparams are chosen."""

    WEIGHTED = "weighted"
    """Conv/Gemm/MatMul family: activation input, int8 weight, int32 bias, own output qparams."""
    GENERAL = "general"
    """Every data input and the output get their own qparams (Add, pools, float islands)."""
    PASS_THROUGH = "pass_through"
    """Output values are a subset of (or interpolate) the input's: the output reuses the
    input's qparams so that onnxruntime can run the op on 8-bit data."""
    CONCAT = "concat"
    """Inputs and output share one scale (range = union of the inputs' ranges)."""
    ACTIVATION = "activation"
    """Relu/Clip: fused into a Conv/Gemm/MatMul/Add producer when it is the sole consumer."""


@attrs.frozen
class OpPolicy:
    """What one op type needs.

    Args:
        kind: see :class:`OpKind`.
        data_inputs: indices of inputs that carry activations to quantize (``None``:
            every input); shape/index inputs are never listed.
        weight_input: index of the weight input (weighted ops only).
        bias_input: index of the bias input (weighted ops only).
        integer_kernel: onnxruntime (x86 CPU) has an integer kernel for the op in QDQ
            form; the others run in float between a DequantizeLinear and a QuantizeLinear.

    Example:
        >>> OpPolicy(OpKind.GENERAL, data_inputs=(0,)).integer_kernel
        True
    """

    kind: OpKind
    data_inputs: tuple[int, ...] | None = (0,)
    weight_input: int | None = None
    bias_input: int | None = None
    integer_kernel: bool = True


_WEIGHTED = {
    "Conv": OpPolicy(OpKind.WEIGHTED, (0,), weight_input=1, bias_input=2),
    "ConvTranspose": OpPolicy(OpKind.WEIGHTED, (0,), weight_input=1, bias_input=2, integer_kernel=False),
    "Gemm": OpPolicy(OpKind.WEIGHTED, (0,), weight_input=1, bias_input=2),
    "MatMul": OpPolicy(OpKind.WEIGHTED, (0,), weight_input=1),
}

_GENERAL_INTEGER = ("Add", "Mul", "AveragePool", "GlobalAveragePool", "LeakyRelu", "Sigmoid", "Softmax")
_GENERAL_FLOAT = ("Sub", "Div", "PRelu", "HardSigmoid", "HardSwish", "Tanh", "ReduceMean", "Pow", "Sqrt", "Erf", "Gelu")
_PASS_THROUGH = (
    "MaxPool",
    "GlobalMaxPool",
    "Reshape",
    "Flatten",
    "Transpose",
    "Squeeze",
    "Unsqueeze",
    "Split",
    "Slice",
    "Gather",
    "Resize",
    "Pad",
    "DepthToSpace",
    "SpaceToDepth",
    "Identity",
    "Expand",
    "Tile",
    "ReduceMax",
    "ReduceMin",
)

POLICIES: Mapping[str, OpPolicy] = {
    **_WEIGHTED,
    **{op: OpPolicy(OpKind.GENERAL, None) for op in ("Add", "Mul", "Sub", "Div")},
    **{
        op: OpPolicy(OpKind.GENERAL, (0,))
        for op in _GENERAL_INTEGER + _GENERAL_FLOAT
        if op not in ("Add", "Mul", "Sub", "Div")
    },
    **{op: OpPolicy(OpKind.PASS_THROUGH, (0,)) for op in _PASS_THROUGH},
    "Concat": OpPolicy(OpKind.CONCAT, None),
    "Relu": OpPolicy(OpKind.ACTIVATION, (0,)),
    "Clip": OpPolicy(OpKind.ACTIVATION, (0,)),
}
"""The policy table, by ONNX op type (default domain)."""

for _op in _GENERAL_FLOAT:
    POLICIES[_op] = attrs.evolve(POLICIES[_op], integer_kernel=False)  # type: ignore[index]

FUSABLE_PRODUCERS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul", "Add"})
"""Ops whose output a following Relu/Clip is fused into (quantized after the activation only)."""


def _attr(node: onnx.NodeProto, name: str, default: object) -> object:
    for attribute in node.attribute:
        if attribute.name == name:
            return onnx.helper.get_attribute_value(attribute)
    return default


def policy_for(node: onnx.NodeProto, constant: ConstantLookup | None = None) -> OpPolicy | None:
    """The policy for ``node``, refined by its attributes, or ``None`` when the op has none
    (it then stays float).

    Resize with cubic interpolation and Pad with a non-zero (or unknown) constant can
    leave the input's range, so they get their own output qparams; Clip with bounds that
    are not constants is a general op. ``constant`` reads constant inputs (a name ->
    array or ``None``).
    """
    if not is_default_domain(node):
        return None
    rule = POLICIES.get(node.op_type)
    if rule is None:
        return None
    lookup = constant or (lambda _name: None)
    own_range = OpPolicy(OpKind.GENERAL, (0,), integer_kernel=False)
    if node.op_type == "Resize" and _attr(node, "mode", b"nearest") == b"cubic":
        return own_range
    if node.op_type == "Pad" and _attr(node, "mode", b"constant") == b"constant":
        value = float(_attr(node, "value", 0.0))  # type: ignore[arg-type]
        if len(node.input) > 2 and node.input[2]:
            pad_value = lookup(node.input[2])
            value = float("nan") if pad_value is None else float(pad_value.reshape(-1)[0])
        if value != 0.0:
            return own_range
    if node.op_type == "Clip" and clip_bounds(node, lookup) is None:
        return OpPolicy(OpKind.GENERAL, (0,))
    return rule


def clip_bounds(node: onnx.NodeProto, constant: ConstantLookup) -> tuple[float, float] | None:
    """``(lo, hi)`` of a Relu or Clip (attributes before opset 11, constant inputs after),
    or ``None`` when a bound is not a constant.

    Example:
        >>> import onnx
        >>> clip_bounds(onnx.helper.make_node("Relu", ["x"], ["y"]), lambda n: None)
        (0.0, inf)
    """
    if node.op_type == "Relu":
        return 0.0, float("inf")
    lo = float(_attr(node, "min", float("-inf")))  # type: ignore[arg-type]
    hi = float(_attr(node, "max", float("inf")))  # type: ignore[arg-type]
    for index in (1, 2):
        if len(node.input) > index and node.input[index]:
            value = constant(node.input[index])
            if value is None:
                return None
            if index == 1:
                lo = float(value.reshape(-1)[0])
            else:
                hi = float(value.reshape(-1)[0])
    return lo, hi


def weight_channel_axis(node: onnx.NodeProto, weight_rank: int) -> int:
    """The output-channel axis of a weighted op's weight, for per-channel quantization.

    Conv: 0 (``[Cout, Cin/g, kh, kw]``); ConvTranspose: 1 (``[Cin, Cout/g, kh, kw]``);
    Gemm: 0 when ``transB=1`` (``[N, K]``) else 1; MatMul: the last axis (``[K, N]``).

    Example:
        >>> import onnx
        >>> weight_channel_axis(onnx.helper.make_node("Gemm", ["a", "b"], ["c"], transB=1), 2)
        0
    """
    op = node.op_type
    if op == "Conv":
        return 0
    if op == "ConvTranspose":
        return 1
    if op == "Gemm":
        return 0 if int_attribute(node, "transB", 0) == 1 else 1
    if op == "MatMul":
        return weight_rank - 1
    raise ValueError(f"node {node.name!r}: op type {op!r} has no weight; allowed: Conv, ConvTranspose, Gemm, MatMul")


def node_attribute(node: onnx.NodeProto, name: str, default: object) -> object:
    """``node``'s attribute ``name`` as a Python value, or ``default`` when absent."""
    return _attr(node, name, default)


def int_attribute(node: onnx.NodeProto, name: str, default: int) -> int:
    """An integer attribute (``group``, ``transB``...), or ``default``."""
    return int(_attr(node, name, default))  # type: ignore[call-overload]


def float_attribute(node: onnx.NodeProto, name: str, default: float) -> float:
    """A float attribute (``alpha``, ``beta``...), or ``default``."""
    return float(_attr(node, name, default))  # type: ignore[arg-type]
