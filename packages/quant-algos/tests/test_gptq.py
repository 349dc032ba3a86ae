"""GPTQ's rounding: nearest where inputs are uncorrelated, the least-squares compensation of
each column's error otherwise, the plan's grid kept (per channel, per tensor, power of two)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quant_algos.gptq import gptq_codes, gptq_pool
from quant_algos.reconstruction_data import ConvGeometry, build_pool
from quant_core.algorithm_config import GPTQConfig
from quant_core.qparams import QParams, dequantize, qparams_from_range, quantize
from quant_core.spec import QuantSpec


def _per_channel(w: np.ndarray, power_of_two: bool = False) -> QParams:
    spec = QuantSpec(
        dtype="int8",
        symmetric=True,
        per_channel_axis=0,
        scale_type="power_of_two" if power_of_two else "float",
        narrow_range=power_of_two,
    )
    amax = np.abs(w.reshape(w.shape[0], -1)).max(axis=1)
    return qparams_from_range(-amax, amax, spec)


def _correlated(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    mix = rng.normal(size=(k, k)) + 2.0 * np.eye(k)
    return (rng.normal(size=(rows, k)) @ mix).astype(np.float64)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), out=st.integers(1, 6), k=st.integers(1, 12))
def test_uncorrelated_inputs_give_nearest_rounding(seed, out, k):
    # A diagonal Hessian: no column's error can be offset by another's.
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(out, k))
    qp = _per_channel(w)
    hessian = np.diag(rng.uniform(0.5, 2.0, size=k))
    np.testing.assert_array_equal(gptq_codes(w, hessian, qp, damping=0.01), quantize(w, qp))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), out=st.integers(1, 5))
def test_two_columns_the_second_absorbs_the_least_squares_share_of_the_firsts_error(seed, out):
    # Independent of GPTQ's Cholesky form: minimising ||X (w - q)^T||^2 over the second
    # column once the first is rounded moves it by err_0 * H[1, 0] / H[1, 1].
    rng = np.random.default_rng(seed)
    x = _correlated(rng, 64, 2)
    w = rng.normal(size=(out, 2))
    qp = _per_channel(w)
    hessian = x.T @ x
    damped = hessian + 0.01 * np.mean(np.diag(hessian)) * np.eye(2)
    first = quantize(w[:, :1], qp)
    error = w[:, 0] - dequantize(first, qp)[:, 0]
    second = quantize((w[:, 1] + error * damped[1, 0] / damped[1, 1])[:, None], qp)
    expected = np.concatenate([first, second], axis=1)
    np.testing.assert_array_equal(gptq_codes(w, hessian, qp, damping=0.01), expected)


@pytest.mark.parametrize("power_of_two", [False, True])
def test_gptq_lowers_the_output_error_and_keeps_the_grid(power_of_two):
    rng = np.random.default_rng(0)
    wins = 0
    for _ in range(20):
        x = _correlated(rng, 256, 16)
        w = rng.normal(size=(8, 16)) * rng.uniform(0.1, 1.0, size=(8, 1))
        qp = _per_channel(w, power_of_two)
        codes = gptq_codes(w, x.T @ x, qp, damping=0.01)
        assert codes.dtype == np.int8 and codes.min() >= (-127 if power_of_two else -128) and codes.max() <= 127
        gptq = np.sum((x @ (w - dequantize(codes, qp)).T) ** 2)
        nearest = np.sum((x @ (w - dequantize(quantize(w, qp), qp)).T) ** 2)
        wins += gptq < nearest
    assert wins >= 18


def test_groups_round_as_each_group_alone():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(3, 4, 5))  # 3 groups of 4 rows
    hessians = np.stack([(lambda x: x.T @ x)(_correlated(rng, 40, 5)) for _ in range(3)])
    qp = _per_channel(w.reshape(12, 5))
    together = gptq_codes(w, hessians, qp, damping=0.01)
    for g in range(3):
        rows = slice(4 * g, 4 * g + 4)
        alone = qp.evolve(scale=qp.scale[rows], zero_point=np.asarray(qp.zero_point)[rows])
        np.testing.assert_array_equal(together[g], gptq_codes(w[g], hessians[g], alone, damping=0.01))


def test_an_input_that_is_always_zero_rounds_its_weight_to_nearest():
    rng = np.random.default_rng(2)
    x = _correlated(rng, 64, 4)
    x[:, 2] = 0.0
    w = rng.normal(size=(3, 4))
    qp = _per_channel(w)
    codes = gptq_codes(w, x.T @ x, qp, damping=0.01)
    np.testing.assert_array_equal(codes[:, 2], quantize(w, qp)[:, 2])
    with pytest.raises(ValueError, match="does not fit"):
        gptq_codes(w, np.eye(3), qp, damping=0.01)


def test_the_pool_solver_reports_both_errors_and_never_returns_a_worse_rounding():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(4, 6, 7, 7)).astype(np.float32) + np.linspace(0, 1, 7, dtype=np.float32)
    w = (rng.normal(size=(8, 3, 3, 3)) * 0.3).astype(np.float32)  # groups of 2: 3 inputs each
    geometry = ConvGeometry(pads=(1, 1, 1, 1), groups=2)
    pool = build_pool(w.shape, x, None, geometry)
    qp = _per_channel(w)
    result = gptq_pool(w, None, qp, pool, GPTQConfig())
    assert result.codes.shape == w.shape and result.loss <= result.loss_nearest
    np.testing.assert_array_equal(quantize(result.weight, qp), result.codes)
    # The errors are the pool's output errors, computed here from the patches themselves.
    patches = pool.patches.astype(np.float64)
    for codes, loss in ((quantize(w, qp), result.loss_nearest), (result.codes, result.loss)):
        delta = (w - dequantize(codes, qp)).reshape(2, 4, -1)
        direct = sum(np.sum((patches[g] @ delta[g].T) ** 2) for g in range(2)) / patches.shape[1]
        assert loss == pytest.approx(direct, rel=1e-6)
    assert not result.fell_back and result.loss < result.loss_nearest


def test_act_order_rounds_the_largest_inputs_first_and_returns_codes_in_place():
    rng = np.random.default_rng(4)
    x = _correlated(rng, 128, 6) * np.array([0.1, 3.0, 1.0, 0.5, 2.0, 0.2])  # inputs of unequal size
    hessian = x.T @ x
    w = rng.normal(size=(4, 6))
    qp = _per_channel(w)
    order = np.argsort(-np.diag(hessian), kind="stable")  # [1, 4, 2, 3, 5, 0]
    by_hand = gptq_codes(w[:, order], hessian[np.ix_(order, order)], qp, damping=0.01)
    expected = np.empty_like(by_hand)
    expected[:, order] = by_hand
    np.testing.assert_array_equal(gptq_codes(w, hessian, qp, damping=0.01, act_order=True), expected)
    grouped = gptq_codes(
        np.stack([w, w]), np.stack([hessian, hessian]), _per_channel(np.vstack([w, w])), damping=0.01, act_order=True
    )
    np.testing.assert_array_equal(grouped[1], expected)


def test_gptq_refuses_scales_along_the_input_axis():
    # The solver's rows are output channels: per-column scales gave codes up to 127 off.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype(np.float32)
    w = rng.normal(size=(4, 4)).astype(np.float32)
    amax = np.abs(w).max(axis=0)
    qp = qparams_from_range(-amax, amax, QuantSpec(dtype="int8", per_channel_axis=1))
    pool = build_pool(w.shape, x, None, None)
    with pytest.raises(ValueError, match="axis"):
        gptq_pool(w, None, qp, pool, GPTQConfig())
