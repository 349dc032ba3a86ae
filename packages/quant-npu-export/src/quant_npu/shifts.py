"""Conv/Gemm shift rules: ``shift_cut = wpos + ipos - opos`` in the profile's range,
``shift_bias = wpos + ipos - bpos`` in ``[min(0, shift_cut - 16), shift_bias_max]``
(lower bound 0 when a LeakyRelu follows).

Example:
    >>> check_conv_shifts("conv1", ipos=5, wpos=7, opos=4, bpos=9)
    []
    >>> [v.rule for v in check_conv_shifts("conv1", ipos=5, wpos=7, opos=-6, bpos=9)]
    ['shift_cut']
"""

from __future__ import annotations

import attrs

from quant_npu.profile import NPUProfile


@attrs.frozen
class ShiftViolation:
    """One broken rule at one node.

    Example:
        >>> ShiftViolation("c", "shift_cut", 17, (0, 16)).message
        'c: shift_cut 17 outside [0, 16]'
    """

    node: str
    rule: str
    value: int
    allowed: tuple[int, int]

    @property
    def message(self) -> str:
        return f"{self.node}: {self.rule} {self.value} outside [{self.allowed[0]}, {self.allowed[1]}]"


def check_conv_shifts(
    node: str,
    *,
    ipos: int,
    wpos: int,
    opos: int,
    bpos: int | None = None,
    leaky_relu_follows: bool = False,
    profile: NPUProfile | None = None,
) -> list[ShiftViolation]:
    """Violations of the conv shift rules for one node's fix positions."""
    profile = profile or NPUProfile()
    violations = []
    shift_cut = wpos + ipos - opos
    lo, hi = profile.shift_cut_range
    if not lo <= shift_cut <= hi:
        violations.append(ShiftViolation(node, "shift_cut", shift_cut, (lo, hi)))
    if bpos is not None:
        shift_bias = wpos + ipos - bpos
        bias_lo = 0 if leaky_relu_follows else min(0, shift_cut - 16)
        if not bias_lo <= shift_bias <= profile.shift_bias_max:
            violations.append(ShiftViolation(node, "shift_bias", shift_bias, (bias_lo, profile.shift_bias_max)))
    return violations
