"""``legalize``'s first phase: the conversions of :mod:`quant_core.conversions` on a
calibrated QDQ model, for the nodes its target cannot run as they are.

The rules are the ones quant-onnx applies before calibration (``QuantConfig.npu_conversions``);
here they run after it, through the same ONNX edits
(:class:`~quant_core.onnx_qdq.conversions.OnnxConversions`) with three
hooks changed for a QDQ graph: a new intermediate tensor gets a QuantizeLinear /
DequantizeLinear pair at a position that covers it (HardSigmoid's output at the device's
minimum, 7; a tensor scaled by 1.702 one position coarser than its source; moved data at
its source's), a new Mul operand is an int8 constant, and a ConvTranspose's weight codes
are moved into the equivalent Conv's layout unchanged. Which nodes a rule applies to:
those whose op the profile does not run (a Sigmoid on ``xint8``), ConvTransposes beyond the
profile's limits, and every HardSigmoid written ``x/6 + 1/2`` (``hard_sigmoid``: the QDQ model
then computes the device's ``2731 / 2**14``). Nodes kept on the CPU are never converted.

With calibration-like data, :func:`conversion_costs` measures what each rule costs: the
output SQNR of the converted QDQ model against the unconverted one, in onnxruntime.

Example:
    >>> import numpy as np
    >>> from onnx import TensorProto, helper, numpy_helper
    >>> from quant_npu.profile import NPUProfile
    >>> inits = [numpy_helper.from_array(np.array(0.125, np.float32), "s"),
    ...          numpy_helper.from_array(np.array(0, np.int8), "z"),
    ...          numpy_helper.from_array(np.array(2.0**-7, np.float32), "s7")]
    >>> nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
    ...          helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
    ...          helper.make_node("Sigmoid", ["xd"], ["g"], name="sig"),
    ...          helper.make_node("QuantizeLinear", ["g", "s7", "z"], ["gq"]),
    ...          helper.make_node("DequantizeLinear", ["gq", "s7", "z"], ["y"])]
    >>> g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
    ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])], inits)
    >>> result = convert_for_target(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), NPUProfile())
    >>> [c.line for c in result.converted]
    ['sig (Sigmoid) -> HardSigmoid [sigmoid]']
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import attrs
import numpy as np
import onnx

from quant_core.conversions import RULES, Match, conv_weight
from quant_core.errors import MissingDependencyError
from quant_core.onnx_qdq.conversions import Converted, OnnxConversions
from quant_core.onnx_qdq.graph import Dim, plan_node, str_attribute
from quant_core.onnx_qdq.reader import DEQUANTIZE, QUANTIZE, QDQGraph
from quant_core.plan.conversions import find_matches
from quant_core.plan.graph import PlanNode
from quant_core.qparams import sqnr_db
from quant_npu.formats import storage
from quant_npu.partitions import CpuSelection, writes_output
from quant_npu.positions import covering_position, initial_position
from quant_npu.profile import NPUProfile
from quant_npu.rewrite import ModelEditor, quantize_real

_ROLE_SHIFT = {"scaled": 1, "moved": 0, "halved": -1}
"""Positions coarser than the source for a new tensor: ``x * 1.702`` or ``x * 2/3`` needs one
more integer bit at most; moved data keeps its source's position; ``x * 0.5`` is the same
codes one position finer (exact)."""


class QDQView:
    """:class:`~quant_core.plan.conversions.ConversionView` of a QDQ model: the compute nodes,
    with every DequantizeLinear output of an integer tensor holding that tensor's value."""

    def __init__(self, qdq: QDQGraph) -> None:
        self.qdq = qdq
        self._nodes = [plan_node(cn.node) for cn in qdq.compute_nodes]

    @property
    def nodes(self) -> Sequence[PlanNode]:
        return self._nodes

    def value(self, name: str) -> str:
        """The integer tensor a name holds (a DequantizeLinear output or a quantized float
        tensor), else the name."""
        return self.qdq.dequantized.get(name) or self.qdq.quantized.get(name) or name

    def readers(self, tensor: str) -> Sequence[PlanNode]:
        key = self.qdq.quantized.get(tensor)
        nodes = self.qdq.readers(key) if key is not None else self.qdq.consumers(tensor)
        return [plan_node(n) for n in nodes if n.op_type not in (QUANTIZE, DEQUANTIZE)]

    def same_value(self, a: str, b: str) -> bool:
        return self.value(a) == self.value(b)

    def constant(self, tensor: str) -> np.ndarray | None:
        key = self.qdq.dequantized.get(tensor)
        if key is not None and self.qdq.tensors[key].is_constant:
            return self.qdq.tensors[key].real_values()
        return self.qdq.constant(tensor)

    def producer(self, tensor: str) -> PlanNode | None:
        key = self.qdq.dequantized.get(tensor)
        source = self.qdq.tensors[key].float_name if key is not None else tensor
        node = self.qdq.producer(source) if source else None
        return None if node is None or node.op_type in (QUANTIZE, DEQUANTIZE) else plan_node(node)

    def rank(self, tensor: str) -> int | None:
        key = self.qdq.dequantized.get(tensor)
        source = self.qdq.tensors[key].float_name if key is not None else None
        for name in (tensor, source):  # a DequantizeLinear output has the shape its source has
            shape = self.qdq.index.shape(name) if name else None
            if shape is not None:
                return len(shape)
        return None


class QDQConversions(OnnxConversions):
    """The ONNX edits with the QDQ hooks (see the module docstring)."""

    def __init__(
        self, model: onnx.ModelProto, qdq: QDQGraph, editor: ModelEditor, profile: NPUProfile, rules: Iterable[str] = ()
    ) -> None:
        super().__init__(model, rules)
        self.index = editor.names  # one name table: the editor's and the edits' names never clash
        self.qdq = qdq
        self.editor = editor
        self.profile = profile
        self.formats: dict[str, tuple[int, int, int]] = {}  # new tensor -> (position, elem type, zero point)

    def format_of(self, name: str) -> tuple[int, int, int]:
        """Position and storage of what ``name`` holds: an integer tensor of the model or a
        tensor an earlier edit made."""
        if name in self.formats:
            return self.formats[name]
        key = self.qdq.dequantized.get(name) or self.qdq.quantized.get(name) or name
        tensor = self.qdq.tensors[key]
        return (initial_position(tensor, self.profile), *storage(tensor, self.profile))

    def edge(self, tensor: str, source: str, role: str) -> str:
        position, elem_type, zero_point = self.format_of(source)
        if role == "hard_sigmoid":
            position = self.profile.hard_sigmoid_output_min
        elif role == "tanh":  # (-1, 1) on every code of the signed activation
            position = self.profile.activation_bits - 1
        else:
            position -= _ROLE_SHIFT[role]
        output = self.editor.quantize_tensor(tensor, position, zero_point, elem_type)
        self.formats[tensor] = self.formats[output] = (position, elem_type, zero_point)
        return output

    def operand(self, prefix: str, value: float) -> str:
        position = covering_position(min(value, 0.0), max(value, 0.0))
        codes, _clipped = quantize_real(np.asarray(value), position, -128, 127, self.profile.weight_rounding)
        params = self.editor.qparams(prefix, position, 0, onnx.TensorProto.INT8)
        return self.editor.dequantized_constant(prefix, codes.astype(np.int8), params)

    def weight_shape(self, node: onnx.NodeProto) -> list[int] | None:
        return weight_shape(self.qdq, node)

    def shape(self, tensor: str) -> list[Dim] | None:
        """A DequantizeLinear output has its integer tensor's shape, known on the float
        tensor its QuantizeLinear reads."""
        known = self.index.shape(tensor)
        key = self.qdq.dequantized.get(tensor)
        source = self.qdq.tensors[key].float_name if key is not None else None
        return known if known is not None or source is None else self.index.shape(source)

    def conv_weight(self, node: onnx.NodeProto, group: int) -> str | None:
        key = self.qdq.dequantized.get(node.input[1])
        tensor = self.qdq.tensors.get(key) if key else None
        if tensor is None or tensor.codes is None or key is None:
            return None
        per_channel = tensor.axis is not None and np.asarray(tensor.scale).size > 1
        if per_channel and group != 1:
            self.notes.append(f"node {node.name!r} (ConvTranspose): grouped per-channel weight; left as it is")
            return None
        dq = self.qdq.dequantizers[key][0]
        zero_point = dq.input[2] if len(dq.input) > 2 and dq.input[2] else None
        if zero_point is None:
            zero_point = self.constant(
                f"{key}_zero_point", np.zeros(np.asarray(tensor.scale).shape, tensor.codes.dtype)
            )
        codes = conv_weight(tensor.codes, group)
        return self.editor.dequantized_constant(
            f"{key}_conv", codes, (dq.input[1], zero_point), 0 if per_channel else None
        )


@attrs.frozen(eq=False)
class ConversionResult:
    """The converted model (sorted, unused tensors dropped), what was converted, notes."""

    model: onnx.ModelProto
    converted: tuple[Converted, ...]
    notes: tuple[str, ...] = ()

    def counts(self) -> dict[str, int]:
        found: dict[str, int] = {}
        for item in self.converted:
            found[item.rule] = found.get(item.rule, 0) + 1
        return found


def weight_shape(qdq: QDQGraph, node: onnx.NodeProto) -> list[int] | None:
    """The shape of a weighted node's integer weight (input 1), or None."""
    key = qdq.dequantized.get(node.input[1]) if len(node.input) > 1 else None
    tensor = qdq.tensors.get(key) if key else None
    return None if tensor is None or tensor.codes is None else list(tensor.codes.shape)


def conv_transpose_issues(node: onnx.NodeProto, weight_shape: Sequence[int], profile: NPUProfile) -> list[str]:
    """What keeps a ConvTranspose from the profile's engine: kernel, stride, the device's
    own padding ``dilation * (kernel - 1) - pad`` (and ``+ output_padding`` at the end)
    in ``[conv_transpose_pad_min, kernel - 1]``.

    Example:
        >>> from onnx import helper
        >>> node = helper.make_node("ConvTranspose", ["x", "w"], ["y"], strides=[2, 2], pads=[2, 2, 2, 2])
        >>> conv_transpose_issues(node, (4, 4, 3, 3), NPUProfile())
        ['padding 2 leaves the device padding 0; allowed: [1, 2]']
    """
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    kernel = [int(k) for k in weight_shape[2:]]
    strides = [int(s) for s in attributes.get("strides", [1] * len(kernel))]
    dilations = [int(d) for d in attributes.get("dilations", [1] * len(kernel))]
    pads = [int(p) for p in attributes.get("pads", [0] * 2 * len(kernel))]
    extra = [int(p) for p in attributes.get("output_padding", [0] * len(kernel))]
    if str_attribute(node, "auto_pad", "NOTSET") != "NOTSET":
        return ["auto_pad; allowed: explicit pads"]
    if "output_shape" in attributes:  # ONNX then derives the pads and ignores ``pads``
        return ["output_shape; allowed: explicit pads"]
    issues = []
    for what, values, allowed in (
        ("kernel", kernel, profile.conv_transpose_kernel_range),
        ("stride", strides, profile.conv_transpose_stride_range),
    ):
        if values and not (allowed[0] <= min(values) and max(values) <= allowed[1]):
            issues.append(f"{what} {values}; allowed: {list(allowed)}")
    low = profile.conv_transpose_pad_min
    for axis, k in enumerate(kernel):
        reach = dilations[axis] * (k - 1)
        end = axis + len(kernel)
        for pad, device in ((pads[axis], reach - pads[axis]), (pads[end], reach - pads[end] + extra[axis])):
            if not low <= device <= k - 1:
                issues.append(f"padding {pad} leaves the device padding {device}; allowed: [{low}, {k - 1}]")
                return issues
    return issues


def _applies(
    match: Match, nodes: Mapping[str, onnx.NodeProto], qdq: QDQGraph, profile: NPUProfile, cpu: CpuSelection
) -> bool:
    node = nodes[match.node]
    if cpu.selects(node.name, node.op_type, writes_output(qdq, node)):
        return False
    if RULES[match.rule].device_form:
        return True  # the device's own arithmetic for an op it runs (HardSigmoid's constants...)
    if not set(RULES[match.rule].produces) <= profile.accepted_ops:
        return False  # the result would not run either
    if match.rule == "conv_transpose" and "ConvTranspose" in profile.ops:
        shape = weight_shape(qdq, node)
        return shape is not None and bool(conv_transpose_issues(node, shape, profile))
    return node.op_type not in profile.accepted_ops


def applicable_matches(
    qdq: QDQGraph, profile: NPUProfile, cpu: CpuSelection, rules: Iterable[str] | None = None
) -> list[Match]:
    """The matches of the profile's conversions (or ``rules``) that apply to ``qdq``'s nodes."""
    names = profile.conversions if rules is None else tuple(rules)
    nodes = {cn.name: cn.node for cn in qdq.compute_nodes}
    return [m for m in find_matches(QDQView(qdq), names) if _applies(m, nodes, qdq, profile, cpu)]


def convert_for_target(
    model: onnx.ModelProto,
    profile: NPUProfile,
    cpu: CpuSelection | None = None,
    rules: Iterable[str] | None = None,
) -> ConversionResult:
    """The profile's conversions (or ``rules``) applied to a copy of a QDQ ``model`` where
    its target needs them (see the module docstring and example)."""
    work = onnx.ModelProto()
    work.CopyFrom(model)
    qdq = QDQGraph(work)
    matches = applicable_matches(qdq, profile, cpu or CpuSelection(), rules)
    if not matches:
        return ConversionResult(model, ())
    editor = ModelEditor(work)
    # the profile's rules are in force for what a conversion makes (a ReduceMean's pool is split
    # when the profile splits pools), also when ``rules`` picks which matches to apply
    converter = QDQConversions(work, qdq, editor, profile, profile.conversions)
    for match in matches:
        converter.apply(match)
    drop_stranded_qdq(work.graph)
    finished = editor.finish()
    return ConversionResult(finished, tuple(converter.done), tuple(converter.notes))


def drop_stranded_qdq(graph: onnx.GraphProto) -> None:
    """Remove QuantizeLinear/DequantizeLinear nodes a replaced pattern stranded: those
    reading a tensor nothing produces any more, and those nothing reads."""
    while True:
        available = {i.name for i in graph.input} | {t.name for t in graph.initializer}
        available |= {o for n in graph.node for o in n.output}
        read = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
        stranded = [
            n
            for n in graph.node
            if n.op_type in (QUANTIZE, DEQUANTIZE) and (n.input[0] not in available or not read & set(n.output))
        ]
        if not stranded:
            return
        gone = {id(n) for n in stranded}
        kept = [n for n in graph.node if id(n) not in gone]
        del graph.node[:]
        graph.node.extend(kept)


def _outputs(model: onnx.ModelProto, data: np.ndarray | Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """``model``'s outputs on ``data`` in onnxruntime, without graph optimizations (the QDQ
    arithmetic as written). onnxruntime is no dependency of quant-npu-export: only measuring
    costs needs it."""
    try:
        import onnxruntime as ort
    except ImportError as error:
        raise MissingDependencyError(
            "legalize: measuring conversion costs (data=, --data) runs the model in onnxruntime: "
            "pip install 'quant-npu-export[costs]'"
        ) from error
    from quant_core.onnx_qdq.tensor_data import bound_folders, inline_external_data

    if bound_folders(model):
        model = inline_external_data(model)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 4
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    feeds = dict(data) if isinstance(data, Mapping) else {names[0]: np.asarray(data, np.float32)}
    return [np.asarray(o, np.float64) for o in session.run(None, {n: feeds[n] for n in names})]


def output_sqnr(reference: Sequence[np.ndarray], approx: Sequence[np.ndarray]) -> float:
    """The lowest output SQNR (dB) over a model's outputs."""
    return min(sqnr_db(r, a) for r, a in zip(reference, approx, strict=True))


def conversion_costs(
    model: onnx.ModelProto,
    profile: NPUProfile,
    data: np.ndarray | Mapping[str, np.ndarray],
    cpu: CpuSelection | None = None,
) -> dict[str, float]:
    """Per rule the profile applies to ``model`` (and ``"all"``), the output SQNR (dB) of the
    QDQ model with that conversion against the model without it, in onnxruntime on ``data``."""
    reference = _outputs(model, data)
    everything = convert_for_target(model, profile, cpu)
    costs: dict[str, float] = {}
    for rule in everything.counts():
        alone = convert_for_target(model, profile, cpu, rules=(rule,))
        costs[rule] = output_sqnr(reference, _outputs(alone.model, data))
    if costs:
        costs["all"] = output_sqnr(reference, _outputs(everything.model, data))
    return costs
