"""The Vitis AI ``pytorch_nndct``-style flow (``quant_npu.vitis``, the ``[torch]`` extra):
calibration and test mode in separate processes through ``output_dir``, QAT, bad input.
Skipped where torch is not installed (the ONNX-only install)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("quant_torch_fx")

import onnxruntime as ort  # noqa: E402

import quant_npu  # noqa: E402
from quant_npu.vitis import QatProcessor, torch_quantizer  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from vitis_flow import Net, build  # noqa: E402


def _run_mode(mode: str, out: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(HERE / "vitis_flow.py"), mode, str(out)],
        capture_output=True,
        text=True,
        env=os.environ.copy(),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def _onnx_outputs(path: Path, x: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


def _output_step(onnx_path: Path) -> float:
    """The quantization step of the model's output (its last DequantizeLinear's scale)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(onnx_path))
    output = model.graph.output[0].name
    node = next(n for n in model.graph.node if output in n.output)
    assert node.op_type == "DequantizeLinear", node.op_type
    scale = next(i for i in model.graph.initializer if i.name == node.input[1])
    return float(numpy_helper.to_array(scale))


@pytest.fixture(scope="module")
def calib_then_test(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("quantize_result")
    _run_mode("calib", out)
    calib_files = {p.name: p.read_bytes() for p in out.iterdir()}
    _run_mode("test", out)
    (out / "calib_quant_info.json").write_bytes(calib_files["quant_info.json"])
    return out


def test_calib_writes_config_qparams_and_quant_info(calib_then_test: Path) -> None:
    out = calib_then_test
    config = json.loads((out / "quant_config.json").read_text())
    assert config["name"] == "xint8"
    qparams = json.loads((out / "qparams.json").read_text())
    assert qparams["model"] == {"class": "Net", "input_shapes": [[1, 3, 12, 12]]}
    names = set(qparams["graphs"][0])
    assert {"weight:conv1/conv2d", "weight:fc/linear"} <= names
    assert all(entry["fix_pos"] is not None for entry in qparams["graphs"][0].values())  # power-of-two: xint8
    info = json.loads((out / "calib_quant_info.json").read_text())
    assert set(info) >= {"param", "input", "output", "fast_finetuned"} and info["param"] and info["output"]
    assert all(value[0][0] == 8 for section in ("param", "input", "output") for value in info[section].values())


def test_test_mode_computes_what_calibration_computed(calib_then_test: Path) -> None:
    calib = np.load(calib_then_test / "calib_outputs.npy")
    test = np.load(calib_then_test / "test_outputs.npy")
    np.testing.assert_array_equal(test, calib)
    net, _, _, evaluation = build()
    with torch.no_grad():
        float_out = net(evaluation).numpy()
    assert not np.array_equal(test, float_out)  # quantized, not the float model
    assert np.abs(test - float_out).max() < 0.25 * np.abs(float_out).max()


def test_exported_onnx_is_legal_and_agrees(calib_then_test: Path) -> None:
    out = calib_then_test
    onnx_path = out / "Net_int.onnx"
    assert quant_npu.check(onnx_path, "xint8").ok
    report = json.loads((out / "legalize_report.json").read_text())
    assert report["ok"] and report["target"] == "xint8"
    evaluation = np.load(out / "evaluation.npy")
    test = np.load(out / "test_outputs.npy")
    onnx_out = _onnx_outputs(onnx_path, evaluation)
    step = _output_step(onnx_path)
    # Legalisation requantizes the int32 biases to the profile's int8 and gives the global
    # pool its input's coarser position (legalize_report.json): the device model differs from
    # the torch model by a few output steps, out of outputs about a hundred steps large.
    assert np.abs(onnx_out - test).max() <= 4 * step
    assert np.abs(test).max() > 50 * step
    # Both processes describe the same device model.
    assert (out / "quant_info.json").read_bytes() == (out / "calib_quant_info.json").read_bytes()


# ------------------------------------------------------------------------------------ QAT
def test_qat_trains_and_deploys(tmp_path: Path) -> None:
    net, example, calib, evaluation = build()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    processor = QatProcessor(net, (example,), quiet=True)
    trainable = processor.trainable_model(calib_loader=calib)
    assert trainable.training
    optimizer = torch.optim.Adam(trainable.parameters(), lr=1e-3)
    with torch.no_grad():
        targets = net(torch.cat(calib))
    losses = []
    for _ in range(3):
        for batch, target in zip(calib, targets.split(8), strict=True):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(trainable(batch), target)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    assert losses[-1] < losses[0]
    deployable = processor.to_deployable(trainable, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "Net_int.onnx", "legalize_report.json", "quant_config.json", "quant_info.json"
    ]  # fmt: skip
    assert quant_npu.check(tmp_path / "Net_int.onnx", "xint8").ok
    with torch.no_grad():
        frozen_out = deployable(evaluation).numpy()
    onnx_out = _onnx_outputs(tmp_path / "Net_int.onnx", evaluation.numpy())
    assert np.abs(onnx_out - frozen_out).max() <= 4 * _output_step(tmp_path / "Net_int.onnx")
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())  # the input model is unchanged


# --------------------------------------------------------------------------------- errors
def _net() -> tuple[Net, torch.Tensor, list[torch.Tensor]]:
    net, example, calib, _ = build()
    return net, example, calib


def _one_line(excinfo: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_bad_quant_mode() -> None:
    net, example, _ = _net()
    with pytest.raises(ValueError) as excinfo:
        torch_quantizer("float", net, (example,))
    assert _one_line(excinfo) == "quant_mode: 'float' is not allowed; allowed: calib, test"


def test_test_mode_without_calibration_files(tmp_path: Path) -> None:
    net, example, _ = _net()
    with pytest.raises(ValueError) as excinfo:
        torch_quantizer("test", net, (example,), output_dir=tmp_path)
    assert _one_line(excinfo).startswith(f"output_dir: '{tmp_path / 'quant_config.json'}' does not exist")


def test_wrong_input_shapes(tmp_path: Path) -> None:
    net, example, _ = _net()
    with pytest.raises(ValueError) as excinfo:
        torch_quantizer("calib", net, (torch.randn(1, 5, 12, 12),), output_dir=tmp_path)
    assert _one_line(excinfo).startswith("input_args: the module does not run on inputs of shapes [[1, 5, 12, 12]]")
    with pytest.raises(ValueError) as excinfo:
        torch_quantizer("calib", net, "images", output_dir=tmp_path)
    assert "input_args: str is not allowed" in _one_line(excinfo)
    quantizer = torch_quantizer("calib", net, (example,), output_dir=tmp_path, quiet=True)
    with pytest.raises(ValueError) as excinfo:
        quantizer.quant_model(torch.randn(2, 3, 10, 10))
    assert _one_line(excinfo).endswith(
        "has shape [2, 3, 10, 10]; expected [N, 3, 12, 12] (the example input's shape, any batch size N)"
    )
    with pytest.raises(ValueError) as excinfo:
        QatProcessor(net, torch.randn(1, 3))
    assert _one_line(excinfo).startswith("inputs: the module does not run on inputs of shapes [[1, 3]]")


def test_test_mode_refuses_other_shapes_and_configs(tmp_path: Path) -> None:
    net, example, calib = _net()
    quantizer = torch_quantizer("calib", net, (example,), output_dir=tmp_path, quiet=True)
    for batch in calib:
        quantizer.quant_model(batch)
    quantizer.export_quant_config()
    import onnx

    exported = torch_quantizer("test", net, (example,), output_dir=tmp_path, quiet=True).export_onnx_model(
        tmp_path / "opset17", opset_version=17
    )
    assert exported == tmp_path / "opset17" / "Net_int.onnx"
    assert [o.version for o in onnx.load(str(exported)).opset_import if o.domain in ("", "ai.onnx")] == [17]
    with pytest.raises(ValueError) as excinfo:
        torch_quantizer("test", net, (torch.randn(1, 3, 16, 16),), output_dir=tmp_path)
    assert _one_line(excinfo).startswith(
        "input_args: shapes [[1, 3, 16, 16]] differ from the calibration's [[1, 3, 12, 12]]"
    )
    with pytest.raises(ValueError) as excinfo:
        torch_quantizer("test", net, (example,), output_dir=tmp_path, quant_config_file="a8w8")
    assert _one_line(excinfo).startswith("quant_config_file: differs from the config calibration used")
    with pytest.raises(ValueError) as excinfo:
        torch_quantizer("test", torch.nn.Sequential(net), (example,), output_dir=tmp_path)
    assert _one_line(excinfo).startswith("module: Sequential is not the model calibrated into")


def test_mode_specific_calls_and_arguments(tmp_path: Path) -> None:
    net, example, _ = _net()
    quantizer = torch_quantizer("calib", net, (example,), output_dir=tmp_path, quiet=True)
    with pytest.raises(ValueError) as excinfo:
        quantizer.export_quant_config()
    assert _one_line(excinfo).startswith("export_quant_config: quant_model has not run on any data")
    with pytest.raises(ValueError) as excinfo:
        quantizer.export_onnx_model()
    assert _one_line(excinfo).startswith("export_onnx_model: not allowed with quant_mode 'calib'; allowed in 'test'")
    with pytest.raises(ValueError) as excinfo:
        quantizer.load_ft_param()
    assert _one_line(excinfo).startswith("load_ft_param: not allowed with quant_mode 'calib'")
    for kwargs, start in [
        ({"bitwidth": 4}, "bitwidth: 4 is not allowed; allowed: 8"),
        ({"target": "tpu"}, "target: "),
        ({"device": "quantum"}, "device: 'quantum' is not allowed"),
        ({"quant_config_file": "missing.json"}, "quant_config_file: 'missing.json' does not exist"),
        ({"quant_config_file": "int3"}, "quant_config_file: preset: 'int3' is not a known preset"),
        ({"state_dict_file": tmp_path / "none.pth"}, "state_dict_file: "),
    ]:
        with pytest.raises(ValueError) as excinfo:
            torch_quantizer("calib", net, (example,), output_dir=tmp_path, **kwargs)
        assert _one_line(excinfo).startswith(start), (kwargs, str(excinfo.value))
    with pytest.raises(ValueError) as excinfo:
        QatProcessor(net, example).to_deployable(net, tmp_path)
    assert _one_line(excinfo).startswith("trained_model: Net holds no quantized graph")


def test_state_dict_file_loads_the_float_weights(tmp_path: Path) -> None:
    net, example, _ = _net()
    trained = Net()
    torch.save(trained.state_dict(), tmp_path / "float.pth")
    quantizer = torch_quantizer("calib", net, (example,), str(tmp_path / "float.pth"), tmp_path, quiet=True)
    assert torch.equal(quantizer.module.conv1.weight, trained.conv1.weight)
    assert not torch.equal(net.conv1.weight, trained.conv1.weight)  # the given module is unchanged


def test_fast_finetune_then_load_ft_param_in_test_mode(tmp_path: Path) -> None:
    """Vitis AI's order: calib, fast_finetune (AdaRound over the batches the user's function
    feeds), export_quant_config; then test mode with load_ft_param computes what the
    finetuned calib model computed."""
    net, example, calib = _net()
    quantizer = torch_quantizer("calib", net, (example,), output_dir=tmp_path, quiet=True)
    for batch in calib:
        quantizer.quant_model(batch)
    calls: list[int] = []
    quantizer.fast_finetune(
        lambda model, data: calls.append(len(data)) or [model(b) for b in data], (quantizer.quant_model, calib)
    )
    assert calls == [len(calib)] and quantizer.fast_finetuned and (tmp_path / "fast_finetune.pth").is_file()
    quantizer.export_quant_config()
    with torch.no_grad():
        finetuned = quantizer.quant_model(calib[0])
    tester = torch_quantizer("test", net, (example,), output_dir=tmp_path, quiet=True)
    tester.load_ft_param()
    with torch.no_grad():
        torch.testing.assert_close(tester.quant_model(calib[0]), finetuned, rtol=0, atol=0)
