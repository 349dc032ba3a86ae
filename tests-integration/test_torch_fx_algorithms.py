"""A config's algorithms in both backends (quant-torch-fx and quant-onnx on the
torch.onnx export of the same model), and the torch backend's AdaRound model exported
to QDQ and run by onnxruntime.

"Comparable" for one config JSON in both backends means here: CLE's equalized float
weights equal within 1e-5 (the same driver decides on the same graph), the calibrated
weight scales equal, AdaRound's learned codes equal for at least 95% of the weights
(each backend's float arithmetic differs by roundings, which can flip a code whose
soft rounding sat at one half), and output SQNR against the float model within 1 dB.
"""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
quant_onnx = pytest.importorskip("quant_onnx")

import onnx  # noqa: E402
from onnx import numpy_helper  # noqa: E402

from quant_core.algorithm_config import AdaRoundConfig, CLEConfig  # noqa: E402
from quant_core.presets import get_preset  # noqa: E402
from quant_core.serialization import load_config, save_config  # noqa: E402
from quant_onnx.algorithms import run_pre_passes  # noqa: E402
from quant_torch_fx import ModelQuantizer  # noqa: E402
from quant_torch_fx.algorithms import TorchLayerRunner  # noqa: E402
from quant_torch_fx.prepare import activation_quantizers  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "torch_fx_test_models", Path(__file__).resolve().parents[1] / "packages/quant-torch-fx/tests/models.py"
)
assert _spec is not None and _spec.loader is not None
models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(models)

EXAMPLE = torch.zeros(1, 3, 8, 8)
ADAROUND = AdaRoundConfig(num_iterations=300, num_samples=64)


@pytest.fixture(scope="module")
def setup():
    net = models.mobile_block_net()
    calibration = models.images(4, batch=16)
    test = torch.cat(models.images(4, batch=16, seed=7))
    buffer = io.BytesIO()
    torch.onnx.export(
        net, (EXAMPLE,), buffer, dynamo=False, opset_version=17, do_constant_folding=False,
        input_names=["input"], output_names=["output"], dynamic_axes={"input": {0: "n"}, "output": {0: "n"}},
    )  # fmt: skip
    return net, calibration, test, onnx.load_from_string(buffer.getvalue())


def _feeds(calibration):
    return [{"input": x.numpy()} for x in calibration]


def _onnx_weights(model: onnx.ModelProto) -> list[np.ndarray]:
    """Float Conv/Gemm weights in ``[out, in, ...]`` layout, graph order."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    out = []
    for node in model.graph.node:
        if node.op_type in ("Conv", "Gemm"):
            w = inits[node.input[1]]
            trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
            out.append(w.T if node.op_type == "Gemm" and not trans_b else w)
    return out


def _sqnr(y: np.ndarray, reference: np.ndarray) -> float:
    return float(10 * np.log10(np.mean(reference**2) / np.mean((y - reference) ** 2)))


def test_cle_gives_the_weights_quant_onnx_gives(setup) -> None:
    net, calibration, _test, exported = setup
    config = get_preset("xint8").evolve(algorithms=(CLEConfig(),))
    q = ModelQuantizer(config, quiet=True)
    torch_layers = TorchLayerRunner(q.quantize_model(net, EXAMPLE, calibration), []).layers()
    onnx_q = quant_onnx.ModelQuantizer(config, quiet=True)
    prepared = onnx_q.prepare(exported)
    equalized = run_pre_passes(prepared.model, config, _feeds(calibration))
    assert equalized.reports["cle"]["chains"]
    onnx_w = _onnx_weights(equalized.model)
    plain = _onnx_weights(prepared.model)
    assert len(onnx_w) == len(torch_layers) == 4
    assert any(not np.allclose(a, b, atol=1e-3) for a, b in zip(onnx_w, plain, strict=True))  # CLE changed them
    for layer, expected in zip(torch_layers, onnx_w, strict=True):
        np.testing.assert_allclose(layer.float_weight, expected, rtol=1e-5, atol=1e-5, err_msg=layer.name)


def test_one_config_json_with_algorithms_gives_comparable_models(setup, tmp_path: Path) -> None:
    net, calibration, test, exported = setup
    path = tmp_path / "xint8_cle_adaround.json"
    save_config(get_preset("xint8").evolve(algorithms=(CLEConfig(), ADAROUND)), path)
    config = load_config(path)
    with torch.no_grad():
        reference = net(test).numpy()
    onnx_result = quant_onnx.quantize(exported, None, config, _feeds(calibration), quiet=True)
    session = ort.InferenceSession(onnx_result.model.SerializeToString(), providers=["CPUExecutionProvider"])
    onnx_out = session.run(None, {"input": test.numpy()})[0]
    q = ModelQuantizer(config, quiet=True)
    frozen = q.freeze(q.quantize_model(net, EXAMPLE, calibration))
    with torch.no_grad():
        torch_out = frozen(test).numpy()
    torch_codes = _codes(q.export_onnx(frozen, EXAMPLE, tmp_path / "torch.onnx"))
    onnx_codes = _codes(onnx_result.model)
    assert len(torch_codes) == len(onnx_codes) == 4
    for (c1, s1), (c2, s2) in zip(torch_codes, onnx_codes, strict=True):
        np.testing.assert_allclose(s1, s2, rtol=1e-5)
        assert np.mean(c1 == c2) >= 0.95
    assert abs(_sqnr(torch_out, reference) - _sqnr(onnx_out, reference)) < 1.0


def _codes(model: onnx.ModelProto | Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """(weight codes ``[out, in, ...]``, weight scale) of each Conv/Gemm, graph order."""
    proto = onnx.load(str(model)) if isinstance(model, Path) else model
    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    producers = {out: n for n in proto.graph.node for out in n.output}
    rows = []
    for node in proto.graph.node:
        if node.op_type in ("Conv", "Gemm"):
            dq = producers[node.input[1]]
            codes = inits[dq.input[0]].astype(np.int64)
            trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
            rows.append((codes.T if node.op_type == "Gemm" and not trans_b else codes, inits[dq.input[1]]))
    return rows


def test_adaround_model_exports_and_runs_in_onnxruntime_within_one_output_step(setup, tmp_path: Path) -> None:
    net, calibration, test, _exported = setup
    q = ModelQuantizer(get_preset("xint8").evolve(algorithms=(ADAROUND,)), quiet=True)
    frozen = q.freeze(q.quantize_model(net, EXAMPLE, calibration))
    path = q.export_onnx(frozen, EXAMPLE, tmp_path / "adaround.onnx")
    with torch.no_grad():
        expected = frozen(test).numpy()
    step = float(dict(activation_quantizers(frozen))["linear"].current_qparams().scale)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    got = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(
        None, {"input": test.numpy()}
    )[0]
    assert np.abs(np.rint(got / step) - np.rint(expected / step)).max() <= 1


@pytest.mark.parametrize("seed", [0, 1])
def test_qat_learned_power_of_two_scales_export_exactly(setup, tmp_path: Path, seed: int) -> None:
    """TQT moves every log2 threshold during training; wherever they land (here each is
    moved by -2..+1 steps), the exported model computes what the frozen model does, in
    onnxruntime's reference nodes and its integer kernels (regression for the QAT
    MobileNetV2 fidelity report: the export was exact for every such draw)."""
    net, calibration, test, _exported = setup
    q = ModelQuantizer("xint8", quiet=True)
    qat = q.prepare_qat(net, EXAMPLE, calib_loader=calibration)
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for fq in qat.modules():
            learned = getattr(fq, "learned", None)
            if isinstance(learned, torch.nn.Parameter):
                learned.add_(torch.from_numpy(rng.integers(-2, 2, size=tuple(learned.shape)).astype(np.float32)))
    frozen = q.freeze(qat)
    path = q.export_onnx(frozen, EXAMPLE, tmp_path / "qat.onnx")
    with torch.no_grad():
        expected = frozen(test).numpy()
    step = float(dict(activation_quantizers(frozen))["linear"].current_qparams().scale)
    for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
        options = ort.SessionOptions()
        options.graph_optimization_level = level
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        got = session.run(None, {"input": test.numpy()})[0]
        assert np.abs(np.rint(got / step) - np.rint(expected / step)).max() <= 1, level
