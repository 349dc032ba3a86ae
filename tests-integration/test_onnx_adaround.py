"""AdaRound and AdaQuant through quant_onnx on QDQ models (needs torch: runs in the
integration session, where quant-onnx[torch] is installed)."""

from __future__ import annotations

import sys
from pathlib import Path

import attrs
import numpy as np
import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "quant-onnx" / "tests"))

from algorithms_models import batches_for, conv_relu_conv, mobilenet_block, run, write_qdq  # noqa: E402

from quant_core.algorithm_config import AdaQuantConfig, AdaRoundConfig  # noqa: E402
from quant_core.presets import get_preset  # noqa: E402
from quant_core.qparams import round_values  # noqa: E402
from quant_onnx.algorithms import (  # noqa: E402
    apply_adaquant_with_report,
    apply_adaround,
    apply_adaround_with_report,
    run_post_passes,
)
from quant_onnx.algorithms.qdq_layers import find_qdq_layers, match_float_layers  # noqa: E402


def _mse(a, b):
    return float(np.mean((np.asarray(a, np.float64) - b) ** 2))


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    model = mobilenet_block(seed=2)
    batches = batches_for(model, count=4, batch=16)
    qdq = write_qdq(model, batches, per_channel=False, power_of_two=True)
    return model, batches, qdq


def test_adaround_lowers_output_error_and_codes_stay_within_floor_and_ceil(case):
    model, batches, qdq = case
    config = AdaRoundConfig(num_iterations=400, batch_size=16)
    out, report = apply_adaround_with_report(model, qdq, batches, config, quiet=True)
    reference = run(model, batches)
    assert _mse(run(out, batches), reference) < _mse(run(qdq, batches), reference)
    assert [o.name for o in report.layers] == ["conv1", "dw", "conv3", "fc"]
    assert all(o.loss <= o.loss_nearest for o in report.layers)
    changed = 0
    for pair in match_float_layers(model, out)[0]:
        qp = pair.layer.weight_qparams_oi()
        ratio = pair.float_weight / qp.scale.reshape(qp.broadcast_shape(pair.float_weight.ndim))
        lo = np.clip(round_values(ratio, "floor"), qp.qmin, qp.qmax)
        hi = np.clip(round_values(ratio, "ceil"), qp.qmin, qp.qmax)
        codes = pair.layer.weight_oi().astype(np.float64)
        assert np.all((codes == lo) | (codes == hi)), pair.layer.name
        nearest = next(p for p in find_qdq_layers(qdq) if p.name == pair.layer.name).weight_oi()
        changed += int(np.count_nonzero(codes != nearest))
    assert changed > 0
    # Only weight codes changed: same graph, same biases.
    assert [n.op_type for n in out.graph.node] == [n.op_type for n in qdq.graph.node]


def test_adaquant_learns_weights_and_biases(case):
    model, batches, qdq = case
    config = AdaQuantConfig(num_iterations=300, learning_rate=1e-3, batch_size=16)
    out, report = apply_adaquant_with_report(model, qdq, batches, config, quiet=True)
    reference = run(model, batches)
    assert _mse(run(out, batches), reference) < _mse(run(qdq, batches), reference)
    assert all(o.loss <= o.loss_nearest for o in report.layers)


def test_adaround_through_the_dispatcher_and_num_samples():
    model = conv_relu_conv()
    batches = batches_for(model, count=2, batch=8)
    qdq = write_qdq(model, batches)
    config = attrs.evolve(get_preset("a8w8"), algorithms=(AdaRoundConfig(num_iterations=50, num_samples=8),))
    result = run_post_passes(model, qdq, config, batches, quiet=True)
    assert [o["name"] for o in result.reports["adaround"]["layers"]] == ["conv1", "conv2"]
    direct = apply_adaround(model, qdq, batches[:1], AdaRoundConfig(num_iterations=50, num_samples=8), quiet=True)
    assert direct.SerializeToString() == result.model.SerializeToString()  # deterministic, first 8 samples
