"""quant-torch-fx's 16-bit export in onnxruntime: the a16w8 QDQ model (uint16 activations,
which the TorchScript exporter cannot type and the export writes itself) runs in the default
session and with every optimisation off, both within one output step of the frozen model."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

from quant_torch_fx import ModelQuantizer  # noqa: E402
from quant_torch_fx.export import onnx_model  # noqa: E402
from quant_torch_fx.prepare import activation_quantizers  # noqa: E402


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, groups=8, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, 5),
    ).eval()


def test_a16w8_export_runs_in_onnxruntime_as_the_frozen_model() -> None:
    generator = torch.Generator().manual_seed(1)
    calibration = [torch.randn(16, 3, 8, 8, generator=generator) for _ in range(3)]
    q = ModelQuantizer("a16w8", quiet=True)
    frozen = q.freeze(q.quantize_model(_net(), torch.randn(1, 3, 8, 8), calibration))
    proto = onnx_model(frozen, (torch.randn(1, 3, 8, 8),))
    x = torch.randn(7, 3, 8, 8, generator=generator)
    with torch.no_grad():
        expected = frozen(x).numpy()
    step = float(dict(activation_quantizers(frozen))["linear"].current_qparams().scale)
    for level in (ort.GraphOptimizationLevel.ORT_ENABLE_ALL, ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
        options = ort.SessionOptions()
        options.graph_optimization_level = level
        session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
        (got,) = session.run(None, {"input": x.numpy()})
        assert np.max(np.abs(got - expected)) <= step * (1 + 1e-6), level
