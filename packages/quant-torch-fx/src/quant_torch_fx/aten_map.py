"""ATen operators in ONNX terms: one table, :data:`ATEN_OPS`, read by the planner and by
the exporter, so that the op a plan talks about is the op the file holds.

Each entry (:class:`AtenOp`) gives

- the planner's view: :func:`plan_node_for` turns one node of a ``torch.export`` graph into
  the :class:`~quant_core.plan.PlanNode` the ONNX file holds for it: the same op type
  (``conv2d`` -> ``Conv``, ``linear`` -> ``Gemm`` with ``transB=1``, ``hardtanh`` ->
  ``Clip``...), its tensor inputs in ONNX order and the attributes the planner reads;
- the exporter's rule (:mod:`quant_torch_fx.onnx_rules`,
  :mod:`quant_torch_fx.onnx_layout_rules`): how :mod:`quant_torch_fx.onnx_emit` writes the
  node, which must write the planned op (or the ops ``written_as`` lists).

This is a translation table only; what each op type means for quantization (shared scales,
fusions, weights) is :mod:`quant_core.plan`'s, so one config means the same thing on both
backends. Ops without a planner view become non-standard nodes (``standard=False``): the
planner keeps them float and reports them; ops without a rule cannot be exported.

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
from quant_torch_fx import onnx_layout_rules as layout
from quant_torch_fx import onnx_rules as rules

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
    attributes = {"mode": mode, "value": 0.0 if value is None else float(value)}
    return "Pad", [_arg(node, 0, "self")], {**attributes, **_onnx_pads(node)}


def _constant_pad(node: Node) -> tuple[str, list[Any], dict[str, Any]]:
    attributes = {"mode": "constant", "value": float(_arg(node, 2, "value", 0.0))}
    return "Pad", [_arg(node, 0, "self")], {**attributes, **_onnx_pads(node)}


def _onnx_pads(node: Node) -> dict[str, Any]:
    """``{"pads": [begin of every axis..., end of every axis...]}`` (ONNX's order) from
    torch's ``pad`` (last axis first, begin and end in pairs); empty when the rank or the
    amounts are not known when the graph is planned."""
    source, amounts = _arg(node, 0, "self"), _arg(node, 1, "pad")
    value = source.meta.get("val") if isinstance(source, Node) else None
    if value is None or not isinstance(amounts, Sequence) or not all(isinstance(a, int) for a in amounts):
        return {}
    rank = value.dim()
    begin, end = [0] * rank, [0] * rank
    for i in range(len(amounts) // 2):
        begin[rank - 1 - i], end[rank - 1 - i] = amounts[2 * i], amounts[2 * i + 1]
    return {"pads": [*begin, *end]}


def _resize(mode: str) -> _Translate:
    return lambda node: ("Resize", [_arg(node, 0, "input")], {"mode": mode})


def _conv_attributes(node: Node) -> dict[str, Any]:
    return rules.conv_attributes(node)


def _convolution(node: Node) -> tuple[str, list[Any], dict[str, Any]]:
    transposed = bool(_arg(node, 6, "transposed", False))
    op = "ConvTranspose" if transposed else "Conv"
    inputs = [_arg(node, 0, "input"), _arg(node, 1, "weight"), _arg(node, 2, "bias")]
    return op, inputs, rules.conv_attributes(node)


def _mean(node: Node) -> tuple[str, list[Any], dict[str, Any]]:
    """``mean(x, dim, keepdim)`` with ONNX's ``axes``/``keepdims`` where the dims are given."""
    dims = _arg(node, 1, "dim", None)
    attributes: dict[str, Any] = {"keepdims": int(bool(_arg(node, 2, "keepdim", False)))}
    if isinstance(dims, list | tuple) and all(isinstance(d, int) for d in dims):
        attributes["axes"] = tuple(dims)
    return "ReduceMean", [_arg(node, 0, "self")], attributes


def _matmul(node: Node) -> tuple[str, list[Any], dict[str, Any]]:
    return "MatMul", [_arg(node, 0, "self"), _arg(node, 1, "other")], {}


def _rsub(node: Node) -> tuple[str, list[Any], dict[str, Any]]:
    """``rsub(x, other)`` is ``other - x``: ONNX's ``Sub(other, x)``."""
    return "Sub", [_arg(node, 1, "other"), _arg(node, 0, "self")], {}


def _linear(node: Node) -> tuple[str, list[Any], dict[str, Any]]:
    return "Gemm", [_arg(node, 0, "input"), _arg(node, 1, "weight"), _arg(node, 2, "bias")], {"transB": 1}


_PLAIN_UNARY = {
    "exp": "Exp", "log": "Log", "neg": "Neg", "abs": "Abs", "reciprocal": "Reciprocal", "floor": "Floor",
    "ceil": "Ceil", "sign": "Sign", "sin": "Sin", "cos": "Cos", "logical_not": "Not", "bitwise_not": "Not",
    "isnan": "IsNaN",
}  # fmt: skip
"""One-input ops with the same definition in ONNX that the planner keeps float."""

_COMPARISONS = {"eq": "Equal", "ne": "Not", "lt": "Less", "le": "LessOrEqual", "gt": "Greater", "ge": "GreaterOrEqual"}
_LOGICAL = {
    "logical_and": "And", "logical_or": "Or", "logical_xor": "Xor",
    "bitwise_and": "And", "bitwise_or": "Or", "bitwise_xor": "Xor",
    "__and__": "And", "__or__": "Or", "__xor__": "Xor",  # `mask_a | mask_b` in Python
}  # fmt: skip
_ALIAS_NAMES = (
    "clone", "contiguous", "alias", "detach", "detach_", "dropout", "feature_dropout", "lift_fresh_copy", "identity",
)  # fmt: skip


@attrs.frozen
class AtenOp:
    """One ATen op in both vocabularies: ``plan`` gives the planner's view of a node (ONNX op
    type, inputs in ONNX order, attributes; ``None``: the planner keeps it float as a
    non-standard op), ``emit`` writes it into the ONNX file
    (:mod:`quant_torch_fx.onnx_rules`), ``onnx`` names what it writes when there is no
    plan, and ``written_as`` lists the op types the file may hold for it besides the
    planned one (a decomposition; shape helpers are always allowed).

    Example:
        >>> ATEN_OPS["hardswish"].onnx, sorted(ATEN_OPS["linear"].written_as)
        ('HardSwish', ['Add', 'MatMul', 'Transpose'])
    """

    onnx: str
    plan: _Translate | None = None
    emit: Any = None
    written_as: frozenset[str] = frozenset()

    def op_type(self, node: Node) -> str:
        """The op the plan calls ``node`` (what the file writes for it)."""
        return self.plan(node)[0] if self.plan is not None else self.onnx


def _ops(
    names: Sequence[str], onnx: str, plan: _Translate | None, emit: Any, written_as: Sequence[str] = ()
) -> dict[str, AtenOp]:
    """One entry per name (an op and its in-place form share it)."""
    entry = AtenOp(onnx, plan, emit, frozenset[str](written_as))
    return dict.fromkeys(names, entry)


def _unary(onnx: str, *names: str) -> dict[str, AtenOp]:
    """Element-wise one-input ops in the planner's table (and their in-place forms)."""
    return _ops([n for name in names for n in (name, f"{name}_")], onnx, _first(onnx), rules.unary)


def _where(node: Node) -> tuple[str, list[Any], dict[str, Any]]:
    """``where(condition, self, other)``: ONNX's ``Where`` (no policy: it stays float; the
    planner reads its constant branches, an attention mask's ``0`` and fill)."""
    return "Where", [_arg(node, 0, "condition"), _arg(node, 1, "self"), _arg(node, 2, "other")], {}


def _masked_fill(node: Node) -> tuple[str, list[Any], dict[str, Any]]:
    """``masked_fill(self, mask, value)`` is ``Where(mask, value, self)`` (a number ``value``
    is a constant once :func:`~quant_torch_fx.graph_passes.scalars_to_constants` ran)."""
    return "Where", [_arg(node, 1, "mask"), _arg(node, 2, "value"), _arg(node, 0, "self")], {}


def _filled(value: float) -> _Translate:
    """``zeros``/``ones`` and their ``_like``/``new_`` forms as ONNX's ``ConstantOfShape``
    with its fill: the planner then knows every element's value (``zeros_like`` of a mask is
    the ``0`` of an attention mask made additive, ``quant_core.plan.graph.uniform_value``)."""

    def translate(_node: Node) -> tuple[str, list[Any], dict[str, Any]]:
        return "ConstantOfShape", [], {"value": value}

    return translate


def _float(onnx: str, emit: Any, *names: str, written_as: Sequence[str] = ()) -> dict[str, AtenOp]:
    """Ops the planner keeps float (non-standard): written, never quantized inside (their
    in-place forms are written by the same rule)."""
    return _ops(names, onnx, None, emit, written_as)


_DECOMPOSED_GELU = ("Mul", "Add", "Erf", "Tanh")
_POOL_PIECES = ("Slice", "ReduceMean", "ReduceMax", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool")

ATEN_OPS: dict[str, AtenOp] = {
    # weighted
    **_ops(("conv1d", "conv2d", "conv3d"), "Conv", _weighted("Conv", _conv_attributes), rules.conv),
    **_ops(
        ("conv_transpose1d", "conv_transpose2d", "conv_transpose3d"),
        "ConvTranspose",
        _weighted("ConvTranspose", _conv_attributes),
        rules.conv,
    ),
    **_ops(("convolution",), "Conv", _convolution, rules.conv),
    # linear over tokens is written MatMul (weight stored [in, out]) then Add of the bias
    **_ops(("linear",), "Gemm", _linear, rules.linear, ("MatMul", "Add", "Transpose")),
    **_ops(("matmul", "mm", "bmm"), "MatMul", _matmul, rules.matmul),
    **_ops(("addmm",), "Gemm", None, rules.addmm),
    # element-wise
    **_ops(("add", "add_"), "Add", _binary("Add"), rules.binary, ("Mul",)),
    **_ops(("mul", "mul_"), "Mul", _binary("Mul"), rules.binary),
    **_ops(("sub", "sub_"), "Sub", _binary("Sub"), rules.binary, ("Mul",)),
    **_ops(("rsub",), "Sub", _rsub, rules.rsub, ("Mul",)),
    **_ops(("div", "div_"), "Div", _binary("Div"), rules.binary, ("Floor", "Sign", "Abs", "Mul", "Mod", "Sub")),
    **_unary("Relu", "relu"),
    **_ops(("hardtanh", "hardtanh_"), "Clip", _hardtanh, rules.clamp, ("Max", "Min")),
    **_ops(("relu6",), "Clip", lambda node: ("Clip", [_arg(node, 0, "self")], {"min": 0.0, "max": 6.0}), rules.clamp),
    **_ops(("clamp", "clamp_", "clip", "clip_"), "Clip", _clamp, rules.clamp, ("Max", "Min")),
    **_ops(("clamp_min", "clamp_min_"), "Clip", _clamp_bound("min"), rules.clamp, ("Max",)),
    **_ops(("clamp_max", "clamp_max_"), "Clip", _clamp_bound("max"), rules.clamp, ("Min",)),
    **_unary("Sigmoid", "sigmoid"),
    **_ops(("hardswish", "hardswish_"), "HardSwish", _first("HardSwish"), rules.hard_swish),
    # torch's hardsigmoid is relu6(x + 3) / 6: ONNX's HardSigmoid with alpha 1/6 (its default is 0.2).
    **_ops(
        ("hardsigmoid", "hardsigmoid_"),
        "HardSigmoid",
        lambda node: ("HardSigmoid", [_arg(node, 0, "self")], {"alpha": 1.0 / 6.0, "beta": 0.5}),
        rules.hard_sigmoid,
    ),
    **_unary("Tanh", "tanh"),
    **_ops(("leaky_relu", "leaky_relu_"), "LeakyRelu", _first("LeakyRelu"), rules.leaky_relu),
    **_ops(
        ("prelu", "_prelu_kernel"),
        "PRelu",
        lambda node: ("PRelu", [_arg(node, 0, "self"), _arg(node, 1, "weight")], {}),
        rules.prelu,
    ),
    **_ops(("gelu", "gelu_"), "Gelu", _first("Gelu"), rules.gelu, _DECOMPOSED_GELU),
    **_ops(("softmax", "_softmax"), "Softmax", _first("Softmax"), rules.softmax),
    **_unary("Sqrt", "sqrt"),
    **_unary("Erf", "erf"),
    **_ops(("pow", "pow_"), "Pow", _first("Pow"), rules.power),
    # pooling and reductions
    **_ops(
        ("max_pool1d", "max_pool2d", "max_pool3d", "max_pool2d_with_indices", "max_pool3d_with_indices"),
        "MaxPool",
        _first("MaxPool"),
        rules.max_pool,
    ),
    # (values, indices) like max_pool2d_with_indices: MaxPool's policy reads output 0 only
    **_ops(
        [f"adaptive_max_pool{d}d" for d in (1, 2, 3)],
        "MaxPool",
        _first("MaxPool"),
        rules.adaptive_pool,
        (*_POOL_PIECES, "Concat"),
    ),
    **_ops(
        ("avg_pool1d", "avg_pool2d", "avg_pool3d"), "AveragePool", _first("AveragePool"), rules.avg_pool, ("Pad", "Mul")
    ),
    **_ops(
        ("adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "_adaptive_avg_pool2d"),
        "AveragePool",
        _adaptive_avg_pool,
        rules.adaptive_pool,
        (*_POOL_PIECES, "Concat"),
    ),
    **_ops(("mean",), "ReduceMean", _mean, rules.reduce),
    **_ops(("amax",), "ReduceMax", _first("ReduceMax"), rules.reduce),
    **_ops(("amin",), "ReduceMin", _first("ReduceMin"), rules.reduce),
    # data movement
    **_ops(("cat", "concat"), "Concat", _concat, layout.concat),
    **_ops(("view", "reshape", "_unsafe_view"), "Reshape", _first("Reshape"), layout.reshape),
    **_ops(("flatten",), "Flatten", _first("Flatten"), layout.flatten, ("Reshape",)),
    **_ops(("permute", "transpose", "t"), "Transpose", _first("Transpose"), layout.permute),
    **_ops(("squeeze", "squeeze_"), "Squeeze", _first("Squeeze"), layout.squeeze),
    **_ops(("unsqueeze", "unsqueeze_"), "Unsqueeze", _first("Unsqueeze"), layout.unsqueeze),
    **_ops(("slice", "narrow"), "Slice", _first("Slice"), layout.slice_),
    **_ops(("select",), "Gather", _first("Gather"), layout.select),
    **_ops(("index_select",), "Gather", _first("Gather"), layout.index_select),
    **_ops(("split", "split_with_sizes", "chunk", "unbind"), "Split", _first("Split"), layout.split),
    **_ops(("expand", "expand_as"), "Expand", _first("Expand"), layout.expand),
    **_ops(("repeat",), "Tile", _first("Tile"), layout.repeat),
    **_ops(("pixel_shuffle",), "DepthToSpace", _first("DepthToSpace"), rules.pixel_shuffle),
    # torch's channel order is not SpaceToDepth's: written as Reshape, Transpose, Reshape
    **_ops(("pixel_unshuffle",), "SpaceToDepth", _first("SpaceToDepth"), layout.pixel_unshuffle, ("Transpose",)),
    **_ops(("pad",), "Pad", _pad, layout.pad, ("Slice", "Concat")),
    **_ops(("constant_pad_nd",), "Pad", _constant_pad, layout.pad),
    **_ops(
        ("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d"), "Resize", _resize("nearest"), rules.upsample
    ),
    **_ops(
        ("upsample_linear1d", "upsample_bilinear2d", "upsample_trilinear3d"),
        "Resize",
        _resize("linear"),
        rules.upsample,
    ),
    **_ops(("upsample_bicubic2d",), "Resize", _resize("cubic"), rules.upsample),
    **_ops(
        ("batch_norm",),
        "BatchNormalization",
        lambda node: ("BatchNormalization", [_arg(node, 0, "input")], {}),
        rules.batch_norm,
    ),
    # the planner's transformer recipe recognises LayerNormalization (its input and output)
    **_ops(
        ("layer_norm",),
        "LayerNormalization",
        lambda node: (
            "LayerNormalization",
            [_arg(node, 0, "input"), _arg(node, 2, "weight"), _arg(node, 3, "bias")],
            {},
        ),
        rules.layer_norm,
    ),
    # ops the planner keeps float (no entry in its table): written as torch computes them
    **_float("BatchNormalization", rules.batch_norm, "_native_batch_norm_legit_no_training"),
    **_float("LayerNormalization", rules.layer_norm, "native_layer_norm"),
    **_float("InstanceNormalization", rules.group_norm, "group_norm", written_as=("Mul", "Add")),
    **_float(
        "Resize", rules.upsample, "_upsample_nearest_exact1d", "_upsample_nearest_exact2d", "_upsample_nearest_exact3d"
    ),
    **_float("Mul", rules.silu, "silu", written_as=("Sigmoid",)),
    **_float("Mul", rules.mish, "mish", written_as=("Tanh", "Softplus")),
    **_float("Softplus", rules.softplus, "softplus"),
    **_float("Elu", rules.elu, "elu"),
    **_float("LogSoftmax", rules.softmax, "log_softmax", "_log_softmax"),
    **_float("ReduceSum", rules.reduce, "sum"),
    **_float("ReduceMax", rules.max_min_dim, "max", written_as=("ArgMax", "Max")),
    **_float("ReduceMin", rules.max_min_dim, "min", written_as=("ArgMin", "Min")),
    **_float("ReduceL2", rules.vector_norm, "linalg_vector_norm", written_as=("ReduceL1",)),
    **_float("Max", rules.binary, "maximum"),
    **_float("Min", rules.binary, "minimum"),
    **_float("Reciprocal", rules.rsqrt, "rsqrt", written_as=("Sqrt",)),
    **_float("Round", rules.round_, "round", written_as=("Mul", "Div")),
    **{name: AtenOp(onnx, None, rules.unary) for name, onnx in _PLAIN_UNARY.items()},
    **{name: AtenOp(onnx, None, rules.compare, frozenset[str](["Equal"])) for name, onnx in _COMPARISONS.items()},
    **{name: AtenOp(onnx, None, rules.logical) for name, onnx in _LOGICAL.items()},
    **_ops(("where",), "Where", _where, rules.where),
    **_ops(("masked_fill", "masked_fill_"), "Where", _masked_fill, rules.where),
    **_float("Cast", rules.cast, "to", "_to_copy", "type_as"),
    **_float("Identity", rules.identity, *_ALIAS_NAMES),
    **_float("Slice", layout.flip, "flip"),
    **_float("Concat", layout.roll, "roll", written_as=("Slice",)),
    **_float("Concat", layout.concat, "stack", written_as=("Unsqueeze",)),
    **_float("Gather", layout.index, "index"),
    **_float("GatherElements", layout.gather, "gather"),
    **_float("Reshape", layout.reshape, "view_as", "reshape_as", "unflatten"),
    **_float("Transpose", layout.permute, "movedim"),
    **_float("Pad", layout.pad, *[f"{kind}_pad{d}d" for kind in ("reflection", "replication") for d in (1, 2, 3)]),
    **_ops(("zeros", "new_zeros", "zeros_like"), "ConstantOfShape", _filled(0.0), layout.full),
    **_ops(("ones", "new_ones", "ones_like"), "ConstantOfShape", _filled(1.0), layout.full),
    **_float("ConstantOfShape", layout.full, "full", "new_full", "full_like"),
    **_float("Range", layout.arange, "arange"),
    **_float("Expand", layout.meshgrid, "meshgrid", written_as=("Reshape",)),
    **_float("CumSum", layout.cumsum, "cumsum", written_as=("Cast",)),
    **_float("Constant", layout.scalar_tensor, "scalar_tensor"),
}
"""ATen op name -> :class:`AtenOp`: the one table from ATen to ONNX, for the planner
(:func:`map_node`) and the exporter (:mod:`quant_torch_fx.onnx_emit`)."""

ALIASES = frozenset(_ALIAS_NAMES)
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
    entry = ATEN_OPS.get(name)
    translate = entry.plan if entry is not None else None
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
        raise AssertionError(f"node {node.name!r}: {op_name(node)!r} is an alias, not an op")
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
