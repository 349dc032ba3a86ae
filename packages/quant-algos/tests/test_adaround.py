from __future__ import annotations

import numpy as np
import pytest
from reference_ops import conv2d

from quant_algos.adaround import adaround_layer, beta_at
from quant_algos.reconstruction_data import ConvGeometry
from quant_core.algorithm_config import AdaRoundConfig
from quant_core.errors import ConfigError, ModelError
from quant_core.qparams import QParams, qparams_from_range, quantize, round_values
from quant_core.spec import QuantSpec

torch = pytest.importorskip("torch")

FAST = AdaRoundConfig(num_iterations=300, batch_size=8)


def _conv_problem(seed=0, groups=1, cin=8, cout=8):
    """A conv whose input arrives quantized (coarse grid) while the target is float."""
    rng = np.random.default_rng(seed)
    w = (rng.normal(size=(cout, cin // groups, 3, 3)) * 0.3).astype(np.float32)
    b = rng.normal(size=cout).astype(np.float32) * 0.1
    xf = np.maximum(rng.normal(size=(16, cin, 10, 10)), 0)
    xf = ((xf + np.roll(xf, 1, axis=2) + np.roll(xf, 1, axis=3)) / 3).astype(np.float32)  # spatially correlated
    xq = (np.round(xf / 0.125) * 0.125).astype(np.float32)
    geo = ConvGeometry(pads=(1, 1, 1, 1), strides=(1, 1), groups=groups)
    target = conv2d(xf, w, b, pads=geo.pads, groups=groups).astype(np.float32)
    return w, b, xq, target, geo


def _pow2_per_channel(w):
    spec = QuantSpec(dtype="int8", scale_type="power_of_two", per_channel_axis=0)
    flat = w.reshape(w.shape[0], -1)
    return qparams_from_range(flat.min(1), flat.max(1), spec)


@pytest.mark.parametrize("groups, kind", [(1, "per_tensor"), (8, "pow2_per_channel"), (2, "uint8_asymmetric")])
def test_reduces_output_mse_and_codes_are_floor_or_ceil(groups, kind):
    w, b, xq, target, geo = _conv_problem(groups=groups)
    if kind == "per_tensor":
        qp = QParams.per_tensor(0.05, 0, "int8")
    elif kind == "pow2_per_channel":
        qp = _pow2_per_channel(w)
    else:
        qp = qparams_from_range(float(w.min()), float(w.max()), QuantSpec(dtype="uint8", symmetric=False))
    r = adaround_layer(w, b, qp, xq, target, FAST, geometry=geo, activation="relu", quiet=True)
    assert r.loss < r.loss_nearest and not r.fell_back
    scale = qp.scale.reshape(qp.broadcast_shape(w.ndim))
    low = round_values(w / scale, "floor") + qp.zero_point.reshape(qp.broadcast_shape(w.ndim))
    codes = r.codes.astype(np.float64)
    # floor or ceil, saturated: a power-of-two position may clip the largest weights
    assert np.all((codes == np.clip(low, qp.qmin, qp.qmax)) | (codes == np.clip(low + 1, qp.qmin, qp.qmax)))
    assert np.array_equal(quantize(r.weight, qp), r.codes)  # the float result quantizes to the chosen codes
    assert r.weight.dtype == np.float32 and np.array_equal(r.bias, b)


@pytest.mark.parametrize("zero_point, dtype", [(0, "int8"), (128, "uint8")])
def test_weights_on_the_grid_keep_their_code(zero_point, dtype):
    # Pruned zeros and exact grid values have floor == ceil; a target shifted upward
    # pulls every rounding up, and used to move them a whole step.
    rng = np.random.default_rng(0)
    scale = 0.0625
    w = (rng.normal(size=(4, 12)) * 0.5).astype(np.float32)
    w[:, :4] = 0.0
    w[:, 4:6] = np.float32(scale) * rng.integers(-4, 5, size=(4, 2))
    x = np.abs(rng.normal(size=(256, 12))).astype(np.float32)
    qp = QParams.per_tensor(scale, zero_point, dtype)
    r = adaround_layer(w, None, qp, x, x @ w.T + 0.3, FAST, quiet=True)
    assert not r.fell_back and r.loss < r.loss_nearest
    codes = r.codes.astype(np.float64) - zero_point
    assert np.array_equal(codes[:, :6], w[:, :6] / scale)
    assert np.all((codes == np.floor(w / scale)) | (codes == np.ceil(w / scale)))


def test_an_inf_in_the_data_gives_nearest_rounding_not_floor():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(4, 8)).astype(np.float32)
    x = rng.normal(size=(64, 8)).astype(np.float32)
    x[3, 2] = np.inf
    qp = QParams.per_tensor(0.05, 0, "int8")
    r = adaround_layer(w, None, qp, x, None, AdaRoundConfig(num_iterations=100), quiet=True)
    assert r.fell_back and np.array_equal(r.codes, quantize(w, qp))


def test_deterministic_for_a_seed():
    w, b, xq, target, geo = _conv_problem(seed=3)
    qp = QParams.per_tensor(0.05, 0, "int8")
    one = adaround_layer(w, b, qp, xq, target, FAST, geometry=geo, quiet=True, seed=7)
    two = adaround_layer(w, b, qp, xq, target, FAST, geometry=geo, quiet=True, seed=7)
    assert np.array_equal(one.codes, two.codes) and one.loss == two.loss


def test_linear_layer_without_targets_and_early_stop():
    rng = np.random.default_rng(4)
    w = rng.normal(size=(6, 12)).astype(np.float32)
    x = (rng.normal(size=(512, 12)) @ rng.normal(size=(12, 12))).astype(np.float32)
    qp = QParams.per_tensor(0.1, 0, "int8")
    cfg = AdaRoundConfig(num_iterations=2000, reg_param=1.0, warm_start=0.1, batch_size=64)
    r = adaround_layer(w, None, qp, x, None, cfg, quiet=True)
    assert r.loss <= r.loss_nearest and r.bias is None
    assert r.stopped_early and r.iterations < 2000


def test_beta_schedule():
    cfg = AdaRoundConfig(num_iterations=100, warm_start=0.2, beta_start=20.0, beta_end=2.0)
    assert beta_at(0, cfg) is None and beta_at(19, cfg) is None
    assert beta_at(20, cfg) == 20.0 and beta_at(100, cfg) == pytest.approx(2.0)


def test_bad_arguments_are_named():
    w, b, xq, target, geo = _conv_problem()
    qp = QParams.per_tensor(0.05, 0, "int8")
    with pytest.raises(ValueError, match="activation"):
        adaround_layer(w, b, qp, xq, target, FAST, geometry=geo, activation="gelu", quiet=True)
    bad = qparams_from_range(np.zeros(3), np.ones(3), QuantSpec(dtype="int8", per_channel_axis=0))
    with pytest.raises(ValueError, match="weight_qparams"):
        adaround_layer(w, b, bad, xq, target, FAST, geometry=geo, quiet=True)
    with pytest.raises(ValueError, match="targets"):
        adaround_layer(w, b, qp, xq, target[:, :, :5], FAST, geometry=geo, quiet=True)
    with pytest.raises(ModelError, match="bias: shape"):  # was torch's RuntimeError from a reshape
        adaround_layer(w, b[:-1], qp, xq, target, FAST, geometry=geo, quiet=True)
    if not torch.cuda.is_available():  # a ConfigError naming the field, not a RuntimeError
        with pytest.raises(ConfigError, match="device: 'cuda'"):
            adaround_layer(w, b, qp, xq, target, AdaRoundConfig(device="cuda"), geometry=geo, quiet=True)


@pytest.mark.parametrize("num_threads", [1, 2, None])
def test_the_layer_loop_runs_on_the_configs_thread_count_and_restores_torchs(monkeypatch, num_threads):
    import quant_algos.adaround as adaround_module

    seen = []
    solver = adaround_module._adaround_layer

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return solver(*args, **kwargs)

    monkeypatch.setattr(adaround_module, "_adaround_layer", recording)
    w, b, xq, target, geo = _conv_problem()
    before = torch.get_num_threads()
    config = AdaRoundConfig(num_iterations=20, batch_size=8, num_threads=num_threads)
    adaround_layer(w, b, QParams.per_tensor(0.05, 0, "int8"), xq, target, config, geometry=geo, quiet=True)
    assert seen == [before if num_threads is None else num_threads]
    assert torch.get_num_threads() == before
    assert AdaRoundConfig().num_threads == 1


def test_a_thread_count_below_one_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"num_threads: 0 is out of range; allowed: null or an integer > 0"):
        AdaRoundConfig(num_threads=0)
