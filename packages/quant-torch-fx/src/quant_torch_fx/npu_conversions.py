"""The NPU conversions of :mod:`quant_core.conversions` as edits of a normalised FX graph,
before it is planned and calibrated (``QuantConfig.npu_conversions``), so that calibration
and AdaRound see the function the NPU computes. The rules and their constants are
quant_core's; which nodes they match is :func:`quant_core.plan.conversions.find_matches` on the
planner's view of the graph.

- ``silu``, ``sigmoid``: ``sigmoid`` -> ``hardsigmoid`` (torch's ``x/6 + 1/2``: the ONNX
  export writes it, and ``quant-npu legalize`` gives it the device's ``2731 / 2**14``,
  0.012% apart, by the ``hard_sigmoid`` rule; that rule has nothing to do here);
- ``sigmoid_tanh``: ``sigmoid(x)`` -> ``0.5 * tanh(0.5 x) + 0.5`` (exact);
- ``hard_swish``: ``hardswish(x)`` -> ``x * hardsigmoid(x)``;
- ``tanh``: ``tanh(x)`` -> ``hardtanh(x * 2/3, -1, 1)``;
- ``gelu``: ``gelu(x)`` -> ``x * hardsigmoid(x * 1.702)``;
- ``split``: ``split``/``chunk`` -> one ``slice`` per output;
- ``reduce_mean``: ``mean(x, [2, 3], keepdim=True)`` -> ``adaptive_avg_pool2d(x, 1)``;
- ``conv_transpose``: ``conv_transpose2d`` -> zero insertion (``unsqueeze``, ``constant_pad_nd``,
  ``reshape``), padding or cropping, and ``conv2d`` with the flipped kernel (exact).

Example:
    >>> import torch
    >>> class Net(torch.nn.Module):
    ...     def forward(self, x):
    ...         return torch.nn.functional.silu(x)
    >>> from quant_torch_fx.prepare import normalize
    >>> gm = torch.export.export(Net(), (torch.randn(2, 3),)).module()
    >>> normalize(gm, fold_batch_norms=True)
    >>> [c.rule for c in convert_for_npu(gm, ("silu",))]
    ['silu']
    >>> [n.target.__name__ for n in gm.graph.nodes if n.op == "call_function"]
    ['hardsigmoid.default', 'mul.Tensor']
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import numpy as np
import torch
from torch.fx import GraphModule, Node

from quant_core.conversions import (
    GELU_SIGMOID_SCALE,
    SIGMOID_TANH_OFFSET,
    SIGMOID_TANH_SCALE,
    TANH_SLOPE,
    ConvTransposeAsConv,
    Match,
    conv_weight,
    parse_conversions,
)
from quant_core.plan.conversions import find_matches, float_view
from quant_torch_fx.aten_map import op_name
from quant_torch_fx.graph_passes import get_attr_value
from quant_torch_fx.onnx_rules import bind, conv_attributes

aten = torch.ops.aten


@attrs.frozen
class FxConverted:
    """One node rewritten.

    Example:
        >>> FxConverted("tanh", "head/tanh", ("mul", "hardtanh")).rule
        'tanh'
    """

    rule: str
    node: str
    result: tuple[str, ...]


class _Editor:
    def __init__(self, gm: GraphModule) -> None:
        self.gm = gm
        self.graph = gm.graph
        self.count = 0

    def call(self, target: Any, args: tuple[Any, ...], like: Node) -> Node:
        node = self.graph.call_function(target, args)
        node.meta = {k: v for k, v in like.meta.items() if k != "val"}
        node.meta["val"] = target(*[a.meta["val"] if isinstance(a, Node) else a for a in args])
        return node

    def constant(self, value: torch.Tensor, like: Node, parameter: bool = False) -> Node:
        name = f"_npu_constant_{self.count}"
        while hasattr(self.gm, name):
            self.count += 1
            name = f"_npu_constant_{self.count}"
        self.count += 1
        device = like.meta["val"].device if isinstance(like.meta.get("val"), torch.Tensor) else None
        value = value.to(device) if device is not None else value
        if parameter:
            self.gm.register_parameter(name, torch.nn.Parameter(value, requires_grad=False))
        else:
            self.gm.register_buffer(name, value)
        node = self.graph.get_attr(name)
        fake = like.meta.get("val")
        mode = getattr(fake, "fake_mode", None)
        node.meta["val"] = mode.from_tensor(value) if mode is not None else value
        return node

    def replace(self, old: Node, new: Node) -> None:
        old.replace_all_uses_with(new)
        self.graph.erase_node(old)


def _scalar(editor: _Editor, value: float, like: Node) -> Node:
    return editor.constant(torch.tensor(value, dtype=torch.float32), like)


def _sigmoid(editor: _Editor, node: Node) -> tuple[str, ...]:
    node.target = aten.hardsigmoid.default
    node.args = node.args[:1]
    return ("hardsigmoid",)


def _replacing(build: Callable[[_Editor, Node, Node], Node]) -> Callable[[_Editor, Node], tuple[str, ...]]:
    """A handler that replaces a one-input node by what ``build(editor, x, node)`` makes
    before it; returns the new op names."""

    def handler(editor: _Editor, node: Node) -> tuple[str, ...]:
        x = node.args[0]
        assert isinstance(x, Node)
        before = set(editor.graph.nodes)
        with editor.graph.inserting_before(node):
            result = build(editor, x, node)
        made = [n for n in editor.graph.nodes if n not in before and n.op == "call_function"]
        editor.replace(node, result)
        return tuple(op_name(n) for n in made)

    return handler


def _x_times(editor: _Editor, x: Node, gate_input: Node, node: Node) -> Node:
    """``x * hardsigmoid(gate_input)``."""
    return editor.call(aten.mul.Tensor, (x, editor.call(aten.hardsigmoid.default, (gate_input,), node)), node)


def _scaled(editor: _Editor, x: Node, value: float, node: Node) -> Node:
    return editor.call(aten.mul.Tensor, (x, _scalar(editor, value, node)), node)


_hard_swish = _replacing(lambda e, x, n: _x_times(e, x, x, n))
_tanh = _replacing(lambda e, x, n: e.call(aten.hardtanh.default, (_scaled(e, x, TANH_SLOPE, n), -1.0, 1.0), n))
_sigmoid_tanh = _replacing(
    lambda e, x, n: e.call(
        aten.add.Tensor,
        (
            _scaled(e, e.call(aten.tanh.default, (_scaled(e, x, SIGMOID_TANH_SCALE, n),), n), SIGMOID_TANH_SCALE, n),
            _scalar(e, SIGMOID_TANH_OFFSET, n),
        ),
        n,
    )
)
_gelu = _replacing(lambda e, x, n: _x_times(e, x, _scaled(e, x, GELU_SIGMOID_SCALE, n), n))


def _conv_transpose_arguments(node: Node) -> dict[str, Any] | None:
    """A transposed 2-D convolution's ONNX-style attributes (:func:`~quant_torch_fx.onnx_rules.conv_attributes`),
    ``None`` for another kind or rank."""
    if op_name(node) == "convolution" and not bind(node).get("transposed"):
        return None
    attributes = conv_attributes(node)
    if len(attributes["strides"]) != 2:
        return None
    attributes.setdefault("output_padding", [0, 0])
    return attributes


def _conv_transpose(editor: _Editor, node: Node) -> tuple[str, ...] | None:
    x, weight_node = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 else None
    attributes = _conv_transpose_arguments(node)
    value = x.meta.get("val") if isinstance(x, Node) else None
    if attributes is None or not isinstance(weight_node, Node) or weight_node.op != "get_attr" or value is None:
        return None
    channels, height, width = value.shape[1], value.shape[2], value.shape[3]
    if not all(isinstance(d, int) for d in (channels, height, width)):
        return None
    weight = get_attr_value(editor.gm, weight_node)
    form = ConvTransposeAsConv.from_attributes(attributes, tuple(weight.shape))
    moved = torch.from_numpy(conv_weight(weight.detach().cpu().numpy(), form.group)).to(weight.dtype)
    (sh, sw), (top, left, bottom, right) = form.strides, form.pads
    assert isinstance(x, Node)
    with editor.graph.inserting_before(node):
        conv_w = editor.constant(moved, weight_node, parameter=isinstance(weight, torch.nn.Parameter))
        t = editor.call(aten.unsqueeze.default, (x, 3), node)
        t = editor.call(aten.unsqueeze.default, (t, 5), node)
        t = editor.call(aten.constant_pad_nd.default, (t, [0, sw - 1, 0, 0, 0, sh - 1], 0.0), node)
        t = editor.call(aten.reshape.default, (t, [-1, channels, height * sh, width * sw]), node)
        (cb_h, cb_w), (ce_h, ce_w) = form.crop_begin, form.crop_end
        if cb_h or ce_h:
            t = editor.call(aten.slice.Tensor, (t, 2, cb_h, height * sh - ce_h), node)
        if cb_w or ce_w:
            t = editor.call(aten.slice.Tensor, (t, 3, cb_w, width * sw - ce_w), node)
        if top or left or bottom or right:
            t = editor.call(aten.constant_pad_nd.default, (t, [left, right, top, bottom], 0.0), node)
        conv = editor.call(
            aten.conv2d.default, (t, conv_w, bias, [1, 1], [0, 0], list(form.dilations), form.group), node
        )
    editor.replace(node, conv)
    return tuple(op_name(n) for n in (conv,))


def _index(getitem: Node) -> int:
    value: Any = getitem.args[1]
    return int(value)


def _split(editor: _Editor, node: Node) -> tuple[str, ...] | None:
    """``split``/``split_with_sizes``/``chunk`` -> one ``slice`` per ``getitem`` (sizes from
    each output's shape; ``unbind`` drops the axis and stays)."""
    x = node.args[0]
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    items = sorted((u for u in node.users if u.op == "call_function" and isinstance(u.args[1], int)), key=_index)
    value = x.meta.get("val") if isinstance(x, Node) else None
    if op_name(node) == "unbind" or not isinstance(dim, int) or value is None or len(items) != len(node.users):
        return None
    sizes = [node.meta["val"][i].shape[dim] for i in range(len(node.meta["val"]))]
    if not all(isinstance(size, int) for size in sizes):
        return None
    starts = np.cumsum([0, *sizes])
    made = []
    for item in items:
        index = _index(item)
        with editor.graph.inserting_before(item):
            piece = editor.call(aten.slice.Tensor, (x, dim, int(starts[index]), int(starts[index + 1])), item)
        editor.replace(item, piece)
        made.append("slice")
    editor.graph.erase_node(node)
    return tuple(made)


def _global_pool(editor: _Editor, node: Node) -> tuple[str, ...]:
    """``mean(x, [2, 3], keepdim=True)`` -> ``adaptive_avg_pool2d(x, [1, 1])``."""
    x = node.args[0]
    assert isinstance(x, Node)
    with editor.graph.inserting_before(node):
        pool = editor.call(aten.adaptive_avg_pool2d.default, (x, [1, 1]), node)
    editor.replace(node, pool)
    return ("adaptive_avg_pool2d",)


_HANDLERS: dict[str, Callable[[_Editor, Node], tuple[str, ...] | None]] = {
    "silu": _sigmoid,
    "sigmoid": _sigmoid,
    "sigmoid_tanh": _sigmoid_tanh,
    "hard_swish": _hard_swish,
    "tanh": _tanh,
    "gelu": _gelu,
    "conv_transpose": _conv_transpose,
    "split": _split,
    "reduce_mean": _global_pool,
}


def convert_for_npu(gm: GraphModule, rules: Iterable[str]) -> list[FxConverted]:
    """Apply ``rules`` to a normalised graph module in place (see the module example)."""
    from quant_torch_fx.graph_plan import build_plan_graph

    names = parse_conversions(tuple(rules))
    if not names:
        return []
    view = build_plan_graph(gm)
    matches: Sequence[Match] = find_matches(float_view(view.graph), names)
    editor = _Editor(gm)
    done = []
    for match in matches:
        handler = _HANDLERS.get(match.rule)
        if handler is None:  # hard_sigmoid: torch's hardsigmoid is the nominal one; legalize sets the device's
            continue
        result = handler(editor, view.nodes[match.node])
        if result is not None:
            done.append(FxConverted(match.rule, match.node, result))
    gm.graph.lint()
    gm.recompile()
    return done


__all__ = ["FxConverted", "convert_for_npu"]
