"""quant_info.json: Vitis AI's layout, a lossless round trip, positions applied to another model."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from builders import conv_chain, ort_run, quantize, random_inputs

from quant_core.errors import DataError
from quant_core.onnx_qdq.reader import QDQGraph
from quant_npu.legalize import legalize_model
from quant_npu.quant_info import (
    export_quant_info,
    import_quant_info,
    load_quant_info,
    parse_key,
    write_quant_info,
)


@pytest.fixture(scope="module")
def npu_model():
    return legalize_model(quantize(conv_chain())).model


def test_layout_names_every_tensor(npu_model) -> None:
    info = export_quant_info(npu_model)
    assert set(info) == {"param", "input", "output", "fast_finetuned", "bias_corrected", "version"}
    qdq = QDQGraph(npu_model)
    constants = [t for t in qdq.tensors.values() if t.is_constant]
    assert len(info["param"]) == len({t.initializer for t in constants})
    assert info["input"] == {"test::x": [[8, qdq.tensors[qdq.quantized["x"]].position]]}
    assert len(info["output"]) == len(list(qdq.activation_keys())) - 1
    for key, value in info["param"].items():
        assert key.startswith("test::") and value[0][0] in (8, 32) and isinstance(value[0][1], int)


def test_round_trip_is_lossless(npu_model, tmp_path) -> None:
    path = tmp_path / "quant_info.json"
    write_quant_info(npu_model, path)
    text = path.read_text()
    assert '"test::x": [[8, ' in text  # one entry per line, as Vitis AI writes it
    result = import_quant_info(npu_model, path)
    assert result.unmatched == () and result.not_in_file == ()
    assert export_quant_info(result.model) == json.loads(text)
    x = random_inputs(conv_chain(), 16)
    np.testing.assert_array_equal(ort_run(result.model, x)[0], ort_run(npu_model, x)[0])


def test_import_applies_positions_to_another_quantization(npu_model) -> None:
    other = quantize(conv_chain(), "a8w8")  # float scales, asymmetric
    info = export_quant_info(npu_model)
    # a8w8's initializers have the same names: quant_onnx names them after the float model
    result = import_quant_info(other, info)
    assert result.applied > 0 and result.not_in_file == ()
    # a8w8's writer absorbed the Relus into asymmetric quantizers: the pre-Relu tensors do not exist there;
    # nor do quantized logits (a8w8 leaves the result tail float: quant_core.plan.tail)
    assert result.unmatched and all(name.startswith(("conv", "add", "gemm")) for name in result.unmatched)
    assert [name for name in result.unmatched if name.startswith("gemm")] == ["gemm32_out_float"]
    qdq = QDQGraph(result.model)
    for key in qdq.activation_keys():
        tensor = qdq.tensors[key]
        assert tensor.is_symmetric and tensor.position == info["output" if key != qdq.quantized["x"] else "input"][
            f"test::{tensor.float_name}"][0][1]  # fmt: skip


def test_bad_files(tmp_path, npu_model) -> None:
    with pytest.raises(ValueError, match=r"file '.*nope\.json' not found"):
        load_quant_info(tmp_path / "nope.json")
    broken = tmp_path / "broken.json"
    broken.write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        load_quant_info(broken)
    with pytest.raises(ValueError, match="entry 'test::x' is 8; allowed: \\[\\[bit_width, fix_position\\]\\]"):
        import_quant_info(npu_model, {"input": {"test::x": 8}})
    with pytest.raises(ValueError, match="bit width 12; allowed: 8, 16, 32"):
        import_quant_info(npu_model, {"input": {"test::x": [[12, 3]]}})
    with pytest.raises(ValueError, match="is not a power of two; run quant-npu legalize first"):
        export_quant_info(quantize(conv_chain(), "a8w8"))


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({}, r"entry 'test::x' is \{\}; allowed: \[\[bit_width, fix_position\]\]"),  # was KeyError: 0
        ([[8.7, 3]], r"entry 'test::x' is \[\[8\.7, 3\]\]; allowed"),  # was truncated to 8
        ([[8, 3.9]], r"entry 'test::x' is \[\[8, 3\.9\]\]; allowed"),
        ([[True, 3]], r"entry 'test::x' is \[\[True, 3\]\]; allowed"),
        ([[8]], r"entry 'test::x' is \[\[8\]\]; allowed"),
        ([[8, 400]], r"entry 'test::x': fix position 400 is out of range; allowed: -127 to 149"),  # was scale 0.0
        ([[8, -128]], r"entry 'test::x': fix position -128 is out of range"),  # 2**128: inf in float32
    ],
)
def test_a_malformed_entry_is_a_data_error_naming_the_tensor(npu_model, entry, message) -> None:
    with pytest.raises(DataError, match=f"^quant_info: {message}"):
        import_quant_info(npu_model, {"input": {"test::x": entry}})


def test_a_float_model_is_refused_as_check_refuses_it(tmp_path) -> None:
    from quant_npu.check import check
    from quant_npu.cli import main

    with pytest.raises(ValueError, match=r"^the model is not quantized .*: quantize it first, e\.g\. quant-onnx"):
        export_quant_info(conv_chain())
    assert "the model is not quantized" in check(conv_chain()).format_text()
    path = tmp_path / "float.onnx"
    onnx.save(conv_chain(), path)
    assert main(["export-info", str(path), str(tmp_path / "q.json")]) == 2
    assert not (tmp_path / "q.json").exists()


def test_a_cpu_partition_is_left_out() -> None:
    """a8w8 leaves the classifier float (quant_core.plan.tail): legalize puts it on the CPU
    with its float-scaled weights, and the file describes the NPU partition only."""
    legal = legalize_model(quantize(conv_chain(), "a8w8")).model
    info = export_quant_info(legal)
    qdq = QDQGraph(legal)
    gemm = next(n for n in legal.graph.node if n.op_type == "Gemm")
    cpu_params = {qdq.tensors[qdq.dequantized[name]].initializer for name in gemm.input[1:]}
    assert cpu_params and not cpu_params & {parse_key(k) for k in info["param"]}
    # the tensor the NPU hands to the CPU is the NPU's output: it stays
    assert f"test::{qdq.tensors[qdq.dequantized[gemm.input[0]]].float_name}" in info["output"]
    # a node kept on the CPU by name drops out the same way, as check --cpu selects it
    conv = next(n for n in legal.graph.node if n.op_type == "Conv")
    weight = qdq.tensors[qdq.dequantized[conv.input[1]]].initializer
    assert f"test::{weight}" in info["param"]
    assert f"test::{weight}" not in export_quant_info(legal, cpu=conv.name)["param"]


def test_a_round_trip_keeps_a_constant_stored_unsigned() -> None:
    """The x86 encoding stores an Add's constant operand as uint8 around 128; the import
    writes constants signed, so its negative values survive, in the device's weight range."""
    from builders import GraphBuilder

    from quant_npu.check import check

    def net():
        b = GraphBuilder(0)
        x = b.input("x", ["N", 4, 8, 8])
        h = b.node("Relu", [b.conv(x, 4, 8)])
        k = b.const(np.random.default_rng(3).normal(size=(1, 8, 1, 1)).astype(np.float32), "k")
        return b.model([b.node("Add", [h, k])], rank=4)

    model = legalize_model(quantize(net(), "xint8", encoding="x86_uint8"), "xint8").model
    assert any(t.is_constant and not t.signed for t in QDQGraph(model).tensors.values())
    imported = import_quant_info(model, export_quant_info(model), "xint8").model
    x = random_inputs(net(), 8, seed=4)
    np.testing.assert_array_equal(ort_run(imported, x)[0], ort_run(model, x)[0])
    assert check(imported, "xint8").ok
