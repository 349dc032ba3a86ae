"""A broken device rule at one node, and the list of rules ``check`` knows.

Example:
    >>> v = Violation("conv1", "Conv", "shift_cut", "shift_cut 17 outside [0, 16]", fixable=True)
    >>> v.line
    'conv1 (Conv): shift_cut: shift_cut 17 outside [0, 16] [legalize fixes]'
"""

from __future__ import annotations

from typing import Any

import attrs

from quant_core.errors import ConfigError

NOT_QUANTIZED = "the model is not quantized (no QuantizeLinear or DequantizeLinear)"
QUANTIZE_FIRST = "quantize it first, e.g. quant-onnx quantize MODEL OUTPUT --preset xint8 --calib-data DATA"


def is_quantized(qdq: Any) -> bool:
    """Whether a :class:`~quant_core.onnx_qdq.reader.QDQGraph` holds any Q/DQ node: a float
    model breaks every rule at once, and the one thing to say is :data:`QUANTIZE_FIRST`."""
    return bool(qdq.quantizers or qdq.dequantizers)


RULES: dict[str, str] = {
    "unsupported_op": "the op type is not in the profile's ops: it cannot run on the NPU",
    "unsupported_attribute": "the op is supported but not with these attributes",
    "not_quantized": "the op reads or writes a float tensor: the NPU has no float datapath",
    "activation_format": "activations must be symmetric int8 (uint8 at zero point 128 where accepted)",
    "symmetric": "zero points must be the symmetric one (0, or 128 for uint8)",
    "power_of_two": "scales must be powers of two (a fix position)",
    "per_channel": "one position per tensor where the profile allows no per-channel scales",
    "weight_format": "weights must be int8 with codes in [weight_qmin, 127]",
    "bias_format": "bias must be stored in the profile's bias format",
    "shift_cut": "wpos + ipos - opos of Conv/Gemm/MatMul outside the profile's range",
    "shift_bias": "wpos + ipos - bpos outside the profile's range",
    "shift_read": "Add/Sub input positions too far apart",
    "shift_write": "min(input positions) - output position of Add/Sub outside the profile's range",
    "mul_shift": "sum(input positions) - output position of Mul outside the profile's range",
    "shared_position": "tensors that must share one position differ",
    "hard_sigmoid": "HardSigmoid/HardSwish input or output position outside the device's rules",
    "leaky_relu_alpha": "LeakyRelu alpha is not a multiple of 2**-leaky_relu_alpha_bits (the device rounds it)",
    "fused_position": "a QDQ pair between an op and its fused activation: the CPU model rounds twice",
    "engine_limit": "kernel or stride outside the engine's limits",
}
"""Rule name -> what it means (``docs/npu.md`` lists them too)."""


@attrs.frozen
class Violation:
    """One broken rule.

    Args:
        node: the node (or tensor) it concerns.
        op_type: that node's op type.
        rule: a key of :data:`RULES`.
        message: what is wrong and what is allowed, one line.
        fixable: whether ``legalize`` fixes it.
    """

    node: str
    op_type: str
    rule: str = attrs.field()
    message: str
    fixable: bool

    @rule.validator
    def _check_rule(self, _attribute: object, value: str) -> None:
        if value not in RULES:
            raise ConfigError(f"rule: {value!r} is not allowed; allowed: {', '.join(RULES)}")

    @property
    def line(self) -> str:
        tail = "legalize fixes" if self.fixable else "not fixable by legalize"
        return f"{self.node} ({self.op_type}): {self.rule}: {self.message} [{tail}]"

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)
