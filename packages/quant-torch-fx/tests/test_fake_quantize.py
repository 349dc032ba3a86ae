import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quant_core.dtypes import INTEGER_DTYPES
from quant_core.qparams import fake_quantize as np_fake_quantize
from quant_core.qparams import qparams_from_range
from quant_core.spec import QuantSpec, RoundMode, ScaleType
from quant_torch_fx import fake_quantize


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from([d for d in INTEGER_DTYPES if d.bits <= 16]),
    symmetric=st.booleans(),
    scale_type=st.sampled_from(list(ScaleType)),
    rounding=st.sampled_from(list(RoundMode)),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_numpy_reference_bit_exactly(dtype, symmetric, scale_type, rounding, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((4, 3, 5)) * rng.uniform(0.01, 10)).astype(np.float32)
    spec = QuantSpec(dtype=dtype, symmetric=symmetric, scale_type=scale_type, rounding=rounding)
    qp = qparams_from_range(float(x.min()) * 0.8, float(x.max()) * 0.8, spec)
    expected = np_fake_quantize(x, qp, rounding)
    got = fake_quantize(torch.from_numpy(x), qp, rounding).numpy()
    np.testing.assert_array_equal(got, expected)


def test_per_channel_axis_broadcasts():
    x = np.random.default_rng(0).standard_normal((8, 4, 3, 3)).astype(np.float32)
    spec = QuantSpec(dtype="int8", per_channel_axis=0)
    qp = qparams_from_range(x.min(axis=(1, 2, 3)), x.max(axis=(1, 2, 3)), spec)
    np.testing.assert_array_equal(fake_quantize(torch.from_numpy(x), qp).numpy(), np_fake_quantize(x, qp))


def test_onnxruntime_is_not_imported():
    import sys

    assert "onnxruntime" not in sys.modules
    pytest.importorskip("torch")
