from __future__ import annotations

import numpy as np
import pytest

from quant_algos.adaquant import adaquant_layer
from quant_algos.reconstruction_data import ConvGeometry
from quant_core.algorithm_config import AdaQuantConfig
from quant_core.qparams import QParams, quantize

torch = pytest.importorskip("torch")


def test_reduces_mse_on_linear_layer_with_biased_inputs():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(6, 10)).astype(np.float32)
    b = np.zeros(6, np.float32)
    x = np.abs(rng.normal(size=(512, 10))).astype(np.float32)
    xq = np.floor(x * 2) / 2
    qp = QParams.per_tensor(0.25, 0, "int8")
    cfg = AdaQuantConfig(learning_rate=1e-2, num_iterations=300)
    r = adaquant_layer(w, b, qp, xq, x @ w.T, cfg, quiet=True, seed=1)
    assert r.loss < 0.5 * r.loss_nearest
    assert np.array_equal(quantize(r.weight, qp), r.codes)
    assert not np.array_equal(r.bias, b)
    again = adaquant_layer(w, b, qp, xq, x @ w.T, cfg, quiet=True, seed=1)
    assert np.array_equal(again.codes, r.codes)


def test_conv_with_relu_never_worse_than_nearest():
    rng = np.random.default_rng(1)
    w = (rng.normal(size=(4, 3, 3, 3)) * 0.3).astype(np.float32)
    x = np.abs(rng.normal(size=(8, 3, 6, 6))).astype(np.float32)
    qp = QParams.per_tensor(0.05, 0, "int8")
    r = adaquant_layer(
        w,
        None,
        qp,
        x,
        None,
        AdaQuantConfig(num_iterations=100),
        geometry=ConvGeometry(),
        activation="relu6",
        quiet=True,
    )
    assert r.loss <= r.loss_nearest and r.bias is None
