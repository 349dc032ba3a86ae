"""Torch fake quantization against quant_core's numpy reference, bit for bit."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quant_core.dtypes import INTEGER_DTYPES, DType
from quant_core.qparams import QParams, qparams_from_range
from quant_core.qparams import fake_quantize as np_fake_quantize
from quant_core.qparams import quantize as np_quantize
from quant_core.spec import QuantSpec, RoundMode, ScaleType
from quant_torch_fx import fake_quantize
from quant_torch_fx.fake_quantize import quantize_codes

F32 = np.float32


def _adversarial(scale: float) -> np.ndarray:
    """Ties (k + 0.5 steps) and their float32 neighbours, +-0.49999997, huge, subnormal,
    signed zeros, infinities and NaN, all in units of ``scale``."""
    ties = np.array([k + 0.5 for k in range(-6, 6)], np.float64)
    halves = (ties * scale).astype(F32)
    around = np.concatenate([np.nextafter(halves, F32(np.inf)), np.nextafter(halves, F32(-np.inf)), halves])
    specials = np.array(
        [0.49999997, -0.49999997, 0.5, -0.5, 1.5, -2.5, 3e38, -3e38, 1e-45, -1e-45, 0.0, -0.0, np.inf, -np.inf, np.nan],
        F32,
    )
    return np.concatenate([around, specials * F32(scale), specials]).astype(F32)


def _check(x: np.ndarray, qp: QParams) -> None:
    expected = np_fake_quantize(x, qp)
    got = fake_quantize(torch.from_numpy(x), qp).numpy()
    np.testing.assert_array_equal(got.view(np.int32), expected.view(np.int32))  # bit patterns, -0.0 included
    codes = quantize_codes(torch.from_numpy(x), qp).numpy().astype(np.float64)
    np.testing.assert_array_equal(codes, np_quantize(x, qp).astype(np.float64))


@pytest.mark.parametrize("mode", list(RoundMode))
@pytest.mark.parametrize("dtype", [d for d in INTEGER_DTYPES])
@pytest.mark.parametrize("scale", [1.0, 0.125, 0.1, 3.0517578125e-05])
def test_adversarial_values_match_the_reference(mode: RoundMode, dtype: DType, scale: float) -> None:
    zero_point = 0 if dtype.signed else (dtype.qmax + 1) // 2
    qp = QParams.per_tensor(scale, zero_point, dtype, rounding=mode)
    _check(_adversarial(scale), qp)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(list(INTEGER_DTYPES)),
    symmetric=st.booleans(),
    scale_type=st.sampled_from(list(ScaleType)),
    rounding=st.sampled_from(list(RoundMode)),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_numpy_reference_bit_exactly(dtype, symmetric, scale_type, rounding, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((4, 3, 5)) * rng.uniform(0.01, 10)).astype(F32)
    spec = QuantSpec(dtype=dtype, symmetric=symmetric, scale_type=scale_type, rounding=rounding)
    qp = qparams_from_range(float(x.min()) * 0.8, float(x.max()) * 0.8, spec)
    _check(np.concatenate([x.reshape(-1), _adversarial(float(qp.scale))]), qp)


def test_per_channel_axis_broadcasts():
    x = np.random.default_rng(0).standard_normal((8, 4, 3, 3)).astype(F32)
    spec = QuantSpec(dtype="int8", per_channel_axis=0, rounding="half_away")
    qp = qparams_from_range(x.min(axis=(1, 2, 3)), x.max(axis=(1, 2, 3)), spec)
    _check(x, qp)


def test_onnxruntime_is_not_imported():
    import sys

    assert "onnxruntime" not in sys.modules
