from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from reference_ops import conv2d

from quant_algos.smoothquant import (
    ActivationAbsMax,
    scale_weight_inputs,
    smooth_layers,
    smoothquant_scales,
    weight_absmax,
)
from quant_core.algorithm_config import SmoothQuantConfig


def _outlier_activations(rng, n=64, k=8):
    x = rng.normal(size=(n, k))
    x[:, 3] *= 50.0  # one outlier channel
    return x


@given(st.floats(0.0, 1.0), st.integers(0, 2**31 - 1))
def test_matmul_function_unchanged(alpha, seed):
    rng = np.random.default_rng(seed)
    x = _outlier_activations(rng)
    w = rng.normal(size=(8, 5))  # MatMul [in, out]
    acc = ActivationAbsMax(channel_axis=-1)
    for part in np.split(x, 4):
        acc.update(part)
    r = smooth_layers(acc.absmax(), [(w, 0)], SmoothQuantConfig(alpha=alpha))
    assert np.allclose((x * r.input_multiplier) @ r.weights[0], x @ w, rtol=1e-9, atol=1e-9)


def test_outlier_channel_reduced():
    rng = np.random.default_rng(0)
    x = _outlier_activations(rng)
    w = rng.normal(size=(8, 5))
    acc = ActivationAbsMax()
    acc.update(x)
    r = smooth_layers(acc.absmax(), [(w, 0)], SmoothQuantConfig(alpha=0.5))
    before = np.abs(x).max(0)
    after = np.abs(x * r.input_multiplier).max(0)
    assert after.max() / after.min() < before.max() / before.min()
    assert after[3] < before[3] / 3


def test_gemm_and_conv_layouts_and_shared_activation():
    rng = np.random.default_rng(1)
    x = np.abs(rng.normal(size=(2, 6, 5, 5)))
    x[:, 2] *= 30
    conv_w = rng.normal(size=(4, 6, 1, 1))
    gemm_w = rng.normal(size=(3, 6))  # Gemm transB=1 [out, in]
    acc = ActivationAbsMax(channel_axis=1)
    acc.update(x)
    r = smooth_layers(acc.absmax(), [(conv_w, 1), (gemm_w, 1)], SmoothQuantConfig(alpha=0.5))
    xs = x * r.input_multiplier.reshape(1, -1, 1, 1)
    assert np.allclose(conv2d(xs, r.weights[0]), conv2d(x, conv_w))
    pooled, pooled_s = x.mean(axis=(2, 3)), xs.mean(axis=(2, 3))
    assert np.allclose(pooled_s @ r.weights[1].T, pooled @ gemm_w.T)
    joint = np.maximum(weight_absmax(conv_w, 1), weight_absmax(gemm_w, 1))
    assert np.allclose(r.scales, smoothquant_scales(acc.absmax(), joint, 0.5))


def test_dead_channels_and_errors():
    s = smoothquant_scales(np.array([0.0, 4.0]), np.array([1.0, 0.0]), 0.5)
    assert s.tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="alpha"):
        smoothquant_scales(np.ones(2), np.ones(2), 1.5)
    with pytest.raises(ValueError, match="channels"):
        smoothquant_scales(np.ones(2), np.ones(3), 0.5)
    with pytest.raises(ValueError, match="no activations"):
        ActivationAbsMax().absmax()
    with pytest.raises(ValueError, match="at least one"):
        smooth_layers(np.ones(2), [], SmoothQuantConfig())
    acc_a, acc_b = ActivationAbsMax(), ActivationAbsMax()
    acc_a.update(np.array([[1.0, -5.0]]))
    acc_b.update(np.array([[-3.0, 2.0]]))
    assert acc_a.merge(acc_b).absmax().tolist() == [3.0, 5.0]
    assert scale_weight_inputs(np.ones((2, 2), np.float32), np.array([2.0, 3.0]), 1).dtype == np.float32
