"""Decide which tensor gets which :class:`~quant_core.spec.QuantSpec`.

Applies the :mod:`policy` table and the user's :class:`~quant_core.config.QuantConfig`
to a (pre-processed) float model and returns an :class:`Annotation`:

- activation tensors grouped into :class:`TensorGroup` s that share one set of qparams
  (a pass-through op's output joins its input's group, Concat's inputs and output form
  one group, a Conv/Gemm/MatMul/Add output fused with its sole-consumer Relu/Clip joins
  the activation output's group); each group lists the tensors calibration must observe;
- weight and bias slots of Conv/ConvTranspose/Gemm/MatMul with the weight's channel axis
  resolved per op;
- every node left in float, with the reason.

Nothing is computed from data here: calibration (:mod:`calibrate`) turns each group's
observations into qparams.

Example:
    >>> import numpy as np, onnx
    >>> from onnx import helper, numpy_helper, TensorProto
    >>> from quant_core.presets import get_preset
    >>> w = numpy_helper.from_array(np.ones((4, 3, 1, 1), np.float32), "w")
    >>> g = helper.make_graph(
    ...     [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"), helper.make_node("Relu", ["c"], ["y"], name="relu")],
    ...     "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
    ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    >>> ann = annotate(helper.make_model(g), get_preset("a8w8"))
    >>> [(grp.members, grp.observed) for grp in ann.groups]
    [(('x',), ('x',)), (('c', 'y'), ('y',))]
    >>> ann.weights[0].spec.per_channel_axis, [f.node for f in ann.fused]
    (0, ['relu'])
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import onnx
from onnx import TensorProto

from quant_core.config import OperatorConfig, QuantConfig
from quant_core.spec import QuantSpec
from quant_onnx.graph import GraphIndex
from quant_onnx.policy import (
    FUSABLE_PRODUCERS,
    OpKind,
    clip_bounds,
    int_attribute,
    policy_for,
    weight_channel_axis,
)


@attrs.frozen
class TensorGroup:
    """Activation tensors that share one scale and zero point.

    ``observed`` are the members whose values calibration must see (the others lie
    inside their range by construction: pass-through outputs, Concat's output, the
    pre-activation tensor of a fused Relu/Clip).

    Example:
        >>> from quant_core.spec import QuantSpec
        >>> TensorGroup("x", QuantSpec(dtype="uint8", symmetric=False), ("x", "y"), ("x",)).key
        'x'
    """

    key: str
    spec: QuantSpec
    members: tuple[str, ...]
    observed: tuple[str, ...]


@attrs.frozen
class WeightSlot:
    """A Conv/ConvTranspose/Gemm/MatMul weight to store as integers behind a DequantizeLinear.

    ``spec.per_channel_axis`` is already the op's output-channel axis (or ``None``).

    Example:
        >>> from quant_core.spec import QuantSpec
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
    """A bias stored as int32 at ``scale(input) * scale(weight)`` (``spec`` ``None`` or
    int32), as another integer format with its own qparams, or kept float (a float spec).

    Example:
        >>> BiasSlot("conv", "b", 2, "x", "w", None).input_tensor
        'x'
    """

    node: str
    tensor: str
    input_index: int
    input_tensor: str
    weight_tensor: str
    spec: QuantSpec | None


@attrs.frozen
class FusedActivation:
    """A Relu/Clip fused into its producer: the producer's output ``pre_tensor`` shares
    ``post_tensor``'s qparams; the writer drops the activation node when the quantizer's
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
class Annotation:
    """Everything the calibrator and the writer need to know about a model, per tensor.

    Example:
        >>> Annotation(groups=(), weights=(), biases=(), fused=(), quantized_nodes=(), float_nodes=()).group_of("x") is None
        True
    """

    groups: tuple[TensorGroup, ...]
    weights: tuple[WeightSlot, ...]
    biases: tuple[BiasSlot, ...]
    fused: tuple[FusedActivation, ...]
    quantized_nodes: tuple[tuple[str, str], ...]
    float_nodes: tuple[FloatNode, ...]
    notes: tuple[str, ...] = ()
    _by_tensor: Mapping[str, TensorGroup] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        index = {member: group for group in self.groups for member in group.members}
        object.__setattr__(self, "_by_tensor", index)

    def group_of(self, tensor: str) -> TensorGroup | None:
        """The group ``tensor`` belongs to, or ``None`` when it stays float."""
        return self._by_tensor.get(tensor)

    @property
    def observed_tensors(self) -> tuple[str, ...]:
        """Every tensor calibration must observe, in a deterministic order."""
        return tuple(name for group in self.groups for name in group.observed)


def is_float_tensor(index: GraphIndex, tensor: str) -> bool:
    """True for float32 tensors and tensors of unknown type: shape and index tensors are
    integers and are never quantized."""
    return (index.elem_type(tensor) or TensorProto.FLOAT) == TensorProto.FLOAT


def typed_index(model: onnx.ModelProto) -> GraphIndex:
    """A :class:`GraphIndex` whose tensors carry element types: the model's own when every
    node output has one (pre-processing ran shape inference), else an inferred copy's."""
    index = GraphIndex(model.graph)
    if all(index.elem_type(out) for node in model.graph.node for out in node.output if out):
        return index
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # inference is advisory: unknown types count as float
        return index
    return GraphIndex(inferred.graph)


def ensure_node_names(model: onnx.ModelProto) -> None:
    """Give every unnamed node a unique, deterministic name (in place; used on the
    quantizer's own copy) so that name globs and reports can refer to it."""
    taken = {node.name for node in model.graph.node if node.name}
    for index, node in enumerate(model.graph.node):
        if not node.name:
            candidate = f"{node.op_type}_{index}"
            while candidate in taken:
                candidate += "_"
            node.name = candidate
            taken.add(candidate)


def _activation_spec(spec: QuantSpec | None, node: onnx.NodeProto, field: str) -> QuantSpec | None:
    if spec is None or not spec.is_quantized:
        return None
    if spec.per_channel_axis is not None:
        raise ValueError(
            f"node {node.name!r} ({node.op_type}): {field}.per_channel_axis: {spec.per_channel_axis} is not "
            "allowed for activations; allowed: null (per tensor)"
        )
    if spec.dynamic:
        raise ValueError(
            f"node {node.name!r} ({node.op_type}): {field}.dynamic: true needs dynamic quantization "
            "(quant_onnx.dynamic / --dynamic); static quantization allows: false"
        )
    return spec


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


class _Annotator:
    def __init__(self, model: onnx.ModelProto, config: QuantConfig, share_concat_scales: bool) -> None:
        self.view = typed_index(model)
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

    def request(self, tensor: str, spec: QuantSpec, priority: int) -> None:
        self.groups.add(tensor)
        if tensor not in self.specs:
            self.order.append(tensor)
        current = self.specs.get(tensor)
        if current is None or priority < current[0]:
            self.specs[tensor] = (priority, spec)

    def data_inputs(self, node: onnx.NodeProto, indices: tuple[int, ...] | None) -> list[str]:
        chosen = range(len(node.input)) if indices is None else indices
        names = [node.input[i] for i in chosen if i < len(node.input) and node.input[i]]
        return [name for name in dict.fromkeys(names) if is_float_tensor(self.view, name)]

    def run(self) -> Annotation:
        for node in self.view.graph.node:
            if self.visit(node):
                self.quantized.append((node.name, node.op_type))
                self.quantized_names.add(node.name)
        return self.finish()

    def visit(self, node: onnx.NodeProto) -> bool:
        if node.op_type == "Constant":
            return False
        rule = policy_for(node, self.view.constant)
        if rule is None:
            self.floating.append(FloatNode(node.name, node.op_type, "no quantization policy for this op type"))
            return False
        cfg: OperatorConfig | None = self.config.for_node(node.name, node.op_type)
        if cfg is None:
            self.floating.append(FloatNode(node.name, node.op_type, "excluded by the config"))
            return False
        act_in = _activation_spec(cfg.input, node, "input")
        act_out = _activation_spec(cfg.output, node, "output")
        inputs = self.data_inputs(node, rule.data_inputs)
        outputs = [
            o for o in node.output[: 1 if node.op_type == "MaxPool" else None] if o and is_float_tensor(self.view, o)
        ]
        if rule.kind is OpKind.WEIGHTED:
            inputs += self.weighted(node, rule.weight_input, rule.bias_input, cfg, act_in)
        if act_in is None and act_out is None and not any(w.node == node.name for w in self.weights):
            self.floating.append(FloatNode(node.name, node.op_type, "the config quantizes none of its tensors"))
            return False
        if act_in is not None:
            for name in inputs:
                self.request(name, act_in, priority=1)
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

    def weighted(
        self,
        node: onnx.NodeProto,
        weight_index: int | None,
        bias_index: int | None,
        cfg: OperatorConfig,
        act_in: QuantSpec | None,
    ) -> list[str]:
        """Record weight and bias slots; returns non-constant weights, quantized as activations."""
        assert weight_index is not None
        if len(node.input) <= weight_index or not node.input[weight_index]:
            return []
        weight = node.input[weight_index]
        value = self.view.constant(weight)
        if value is None or not is_float_tensor(self.view, weight):
            return [weight] if is_float_tensor(self.view, weight) else []
        if cfg.weight is None or not cfg.weight.is_quantized:
            return []
        spec = cfg.weight
        if spec.per_channel_axis is not None:
            axis: int | None = weight_channel_axis(node, value.ndim)
            group = int_attribute(node, "group", 1)
            if node.op_type == "ConvTranspose" and group != 1:
                # [Cin, Cout/g, kh, kw]: axis 1 does not index the Cout output channels.
                self.notes.append(f"node {node.name!r}: grouped ConvTranspose weight quantized per tensor")
                axis = None
            spec = spec.evolve(per_channel_axis=axis)
        self.weights.append(WeightSlot(node.name, node.op_type, weight, weight_index, spec))
        if bias_index is not None and len(node.input) > bias_index and node.input[bias_index]:
            bias = node.input[bias_index]
            if self.view.constant(bias) is not None and act_in is not None and node.input[0]:
                self.biases.append(BiasSlot(node.name, bias, bias_index, node.input[0], weight, cfg.bias))
            else:
                self.notes.append(f"node {node.name!r}: bias {bias!r} kept float (not a constant or input float)")
        return []

    def pass_through(self, inputs: list[str], outputs: list[str]) -> None:
        if not inputs or inputs[0] not in self.specs:
            return
        for name in outputs:
            self.groups.add(name)
            self.groups.union(inputs[0], name)
            self.unobserved.add(name)
            self.request(name, self.specs[inputs[0]][1], priority=2)

    def concat(self, inputs: list[str], outputs: list[str], spec: QuantSpec | None) -> None:
        if spec is None:
            return
        for name in inputs:
            self.request(name, spec, priority=1)
        for name in outputs:
            self.request(name, spec, priority=0)
            self.unobserved.add(name)
            for other in inputs:
                self.groups.union(other, name)

    def try_fuse(self, node: onnx.NodeProto, act_out: QuantSpec) -> None:
        pre = node.input[0]
        producer = self.view.producer(pre)
        bounds = clip_bounds(node, self.view.constant)
        if (
            producer is None
            or bounds is None
            or producer.op_type not in FUSABLE_PRODUCERS
            or producer.name not in self.quantized_names
            or self.view.is_graph_output(pre)
            or [c.name for c in self.view.consumers(pre)] != [node.name]
        ):
            return
        post = node.output[0]
        # The post-activation range decides the shared qparams; the producer's output
        # only needs to be representable where the activation lets values through.
        self.specs[pre] = (0, act_out)
        self.groups.union(post, pre)
        self.unobserved.add(pre)
        self.fused.append(FusedActivation(node.name, node.op_type, producer.name, pre, post, bounds))

    def finish(self) -> Annotation:
        members: dict[str, list[str]] = {}
        for name in self.order:
            members.setdefault(self.groups.find(name), []).append(name)
        groups = []
        for names in members.values():
            best = min(names, key=lambda n: (self.specs[n][0], self.order.index(n)))
            spec = self.specs[best][1]
            differing = sorted(n for n in names if self.specs[n][1] != spec)
            if differing:
                self.notes.append(f"tensors {differing} share qparams with {best!r} and use its spec")
            observed = tuple(n for n in names if n not in self.unobserved)
            if not observed:  # e.g. Concat of constants: observe every member instead
                observed = tuple(names)
            groups.append(TensorGroup(names[0], spec, tuple(names), observed))
        return Annotation(
            groups=tuple(groups),
            weights=tuple(self.weights),
            biases=tuple(self.biases),
            fused=tuple(self.fused),
            quantized_nodes=tuple(self.quantized),
            float_nodes=tuple(self.floating),
            notes=tuple(self.notes),
        )


def annotate(model: onnx.ModelProto, config: QuantConfig, *, share_concat_scales: bool = True) -> Annotation:
    """Annotate ``model`` (not modified; its nodes must be named, see
    :func:`ensure_node_names`) under ``config``. See the module docstring.

    ``share_concat_scales=False`` gives Concat's inputs and output their own qparams
    (onnxruntime's QLinearConcat then requantizes each input)."""
    return _Annotator(model, config, share_concat_scales).run()
