from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from reference_ops import conv2d

from quant_algos.reconstruction_data import ConvGeometry, build_pool


@given(
    groups=st.sampled_from([1, 2, 4]),
    stride=st.integers(1, 2),
    dilation=st.integers(1, 2),
    pads=st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(0, 2), st.integers(0, 2)),
    kernel=st.sampled_from([1, 3]),
    seed=st.integers(0, 2**31 - 1),
    max_rows=st.sampled_from([10, 10_000]),
)
def test_pool_rows_are_conv_outputs(groups, stride, dilation, pads, kernel, seed, max_rows):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(4, 8 // groups, kernel, kernel)).astype(np.float32)
    x = rng.normal(size=(3, 8, 7, 6)).astype(np.float32)
    geo = ConvGeometry(strides=(stride, stride), pads=pads, dilations=(dilation, dilation), groups=groups)
    y = conv2d(x, w, None, geo.strides, geo.pads, geo.dilations, groups).astype(np.float32)
    row_bytes = 4 * (groups * w[0].size + 4)
    pool = build_pool(w.shape, x, y, geo, max_pool_bytes=max_rows * row_bytes, seed=seed)
    g, p, k = pool.patches.shape
    assert (g, k) == (groups, w[0].size) and p == min(max_rows, y.shape[0] * y.shape[2] * y.shape[3])
    wg = w.reshape(groups, 4 // groups, k)
    from_patches = np.einsum("gpk,gok->gpo", pool.patches.astype(np.float64), wg.astype(np.float64))
    assert np.allclose(from_patches, pool.targets, atol=1e-4)


def test_gemm_pool_with_extra_dims_and_errors():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3, 5)).astype(np.float32)
    x = rng.normal(size=(4, 6, 5)).astype(np.float32)
    pool = build_pool(w.shape, x, x @ w.T, None)
    assert pool.patches.shape == (1, 24, 5) and pool.rows_per_sample == 6
    assert np.allclose(pool.patches[0] @ w.T, pool.targets[0], atol=1e-5)
    with pytest.raises(ValueError, match="targets"):
        build_pool(w.shape, x, np.zeros((4, 6, 4)), None)
    with pytest.raises(ValueError, match="input features"):
        build_pool(w.shape, x[..., :4], None, None)
    with pytest.raises(ValueError, match="ConvGeometry"):
        build_pool((3, 5, 1, 1), x, None, None)
    with pytest.raises(ValueError, match="groups=2"):
        build_pool((4, 3, 1, 1), np.zeros((1, 5, 2, 2)), None, ConvGeometry(groups=2))
    with pytest.raises(ValueError, match="pads"):
        ConvGeometry(pads=(1, 1))
