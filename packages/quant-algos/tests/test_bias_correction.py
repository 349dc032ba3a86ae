from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_ops import conv2d

from quant_algos.bias_correction import InputMeanAccumulator, MeanErrorAccumulator, correct_bias, weight_rounding_shift
from quant_algos.reconstruction_data import ConvGeometry
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


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    kernel=st.sampled_from([(1, 1), (3, 3), (3, 1), (5, 5)]),
    stride=st.integers(1, 2),
    dilation=st.integers(1, 2),
    pads=st.tuples(*[st.integers(0, 2)] * 4),
    groups=st.sampled_from([1, 2, 4]),
    size=st.tuples(st.integers(5, 9), st.integers(5, 9)),
)
def test_the_analytic_shift_of_a_convolution_is_its_mean_output_over_samples_and_positions(
    seed, kernel, stride, dilation, pads, groups, size
):
    # Padding included: the inputs are not stationary (a ramp plus an offset per channel), so
    # taking each channel's mean for every tap would miss where the taps read padding.
    rng = np.random.default_rng(seed)
    channels = 4
    x = rng.normal(size=(6, channels, *size)) + np.arange(size[1]) / 3.0 + rng.normal(size=(1, channels, 1, 1))
    delta = rng.normal(size=(8, channels // groups, *kernel))
    geometry = ConvGeometry(strides=(stride, stride), pads=pads, dilations=(dilation, dilation), groups=groups)
    span = [dilation * (k - 1) + 1 for k in kernel]
    if any(size[i] + pads[i] + pads[i + 2] < span[i] for i in range(2)):
        return
    expected = conv2d(x, delta, None, (stride, stride), pads, (dilation, dilation), groups).mean(axis=(0, 2, 3))
    acc = InputMeanAccumulator(conv=True)
    acc.update(x[:2])
    acc.update(x[2:])
    np.testing.assert_allclose(weight_rounding_shift(delta, acc.mean(), geometry), expected, rtol=1e-9, atol=1e-9)


def test_the_analytic_shift_of_a_dense_layer_averages_over_samples_and_tokens():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 7, 6)) + rng.normal(size=6)  # [samples, tokens, features]
    delta = rng.normal(size=(3, 6))
    acc = InputMeanAccumulator(conv=False)
    acc.update(x)
    np.testing.assert_allclose(weight_rounding_shift(delta, acc.mean()), (x @ delta.T).mean(axis=(0, 1)), rtol=1e-12)


def test_a_convolution_without_geometry_takes_each_channels_mean_and_its_groups_from_the_input():
    # A 1-D depthwise convolution: no 2-D geometry, groups read from the 4 input channels.
    mean = np.arange(4.0).reshape(4, 1) * np.ones((4, 10))
    delta = np.ones((4, 1, 3))
    np.testing.assert_allclose(weight_rounding_shift(delta, mean), 3.0 * np.arange(4.0))


def test_analytic_errors():
    with pytest.raises(ValueError, match="no inputs"):
        InputMeanAccumulator(conv=True).mean()
    acc = InputMeanAccumulator(conv=True)
    with pytest.raises(ValueError, match="rank 2"):
        acc.update(np.zeros((2, 3)))
    acc.update(np.zeros((2, 3, 4, 4)))
    with pytest.raises(ValueError, match="earlier batches"):  # another channel count
        acc.update(np.zeros((2, 4, 4, 4)))
    acc.update(np.full((2, 3, 4, 4), np.inf))  # it stays in the sum, and the mean says so
    with pytest.raises(ValueError, match="NaN"):
        acc.mean()
    with pytest.raises(ValueError, match="5 channels"):
        weight_rounding_shift(np.zeros((4, 2, 3, 3)), np.zeros((5, 4, 4)))
    with pytest.raises(ValueError, match="does not match"):
        weight_rounding_shift(np.zeros((4, 2)), np.zeros(3))


@pytest.mark.parametrize("conv", [True, False])
def test_input_mean_of_one_sample_runs_and_batches_mixed(conv):
    # A calibration pass hands the accumulator one sample per run (float32 partial sums that
    # fold into float64 every 64 rows) or whole batches (float64 sums): numpy's mean either way.
    rng = np.random.default_rng(3)
    shape = (4, 5, 6) if conv else (7, 3)
    samples = (rng.normal(size=(150, *shape)) * 10 + 3).astype(np.float32)
    acc = InputMeanAccumulator(conv=conv)
    start = 0
    for size in [1] * 70 + [5, 1, 1, 20] + [1] * 53:
        acc.update(samples[start : start + size])
        start += size
    assert start == len(samples)
    x = samples.astype(np.float64)
    expected = x.mean(axis=0) if conv else x.reshape(-1, shape[-1]).mean(axis=0)
    np.testing.assert_allclose(acc.mean(), expected, rtol=1e-6, atol=1e-5)
    with pytest.raises(ValueError, match="earlier batches"):  # another channel (feature) count
        acc.update(np.zeros((1, shape[0] + 1, *shape[1:]) if conv else (1, *shape[:-1], shape[-1] + 1), np.float32))


@pytest.mark.parametrize("first", ["batch", "one_sample"])
def test_a_convolution_input_whose_size_changes_keeps_channel_means(first):
    # Text lines of several widths: no mean map fits them all, so from the first change on
    # each channel's mean over every value (what weight_rounding_shift takes for each tap).
    rng = np.random.default_rng(5)
    widths = [8, 8, 12, 8, 5, 12]
    samples = [
        (rng.normal(size=(2 if first == "batch" and i == 0 else 1, 3, 4, w)) + np.arange(3)[:, None, None]).astype(
            np.float32
        )
        for i, w in enumerate(widths)
    ]
    acc = InputMeanAccumulator(conv=True)
    for x in samples:
        acc.update(x)
    values = np.concatenate([x.transpose(1, 0, 2, 3).reshape(3, -1) for x in samples], axis=1).astype(np.float64)
    np.testing.assert_allclose(acc.mean(), values.mean(axis=1), rtol=1e-6)
    # The shift then takes each channel's mean for every tap.
    delta = rng.normal(size=(2, 3, 3, 3))
    np.testing.assert_allclose(
        weight_rounding_shift(delta, acc.mean()), delta.sum(axis=(2, 3)) @ values.mean(axis=1), rtol=1e-6
    )
    # Sums reduced elsewhere (the ONNX runner's in-graph pass) take the same path.
    summed = InputMeanAccumulator(conv=True)
    for x in samples:
        summed.add(x.sum(axis=0, dtype=np.float64), len(x))
    np.testing.assert_allclose(summed.mean(), values.mean(axis=1), rtol=1e-9)
