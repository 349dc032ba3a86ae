"""quant-torch-fx's 16-bit export in onnxruntime: the a16w8 QDQ model (uint16 activations,
which the TorchScript exporter cannot type and the export writes itself) runs in the default
session and with every optimisation off, both within one output step of the frozen model,
a convolution net and a linear over tokens (whose MatMul onnxruntime would otherwise rewrite
into MatMulNBits) alike."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

from quant_torch_fx import ModelQuantizer  # noqa: E402
from quant_torch_fx.export import onnx_model  # noqa: E402
from quant_torch_fx.export_fidelity import output_tolerance  # noqa: E402


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


def _tokens_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16)).eval()


@pytest.mark.parametrize(("make", "sample"), [(_net, (3, 8, 8)), (_tokens_net, (4, 64))], ids=["conv", "tokens"])
def test_a16w8_export_runs_in_onnxruntime_as_the_frozen_model(make, sample, tmp_path) -> None:
    generator = torch.Generator().manual_seed(1)
    calibration = [torch.randn(16, *sample, generator=generator) for _ in range(3)]
    q = ModelQuantizer("a16w8", quiet=True)
    frozen = q.freeze(q.quantize_model(make(), torch.randn(1, *sample), calibration))
    proto = onnx_model(frozen, (torch.randn(1, *sample),))
    x = torch.randn(7, *sample, generator=generator)
    with torch.no_grad():
        expected = frozen(x).numpy()
    step = output_tolerance(proto)  # the output is float (the result tail): one input step through the last layer
    assert step is not None
    for level in (ort.GraphOptimizationLevel.ORT_ENABLE_ALL, ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
        options = ort.SessionOptions()
        options.graph_optimization_level = level
        options.optimized_model_filepath = str(tmp_path / f"optimized_{int(level)}.onnx")
        session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
        (got,) = session.run(None, {"input": x.numpy()})
        assert np.max(np.abs(got - expected)) <= step * (1 + 1e-6), level
        ran = {n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node}
        assert "MatMulNBits" not in ran
