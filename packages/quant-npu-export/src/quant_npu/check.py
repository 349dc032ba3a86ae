"""``check``: every device rule a QDQ model breaks, by node and rule.

Example:
    >>> import numpy as np
    >>> from onnx import TensorProto, helper, numpy_helper
    >>> inits = [numpy_helper.from_array(np.array(0.3, np.float32), "s"),
    ...          numpy_helper.from_array(np.array(0, np.int8), "z")]
    >>> nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q"),
    ...          helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq"),
    ...          helper.make_node("Sigmoid", ["xd"], ["sg"], name="sig"),
    ...          helper.make_node("Mul", ["xd", "sg"], ["m"], name="swish"),
    ...          helper.make_node("QuantizeLinear", ["m", "s", "z"], ["mq"], name="q2"),
    ...          helper.make_node("DequantizeLinear", ["mq", "s", "z"], ["y"], name="dq2")]
    >>> g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
    ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])], inits)
    >>> result = check(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]))
    >>> result.ok, sorted(result.counts())
    (False, ['not_quantized', 'power_of_two', 'unsupported_op'])
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable
from typing import Any

import attrs
import numpy as np
import onnx

from quant_core.conversions import RULES
from quant_core.onnx_qdq.graph import (
    float_attribute,
    int_attribute,
    int_list,
    node_attribute,
    node_label,
    str_attribute,
)
from quant_core.onnx_qdq.reader import QDQGraph
from quant_npu.approximations import is_device_hard_sigmoid, leaky_relu_alpha
from quant_npu.conversions import applicable_matches, conv_transpose_issues
from quant_npu.formats import activation_issues, bias_issues, weight_issues
from quant_npu.partitions import CpuSelection, Partition, cpu_steps, deployment_selection, partitions
from quant_npu.plan import ADD_OPS, COMMUTING_ACTIVATIONS, WEIGHTED_OPS, Step, is_swish, plan, step_label
from quant_npu.profile import NPUProfile, load_profile
from quant_npu.shifts import (
    add_shift_read_range,
    hard_sigmoid_output_range,
    hard_sigmoid_shift,
    inside,
    mul_shift_range,
    shift_bias_range,
)
from quant_npu.sim.movement import per_axis
from quant_npu.sim.spatial import Geometry
from quant_npu.violations import NOT_QUANTIZED, QUANTIZE_FIRST, Violation, is_quantized

ModelSource = str | os.PathLike[str] | onnx.ModelProto


OPERAND_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Concat"})
"""Ops whose every input is an operand: a float constant there is float arithmetic, which
the device does not do (the simulator refuses it), unlike other ops' constant inputs
(Clip bounds, shapes, pads, scales) or weights and slopes (their own rules)."""


@attrs.frozen
class CheckResult:
    """The violations of one model under one profile.

    Example:
        >>> CheckResult("xint8", ()).ok
        True
    """

    target: str
    violations: tuple[Violation, ...]
    quantized: bool = True
    partitions: tuple[Partition, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.violations

    def counts(self) -> dict[str, int]:
        """Violations per rule."""
        return dict(Counter(v.rule for v in self.violations))

    def unfixable(self) -> tuple[Violation, ...]:
        return tuple(v for v in self.violations if not v.fixable)

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "ok": self.ok,
            "quantized": self.quantized,
            "counts": dict(sorted(self.counts().items())),
            "violations": [v.to_dict() for v in self.violations],
            "partitions": [p.to_dict() for p in self.partitions],
        }

    def format_text(self) -> str:
        kept = [p.line for p in self.partitions]
        if self.ok:
            tail = f" ({len(kept)} CPU partition(s))" if kept else ""
            return "\n".join([*kept, f"ok: the model meets every rule of target '{self.target}'{tail}"])
        if not self.quantized:  # every node would be listed: say the one thing to do instead
            return (
                f"{NOT_QUANTIZED}, so every node breaks target '{self.target}' "
                f"({len(self.violations)} violation(s); --json lists them): {QUANTIZE_FIRST}"
            )
        lines = [*kept, *(v.line for v in self.violations)]
        fixable = len(self.violations) - len(self.unfixable())
        lines.append(
            f"{len(self.violations)} violation(s) of target '{self.target}' ({fixable} fixable by legalize): "
            + ", ".join(f"{rule} {n}" for rule, n in sorted(self.counts().items()))
        )
        return "\n".join(lines)


class _Checker:
    def __init__(self, qdq: QDQGraph, profile: NPUProfile, cpu: CpuSelection) -> None:
        self.qdq = qdq
        self.profile = profile
        self.cpu = cpu
        self.steps = plan(qdq, profile)
        self.found: list[Violation] = []
        self.seen_tensors: set[str] = set()
        self.conversions = planned_conversions(qdq, profile, cpu)

    # ------------------------------------------------------------------ helpers
    def add(self, node: str, op_type: str, rule: str, message: str, fixable: bool = True) -> None:
        self.found.append(Violation(node, op_type, rule, message, fixable))

    def step_add(self, step: Step, rule: str, message: str, fixable: bool = True) -> None:
        op = step.op_type if step.activation is None else f"{step.op_type}+{step.activation.op_type}"
        self.add(step_label(step), op, rule, message, fixable)

    def pos(self, key: str | None) -> int | None:
        return self.qdq.position(key)

    def float_inputs(self, step: Step) -> list[str]:
        """Inputs of the main node that carry float data (not quantized, not shape; a float
        constant only where it is an operand of the arithmetic, see :data:`OPERAND_OPS`)."""
        names = []
        for name, key in zip(step.node.input, step.data_inputs, strict=True):
            if not name or key is not None or name in self.qdq.host_values:
                continue
            if self.qdq.constant(name) is not None and step.op_type not in OPERAND_OPS:
                continue
            names.append(name)
        return names

    # ------------------------------------------------------------------ rules
    def run(self) -> list[Violation]:
        on_cpu = {id(s) for s in cpu_steps(self.qdq, self.steps, self.cpu)}
        for step in self.steps:
            if id(step) not in on_cpu:
                self.check_step(step)
        return self.found

    def check_step(self, step: Step) -> None:
        op = step.op_type
        rule = self.conversions.get(step.name)
        if op not in self.profile.accepted_ops:
            message = f"{op} is not in target '{self.profile.name}'"
            if rule is not None:
                message += f"; legalize converts it ({rule}: {RULES[rule].becomes})"
            self.step_add(step, "unsupported_op", message, fixable=rule is not None)
        floats = self.float_inputs(step)
        if floats:
            self.step_add(step, "not_quantized", f"reads float tensor {floats[0]!r}", fixable=False)
        if step.output is None:
            out = (step.activation or step.node).output[0]
            self.step_add(step, "not_quantized", f"writes float tensor {out!r}", fixable=False)
        self.check_formats(step)
        if op in WEIGHTED_OPS:
            self.check_weighted(step)
        elif op in ADD_OPS:
            self.check_add(step)
        elif op == "Mul":
            self.check_mul(step)
        elif op in ("HardSigmoid", "HardSwish"):
            self.check_hard_sigmoid(step)
        shares = op in self.profile.shared_position_ops or op in self.profile.layout_ops or op == "Resize"
        if shares and step.output is not None:  # a float output shares no position (not_quantized says why)
            self.check_shared(step)
        if op == "PRelu":
            self.check_prelu(step)
        if op in ("MaxPool", "AveragePool"):
            kernel = int_list(step.node, "kernel_shape")
            if kernel and max(kernel) > self.profile.pool_kernel_max:
                limit = self.profile.pool_kernel_max
                self.step_add(step, "engine_limit", f"pool kernel {kernel}; allowed: <= {limit}", fixable=False)
        if op == "AveragePool":
            self.check_average_divisor(step)
        if op == "Resize":
            text = str_attribute(step.node, "mode", "nearest")
            if text not in self.profile.resize_modes:
                allowed = ", ".join(sorted(self.profile.resize_modes))
                self.step_add(step, "unsupported_attribute", f"Resize mode {text!r}; allowed: {allowed}", False)
            self.check_resize_scales(step)
        for node in step.nodes:
            if node.op_type == "LeakyRelu":
                self.check_leaky_relu(step, node)
        if step.skipped is not None:
            self.check_fused(step)

    def check_formats(self, step: Step) -> None:
        keys = [k for k in step.data_inputs if k is not None]
        if step.op_type in WEIGHTED_OPS and len(keys) > 1 and self.qdq.tensors[keys[1]].is_constant:
            keys = keys[:1]  # weights and biases have their own rules
        if step.output is not None:
            keys.append(step.output)
        for key in keys:
            if key in self.seen_tensors:
                continue
            self.seen_tensors.add(key)
            tensor = self.qdq.tensors[key]
            node, op = self.tensor_owner(key)
            for rule, message in activation_issues(tensor, self.profile):
                self.add(node, op, rule, message)

    def tensor_owner(self, key: str) -> tuple[str, str]:
        tensor = self.qdq.tensors[key]
        producer = self.qdq.producer(tensor.float_name) if tensor.float_name else None
        if producer is not None:
            return node_label(producer), producer.op_type
        quantizer = self.qdq.quantizers.get(key)
        return (node_label(quantizer), quantizer.op_type) if quantizer is not None else (key, "Constant")

    def check_weighted(self, step: Step) -> None:
        node = step.node
        weight_key = step.data_inputs[1] if len(step.data_inputs) > 1 else None
        weight = self.qdq.tensors.get(weight_key) if weight_key else None
        if node.op_type == "Gemm":
            for attr, default in (("alpha", 1.0), ("beta", 1.0), ("transA", 0)):
                value = node_attribute(node, attr, default)
                if value != default:
                    self.step_add(step, "unsupported_attribute", f"Gemm {attr}={value}; allowed: {default}", False)
        if weight is None or not weight.is_constant:
            if node.op_type != "MatMul" or weight is None:
                self.step_add(step, "not_quantized", "weight is not an integer constant", fixable=False)
                return
            self.check_mul(step)  # activation x activation
            return
        for rule, message in weight_issues(weight, self.profile):
            self.step_add(step, rule, message)
        if node.op_type == "Conv" and weight.codes is not None:
            self.check_conv_limits(step, weight.codes.shape)
        if node.op_type == "ConvTranspose" and weight.codes is not None:
            conversion = self.conversions.get(step.name)
            for issue in conv_transpose_issues(node, weight.codes.shape, self.profile):
                text = issue if conversion is None else f"{issue}; legalize converts it ({conversion})"
                self.step_add(step, "engine_limit", f"transposed conv {text}", fixable=conversion is not None)
        ipos, wpos, opos = self.pos(step.data_inputs[0]), weight.position, self.pos(step.output)
        if wpos is None and weight.fix_pos is not None:
            wpos = int(weight.fix_pos.max())  # per-channel: the channel with the largest shift
        bias_key = step.data_inputs[2] if len(step.data_inputs) > 2 else None
        has_bias = len(node.input) > 2 and bool(node.input[2])
        accumulator = None if ipos is None or wpos is None else ipos + wpos
        if has_bias:
            bias = self.qdq.tensors.get(bias_key) if bias_key else None
            for rule, message in bias_issues(bias, accumulator, self.profile):
                self.step_add(step, rule, message)
        if ipos is None or wpos is None or opos is None:
            return
        shift_cut = ipos + wpos - opos
        if not inside(shift_cut, self.profile.shift_cut_range):
            lo, hi = self.profile.shift_cut_range
            self.step_add(
                step, "shift_cut", f"wpos {wpos} + ipos {ipos} - opos {opos} = {shift_cut}; allowed: [{lo}, {hi}]"
            )
        bias_pos = self.pos(bias_key) if has_bias else None
        if bias_pos is not None:
            leaky = step.activation is not None and step.activation.op_type == "LeakyRelu"
            lo, hi = shift_bias_range(self.profile, shift_cut, leaky)
            shift_bias = ipos + wpos - bias_pos
            if not lo <= shift_bias <= hi:
                message = f"wpos {wpos} + ipos {ipos} - bpos {bias_pos} = {shift_bias}; allowed: [{lo}, {hi}]"
                self.step_add(step, "shift_bias", message)

    def check_conv_limits(self, step: Step, weight_shape: tuple[int, ...]) -> None:
        group = int_attribute(step.node, "group", 1)
        kernel = list(weight_shape[2:])
        strides = int_list(step.node, "strides", [1] * len(kernel))
        depthwise = group > 1 and weight_shape[1] == 1
        p = self.profile
        k_range, s_range = (
            (p.depthwise_kernel_range, p.depthwise_stride_range)
            if depthwise
            else (p.conv_kernel_range, p.conv_stride_range)
        )
        kind = "depthwise conv" if depthwise else "conv"
        if kernel and not (k_range[0] <= min(kernel) and max(kernel) <= k_range[1]):
            self.step_add(step, "engine_limit", f"{kind} kernel {kernel}; allowed: {list(k_range)}", fixable=False)
        if strides and not (s_range[0] <= min(strides) and max(strides) <= s_range[1]):
            self.step_add(step, "engine_limit", f"{kind} stride {strides}; allowed: {list(s_range)}", fixable=False)

    def check_prelu(self, step: Step) -> None:
        key = step.data_inputs[1] if len(step.data_inputs) > 1 else None
        slope = self.qdq.tensors.get(key) if key else None
        if slope is None or not slope.is_constant:
            what = "a float constant" if self.qdq.constant(step.node.input[1]) is not None else "not a constant"
            self.step_add(step, "weight_format", f"slope is {what}; allowed: int8 codes at one fix position")
            return
        for rule, message in weight_issues(slope, self.profile):
            self.step_add(step, rule, message)

    def check_average_divisor(self, step: Step) -> None:
        """The device divides every window's sum by the whole kernel (``sum * N >> M``).
        ONNX divides a window that covers padding by its real pixels only
        (``count_include_pad=0``, the default) and a window past the end that ``ceil_mode``
        adds by its part inside: neither is the device's average."""
        node = step.node
        implicit = str_attribute(node, "auto_pad", "NOTSET") in ("SAME_UPPER", "SAME_LOWER")
        padded = implicit or any(int_list(node, "pads") or [])
        known = self.pool_geometry(step)
        if known is not None:  # SAME on sizes the stride divides pads nothing
            geometry, spatial = known
            padded = any(attrs.evolve(geometry, ceil_mode=False).padding(*spatial))
        if padded and not int_attribute(node, "count_include_pad", 0):
            self.step_add(
                step,
                "unsupported_attribute",
                "AveragePool count_include_pad=0 over padding; allowed: count_include_pad=1 or no padding "
                "(the device divides every window by the kernel's size)",
                False,
            )
        if int_attribute(node, "ceil_mode", 0) and _ceil_adds_windows(known):
            self.step_add(
                step,
                "unsupported_attribute",
                "AveragePool ceil_mode=1; allowed: ceil_mode=0 (the device divides every window by the kernel's size)",
                False,
            )

    def pool_geometry(self, step: Step) -> tuple[Geometry, tuple[int, int]] | None:
        """A 2-D pool's window geometry and input size, None where the size is unknown."""
        name, key = step.node.input[0], step.data_inputs[0]
        shape = self.qdq.index.shape(name)
        source = self.qdq.tensors[key].float_name if shape is None and key is not None else None
        shape = self.qdq.index.shape(source) if source else shape
        spatial = [] if shape is None else shape[2:]
        kernel = int_list(step.node, "kernel_shape")
        if len(spatial) != 2 or len(kernel) != 2 or not all(isinstance(d, int) for d in spatial):
            return None
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in step.node.attribute}
        return Geometry.from_node_attributes(attributes, kernel), (int(spatial[0]), int(spatial[1]))  # type: ignore[arg-type]

    def check_resize_scales(self, step: Step) -> None:
        scales = resize_scales(self.qdq, step.node)
        if scales is None:
            return
        lo, hi = self.profile.resize_scale_range
        spatial = scales[2:]
        if any(s != int(s) or not lo <= s <= hi for s in spatial):
            shown = [float(s) for s in spatial]
            self.step_add(step, "engine_limit", f"Resize scales {shown}; allowed: integers in [{lo}, {hi}]", False)

    def check_add(self, step: Step) -> None:
        positions = [self.pos(k) for k in step.data_inputs if k is not None]
        opos = self.pos(step.output)
        if len(positions) < 2 or any(p is None for p in positions) or opos is None:
            return
        known = [int(p) for p in positions if p is not None]
        low = min(known)
        _lo, hi = add_shift_read_range(self.profile)
        for key, p in zip([k for k in step.data_inputs if k is not None], known, strict=True):
            if p - low > hi:
                self.step_add(
                    step, "shift_read", f"input {key} at {p}, min input position {low}; allowed: <= {hi} apart"
                )
        write = low - opos
        if not inside(write, self.profile.add_shift_write_range):
            wlo, whi = self.profile.add_shift_write_range
            self.step_add(step, "shift_write", f"min(ipos) {low} - opos {opos} = {write}; allowed: [{wlo}, {whi}]")
        if self.profile.add_inputs_share_position and len(set(known)) > 1:
            self.step_add(step, "shared_position", f"input positions {known}; allowed: one position")

    def check_mul(self, step: Step) -> None:
        positions = [self.pos(k) for k in step.data_inputs if k is not None]
        opos = self.pos(step.output)
        if len(positions) < 2 or any(p is None for p in positions) or opos is None:
            return
        shift = sum(int(p) for p in positions if p is not None) - opos
        allowed = mul_shift_range(self.profile, swish=is_swish(self.qdq, step))
        if not inside(shift, allowed):
            self.step_add(
                step, "mul_shift", f"sum(ipos) {shift + opos} - opos {opos} = {shift}; allowed: {list(allowed)}"
            )

    def check_hard_sigmoid(self, step: Step) -> None:
        node = step.node
        if node.op_type == "HardSigmoid":
            alpha = float_attribute(node, "alpha", 0.2)
            beta = float_attribute(node, "beta", 0.5)
            if not is_device_hard_sigmoid(alpha, beta):
                self.step_add(step, "unsupported_attribute", f"alpha {alpha}, beta {beta}; allowed: 1/6, 0.5", False)
        ipos, opos = self.pos(step.data_inputs[0]), self.pos(step.output)
        if ipos is None or opos is None:
            return
        p = self.profile
        lo, hi = p.hard_sigmoid_input_range
        if not lo <= ipos <= hi:
            self.step_add(step, "hard_sigmoid", f"input position {ipos}; allowed: [{lo}, {hi}]")
        if node.op_type == "HardSigmoid":
            olo, ohi = hard_sigmoid_output_range(p, ipos)
            if not olo <= opos <= ohi:
                shift = hard_sigmoid_shift(p, ipos, opos)
                self.step_add(step, "hard_sigmoid", f"output position {opos} (shift {shift}); allowed: [{olo}, {ohi}]")
            return
        hpos = p.hard_swish_sigmoid_position
        swish = ipos + hpos - opos
        if not inside(swish, p.swish_shift_range):
            allowed = list(p.swish_shift_range)
            self.step_add(step, "hard_sigmoid", f"swish shift ipos + {hpos} - opos = {swish}; allowed: {allowed}")

    def check_shared(self, step: Step) -> None:
        keys = [k for k in step.data_inputs if k is not None]
        if step.op_type != "Concat":
            keys = keys[:1]
        if step.output is not None:
            keys.append(step.output)
        positions = {k: self.pos(k) for k in keys}
        known = {p for p in positions.values() if p is not None}
        if len(known) > 1:
            listed = ", ".join(f"{k}@{p}" for k, p in positions.items())
            self.step_add(step, "shared_position", f"{listed}; allowed: one position (the minimum)")

    def check_leaky_relu(self, step: Step, node: onnx.NodeProto) -> None:
        alpha = float_attribute(node, "alpha", 0.01)
        numerator, bits = leaky_relu_alpha(alpha, self.profile)
        if numerator / 2**bits != np.float64(np.float32(alpha)):
            self.step_add(step, "leaky_relu_alpha", f"alpha {alpha:.8g} runs as {numerator}/{2**bits}")

    def check_fused(self, step: Step) -> None:
        assert step.activation is not None and step.skipped is not None
        if step.activation.op_type in COMMUTING_ACTIVATIONS:
            inner, outer = self.pos(step.skipped), self.pos(step.output)
            if inner is not None and outer is not None and inner != outer:
                self.step_add(step, "fused_position", f"{step.skipped}@{inner} before the activation, @{outer} after")
        else:
            self.step_add(
                step, "fused_position", f"{step.skipped} is quantized before the fused {step.activation.op_type}"
            )


def resize_scales(qdq: QDQGraph, node: onnx.NodeProto) -> list[float] | None:
    """A Resize's scale per axis, from its constant ``scales`` or ``sizes`` and its input's
    shape; None when they are not known before run time."""
    axes = int_list(node, "axes")  # opset 18: scales or sizes of these axes only
    key = qdq.dequantized.get(node.input[0]) if node.input else None
    source = qdq.tensors[key].float_name if key in qdq.tensors else None
    shape = qdq.index.shape(source or node.input[0]) if node.input else None
    scales = qdq.constant_input(node, 2)
    if scales is not None and scales.size:
        if axes and shape is None:
            return None
        return [float(s) for s in per_axis(scales, axes, len(shape or scales.reshape(-1)), 1.0)]
    sizes = qdq.constant_input(node, 3)
    if sizes is None or shape is None or not all(isinstance(d, int) and d for d in shape):
        return None
    full = per_axis(sizes, axes, len(shape), 0)
    return [float(o or i) / float(i) for o, i in zip(full, shape, strict=False)]  # type: ignore[arg-type]


def planned_conversions(qdq: QDQGraph, profile: NPUProfile, cpu: CpuSelection | None = None) -> dict[str, str]:
    """Node name -> the conversion ``legalize`` applies to it under ``profile``."""
    return {m.node: m.rule for m in applicable_matches(qdq, profile, cpu or CpuSelection())}


def check(
    model: ModelSource,
    target: str | os.PathLike[str] | NPUProfile | None = None,
    *,
    cpu: CpuSelection | Iterable[str] | str | None = None,
) -> CheckResult:
    """Every rule of ``target`` (a profile, a built-in name or a ``.json`` file; default
    ``xint8``) that ``model`` (a path or ModelProto, never modified) breaks. Nodes ``cpu``
    selects (op types or node-name globs) run on the CPU: no rule applies to them, and the
    result lists the partitions they make; so does a float Concat that only assembles the
    model's results (:func:`~quant_npu.partitions.deployment_selection`)."""
    from quant_core.onnx_qdq.model_io import load_model

    loaded = load_model(model)
    return check_loaded(loaded, load_profile(target), deployment_selection(loaded, cpu))


def _ceil_adds_windows(known: tuple[Geometry, tuple[int, int]] | None) -> bool:
    """Whether ``ceil_mode`` gives a pool (its :meth:`_Checker.pool_geometry`) windows past
    the end of its input: not where every window fits (even sizes at stride 2, as a
    ResNet-D shortcut's pool), and assumed where the input's size is unknown."""
    if known is None:
        return True
    ceil, spatial = known
    return ceil.padding(*spatial) != attrs.evolve(ceil, ceil_mode=False).padding(*spatial)


def check_loaded(model: onnx.ModelProto, profile: NPUProfile, cpu: CpuSelection | None = None) -> CheckResult:
    """:func:`check` of an already loaded and validated model."""
    selection = cpu or CpuSelection()
    qdq = QDQGraph(model)
    quantized = is_quantized(qdq)
    checker = _Checker(qdq, profile, selection)
    found = tuple(checker.run())
    return CheckResult(profile.name, found, quantized, tuple(partitions(qdq, checker.steps, selection)))
