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


@given(
    widths=st.lists(st.integers(3, 9), min_size=2, max_size=5),
    pads=st.integers(0, 1),
    max_rows=st.sampled_from([12, 10_000]),
    seed=st.integers(0, 2**31 - 1),
)
def test_samples_of_several_sizes_fill_the_pool_with_matching_rows(widths, pads, max_rows, seed):
    # Text lines of several widths, one width per batch: every pool row is filled, each is a
    # patch with its own conv output, and once sizes differ the later samples share the rows.
    from quant_algos.reconstruction_data import PoolBuilder

    rng = np.random.default_rng(seed)
    w = rng.normal(size=(4, 3, 3, 3)).astype(np.float32)
    geo = ConvGeometry(pads=(pads,) * 4)
    batches = [rng.normal(size=(2, 3, 5, width)).astype(np.float32) + 1.0 for width in widths]
    row_bytes = 4 * (w[0].size + 4)
    builder = PoolBuilder(w.shape, geo, 2 * len(widths), with_targets=True, max_pool_bytes=max_rows * row_bytes)
    for x in batches:
        builder.add(x, conv2d(x, w, None, geo.strides, geo.pads, geo.dilations, 1).astype(np.float32))
    pool = builder.pool()
    assert np.all(np.isfinite(pool.patches)) and np.all(np.abs(pool.patches).sum(axis=2) > 0)  # no row left empty
    from_patches = np.einsum("gpk,gok->gpo", pool.patches.astype(np.float64), w.reshape(1, 4, -1).astype(np.float64))
    assert np.allclose(from_patches, pool.targets, atol=1e-4)
    if len(set(widths)) == 1:  # one size: the pool of the whole set, as build_pool draws it
        whole = np.concatenate(batches)
        y = conv2d(whole, w, None, geo.strides, geo.pads, geo.dilations, 1).astype(np.float32)
        reference = build_pool(w.shape, whole, y, geo, max_pool_bytes=max_rows * row_bytes)
        np.testing.assert_array_equal(pool.patches, reference.patches)
