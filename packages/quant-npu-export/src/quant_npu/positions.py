"""Activation positions that meet the profile: every activation gets a power-of-two
symmetric position, tensors that must share one are grouped (the group takes its
members' minimum: the coarsest, which clips nothing), and the Add/Mul/HardSigmoid shift
rules move positions until none is broken or ``max_rounds`` passes end.

A position chosen from a float range follows what the range is. A weight converted from
another format gets the position quant_core's planner gives it (:func:`planned_weight_position`:
the power of two nearest its min-max scale, which may saturate its largest values); an
activation converted from another format, and a constant whose value must be represented
(a bias, a PRelu slope, a conversion's scalar), get the finest position covering what they
hold (:func:`covering_position`; for activations the nearest power measured mixed:
``docs/benchmarks.md``, "Converted positions follow the planner's nearest rule").

Example:
    >>> covering_position(-1.0, 3.0)  # 127 * 2**-5 = 3.97 >= 3
    5
    >>> weights = np.array([-0.5, 1.2])  # 1.2 / 127 = 2**-6.73: nearest 2**-7 (1.2 clips to 0.99)
    >>> planned_weight_position(weights, NPUProfile()), covering_position(-0.5, 1.2)
    (7, 6)
"""

from __future__ import annotations

import attrs
import numpy as np

from quant_core.dtypes import DType
from quant_core.onnx_qdq.reader import QDQGraph, QuantTensor
from quant_core.plan.weight_range import held_weight_spec
from quant_core.presets import get_preset
from quant_core.qparams import pow2_fix_pos
from quant_core.weights import constant_qparams
from quant_npu.formats import activation_issues
from quant_npu.plan import ADD_OPS, COMMUTING_ACTIVATIONS, WEIGHTED_OPS, Step, is_swish
from quant_npu.profile import NPUProfile
from quant_npu.shifts import clamp, hard_sigmoid_output_range, mul_shift_range

MAX_ROUNDS = 20


def covering_position(lo: float, hi: float, levels: int = 127) -> int:
    """The finest position whose symmetric int8 range covers ``[lo, hi]`` (``levels`` codes
    above zero, one more below). An all-zero range gets position 0."""
    candidates = []
    if hi > 0:
        candidates.append(int(pow2_fix_pos(hi / levels)))
    if lo < 0:
        candidates.append(int(pow2_fix_pos(-lo / (levels + 1))))
    return min(candidates) if candidates else 0


def planned_weight_position(values: np.ndarray, profile: NPUProfile) -> int:
    """The position quant_core's planner gives the weight ``values`` under the ``xint8``
    preset's weight spec (per-tensor int8 power of two, min-max observed; narrow range when
    the profile's codes start at -127): the power of two nearest the min-max scale
    (:func:`quant_core.qparams.nearest_pow2_fix_pos`; the largest values may saturate), or
    by squared error where that grid holds the weight under 20 dB
    (:func:`quant_core.plan.weight_range.held_weight_spec`). The legaliser converts a weight
    of another format (float scales, per channel) with it, so that an ``a8w8`` file gets
    the positions the ``xint8`` preset would have chosen for the same weights."""
    preset = get_preset("xint8").global_config.weight
    assert preset is not None
    spec = preset.evolve(narrow_range=profile.weight_qmin > DType.INT8.qmin)
    spec, _note = held_weight_spec(values, spec)
    fix_pos = constant_qparams(values, spec).fix_pos
    assert fix_pos is not None
    return int(fix_pos)


def initial_position(tensor: QuantTensor, profile: NPUProfile) -> int:
    """A tensor's position as it is, or one covering its representable range when its
    format is not the device's."""
    if tensor.position is not None and not activation_issues(tensor, profile):
        return tensor.position
    if tensor.is_constant:
        real = tensor.real_values()
        return covering_position(float(real.min(initial=0.0)), float(real.max(initial=0.0)))
    lo, hi = representable_range(tensor)
    return covering_position(lo, hi)


def representable_range(tensor: QuantTensor) -> tuple[float, float]:
    """The real values a tensor's codes can hold (its QuantizeLinear saturates there)."""
    scale = np.asarray(tensor.scale, np.float64).reshape(-1)
    zero = np.asarray(tensor.zero_point, np.int64).reshape(-1)
    lo = float(np.min((tensor.dtype.qmin - zero) * scale))
    hi = float(np.max((tensor.dtype.qmax - zero) * scale))
    return lo, hi


def operand_constants(qdq: QDQGraph, steps: list[Step]) -> list[str]:
    """Constant data inputs of steps other than a weighted op's weight and bias (e.g. the
    constant of an Add): positioned like activations, requantized when they move."""
    keys: list[str] = []
    for step in steps:
        inputs = step.data_inputs[:1] if step.op_type in WEIGHTED_OPS else step.data_inputs
        for key in inputs:
            if key is not None and qdq.tensors[key].is_constant and key not in keys:
                keys.append(key)
    return keys


@attrs.define
class PositionChange:
    """One activation moved by the solver.

    Example:
        >>> PositionChange("k", 5, 4, "shares one position at Concat 'c'").after
        4
    """

    key: str
    before: int | None
    after: int
    reason: str


class PositionSolver:
    """Chooses a position for every activation key used by ``steps`` (exercised through
    :func:`quant_npu.legalize.legalize_model`, whose example shows a moved position)."""

    def __init__(self, qdq: QDQGraph, steps: list[Step], profile: NPUProfile) -> None:
        self.qdq = qdq
        self.steps = steps
        self.profile = profile
        self.keys = list(qdq.activation_keys()) + operand_constants(qdq, steps)
        self.pos = {k: initial_position(qdq.tensors[k], profile) for k in self.keys}
        self.parent = {k: k for k in self.keys}
        self.reasons: dict[str, str] = {}
        for key in self.keys:
            if self.pos[key] != qdq.tensors[key].position:
                self.reasons[key] = "power-of-two symmetric int8 format"
        self.notes: list[str] = []

    # ------------------------------------------------------------------ groups
    def find(self, key: str) -> str:
        while self.parent[key] != key:
            self.parent[key] = self.parent[self.parent[key]]
            key = self.parent[key]
        return key

    def union(self, keys: list[str], reason: str) -> None:
        keys = [k for k in keys if k in self.parent]
        for other in keys[1:]:
            a, b = self.find(keys[0]), self.find(other)
            if a != b:
                self.parent[b] = a
        if len(keys) > 1:
            low = min(self.pos[k] for k in keys)
            self.set(keys[0], low, reason)

    def members(self, key: str) -> list[str]:
        root = self.find(key)
        return [k for k in self.keys if self.find(k) == root]

    def set(self, key: str, position: int, reason: str) -> bool:
        """Give ``key``'s whole group ``position``; True when anything moved."""
        moved = False
        for member in self.members(key):
            if self.pos[member] != position:
                self.pos[member] = position
                self.reasons[member] = reason
                moved = True
        return moved

    def build_groups(self) -> None:
        p = self.profile
        for step in self.steps:
            keys = [k for k in step.data_inputs if k is not None and k in self.parent]
            op = step.op_type
            if op in p.shared_position_ops or op in p.layout_ops or op == "Resize":
                shared = keys if op == "Concat" else keys[:1]
                if step.output is not None:
                    self.union([*shared, step.output], f"shares one position at {op} {step.name!r}")
            elif op in ADD_OPS and p.add_inputs_share_position:
                self.union(keys, f"inputs of {op} {step.name!r} share one position")
            skipped, activation, output = step.skipped, step.activation, step.output
            commuting = activation is not None and activation.op_type in COMMUTING_ACTIVATIONS
            if skipped is not None and output is not None and commuting:
                self.union([skipped, output], f"fused into {step.op_type} {step.name!r}")

    # ------------------------------------------------------------------ rules
    def known(self, keys: list[str | None]) -> list[str]:
        return [k for k in keys if k is not None and k in self.pos]

    def apply_add(self, step: Step) -> bool:
        keys = self.known(list(step.data_inputs))
        if len(keys) < 2 or step.output not in self.pos:
            return False
        moved = False
        low = min(self.pos[k] for k in keys)
        for key in keys:
            if self.pos[key] - low > self.profile.add_shift_read_max:
                reason = f"shift_read of {step.op_type} {step.name!r}"
                moved |= self.set(key, low + self.profile.add_shift_read_max, reason)
        low = min(self.pos[k] for k in keys)
        out = str(step.output)
        write = clamp(low - self.pos[out], self.profile.add_shift_write_range)
        return self.set(out, low - write, f"shift_write of {step.op_type} {step.name!r}") or moved

    def apply_mul(self, step: Step, swish: bool) -> bool:
        keys = self.known(list(step.data_inputs))
        if len(keys) < 2 or step.output not in self.pos:
            return False
        total = sum(self.pos[k] for k in keys)
        out = str(step.output)
        shift = clamp(total - self.pos[out], mul_shift_range(self.profile, swish))
        return self.set(out, total - shift, f"shift of {step.op_type} {step.name!r}")

    def apply_hard_sigmoid(self, step: Step) -> bool:
        keys = self.known(list(step.data_inputs)[:1])
        if not keys or step.output not in self.pos:
            return False
        p, key, out = self.profile, keys[0], str(step.output)
        reason = f"{step.op_type} {step.name!r} position rules"
        moved = self.set(key, clamp(self.pos[key], p.hard_sigmoid_input_range), reason)
        ipos = self.pos[key]
        if step.op_type == "HardSigmoid":
            target = clamp(self.pos[out], hard_sigmoid_output_range(p, ipos))
        else:
            hpos = p.hard_swish_sigmoid_position
            target = ipos + hpos - clamp(ipos + hpos - self.pos[out], p.swish_shift_range)
        return self.set(out, target, reason) or moved

    def solve(self) -> list[PositionChange]:
        """Positions for every key; returns what moved from the model's positions."""
        self.build_groups()
        for _round in range(MAX_ROUNDS):
            moved = False
            for step in self.steps:
                op = step.op_type
                if op in ADD_OPS:
                    moved |= self.apply_add(step)
                elif op == "Mul" or (op == "MatMul" and self.is_activation_matmul(step)):
                    moved |= self.apply_mul(step, is_swish(self.qdq, step))
                elif op in ("HardSigmoid", "HardSwish"):
                    moved |= self.apply_hard_sigmoid(step)
            if not moved:
                break
        else:
            self.notes.append(f"position rules still moving after {MAX_ROUNDS} rounds: they conflict")
        return [
            PositionChange(k, self.qdq.tensors[k].position, self.pos[k], self.reasons.get(k, ""))
            for k in self.keys
            if self.pos[k] != self.qdq.tensors[k].position
        ]

    def is_activation_matmul(self, step: Step) -> bool:
        keys = [k for k in step.data_inputs if k is not None]
        return len(keys) == 2 and not any(self.qdq.tensors[k].is_constant for k in keys)
