"""Rewrite a graph module's weights and biases in place (what the algorithms learned).

Example:
    >>> import torch
    >>> from quant_torch_fx.capture import capture
    >>> gm = capture(torch.nn.Linear(2, 1, bias=False), (torch.randn(1, 2),))
    >>> fc = next(n for n in gm.graph.nodes if n.op == "call_function")
    >>> name = set_bias(gm, fc, torch.tensor([0.5]))
    >>> gm(torch.zeros(1, 2)).tolist()
    [[0.5]]
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np
import torch
from torch.fx import GraphModule, Node

from quant_algos.drivers.cle_chains import LayerRef
from quant_algos.layer import Layer
from quant_core.errors import ModelError
from quant_torch_fx.aten_map import op_name
from quant_torch_fx.graph_passes import get_attr_value
from quant_torch_fx.graph_plan import GraphView

BIAS_INDEX = 2
"""Position of the bias argument of ``aten.conv*d`` and ``aten.linear``."""


def set_constant(gm: GraphModule, node_name: str, value: torch.Tensor) -> None:
    """Overwrite the tensor the ``get_attr`` node ``node_name`` reads (same shape)."""
    node = next(n for n in gm.graph.nodes if n.name == node_name)
    target = get_attr_value(gm, node)
    with torch.no_grad():
        target.copy_(value.to(device=target.device, dtype=target.dtype).reshape(target.shape))


def bias_argument(node: Node) -> Node | None:
    """The node a convolution or linear node reads its bias from, if any (a ``get_attr``,
    or a computed one: ``nn.MultiheadAttention`` with ``kdim`` slices one bias in three)."""
    value = node.args[BIAS_INDEX] if len(node.args) > BIAS_INDEX else node.kwargs.get("bias")
    return value if isinstance(value, Node) else None


def bias_node(node: Node) -> Node | None:
    """The ``get_attr`` bias a convolution or linear node reads, if any."""
    value = bias_argument(node)
    return value if value is not None and value.op == "get_attr" else None


def set_bias(gm: GraphModule, node: Node, value: torch.Tensor) -> str:
    """Give ``node`` (``aten.conv*d``/``aten.linear``) the bias ``value``: its own tensor
    is overwritten, or a new buffer is read when it has none. Returns the bias's node name."""
    current = bias_node(node)
    if current is not None:
        set_constant(gm, current.name, value)
        return current.name
    if bias_argument(node) is not None:
        raise ModelError(f"node {node.name!r}: its bias is computed in the graph; it cannot be replaced")
    if op_name(node) not in ("conv1d", "conv2d", "conv3d", "linear"):
        raise ModelError(f"node {node.name!r}: {op_name(node)} takes no bias")
    getter = new_buffer(gm, node, "bias", value)
    args = list(node.args)
    if len(args) > BIAS_INDEX:
        args[BIAS_INDEX] = getter
        node.args = tuple(args)
    else:
        node.args = (*args, *([None] * (BIAS_INDEX - len(args))), getter)
        node.kwargs = {k: v for k, v in node.kwargs.items() if k != "bias"}
    gm.recompile()
    return getter.name


def new_buffer(gm: GraphModule, node: Node, suffix: str, value: torch.Tensor, *, after: bool = False) -> Node:
    """A ``get_attr`` node just before ``node`` (after it with ``after``) reading a new float
    buffer ``<node>_<suffix>`` that holds ``value`` on ``node``'s device."""
    meta = node.meta.get("val")
    device = meta.device if isinstance(meta, torch.Tensor) else torch.device("cpu")
    name = re.sub(r"\W", "_", f"{node.name}_{suffix}")
    while hasattr(gm, name):
        name += "_"
    gm.register_buffer(name, value.detach().clone().to(device).float())
    with gm.graph.inserting_after(node) if after else gm.graph.inserting_before(node):
        getter = gm.graph.get_attr(name)
    getter.meta["val"] = value
    return getter


def write_layers(gm: GraphModule, view: GraphView, layers: Mapping[str, Layer], refs: Mapping[str, LayerRef]) -> None:
    """Write rescaled layers (``[out, in, ...]`` weights and biases, by plan node name) into
    the tensors ``refs`` names (CLE's and activation equalization's edits)."""
    for name, layer in layers.items():
        ref = refs[name]
        set_constant(gm, ref.weight_name, _tensor(ref.stored_weight(layer.weight)))
        if layer.bias is not None:
            set_bias(gm, view.nodes[name], _tensor(layer.bias))


def _tensor(value: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(value, np.float32))
