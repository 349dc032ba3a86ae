"""The shift rules of the device, as allowed ranges of position arithmetic. ``check``
compares the model's shifts with them; ``legalize`` clamps into them.

- Conv/Gemm/MatMul: ``shift_cut = wpos + ipos - opos`` in ``shift_cut_range``;
  ``shift_bias = wpos + ipos - bpos`` in ``[min(0, shift_cut + 8 - bias_accumulator_bits),
  shift_bias_max]`` (lower bound ``leaky_relu_shift_bias_min`` when a LeakyRelu is fused).
- Add/Sub: ``shift_read_i = ipos_i - min(ipos) <= add_shift_read_max`` and
  ``shift_write = min(ipos) - opos`` in ``add_shift_write_range``.
- Mul: ``sum(ipos) - opos`` in ``mul_shift_range`` (``swish_shift_range`` for x * hardsigmoid(x)).
- HardSigmoid: ``ipos`` in ``hard_sigmoid_input_range``, ``opos >= hard_sigmoid_output_min``,
  ``hard_sigmoid_shift + ipos - opos`` in ``hard_sigmoid_shift_range``.

Example:
    >>> from quant_npu.profile import NPUProfile
    >>> p = NPUProfile()
    >>> shift_bias_range(p, shift_cut=2), shift_bias_range(p, shift_cut=2, leaky_relu=True)
    ((-14, 15), (0, 15))
    >>> clamp(17, p.shift_cut_range)
    16
"""

from __future__ import annotations

from quant_npu.profile import NPUProfile, Range


def clamp(value: int, allowed: Range) -> int:
    """``value`` moved into ``allowed``."""
    return max(allowed[0], min(allowed[1], value))


def inside(value: int, allowed: Range) -> bool:
    return allowed[0] <= value <= allowed[1]


def shift_bias_range(profile: NPUProfile, shift_cut: int, leaky_relu: bool = False) -> Range:
    """Allowed ``wpos + ipos - bpos`` for a given shift_cut."""
    lo = min(0, shift_cut + 8 - profile.bias_accumulator_bits)
    if leaky_relu and profile.leaky_relu_shift_bias_min is not None:
        lo = profile.leaky_relu_shift_bias_min
    return lo, profile.shift_bias_max


def add_shift_read_range(profile: NPUProfile) -> Range:
    return 0, profile.add_shift_read_max


def mul_shift_range(profile: NPUProfile, swish: bool = False) -> Range:
    return profile.swish_shift_range if swish else profile.mul_shift_range


def hard_sigmoid_shift(profile: NPUProfile, ipos: int, opos: int) -> int:
    """The device's right shift after multiplying by ``hard_sigmoid_multiplier``."""
    return profile.hard_sigmoid_shift + ipos - opos


def hard_sigmoid_output_range(profile: NPUProfile, ipos: int) -> Range:
    """Allowed output positions of a HardSigmoid whose input is at ``ipos``.

    Example:
        >>> from quant_npu.profile import NPUProfile
        >>> hard_sigmoid_output_range(NPUProfile(), 4)
        (7, 18)
    """
    lo_shift, hi_shift = profile.hard_sigmoid_shift_range
    lo = max(profile.hard_sigmoid_output_min, profile.hard_sigmoid_shift + ipos - hi_shift)
    return lo, profile.hard_sigmoid_shift + ipos - lo_shift
