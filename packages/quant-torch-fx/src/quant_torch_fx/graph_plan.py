"""A normalised captured graph (:mod:`quant_torch_fx.graph_passes`) as the planner's
:class:`~quant_core.plan.PlanGraph`, and the names that tie the two together.

- Tensors are named after the FX node that produces them; alias ops (dropout, clone...)
  are looked through, so the planner sees the tensor the ONNX exporter would write.
- Nodes are named ``"<module path>/<fx name>"`` (``"layer1.0/add_3"``; top level: the FX
  name); a weighted module call (:class:`~quant_torch_fx.modules.ConvBn`) is named by its
  module path. Config name globs (``exclude``, ``name_overrides``) match these names.
- Weights and biases are constants: ``get_attr`` tensors, or a ``ConvBn``'s folded weight
  and bias (``"<path>.weight"``, ``"<path>.bias"``).
- Values that are not float tensors (indices, shapes) are marked non-float.

Example:
    >>> import torch
    >>> from quant_core.plan import plan_quantization
    >>> from quant_core.presets import get_preset
    >>> class Net(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.fc, self.head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    ...     def forward(self, x):  # a layer reads the Relu: not the result tail (float)
    ...         return self.head(torch.relu(self.fc(x)))
    >>> from quant_torch_fx.prepare import normalize
    >>> gm = torch.export.export(Net(), (torch.randn(3, 4),)).module()
    >>> normalize(gm, fold_batch_norms=True)
    >>> view = build_plan_graph(gm)
    >>> [(n.name, n.op_type, n.inputs) for n in view.graph.nodes]
    [('fc/linear', 'Gemm', ('x', 'fc_weight', 'fc_bias')), ('relu', 'Relu', ('linear',)), ('head/linear_1', 'Gemm', ('relu', 'head_weight', 'head_bias'))]
    >>> plan = plan_quantization(view.graph, get_preset("a8w8"))
    >>> [f.node for f in plan.fused], plan.weights[0].spec.per_channel_axis
    (['relu'], 0)
"""

from __future__ import annotations

import fnmatch
import operator
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

import attrs
import numpy as np
import torch
from torch import nn
from torch.fx import GraphModule, Node

from quant_core.plan import PlanGraph, PlanNode
from quant_torch_fx.aten_map import MappedNode, map_node, to_plan_node
from quant_torch_fx.graph_passes import get_attr_value, getitem_outputs
from quant_torch_fx.modules import ConvBn, GraphBatchNorm
from quant_torch_fx.naming import module_paths, module_type_names, plan_name


@attrs.frozen(eq=False)
class GraphView:
    """The planner's view of a graph module and how its names map back.

    Args:
        graph: the :class:`PlanGraph`.
        nodes: plan node name -> FX node.
        tensors: tensor name -> FX node producing it.
        constants: tensor name -> the constant's current value (a callable: weights
            change during QAT).
    """

    graph: PlanGraph
    nodes: dict[str, Node]
    tensors: dict[str, Node]
    constants: dict[str, Callable[[], torch.Tensor]]

    def constant_value(self, tensor: str) -> np.ndarray | None:
        getter = self.constants.get(tensor)
        return None if getter is None else getter().detach().cpu().numpy()


def _is_float_tensor(node: Node) -> bool:
    meta = node.meta.get("val")
    return isinstance(meta, torch.Tensor) and meta.is_floating_point()


def _holds_tensors(node: Node) -> bool:
    meta = node.meta.get("val")
    if isinstance(meta, list | tuple):
        return any(isinstance(v, torch.Tensor) for v in meta)
    return meta is None or isinstance(meta, torch.Tensor)


def _alias_source(gm: GraphModule, node: Node) -> Node | None:
    """The node whose value ``node`` passes on unchanged in inference, if it is an alias."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if isinstance(module, nn.Dropout | nn.Dropout2d | nn.Identity):
            source = node.args[0]
            return source if isinstance(source, Node) else None
        return None
    if node.op == "call_function" and map_node(node) is None and node.target is not operator.getitem:
        source = node.args[0] if node.args else None
        return source if isinstance(source, Node) else None
    return None


def build_plan_graph(gm: GraphModule) -> GraphView:
    """The :class:`GraphView` of a normalised graph module (see the module docstring)."""
    canonical: dict[Node, Node] = {}

    def resolve(node: Node) -> Node:
        return canonical.get(node, node)

    nodes: list[PlanNode] = []
    by_name: dict[str, Node] = {}
    tensors: dict[str, Node] = {}
    constants: dict[str, Callable[[], torch.Tensor]] = {}
    non_float: set[str] = set()
    inputs: list[str] = []

    def name_of(node: Node) -> str:
        return resolve(node).name

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            tensors[node.name] = node
            if _is_float_tensor(node):
                inputs.append(node.name)
            else:
                non_float.add(node.name)
            continue
        if node.op == "get_attr":
            tensors[node.name] = node
            constants[node.name] = _getter(gm, node)
            if not get_attr_value(gm, node).is_floating_point():
                non_float.add(node.name)
            continue
        if node.op == "output" or (node.op == "call_function" and node.target is operator.getitem):
            continue
        if not _holds_tensors(node):
            continue  # shape arithmetic (sym_size...) and assertions: not data
        source = _alias_source(gm, node)
        if source is not None:
            canonical[node] = resolve(source)
            continue
        mapped = _map(gm, node, constants)
        if mapped is None:
            continue
        outputs = getitem_outputs(node)
        output_names = [node.name] if outputs is None else outputs
        for out in output_names:
            if out:
                tensors[out] = node if out == node.name else next(u for u in node.users if u.name == out)
                if not _is_float_tensor(tensors[out]):
                    non_float.add(out)
        name = plan_name(node)
        by_name[name] = node
        nodes.append(to_plan_node(mapped, name, name_of, output_names))
    outputs = [name_of(v) for v in _flatten(gm.graph.output_node().args) if isinstance(v, Node)]

    def constant(tensor: str) -> np.ndarray | None:
        getter = constants.get(tensor)
        return None if getter is None else getter().detach().float().cpu().numpy()

    graph = PlanGraph(nodes, inputs=inputs, outputs=outputs, constant=constant, non_float=non_float)
    return GraphView(graph, by_name, tensors, constants)


def _getter(gm: GraphModule, node: Node) -> Callable[[], torch.Tensor]:
    return lambda: get_attr_value(gm, node)


def _map(gm: GraphModule, node: Node, constants: dict[str, Callable[[], torch.Tensor]]) -> MappedNode | None:
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if isinstance(module, ConvBn):
            path = str(node.target)
            constants[f"{path}.weight"] = lambda: module.folded()[0]
            constants[f"{path}.bias"] = lambda: module.folded()[1]
            # conv_args: stride, padding, dilation, groups
            groups = int(module.conv_args[3]) if len(module.conv_args) > 3 else 1
            return MappedNode("Conv", (node.args[0], f"{path}.weight", f"{path}.bias"), {"group": groups})
        if isinstance(module, GraphBatchNorm):
            return MappedNode("BatchNormalization", (node.args[0],), {})
        tensors = tuple(a for a in node.args if isinstance(a, Node))
        return MappedNode(type(module).__name__, tensors, {}, standard=False)
    if node.op != "call_function":
        return None
    return map_node(node)


def _flatten(values: Iterable[Any]) -> list[Any]:
    flat: list[Any] = []
    for value in values:
        if isinstance(value, list | tuple):
            flat.extend(_flatten(value))
        elif isinstance(value, dict):
            flat.extend(_flatten(value.values()))
        else:
            flat.append(value)
    return flat


def excluded_nodes(
    view: GraphView,
    *,
    modules: Sequence[str] = (),
    module_types: Collection[type] = (),
    only_modules: Sequence[str] | None = None,
) -> list[str]:
    """Plan node names to leave float: inside a module whose path matches a glob of
    ``modules`` or whose type is in ``module_types``, or (``only_modules``) outside every
    module matching one of those globs.

    Example:
        >>> excluded_nodes(GraphView(PlanGraph([], inputs=(), outputs=()), {}, {}, {}), modules=["head*"])
        []
    """
    type_names = {f"{t.__module__}.{t.__qualname__}" for t in module_types}
    names = []
    for name, node in view.nodes.items():
        paths = module_paths(node) + ([str(node.target)] if node.op == "call_module" else [])
        kinds = set(module_type_names(node))
        inside = any(fnmatch.fnmatchcase(p, pattern) for p in paths for pattern in modules)
        typed = bool(kinds & type_names)
        outside = only_modules is not None and not any(
            fnmatch.fnmatchcase(p, pattern) or p.startswith(pattern + ".") for p in paths for pattern in only_modules
        )
        if inside or typed or outside:
            names.append(name)
    return names
