"""Weight and bias positions that meet the shift rules, once activation positions are
fixed: ``shift_cut`` is clamped by moving the weight position, ``shift_bias`` by moving
the bias position; weights and biases are requantized from their exact real values.

Example:
    >>> from quant_npu.profile import NPUProfile
    >>> weight_position(ipos=5, opos=-14, wpos=3, profile=NPUProfile())  # shift_cut 22 -> 16
    -3
"""

from __future__ import annotations

import attrs
import numpy as np

from quant_core.conversions import conv_weight
from quant_core.onnx_qdq.graph import int_attribute
from quant_core.onnx_qdq.reader import QDQGraph
from quant_npu.formats import bias_issues, weight_issues
from quant_npu.plan import Step
from quant_npu.positions import covering_position, planned_weight_position
from quant_npu.profile import BiasFormat, NPUProfile
from quant_npu.rewrite import ModelEditor, quantize_real
from quant_npu.shifts import clamp, shift_bias_range

INT32 = (int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max))


@attrs.frozen
class ParameterChange:
    """A weight or bias requantized.

    Example:
        >>> ParameterChange("bias", "conv1", "int32@12", "int8@6", "bias format int8_own_position").after
        'int8@6'
    """

    kind: str
    target: str
    before: str
    after: str
    reason: str


def weight_position(ipos: int, opos: int, wpos: int, profile: NPUProfile) -> int:
    """``wpos`` moved so that ``wpos + ipos - opos`` lies in the profile's shift_cut range."""
    return clamp(ipos + wpos - opos, profile.shift_cut_range) - ipos + opos


def _describe(dtype: str, position: int | None) -> str:
    return f"{dtype}@{position}"


class ParameterLegalizer:
    """Requantizes the weight and bias of Conv/Gemm/MatMul steps (see the module example
    for the weight position rule; ``legalize_model`` drives it)."""

    def __init__(self, qdq: QDQGraph, profile: NPUProfile, editor: ModelEditor, positions: dict[str, int]) -> None:
        self.qdq = qdq
        self.profile = profile
        self.editor = editor
        self.positions = positions
        self.changes: list[ParameterChange] = []
        self.notes: list[str] = []

    def legalize(self, step: Step) -> None:
        keys = step.data_inputs
        in_key, weight_key = keys[0], keys[1] if len(keys) > 1 else None
        weight = self.qdq.tensors.get(weight_key) if weight_key else None
        if weight is None or not weight.is_constant:
            return
        ipos = self.positions.get(in_key) if in_key else None
        opos = self.positions.get(step.output) if step.output else None
        if ipos is None or opos is None:
            self.notes.append(f"node {step.name!r}: input or output not quantized; weight and bias left as they are")
            return
        real = weight.real_values()
        qmin = self.profile.weight_qmin
        usable = weight.position is not None and not weight_issues(weight, self.profile)
        start = weight.position if usable else planned_weight_position(real, self.profile)
        assert start is not None
        wpos = weight_position(ipos, opos, start, self.profile)
        final = real
        if not usable or wpos != start:
            codes, clipped = quantize_real(real, wpos, qmin, 127, self.profile.weight_rounding)
            assert weight_key is not None
            self.editor.set_constant(self.qdq, weight_key, codes.astype(np.int8), wpos)
            final = np.ldexp(codes.astype(np.float64), -wpos)
            reason = "device weight format" if wpos == start else f"shift_cut {ipos + start - opos} outside range"
            if clipped:
                reason += f"; {clipped} code(s) saturated"
            self.changes.append(
                ParameterChange("weight", step.name, weight.describe(), _describe("int8", wpos), reason)
            )
        if len(step.node.input) > 2 and step.node.input[2]:
            self.legalize_bias(step, ipos, wpos, opos, final)

    def bias_limits(self, step: Step, ipos: int, opos: int, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per output channel, the bias values beyond which the output saturates whatever
        the input (``output range +- max |sum w x|``, one output step of margin): clipping
        a bias there changes no output, and keeps an outlier channel (CLE scales some
        biases far beyond the output range) from coarsening every other channel's bias."""
        if step.op_type == "ConvTranspose":  # [Cin, Cout/g, ...]: the output channels as a Conv's
            weights = conv_weight(weights, int_attribute(step.node, "group", 1))
        axis = (
            1
            if step.op_type == "MatMul" or (step.op_type == "Gemm" and not int_attribute(step.node, "transB", 0))
            else 0
        )
        moved = np.moveaxis(np.abs(weights), axis, 0)
        in_tensor = self.qdq.tensors[step.data_inputs[0]]  # type: ignore[index]
        largest_input = max(abs(v) for v in in_tensor.value_range) * 2.0**-ipos
        reach = largest_input * moved.reshape(moved.shape[0], -1).sum(axis=1)
        step_size = 2.0**-opos
        low, high = -128 * step_size, 127 * step_size
        activation = step.activation
        if activation is not None and activation.op_type == "Relu":
            low = 0.0
        elif activation is not None and activation.op_type == "Clip":
            bounds = [self.qdq.constant(n) for n in activation.input[1:3] if n]
            if len(bounds) == 2 and all(b is not None for b in bounds):
                low, high = max(low, float(bounds[0])), min(high, float(bounds[1]))  # type: ignore[arg-type]
        if activation is not None and activation.op_type == "LeakyRelu":
            low = -np.inf  # negative values are scaled, not clamped
        return low - reach - step_size, high + reach + step_size

    def legalize_bias(self, step: Step, ipos: int, wpos: int, opos: int, weights: np.ndarray) -> None:
        key = step.data_inputs[2] if len(step.data_inputs) > 2 else None
        tensor = self.qdq.tensors.get(key) if key else None
        if tensor is not None:
            real = tensor.real_values().reshape(-1)
            before = tensor.describe()
        else:
            value = self.qdq.constant(step.node.input[2])
            if value is None:
                self.notes.append(f"node {step.name!r}: bias is computed at run time; left as it is")
                return
            real, before = np.asarray(value, np.float64).reshape(-1), "float"
        accumulator = ipos + wpos
        dtype: type[np.signedinteger]
        outliers = 0
        if self.profile.bias_format is BiasFormat.INT32_INPUT_PLUS_WEIGHT:
            bpos, (qmin, qmax), dtype = accumulator, INT32, np.int32
        else:
            low, high = self.bias_limits(step, ipos, opos, weights)
            if real.shape == low.shape:
                outliers = int(np.count_nonzero((real < low) | (real > high)))
                real = np.clip(real, low, high)
            usable = (
                tensor is not None
                and tensor.position is not None
                and not outliers
                and not bias_issues(tensor, None, self.profile)
            )
            start = tensor.position if usable and tensor is not None else None
            if start is None:  # covering, not a weight's nearest power: a clipped bias shifts a whole channel
                start = covering_position(float(real.min()), float(real.max()), 127)
            leaky = step.activation is not None and step.activation.op_type == "LeakyRelu"
            allowed = shift_bias_range(self.profile, accumulator - opos, leaky)
            bpos = accumulator - clamp(accumulator - start, allowed)
            (qmin, qmax), dtype = (self.profile.weight_qmin, 127), np.int8
        unchanged = (
            tensor is not None
            and tensor.position == bpos
            and tensor.numpy_dtype == np.dtype(dtype)
            and not bias_issues(tensor, accumulator, self.profile)
        )
        if unchanged:
            return
        codes, clipped = quantize_real(real, bpos, qmin, qmax, self.profile.bias_rounding)
        if tensor is not None and key is not None:
            self.editor.set_constant(self.qdq, key, codes.astype(dtype), bpos)
        else:
            self.editor.quantize_input(step.node, 2, codes.astype(dtype), bpos)
        reason = f"bias format {self.profile.bias_format.value}"
        if outliers:
            reason += f"; {outliers} value(s) limited to where the output saturates anyway"
        if clipped:
            reason += f"; {clipped} value(s) saturated"
        after = _describe(np.dtype(dtype).name, bpos)
        self.changes.append(ParameterChange("bias", step.name, before, after, reason))


def legalize_operand(qdq: QDQGraph, editor: ModelEditor, key: str, position: int, profile: NPUProfile) -> str:
    """Requantize a constant operand (Add/Mul/Concat input) at ``position`` as int8; returns its old format."""
    tensor = qdq.tensors[key]
    codes, _clipped = quantize_real(tensor.real_values(), position, -128, 127, profile.weight_rounding)
    editor.set_constant(qdq, key, codes.astype(np.int8), position)
    return tensor.describe()
