"""The operator vocabulary: per ONNX op type, which inputs carry activations, which a
weight and a bias, and how the output's quantization parameters relate to the inputs'.

This table is the one place that knows operator semantics; :mod:`quant_core.plan.planner`
applies it to a graph. Backends name their ops with these ONNX names. Ops that are not
in the table stay float and are reported.

Example:
    >>> from quant_core.plan.graph import PlanNode
    >>> node = PlanNode("conv", "Conv", ("x", "w", "b"), ("y",))
    >>> rule = policy_for(node)
    >>> rule.kind is OpKind.WEIGHTED, rule.weight_input, rule.bias_input
    (True, 1, 2)
    >>> weight_channel_axis(node, weight_rank=4)
    0
    >>> policy_for(PlanNode("nms", "NonMaxSuppression", ("a", "b"), ("c",))) is None
    True
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping

import attrs
import numpy as np

from quant_core.dtypes import DType
from quant_core.errors import ModelError
from quant_core.plan.graph import ConstantLookup, PlanNode


class OpKind(enum.Enum):
    """How an operator's output qparams are chosen."""

    WEIGHTED = "weighted"
    """Conv/Gemm/MatMul family: activation input, integer weight, int32 bias, own output qparams."""
    GENERAL = "general"
    """Every data input and the output get their own qparams (Add, pools, float islands)."""
    PASS_THROUGH = "pass_through"
    """Output values are a subset of (or interpolate) the input's: the output reuses the
    input's qparams so that integer runtimes can run the op on 8-bit data."""
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
        data_outputs: indices of outputs that carry activations (``None``: every output;
            MaxPool's second output holds indices).
        weight_input: index of the weight input (weighted ops only).
        bias_input: index of the bias input (weighted ops only).
        integer_kernel: runtimes (onnxruntime's x86 CPU provider, NPUs) have an integer
            kernel for the op; the others run in float between a dequantize and a quantize.

    Example:
        >>> OpPolicy(OpKind.GENERAL, data_inputs=(0,)).integer_kernel
        True
    """

    kind: OpKind
    data_inputs: tuple[int, ...] | None = (0,)
    data_outputs: tuple[int, ...] | None = None
    weight_input: int | None = None
    bias_input: int | None = None
    integer_kernel: bool = True


_WEIGHTED = {
    "Conv": OpPolicy(OpKind.WEIGHTED, (0,), weight_input=1, bias_input=2),
    "ConvTranspose": OpPolicy(OpKind.WEIGHTED, (0,), weight_input=1, bias_input=2, integer_kernel=False),
    "Gemm": OpPolicy(OpKind.WEIGHTED, (0,), weight_input=1, bias_input=2),
    "MatMul": OpPolicy(OpKind.WEIGHTED, (0,), weight_input=1),
}

_ELEMENTWISE = ("Add", "Mul", "Sub", "Div")
_GENERAL_INTEGER = ("AveragePool", "GlobalAveragePool", "LeakyRelu", "Sigmoid", "Softmax")
_GENERAL_FLOAT = ("PRelu", "HardSigmoid", "HardSwish", "Tanh", "ReduceMean", "Pow", "Sqrt", "Erf", "Gelu")
_FLOAT_ELEMENTWISE = ("Sub", "Div")
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
    **{op: OpPolicy(OpKind.GENERAL, None, integer_kernel=op not in _FLOAT_ELEMENTWISE) for op in _ELEMENTWISE},
    **{op: OpPolicy(OpKind.GENERAL, (0,)) for op in _GENERAL_INTEGER},
    **{op: OpPolicy(OpKind.GENERAL, (0,), integer_kernel=False) for op in _GENERAL_FLOAT},
    **{op: OpPolicy(OpKind.PASS_THROUGH, (0,)) for op in _PASS_THROUGH},
    "MaxPool": OpPolicy(OpKind.PASS_THROUGH, (0,), data_outputs=(0,)),
    "Concat": OpPolicy(OpKind.CONCAT, None),
    "Relu": OpPolicy(OpKind.ACTIVATION, (0,)),
    "Clip": OpPolicy(OpKind.ACTIVATION, (0,)),
}
"""The policy table, by ONNX op type."""

FUSABLE_PRODUCERS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul", "Add"})
"""Ops whose output a following Relu/Clip is fused into (quantized after the activation only)."""

HOMOGENEOUS_ACTIVATIONS = ("Relu", "LeakyRelu", "PRelu")
"""Activations f with f(x / s) == f(x) / s for every s > 0: per-channel scaling crosses them."""

CHANNEL_WISE_POOLS = ("MaxPool", "AveragePool")
"""Pools a positive per-channel scale on axis 1 crosses: they mix the trailing spatial axes
only. A dense layer's channels are the last axis, which they mix: its scales do not cross."""

_OWN_RANGE = OpPolicy(OpKind.GENERAL, (0,), integer_kernel=False)


def integer_kernel_reads(policy: OpPolicy, activation: DType, weight: DType) -> bool:
    """Whether integer kernels consume a layer of ``policy`` whose input is stored as
    ``activation`` and weight as ``weight``: the op has one, the activations are 8-bit and
    the weights at most 8 bits. Such a layer's bias is read at ``input_scale * weight_scale``.

    Example:
        >>> conv = POLICIES["Conv"]
        >>> integer_kernel_reads(conv, DType.UINT8, DType.INT8), integer_kernel_reads(conv, DType.UINT16, DType.INT8)
        (True, False)
    """
    return policy.integer_kernel and activation.bits <= 8 and weight.bits <= 8


def policy_for(node: PlanNode, constant: ConstantLookup | None = None) -> OpPolicy | None:
    """The policy for ``node``, refined by its attributes, or ``None`` when the op has none
    (it then stays float).

    Resize with cubic interpolation and Pad with a non-zero (or unknown) constant can
    leave the input's range, so they get their own output qparams; Clip with bounds that
    are not constants is a general op. ``constant`` reads constant inputs.
    """
    if not node.standard:
        return None
    rule = POLICIES.get(node.op_type)
    if rule is None:
        return None
    lookup = constant or (lambda _name: None)
    if node.op_type == "Resize" and node.attr("mode", "nearest") == "cubic":
        return _OWN_RANGE
    if node.op_type == "Pad" and node.attr("mode", "constant") == "constant":
        value = float(node.attr("value", 0.0))
        if node.input(2):
            pad_value = lookup(node.input(2))
            value = math.nan if pad_value is None else float(pad_value.reshape(-1)[0])
        if value != 0.0:
            return _OWN_RANGE
    if node.op_type == "Clip" and clip_bounds(node, lookup) is None:
        return OpPolicy(OpKind.GENERAL, (0,))
    return rule


def pads_keep_channels(pads: object) -> bool:
    """Whether ONNX ``pads`` (the begin of every axis, then the end of every axis) leave the
    batch and channel axes alone: padding only around the spatial axes keeps every channel
    where it was, what folding a Pad into a Conv and moving a per-channel scale across it
    both need.

    Example:
        >>> pads_keep_channels([0, 0, 1, 1, 0, 0, 1, 1]), pads_keep_channels([0, 1, 0, 0, 0, -1, 0, 0])
        (True, False)
    """
    flat = np.asarray(pads, np.int64).reshape(-1)
    rank = flat.size // 2
    return rank >= 2 and not np.any(flat[[0, 1, rank, rank + 1]])


def clip_bounds(node: PlanNode, constant: ConstantLookup) -> tuple[float, float] | None:
    """``(lo, hi)`` of a Relu or Clip (attributes before opset 11, constant inputs after),
    or ``None`` when a bound is not a constant or the node is neither.

    Example:
        >>> clip_bounds(PlanNode("r", "Relu", ("x",), ("y",)), lambda n: None)
        (0.0, inf)
        >>> clip_bounds(PlanNode("c", "Clip", ("x",), ("y",), {"min": 0.0, "max": 6.0}), lambda n: None)
        (0.0, 6.0)
    """
    if node.op_type == "Relu":
        return 0.0, math.inf
    if node.op_type != "Clip":
        return None
    bounds = [float(node.attr("min", -math.inf)), float(node.attr("max", math.inf))]
    for index in (1, 2):
        if node.input(index):
            value = constant(node.input(index))
            if value is None:
                return None
            bounds[index - 1] = float(np.asarray(value).reshape(-1)[0])
    return bounds[0], bounds[1]


def saturation_interval(node: PlanNode, constant: ConstantLookup) -> tuple[float, float] | None:
    """The input interval outside which ``node``'s output no longer changes: its output for
    an input beyond a bound is its output at the bound. HardSwish is 0 below -3;
    HardSigmoid is 0 below ``-beta / alpha`` and 1 above ``(1 - beta) / alpha``; Relu and
    Clip at their bounds (:func:`clip_bounds`). ``None`` for any other op (a bound side
    it does not have is infinite).

    Example:
        >>> saturation_interval(PlanNode("h", "HardSwish", ("x",), ("y",)), lambda n: None)
        (-3.0, inf)
        >>> saturation_interval(PlanNode("s", "HardSigmoid", ("x",), ("y",), {"alpha": 1 / 6}), lambda n: None)
        (-3.0, 3.0)
        >>> saturation_interval(PlanNode("g", "Sigmoid", ("x",), ("y",)), lambda n: None) is None
        True
    """
    if not node.standard:
        return None
    if node.op_type == "HardSwish":  # x * max(0, min(1, x / 6 + 1 / 2))
        return -3.0, math.inf
    if node.op_type == "HardSigmoid":  # max(0, min(1, alpha * x + beta))
        alpha, beta = float(node.attr("alpha", 0.2)), float(node.attr("beta", 0.5))
        if not alpha > 0.0:
            return None
        return -beta / alpha, (1.0 - beta) / alpha
    return clip_bounds(node, constant)


def activation_kind(node: PlanNode, constant: ConstantLookup) -> str | None:
    """``"relu"`` for Relu and Clip(0, inf), ``"relu6"`` for Clip(0, 6), else ``None``.

    Example:
        >>> activation_kind(PlanNode("c", "Clip", ("x",), ("y",), {"min": 0.0, "max": 6.0}), lambda n: None)
        'relu6'
    """
    if not node.standard:
        return None
    bounds = clip_bounds(node, constant)
    if bounds == (0.0, math.inf):
        return "relu"
    if bounds == (0.0, 6.0):
        return "relu6"
    return None


def crossed_by_channel_scales(node: PlanNode, constant: ConstantLookup, *, channels_last: bool = False) -> bool:
    """Whether a positive per-channel scale of ``node``'s first input comes out unchanged at
    its output (Relu, LeakyRelu, Clip(0, inf), and, for channels on axis 1, max and average
    pooling: :data:`CHANNEL_WISE_POOLS`), so that it can move from one side of the node to
    the other. ``channels_last``: the channels are the last axis (a dense layer's). PRelu,
    homogeneous too, is not crossed: its per-channel slope is a second input, which the
    walks that move scales do not read.

    Example:
        >>> crossed_by_channel_scales(PlanNode("p", "MaxPool", ("x",), ("y",)), lambda n: None)
        True
        >>> crossed_by_channel_scales(PlanNode("p", "MaxPool", ("x",), ("y",)), lambda n: None, channels_last=True)
        False
        >>> crossed_by_channel_scales(PlanNode("c", "Clip", ("x",), ("y",), {"min": 0.0, "max": 6.0}), lambda n: None)
        False
    """
    if not node.standard:
        return False
    if node.op_type in CHANNEL_WISE_POOLS:
        return not channels_last
    kept = tuple(op for op in HOMOGENEOUS_ACTIVATIONS if op != "PRelu")
    return node.op_type in kept or activation_kind(node, constant) == "relu"


def weight_channel_axis(node: PlanNode, weight_rank: int) -> int | None:
    """The output-channel axis of a weighted op's weight, or ``None`` when the layout has
    no single such axis (a grouped ConvTranspose: ``[Cin, Cout/g, ...]``; a MatMul vector
    ``[K]``, whose one axis is summed over; a stacked MatMul weight ``[B, K, N]``).

    Conv: 0 (``[Cout, Cin/g, kh, kw]``); ConvTranspose: 1 (``[Cin, Cout/g, kh, kw]``);
    Gemm: 0 when ``transB=1`` (``[N, K]``) else 1; MatMul: 1 (``[K, N]``).

    Example:
        >>> weight_channel_axis(PlanNode("fc", "Gemm", ("a", "b"), ("c",), {"transB": 1}), 2)
        0
    """
    op = node.op_type
    if op == "Conv":
        return 0
    if op == "ConvTranspose":
        return 1 if int(node.attr("group", 1)) == 1 else None
    if op == "Gemm":
        return 0 if int(node.attr("transB", 0)) == 1 else 1
    if op == "MatMul":
        # A stacked weight ``[B, K, N]`` stays per tensor: onnxruntime's integer MatMul
        # kernels take per-column scales of a 2-D right input only (a rank-3 one with a 1-D
        # zero point fails to run once fused into MatMulIntegerToFloat).
        return 1 if weight_rank == 2 else None
    raise ModelError(f"node {node.name!r}: op type {op!r} has no weight; allowed: Conv, ConvTranspose, Gemm, MatMul")


def weight_is_transposed(node: PlanNode) -> bool:
    """True when the op stores its weight ``[in, out]`` (MatMul, Gemm with ``transB=0``).

    Example:
        >>> weight_is_transposed(PlanNode("mm", "MatMul", ("a", "b"), ("c",)))
        True
    """
    return node.op_type == "MatMul" or (node.op_type == "Gemm" and not int(node.attr("transB", 0)))
