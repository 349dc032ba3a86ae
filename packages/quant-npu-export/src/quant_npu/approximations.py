"""The arithmetic shortcuts the device takes, as integers: average pooling by a
multiply and a shift, LeakyRelu's alpha in 1/256 steps, HardSigmoid's 1/6 as 2731/16384.

Example:
    >>> from quant_npu.profile import NPUProfile
    >>> p = NPUProfile()
    >>> average_pool_factor(3, 3, p), average_pool_factor(2, 2, p), average_pool_factor(4, 4, p)
    ((7, 6), (1, 2), (1, 4))
    >>> leaky_relu_alpha(0.1, p)
    (26, 8)
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from quant_core import conversions
from quant_core.errors import ModelError
from quant_core.qparams import round_values
from quant_core.spec import RoundMode
from quant_npu.profile import NPUProfile


def _round_half_even(value: Fraction) -> int:
    return int(round_values(np.array(float(value)), RoundMode.HALF_EVEN))


def average_pool_factor(kh: int, kw: int, profile: NPUProfile) -> tuple[int, int]:
    """``(N, M)`` with ``1 / (kh * kw) ~ N / 2**M``: the profile's table for the sizes the
    device has fixed factors for; otherwise the ``N = round(2**M / (kh * kw))`` with
    ``M < ceil(log2(kh * kw * 128))`` closest to ``1 / (kh * kw)`` (the smallest such M on ties).

    Example:
        >>> average_pool_factor(7, 7, NPUProfile())
        (21, 10)
        >>> average_pool_factor(2, 3, NPUProfile())  # 85 / 512 ~ 1/6, M < ceil(log2(6 * 128)) = 10
        (85, 9)
    """
    if kh < 1 or kw < 1:
        raise ModelError(f"pool kernel: {kh}x{kw} is not allowed; allowed: sizes >= 1")
    table = profile.average_pool_factors.get(f"{kh}x{kw}")
    if table is not None:
        return table
    count = kh * kw
    target = Fraction(1, count)
    best: tuple[Fraction, int, int] | None = None
    for m in range(math.ceil(math.log2(count * 128))):
        n = _round_half_even(Fraction(2**m, count))
        error = abs(Fraction(n, 2**m) - target)
        if best is None or error < best[0]:
            best = (error, n, m)
    assert best is not None  # count * 128 >= 128: at least seven candidates
    return best[1], best[2]


def leaky_relu_alpha(alpha: float, profile: NPUProfile) -> tuple[int, int]:
    """``(numerator, bits)``: the device's alpha is ``numerator / 2**bits``.

    Example:
        >>> leaky_relu_alpha(0.01, NPUProfile())
        (3, 8)
    """
    bits = profile.leaky_relu_alpha_bits
    return _round_half_even(Fraction(alpha) * 2**bits), bits


def device_leaky_relu_alpha(alpha: float, profile: NPUProfile) -> float:
    """The alpha the device computes with, as a float (exact: a multiple of ``2**-bits``).

    Example:
        >>> device_leaky_relu_alpha(0.1, NPUProfile())
        0.1015625
    """
    numerator, bits = leaky_relu_alpha(alpha, profile)
    return numerator / 2**bits


def is_device_hard_sigmoid(alpha: float, beta: float) -> bool:
    """Whether a HardSigmoid is the one the device implements: ``x/6 + 1/2`` (torch's
    hardsigmoid, which the device computes with its constants) or those constants
    themselves (``2731 / 2**14``, ``3 * 2731 / 2**14``, what ``legalize`` writes).

    Example:
        >>> is_device_hard_sigmoid(0.16666667, 0.5), is_device_hard_sigmoid(2731 / 16384, 8193 / 16384)
        (True, True)
        >>> is_device_hard_sigmoid(0.2, 0.5)
        False
    """
    return conversions.is_nominal_hard_sigmoid(alpha, beta) or conversions.is_device_hard_sigmoid(alpha, beta)
