"""The dispatcher, and the torch-free guarantees of the algorithms package."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import attrs
import numpy as np
import pytest
from algorithms_models import batches_for, conv_relu_conv, run, write_qdq

from quant_core.algorithm_config import (
    AdaQuantConfig,
    AdaRoundConfig,
    BiasCorrectionConfig,
    CLEConfig,
    SmoothQuantConfig,
)
from quant_core.presets import get_preset
from quant_onnx.algorithms import adaround as adaround_module
from quant_onnx.algorithms import apply_adaquant, apply_adaround, run_post_passes, run_pre_passes


def _config(*algorithms):
    return attrs.evolve(get_preset("a8w8"), algorithms=tuple(algorithms))


def test_pre_passes_run_cle_then_smoothquant():
    model = conv_relu_conv()
    batches = batches_for(model)
    result = run_pre_passes(model, _config(SmoothQuantConfig(), CLEConfig(absorb_high_bias=False)), batches)
    assert set(result.reports) == {"cle", "smoothquant"}
    assert result.reports["cle"]["chains"] == [["conv1", "conv2"]]
    np.testing.assert_allclose(run(result.model, batches), run(model, batches), rtol=1e-4, atol=1e-3)


def test_smoothquant_needs_data():
    with pytest.raises(ValueError, match="SmoothQuant needs calibration batches"):
        run_pre_passes(conv_relu_conv(), _config(SmoothQuantConfig()), None)


def test_post_passes_bias_correction_and_mixed_precision_without_the_quantizer():
    from quant_core.algorithm_config import MixedPrecisionConfig

    model = conv_relu_conv()
    batches = batches_for(model, count=2)
    qdq = write_qdq(model, batches)
    result = run_post_passes(model, qdq, _config(BiasCorrectionConfig()), batches, quiet=True)
    assert "bias_correction" in result.reports
    # Without a quantizer the search's rewrite of the QDQ model is the result.
    raised = run_post_passes(model, qdq, _config(MixedPrecisionConfig(max_layers=1)), batches, quiet=True)
    report = raised.reports["mixed_precision"]
    assert len(report["raised"]) == 1
    assert report["final_score"] == pytest.approx(report["search_score"])
    assert report["final_score"] >= report["baseline_score"]


def test_without_torch_adaround_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        adaround_module.importlib.util, "find_spec", lambda n, *a: None if n == "torch" else real(n, *a)
    )
    model = conv_relu_conv()
    batches = batches_for(model, count=1)
    qdq = write_qdq(model, batches)
    with pytest.raises(ImportError, match=r"quant-onnx\[torch\]"):
        apply_adaround(model, qdq, batches, AdaRoundConfig())
    with pytest.raises(ImportError, match=r"AdaQuant.*quant-onnx\[torch\]"):
        apply_adaquant(model, qdq, batches, AdaQuantConfig())


def test_importing_the_algorithms_does_not_import_torch():
    code = "import sys, quant_onnx.algorithms; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
