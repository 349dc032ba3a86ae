"""External data: large payloads stay in their files after loading (read tensor by tensor)
and give the same quantized model as data read into memory; a file's own ``basepath``
key never moves where data are looked for; bound tensors are re-checked when read."""

from __future__ import annotations

import hashlib

import numpy as np
import onnx
import pytest
from model_builders import random_inputs, small_cnn

import quant_core.onnx_qdq.model_io as model_io
from quant_core.errors import ModelError
from quant_core.onnx_qdq.tensor_data import BASEPATH, bound_folders, to_array, uses_external_data
from quant_onnx.cli.main import main


@pytest.fixture
def external_model(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    path = folder / "model.onnx"
    onnx.save_model(small_cnn(), path, save_as_external_data=True, location="model.data", size_threshold=0)
    data = tmp_path / "calib.npy"
    np.save(data, random_inputs(small_cnn(), 12))
    return path, data


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_data_left_in_their_files_give_the_same_model(external_model, tmp_path, monkeypatch, capsys) -> None:
    path, data = external_model
    eager, lazy = tmp_path / "eager.onnx", tmp_path / "lazy.onnx"
    assert main(["quantize", str(path), str(eager), "--calib-data", str(data), "--quiet"]) == 0
    assert not bound_folders(model_io.load_model(path))  # small: read into memory
    monkeypatch.setattr(model_io, "LAZY_EXTERNAL_BYTES", 0)
    loaded = model_io.load_model(path)
    assert bound_folders(loaded) == {path.parent.resolve()}
    assert all(uses_external_data(t) for t in loaded.graph.initializer)
    assert main(["quantize", str(path), str(lazy), "--calib-data", str(data), "--quiet"]) == 0
    assert _digest(lazy) == _digest(eager)
    written = onnx.load(str(lazy), load_external_data=False)
    assert not any(uses_external_data(t) for t in written.graph.initializer)  # the output holds its own data
    assert main(["compare", str(path), str(lazy), "--data", str(data), "--quiet"]) == 0
    assert "top-1 agreement" in capsys.readouterr().out
    assert main(["inspect", str(path)]) == 0


def test_a_files_own_basepath_is_ignored(external_model, tmp_path, monkeypatch) -> None:
    path, _data = external_model
    monkeypatch.setattr(model_io, "LAZY_EXTERNAL_BYTES", 0)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "model.data").write_bytes((path.parent / "model.data").read_bytes())
    (path.parent / "model.data").unlink()  # only the copy outside the model's folder is left
    model = onnx.load(str(path), load_external_data=False)
    for tensor in model.graph.initializer:
        tensor.external_data.add(key=BASEPATH, value=str(elsewhere))
    onnx.save(model, path)
    with pytest.raises(ModelError, match="file not found"):
        model_io.load_model(path)
    with pytest.raises(ModelError, match="give the model's path"):
        model_io.load_model(model.SerializeToString())


def test_bound_tensors_are_checked_again_when_read(external_model, monkeypatch) -> None:
    path, _data = external_model
    monkeypatch.setattr(model_io, "LAZY_EXTERNAL_BYTES", 0)
    loaded = model_io.load_model(path)
    tensor = loaded.graph.initializer[0]
    expected = onnx.numpy_helper.to_array(onnx.load(str(path)).graph.initializer[0])
    np.testing.assert_array_equal(to_array(tensor), expected)
    assert model_io.load_model(loaded) is not loaded  # an in-memory copy keeps its binding
    (path.parent / "model.data").write_bytes(b"")  # truncated behind our back
    with pytest.raises(ModelError, match="past the end of the file"):
        to_array(tensor)


def test_no_output_may_overwrite_the_inputs_data_files(external_model, tmp_path, capsys) -> None:
    """The input's tensors live in model.data beside it: neither the model output, the
    report nor compare's --json may be written there (nor over either compared model)."""
    path, data = external_model
    stored = path.parent / "model.data"
    before = _digest(stored), _digest(path)
    args = ["--calib-data", str(data), "--quiet"]
    assert main(["quantize", str(path), str(stored), *args]) == 2
    assert "a data file of the input model ('model.data')" in capsys.readouterr().err
    assert main(["quantize", str(path), str(tmp_path / "q.onnx"), *args, "--report", str(stored)]) == 2
    quantized = tmp_path / "q.onnx"
    assert main(["quantize", str(path), str(quantized), *args]) == 0
    for target in (path, quantized, stored):
        assert main(["compare", str(path), str(quantized), "--data", str(data), "--json", str(target), "--quiet"]) == 2
    assert (_digest(stored), _digest(path)) == before
