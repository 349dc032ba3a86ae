"""ATen operators in the planner's vocabulary (ONNX operator names).

:func:`plan_node_for` turns one node of a ``torch.export`` graph into the
:class:`~quant_core.plan.PlanNode` that the ONNX exporter would write for it: the same op
type (``conv2d`` -> ``Conv``, ``linear`` -> ``Gemm`` with ``transB=1``, ``hardtanh`` ->
``Clip``...), its tensor inputs in ONNX order and the attributes the planner reads. This
is a translation table only; what each op type means for quantization (shared scales,
fusions, weights) is :mod:`quant_core.plan`'s, so one config means the same thing on
both backends.

Ops without an entry become non-standard nodes (``standard=False``): the planner keeps
them float and reports them.

Example:
    >>> import torch
    >>> from torch.fx import Graph
    >>> g = Graph()
    >>> x = g.placeholder("x")
    >>> y = g.call_function(torch.ops.aten.hardtanh.default, (x, 0.0, 6.0))
    >>> spec = plan_node_for(y, "relu6")
    >>> spec.op_type, spec.inputs, dict(spec.attributes)
    ('Clip', ('x',), {'min': 0.0, 'max': 6.0})
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from torch.fx import Node

from quant_core.plan import PlanNode

_Translate = Callable[[Node], tuple[str, list[Any], dict[str, Any]]]


def op_name(node: Node) -> str:
    """The ATen op's short name (``"conv2d"`` for ``aten.conv2d.padding``), or ``""``.

    Example:
        >>> from torch.fx import Graph
        >>> g = Graph(); x = g.placeholder("x")
        >>> op_name(g.call_function(torch.ops.aten.add_.Tensor, (x, x)))
        'add_'
    """
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return ""
    return str(target._schema.name).split("::", 1)[-1]


def _arg(node: Node, index: int, name: str, default: Any = None) -> Any:
    if index < len(node.args):
        return node.args[index]
    return node.kwargs.get(name, default)


def _first(op: str) -> _Translate:
    """The op reads its first argument's values (shape/index arguments are not data)."""
    return lambda node: (op, [_arg(node, 0, "self")], {})


def _weighted(op: str, attributes: Callable[[Node], dict[str, Any]] = lambda node: {}) -> _Translate:
    return lambda node: (op, [_arg(node, 0, "input"), _arg(node, 1, "weight"), _arg(node, 2, "bias")], attributes(node))


def _binary(op: str) -> _Translate:
    return lambda node: (op, [_arg(node, 0, "self"), _arg(node, 1, "other")], {})


def _clip_attributes(lo: Any, hi: Any) -> tuple[list[Any], dict[str, Any]]:
    """Clip's bounds: numbers become attributes, tensors extra inputs (``None``: unbounded)."""
    attributes: dict[str, Any] = {}
    extra: list[Any] = []
    for key, value in (("min", lo), ("max", hi)):
        if isinstance(value, Node):
            extra.append(value)
        else:
            extra.append(None)
            if value is not None:
                attributes[key] = float(value)
    if not any(isinstance(v, Node) for v in extra):
        extra = []
    return extra, attributes


def _clamp(node: Node) -> tuple[str, list[Any], dict[str, Any]]:
    extra, attributes = _clip_attributes(_arg(node, 1, "min"), _arg(node, 2, "max"))
    return "Clip", [_arg(node, 0, "self"), *extra], attributes


def _hardtanh(node: Node) -> tuple[str, list[Any], dict[str, Any]]:
    lo, hi = _arg(node, 1, "min_val", -1.0), _arg(node, 2, "max_val", 1.0)
    return "Clip", [_arg(node, 0, "self")], {"min": float(lo), "max": float(hi)}


def _clamp_bound(key: str) -> _Translate:
    def translate(node: Node) -> tuple[str, list[Any], dict[str, Any]]:
        value = _arg(node, 1, key)
        lo, hi = (value, None) if key == "min" else (None, value)
        extra, attributes = _clip_attributes(lo, hi)
        return "Clip", [_arg(node, 0, "self"), *extra], attributes

    return translate


def _concat(node: Node) -> tuple[str, list[Any], dict[str, Any]]:
    return "Concat", list(_arg(node, 0, "tensors")), {"axis": _arg(node, 1, "dim", 0)}


def _adaptive_avg_pool(node: Node) -> tuple[str, list[Any], dict[str, Any]]:
    size = _arg(node, 1, "output_size")
    if isinstance(size, Sequence) and all(s == 1 for s in size):
        return "GlobalAveragePool", [_arg(node, 0, "self")], {}
    return "AveragePool", [_arg(node, 0, "self")], {}


def _pad(node: Node) -> tuple[str, list[Any], dict[str, Any]]:
    mode = _arg(node, 2, "mode", "constant")
    value = _arg(node, 3, "value", None)
    return "Pad", [_arg(node, 0, "self")], {"mode": mode, "value": 0.0 if value is None else float(value)}


def _constant_pad(node: Node) -> tuple[str, list[Any], dict[str, Any]]:
    return "Pad", [_arg(node, 0, "self")], {"mode": "constant", "value": float(_arg(node, 2, "value", 0.0))}


def _resize(mode: str) -> _Translate:
    return lambda node: ("Resize", [_arg(node, 0, "input")], {"mode": mode})


def _conv_attributes(node: Node) -> dict[str, Any]:
    groups = _arg(node, 6, "groups", 1)
    return {"group": int(groups) if isinstance(groups, int) else 1}


def _conv_transpose_attributes(node: Node) -> dict[str, Any]:
    groups = _arg(node, 6, "groups", 1)
    return {"group": int(groups) if isinstance(groups, int) else 1}


def _convolution(node: Node) -> tuple[str, list[Any], dict[str, Any]]:
    transposed = bool(_arg(node, 6, "transposed", False))
    groups = _arg(node, 8, "groups", 1)
    op = "ConvTranspose" if transposed else "Conv"
    inputs = [_arg(node, 0, "input"), _arg(node, 1, "weight"), _arg(node, 2, "bias")]
    return op, inputs, {"group": int(groups) if isinstance(groups, int) else 1}


def _matmul(node: Node) -> tuple[str, list[Any], dict[str, Any]]:
    return "MatMul", [_arg(node, 0, "self"), _arg(node, 1, "other")], {}


def _rsub(node: Node) -> tuple[str, list[Any], dict[str, Any]]:
    """``rsub(x, other)`` is ``other - x``: ONNX's ``Sub(other, x)``."""
    return "Sub", [_arg(node, 1, "other"), _arg(node, 0, "self")], {}


def _linear(node: Node) -> tuple[str, list[Any], dict[str, Any]]:
    return "Gemm", [_arg(node, 0, "input"), _arg(node, 1, "weight"), _arg(node, 2, "bias")], {"transB": 1}


ATEN_TO_ONNX: dict[str, _Translate] = {
    # weighted
    **{name: _weighted("Conv", _conv_attributes) for name in ("conv1d", "conv2d", "conv3d")},
    **{
        name: _weighted("ConvTranspose", _conv_transpose_attributes)
        for name in ("conv_transpose1d", "conv_transpose2d", "conv_transpose3d")
    },
    "convolution": _convolution,
    "linear": _linear,
    "matmul": _matmul,
    "mm": _matmul,
    "bmm": _matmul,
    # element-wise
    **{name: _binary("Add") for name in ("add", "add_")},
    **{name: _binary("Mul") for name in ("mul", "mul_")},
    **{name: _binary("Sub") for name in ("sub", "sub_")},
    "rsub": _rsub,
    **{name: _binary("Div") for name in ("div", "div_")},
    **{name: _first("Relu") for name in ("relu", "relu_")},
    **{name: _hardtanh for name in ("hardtanh", "hardtanh_")},
    "relu6": lambda node: ("Clip", [_arg(node, 0, "self")], {"min": 0.0, "max": 6.0}),
    **{name: _clamp for name in ("clamp", "clamp_", "clip", "clip_")},
    **{name: _clamp_bound("min") for name in ("clamp_min", "clamp_min_")},
    **{name: _clamp_bound("max") for name in ("clamp_max", "clamp_max_")},
    **{name: _first("Sigmoid") for name in ("sigmoid", "sigmoid_")},
    **{name: _first("HardSwish") for name in ("hardswish", "hardswish_")},
    **{name: _first("HardSigmoid") for name in ("hardsigmoid", "hardsigmoid_")},
    **{name: _first("Tanh") for name in ("tanh", "tanh_")},
    **{name: _first("LeakyRelu") for name in ("leaky_relu", "leaky_relu_")},
    "prelu": lambda node: ("PRelu", [_arg(node, 0, "self"), _arg(node, 1, "weight")], {}),
    "_prelu_kernel": lambda node: ("PRelu", [_arg(node, 0, "self"), _arg(node, 1, "weight")], {}),
    "gelu": _first("Gelu"),
    "softmax": _first("Softmax"),
    "_softmax": _first("Softmax"),
    "sqrt": _first("Sqrt"),
    "erf": _first("Erf"),
    "pow": _first("Pow"),
    # pooling and reductions
    "max_pool1d": _first("MaxPool"),
    "max_pool2d": _first("MaxPool"),
    "max_pool3d": _first("MaxPool"),
    "max_pool2d_with_indices": _first("MaxPool"),
    # (values, indices) like max_pool2d_with_indices: MaxPool's policy reads output 0 only
    **{f"adaptive_max_pool{d}d": _first("MaxPool") for d in (1, 2, 3)},
    "avg_pool1d": _first("AveragePool"),
    "avg_pool2d": _first("AveragePool"),
    "avg_pool3d": _first("AveragePool"),
    "adaptive_avg_pool1d": _adaptive_avg_pool,
    "adaptive_avg_pool2d": _adaptive_avg_pool,
    "adaptive_avg_pool3d": _adaptive_avg_pool,
    "mean": _first("ReduceMean"),
    "amax": _first("ReduceMax"),
    "amin": _first("ReduceMin"),
    # data movement
    "cat": _concat,
    "concat": _concat,
    "view": _first("Reshape"),
    "reshape": _first("Reshape"),
    "_unsafe_view": _first("Reshape"),
    "flatten": _first("Flatten"),
    "permute": _first("Transpose"),
    "transpose": _first("Transpose"),
    "t": _first("Transpose"),
    "squeeze": _first("Squeeze"),
    "unsqueeze": _first("Unsqueeze"),
    "slice": _first("Slice"),
    "narrow": _first("Slice"),
    "select": _first("Gather"),
    "index_select": _first("Gather"),
    "split": _first("Split"),
    "split_with_sizes": _first("Split"),
    "chunk": _first("Split"),
    "unbind": _first("Split"),
    "expand": _first("Expand"),
    "expand_as": _first("Expand"),
    "repeat": _first("Tile"),
    "pixel_shuffle": _first("DepthToSpace"),
    "pixel_unshuffle": _first("SpaceToDepth"),
    "pad": _pad,
    "constant_pad_nd": _constant_pad,
    "upsample_nearest1d": _resize("nearest"),
    "upsample_nearest2d": _resize("nearest"),
    "upsample_nearest3d": _resize("nearest"),
    "upsample_linear1d": _resize("linear"),
    "upsample_bilinear2d": _resize("linear"),
    "upsample_trilinear3d": _resize("linear"),
    "upsample_bicubic2d": _resize("cubic"),
    "batch_norm": lambda node: ("BatchNormalization", [_arg(node, 0, "input")], {}),
    "layer_norm": lambda node: (
        "LayerNormalization",
        [_arg(node, 0, "input"), _arg(node, 2, "weight"), _arg(node, 3, "bias")],
        {},
    ),
}
"""ATen op name -> ``node -> (ONNX op type, inputs in ONNX order, attributes)``."""

ALIASES = frozenset(
    {"clone", "contiguous", "alias", "detach", "detach_", "dropout", "feature_dropout", "lift_fresh_copy", "identity"}
)
"""Ops whose output is their input's value in inference (the ONNX exporter writes nothing,
or an Identity its cleanup removes): the planner sees the input tensor itself."""


@attrs.frozen
class MappedNode:
    """One FX node in the planner's vocabulary, before tensor names are resolved.

    Example:
        >>> MappedNode("Relu", ("x",), {}).standard
        True
    """

    op_type: str
    inputs: tuple[Any, ...]
    attributes: dict[str, Any]
    standard: bool = True


def map_node(node: Node) -> MappedNode | None:
    """``node`` as an ONNX op (``None`` for alias ops and nodes without tensor outputs)."""
    name = op_name(node)
    if name in ALIASES:
        return None
    translate = ATEN_TO_ONNX.get(name)
    if translate is None:
        tensors = [a for a in _flat_args(node) if isinstance(a, Node)]
        return MappedNode(f"aten.{name}" if name else str(node.target), tuple(tensors), {}, standard=False)
    op_type, inputs, attributes = translate(node)
    return MappedNode(op_type, tuple(inputs), attributes)


def _flat_args(node: Node) -> list[Any]:
    flat: list[Any] = []
    for value in (*node.args, *node.kwargs.values()):
        if isinstance(value, list | tuple):
            flat.extend(value)
        else:
            flat.append(value)
    return flat


def plan_node_for(
    node: Node,
    name: str,
    tensor_name: Callable[[Node], str] | None = None,
    outputs: Sequence[str] | None = None,
) -> PlanNode:
    """``node`` as a :class:`PlanNode` called ``name``; ``tensor_name`` names an input
    node's tensor (default: the node's own name; omitted inputs become ``""``);
    ``outputs`` names its outputs (default: the node itself)."""
    mapped = map_node(node)
    if mapped is None:
        raise ValueError(f"node {node.name!r}: {op_name(node)!r} is an alias, not an op")
    return to_plan_node(mapped, name, tensor_name, (node.name,) if outputs is None else outputs)


def to_plan_node(
    mapped: MappedNode, name: str, tensor_name: Callable[[Node], str] | None, outputs: Sequence[str]
) -> PlanNode:
    """A :class:`MappedNode` with its tensors named (trailing omitted inputs dropped)."""
    naming = tensor_name or (lambda n: n.name)
    # inputs are FX nodes, tensor names already (a module's own constants), or omitted (None)
    inputs = [naming(v) if isinstance(v, Node) else v if isinstance(v, str) else "" for v in mapped.inputs]
    while inputs and inputs[-1] == "":
        inputs.pop()
    # attrs' converter=tuple gives mypy an unsolved generic parameter type here
    return PlanNode(name, mapped.op_type, tuple(inputs), tuple(outputs), mapped.attributes, standard=mapped.standard)  # type: ignore[arg-type]
