"""load_model / save_model / hashing."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import conv_bn_relu_model, make_model, run_ort, vi
from onnx import helper

from quant_core.errors import ModelError
from quant_core.onnx_qdq.model_io import (
    initializer_bytes,
    load_model,
    model_hash,
    model_size,
    opset_version,
    save_model,
)


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


def test_checker_message_keeps_the_node_name_and_op_on_one_line():
    # onnx.checker puts "name: add_bad OpType: Add" on the lines after the first; keeping only
    # the first line left "input 'nowhere' of node: " naming no node.
    conv = helper.make_node("Conv", ["x", "w"], ["c"], name="conv")
    add = helper.make_node("Add", ["c", "nowhere"], ["y"], name="add_bad")
    weight = onnx.numpy_helper.from_array(np.ones((4, 3, 3, 3), np.float32), "w")
    graph = helper.make_graph([conv, add], "g", [vi("x", [1, 3, 8, 8])], [vi("y", [1, 4, 6, 6])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    with pytest.raises(ModelError) as info:
        load_model(model)
    message = str(info.value)
    assert "\n" not in message and "  " not in message
    assert "input 'nowhere' of node: name: add_bad OpType: Add is not output of any previous nodes" in message


def test_onnxruntime_messages_keep_every_line():
    from quant_core.errors import MAX_MESSAGE_CHARS
    from quant_onnx.ort_session import onnxruntime_errors

    class Fail(Exception):  # what onnxruntime's own exception types look like to the wrapper
        __module__ = "onnxruntime.capi.onnxruntime_pybind11_state"

    with pytest.raises(ModelError) as info, onnxruntime_errors("run the model"):
        raise Fail("[ONNXRuntimeError] : 1 : FAIL : Non-zero status code\n  Node (add_bad)\n  Op (Add) failed")
    assert str(info.value) == "onnxruntime cannot run the model: Non-zero status code Node (add_bad) Op (Add) failed"
    with pytest.raises(ModelError) as info, onnxruntime_errors("run the model"):
        raise Fail("x" * (2 * MAX_MESSAGE_CHARS))
    assert str(info.value).endswith("...") and len(str(info.value)) < MAX_MESSAGE_CHARS + 40
