"""The device's approximations against their definitions."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from quant_npu.approximations import (
    average_pool_factor,
    device_leaky_relu_alpha,
    is_device_hard_sigmoid,
    leaky_relu_alpha,
)
from quant_npu.profile import NPUProfile

PROFILE = NPUProfile()


@pytest.mark.parametrize(("size", "factor"), [(3, (7, 6)), (5, (10, 8)), (6, (7, 8)), (7, (21, 10)), (14, (21, 12))])
def test_table_sizes(size: int, factor: tuple[int, int]) -> None:
    assert average_pool_factor(size, size, PROFILE) == factor


@pytest.mark.parametrize("kernel", [(1, 1), (2, 2), (4, 4), (2, 3), (1, 7), (9, 9), (11, 13), (28, 28)])
def test_search_is_the_closest_power_of_two_fraction(kernel: tuple[int, int]) -> None:
    count = kernel[0] * kernel[1]
    n, m = average_pool_factor(*kernel, PROFILE)
    assert m < math.ceil(math.log2(count * 128))
    error = abs(Fraction(n, 2**m) - Fraction(1, count))
    for other in range(math.ceil(math.log2(count * 128))):
        candidate = round(Fraction(2**other, count))  # Python's round: half to even, like the search
        assert abs(Fraction(candidate, 2**other) - Fraction(1, count)) >= error
    if count & (count - 1) == 0:
        assert Fraction(n, 2**m) == Fraction(1, count)  # powers of two are exact


def test_leaky_relu_alpha() -> None:
    assert leaky_relu_alpha(0.1, PROFILE) == (26, 8)
    assert device_leaky_relu_alpha(0.1, PROFILE) == 26 / 256
    assert device_leaky_relu_alpha(0.25, PROFILE) == 0.25
    assert leaky_relu_alpha(0.1, NPUProfile(leaky_relu_alpha_bits=4)) == (2, 4)


def test_hard_sigmoid_condition() -> None:
    assert is_device_hard_sigmoid(1 / 6, 0.5)
    assert not is_device_hard_sigmoid(0.2, 0.5)
    assert not is_device_hard_sigmoid(1 / 6, 0.4)
