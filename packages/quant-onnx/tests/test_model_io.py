"""load_model / save_model / hashing."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import conv_bn_relu_model, make_model, run_ort, vi
from onnx import helper

from quant_onnx.errors import ModelError
from quant_onnx.model_io import initializer_bytes, load_model, model_hash, model_size, opset_version, save_model


def test_load_from_path_bytes_and_proto_returns_copies(tmp_path):
    model = conv_bn_relu_model()
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    for source in (path, str(path), model.SerializeToString(), model):
        loaded = load_model(source)
        assert loaded is not model
        assert model_hash(loaded) == model_hash(model)
    loaded = load_model(model)
    loaded.graph.node[0].name = "changed"
    assert model.graph.node[0].name == "conv"


def test_load_errors_are_one_line(tmp_path):
    with pytest.raises(ModelError, match="file not found"):
        load_model(tmp_path / "missing.onnx")
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\x00\xffnot a model at all\x13\x37" * 10)
    with pytest.raises(ModelError, match="not an ONNX model") as info:
        load_model(junk)
    assert "\n" not in str(info.value)
    text = tmp_path / "text.onnx"
    text.write_text("hello")
    with pytest.raises(ModelError, match="not an ONNX model"):
        load_model(text)


def test_opset_range_is_enforced():
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", [1])], [vi("y", [1])], opset=10)
    with pytest.raises(ModelError, match="opset 10 is not supported"):
        load_model(model)
    assert opset_version(load_model(model, min_opset=7)) == 10


def test_checker_failure_is_reported():
    model = conv_bn_relu_model()
    model.graph.node[0].input[1] = "nowhere"
    with pytest.raises(ModelError, match=r"fails onnx\.checker"):
        load_model(model)


def test_external_data_is_loaded(tmp_path):
    model = conv_bn_relu_model()
    path = tmp_path / "ext.onnx"
    # onnx.save_model moves the tensors out of the proto it is given, so hand it a copy.
    onnx.save_model(conv_bn_relu_model(), str(path), save_as_external_data=True, location="ext.data", size_threshold=0)
    assert (tmp_path / "ext.data").is_file()
    loaded = load_model(path)
    x = {"x": np.ones((1, 3, 8, 8), np.float32)}
    np.testing.assert_array_equal(run_ort(loaded, x)[0], run_ort(model, x)[0])


def test_save_is_atomic_and_refuses_input_path(tmp_path):
    model = conv_bn_relu_model()
    src = tmp_path / "in.onnx"
    onnx.save(model, str(src))
    with pytest.raises(ModelError, match="is the input model"):
        save_model(model, src, input_path=src)
    with pytest.raises(ModelError, match="is the input model"):
        save_model(model, tmp_path / "." / "in.onnx", input_path=str(src))
    out = save_model(model, tmp_path / "sub" / "out.onnx", input_path=src)
    assert model_hash(onnx.load(str(out))) == model_hash(model)
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["out.onnx"]  # no temp file left behind


def test_hash_and_sizes():
    a, b = conv_bn_relu_model(), conv_bn_relu_model()
    assert model_hash(a) == model_hash(b)
    b.graph.node[0].name = "other"
    assert model_hash(a) != model_hash(b)
    assert model_size(a) > initializer_bytes(a) > 8 * 3 * 3 * 3 * 4
