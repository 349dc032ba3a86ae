from __future__ import annotations

import numpy as np
import pytest

from quant_algos._reconstruction import PoolSettings, make_problem
from quant_algos.adaquant import adaquant_layer
from quant_algos.drivers.reconstruction import reconstruct_layers
from quant_algos.drivers.runner import QuantLayer
from quant_algos.reconstruction_data import ConvGeometry, build_pool
from quant_core.algorithm_config import AdaQuantConfig
from quant_core.qparams import QParams, dequantize, quantize

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


@pytest.mark.parametrize("iterations, checked", [(30, 0), (99, 50)])
def test_the_steps_after_the_last_check_are_kept(iterations, checked):
    # The weights were scored only every 50 steps: 30 steps learned nothing at all (nearest
    # rounding came back), and 99 gave what 50 did.
    rng = np.random.default_rng(0)
    w = rng.normal(size=(6, 10)).astype(np.float32)
    x = np.abs(rng.normal(size=(512, 10))).astype(np.float32)
    xq = np.floor(x * 2) / 2
    qp = QParams.per_tensor(0.25, 0, "int8")

    def learn(steps: int):
        config = AdaQuantConfig(learning_rate=1e-2, num_iterations=steps)
        return adaquant_layer(w, np.zeros(6, np.float32), qp, xq, x @ w.T, config, quiet=True, seed=1)

    r = learn(iterations)
    assert r.iterations == iterations
    assert r.loss < (learn(checked).loss if checked else r.loss_nearest)


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


class _OneLayerRunner:
    """A Gemm whose bias the model keeps as it is (``bias_allowed=False``: e.g. its input
    stays float), fed inputs that upstream quantization shifted."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        w = (rng.normal(size=(6, 10)) * 0.3).astype(np.float32)
        self.bias = rng.normal(size=6).astype(np.float32)
        x = (rng.normal(size=(256, 10)) + rng.normal(size=10)).astype(np.float32)
        self.inputs = (np.round(x * 4) / 4 + 0.1).astype(np.float32)
        self.targets = x @ w.T + self.bias
        qp = QParams.per_tensor(0.02, 0, "int8")
        self.layer = QuantLayer("fc", "Gemm", w, qp, self.bias, None, None, output_channel_axis=1, bias_allowed=False)
        self.codes: np.ndarray | None = None
        self.biases: list[np.ndarray] = []

    num_samples = 256

    def layers(self):
        return [self.layer]

    def quantized_inputs(self, layer):
        yield self.inputs

    def float_outputs(self, layer):
        yield self.targets

    def set_weight_codes(self, layer, codes):
        self.codes = codes

    def set_bias(self, layer, values):
        self.biases.append(values)


@pytest.mark.parametrize("seed", [1, 4])
def test_a_bias_that_cannot_be_written_is_not_learned(seed):
    # The codes used to be learned with a learned bias the model never got: with its own
    # bias they scored worse than nearest rounding, and the report gave the learned loss.
    runner = _OneLayerRunner(seed)
    config = AdaQuantConfig(learning_rate=1e-2, num_iterations=500)
    outcome = reconstruct_layers(runner, config, quiet=True).layers[0]
    assert runner.biases == [] and runner.codes is not None
    pool = build_pool((6, 10), runner.inputs, runner.targets, None)
    _, problem = make_problem(
        torch,
        runner.layer.float_weight,
        runner.bias,
        runner.layer.weight_qparams,
        pool,
        activation=None,
        device="cpu",
        batch_size=config.batch_size,
        settings=PoolSettings(),
    )
    written = problem.full_loss(dequantize(runner.codes, runner.layer.weight_qparams), None)
    assert written <= outcome.loss_nearest
    assert written == pytest.approx(outcome.loss, rel=1e-5)
