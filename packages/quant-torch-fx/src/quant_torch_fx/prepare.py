"""Turn a captured graph into a quantizable one: normalise it, ask the planner, insert
:class:`~quant_torch_fx.quantizer.FakeQuantizer` calls where the plan says.

- one activation quantizer per :class:`~quant_core.plan.TensorGroup` (module
  ``activation_quantizers.<group key>``), called after every member tensor's producer
  (observing only where the plan lists the member as observed); shape-reading nodes keep
  reading the float tensor;
- one weight quantizer per :class:`~quant_core.plan.WeightSlot`, called on the weight
  just before its consumer (``weight_quantizers.<node>``, or inside a
  :class:`~quant_torch_fx.modules.ConvBn`).

What was decided is kept in ``gm.meta["quant_torch_fx"]`` (:class:`QuantGraphInfo`),
which survives ``copy.deepcopy``.

Example:
    >>> import torch
    >>> from quant_core.presets import get_preset
    >>> class Net(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.conv = torch.nn.Conv2d(3, 4, 3)
    ...     def forward(self, x):
    ...         return torch.relu(self.conv(x))
    >>> gm = torch.export.export(Net(), (torch.randn(2, 3, 8, 8),)).module()
    >>> gm = prepare_graph(gm, get_preset("a8w8"), mode="ptq")
    >>> sorted(graph_info(gm).activation), sorted(graph_info(gm).weights)
    (['conv2d', 'x'], ['conv/conv2d'])
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import attrs
import numpy as np
import torch
from torch import nn
from torch.fx import GraphModule, Node

from quant_core.config import QuantConfig
from quant_core.errors import ConfigError, DataError, ModelError
from quant_core.plan import PlanGraph, PlanNode, QuantPlan, activation_kind, plan_quantization, weight_is_transposed
from quant_core.qparams import QParams
from quant_torch_fx.aten_map import op_name
from quant_torch_fx.attention import decompose_attention
from quant_torch_fx.graph_passes import (
    functionalize_inplace,
    get_attr_value,
    modularize,
    remove_guards,
    scalars_to_constants,
    split_silu,
)
from quant_torch_fx.graph_plan import build_plan_graph, excluded_nodes
from quant_torch_fx.modules import ConvBn
from quant_torch_fx.naming import unique_name
from quant_torch_fx.npu_conversions import convert_for_npu
from quant_torch_fx.quantizer import FakeQuantizer

META_KEY = "quant_torch_fx"
ACTIVATIONS = "activation_quantizers"
WEIGHTS = "weight_quantizers"
SHAPE_READERS = frozenset({"sym_size", "sym_numel", "sym_stride", "sym_storage_offset"})
"""Ops that read only a tensor's shape: they keep reading the float tensor."""

VALUE_PRESERVING = frozenset(
    {
        "max_pool1d", "max_pool2d", "max_pool3d", "max_pool2d_with_indices", "view", "reshape", "_unsafe_view",
        "flatten", "permute", "transpose", "t", "squeeze", "unsqueeze", "slice", "narrow", "select", "split",
        "split_with_sizes", "chunk", "unbind", "expand", "repeat", "cat", "concat", "pixel_shuffle",
        "pixel_unshuffle", "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "clone", "contiguous",
    }
)  # fmt: skip
"""ATen ops whose output values are some of their inputs' values (in torch's arithmetic):
fake quantization after them, with the qparams their inputs already carry, changes
nothing. Training skips those calls (``redundant``); eval keeps them, so the frozen
model and the export keep the QDQ pairs onnxruntime's 8-bit ops need."""


@attrs.define(eq=False)
class QuantGraphInfo:
    """What :func:`prepare_graph` decided for one graph module.

    Args:
        plan: the planner's decisions.
        config: the config the plan came from (module exclusions added).
        mode: ``"ptq"`` (batch norm folded) or ``"qat"`` (batch norm simulated, or folded
            with ``fold_batch_norms``).
        activation: group key -> quantizer path.
        weights: weighted plan node -> weight quantizer path.
        weighted: weighted plan node -> FX node name (its call).
        nodes: plan node name -> FX node name.
        constant_groups: group keys with a constant member to observe once.
        frozen: set by :func:`quant_torch_fx.freeze.freeze`.
        biases: weighted plan node -> the encoded bias (frozen models).
        notes: what calibration and freezing had to decide.
        layer_activations: weighted plan node -> ``"relu"``/``"relu6"`` when only that
            activation reads its output (``quant_core.plan.activation_kind``), else ``None``.
        transposed_weights: weighted plan nodes whose weight is stored ``[in, out]``.
        fixed_weights: weighted plan node -> weight qparams that freezing keeps (the
            algorithms learned codes at them).
        algorithms: what each config algorithm did (JSON-ready, by kind).
        first_batch_seen: QAT: whether the model ran since :func:`quant_torch_fx.qat.enable_qat`
            (the first call calibrates learnable qparams nothing set).
    """

    plan: QuantPlan
    config: QuantConfig
    mode: str
    activation: dict[str, str]
    weights: dict[str, str]
    weighted: dict[str, str]
    nodes: dict[str, str]
    constant_groups: tuple[str, ...] = ()
    frozen: bool = False
    biases: dict[str, Any] = attrs.field(factory=dict)
    notes: list[str] = attrs.field(factory=list)
    layer_activations: dict[str, str | None] = attrs.field(factory=dict)
    transposed_weights: frozenset[str] = frozenset()
    fixed_weights: dict[str, QParams] = attrs.field(factory=dict)
    algorithms: dict[str, Any] = attrs.field(factory=dict)
    first_batch_seen: bool = True

    def add_bias(self, node: str, tensor: str) -> None:
        """Record that weighted node ``node`` now reads the bias constant ``tensor``."""
        biases = tuple(attrs.evolve(slot, tensor=tensor) if slot.node == node else slot for slot in self.plan.biases)
        self.plan = attrs.evolve(self.plan, biases=biases)


def graph_info(gm: nn.Module) -> QuantGraphInfo:
    """The :class:`QuantGraphInfo` of a prepared graph module.

    Example:
        >>> graph_info(torch.nn.Linear(1, 1))
        Traceback (most recent call last):
        ...
        quant_core.errors.ModelError: model: Linear is not a prepared quantized graph; use ModelQuantizer.quantize_model or prepare_qat
    """
    meta = getattr(gm, "meta", None)
    info = meta.get(META_KEY) if isinstance(meta, dict) else None
    if not isinstance(info, QuantGraphInfo):
        raise ModelError(
            f"model: {type(gm).__name__} is not a prepared quantized graph; "
            "use ModelQuantizer.quantize_model or prepare_qat"
        )
    return info


def is_quantized_graph(module: nn.Module) -> bool:
    meta = getattr(module, "meta", None)
    return isinstance(module, GraphModule) and isinstance(meta, dict) and META_KEY in meta


def quantized_graphs(model: nn.Module) -> list[GraphModule]:
    """Every prepared graph in ``model`` (the model itself, or regions inside it)."""
    return [m for m in model.modules() if isinstance(m, GraphModule) and is_quantized_graph(m)]


def quantizer(gm: GraphModule, path: str) -> FakeQuantizer:
    module = gm.get_submodule(path)
    assert isinstance(module, FakeQuantizer)
    return module


def activation_quantizers(gm: GraphModule) -> Iterator[tuple[str, FakeQuantizer]]:
    """``(group key, quantizer)`` in plan order."""
    for key, path in graph_info(gm).activation.items():
        yield key, quantizer(gm, path)


def weight_quantizers(gm: GraphModule) -> Iterator[tuple[str, FakeQuantizer]]:
    """``(weighted node, quantizer)`` in plan order."""
    for node, path in graph_info(gm).weights.items():
        yield node, quantizer(gm, path)


def named_quantizers(model: nn.Module) -> list[dict[str, FakeQuantizer]]:
    """Per quantized graph of ``model`` (in module order): ``"activation:<group>"`` and
    ``"weight:<node>"`` -> its quantizer. The names are stable for the same model and
    config, so qparams saved from one process can be loaded into another.

    Example:
        >>> import torch
        >>> from quant_core.presets import get_preset
        >>> from quant_torch_fx import ModelQuantizer
        >>> q = ModelQuantizer(get_preset("a8w8"), quiet=True)
        >>> prepared = q.prepare(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1)), torch.randn(1, 3, 4, 4))
        >>> sorted(named_quantizers(prepared)[0])[-1]
        'weight:0/conv2d'
    """
    graphs = []
    for gm in quantized_graphs(model):
        named = {f"activation:{key}": fq for key, fq in activation_quantizers(gm)}
        named.update({f"weight:{node}": fq for node, fq in weight_quantizers(gm)})
        graphs.append(named)
    return graphs


def qparams_table(model: nn.Module) -> dict[str, tuple[list[float], list[int]]]:
    """Every quantizer's current scale and zero point as plain lists, keyed by
    ``"<graph index>/<named_quantizers name>"``: what two runs (devices, DDP ranks,
    processes) compare to tell whether they calibrated alike.

    Example:
        >>> import torch
        >>> from quant_torch_fx import ModelQuantizer
        >>> x = torch.randn(1, 3, 4, 4)
        >>> calibrated = ModelQuantizer("a8w8", quiet=True).quantize_model(torch.nn.Conv2d(3, 4, 1), x, [x])
        >>> sorted(qparams_table(calibrated))[-1]
        '0/weight:conv2d'
    """
    table = {}
    for index, named in enumerate(named_quantizers(model)):
        for name, fq in named.items():
            qp = fq.current_qparams()
            table[f"{index}/{name}"] = (qp.scale.reshape(-1).tolist(), qp.zero_point.reshape(-1).tolist())
    return table


_MODULE_DICT_ATTRIBUTES = frozenset(dir(nn.ModuleDict()))
"""Names a ModuleDict key may not take (a tensor called ``to`` or ``float`` is common)."""


def _key(name: str, taken: Collection[str]) -> str:
    return unique_name(re.sub(r"\W", "_", name) or "q", {*taken, *_MODULE_DICT_ATTRIBUTES})


def _data_user(user: Node) -> bool:
    return op_name(user) not in SHAPE_READERS


def normalize(gm: GraphModule, *, fold_batch_norms: bool) -> None:
    """The exact rewrites of :mod:`quant_torch_fx.graph_passes`, in order (in place), with
    attention written out first (:mod:`quant_torch_fx.attention`: its scale then becomes a
    constant like any other number operand)."""
    remove_guards(gm)
    functionalize_inplace(gm)
    decompose_attention(gm)
    split_silu(gm)
    scalars_to_constants(gm)
    modularize(gm, fold_batch_norms=fold_batch_norms)


def prepare_graph(
    gm: GraphModule,
    config: QuantConfig,
    *,
    mode: str,
    exclude_modules: Sequence[str] = (),
    exclude_module_types: Collection[type] = (),
    only_modules: Sequence[str] | None = None,
    share_concat_scales: bool = True,
    float_pass: Callable[[GraphModule], dict[str, Any]] | None = None,
    fold_batch_norms: bool | None = None,
    check_selectors: bool = True,
    normalized: bool = False,
) -> GraphModule:
    """Normalise, plan and instrument ``gm`` (a captured graph module; changed in place and
    returned). ``mode``: ``"ptq"`` or ``"qat"``. Module exclusions become node exclusions in
    the config the planner sees (see :func:`~quant_torch_fx.graph_plan.excluded_nodes`).
    ``float_pass`` edits the normalised float graph before it is planned (CLE) and returns
    its reports by algorithm kind. Batch norm after a convolution is folded into it with
    ``fold_batch_norms`` (default: in PTQ only; QAT otherwise simulates it, see ``ConvBn``).
    ``check_selectors=False`` leaves the check that every config selector selects a node
    to the caller (one region of a model need not hold them all). ``normalized``: ``gm`` is
    a copy of a graph :func:`normalize` already rewrote with the same ``fold_batch_norms``
    (a recipe search normalises its capture once for every candidate)."""
    if mode not in ("ptq", "qat"):
        raise ConfigError(f"mode: {mode!r} is not allowed; allowed: ptq, qat")
    if not normalized:
        normalize(gm, fold_batch_norms=mode == "ptq" if fold_batch_norms is None else fold_batch_norms)
    converted = convert_for_npu(gm, config.npu_conversions)
    reports = {} if float_pass is None else float_pass(gm)
    if converted:
        reports["npu_conversions"] = [attrs.asdict(c) for c in converted]
    view = build_plan_graph(gm)
    excluded = excluded_nodes(
        view, modules=exclude_modules, module_types=exclude_module_types, only_modules=only_modules
    )
    if excluded:
        config = config.evolve(exclude=(*config.exclude, *excluded))
    plan = plan_quantization(
        view.graph, config, share_concat_scales=share_concat_scales, check_selectors=check_selectors
    )
    if plan.requants:
        # One fake quantizer per tensor group here; a layer reading its input at another
        # format than the group's needs a quantizer on that edge, which is not built yet.
        first = plan.requants[0]
        raise ConfigError(
            f"config: node {first.node!r} reads {first.tensor!r} as {first.spec.dtype.value}, another format "
            f"than the tensor's other readers ({len(plan.requants)} such input(s)); the torch backend quantizes "
            "each tensor once: give the readers one activation dtype (op_type_overrides / node_overrides), "
            "or use quant-onnx for per-reader formats"
        )

    gm.add_module(ACTIVATIONS, nn.ModuleDict())
    gm.add_module(WEIGHTS, nn.ModuleDict())
    activations: nn.ModuleDict = gm.get_submodule(ACTIVATIONS)  # type: ignore[assignment]
    weights: nn.ModuleDict = gm.get_submodule(WEIGHTS)  # type: ignore[assignment]
    activation_paths: dict[str, str] = {}
    constant_groups: list[str] = []
    # A fused producer's output is quantized again, with the same qparams, after its
    # Relu/Clip: r(clip(r(x))) == r(clip(x)), so training can skip the first call.
    fused_pre = {f.pre_tensor for f in plan.fused}
    for group in plan.groups:
        key = _key(group.key, activations.keys())
        fq = FakeQuantizer(group.spec, name=group.key)
        activations[key] = fq
        path = f"{ACTIVATIONS}.{key}"
        activation_paths[group.key] = path
        inserted: dict[str, Node] = {}
        for member in group.members:
            node = view.tensors[member]
            observed = member in group.observed
            if node.op == "get_attr":  # constants are observed once, at calibration start
                if observed and group.key not in constant_groups:
                    constant_groups.append(group.key)
                observed = False
            redundant = not observed and (member in fused_pre or _preserves_group_values(node, inserted))
            inserted[member] = _insert_after(gm, node, path, observed, redundant)
    _to_model_device(gm, activation_paths.values())

    weight_paths: dict[str, str] = {}
    weighted: dict[str, str] = {}
    for slot in plan.weights:
        node = view.nodes[slot.node]
        weighted[slot.node] = node.name
        fq = FakeQuantizer(slot.spec, name=slot.node)
        if node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            assert isinstance(module, ConvBn)
            module.weight_quantizer = fq.to(module.weight.device)
            weight_paths[slot.node] = f"{node.target}.weight_quantizer"
            continue
        key = _key(slot.node, weights.keys())
        weight_node = node.args[slot.input_index]
        assert isinstance(weight_node, Node)
        weights[key] = fq.to(_device_of(gm, weight_node))
        path = f"{WEIGHTS}.{key}"
        weight_paths[slot.node] = path
        with gm.graph.inserting_before(node):
            call = gm.graph.call_module(path, (weight_node,), {"observe_batch": False})
        call.meta["val"] = weight_node.meta.get("val")
        node.replace_input_with(weight_node, call)
    gm.graph.lint()
    gm.recompile()
    gm.meta[META_KEY] = QuantGraphInfo(
        plan=plan,
        config=config,
        mode=mode,
        activation=activation_paths,
        weights=weight_paths,
        weighted=weighted,
        nodes={name: node.name for name, node in view.nodes.items()},
        constant_groups=tuple(constant_groups),
        layer_activations={slot.node: _activation_after(view.graph, slot.node) for slot in plan.weights},
        transposed_weights=frozenset(
            slot.node
            for slot in plan.weights
            if slot.op_type != "Conv" and weight_is_transposed(_plan_node(view, slot.node))
        ),
        algorithms=dict(reports),
    )
    return gm


def _plan_node(view: Any, name: str) -> PlanNode:
    return next(n for n in view.graph.nodes if n.name == name)


def _activation_after(graph: PlanGraph, name: str) -> str | None:
    """The activation kind of the sole reader of a weighted node's output (what the
    layer-wise algorithms compare outputs after)."""
    node = next(n for n in graph.nodes if n.name == name)
    readers = graph.consumers(node.outputs[0])
    if len(readers) != 1 or graph.is_graph_output(node.outputs[0]):
        return None
    return activation_kind(readers[0], graph.constant)


def _device_of(gm: GraphModule, node: Node) -> torch.device:
    if node.op == "get_attr":
        return get_attr_value(gm, node).device
    meta = node.meta.get("val")
    return meta.device if isinstance(meta, torch.Tensor) else torch.device("cpu")


def _to_model_device(gm: GraphModule, paths: Collection[str]) -> None:
    """Put activation quantizers on the device of the tensors they see (the model's)."""
    device = next((p.device for p in gm.parameters()), None) or next((b.device for b in gm.buffers()), None)
    if device is None:
        return
    for path in paths:
        gm.get_submodule(path).to(device)


def _preserves_group_values(node: Node, inserted: dict[str, Node]) -> bool:
    """``node`` is a value-preserving op reading only tensors already fake-quantized with
    its group's qparams (the calls in ``inserted``)."""
    if op_name(node) not in VALUE_PRESERVING:
        if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], Node):
            return _preserves_group_values(node.args[0], inserted)
        return False
    quantized = set(inserted.values())
    tensors = [a for a in _flat(node.args) if isinstance(a, Node) and isinstance(a.meta.get("val"), torch.Tensor)]
    return bool(tensors) and all(t in quantized for t in tensors)


def _flat(values: Any) -> list[Any]:
    flat: list[Any] = []
    for value in values:
        flat.extend(_flat(value) if isinstance(value, list | tuple) else [value])
    return flat


def _insert_after(gm: GraphModule, node: Node, path: str, observe: bool, redundant: bool = False) -> Node:
    with gm.graph.inserting_after(node):
        kwargs: dict[str, Any] = {"observe_batch": observe}
        if redundant:
            kwargs["redundant"] = True
        call = gm.graph.call_module(path, (node,), kwargs)
    call.meta["val"] = node.meta.get("val")
    call.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
    node.replace_all_uses_with(call, delete_user_cb=lambda user: user is not call and _data_user(user))
    return call


def observe_constants(gm: GraphModule) -> None:
    """Feed each constant member of a group its value once (calibration start)."""
    from quant_torch_fx.observe import observe

    info = graph_info(gm)
    wanted = set(info.constant_groups)
    if not wanted:
        return
    by_name = {n.name: n for n in gm.graph.nodes}
    for group in info.plan.groups:
        if group.key not in wanted:
            continue
        fq = quantizer(gm, info.activation[group.key])
        for member in group.observed:
            node = by_name.get(member)
            if node is not None and node.op == "get_attr":
                try:
                    observe(fq.observer, get_attr_value(gm, node))
                except DataError as exc:  # an infinite constant (a mask nothing recognised)
                    raise DataError(f"calibration: constant {member!r}: {exc}") from None


def activation_qparams_lookup(gm: GraphModule) -> Any:
    """``(layer node, input tensor) -> qparams`` of the input that layer reads: its group's
    (``None``: float). The torch backend refuses plans with input requantizations, so a
    layer always reads its input's group qparams."""
    info = graph_info(gm)

    def lookup(node: str, tensor: str) -> QParams | None:
        group = info.plan.group_of(tensor)
        if group is None:
            return None
        return quantizer(gm, info.activation[group.key]).current_qparams()

    return lookup


def constant_lookup(gm: GraphModule) -> Any:
    """tensor name -> the constant's value as the kernel uses it (folded for ``ConvBn``)."""
    by_name = {n.name: n for n in gm.graph.nodes if n.op == "get_attr"}

    def lookup(tensor: str) -> np.ndarray | None:
        node = by_name.get(tensor)
        if node is not None:
            return get_attr_value(gm, node).detach().float().cpu().numpy()
        # "<path>.weight" / "<path>.bias": a ConvBn's folded values, or (once frozen) the
        # tensors the fold left at that path.
        path, _, which = tensor.rpartition(".")
        if which not in ("weight", "bias") or not path:
            return None
        try:
            module = gm.get_submodule(path)
        except AttributeError:
            return None
        if isinstance(module, ConvBn):
            folded = module.folded()
            return (folded[0] if which == "weight" else folded[1]).detach().cpu().numpy()
        value = getattr(module, which, None)
        return value.detach().float().cpu().numpy() if isinstance(value, torch.Tensor) else None

    return lookup
