"""Rewrites of a captured graph before it is planned, each exact in inference:

- :func:`remove_guards`: drop the shape-guard call ``torch.export`` adds (the prepared
  graph takes any batch size);
- :func:`functionalize_inplace`: ``relu_``/``add_``... become their out-of-place forms
  where nothing reads the mutated tensor afterwards (each value then has one node, so one
  quantizer);
- :func:`split_silu`: ``silu(x)`` becomes ``x * sigmoid(x)``, as the ONNX exporter writes
  it, so that the sigmoid's output is a tensor of its own to quantize;
- :func:`scalars_to_constants`: a Python number operand of add/sub/mul/div becomes a
  0-d constant tensor (the ONNX exporter writes a ``Constant``), which the planner then
  quantizes like any constant operand; so does ``masked_fill``'s number (the planner reads
  an attention mask's fill from it);
- :func:`modularize`: dropout and batch norm become module calls that follow
  ``train()``/``eval()``; a convolution followed by batch norm is folded (PTQ) or
  becomes a :class:`~quant_torch_fx.modules.ConvBn` (QAT).

Example:
    >>> import torch
    >>> class Net(torch.nn.Module):
    ...     def forward(self, x):
    ...         return torch.nn.functional.silu(x) + 1.0
    >>> gm = torch.export.export(Net(), (torch.randn(2, 3),)).module()
    >>> remove_guards(gm); split_silu(gm); scalars_to_constants(gm)
    >>> [n.target.__name__ for n in gm.graph.nodes if n.op == "call_function"]
    ['sigmoid.default', 'mul.Tensor', 'add.Tensor']
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node

from quant_torch_fx.aten_map import op_name
from quant_torch_fx.capture import BATCH_NORM_UPDATES
from quant_torch_fx.modules import ConvBn, GraphBatchNorm, fold_batch_norm
from quant_torch_fx.naming import plan_name, unique_name

aten = torch.ops.aten

CONVOLUTIONS = frozenset({"conv1d", "conv2d", "conv3d"})
"""Captured convolutions a following batch norm folds into (weight ``[Cout, Cin/g, k...]``)."""


def remove_guards(gm: GraphModule) -> None:
    """Drop ``torch.export``'s ``_guards_fn`` call (in place)."""
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and str(node.target).startswith("_guards"):
            gm.graph.erase_node(node)
            if hasattr(gm, str(node.target)):
                delattr(gm, str(node.target))
    gm.recompile()


def _position(gm: GraphModule) -> dict[Node, int]:
    return {node: i for i, node in enumerate(gm.graph.nodes)}


def functionalize_inplace(gm: GraphModule) -> None:
    """Out-of-place forms of in-place ops whose mutated input nothing reads later (in place)."""
    order = _position(gm)
    for node in list(gm.graph.nodes):
        name = op_name(node)
        if not name.endswith("_") or name.startswith("_") or not node.args:
            continue
        packet = getattr(aten, name[:-1], None)
        target = node.target
        assert isinstance(target, torch._ops.OpOverload)
        functional = getattr(packet, target._overloadname, None) if packet is not None else None
        mutated = node.args[0]
        if functional is None or not isinstance(mutated, Node):
            continue
        if any(order[user] > order[node] for user in mutated.users if user is not node):
            continue  # the old value is read after the mutation: keep the op as captured
        node.target = functional
    gm.recompile()


def split_silu(gm: GraphModule) -> None:
    """``silu(x)`` -> ``mul(x, sigmoid(x))`` (in place)."""
    for node in list(gm.graph.nodes):
        if op_name(node) not in ("silu", "silu_"):
            continue
        x = node.args[0]
        with gm.graph.inserting_before(node):
            sigmoid = gm.graph.call_function(aten.sigmoid.default, (x,))
            product = gm.graph.call_function(aten.mul.Tensor, (x, sigmoid))
        for new in (sigmoid, product):
            new.meta = dict(node.meta)
        node.replace_all_uses_with(product)
        gm.graph.erase_node(node)
    gm.recompile()


_ARITHMETIC = frozenset({"add", "sub", "rsub", "mul", "div", "add_", "sub_", "mul_", "div_"})
_FILLS = frozenset({"masked_fill", "masked_fill_"})


def _is_float_node(value: Any) -> bool:
    if not isinstance(value, Node):
        return False
    meta = value.meta.get("val")
    return isinstance(meta, torch.Tensor) and meta.is_floating_point()


def scalars_to_constants(gm: GraphModule) -> None:
    """A number operand of float add/sub/rsub/mul/div, and the number ``masked_fill`` writes,
    becomes a 0-d float32 constant (in place)."""
    count = 0
    for node in list(gm.graph.nodes):
        fill = op_name(node) in _FILLS and len(node.args) == 3
        if (op_name(node) not in _ARITHMETIC or len(node.args) < 2) and not fill:
            continue
        first, second = node.args[0], node.args[2 if fill else 1]
        if not _is_float_node(first) or not isinstance(second, int | float) or isinstance(second, bool):
            continue
        if node.kwargs.get("alpha", 1) != 1 or node.kwargs.get("rounding_mode") is not None:
            continue
        name = f"_constant_{count}"
        while hasattr(gm, name):
            count += 1
            name = f"_constant_{count}"
        count += 1
        gm.register_buffer(name, torch.tensor(float(second), dtype=torch.float32, device=_device(first)))
        with gm.graph.inserting_before(node):
            constant = gm.graph.get_attr(name)
        constant.meta["val"] = getattr(gm, name)
        target = node.target
        assert isinstance(target, torch._ops.OpOverload)
        tensor_overload = getattr(target.overloadpacket, "Tensor", None)
        if tensor_overload is None:
            continue
        node.target = tensor_overload
        node.args = (first, node.args[1], constant) if fill else (first, constant, *node.args[2:])
    gm.recompile()


def _device(node: Node) -> torch.device:
    meta = node.meta.get("val")
    return meta.device if isinstance(meta, torch.Tensor) else torch.device("cpu")


def get_attr_value(gm: GraphModule, node: Node) -> torch.Tensor:
    """The tensor a ``get_attr`` node reads."""
    value: Any = gm
    for part in str(node.target).split("."):
        value = getattr(value, part)
    assert isinstance(value, torch.Tensor)
    return value


def _owner_path(node: Node) -> str:
    """``"layer1.0.bn1"`` for a get_attr of ``layer1.0.bn1.weight``."""
    return str(node.target).rpartition(".")[0]


def _free_path(gm: GraphModule, preferred: str) -> str:
    """``preferred`` (dots allowed) unless something else lives there; then a suffixed variant."""
    path = preferred or "module"
    candidate = path
    index = 1
    while _exists(gm, candidate):
        candidate = f"{path}_q{index}"
        index += 1
    return candidate


def _exists(gm: GraphModule, path: str) -> bool:
    try:
        gm.get_submodule(path)
    except AttributeError:
        owner, _, leaf = path.rpartition(".")
        try:
            parent = gm.get_submodule(owner) if owner else gm
        except AttributeError:
            return False
        return hasattr(parent, leaf)
    return True


def _innermost_module(node: Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    paths = [path for path, _type in stack.values() if path]
    return paths[-1] if paths else ""


def _batch_norm_module(gm: GraphModule, node: Node) -> GraphBatchNorm | None:
    """A :class:`GraphBatchNorm` holding a captured ``batch_norm``'s parameters and statistics."""
    _x, weight, bias, mean, var = (node.args + (None,) * 5)[:5]
    momentum = node.args[6] if len(node.args) > 6 else node.kwargs.get("momentum", 0.1)
    # The module's own setting where capture recorded it (None: a cumulative average).
    momentum, tracked = node.meta.get(BATCH_NORM_UPDATES, (momentum, None))
    eps = node.args[7] if len(node.args) > 7 else node.kwargs.get("eps", 1e-5)
    if not all(isinstance(v, Node) and v.op == "get_attr" for v in (mean, var)):
        return None  # batch statistics only (track_running_stats=False): left as captured
    assert isinstance(mean, Node) and isinstance(var, Node)
    running_mean = get_attr_value(gm, mean)
    module = GraphBatchNorm(
        running_mean.shape[0],
        eps=float(eps),  # type: ignore[arg-type]
        momentum=None if momentum is None else float(momentum),  # type: ignore[arg-type]
        affine=weight is not None,
    )
    module.to(running_mean.device)
    with torch.no_grad():
        module.running_mean.copy_(running_mean)  # type: ignore[union-attr]
        module.running_var.copy_(get_attr_value(gm, var))  # type: ignore[union-attr]
        if tracked is not None and module.num_batches_tracked is not None:
            module.num_batches_tracked.fill_(tracked)
        for name, source in (("weight", weight), ("bias", bias)):
            if isinstance(source, Node) and source.op == "get_attr":
                value = get_attr_value(gm, source)
                getattr(module, name).copy_(value)
                # A parameter the user froze stays frozen: QAT must not train it.
                getattr(module, name).requires_grad_(value.requires_grad)
            elif source is not None:
                return None
    return module


def _foldable_conv(node: Node) -> Node | None:
    """The convolution a ``batch_norm`` node can fold into, if any."""
    conv = node.args[0]
    if not isinstance(conv, Node) or op_name(conv) not in CONVOLUTIONS or len(conv.users) != 1:
        return None
    weight = conv.args[1]
    bias = conv.args[2] if len(conv.args) > 2 else None
    if not (isinstance(weight, Node) and weight.op == "get_attr"):
        return None
    if bias is not None and not (isinstance(bias, Node) and bias.op == "get_attr"):
        return None
    return conv


def _weight_shared(conv: Node) -> bool:
    """Whether another node reads ``conv``'s weight or bias (a module called twice): a
    :class:`ConvBn` holds its own copy, which QAT would then train apart from the others."""
    params = [a for a in conv.args[1:3] if isinstance(a, Node)]
    targets = {str(p.target) for p in params}
    readers = [n for n in conv.graph.nodes if n.op == "get_attr" and str(n.target) in targets for _ in n.users]
    return len(readers) > len(params)


def _replace_with_module(
    gm: GraphModule, nodes: list[Node], path: str, module: nn.Module, args: tuple[Any, ...]
) -> Node:
    """Replace the chain ``nodes`` (last one's output is the result) with a call to ``module``."""
    gm.add_submodule(path, module)
    last = nodes[-1]
    with gm.graph.inserting_before(last):
        call = gm.graph.call_module(path, args)
    call.meta = dict(nodes[0].meta)
    call.meta["val"] = last.meta.get("val")
    last.replace_all_uses_with(call)
    for node in reversed(nodes):
        gm.graph.erase_node(node)
    return call


def _fold_into_conv(gm: GraphModule, conv: Node, bn_node: Node, bn: GraphBatchNorm) -> None:
    weight_node = conv.args[1]
    bias_node = conv.args[2] if len(conv.args) > 2 else None
    assert isinstance(weight_node, Node)
    weight = get_attr_value(gm, weight_node)
    bias = get_attr_value(gm, bias_node) if isinstance(bias_node, Node) else None
    new_weight, new_bias = fold_batch_norm(weight, bias, bn.eval())
    owner = _owner_path(weight_node)
    parent = gm.get_submodule(owner) if owner else gm
    leaf = str(weight_node.target).rpartition(".")[2]
    # Names no other fold took: a module called twice, each call with its own batch norm,
    # folds the one weight twice, and the second fold must not replace the first.
    taken = set(dir(parent))
    base = unique_name(f"{leaf}_folded", taken | {name.removesuffix("_bias") for name in taken})
    names = (base, f"{base}_bias")
    # Each folded value trains where one of its sources does (QAT with folded batch norms):
    # the weight with the convolution's weight, the bias with the conv bias or beta.
    bias_trains = any(p is not None and p.requires_grad for p in (bias, bn.bias))
    for name, value, trains in zip(names, (new_weight, new_bias), (weight.requires_grad, bias_trains), strict=True):
        setattr(parent, name, nn.Parameter(value, requires_grad=trains))
    prefix = f"{owner}." if owner else ""
    with gm.graph.inserting_before(conv):
        w_attr = gm.graph.get_attr(prefix + names[0])
        b_attr = gm.graph.get_attr(prefix + names[1])
    w_attr.meta["val"] = new_weight
    b_attr.meta["val"] = new_bias
    args = list(conv.args) + [None] * max(0, 3 - len(conv.args))
    args[1], args[2] = w_attr, b_attr
    conv.args = tuple(args)
    bn_node.replace_all_uses_with(conv)
    conv.meta["val"] = bn_node.meta.get("val", conv.meta.get("val"))
    gm.graph.erase_node(bn_node)


def modularize(gm: GraphModule, *, fold_batch_norms: bool) -> None:
    """Dropout and batch norm as modules; conv + batch norm folded (``fold_batch_norms``,
    PTQ: the statistics are final) or as a :class:`ConvBn` (QAT). In place."""
    for node in list(gm.graph.nodes):
        name = op_name(node)
        if name in ("dropout", "feature_dropout"):
            p = float(node.args[1]) if len(node.args) > 1 else 0.5
            module: nn.Module = nn.Dropout(p) if name == "dropout" else nn.Dropout2d(p)
            path = _free_path(gm, _innermost_module(node) or "dropout")
            _replace_with_module(gm, [node], path, module, (node.args[0],))
        elif name == "batch_norm":
            bn = _batch_norm_module(gm, node)
            if bn is None:
                continue
            mean = node.args[3]
            assert isinstance(mean, Node)
            conv = _foldable_conv(node)
            if conv is not None and fold_batch_norms:
                _fold_into_conv(gm, conv, node, bn)
            elif conv is not None and not _weight_shared(conv):
                weight_node, bias_node = conv.args[1], conv.args[2] if len(conv.args) > 2 else None
                assert isinstance(weight_node, Node)
                weight = get_attr_value(gm, weight_node)
                bias = get_attr_value(gm, bias_node) if isinstance(bias_node, Node) else None
                target = conv.target
                assert isinstance(target, torch._ops.OpOverload)
                conv_bn = ConvBn(target, weight, bias, tuple(conv.args[3:]), bn)
                conv_bn.weight.requires_grad_(weight.requires_grad)
                if conv_bn.bias is not None and bias is not None:
                    conv_bn.bias.requires_grad_(bias.requires_grad)
                name = plan_name(conv)  # QAT plans name the layer as PTQ plans do
                path = _free_path(gm, _owner_path(weight_node))
                call = _replace_with_module(gm, [conv, node], path, conv_bn, (conv.args[0],))
                call.meta["plan_name"] = name
            else:
                path = _free_path(gm, _owner_path(mean))
                _replace_with_module(gm, [node], path, bn, (node.args[0],))
    _drop_unused(gm)


def _drop_unused(gm: GraphModule) -> None:
    """Erase get_attr nodes nothing reads, then parameters and modules nothing references."""
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and not node.users:
            gm.graph.erase_node(node)
    used = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    for name, _ in list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False)):
        owner, _, leaf = name.rpartition(".")
        parent = gm.get_submodule(owner) if owner else gm
        # Only the plain containers torch.export builds hold parameters the graph reads
        # through get_attr; modules called by the graph keep theirs.
        if name not in used and (type(parent) is nn.Module or parent is gm):
            delattr(parent, leaf)
    gm.delete_all_unused_submodules()
    gm.recompile()


def getitem_outputs(node: Node) -> list[str] | None:
    """Names of the ``getitem`` users of a multi-output node, by index (``""`` for unused
    outputs), or ``None`` when the node's value is a single tensor."""
    meta = node.meta.get("val")
    if not isinstance(meta, list | tuple):
        return None
    names = [""] * len(meta)
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int):
            names[user.args[1]] = user.name
    return names
