"""Auto mixed precision on QDQ models: the known-sensitive layer is raised."""

from __future__ import annotations

import numpy as np
import pytest
from algorithms_models import batches_for, outlier_mlp, run, write_qdq

from quant_core.algorithm_config import MixedPrecisionConfig, PrecisionTarget
from quant_core.qparams import sqnr_db
from quant_onnx.algorithms.mixed_precision import apply_mixed_precision


@pytest.fixture(scope="module")
def setup():
    model = outlier_mlp()
    batches = batches_for(model, count=4, batch=16)
    calls = []

    def quantize_fn(overrides):
        calls.append(dict(overrides))
        wide = [name for name, t in overrides.items() if t is PrecisionTarget.A16W8]
        return write_qdq(model, batches, per_channel=True, wide_inputs=wide)

    return model, batches, quantize_fn, calls


def test_the_sensitive_layer_is_raised_and_the_target_met(setup):
    model, batches, quantize_fn, calls = setup
    base_sqnr = sqnr_db(run(model, batches), run(quantize_fn({}), batches))
    target = base_sqnr + 10.0
    out, report = apply_mixed_precision(
        model, quantize_fn, batches, MixedPrecisionConfig(target_types=["a16w8"], accuracy_target=target), quiet=True
    )
    assert report.raised == {"fc2": "a16w8"}
    assert report.target_met and report.final_score >= target
    assert max(report.sensitivity, key=report.sensitivity.get) == "fc2"
    assert calls[-1] == {"fc2": PrecisionTarget.A16W8}  # the quantizer wrote the final model
    assert sqnr_db(run(model, batches), run(out, batches)) == pytest.approx(report.final_score, abs=1e-6)
    assert abs(report.search_score - report.final_score) < 3.0  # the rewrite predicts the quantizer


def test_max_layers_and_weight_targets(setup):
    model, batches, quantize_fn, _ = setup
    _, report = apply_mixed_precision(
        model, quantize_fn, batches, MixedPrecisionConfig(target_types=["a8w16", "a16w16"], max_layers=1), quiet=True
    )
    assert len(report.raised) == 1 and report.target_met is None
    assert report.size_ratio > 1.0  # 16-bit weights grow the model


def test_user_evaluate_metric(setup):
    model, batches, quantize_fn, _ = setup
    reference = run(model, batches)

    def evaluate(m):
        return -float(np.mean((run(m, batches) - reference) ** 2))

    config = MixedPrecisionConfig(target_types=["a16w8"], metric="evaluate", max_layers=1)
    _, report = apply_mixed_precision(model, quantize_fn, batches, config, evaluate=evaluate, quiet=True)
    assert report.raised == {"fc2": "a16w8"}
    with pytest.raises(ValueError, match="evaluate"):
        apply_mixed_precision(model, quantize_fn, batches, config, quiet=True)
