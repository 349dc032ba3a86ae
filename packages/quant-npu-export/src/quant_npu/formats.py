"""Which storage formats the device takes for activations, weights and biases, and what
is wrong with a tensor that does not fit: ``(rule, message)`` pairs.

Example:
    >>> import numpy as np, onnx
    >>> from quant_npu.profile import NPUProfile
    >>> from quant_core.onnx_qdq.reader import QuantTensor
    >>> u8 = QuantTensor("a", np.array(0.1, np.float32), np.array(3), onnx.TensorProto.UINT8, None)
    >>> [rule for rule, _ in activation_issues(u8, NPUProfile())]
    ['symmetric', 'power_of_two']
"""

from __future__ import annotations

import numpy as np
import onnx

from quant_core.onnx_qdq.reader import QuantTensor
from quant_npu.profile import BiasFormat, NPUProfile

Issue = tuple[str, str]


def activation_issues(tensor: QuantTensor, profile: NPUProfile) -> list[Issue]:
    """What keeps ``tensor`` from being a device activation (also constant operands)."""
    issues: list[Issue] = []
    bits = profile.activation_bits
    if tensor.bits != bits:
        issues.append(("activation_format", f"{tensor.key}: {tensor.describe()}; allowed: {bits}-bit symmetric"))
    elif not tensor.signed and not profile.accept_uint8_offset:
        issues.append(("activation_format", f"{tensor.key}: {tensor.describe()}; allowed: int{bits}"))
    if not tensor.is_symmetric:
        zp = np.asarray(tensor.zero_point).reshape(-1)[0]
        issues.append(("symmetric", f"{tensor.key}: zero point {int(zp)}; allowed: {tensor.symmetric_offset}"))
    if tensor.axis is not None and np.asarray(tensor.scale).size > 1:
        issues.append(("per_channel", f"{tensor.key}: one scale per channel; allowed: one per tensor"))
    if tensor.fix_pos is None:
        issues.append(("power_of_two", f"{tensor.key}: {tensor.describe()} is not a power of two"))
    return issues


def weight_issues(tensor: QuantTensor, profile: NPUProfile) -> list[Issue]:
    """What keeps a weight from being a device weight."""
    issues: list[Issue] = []
    if tensor.bits != 8 or not tensor.signed:
        issues.append(("weight_format", f"{tensor.key}: {tensor.describe()}; allowed: int8"))
    if not np.all(tensor.zero_point == 0):
        issues.append(("symmetric", f"{tensor.key}: non-zero zero point; allowed: 0"))
    if tensor.axis is not None and np.asarray(tensor.scale).size > 1 and not profile.per_channel_weights:
        issues.append(("per_channel", f"{tensor.key}: one scale per channel; allowed: one per tensor"))
    if tensor.fix_pos is None:
        issues.append(("power_of_two", f"{tensor.key}: {tensor.describe()} is not a power of two"))
    if tensor.codes is not None and tensor.bits == 8 and tensor.codes.size:
        low = int(tensor.values().min())
        if low < profile.weight_qmin:
            issues.append(("weight_format", f"{tensor.key}: code {low}; allowed: [{profile.weight_qmin}, 127]"))
    return issues


def bias_issues(tensor: QuantTensor | None, accumulator_pos: int | None, profile: NPUProfile) -> list[Issue]:
    """What keeps a bias from the profile's bias format; ``tensor`` None means a float bias."""
    if tensor is None:
        return [("bias_format", f"float bias; allowed: {profile.bias_format.value}")]
    issues: list[Issue] = []
    wanted = 8 if profile.bias_format is BiasFormat.INT8_OWN_POSITION else 32
    if tensor.bits != wanted or not tensor.signed:
        issues.append(("bias_format", f"{tensor.key}: {tensor.describe()}; allowed: {profile.bias_format.value}"))
    if not np.all(tensor.zero_point == 0):
        issues.append(("symmetric", f"{tensor.key}: non-zero zero point; allowed: 0"))
    if tensor.fix_pos is None or tensor.position is None:
        issues.append(("bias_format", f"{tensor.key}: {tensor.describe()}; allowed: one power-of-two position"))
    elif (
        profile.bias_format is BiasFormat.INT32_INPUT_PLUS_WEIGHT
        and accumulator_pos is not None
        and tensor.position != accumulator_pos
    ):
        issues.append(("bias_format", f"{tensor.key}: position {tensor.position}; allowed: {accumulator_pos}"))
    return issues


def storage(tensor: QuantTensor, profile: NPUProfile) -> tuple[int, int]:
    """``(elem_type, zero_point)`` a device activation is stored with: the tensor's own
    signed type at its width, uint8 at 128 where the profile accepts that encoding, else int8.

    Example:
        >>> t = QuantTensor("a", np.array(1.0, np.float32), np.array(0), onnx.TensorProto.UINT16, None)
        >>> storage(t, NPUProfile())
        (2, 128)
    """
    bits = profile.activation_bits
    if not tensor.signed and profile.accept_uint8_offset and bits == 8:
        return onnx.TensorProto.UINT8, 128
    signed = {8: onnx.TensorProto.INT8, 16: onnx.TensorProto.INT16}[bits]
    return signed, 0
