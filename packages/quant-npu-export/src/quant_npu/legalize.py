"""``legalize``: a QDQ model changed so that it meets the profile, where that is possible.

What it fixes: activation formats (symmetric, power-of-two, 8-bit; uint8 at zero point
128 kept where the profile accepts it), shared positions (the group's minimum), the
Add/Sub/Mul/HardSigmoid shift rules (output or input positions moved), shift_cut (weight
position moved), weight format (per-tensor int8 in ``[weight_qmin, 127]``), bias format
and shift_bias (bias requantized), LeakyRelu alpha (set to the device's value), and QDQ
pairs between an op and a fused LeakyRelu (removed, so the CPU model rounds once like the
device). What it cannot fix (unsupported ops, float islands, engine limits) stays, and
``remaining`` lists it. The input model is never modified.

Example:
    >>> import numpy as np
    >>> from onnx import TensorProto, helper, numpy_helper
    >>> inits = [numpy_helper.from_array(np.array(0.3, np.float32), "s"),
    ...          numpy_helper.from_array(np.array(128, np.uint8), "z")]
    >>> nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q"),
    ...          helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq"),
    ...          helper.make_node("Relu", ["xd"], ["r"], name="relu"),
    ...          helper.make_node("QuantizeLinear", ["r", "s", "z"], ["rq"], name="q2"),
    ...          helper.make_node("DequantizeLinear", ["rq", "s", "z"], ["y"], name="dq2")]
    >>> g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
    ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])], inits)
    >>> result = legalize_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]))
    >>> result.remaining.ok, [c.line for c in result.changes][:1]
    (True, ['activation xq: uint8 scale 0.3 -> uint8@1 (power-of-two symmetric int8 format)'])
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import onnx

from quant_core.onnx_qdq.graph import float_attribute, node_label
from quant_core.onnx_qdq.reader import QDQGraph, QuantTensor
from quant_core.serialization import report_json
from quant_npu.approximations import device_leaky_relu_alpha
from quant_npu.check import CheckResult, check_loaded
from quant_npu.conversions import conversion_costs, convert_for_target
from quant_npu.formats import activation_issues, storage
from quant_npu.parameters import ParameterLegalizer, legalize_operand
from quant_npu.partitions import CpuSelection, deployment_selection, float_result_tail, writes_output
from quant_npu.plan import COMMUTING_ACTIVATIONS, WEIGHTED_OPS, Step, plan
from quant_npu.positions import PositionSolver, covering_position, representable_range
from quant_npu.profile import NPUProfile, load_profile
from quant_npu.rewrite import quantize_real

ModelSource = str | os.PathLike[str] | onnx.ModelProto


@attrs.frozen
class Change:
    """One edit ``legalize`` made.

    Example:
        >>> Change("bias", "conv1", "int32@12", "int8@6", "bias format").line
        'bias conv1: int32@12 -> int8@6 (bias format)'
    """

    kind: str
    target: str
    before: str
    after: str
    reason: str

    @property
    def line(self) -> str:
        return f"{self.kind} {self.target}: {self.before} -> {self.after} ({self.reason})"

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen(eq=False)
class LegalizeResult:
    """The legalised model, what changed, and what still breaks a rule (see the module
    example: ``result.remaining.ok``, ``result.changes``)."""

    model: onnx.ModelProto
    changes: tuple[Change, ...]
    remaining: CheckResult
    notes: tuple[str, ...] = ()
    costs: Mapping[str, float] = attrs.field(factory=dict)
    """Per conversion rule (and ``"all"``): output SQNR (dB) of the converted QDQ model
    against the unconverted one on the data ``legalize`` was given; empty without data."""

    def to_dict(self) -> dict[str, Any]:
        kinds: dict[str, int] = {}
        for change in self.changes:
            kinds[change.kind] = kinds.get(change.kind, 0) + 1
        return {
            "target": self.remaining.target,
            "ok": self.remaining.ok,
            "changes_by_kind": kinds,
            "changes": [c.to_dict() for c in self.changes],
            "conversion_sqnr_db": {k: _json_number(v) for k, v in self.costs.items()},
            "partitions": [p.to_dict() for p in self.remaining.partitions],
            "remaining": self.remaining.to_dict(),
            "notes": list(self.notes),
        }

    def format_text(self) -> str:
        lines = [c.line for c in self.changes] + [f"note: {n}" for n in self.notes]
        for rule, value in self.costs.items():
            what = "every conversion" if rule == "all" else f"conversion {rule}"
            lines.append(f"cost: {what}: output SQNR {value:.1f} dB against the unconverted model")
        lines.append(f"{len(self.changes)} change(s)")
        if self.remaining.ok:
            lines.extend(p.line for p in self.remaining.partitions)
            tail = f" ({len(self.remaining.partitions)} CPU partition(s))" if self.remaining.partitions else ""
            lines.append(f"ok: the legalised model meets every rule of target '{self.remaining.target}'{tail}")
        else:
            lines.append("not fixed:")
            lines.append(self.remaining.format_text())
        return "\n".join(lines)


class _Legalizer:
    def __init__(self, model: onnx.ModelProto, profile: NPUProfile) -> None:
        from quant_npu.rewrite import ModelEditor

        self.model = model
        self.profile = profile
        self.qdq = QDQGraph(model)
        self.steps = plan(self.qdq, profile)
        self.editor = ModelEditor(model)
        self.changes: list[Change] = []
        self.notes: list[str] = []

    def run(self) -> None:
        self.leaky_relu_alphas()
        solver = PositionSolver(self.qdq, self.steps, self.profile)
        moved = {c.key: c for c in solver.solve()}
        self.notes.extend(solver.notes)
        for key in solver.keys:
            tensor = self.qdq.tensors[key]
            position = solver.pos[key]
            if tensor.is_constant:
                if key in moved or activation_issues(tensor, self.profile):
                    before = legalize_operand(self.qdq, self.editor, key, position, self.profile)
                    reason = moved[key].reason if key in moved else "device format"
                    self.changes.append(Change("constant", key, before, f"int8@{position}", reason))
                continue
            elem_type, zero_point = storage(tensor, self.profile)
            exact = tensor.position == position and tensor.elem_type == elem_type and tensor.is_symmetric
            if exact and not activation_issues(tensor, self.profile):
                continue
            if not tensor.is_symmetric:
                self.keep_clamp(key, tensor)
            self.editor.set_activation(self.qdq, key, position, zero_point, elem_type)
            after = f"{np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type)).name}@{position}"
            reason = moved[key].reason if key in moved else "device format"
            self.changes.append(Change("activation", key, tensor.describe(), after, reason))
        parameters = ParameterLegalizer(self.qdq, self.profile, self.editor, solver.pos)
        for step in self.steps:
            if step.op_type in WEIGHTED_OPS:
                parameters.legalize(step)
            elif step.op_type == "PRelu":
                self.prelu_slope(step)
        self.changes.extend(Change(c.kind, c.target, c.before, c.after, c.reason) for c in parameters.changes)
        self.notes.extend(parameters.notes)
        self.unfuse_quantization()

    def keep_clamp(self, key: str, tensor: QuantTensor) -> None:
        """An asymmetric tensor that holds no negative values clamps at 0 (and at its top) by
        saturation alone: a writer drops a Relu/Clip(0, 6) it reproduces that way. Made
        symmetric, the tensor would hold negative values, so the clamp comes back as an op
        fused into the producer."""
        lo, hi = representable_range(tensor)
        producer = self.qdq.producer(tensor.float_name) if tensor.float_name else None
        if lo < 0 or producer is None:
            return
        fusable = self.profile.fusions.get(producer.op_type, frozenset())
        if "Clip" in fusable:
            op = self.editor.insert_clamp(self.qdq, key, lo, hi)
        elif "Relu" in fusable and lo == 0:
            op = self.editor.insert_clamp(self.qdq, key, 0.0, None)
        else:
            return
        self.changes.append(Change("clamp", key, "saturation", op, "an asymmetric quantizer clamped there"))

    def prelu_slope(self, step: Step) -> None:
        """A float PRelu slope becomes int8 codes (the DPU's ``prelu_in`` codes, checked as a
        weight: from ``weight_qmin``) at the finest position covering it: the planner leaves
        slopes float, and each is one channel's multiplier, not an outlier among many (the
        nearest power would cut whole channels' slopes by up to 29%); a quantized slope is
        positioned like any constant operand."""
        slope = self.qdq.constant(step.node.input[1]) if len(step.node.input) > 1 else None
        if slope is None or (len(step.data_inputs) > 1 and step.data_inputs[1] is not None):
            return
        real = np.asarray(slope, np.float64)
        position = covering_position(float(real.min(initial=0.0)), float(real.max(initial=0.0)))
        codes, clipped = quantize_real(real, position, self.profile.weight_qmin, 127, self.profile.weight_rounding)
        self.editor.quantize_input(step.node, 1, codes.astype(np.int8), position)
        reason = "PRelu slope format" + (f"; {clipped} code(s) saturated" if clipped else "")
        self.changes.append(Change("constant", step.name, "float slope", f"int8@{position}", reason))

    def leaky_relu_alphas(self) -> None:
        for step in self.steps:
            for node in step.nodes:
                if node.op_type != "LeakyRelu":
                    continue
                alpha = float_attribute(node, "alpha", 0.01)
                device = device_leaky_relu_alpha(alpha, self.profile)
                if device == float(np.float32(alpha)):
                    continue
                kept = [a for a in node.attribute if a.name != "alpha"]
                del node.attribute[:]
                node.attribute.extend([*kept, onnx.helper.make_attribute("alpha", device)])
                self.changes.append(
                    Change("leaky_relu_alpha", node_label(node), f"{alpha:.8g}", f"{device}", "the device's alpha")
                )

    def unfuse_quantization(self) -> None:
        """Drop the QDQ pair between an op and a fused activation that does not commute
        with rounding (LeakyRelu): the device never rounds there."""
        for step in self.steps:
            if step.skipped is None or step.activation is None:
                continue
            if step.activation.op_type in COMMUTING_ACTIVATIONS:
                continue
            self.editor.remove_pair(self.qdq, step.skipped)
            self.changes.append(
                Change("fused_qdq", step.skipped, "quantized", "removed", f"fused into {step.op_type} {step.name!r}")
            )


def decouple_hard_sigmoids(
    model: onnx.ModelProto, profile: NPUProfile, cpu: CpuSelection | None = None
) -> tuple[onnx.ModelProto, list[Change]]:
    """A HardSigmoid's output must sit at position >= ``hard_sigmoid_output_min`` (the
    device clamps at 1 by saturating there), but a Concat, pool or layout op reading it
    shares one position with its other inputs (a detector's ``concat([boxes, sigmoid(cls)])``
    would push the boxes to 2**-7 and saturate them). Such a reader gets the value through a
    Relu of its own (exact on a hardsigmoid's non-negative output), which requantizes it to
    the group's position. A reader that shares nothing is left alone: one whose output is
    not quantized (the planner keeps a Concat that only writes graph outputs in float) or
    one ``cpu`` keeps on the CPU."""
    from quant_npu.rewrite import ModelEditor

    qdq = QDQGraph(model)
    selection = cpu or CpuSelection()
    shared = profile.shared_position_ops | profile.layout_ops | {"Resize"}
    quantized_output = {id(cn.node) for cn in qdq.compute_nodes if cn.output is not None}

    def shares_position(reader: onnx.NodeProto) -> bool:
        on_cpu = selection.selects(reader.name, reader.op_type, writes_output(qdq, reader))
        return reader.op_type in shared and id(reader) in quantized_output and not on_cpu

    found = []
    for cn in qdq.compute_nodes:
        if cn.op_type != "HardSigmoid" or cn.output is None:
            continue
        readers = [r for r in qdq.readers(cn.output) if shares_position(r)]
        if readers:
            found.append((cn, readers))
    if not found:
        return model, []
    editor = ModelEditor(model)
    changes = []
    for cn, readers in found:
        assert cn.output is not None
        tensor = qdq.tensors[cn.output]
        elem_type, zero_point = storage(tensor, profile)
        dq = qdq.dequantizers[cn.output][0]
        relu_out = editor.names.unique_name(f"{cn.node.output[0]}_requantized")
        relu_name = editor.names.unique_name(f"{cn.name}_requantize")
        editor.graph.node.append(onnx.helper.make_node("Relu", [dq.output[0]], [relu_out], name=relu_name))
        read = editor.quantize_tensor(relu_out, profile.hard_sigmoid_output_min, zero_point, elem_type)
        sources = {d.output[0] for d in qdq.dequantizers[cn.output]}
        for reader in readers:
            for i, name in enumerate(reader.input):
                if name in sources:
                    reader.input[i] = read
            changes.append(
                Change("requantize", cn.name, "shared position", relu_name, f"HardSigmoid read by {reader.op_type}")
            )
    return editor.finish(), changes


def _json_number(value: float) -> float | str:
    return value if np.isfinite(value) else str(value)


def _check_data(model: onnx.ModelProto, data: np.ndarray | Mapping[str, np.ndarray]) -> None:
    """The simulator's checks of ``data`` against ``model``'s inputs (a DataError naming the input)."""
    from quant_core.onnx_qdq.graph import GraphIndex
    from quant_npu.sim.runner import model_feeds

    index = GraphIndex(model.graph)
    model_feeds(model, [vi.name for vi in model.graph.input if index.is_graph_input(vi.name)], data)


def legalize_model(
    model: ModelSource,
    target: str | os.PathLike[str] | NPUProfile | None = None,
    *,
    cpu: CpuSelection | Iterable[str] | str | None = None,
    data: np.ndarray | Mapping[str, np.ndarray] | None = None,
) -> LegalizeResult:
    """Legalise ``model`` (path or ModelProto, never modified) for ``target`` (a profile,
    built-in name or ``.json`` file; default ``xint8``). First the profile's conversions
    (:mod:`quant_npu.conversions`) replace what the target cannot run, except on nodes
    ``cpu`` keeps on the CPU (op types or node-name globs: the result names the partitions
    they make); then positions, formats and parameters are fixed. With ``data`` (model
    inputs, first axis = samples) each conversion's cost is measured (:attr:`LegalizeResult.costs`)."""
    from quant_core.onnx_qdq.model_io import check_model, load_model

    profile = load_profile(target)
    work = load_model(model)
    if data is not None:  # onnxruntime's own error on bad data is a traceback, and NaN passes it
        _check_data(work, data)
    result_tail = float_result_tail(work)
    selection = deployment_selection(work, cpu, result_tail)
    converted = convert_for_target(work, profile, selection)
    costs = conversion_costs(work, profile, data, selection) if data is not None and converted.converted else {}
    decoupled, requantized = decouple_hard_sigmoids(converted.model, profile, selection)
    legalizer = _Legalizer(decoupled, profile)
    legalizer.run()
    result = legalizer.editor.finish()
    check_model(result, "<legalised model>")
    remaining = check_loaded(result, profile, selection)
    changes = [
        Change("conversion", c.node, c.op_type, " + ".join(c.result), _reason(c.rule)) for c in converted.converted
    ]
    kept = (
        (
            f"on the CPU after the NPU, as the last partition: {_listed(result_tail)} (they finish the model's "
            "results in float from its last integer tensors; the planner leaves them float)",
        )
        if result_tail
        else ()
    )
    notes = (*converted.notes, *legalizer.notes, *kept)
    return LegalizeResult(result, (*changes, *requantized, *legalizer.changes), remaining, notes, costs)


def _listed(names: Sequence[str], shown: int = 6) -> str:
    """``node 'a'`` / ``nodes 'a', 'b' and 3 more``."""
    quoted = ", ".join(repr(n) for n in names[:shown])
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"node{'s' * (len(names) != 1)} {quoted}{more}"


def _reason(rule: str) -> str:
    from quant_core.conversions import RULES

    kind = "exact" if RULES[rule].exact else "approximation"
    return f"{rule}: {kind}, {RULES[rule].source.split(';')[0]}"


def legalize(
    model_in: str | os.PathLike[str],
    model_out: str | os.PathLike[str],
    target: str | os.PathLike[str] | NPUProfile | None = None,
    *,
    report_path: str | os.PathLike[str] | None = None,
    cpu: CpuSelection | Iterable[str] | str | None = None,
    data: np.ndarray | Mapping[str, np.ndarray] | None = None,
) -> LegalizeResult:
    """:func:`legalize_model` and write the result to ``model_out`` (atomically; never over
    the input) and, when given, a JSON report."""
    from quant_core.onnx_qdq.model_io import save_model

    result = legalize_model(model_in, target, cpu=cpu, data=data)
    save_model(result.model, model_out, input_path=model_in)
    if report_path is not None:
        from quant_core.atomic_io import atomic_write

        atomic_write(report_path, report_json(result.to_dict()))
    return result
