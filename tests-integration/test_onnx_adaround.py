"""AdaRound and AdaQuant through quant_onnx (quant_algos' reconstruction driver over the
ONNX runner; needs torch: runs in the integration session, where quant-onnx[torch] is
installed)."""

from __future__ import annotations

import sys
from pathlib import Path

import attrs
import numpy as np
import pytest
from onnx import numpy_helper

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "quant-onnx" / "tests"))

from algorithms_models import (  # noqa: E402
    batches_for,
    conv_relu_conv,
    matmul_mlp,
    mobilenet_block,
    quantize_for_passes,
    run,
    stored_weight_codes,
)

from quant_core.algorithm_config import AdaQuantConfig, AdaRoundConfig  # noqa: E402
from quant_core.presets import get_preset  # noqa: E402
from quant_core.qparams import round_values  # noqa: E402
from quant_onnx.algorithms import OnnxLayerRunner, apply_reconstruction, run_post_passes  # noqa: E402


def _mse(a, b):
    return float(np.mean((np.asarray(a, np.float64) - b) ** 2))


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    model = mobilenet_block(seed=2)
    batches = batches_for(model, count=4, batch=16)
    calibrated, qdq = quantize_for_passes(model, batches, per_channel=False, power_of_two=True)
    return model, batches, calibrated, qdq


def test_adaround_lowers_output_error_and_codes_stay_within_floor_and_ceil(case):
    model, batches, calibrated, qdq = case
    config = AdaRoundConfig(num_iterations=400, batch_size=16)
    out, report = apply_reconstruction(calibrated, qdq, batches, config, quiet=True)
    reference = run(model, batches)
    assert _mse(run(out, batches), reference) < _mse(run(qdq, batches), reference)
    assert [o.name for o in report.layers] == ["conv1", "dw", "conv3", "fc"]
    assert all(o.loss <= o.loss_nearest for o in report.layers)
    changed = 0
    for layer in OnnxLayerRunner(calibrated, qdq, batches).layers():
        qp = layer.weight_qparams  # the plan's, with its rounding, range and position
        ratio = layer.float_weight / qp.scale.reshape(qp.broadcast_shape(layer.float_weight.ndim))
        lo = np.clip(round_values(ratio, "floor"), qp.qmin, qp.qmax)
        hi = np.clip(round_values(ratio, "ceil"), qp.qmin, qp.qmax)
        stored = stored_weight_codes(out, layer.name).astype(np.float64)
        codes = stored.T if stored.shape != lo.shape else stored
        assert np.all((codes == lo) | (codes == hi)), layer.name
        nearest = stored_weight_codes(qdq, layer.name).astype(np.float64)
        changed += int(np.count_nonzero(stored != nearest))
    assert changed > 0
    # Only weight codes changed: same graph, same biases.
    assert [n.op_type for n in out.graph.node] == [n.op_type for n in qdq.graph.node]


def test_adaquant_learns_weights_and_biases(case):
    model, batches, calibrated, qdq = case
    config = AdaQuantConfig(num_iterations=300, learning_rate=1e-3, batch_size=16)
    out, report = apply_reconstruction(calibrated, qdq, batches, config, quiet=True)
    reference = run(model, batches)
    assert _mse(run(out, batches), reference) < _mse(run(qdq, batches), reference)
    assert all(o.loss <= o.loss_nearest for o in report.layers)


def test_adaround_through_the_dispatcher_and_num_samples():
    model = conv_relu_conv()
    batches = batches_for(model, count=2, batch=8)
    calibrated, qdq = quantize_for_passes(model, batches)
    config = attrs.evolve(get_preset("a8w8"), algorithms=(AdaRoundConfig(num_iterations=50, num_samples=8),))
    result = run_post_passes(calibrated, qdq, config, batches, quiet=True)
    assert [o["name"] for o in result.reports["adaround"]["layers"]] == ["conv1", "conv2"]
    direct, _ = apply_reconstruction(
        calibrated, qdq, batches[:1], AdaRoundConfig(num_iterations=50, num_samples=8), quiet=True
    )
    assert direct.SerializeToString() == result.model.SerializeToString()  # deterministic, first 8 samples


@pytest.mark.parametrize("config", [AdaRoundConfig(num_iterations=300, batch_size=16), AdaQuantConfig()])
def test_a_bias_added_after_a_matmul_is_part_of_the_target(config):
    # An exporter writes a linear layer over tokens as MatMul then Add. The runner compares
    # the MatMul's output, without the bias; the problem adds the bias, so the target must
    # have it too, or the bias is an error the learned rounding bends every weight to cancel.
    model = matmul_mlp(sizes=(12, 16, 4))
    for tensor in model.graph.initializer:
        if tensor.name in ("b1", "b2"):  # biases far above what rounding a weight moves
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor) * 20.0, tensor.name))
    batches = batches_for(model, count=4, batch=16)
    calibrated, qdq = quantize_for_passes(model, batches)
    out, report = apply_reconstruction(calibrated, qdq, batches, config, quiet=True)
    reference = run(model, batches)
    assert _mse(run(out, batches), reference) <= _mse(run(qdq, batches), reference)
    for outcome in report.layers:  # what nearest rounding leaves is small against the bias
        assert outcome.loss_nearest < 1.0, outcome
    if isinstance(config, AdaRoundConfig):
        for layer in ("fc1", "fc2"):
            moved = stored_weight_codes(out, layer) != stored_weight_codes(qdq, layer)
            assert moved.mean() < 0.25, (layer, moved.mean())
