from __future__ import annotations

import numpy as np
import pytest
from reference_ops import conv2d

from quant_algos.bias_correction import MeanErrorAccumulator, correct_bias
from quant_core.algorithm_config import BiasCorrectionConfig
from quant_core.qparams import QParams, fake_quantize


def _quantized_conv_outputs(rng, batches):
    """Float and weight-quantized outputs of one conv (the quantized one is biased)."""
    w = rng.normal(size=(5, 3, 3, 3)).astype(np.float32)
    b = rng.normal(size=5).astype(np.float32)
    wq = fake_quantize(w, QParams.per_tensor(0.2, 0, "int8"))
    xs = [np.abs(rng.normal(size=(4, 3, 6, 6))).astype(np.float32) for _ in range(batches)]
    return b, [(conv2d(x, w, b, pads=(1, 1, 1, 1)), conv2d(x, wq, b, pads=(1, 1, 1, 1))) for x in xs], (w, wq, xs)


def test_correction_zeroes_mean_error_nchw():
    rng = np.random.default_rng(0)
    bias, pairs, (w, wq, xs) = _quantized_conv_outputs(rng, 3)
    new_bias = correct_bias(bias, pairs, channel_axis=1)
    errors = []
    for x in xs:
        f = conv2d(x, w, bias, pads=(1, 1, 1, 1))
        q = conv2d(x, wq, new_bias, pads=(1, 1, 1, 1))
        errors.append(q - f)
    mean = np.concatenate(errors).mean(axis=(0, 2, 3))
    assert np.max(np.abs(mean)) < 1e-5
    assert not np.allclose(new_bias, bias)


@pytest.mark.parametrize("axis", [1, -1])
def test_2d_and_channels_last(axis):
    rng = np.random.default_rng(1)
    f = rng.normal(size=(50, 7))
    q = f + rng.normal(size=(50, 7)) * 0.1 + np.arange(7) * 0.01
    if axis == -1:
        f, q = f.reshape(5, 10, 7), q.reshape(5, 10, 7)
    acc = MeanErrorAccumulator(channel_axis=axis)
    acc.update(f, q)
    bias = np.zeros(7, np.float32)
    corrected = acc.corrected_bias(bias)
    assert np.allclose((q + (corrected - bias)).reshape(-1, 7).mean(0) - f.reshape(-1, 7).mean(0), 0.0, atol=1e-6)
    assert corrected.dtype == np.float32


def test_streaming_equals_one_batch_and_merge():
    rng = np.random.default_rng(2)
    f = rng.normal(size=(12, 3, 4, 4))
    q = f + rng.normal(size=f.shape)
    whole = MeanErrorAccumulator()
    whole.update(f, q)
    parts = [MeanErrorAccumulator() for _ in range(3)]
    for i, acc in enumerate(parts):
        acc.update(f[i * 4 : (i + 1) * 4], q[i * 4 : (i + 1) * 4])
    merged = parts[0].merge(parts[1]).merge(parts[2])
    assert np.allclose(merged.mean_error(), whole.mean_error(), atol=1e-12)
    assert merged.count == whole.count == 12 * 16


def test_num_samples_limit():
    f = np.zeros((4, 2))
    batches = [(f, f + 1.0), (f, f + 3.0)]
    assert correct_bias(None, batches, BiasCorrectionConfig(num_samples=6)).tolist() == pytest.approx([-5 / 3, -5 / 3])
    assert correct_bias(None, batches).tolist() == pytest.approx([-2.0, -2.0])


def test_errors():
    acc = MeanErrorAccumulator()
    with pytest.raises(ValueError, match="no outputs"):
        acc.mean_error()
    with pytest.raises(ValueError, match="shape"):
        acc.update(np.zeros((2, 3)), np.zeros((2, 4)))
    acc.update(np.zeros((2, 3)), np.ones((2, 3)))
    with pytest.raises(ValueError, match="earlier batches had 3"):
        acc.update(np.zeros((2, 4)), np.zeros((2, 4)))
    with pytest.raises(ValueError, match="NaN"):
        acc.update(np.full((2, 3), np.nan), np.zeros((2, 3)))
    with pytest.raises(ValueError, match="bias"):
        acc.corrected_bias(np.zeros(5))
