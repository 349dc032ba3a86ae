"""How each computing ATen op is written in ONNX, exactly as torch computes it: layers
(convolution, linear, matmul), element-wise arithmetic and activations, normalisation,
pooling and resizing (attention is written out in ATen ops first,
:mod:`quant_torch_fx.attention`). Data movement and tensor creation are in
:mod:`quant_torch_fx.onnx_layout_rules`; :data:`quant_torch_fx.aten_map.ATEN_OPS` ties each
ATen op to its rule.

A rule is ``rule(emitter, node, op_type) -> value``: ``op_type`` is the op the planner
calls the node (the table's), which the rule writes; the value is the output tensor's name
(or a list of names).

Example:
    >>> import torch
    >>> from quant_torch_fx.onnx_emit import emit_onnx
    >>> class Net(torch.nn.Module):
    ...     def forward(self, x):
    ...         return torch.nn.functional.gelu(x, approximate="tanh")
    >>> gm = torch.export.export(Net(), (torch.randn(2, 3),)).module()
    >>> [n.op_type for n in emit_onnx(gm, opset=20, input_names=["x"], output_names=None).graph.node]
    ['Gelu']
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.fx import Node

from quant_core.errors import ModelError
from quant_torch_fx.onnx_context import RuleContext
from quant_torch_fx.onnx_types import onnx_type
from quant_torch_fx.onnx_values import Constant, Dequantized

Rule = Any  # Callable[[RuleContext, Node, str], Any]


def bind(node: Node) -> dict[str, Any]:
    """An ATen call's arguments by their schema names, defaults filled in.

    Example:
        >>> from torch.fx import Graph
        >>> g = Graph(); x = g.placeholder("x")
        >>> bind(g.call_function(torch.ops.aten.leaky_relu.default, (x,)))["negative_slope"]
        0.01
    """
    schema = node.target._schema  # type: ignore[union-attr]
    bound: dict[str, Any] = {}
    positional = 0
    for argument in schema.arguments:
        if not argument.kwarg_only and positional < len(node.args):
            bound[argument.name] = node.args[positional]
            positional += 1
        elif argument.name in node.kwargs:
            bound[argument.name] = node.kwargs[argument.name]
        else:
            bound[argument.name] = argument.default_value if argument.has_default_value() else None
    return bound


def schema_name(node: Node) -> str:
    """The ATen op's name without namespace or overload (``"unflatten"``).

    Example:
        >>> from torch.fx import Graph
        >>> g = Graph(); x = g.placeholder("x")
        >>> schema_name(g.call_function(torch.ops.aten.unflatten.int, (x, 0, [1])))
        'unflatten'
    """
    return str(node.target._schema.name).split("::")[-1]  # type: ignore[union-attr]


def _spatial(values: Any, rank: int, default: int) -> list[int]:
    """A per-spatial-axis list from an int or a list that may hold one value for all axes."""
    if values is None or values == []:
        return [default] * rank
    if isinstance(values, int):
        return [values] * rank
    values = [int(v) for v in values]
    return values * rank if len(values) == 1 else values


def _first(ctx: RuleContext, bound: dict[str, Any]) -> Any:
    return bound.get("self", bound.get("input"))


# --- layers -----------------------------------------------------------------------------------------------
def _conv_inputs(ctx: RuleContext, bound: dict[str, Any]) -> list[str]:
    inputs = [ctx.tensor(bound["input"]), ctx.tensor(bound["weight"])]
    if bound.get("bias") is not None:
        inputs.append(ctx.tensor(bound["bias"]))
    return inputs


def conv_attributes(node: Node) -> dict[str, Any]:
    """The ONNX Conv/ConvTranspose attributes of a ``conv{1,2,3}d``,
    ``conv_transpose{1,2,3}d`` or ``convolution`` call: torch's strides, pads (``"same"``
    as explicit pads, the odd one at the end as torch pads it), dilations, groups and, for
    a transposed one, a nonzero output padding. The one reading of torch's convolution
    arguments: the planner's view, the export and the algorithms take it from here.

    Example:
        >>> from torch.fx import Graph
        >>> g = Graph(); x = g.placeholder("x"); w = g.placeholder("w")
        >>> w.meta["val"] = torch.empty(8, 3, 3, 3)
        >>> conv_attributes(g.call_function(torch.ops.aten.conv2d.default, (x, w, None, [2, 2], "same")))
        {'strides': [2, 2], 'pads': [1, 1, 1, 1], 'dilations': [1, 1], 'group': 1}
    """
    bound = bind(node)
    kernel = _kernel_size(bound["weight"])
    spatial = len(kernel)
    stride = _spatial(bound.get("stride"), spatial, 1)
    dilation = _spatial(bound.get("dilation"), spatial, 1)
    padding = bound.get("padding")
    if padding == "valid":
        padding = [0] * spatial
    if padding == "same":
        total = [d * (k - 1) for d, k in zip(dilation, kernel, strict=True)]
        pads = [t // 2 for t in total] + [t - t // 2 for t in total]
    else:
        begin = _spatial(padding, spatial, 0)
        pads = begin + begin
    attributes: dict[str, Any] = {"strides": stride, "pads": pads, "dilations": dilation}
    attributes["group"] = int(bound.get("groups") or 1)
    if "transpose" in schema_name(node) or bound.get("transposed"):
        output_padding = _spatial(bound.get("output_padding"), spatial, 0)
        if any(output_padding):
            attributes["output_padding"] = output_padding
    return attributes


def _kernel_size(weight: Node) -> list[int]:
    """The spatial sizes of a convolution weight (its traced value, or the parameter a
    ``get_attr`` reads)."""
    value = weight.meta.get("val")
    if value is None and weight.op == "get_attr":
        value = operator.attrgetter(str(weight.target))(weight.graph.owning_module)
    if value is None:
        raise ModelError(f"node {weight.name!r}: the convolution weight's shape is not known")
    return [int(k) for k in value.shape[2:]]


def conv(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``conv{1,2,3}d``, ``conv_transpose{1,2,3}d`` and ``convolution``: Conv/ConvTranspose
    with :func:`conv_attributes`."""
    return ctx.add(op_type, _conv_inputs(ctx, ctx.bind(node)), **conv_attributes(node))


def linear(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``linear``: ``Gemm(transB=1)`` on a 2-D input; on any other rank (tokens) a ``MatMul``
    reading the weight stored ``[in, out]`` (integer codes behind their DequantizeLinear,
    channel axis 1, so onnxruntime's QDQ MatMul sees a DQ initializer), then ``Add`` of the
    bias."""
    bound = ctx.bind(node)
    x, weight, bias = bound["input"], bound["weight"], bound.get("bias")
    if ctx.rank(x) == 2:
        inputs = [ctx.tensor(x), ctx.tensor(weight)] + ([ctx.tensor(bias)] if bias is not None else [])
        return ctx.add("Gemm", inputs, transB=1)
    value = ctx.value(weight)
    if isinstance(value, Dequantized):
        transposed = ctx.weight(value, transposed=True)
    elif isinstance(value, Constant):
        transposed = ctx.attr(value.node, transposed=True)
    else:
        transposed = ctx.add("Transpose", [ctx.tensor(weight)], perm=[1, 0])
    product = ctx.add("MatMul", [ctx.tensor(x), transposed])
    return product if bias is None else ctx.add("Add", [product, ctx.tensor(bias)])


def matmul(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``matmul``/``mm``/``bmm``: MatMul (numpy broadcasting and 1-D rules, as torch)."""
    a, b = node.args[0], node.args[1]
    return ctx.add("MatMul", [ctx.tensor(a), ctx.tensor(b)])


def addmm(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``addmm(bias, a, b, beta, alpha)``: Gemm."""
    bound = ctx.bind(node)
    inputs = [ctx.tensor(bound["mat1"]), ctx.tensor(bound["mat2"]), ctx.tensor(bound["self"])]
    return ctx.add("Gemm", inputs, alpha=float(bound["alpha"]), beta=float(bound["beta"]))


# --- element-wise -----------------------------------------------------------------------------------------
def _operands(ctx: RuleContext, a: Any, b: Any, dtype: torch.dtype) -> tuple[str, str]:
    return ctx.tensor(a, dtype), ctx.tensor(b, dtype)


def _common_type(ctx: RuleContext, a: Any, b: Any) -> torch.dtype:
    """torch's promotion of two operands (a number does not widen a tensor's float type)."""
    metas = [ctx.meta(v) if isinstance(v, Node) else v for v in (a, b)]
    metas = [m if m is not None else 0 for m in metas]
    return torch.result_type(*metas)  # type: ignore[arg-type]


def _scaled(ctx: RuleContext, tensor: str, alpha: Any, dtype: torch.dtype) -> str:
    return tensor if alpha in (None, 1) else ctx.add("Mul", [tensor, ctx.const(alpha, "alpha", dtype)])


def binary(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``add``/``sub``/``mul``/``div`` (Tensor and Scalar forms, ``alpha``, ``rounding_mode``),
    ``maximum``/``minimum``: operands cast to torch's result type first."""
    bound = ctx.bind(node)
    a, b = bound["self"], bound["other"]
    dtype = ctx.out_dtype()
    ta, tb = _operands(ctx, a, b, dtype)
    tb = _scaled(ctx, tb, bound.get("alpha"), dtype)
    mode = bound.get("rounding_mode")
    if op_type != "Div" or mode is None:
        return ctx.add(op_type, [ta, tb])
    if not dtype.is_floating_point:
        if mode == "trunc":
            return ctx.add("Div", [ta, tb])
        remainder = ctx.add("Mod", [ta, tb], fmod=0)  # the sign of the divisor: (a - a mod b) / b is the floor
        return ctx.add("Div", [ctx.add("Sub", [ta, remainder]), tb])
    quotient = ctx.add("Div", [ta, tb])
    if mode == "floor":
        return ctx.add("Floor", [quotient])
    return ctx.add("Mul", [ctx.add("Sign", [quotient]), ctx.add("Floor", [ctx.add("Abs", [quotient])])])


def rsub(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``rsub(x, other, alpha)`` is ``other - alpha * x``."""
    bound = ctx.bind(node)
    dtype = ctx.out_dtype()
    x, other = _operands(ctx, bound["self"], bound["other"], dtype)
    return ctx.add("Sub", [other, _scaled(ctx, x, bound.get("alpha"), dtype)])


def power(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``pow`` (Tensor/Scalar exponents, or a number raised to a tensor)."""
    bound = ctx.bind(node)
    base, exponent = bound["self"], bound["exponent"]
    dtype = ctx.out_dtype()
    return ctx.add("Pow", [ctx.tensor(base, dtype), ctx.tensor(exponent, dtype)])


def compare(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """Comparisons (``eq``/``lt``...), ``ne`` as ``Not(Equal)``, ``le``/``ge`` as the ONNX ops."""
    bound = ctx.bind(node)
    a, b = bound["self"], bound["other"]
    dtype = _common_type(ctx, a, b)
    ta, tb = _operands(ctx, a, b, dtype)
    if op_type == "Not":
        return ctx.add("Not", [ctx.add("Equal", [ta, tb])])
    return ctx.add(op_type, [ta, tb])


def logical(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``logical_and``/``_or``/``_xor`` and the ``bitwise_*``/``__and__``/``__or__``/``__xor__``
    forms on booleans (``mask_a | mask_b``). On integers those compute bits, not truth values:
    refused rather than written as a logical op."""
    if not getattr(node.target, "__name__", "").startswith("logical_"):
        dtypes = {getattr(a.meta.get("val"), "dtype", None) for a in node.args if isinstance(a, Node)}
        if dtypes != {torch.bool}:
            raise ctx.error(f"bitwise op on {sorted(map(str, dtypes))} tensors; allowed: bool tensors (masks)")
    operands = [ctx.tensor(a, torch.bool) for a in node.args if isinstance(a, Node)]
    return ctx.add(op_type, operands)


def where(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``where(condition, a, b)`` and ``masked_fill(x, mask, value)`` (``Where(mask, value, x)``)."""
    bound = ctx.bind(node)
    dtype = ctx.out_dtype()
    if "mask" in bound:
        return ctx.add(
            "Where",
            [
                ctx.tensor(bound["mask"], torch.bool),
                ctx.tensor(bound["value"], dtype),
                ctx.tensor(bound["self"], dtype),
            ],
        )
    return ctx.add(
        "Where",
        [
            ctx.tensor(bound["condition"], torch.bool),
            ctx.tensor(bound["self"], dtype),
            ctx.tensor(bound["other"], dtype),
        ],
    )


def unary(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """One-input ops whose ONNX op has torch's definition (Relu, Sigmoid, Tanh, Exp, Log,
    Sqrt, Erf, Neg, Abs, Reciprocal, Floor, Ceil, Sign, Sin, Cos, Not...)."""
    return ctx.add(op_type, [ctx.tensor(node.args[0])])


def rsqrt(ctx: RuleContext, node: Node, op_type: str) -> Any:
    return ctx.add("Reciprocal", [ctx.add("Sqrt", [ctx.tensor(node.args[0])])])


def round_(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``round`` (half to even, as ONNX Round); ``decimals`` scales by ``10**decimals``."""
    bound = ctx.bind(node)
    x = ctx.tensor(bound["self"])
    decimals = int(bound.get("decimals") or 0)
    if not decimals:
        return ctx.add("Round", [x])
    factor = ctx.const(10.0**decimals, "decimals")
    return ctx.add("Div", [ctx.add("Round", [ctx.add("Mul", [x, factor])]), factor])


def _clip(ctx: RuleContext, x: str, lo: Any, hi: Any) -> str:
    dtype = ctx.out_dtype()
    if isinstance(lo, Node) or isinstance(hi, Node):  # tensor bounds: element-wise Max/Min
        if lo is not None:
            x = ctx.add("Max", [x, ctx.tensor(lo, dtype)])
        return x if hi is None else ctx.add("Min", [x, ctx.tensor(hi, dtype)])
    bounds = ["" if v is None else ctx.const(v, "min" if i == 0 else "max", dtype) for i, v in enumerate((lo, hi))]
    while bounds and bounds[-1] == "":
        bounds.pop()
    return ctx.add("Clip", [x, *bounds])


def clamp(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``clamp``/``clip``/``clamp_min``/``clamp_max``/``hardtanh``/``relu6``: Clip."""
    bound = ctx.bind(node)
    x = ctx.tensor(_first(ctx, bound))
    name = schema_name(node).rstrip("_")
    if name == "hardtanh":
        return _clip(ctx, x, bound["min_val"], bound["max_val"])
    if name == "relu6":
        return _clip(ctx, x, 0.0, 6.0)
    if name == "clamp_min":
        return _clip(ctx, x, bound["min"], None)
    if name == "clamp_max":
        return _clip(ctx, x, None, bound["max"])
    return _clip(ctx, x, bound.get("min"), bound.get("max"))


def leaky_relu(ctx: RuleContext, node: Node, op_type: str) -> Any:
    bound = ctx.bind(node)
    return ctx.add("LeakyRelu", [ctx.tensor(bound["self"])], alpha=float(bound["negative_slope"]))


def elu(ctx: RuleContext, node: Node, op_type: str) -> Any:
    bound = ctx.bind(node)
    if float(bound["scale"]) != 1.0 or float(bound["input_scale"]) != 1.0:
        raise ctx.error("elu with scale or input_scale other than 1 (selu) has no ONNX translation here")
    return ctx.add("Elu", [ctx.tensor(bound["self"])], alpha=float(bound["alpha"]))


def prelu(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``prelu(x, weight)``: weight ``[C]`` applies along axis 1; ONNX PRelu broadcasts the
    slope from the last axis, so it is reshaped to ``[C, 1, ...]``."""
    x, weight = node.args[0], node.args[1]
    rank = ctx.rank(x)
    slope = ctx.tensor(weight)
    if rank > 2 and ctx.rank(weight) == 1 and ctx.shape(weight)[0] != 1:
        slope = ctx.add("Reshape", [slope, ctx.ints([-1] + [1] * (rank - 2), "slope_shape")])
    return ctx.add("PRelu", [ctx.tensor(x), slope])


def hard_sigmoid(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``hardsigmoid``: ``min(max(x + 3, 0), 6) / 6`` is HardSigmoid with alpha 1/6, beta 0.5."""
    return ctx.add("HardSigmoid", [ctx.tensor(node.args[0])], alpha=1.0 / 6.0, beta=0.5)


def hard_swish(ctx: RuleContext, node: Node, op_type: str) -> Any:
    return ctx.add("HardSwish", [ctx.tensor(node.args[0])])


def gelu(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``gelu``: Gelu from opset 20; before it, the formula torch computes: exact
    ``0.5 * x * (1 + erf(x / sqrt(2)))`` or ``approximate="tanh"``."""
    bound = ctx.bind(node)
    x = ctx.tensor(bound["self"])
    approximate = bound.get("approximate") or "none"
    if ctx.opset >= 20:
        return ctx.add("Gelu", [x], approximate=approximate)
    half = ctx.add("Mul", [x, ctx.const(0.5, "half")])
    if approximate == "tanh":
        cube = ctx.add("Mul", [ctx.add("Mul", [x, x]), x])
        inner = ctx.add("Add", [x, ctx.add("Mul", [cube, ctx.const(0.044715, "cubic")])])
        core = ctx.add("Tanh", [ctx.add("Mul", [inner, ctx.const(math.sqrt(2.0 / math.pi), "sqrt_2_over_pi")])])
    else:
        core = ctx.add("Erf", [ctx.add("Mul", [x, ctx.const(math.sqrt(0.5), "sqrt_half")])])
    return ctx.add("Mul", [half, ctx.add("Add", [core, ctx.const(1.0, "one")])])


def silu(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``silu``: ``x * sigmoid(x)`` (the form the planner quantizes)."""
    x = ctx.tensor(node.args[0])
    return ctx.add("Mul", [x, ctx.add("Sigmoid", [x])])


def mish(ctx: RuleContext, node: Node, op_type: str) -> Any:
    x = ctx.tensor(node.args[0])
    return ctx.add("Mul", [x, ctx.add("Tanh", [ctx.add("Softplus", [x])])])


def softplus(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``softplus`` with ``beta`` 1 (torch's threshold returns ``x`` where ONNX's
    ``log(1 + exp(x))`` is ``x`` in float32 already)."""
    bound = ctx.bind(node)
    if float(bound["beta"]) != 1.0:
        raise ctx.error("softplus with beta other than 1 has no ONNX translation here")
    return ctx.add("Softplus", [ctx.tensor(bound["self"])])


def softmax(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``softmax``/``_softmax``/``log_softmax`` along ``dim`` (opset 13 semantics)."""
    bound = ctx.bind(node)
    return ctx.add(op_type, [ctx.tensor(bound["self"])], axis=int(bound["dim"]))


def cast(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``to``/``_to_copy``/``type_as``: Cast where the type changes, else the value itself."""
    source = node.args[0]
    dtype = ctx.out_dtype()
    if ctx.dtype(source) == dtype:
        return ctx.value(source)
    return ctx.add("Cast", [ctx.tensor(source)], to=onnx_type(dtype))


def identity(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """Ops whose output is their input's value in inference (clone, dropout, alias...)."""
    return ctx.value(node.args[0])


# --- reductions -------------------------------------------------------------------------------------------
def _axes(ctx: RuleContext, dims: Any, rank: int) -> list[int]:
    if dims is None or dims == []:
        return list(range(rank))
    return [int(d) % rank for d in ([dims] if isinstance(dims, int) else dims)]


def reduce(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``mean``/``sum``/``amax``/``amin`` over ``dim`` (all axes when none), ``keepdim``;
    axes as an input where the opset takes them so (ReduceSum 13, the others 18)."""
    bound = ctx.bind(node)
    x = bound["self"]
    axes = _axes(ctx, bound.get("dim"), ctx.rank(x))
    keepdims = int(bool(bound.get("keepdim")))
    # In the output's type: torch sums a bool or integer tensor as int64 (or as ``dtype=``),
    # and ONNX's ReduceSum takes no bool.
    return _reduce(ctx, op_type, ctx.tensor(x, ctx.out_dtype()), axes, keepdims)


def _reduce(ctx: RuleContext, op_type: str, x: str, axes: Sequence[int], keepdims: int) -> str:
    if op_type == "ReduceSum" or ctx.opset >= 18:
        return ctx.add(op_type, [x, ctx.ints(list(axes), "axes")], keepdims=keepdims)
    return ctx.add(op_type, [x], axes=list(axes), keepdims=keepdims)


def max_min_dim(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``max``/``min``: of two tensors element-wise (Max/Min), of a whole tensor
    (ReduceMax/Min), or along ``dim`` as (values, indices) (ReduceMax/Min and ArgMax/Min)."""
    bound = ctx.bind(node)
    x = ctx.tensor(bound["self"])
    if "other" in bound:
        return ctx.add("Max" if op_type == "ReduceMax" else "Min", [x, ctx.tensor(bound["other"], ctx.out_dtype())])
    rank = ctx.rank(bound["self"])
    if "dim" not in bound:
        return _reduce(ctx, op_type, x, list(range(rank)), 0)
    axis = int(bound["dim"]) % rank
    keepdims = int(bool(bound.get("keepdim")))
    values = _reduce(ctx, op_type, x, [axis], keepdims)
    arg = "ArgMax" if op_type == "ReduceMax" else "ArgMin"
    return [values, ctx.add(arg, [x], axis=axis, keepdims=keepdims, select_last_index=0)]


def vector_norm(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``linalg_vector_norm`` with ord 2 (ReduceL2) or 1 (ReduceL1)."""
    bound = ctx.bind(node)
    order = float(bound["ord"])
    if order not in (1.0, 2.0):
        raise ctx.error(f"vector norm of order {order:g} has no ONNX translation here; allowed: 1, 2")
    axes = _axes(ctx, bound.get("dim"), ctx.rank(bound["self"]))
    op = "ReduceL2" if order == 2.0 else "ReduceL1"
    return _reduce_input_axes(ctx, op, ctx.tensor(bound["self"]), axes, int(bool(bound.get("keepdim"))))


def _reduce_input_axes(ctx: RuleContext, op_type: str, x: str, axes: Sequence[int], keepdims: int) -> str:
    if ctx.opset >= 18:
        return ctx.add(op_type, [x, ctx.ints(list(axes), "axes")], keepdims=keepdims)
    return ctx.add(op_type, [x], axes=list(axes), keepdims=keepdims)


# --- normalisation --------------------------------------------------------------------------------------
def layer_norm(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``layer_norm`` over the last ``len(normalized_shape)`` axes with torch's ``eps``:
    LayerNormalization (opset 17), scale of ones when the module has no weight."""
    if ctx.opset < 17:
        raise ctx.error(
            f"layer_norm needs LayerNormalization (opset 17); the export's opset is {ctx.opset}; allowed: opset >= 17"
        )
    bound = ctx.bind(node)
    shape = [int(s) for s in bound["normalized_shape"]]
    weight = bound.get("weight")
    scale = ctx.tensor(weight) if weight is not None else ctx.const(np.ones(shape, np.float32), "scale")
    inputs = [ctx.tensor(bound["input"]), scale]
    if bound.get("bias") is not None:
        inputs.append(ctx.tensor(bound["bias"]))
    result = ctx.add("LayerNormalization", inputs, axis=-len(shape), epsilon=float(bound["eps"]))
    return [result, None, None] if schema_name(node) == "native_layer_norm" else result


def batch_norm(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """Batch norm left in the model (eval statistics): BatchNormalization."""
    bound = ctx.bind(node)
    if bound.get("running_mean") is None or bound.get("running_var") is None:
        raise ctx.error(
            "batch norm without running statistics (track_running_stats=False) normalises every batch by "
            "itself and has no ONNX form; replace it, or keep it out of the quantized part (exclude, regions)"
        )
    if bound.get("training"):
        raise ctx.error("batch norm in training mode cannot be exported; call model.eval() first")
    x = bound["input"]
    channels = ctx.shape(x)[1]
    ones = np.ones(channels or 1, np.float32)
    scale = ctx.tensor(bound["weight"]) if bound.get("weight") is not None else ctx.const(ones, "scale")
    shift = ctx.tensor(bound["bias"]) if bound.get("bias") is not None else ctx.const(ones * 0, "bias")
    inputs = [ctx.tensor(x), scale, shift, ctx.tensor(bound["running_mean"]), ctx.tensor(bound["running_var"])]
    result = ctx.add("BatchNormalization", inputs, epsilon=float(bound["eps"]))
    return result if schema_name(node) == "batch_norm" else [result, None, None]


def group_norm(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``group_norm``: the input reshaped to ``[N, G, -1]``, normalised per group with
    InstanceNormalization (scale 1, shift 0), reshaped back, then the per-channel affine."""
    bound = ctx.bind(node)
    x = bound["input"]
    groups = int(bound["num_groups"])
    shape = ctx.shape(x)
    grouped = ctx.add("Reshape", [ctx.tensor(x), ctx.ints([0, groups, -1], "grouped_shape")])
    ones, zeros = np.ones(groups, np.float32), np.zeros(groups, np.float32)
    normed = ctx.add(
        "InstanceNormalization",
        [grouped, ctx.const(ones, "unit"), ctx.const(zeros, "zero")],
        epsilon=float(bound["eps"]),
    )
    restored = ctx.add("Reshape", [normed, ctx.add("Shape", [ctx.shape_source(x)])])
    affine_shape = [-1] + [1] * (len(shape) - 2)
    if bound.get("weight") is not None:
        weight = ctx.add("Reshape", [ctx.tensor(bound["weight"]), ctx.ints(affine_shape, "affine_shape")])
        restored = ctx.add("Mul", [restored, weight])
    if bound.get("bias") is not None:
        bias = ctx.add("Reshape", [ctx.tensor(bound["bias"]), ctx.ints(affine_shape, "affine_shape")])
        restored = ctx.add("Add", [restored, bias])
    return restored


# --- pooling ---------------------------------------------------------------------------------------------
def _window(ctx: RuleContext, bound: dict[str, Any]) -> tuple[int, list[int], list[int], list[int]]:
    """A pooling call's spatial rank, kernel, stride (torch's default: the kernel) and pads."""
    spatial = ctx.rank(bound["self"]) - 2
    kernel = _spatial(bound["kernel_size"], spatial, 1)
    stride = _spatial(bound.get("stride"), spatial, 0) if bound.get("stride") else kernel
    return spatial, kernel, stride, _spatial(bound.get("padding"), spatial, 0)


def max_pool(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``max_pool{1,2,3}d`` (and ``_with_indices``, values only): MaxPool with torch's
    kernel, stride (default: the kernel), pads, dilation and ``ceil_mode``."""
    bound = ctx.bind(node)
    x = bound["self"]
    spatial, kernel, stride, pads = _window(ctx, bound)
    attributes: dict[str, Any] = {"kernel_shape": kernel, "strides": stride, "pads": pads + pads}
    attributes["dilations"] = _spatial(bound.get("dilation"), spatial, 1)
    attributes["ceil_mode"] = int(bool(bound.get("ceil_mode")))
    result = ctx.add("MaxPool", [ctx.tensor(x)], **attributes)
    return [result, None] if schema_name(node).endswith("_with_indices") else result


def avg_pool(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``avg_pool{1,2,3}d``: AveragePool. torch divides a window by the part of it inside
    the padded input (``count_include_pad``) or inside the input; in ``ceil_mode`` a window
    can reach past the padding, so the zero padding is written as a Pad and AveragePool
    counts what is inside it. ``divisor_override`` rescales the mean of a full window."""
    bound = ctx.bind(node)
    spatial, kernel, stride, pads = _window(ctx, bound)
    ceil_mode = bool(bound.get("ceil_mode"))
    include_pad = bool(bound.get("count_include_pad", True))
    divisor = bound.get("divisor_override")
    source = ctx.tensor(bound["self"])
    if divisor is not None and ceil_mode:
        raise ctx.error("avg_pool with both ceil_mode and divisor_override has no ONNX translation here")
    if ceil_mode and include_pad and any(pads):
        source = ctx.add("Pad", [source, ctx.ints([0, 0, *pads, 0, 0, *pads], "pads")], mode="constant")
        pads = [0] * spatial
        include_pad = False
    attributes: dict[str, Any] = {"kernel_shape": kernel, "strides": stride, "pads": pads + pads}
    attributes["ceil_mode"] = int(ceil_mode)
    attributes["count_include_pad"] = int(include_pad or divisor is not None)
    pooled = ctx.add("AveragePool", [source], **attributes)
    if divisor is None:
        return pooled
    return ctx.add("Mul", [pooled, ctx.const(float(np.prod(kernel)) / float(divisor), "divisor")])


def adaptive_pool(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``adaptive_{avg,max}_pool{1,2,3}d``: GlobalAveragePool/GlobalMaxPool for an output of
    ones; Average/MaxPool when every input size is a multiple of the output's; otherwise
    torch's windows (``floor(i * in / out)`` to ``ceil((i + 1) * in / out)``) one axis at a
    time as Slice, ReduceMean/Max and Concat."""
    bound = ctx.bind(node)
    x = bound["self"]
    maximum = "max" in schema_name(node)
    spatial = ctx.rank(x) - 2
    sizes = ctx.shape(x)[2:]
    out = [s if s is not None else sizes[i] for i, s in enumerate(_spatial(bound["output_size"], spatial, 1))]
    if any(s is None for s in sizes):
        raise ctx.error("adaptive pooling over a dynamic spatial size has no ONNX translation here")
    result: Any
    if all(o == 1 for o in out):
        result = ctx.add("GlobalMaxPool" if maximum else "GlobalAveragePool", [ctx.tensor(x)])
    elif all(int(s) % int(o) == 0 for s, o in zip(sizes, out, strict=True)):  # type: ignore[arg-type]
        kernel = [int(s) // int(o) for s, o in zip(sizes, out, strict=True)]  # type: ignore[arg-type]
        result = ctx.add("MaxPool" if maximum else "AveragePool", [ctx.tensor(x)], kernel_shape=kernel, strides=kernel)
    else:
        result = ctx.tensor(x)
        for axis, (size, count) in enumerate(zip(sizes, out, strict=True), start=2):
            pieces = []
            for i in range(int(count)):  # type: ignore[arg-type]
                start, end = (i * size) // count, -((-(i + 1) * size) // count)  # type: ignore[operator]
                piece = ctx.add(
                    "Slice", [result, ctx.ints([start], "start"), ctx.ints([end], "end"), ctx.ints([axis], "axis")]
                )
                pieces.append(_reduce_input_axes(ctx, "ReduceMax" if maximum else "ReduceMean", piece, [axis], 1))
            result = ctx.add("Concat", pieces, axis=axis)
    return [result, None] if maximum else result


# --- resizing -----------------------------------------------------------------------------------------------
_RESIZE_MODES = {
    "nearest": "nearest",
    "nearest_exact": "nearest",
    "linear": "linear",
    "bilinear": "linear",
    "trilinear": "linear",
    "bicubic": "cubic",
}


def upsample(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``upsample_*`` (``F.interpolate``): Resize with torch's coordinates: nearest is
    ``floor(dst * in / out)`` (asymmetric, floor), nearest-exact half-pixel rounding up,
    linear/cubic ``pytorch_half_pixel`` or ``align_corners``, cubic with A = -0.75. Output
    sizes as torch computed them (scales only where torch used the given factor)."""
    bound = ctx.bind(node)
    name = schema_name(node)
    kind = name.removeprefix("_").removeprefix("upsample_")[:-2]
    x = _first(ctx, bound)
    spatial = ctx.rank(x) - 2
    attributes: dict[str, Any] = {"mode": _RESIZE_MODES[kind]}
    if kind == "nearest":
        attributes.update(coordinate_transformation_mode="asymmetric", nearest_mode="floor")
    elif kind == "nearest_exact":
        attributes.update(coordinate_transformation_mode="half_pixel", nearest_mode="round_prefer_ceil")
    else:
        corners = bool(bound.get("align_corners"))
        attributes["coordinate_transformation_mode"] = "align_corners" if corners else "pytorch_half_pixel"
        if kind == "bicubic":
            attributes.update(cubic_coeff_a=-0.75, exclude_outside=0)
    factors = bound.get("scale_factors")
    if factors is None and bound.get("scales_h") is not None:
        factors = [bound.get(k) for k in ("scales_d", "scales_h", "scales_w") if k in bound][-spatial:]
    source = ctx.tensor(x)
    if factors is not None and all(f is not None for f in factors):
        scales = ctx.const(
            np.asarray([1.0, 1.0, *[float(f) for f in _spatial_floats(factors, spatial)]], np.float32), "scales"
        )
        return ctx.add("Resize", [source, "", scales], **attributes)
    out_sizes = ctx.shape(ctx.current)[2:]
    if any(s is None for s in out_sizes):
        raise ctx.error("resizing to a dynamic spatial size has no ONNX translation here")
    leading = ctx.add("Shape", [ctx.shape_source(x)], start=0, end=2)
    sizes = ctx.add("Concat", [leading, ctx.ints(out_sizes, "sizes")], axis=0)
    return ctx.add("Resize", [source, "", "", sizes], **attributes)


def _spatial_floats(values: Sequence[Any], rank: int) -> list[float]:
    values = [float(v) for v in values]
    return values * rank if len(values) == 1 else values


def pixel_shuffle(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``pixel_shuffle``: DepthToSpace in CRD order (torch's channel order)."""
    a = ctx.bind(node)
    return ctx.add("DepthToSpace", [ctx.tensor(a["self"])], blocksize=int(a["upscale_factor"]), mode="CRD")
