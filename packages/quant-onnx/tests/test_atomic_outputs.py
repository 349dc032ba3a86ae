"""Every file quant-onnx writes appears whole or not at all.

An audit of the sources lists every call that can write a file; all but the named ones
go through ``quant_core.atomic_io.atomic_write``. Then each writing command is made to
fail at the final rename: it exits 2 naming the output, leaves no temp file, and an older
output stays as it was. Models over 2 GiB (external data) are saved so that replacing
the model file switches from the old data file to the new one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import onnx
import pytest
from cli_helpers import screen_lines, snapshot
from model_builders import random_inputs, small_cnn

import quant_core.atomic_io
import quant_core.onnx_qdq.model_io as model_io
import quant_onnx
from quant_onnx.cli.main import main

SOURCES = Path(quant_onnx.__file__).parent
# Calls that may write a file, and the writes allowed to make them (file: call).
WRITERS = {"open", "write_text", "write_bytes", "save", "save_model", "savez", "tofile", "dump", "replace", "rename",
           "copy", "copyfile", "move", "atomic_write"}  # fmt: skip
ALLOWED = {
    ("reporting/report.py", "atomic_write"),  # write_report
    ("data.py", "open"),  # Image.open (reading)
}


# Method names that write only when called on these modules (``x.copy()``, ``s.replace()`` do not).
MODULE_ONLY = {"replace": "os", "rename": "os", "copy": "shutil", "copyfile": "shutil", "move": "shutil",
               "save": "np onnx", "savez": "np", "save_model": "onnx", "dump": "json pickle"}  # fmt: skip


def _write_calls() -> set[tuple[str, str]]:
    found = set()
    for path in sorted(SOURCES.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name not in WRITERS:
                continue
            owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else None
            if name in MODULE_ONLY and owner not in MODULE_ONLY[name].split():
                continue  # save_model: quant_onnx's own (atomic); x.copy(), s.replace(): no file
            found.add((str(path.relative_to(SOURCES)), name))
    return found


def test_every_write_in_the_sources_is_atomic() -> None:
    unexpected = _write_calls() - ALLOWED
    assert not unexpected, f"file writes that bypass quant_core.atomic_io.atomic_write: {sorted(unexpected)}"


@pytest.fixture
def files(tmp_path):
    model, data = tmp_path / "float.onnx", tmp_path / "calib.npy"
    onnx.save(small_cnn(), model)
    np.save(data, random_inputs(small_cnn(), 8))
    return tmp_path, model, data


def _fail_renames(monkeypatch) -> None:
    def replace(_src, _dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(quant_core.atomic_io.os, "replace", replace)


def test_a_failed_write_leaves_older_outputs_whole_and_no_temp_file(files, monkeypatch, capsys) -> None:
    folder, model, data = files
    out, report, compared = folder / "q.onnx", folder / "r.json", folder / "c.json"
    commands = {
        "quantize": ["quantize", str(model), str(out), "--calib-data", str(data), "--report", str(report)],
        "dynamic": ["quantize", str(model), str(out), "--dynamic"],
        "compare --json": ["compare", str(model), str(model), "--data", str(data), "--json", str(compared)],
    }
    for path in (out, report, compared):
        path.write_text("older output")
    before = snapshot(folder)
    _fail_renames(monkeypatch)
    for label, argv in commands.items():
        assert main([*argv, "--quiet"]) == 2, label
        lines = screen_lines(capsys.readouterr().err)
        assert len(lines) == 1 and "No space left on device" in lines[0], (label, lines)
        assert str(folder) in lines[0] and ".tmp" not in lines[0], (label, lines)  # names the output
        assert snapshot(folder) == before, label


def _same(loaded: onnx.ModelProto, model: onnx.ModelProto) -> bool:
    """Equal models, once the data_location a load from external data sets is cleared."""
    for tensor in loaded.graph.initializer:
        tensor.ClearField("data_location")
    return model_io.model_hash(loaded) == model_io.model_hash(model)


def test_models_over_2gib_switch_data_files_atomically(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(model_io, "_PROTOBUF_LIMIT", 1000)  # small models take the external-data path
    out = tmp_path / "q.onnx"
    first, second = small_cnn(seed=0), small_cnn(seed=1)
    model_io.save_model(first, out)
    data_files = sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".data")
    assert len(data_files) == 1 and data_files[0].startswith("q.onnx.")
    assert _same(onnx.load(str(out)), first)
    before = snapshot(tmp_path)
    _fail_renames(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        model_io.save_model(second, out)
    assert snapshot(tmp_path) == before  # old model and its data file; the new data file is gone
    monkeypatch.undo()
    monkeypatch.setattr(model_io, "_PROTOBUF_LIMIT", 1000)
    model_io.save_model(second, out)
    assert _same(onnx.load(str(out)), second)
    assert len([p for p in tmp_path.iterdir() if p.suffix == ".data"]) == 1  # the old data file was removed
    written = snapshot(tmp_path)
    model_io.save_model(second, out)
    assert snapshot(tmp_path) == written  # the same model again: the same bytes, the same data file name
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file or folder left


def test_a_small_model_saved_over_one_above_2gib_removes_its_data_file(tmp_path, monkeypatch) -> None:
    out = tmp_path / "q.onnx"
    with monkeypatch.context() as patch:
        patch.setattr(model_io, "_PROTOBUF_LIMIT", 1000)
        model_io.save_model(small_cnn(seed=0), out)
    assert len([p for p in tmp_path.iterdir() if p.suffix == ".data"]) == 1
    (tmp_path / "q.onnx.0123456789abcdef.data").write_bytes(b"not named by the output")
    model_io.save_model(small_cnn(seed=1), out)  # written whole
    assert _same(onnx.load(str(out)), small_cnn(seed=1))
    # before: the old output's tensors stayed beside it, a file nothing names (up to GiBs)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.onnx", "q.onnx.0123456789abcdef.data"]
