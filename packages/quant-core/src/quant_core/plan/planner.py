"""The planner: which tensor gets which :class:`~quant_core.spec.QuantSpec`, decided once
for every backend.

:func:`plan_quantization` applies the op table (:mod:`quant_core.plan.ops`) and a
:class:`~quant_core.config.QuantConfig` to a :class:`~quant_core.plan.graph.GraphView`
and returns a :class:`QuantPlan`:

- activation tensors grouped into :class:`TensorGroup` s that share one set of qparams
  (a pass-through op's output joins its input's group, Concat's inputs and output form
  one group, a Conv/Gemm/MatMul/Add output fused with its sole-consumer Relu/Clip joins
  the activation output's group); each group lists the tensors calibration must observe;
- weight slots with the weight's channel axis resolved per op, and bias slots with the
  facts the bias rule (:mod:`quant_core.bias`) needs;
- every node left in float, with the reason.

Under ``config.transformer_recipe`` (the default) the recognised transformer blocks
(:mod:`quant_core.plan.transformer`) adjust formats: residual-stream tensors float (widened
to 16 bits under power-of-two formats), LayerNorm/GELU internals float, Softmax outputs on
the fixed ``[0, 1]`` grid, and quantized masked attention scores (and their mask) on a
range derived from the scores before the mask (:class:`DerivedRange`). The activation
chains between layers (:mod:`quant_core.plan.activation_chains`: scalar affine steps,
decomposed HardSwish, SiLU) are quantized at their end only, except under power-of-two
formats. Under every format but power-of-two, the result tail (:mod:`quant_core.plan.tail`: what is computed after the last
layer, a classifier's logits, a detector's box decoding) stays float. A per-tensor
power-of-two weight whose min-max grid rounds most of it to zero (one outlier element) gets
its position by squared error (:mod:`quant_core.plan.weight_range`). A tensor every reader
of which saturates (a HardSwish's input) is quantized on its range cut at the saturation
(:class:`RangeBound`), as is a tensor an activation chain alone reads, where the chain
saturates.

Nothing is computed from data here: a backend's calibration turns each group's
observations into qparams, so the same graph, config and data give the same scales on
every backend.

Example:
    >>> import numpy as np
    >>> from quant_core.plan.graph import PlanGraph, PlanNode
    >>> from quant_core.presets import get_preset
    >>> nodes = [PlanNode("conv", "Conv", ("x", "w"), ("c",)), PlanNode("relu", "Relu", ("c",), ("y",))]
    >>> graph = PlanGraph(nodes, inputs=("x",), outputs=("y",), constant={"w": np.ones((4, 3, 1, 1))}.get)
    >>> plan = plan_quantization(graph, get_preset("a8w8"))
    >>> [(grp.members, grp.observed) for grp in plan.groups]
    [(('x',), ('x',)), (('c', 'y'), ('y',))]
    >>> plan.weights[0].spec.per_channel_axis, [f.node for f in plan.fused]
    (0, ['relu'])
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import attrs
import numpy as np

from quant_core.config import CalibrationConfig, OperatorConfig, QuantConfig
from quant_core.errors import ConfigError
from quant_core.plan import selectors
from quant_core.plan.activation_chains import ActivationChains, find_chains
from quant_core.plan.graph import GraphView, PlanNode
from quant_core.plan.ops import (
    FUSABLE_PRODUCERS,
    OpKind,
    OpPolicy,
    clip_bounds,
    integer_kernel_reads,
    policy_for,
    saturation_interval,
    weight_channel_axis,
)
from quant_core.plan.tail import result_tail
from quant_core.plan.transformer import MaskedScores, TransformerBlocks, find_blocks, softmax_spec, widened
from quant_core.plan.weight_range import held_weight_spec
from quant_core.qparams import QParams, dequantize, qparams_from_range
from quant_core.spec import OUTPUT_CHANNELS, QuantSpec, ScaleType

if TYPE_CHECKING:
    from quant_core.observers.base import Observer

RESULT_CONCAT_REASON = (
    "a Concat writing a graph output: no integer op reads it, and one scale for all its inputs "
    "would cost the finer ones their precision (a detector's boxes beside its scores)"
)
"""Why the planner leaves a Concat that only assembles the model's results in float: each
input keeps its own qparams (measured on the trained YOLO-style detector: a8w8 mAP@0.5
0.00 with the output quantized, 0.67 without; float 0.70)."""


@attrs.frozen
class TensorGroup:
    """Activation tensors that share one scale and zero point.

    ``observed`` are the members whose values calibration must see (the others lie
    inside their range by construction: pass-through outputs, Concat's output, the
    pre-activation tensor of a fused Relu/Clip).

    Example:
        >>> TensorGroup("x", QuantSpec(dtype="uint8", symmetric=False), ("x", "y"), ("x",)).key
        'x'
    """

    key: str
    spec: QuantSpec
    members: tuple[str, ...]
    observed: tuple[str, ...]


@attrs.frozen
class WeightSlot:
    """A Conv/ConvTranspose/Gemm/MatMul weight stored as integers.

    ``spec.per_channel_axis`` is the op's output-channel axis (or ``None``), never
    :data:`~quant_core.spec.OUTPUT_CHANNELS`.

    Example:
        >>> WeightSlot("conv", "Conv", "w", 1, QuantSpec(dtype="int8", per_channel_axis=0)).input_index
        1
    """

    node: str
    op_type: str
    tensor: str
    input_index: int
    spec: QuantSpec


@attrs.frozen
class BiasSlot:
    """A Conv/Gemm bias and what the bias rule (:func:`quant_core.bias.encode_bias`) needs:
    the layer's input and weight tensors, the config's bias ``spec`` (``None``: int32 by
    the rule) and whether the layer's formats are ones integer kernels consume
    (``integer_kernel``: 8-bit activations, weights of at most 8 bits, an op with an
    integer kernel), which fixes the bias at ``input_scale * weight_scale``. ``tensor`` is
    ``""`` for a layer that has no bias yet (algorithms may add one by the same rule).

    Example:
        >>> BiasSlot("conv", "b", 2, "x", "w", None, True).input_tensor
        'x'
    """

    node: str
    tensor: str
    input_index: int
    input_tensor: str
    weight_tensor: str
    spec: QuantSpec | None
    integer_kernel: bool


@attrs.frozen
class FusedActivation:
    """A Relu/Clip fused into its producer: the producer's output ``pre_tensor`` shares
    ``post_tensor``'s qparams; a writer drops the activation node when the quantizer's
    saturation already applies its bounds exactly.

    Example:
        >>> FusedActivation("relu", "Relu", "conv", "c", "y", (0.0, float("inf"))).bounds
        (0.0, inf)
    """

    node: str
    op_type: str
    producer: str
    pre_tensor: str
    post_tensor: str
    bounds: tuple[float, float]


@attrs.frozen
class FloatNode:
    """A node left in float and why (reported, never silent).

    Example:
        >>> FloatNode("nms", "NonMaxSuppression", "no quantization policy for this op type").op_type
        'NonMaxSuppression'
    """

    name: str
    op_type: str
    reason: str


@attrs.frozen
class InputRequant:
    """A weighted layer whose config asks for its input in another format than the
    tensor's group (e.g. a layer mixed precision raised to 16-bit input while the
    producer's output stays 8-bit): that layer reads its own quantize/dequantize pair of
    the float tensor, with ``spec``; qparams come from the group's observer.

    Example:
        >>> InputRequant("conv", "x", QuantSpec(dtype="uint16", symmetric=False)).key
        'conv:x'
    """

    node: str
    tensor: str
    spec: QuantSpec

    @property
    def key(self) -> str:
        return f"{self.node}:{self.tensor}"


@attrs.frozen
class DerivedRange:
    """A group whose range calibration does not observe: it comes from the selected ranges
    ``[lo, hi]`` of the ``sources`` groups (the attention scores before a mask).

    ``masked=False`` (the masked scores): ``[min lo - margin, max hi]``. A masked position
    clamps to the lower end, whose softmax weight beside the row's largest score (at least
    the visible minimum) is under ``exp(-margin)``: ``margin = ln(2**bits)`` of the softmax
    output, under its step, so it still reads as masked, while the visible scores keep the
    grid (observed, the fill would set the range: ``-3.4e38`` leaves them one code).
    ``masked=True`` (the additive mask): ``[min (lo - margin - hi), 0]``, so that the fill
    clamps to a value that takes any score below the masked scores' lower end; 0 stays 0.

    Example:
        >>> import numpy as np
        >>> d = DerivedRange("masked", ("scores",), margin=np.log(256), masked=False)
        >>> [round(float(v), 2) for v in d.range([(np.float64(-3.0), np.float64(4.0))])]
        [-8.55, 4.0]
        >>> [round(float(v), 2) for v in attrs.evolve(d, masked=True).range([(-3.0, 4.0), (-1.0, 1.0)])]
        [-12.55, 0.0]
    """

    group: str
    sources: tuple[str, ...]
    margin: float
    masked: bool

    def range(self, sources: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
        """The derived ``(lo, hi)`` from the sources' selected ranges (in ``sources`` order)."""
        if self.masked:
            lo = min(float(s_lo) - self.margin - float(s_hi) for s_lo, s_hi in sources)
            return np.array(lo, np.float64), np.array(0.0, np.float64)
        lo = min(float(s_lo) for s_lo, _ in sources) - self.margin
        return np.array(lo, np.float64), np.array(max(float(s_hi) for _, s_hi in sources), np.float64)


@attrs.frozen
class RangeBound:
    """A group every reader of which saturates outside ``[lo, hi]`` (a Conv's output read
    only by a HardSwish: 0 below -3; by a HardSigmoid: constant outside ``[-3, 3]`` for
    ``alpha = 1/6``): a value beyond a bound gives every reader what the bound gives, so
    the selected range is cut there and the grid spends its codes where readers see a
    difference. Exact: the cut is widened by one step of the cut grid, so that the grid
    still reaches the bound after the zero point is rounded.

    Example:
        >>> import numpy as np
        >>> from quant_core.spec import QuantSpec
        >>> spec = QuantSpec(dtype="uint8", symmetric=False)
        >>> lo, hi = RangeBound("c", -3.0, float("inf")).cut(np.float64(-21.0), np.float64(20.0), spec)
        >>> round(float(lo), 4), float(hi)
        (-3.0902, 20.0)
    """

    group: str
    lo: float
    hi: float

    def selection(self, observer: Observer, spec: QuantSpec) -> tuple[tuple[np.ndarray, np.ndarray], QParams]:
        """What ``observer`` selects for ``spec``, cut at the bounds (:meth:`cut`), and its
        qparams: the nearest power of two as everywhere, the covering one where the nearest
        stops short of a cut end (:meth:`reached_by`). A symmetric spec selects from the
        statistic of the values clipped at the bounds (:meth:`Observer.clamped`): its
        selection folds both sides into one magnitude, so a tail beyond a bound (a HardSwish
        input far below -3) would set the scale that the cut could no longer narrow."""
        selected = observer.selection(spec)[0]
        if spec.symmetric:  # a side beyond its bound is cut below; the other side as the readers see it
            clamped = observer.clamped(self.lo, self.hi).selection(spec)[0]
            selected = (
                np.where(selected[0] < self.lo, selected[0], clamped[0]),
                np.where(selected[1] > self.hi, selected[1], clamped[1]),
            )
        lo, hi = self.cut(*selected, spec)
        qparams = qparams_from_range(lo, hi, spec)
        if not self.reached_by(qparams, *selected):
            qparams = qparams_from_range(lo, hi, spec, covering=True)
        return (lo, hi), qparams

    def reached_by(self, qparams: QParams, lo: np.ndarray, hi: np.ndarray) -> bool:
        """Whether the grid of ``qparams`` reaches each bound the selected range ``[lo, hi]``
        was cut at (a value beyond it then clamps where the readers saturate)."""
        ends = dequantize(np.array([qparams.qmin, qparams.qmax]), qparams)
        low_ok = not np.any(lo < self.lo) or bool(ends[0] <= self.lo)
        high_ok = not np.any(hi > self.hi) or bool(ends[1] >= self.hi)
        return low_ok and high_ok

    def cut(self, lo: np.ndarray, hi: np.ndarray, spec: QuantSpec) -> tuple[np.ndarray, np.ndarray]:
        """The selected range ``[lo, hi]`` cut at the bounds, one step of the cut grid wider."""
        cut_lo, cut_hi = np.maximum(lo, self.lo), np.minimum(hi, self.hi)
        step = np.asarray(qparams_from_range(cut_lo, cut_hi, spec, covering=True).scale, np.float64)
        new_lo = np.where(lo < self.lo, np.maximum(lo, self.lo - step), lo)
        new_hi = np.where(hi > self.hi, np.minimum(hi, self.hi + step), hi)
        return np.asarray(new_lo, np.float64), np.asarray(new_hi, np.float64)


@attrs.frozen
class QuantPlan:
    """Every quantization decision about a model that does not need data.

    Example:
        >>> QuantPlan(groups=(), weights=(), biases=(), fused=(), quantized_nodes=(), float_nodes=()).group_of("x") is None
        True
    """

    groups: tuple[TensorGroup, ...]
    weights: tuple[WeightSlot, ...]
    biases: tuple[BiasSlot, ...]
    fused: tuple[FusedActivation, ...]
    quantized_nodes: tuple[tuple[str, str], ...]
    float_nodes: tuple[FloatNode, ...]
    notes: tuple[str, ...] = ()
    requants: tuple[InputRequant, ...] = ()
    derived: tuple[DerivedRange, ...] = ()
    bounds: tuple[RangeBound, ...] = ()
    _by_tensor: Mapping[str, TensorGroup] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        index = {member: group for group in self.groups for member in group.members}
        object.__setattr__(self, "_by_tensor", index)

    def group_of(self, tensor: str) -> TensorGroup | None:
        """The group ``tensor`` belongs to, or ``None`` when it stays float."""
        return self._by_tensor.get(tensor)

    def bound_of(self, group: str) -> RangeBound | None:
        """The saturation bound of group ``group`` (a key), or ``None`` when it has none."""
        return next((b for b in self.bounds if b.group == group), None)

    def derived_of(self, group: str) -> DerivedRange | None:
        """How the range of group ``group`` (a key) is derived, or ``None`` when it is observed."""
        return next((d for d in self.derived if d.group == group), None)

    def weight_of(self, node: str) -> WeightSlot | None:
        """The weight slot of weighted node ``node``, if its weight is quantized."""
        return next((slot for slot in self.weights if slot.node == node), None)

    def requant_of(self, node: str, tensor: str) -> InputRequant | None:
        """The requantization of ``tensor`` for consumer ``node``, if the plan has one."""
        return next((r for r in self.requants if r.node == node and r.tensor == tensor), None)

    def bias_of(self, node: str) -> BiasSlot | None:
        """The bias slot of weighted node ``node`` (``tensor`` ``""`` when it has no bias yet)."""
        return next((slot for slot in self.biases if slot.node == node), None)

    @property
    def observed_tensors(self) -> tuple[str, ...]:
        """Every tensor calibration must observe, in a deterministic order."""
        return tuple(name for group in self.groups for name in group.observed)


def _activation_spec(spec: QuantSpec | None, node: PlanNode, field: str) -> QuantSpec | None:
    if spec is None or not spec.is_quantized:
        return None
    if spec.per_channel_axis is not None:
        raise ConfigError(
            f"node {node.name!r} ({node.op_type}): {field}.per_channel_axis: {spec.per_channel_axis!r} is not "
            "allowed for activations; allowed: null (per tensor)"
        )
    if spec.dynamic:
        raise ConfigError(
            f"node {node.name!r} ({node.op_type}): {field}.dynamic: true needs dynamic quantization; "
            "static quantization allows: false"
        )
    return spec


def resolve_weight_spec(node: PlanNode, spec: QuantSpec, weight_rank: int) -> tuple[QuantSpec, str | None]:
    """``spec`` with its per-channel axis resolved for ``node``'s weight, and a note when
    "output channels" had to fall back to per tensor. An explicit integer axis is kept
    when it is the output-channel axis and refused otherwise: integer kernels scale
    output channels, and silently moving the user's axis would hide the mismatch.

    Example:
        >>> from quant_core.plan.graph import PlanNode
        >>> mm = PlanNode("mm", "MatMul", ("x", "w"), ("y",))
        >>> resolve_weight_spec(mm, QuantSpec(dtype="int8", per_channel_axis="output"), 2)[0].per_channel_axis
        1
        >>> resolve_weight_spec(mm, QuantSpec(dtype="int8", per_channel_axis=0), 2)
        Traceback (most recent call last):
        ...
        quant_core.errors.ConfigError: node 'mm' (MatMul): weight.per_channel_axis: 0 is not the output-channel axis of its rank-2 weight; allowed: 1, 'output' or null
    """
    axis = spec.per_channel_axis
    if axis is None:
        return spec, None
    out_axis = weight_channel_axis(node, weight_rank)
    if axis == OUTPUT_CHANNELS:
        if out_axis is None:
            layout = f"rank-{weight_rank}" if node.op_type == "MatMul" else "grouped"
            note = f"node {node.name!r}: {layout} {node.op_type} weight has no single output-channel axis; per tensor"
            return spec.evolve(per_channel_axis=None), note
        return spec.evolve(per_channel_axis=out_axis), None
    if axis != out_axis:
        allowed = f"{out_axis}, {OUTPUT_CHANNELS!r} or null" if out_axis is not None else "null"
        raise ConfigError(
            f"node {node.name!r} ({node.op_type}): weight.per_channel_axis: {axis} is not the output-channel axis "
            f"of its rank-{weight_rank} weight; allowed: {allowed}"
        )
    return spec, None


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def add(self, item: str) -> None:
        self.parent.setdefault(item, item)

    def find(self, item: str) -> str:
        root = item
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[item] != root:
            self.parent[item], item = root, self.parent[item]
        return root

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra


class _Planner:
    def __init__(self, graph: GraphView, config: QuantConfig, share_concat_scales: bool) -> None:
        self.graph = graph
        self.config = config
        self.share_concat_scales = share_concat_scales
        self.specs: dict[str, tuple[int, QuantSpec]] = {}  # tensor -> (priority, spec); 0 = producer's
        self.order: list[str] = []
        self.unobserved: set[str] = set()
        self.groups = _UnionFind()
        self.weights: list[WeightSlot] = []
        self.biases: list[BiasSlot] = []
        self.fused: list[FusedActivation] = []
        self.quantized: list[tuple[str, str]] = []
        self.quantized_names: set[str] = set()
        self.floating: list[FloatNode] = []
        self.notes: list[str] = []
        self.layer_inputs: list[tuple[str, str, QuantSpec]] = []  # (weighted node, input, its spec)
        self.blocks = find_blocks(graph) if config.transformer_recipe else TransformerBlocks()
        if self.blocks.summary():
            self.notes.append(f"transformer recipe: {self.blocks.summary()}")
        self.chains = find_chains(graph) if config.transformer_recipe else ActivationChains()
        if self.chains.summary():
            self.notes.append(self.chains.summary())
        self.tail = result_tail(graph)
        self.tail_float: set[str] = set()

    def kept_float(self, tensor: str, spec: QuantSpec) -> bool:
        """``tensor`` stays float: in the result tail (:mod:`quant_core.plan.tail`: after the
        last layer), or, under the transformer recipe, a block internal or the residual stream
        where no Conv/Gemm/MatMul reads it (no integer kernel reads either). Power-of-two
        formats are an integer-only device's (the NPU presets), which runs no float op: there
        these tensors keep the preset's format (the stream widened to 16 bits)."""
        if spec.scale_type is ScaleType.POWER_OF_TWO:
            return False
        if tensor in self.tail:
            self.tail_float.add(tensor)
            return True
        return (
            tensor in self.blocks.float_tensors
            or tensor in self.blocks.float_stream
            or tensor in self.chains.float_tensors
        )

    def request(self, tensor: str, spec: QuantSpec, priority: int) -> None:
        if self.kept_float(tensor, spec):
            return
        if spec.scale_type is ScaleType.POWER_OF_TWO and (
            tensor in self.blocks.residual or tensor in self.blocks.norm_internals
        ):
            spec = widened(spec)
        elif tensor in self.blocks.softmax_outputs:
            spec = softmax_spec(spec)
        self.groups.add(tensor)
        if tensor not in self.specs:
            self.order.append(tensor)
        current = self.specs.get(tensor)
        if current is None or priority < current[0]:
            self.specs[tensor] = (priority, spec)

    def float_tensors(self, names: tuple[str, ...], indices: tuple[int, ...] | None) -> list[str]:
        chosen = range(len(names)) if indices is None else indices
        picked = [names[i] for i in chosen if i < len(names) and names[i]]
        return [name for name in dict.fromkeys(picked) if self.graph.is_float(name)]

    def run(self) -> QuantPlan:
        for node in self.graph.nodes:
            if self.visit(node):
                self.quantized.append((node.name, node.op_type))
                self.quantized_names.add(node.name)
        return self.finish()

    def visit(self, node: PlanNode) -> bool:
        if node.op_type == "Constant":
            return False
        rule = policy_for(node, self.graph.constant)
        if rule is None:
            self.floating.append(FloatNode(node.name, node.op_type, "no quantization policy for this op type"))
            return False
        cfg: OperatorConfig | None = self.config.for_node(node.name, node.op_type)
        if cfg is None:
            self.floating.append(FloatNode(node.name, node.op_type, "excluded by the config"))
            return False
        act_in = _activation_spec(cfg.input, node, "input")
        act_out = _activation_spec(cfg.output, node, "output")
        inputs = self.float_tensors(node.inputs, rule.data_inputs)
        outputs = self.float_tensors(node.outputs, rule.data_outputs)
        if rule.kind is OpKind.CONCAT and self.joins_results(inputs, outputs):
            self.floating.append(FloatNode(node.name, node.op_type, RESULT_CONCAT_REASON))
            return False
        has_weight = False
        if rule.kind is OpKind.WEIGHTED:
            runtime_weight, has_weight = self.weighted(node, rule, cfg, act_in)
            inputs += runtime_weight
        if act_in is None and act_out is None and not has_weight:
            self.floating.append(FloatNode(node.name, node.op_type, "the config quantizes none of its tensors"))
            return False
        if act_in is not None:
            for name in inputs:
                self.request(name, act_in, priority=1)
                if rule.kind is OpKind.WEIGHTED:
                    self.layer_inputs.append((node.name, name, act_in))
        if rule.kind is OpKind.PASS_THROUGH:
            self.pass_through(inputs, outputs)
        elif rule.kind is OpKind.CONCAT and self.share_concat_scales:
            self.concat(inputs, outputs, act_out or act_in)
        elif act_out is not None:
            for name in outputs:
                self.request(name, act_out, priority=0)
            if rule.kind is OpKind.ACTIVATION and outputs:
                self.try_fuse(node, act_out)
        return True

    def joins_results(self, inputs: list[str], outputs: list[str]) -> bool:
        """A Concat of two or more tensors that only writes graph outputs (nothing reads it)."""
        return (
            len(set(inputs)) > 1
            and bool(outputs)
            and all(self.graph.is_graph_output(name) and not self.graph.consumers(name) for name in outputs)
        )

    def weighted(
        self, node: PlanNode, rule: OpPolicy, cfg: OperatorConfig, act_in: QuantSpec | None
    ) -> tuple[list[str], bool]:
        """Record weight and bias slots. Returns the weight when it is computed at run
        time (it is then quantized like an activation) and whether a slot was recorded."""
        assert rule.weight_input is not None
        weight_index, bias_index = rule.weight_input, rule.bias_input
        weight = node.input(weight_index)
        if not weight:
            return [], False
        value = self.graph.constant(weight)
        if value is None or not self.graph.is_float(weight):
            return ([weight] if self.graph.is_float(weight) else []), False
        if cfg.weight is None or not cfg.weight.is_quantized:
            return [], False
        spec, note = resolve_weight_spec(node, cfg.weight, value.ndim)
        if note is not None:
            self.notes.append(note)
        spec, note = held_weight_spec(value, spec)
        if note is not None:
            self.notes.append(f"node {node.name!r}: weight {weight!r}: {note}")
        self.weights.append(WeightSlot(node.name, node.op_type, weight, weight_index, spec))
        bias = node.input(bias_index) if bias_index is not None else ""
        if (
            bias_index is not None
            and act_in is not None
            and node.input(0)
            and (not bias or self.graph.constant(bias) is not None)
        ):
            # A slot also for a layer without a bias: algorithms (bias correction, AdaQuant)
            # may give it one, and the rule for storing it is decided here, once.
            kernel = integer_kernel_reads(rule, act_in.dtype, spec.dtype)
            self.biases.append(BiasSlot(node.name, bias, bias_index, node.input(0), weight, cfg.bias, kernel))
        elif bias:
            self.notes.append(f"node {node.name!r}: bias {bias!r} kept float (not a constant or input float)")
        return [], True

    def pass_through(self, inputs: list[str], outputs: list[str]) -> None:
        if not inputs or inputs[0] not in self.specs:
            return
        for name in outputs:
            self.groups.add(name)
            self.groups.union(inputs[0], name)
            self.unobserved.add(name)
            self.request(name, self.specs[inputs[0]][1], priority=2)

    def concat(self, inputs: list[str], outputs: list[str], spec: QuantSpec | None) -> None:
        if spec is None or all(self.kept_float(name, spec) for name in outputs):
            # A float output (ViT's class token joined to the patch tokens, the stream's
            # start): its inputs keep the formats their producers and other readers give them.
            return
        for name in inputs:
            self.request(name, spec, priority=1)
        for name in outputs:
            self.request(name, spec, priority=0)
            self.unobserved.add(name)
            for other in inputs:
                if other in self.specs:  # an input the recipe keeps float joins no group
                    self.groups.union(other, name)

    def try_fuse(self, node: PlanNode, act_out: QuantSpec) -> None:
        pre = node.input(0)
        producer = self.graph.producer(pre)
        bounds = clip_bounds(node, self.graph.constant)
        if (
            producer is None
            or bounds is None
            or producer.op_type not in FUSABLE_PRODUCERS
            or producer.name not in self.quantized_names
            or pre not in self.specs  # never planned (not a float tensor): nothing to fuse into
            or node.outputs[0] not in self.specs  # float inside an activation chain: nothing to fuse
            or self.graph.is_graph_output(pre)
            or [c.name for c in self.graph.consumers(pre)] != [node.name]
        ):
            return
        post = node.outputs[0]
        # The post-activation range decides the shared qparams; the producer's output
        # only needs to be representable where the activation lets values through.
        self.specs[pre] = (0, act_out)
        self.groups.union(post, pre)
        self.unobserved.add(pre)
        self.fused.append(FusedActivation(node.name, node.op_type, producer.name, pre, post, bounds))

    def finish(self) -> QuantPlan:
        if self.tail_float:
            count = len(self.tail_float)
            self.notes.append(
                f"result tail: {count} tensor{'s' * (count != 1)} after the last layer float (no integer kernel reads them)"
            )
        members: dict[str, list[str]] = {}
        for name in self.order:
            members.setdefault(self.groups.find(name), []).append(name)
        position = {name: i for i, name in enumerate(self.order)}
        groups = []
        for names in members.values():
            best = min(names, key=lambda n: (self.specs[n][0], position[n]))
            spec = self.specs[best][1]
            differing = sorted(n for n in names if self.specs[n][1] != spec)
            if differing:
                self.notes.append(f"tensors {differing} share qparams with {best!r} and use its spec")
            observed = tuple(n for n in names if n not in self.unobserved)
            if not observed:  # e.g. Concat of constants: observe every member instead
                observed = tuple(names)
            groups.append(TensorGroup(names[0], spec, tuple(names), observed))
        by_tensor = {member: group for group in groups for member in group.members}
        derived = self.derived_ranges(by_tensor)
        if derived:
            keys = {d.group for d in derived}
            groups = [attrs.evolve(g, observed=()) if g.key in keys else g for g in groups]
            by_tensor = {member: group for group in groups for member in group.members}
            self.notes.append(
                f"masked attention scores: {len(self.blocks.masked_scores)} on the range of the scores before "
                "the mask (widened below by ln 2**bits of the softmax output), not observed"
            )
        bounds = self.range_bounds(groups, {d.group for d in derived})
        if bounds:
            self.notes.append(f"{len(bounds)} tensors read only by saturating ops: ranges cut at the saturation")
        requants = tuple(
            InputRequant(node, tensor, spec)
            for node, tensor, spec in self.layer_inputs
            if tensor in by_tensor and spec.dtype is not by_tensor[tensor].spec.dtype
        )
        return QuantPlan(
            groups=tuple(groups),
            weights=tuple(self.weights),
            biases=tuple(self.biases),
            fused=tuple(self.fused),
            quantized_nodes=tuple(self.quantized),
            float_nodes=tuple(self.floating),
            notes=tuple(self.notes),
            requants=requants,
            derived=derived,
            bounds=bounds,
        )

    def range_bounds(self, groups: list[TensorGroup], derived: set[str]) -> tuple[RangeBound, ...]:
        """The groups whose every reader saturates (:func:`saturation_interval`): their
        ranges need only span the hull of the readers' intervals."""
        found = []
        for group in groups:
            if group.key in derived:
                continue
            interval = self.readers_interval(group.members)
            if interval is not None and (interval[0] > -math.inf or interval[1] < math.inf):
                found.append(RangeBound(group.key, *interval))
        return tuple(found)

    def readers_interval(self, tensors: tuple[str, ...]) -> tuple[float, float] | None:
        """The hull of the saturation intervals of every reader of ``tensors`` (values
        outside it change no reader's output), or ``None`` when one reader does not
        saturate or a tensor is a graph output or has no reader."""
        lo, hi = math.inf, -math.inf
        for tensor in tensors:
            chain = self.chains.bounds.get(tensor)
            if chain is not None:  # read by an activation chain alone
                lo, hi = min(lo, chain[0]), max(hi, chain[1])
                continue
            readers = self.graph.consumers(tensor)
            if self.graph.is_graph_output(tensor) or not readers:
                return None
            for node in readers:
                interval = saturation_interval(node, self.graph.constant)
                if interval is None:
                    return None
                lo, hi = min(lo, interval[0]), max(hi, interval[1])
        return lo, hi

    def derived_ranges(self, by_tensor: Mapping[str, TensorGroup]) -> tuple[DerivedRange, ...]:
        """The masked attention scores that are quantized (power-of-two formats; float
        elsewhere), and their masks, on ranges derived from the scores before the mask."""
        scores: dict[str, DerivedRange] = {}
        masks: dict[str, list[str]] = {}
        margins: dict[str, float] = {}
        for found in self.blocks.masked_scores:
            target, source = by_tensor.get(found.output), by_tensor.get(found.scores)
            if target is None or source is None or target is source or target.key in scores:
                continue
            margin = _softmax_margin(found, by_tensor, target.spec)
            scores[target.key] = DerivedRange(target.key, (source.key,), margin, masked=False)
            # every tensor holding the fill (a sum of masks adds two, each its own group)
            for tensor in found.mask_tensors:
                mask = by_tensor.get(tensor)
                if mask is not None and mask is not target and mask is not source:
                    masks.setdefault(mask.key, []).append(source.key)
                    margins[mask.key] = max(margins.get(mask.key, 0.0), margin)
        fills = [DerivedRange(key, tuple(dict.fromkeys(src)), margins[key], masked=True) for key, src in masks.items()]
        return tuple(scores.values()) + tuple(d for d in fills if d.group not in scores)


def _softmax_margin(found: MaskedScores, by_tensor: Mapping[str, TensorGroup], fallback: QuantSpec) -> float:
    """``ln(2**bits)`` of the softmax output's format (the masked scores' own where the
    softmax output stays float): below it, a weight rounds to zero."""
    out = by_tensor.get(found.softmax_output)
    return (out.spec if out is not None else fallback).dtype.bits * math.log(2.0)


def plan_quantization(
    graph: GraphView, config: QuantConfig, *, share_concat_scales: bool = True, check_selectors: bool = True
) -> QuantPlan:
    """Plan ``graph`` (not modified; node names unique) under ``config``. See the module
    docstring. ``share_concat_scales=False`` gives Concat's inputs and output their own
    qparams (a runtime's integer Concat then requantizes each input). A config selector
    that selects no node of ``graph`` is refused (:mod:`quant_core.plan.selectors`) unless
    ``check_selectors=False`` (a backend planning one part of a model at a time checks the
    whole model itself)."""
    if check_selectors:
        selectors.check_selectors(config, ((node.name, node.op_type) for node in graph.nodes))
    return _Planner(graph, config, share_concat_scales).run()


def planning_key(config: QuantConfig) -> QuantConfig:
    """``config`` without the fields :func:`plan_quantization` never reads: its algorithms
    (they run before planning, on the float model, or after it, on the written model), its
    calibration settings and its name. Two configs with equal keys give equal plans of the
    same graph, so a caller that plans one model under many configs (a recipe search) may
    plan once per key.

    Example:
        >>> from quant_core.algorithm_config import CLEConfig
        >>> from quant_core.presets import get_preset
        >>> a8w8 = get_preset("a8w8")
        >>> planning_key(a8w8.evolve(algorithms=(CLEConfig(),), name="x")) == planning_key(a8w8)
        True
        >>> planning_key(a8w8) == planning_key(get_preset("xint8"))
        False
    """
    return config.evolve(algorithms=(), calibration=CalibrationConfig(), name=None)
