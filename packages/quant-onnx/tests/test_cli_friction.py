"""The five points a new user tripped over, each as a command-line test: external data
outside the model's folder, Ctrl-C, ``inspect`` on quantized models, the output location
checked first, and the small things (shapes documented, progress totals, the summary,
presets in ``--help``, aligned ``compare`` columns)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from cli_helpers import read_only_folder, run_cli, screen_lines, snapshot
from conftest import conv_bn_relu_model, identity_weight_model
from model_builders import random_inputs, small_cnn
from onnx import TensorProto, helper, numpy_helper

import quant_onnx.api
from quant_core.presets import list_presets
from quant_onnx.cli.main import main

REPO = Path(__file__).resolve().parents[3]


def _one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = screen_lines(captured.err)
    assert len(lines) == 1, lines
    assert lines[0].startswith("quant-onnx: error: "), lines
    return lines[0]


@pytest.fixture
def calib(tmp_path) -> Path:
    path = tmp_path / "calib.npy"
    np.save(path, random_inputs(small_cnn(), 12))
    return path


@pytest.fixture
def float_model(tmp_path) -> Path:
    path = tmp_path / "float.onnx"
    onnx.save(small_cnn(), path)
    return path


# --- 1. external data ------------------------------------------------------------------------------
def _external_models(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """A model folder whose external data is fine, plus one model per way of pointing it
    elsewhere: label -> (model path, text the error must contain)."""
    folder = tmp_path / "models"
    folder.mkdir()
    onnx.save_model(small_cnn(), folder / "ok.onnx", save_as_external_data=True, location="ok.data", size_threshold=0)
    outside = tmp_path / "outside.data"
    outside.write_bytes((folder / "ok.data").read_bytes())  # right size, wrong place
    (folder / "link.data").symlink_to(outside)
    template = onnx.load(str(folder / "ok.onnx"), load_external_data=False)
    cases = {
        "dotdot": ("../../etc/passwd", "points outside the model's folder"),
        "absolute": ("/etc/passwd", "is an absolute path"),
        "symlink": ("link.data", "leads outside the model's folder"),
        "missing": ("gone.data", "file not found"),
    }
    models = {}
    for label, (location, needle) in cases.items():
        model = onnx.ModelProto()
        model.CopyFrom(template)
        for entry in model.graph.initializer[0].external_data:
            if entry.key == "location":
                entry.value = location
        path = folder / f"{label}.onnx"
        onnx.save(model, path)
        models[label] = (path, needle)
    return models


def test_external_data_outside_the_folder_is_refused_by_our_check(tmp_path, calib, float_model, capsys, monkeypatch):
    def onnx_reads_it(*_args, **_kwargs):
        raise AssertionError("onnx was asked to read external data before our check refused it")

    monkeypatch.setattr(onnx.external_data_helper, "load_external_data_for_model", onnx_reads_it)
    models = _external_models(tmp_path)
    before = snapshot(tmp_path)
    first_tensor = onnx.load(str(models["missing"][0]), load_external_data=False).graph.initializer[0].name
    for label, (path, needle) in models.items():
        out = tmp_path / f"{label}.q.onnx"
        commands = {
            "quantize": ["quantize", str(path), str(out), "--calib-data", str(calib)],
            "inspect": ["inspect", str(path)],
            "compare": ["compare", str(path), str(float_model), "--data", str(calib)],
        }
        for command, argv in commands.items():
            assert main(argv) == 2, (label, command)
            line = _one_error_line(capsys)
            assert needle in line and f"tensor '{first_tensor}'" in line and path.name in line, (label, command, line)
            assert not out.exists()
    assert snapshot(tmp_path) == before


def test_external_data_inside_the_folder_still_works(tmp_path, calib, capsys) -> None:
    path = _external_models(tmp_path)["dotdot"][0].parent / "ok.onnx"
    out = tmp_path / "q.onnx"
    assert main(["quantize", str(path), str(out), "--calib-data", str(calib), "--quiet"]) == 0
    assert main(["inspect", str(path)]) == 0
    onnx.checker.check_model(onnx.load(str(out)))


# --- 2. Ctrl-C -------------------------------------------------------------------------------------
def test_ctrl_c_exits_130_with_one_line_and_no_file(tmp_path, calib, float_model) -> None:
    out = tmp_path / "q.onnx"
    before = snapshot(tmp_path)
    # SIGINT at the second onnxruntime run: inside calibration, its progress bar on screen.
    result = run_cli(
        "quantize", str(float_model), str(out), "--calib-data", str(calib), "--batch-size", "2",
        target="onnxruntime:InferenceSession.run", k=2,
    )  # fmt: skip
    assert result.returncode == 130, result.stderr
    assert screen_lines(result.stderr) == ["quant-onnx: interrupted; no partial file was left"]
    assert "Traceback" not in result.stderr
    assert snapshot(tmp_path) == before  # no output, no temp file, the input untouched


# --- 3. inspect on quantized models ----------------------------------------------------------------
def test_inspect_recognises_qdq_models_and_their_formats(tmp_path, calib, float_model, capsys) -> None:
    expected = {
        "a8w8": ("int8 per-channel symmetric, scales not powers of two", "uint8 per-tensor asymmetric"),
        # onnxruntime's x86 kernels take uint8: xint8's int8 activations are written with zero point 128
        "xint8": ("int8 per-tensor symmetric, power-of-two scales", "uint8 per-tensor symmetric, power-of-two"),
    }
    for preset, (weights, activations) in expected.items():
        out = tmp_path / f"{preset}.onnx"
        assert main(["quantize", str(float_model), str(out), "--calib-data", str(calib), "--preset", preset]) == 0
        capsys.readouterr()
        assert main(["inspect", str(out)]) == 0
        text = capsys.readouterr().out
        assert text.startswith("already quantized: QDQ"), text
        assert "would" not in text and "no quantization policy" not in text
        assert re.search(rf"weights: \d+ {weights}", text), text
        assert re.search(rf"activations: \d+ {activations}", text), text
        assert re.search(r"quantized ops: .*Conv 6", text), text
        assert main(["inspect", str(out), "--json"]) == 0
        info = json.loads(capsys.readouterr().out)
        assert info["already_quantized"] and info["quantized_model"]["quantized_ops"]["Conv"] == 6


def _qlinear_conv_model() -> onnx.ModelProto:
    """x -> QuantizeLinear -> QLinearConv (int8 per-channel weight) -> DequantizeLinear."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(np.float32(0.05), "x_scale"),
        numpy_helper.from_array(np.uint8(128), "x_zp"),
        numpy_helper.from_array(rng.integers(-127, 128, (4, 3, 3, 3)).astype(np.int8), "w_q"),
        numpy_helper.from_array(np.array([0.01, 0.02, 0.03, 0.04], np.float32), "w_scale"),
        numpy_helper.from_array(np.zeros(4, np.int8), "w_zp"),
        numpy_helper.from_array(np.float32(0.1), "y_scale"),
        numpy_helper.from_array(np.uint8(0), "y_zp"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zp"], ["x_q"], name="q"),
        helper.make_node(
            "QLinearConv",
            ["x_q", "x_scale", "x_zp", "w_q", "w_scale", "w_zp", "y_scale", "y_zp"],
            ["y_q"],
            name="conv",
            pads=[1, 1, 1, 1],
        ),
        helper.make_node("DequantizeLinear", ["y_q", "y_scale", "y_zp"], ["y"], name="dq"),
    ]
    graph = helper.make_graph(
        nodes,
        "qop",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 8, 8])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    onnx.checker.check_model(model)
    return model


def test_inspect_recognises_qoperator_models(tmp_path, capsys) -> None:
    path = tmp_path / "qop.onnx"
    onnx.save(_qlinear_conv_model(), path)
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("already quantized: QDQ + QOperator"), text
    assert "weights: 1 int8 per-channel symmetric, scales not powers of two" in text
    assert "quantized ops: QLinearConv 1" in text


def test_inspect_shows_what_preprocessing_folded(tmp_path, capsys) -> None:
    bn, identities = tmp_path / "bn.onnx", tmp_path / "id.onnx"
    onnx.save(conv_bn_relu_model(), bn)
    onnx.save(identity_weight_model(), identities)
    assert main(["inspect", str(bn)]) == 0
    text = capsys.readouterr().out
    assert "1 BatchNormalization nodes folded into Conv/ConvTranspose/Gemm" in text
    assert re.search(r"^BatchNormalization\s+1\s+0\s+0$", text, re.MULTILINE), text  # in the file, gone after
    assert main(["inspect", str(identities)]) == 0
    assert "3 Identity nodes removed" in capsys.readouterr().out


# --- 4. output location checked first --------------------------------------------------------------
def _no_calibration(monkeypatch) -> None:
    def calibrate(*_args, **_kwargs):
        raise AssertionError("calibration ran before the output location was checked")

    monkeypatch.setattr(quant_onnx.api, "calibrate", calibrate)


def test_missing_output_folder_fails_before_calibration(tmp_path, calib, float_model, capsys, monkeypatch) -> None:
    _no_calibration(monkeypatch)
    out = tmp_path / "no-such-folder" / "q.onnx"
    assert main(["quantize", str(float_model), str(out), "--calib-data", str(calib)]) == 2
    line = _one_error_line(capsys)
    assert f"output '{out}'" in line and "does not exist" in line, line
    assert not out.parent.exists()  # not created behind the user's back
    report = tmp_path / "missing" / "r.json"
    assert main(["quantize", str(float_model), str(tmp_path / "q.onnx"), "--calib-data", str(calib),
                 "--report", str(report)]) == 2  # fmt: skip
    assert f"report '{report}'" in _one_error_line(capsys)
    assert main(["quantize", str(float_model), str(out), "--dynamic"]) == 2
    assert "does not exist" in _one_error_line(capsys)
    (tmp_path / "file").write_text("x")
    assert main(["quantize", str(float_model), str(tmp_path / "file" / "q.onnx"), "--calib-data", str(calib)]) == 2
    assert "is not a folder" in _one_error_line(capsys)


def test_read_only_output_folder_fails_before_calibration(tmp_path, calib, float_model, capsys, monkeypatch) -> None:
    _no_calibration(monkeypatch)
    folder = tmp_path / "read-only"
    folder.mkdir()
    out = folder / "q.onnx"
    with read_only_folder(folder) as enforced:
        if not enforced:
            pytest.skip("this process can write to a mode-0555 folder (root without capability control)")
        assert main(["quantize", str(float_model), str(out), "--calib-data", str(calib)]) == 2
    line = _one_error_line(capsys)
    assert f"output '{out}'" in line and "is not writable" in line, line
    assert ".tmp" not in line and ".probe" not in line  # names the output, not a hidden temp file
    assert list(folder.iterdir()) == []


def test_help_says_what_happens_to_a_missing_output_folder(capsys) -> None:
    assert main(["quantize", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "folder must already exist" in text and "never created" in text


# --- 5. the small things ---------------------------------------------------------------------------
def test_reference_model_input_shapes_are_documented() -> None:
    sys.path.insert(0, str(REPO))
    try:
        from tools.reference_models import data
    finally:
        sys.path.remove(str(REPO))
    readme = (REPO / "tools" / "models" / "README.md").read_text()
    meta = json.loads((REPO / "tools" / "models" / "reference_models.json").read_text())["models"]
    for name, entry in meta.items():
        model = onnx.load(str(REPO / "tools" / "models" / entry["onnx"]), load_external_data=False)
        dims = [d.dim_value or d.dim_param for d in model.graph.input[0].type.tensor_type.shape.dim]
        assert dims[1:] == entry["input_shape"][1:], name
        if "task" not in entry:  # the Fashion-MNIST CNNs; the task models have their own inputs
            assert dims[1:] == [1, data.IMAGE_SIZE, data.IMAGE_SIZE], name
        assert f"`{name}.onnx`" in readme
    assert f"(N, 1, {data.IMAGE_SIZE}, {data.IMAGE_SIZE})" in readme
    assert f"{data.MEAN:.4f}" in readme and f"{data.STD:.4f}" in readme
    assert "(N, 1, 32, 32)" in (REPO / "README.md").read_text()


def test_progress_bar_has_a_total_and_the_summary_follows(tmp_path, calib, float_model, capsys) -> None:
    out, report = tmp_path / "q.onnx", tmp_path / "r.json"
    argv = ["quantize", str(float_model), str(out), "--calib-data", str(calib), "--batch-size", "4"]
    assert main([*argv, "--report", str(report)]) == 0
    captured = capsys.readouterr()
    bar = [line for line in screen_lines(captured.err) if line.startswith("calibrating")]
    assert len(bar) == 1 and "3/3" in bar[0] and "100%" in bar[0], bar
    summary = captured.out.strip()
    assert len(summary.splitlines()) == 1, summary
    for needle in ("float.onnx", "q.onnx", "with a8w8", "Conv 6", "int8 per-channel", "uint8 per-tensor", "0.", "x)"):
        assert needle in summary, (needle, summary)
    assert f"Report: '{report}'" in summary and re.search(r"in \d+\.\d s", summary)
    assert main([*argv, "--quiet"]) == 0
    assert capsys.readouterr() == ("", "")


def test_no_stale_progress_line_before_an_error(tmp_path, float_model, capsys) -> None:
    data = random_inputs(small_cnn(), 12)
    data[9] = np.nan  # the third batch of four fails validation mid-calibration
    bad = tmp_path / "bad.npy"
    np.save(bad, data)
    assert main(["quantize", str(float_model), str(tmp_path / "q.onnx"), "--calib-data", str(bad),
                 "--batch-size", "4"]) == 2  # fmt: skip
    assert "contains NaN" in _one_error_line(capsys)


def test_calibration_total_is_known_for_every_sized_source(tmp_path, float_model) -> None:
    from quant_onnx.data import CalibrationReader

    model = small_cnn()
    samples = random_inputs(model, 10)
    np.savez(tmp_path / "c.npz", x=samples)
    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(5):
        (folder / f"{i}.png").write_bytes(b"")  # counted by name; never decoded here
    sources = {
        "array": (samples, 3),
        "dict": ({"x": samples}, 3),
        "list": ([samples[:4], samples[4:]], 3),
        "one sample": (samples[0], 1),
        "npy": (str(tmp_path / "c.npy"), 3),
        "npz": (str(tmp_path / "c.npz"), 3),
        "images": (str(folder), 2),
    }
    np.save(tmp_path / "c.npy", samples)
    for label, (source, batches) in sources.items():
        assert CalibrationReader(model, source, batch_size=4).num_batches() == batches, label
    assert CalibrationReader(model, samples, batch_size=4, num_samples=5).num_batches() == 2
    assert CalibrationReader(model, iter([samples]), batch_size=4).num_batches() is None


def test_preset_help_lists_every_preset(capsys) -> None:
    for command in ("quantize", "inspect"):
        assert main([command, "--help"]) == 0
        text = " ".join(capsys.readouterr().out.split())
        assert all(name in text for name in list_presets()), text


def test_compare_columns_stay_aligned_with_long_names(tmp_path, calib, capsys) -> None:
    model = small_cnn()
    long_name = "backbone/stage_4/block_2/conv_2/" + "very_long_tensor_name_" * 3
    relu = next(node for node in model.graph.node if node.op_type == "Relu")
    renames = {relu.output[0]: long_name}
    for node in model.graph.node:
        node.input[:] = [renames.get(n, n) for n in node.input]
        node.output[:] = [renames.get(n, n) for n in node.output]
    float_path, quant_path = tmp_path / "long.onnx", tmp_path / "long.q.onnx"
    onnx.save(model, float_path)
    assert main(["quantize", str(float_path), str(quant_path), "--calib-data", str(calib), "--quiet"]) == 0
    assert main(["compare", str(float_path), str(quant_path), "--data", str(calib), "--quiet"]) == 0
    text = capsys.readouterr().out
    table = text[text.index("tensor") :].splitlines()
    assert any(line.startswith(long_name) for line in table), table
    ends = {len(line) for line in table}
    assert len(ends) == 1, table  # every SQNR value ends in the same column
    assert all(re.match(r"^\S+\s+-?(\d+\.\d\d|inf)$", line) for line in table[1:]), table


def test_inspect_recognises_dynamic_models(tmp_path, float_model, capsys) -> None:
    out = tmp_path / "dynamic.onnx"
    assert main(["quantize", str(float_model), str(out), "--dynamic", "--quiet"]) == 0
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("already quantized: dynamic"), text
    assert "weights: 7 int8 symmetric (scale applied after the integer op)" in text
    assert "activations: 6 uint8 asymmetric (range found per tensor at run time)" in text
    assert "quantized ops: ConvInteger 6, MatMulInteger 1" in text
