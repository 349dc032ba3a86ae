"""What an NPU target accepts, as a frozen profile. Where public sources disagree
(bias format, weight code range, rounding), the profile makes the choice a field.

Example:
    >>> p = NPUProfile()
    >>> p.weight_qmin, p.shift_cut_range
    (-127, (0, 16))
"""

from __future__ import annotations

import enum

import attrs

from quant_core.spec import RoundMode, parse_enum


class BiasFormat(enum.Enum):
    INT8_OWN_POSITION = "int8_own_position"  # Quark's XINT8 code
    INT32_INPUT_PLUS_WEIGHT = "int32_input_plus_weight"  # Quark's docs table, what onnxruntime fuses


@attrs.frozen
class NPUProfile:
    """Integer rules of an XINT8-class NPU (see NPU-TARGET.md).

    Example:
        >>> NPUProfile(rounding="half_even").rounding
        <RoundMode.HALF_EVEN: 'half_even'>
    """

    name: str = "xint8"
    weight_qmin: int = attrs.field(default=-127)
    bias_format: BiasFormat = attrs.field(
        default=BiasFormat.INT8_OWN_POSITION, converter=lambda v: parse_enum(BiasFormat, v, "bias_format")
    )
    rounding: RoundMode = attrs.field(
        default=RoundMode.HALF_UP, converter=lambda v: parse_enum(RoundMode, v, "rounding")
    )
    shift_cut_range: tuple[int, int] = (0, 16)
    shift_bias_max: int = 15
    max_activation_fix_pos: int = 12

    @weight_qmin.validator
    def _v(self, attribute: attrs.Attribute, value: int) -> None:  # type: ignore[type-arg]
        if value not in (-127, -128):
            raise ValueError(f"weight_qmin: {value!r} is not allowed; allowed: -127 (Quark), -128 (Vitis AI)")
