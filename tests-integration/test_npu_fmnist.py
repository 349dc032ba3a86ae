"""quant-npu on the trained Fashion-MNIST reference models: quant_onnx's xint8 output
legalises, simulates bit-exactly against onnxruntime where the rounding agrees, and
every shipped preset either passes check or check names why.

Accuracy and speed targets are measured in tools/bench/npu.py, never here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import quant_onnx  # noqa: E402
from quant_core.presets import get_preset, list_presets  # noqa: E402
from quant_npu import NPUSimulator, check, export_quant_info, import_quant_info, legalize_model  # noqa: E402

MODELS = REPO_ROOT / "tools" / "models"


def _data():
    data = pytest.importorskip("tools.reference_models.data")
    try:
        train, _ = data.load_fashion_mnist("train")
        test, labels = data.load_fashion_mnist("test")
    except (FileNotFoundError, OSError) as exc:
        pytest.skip(f"Fashion-MNIST not available: {exc}")
    return train[:256], test[:500], labels[:500]


@pytest.fixture(scope="module")
def data():
    return _data()


def _ort(model, x: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


@pytest.fixture(scope="module", params=["fmnist_resnet18", "fmnist_mobilenetv2"])
def npu_model(request, data):
    calibration, _, _ = data
    quantized = quant_onnx.quantize(MODELS / f"{request.param}.onnx", None, "xint8", calibration, quiet=True).model
    result = legalize_model(quantized)
    return request.param, quantized, result


def test_xint8_output_legalises(npu_model) -> None:
    _name, quantized, result = npu_model
    assert set(check(quantized).counts()) <= {"bias_format", "shared_position", "shift_cut"}
    assert result.remaining.ok, result.remaining.format_text()


def test_simulation_is_bit_exact_with_onnxruntime(npu_model, data) -> None:
    _name, _quantized, result = npu_model
    _, test, _labels = data
    expected = _ort(result.model, test)
    (onnx_mode,) = NPUSimulator(result.model, rounding="onnx").run(test, quiet=True).values()
    np.testing.assert_array_equal(onnx_mode, expected)
    (device,) = NPUSimulator(result.model).run(test, quiet=True).values()
    agreement = float(np.mean(device.argmax(1) == expected.argmax(1)))
    assert agreement > 0.9  # half-up ties move some logits; the bench reports the figure


def test_quant_info_round_trip(npu_model, data) -> None:
    _name, _quantized, result = npu_model
    _, test, _ = data
    info = export_quant_info(result.model)
    imported = import_quant_info(result.model, info)
    assert imported.unmatched == () and imported.not_in_file == ()
    np.testing.assert_array_equal(_ort(imported.model, test[:64]), _ort(result.model, test[:64]))


@pytest.mark.parametrize("preset", list_presets())
def test_every_preset_passes_or_check_names_why(preset: str, data) -> None:
    calibration, _, _ = data
    config = get_preset(preset).evolve(algorithms=())  # formats only; AdaRound's rounding is not the question
    quantized = quant_onnx.quantize(MODELS / "fmnist_resnet18.onnx", None, config, calibration[:64], quiet=True).model
    result = check(quantized)
    npu_formats = preset in ("xint8", "xint8_u8", "xint8_int8_bias", "int8_cnn_cle", "xint8_adaround")
    if npu_formats:
        assert set(result.counts()) <= {"bias_format", "shared_position", "shift_cut"}
        if preset == "xint8_int8_bias":  # quantized in the device's bias format: nothing to convert
            assert "bias_format" not in result.counts(), result.counts()
    else:
        assert {"power_of_two", "symmetric", "activation_format"} & set(result.counts()), result.counts()
    assert legalize_model(quantized).remaining.ok
