"""The dispatcher, and the torch-free guarantees of the algorithms package."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import attrs
import numpy as np
import pytest
from algorithms_models import batches_for, conv_relu_conv, gemm_mlp, mobilenet_block, quantize_for_passes, run

from quant_core.algorithm_config import (
    AdaQuantConfig,
    AdaRoundConfig,
    BiasCorrectionConfig,
    CLEConfig,
    SmoothQuantConfig,
)
from quant_core.presets import get_preset
from quant_onnx.algorithms import apply_reconstruction, run_post_passes, run_pre_passes


def _config(*algorithms):
    return attrs.evolve(get_preset("a8w8"), algorithms=tuple(algorithms))


def test_pre_passes_run_cle_then_smoothquant():
    model = conv_relu_conv()
    batches = batches_for(model)
    result = run_pre_passes(model, _config(SmoothQuantConfig(), CLEConfig(absorb_high_bias=False)), batches)
    assert set(result.reports) == {"cle", "smoothquant"}
    assert result.reports["cle"]["chains"] == [["conv1", "conv2"]]
    np.testing.assert_allclose(run(result.model, batches), run(model, batches), rtol=1e-4, atol=1e-3)


def test_measured_pre_passes_need_data():
    from quant_core.algorithm_config import ActivationEqualizationConfig

    with pytest.raises(ValueError, match="smoothquant needs calibration batches"):
        run_pre_passes(conv_relu_conv(), _config(SmoothQuantConfig()), None)
    with pytest.raises(ValueError, match="activation_equalization needs calibration batches"):
        run_pre_passes(conv_relu_conv(), _config(ActivationEqualizationConfig()), None)


def test_post_passes_bias_correction_then_mixed_precision_hand_on_the_plan():
    from quant_core.algorithm_config import MixedPrecisionConfig

    model = conv_relu_conv()
    batches = batches_for(model, count=2)
    calibrated, qdq = quantize_for_passes(model, batches)
    result = run_post_passes(calibrated, qdq, _config(BiasCorrectionConfig()), batches, quiet=True)
    assert "bias_correction" in result.reports and result.calibrated is calibrated
    config = _config(MixedPrecisionConfig(max_layers=1, target_types=["a16w8"]), BiasCorrectionConfig())
    raised = run_post_passes(calibrated, qdq, config, batches, quiet=True)
    report = raised.reports["mixed_precision"]
    assert len(report["raised"]) == 1
    assert report["final_score"] == pytest.approx(report["search_score"])  # the search scores the real model
    assert report["final_score"] >= report["baseline_score"]
    (layer,) = report["raised"]
    assert raised.calibrated.plan.requants[0].node == layer  # bias correction ran on the raised plan


def test_without_torch_adaround_names_the_extra(monkeypatch):
    import quant_algos._torch as torch_helpers

    real = importlib.util.find_spec
    monkeypatch.setattr(torch_helpers.importlib.util, "find_spec", lambda n, *a: None if n == "torch" else real(n, *a))
    model = conv_relu_conv()
    batches = batches_for(model, count=1)
    calibrated, qdq = quantize_for_passes(model, batches)
    with pytest.raises(ImportError, match=r"AdaRound.*quant-onnx\[torch\]"):
        apply_reconstruction(calibrated, qdq, batches, AdaRoundConfig())
    with pytest.raises(ImportError, match=r"AdaQuant.*quant-onnx\[torch\]"):
        apply_reconstruction(calibrated, qdq, batches, AdaQuantConfig())


def test_importing_the_algorithms_does_not_import_torch():
    code = "import sys, quant_onnx.algorithms; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.parametrize("builder", [conv_relu_conv, mobilenet_block, gemm_mlp])
def test_gptq_lowers_the_output_error_without_torch(builder):
    # GPTQ is numpy: it runs in a process where torch cannot be imported.
    code = f"""
import sys
sys.modules["torch"] = None
sys.path.insert(0, {str(Path(__file__).parent)!r})
import numpy as np
from algorithms_models import batches_for, {builder.__name__}, quantize_for_passes, run
from quant_core.algorithm_config import GPTQConfig
from quant_core.qparams import sqnr_db
from quant_onnx.algorithms import apply_reconstruction
model = {builder.__name__}()
batches = batches_for(model, count=4)
calibrated, qdq = quantize_for_passes(model, batches, per_channel=False, power_of_two=True)
rounded, report = apply_reconstruction(calibrated, qdq, batches, GPTQConfig(), quiet=True)
f = run(model, batches)
layers = report.to_dict()["layers"]
assert report.method == "gptq" and layers and all(l["loss"] <= l["loss_nearest"] for l in layers), layers
assert any(l["loss"] < l["loss_nearest"] for l in layers), layers
print(sqnr_db(f, run(rounded, batches)) - sqnr_db(f, run(qdq, batches)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) > 0.0
