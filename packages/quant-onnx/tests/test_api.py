"""Public API: quantize(), ModelQuantizer phases, files, reports, errors."""

from __future__ import annotations

import hashlib
import json
import re

import numpy as np
import onnx
import pytest
from model_builders import GraphBuilder, float_island_net, op_zoo, ort_run, random_inputs, small_cnn

import quant_onnx
from quant_core.errors import ConfigError
from quant_core.presets import get_preset
from quant_core.qparams import sqnr_db
from quant_core.serialization import save_config
from quant_onnx import DataError, ModelError, ModelQuantizer, OutputError, quantize


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "float.onnx"
    onnx.save(small_cnn(), path)
    return path


def test_quantize_writes_a_close_smaller_model_and_leaves_the_input_alone(model_file, tmp_path) -> None:
    before = _sha(model_file)
    x = random_inputs(small_cnn(), 32)
    out = tmp_path / "q.onnx"
    result = quantize(model_file, out, "a8w8", x, batch_size=8, quiet=True)
    assert _sha(model_file) == before
    assert result.output_path == out and out.is_file()
    quantized = onnx.load(out)
    onnx.checker.check_model(quantized)
    float_model = onnx.load(model_file)
    assert sqnr_db(ort_run(float_model, x)[0], ort_run(quantized, x)[0]) > 30
    float_weights = sum(t.ByteSize() for t in float_model.graph.initializer)
    quant_weights = sum(t.ByteSize() for t in quantized.graph.initializer)
    assert quant_weights < 0.4 * float_weights


def test_same_input_gives_bit_identical_files(model_file, tmp_path) -> None:
    x = random_inputs(small_cnn(), 16)
    quantize(model_file, tmp_path / "a.onnx", None, x, quiet=True)
    quantize(model_file, tmp_path / "b.onnx", None, x, quiet=True)
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()


def test_config_forms_preset_object_and_json(model_file, tmp_path) -> None:
    x = random_inputs(small_cnn(), 8)
    json_path = tmp_path / "cfg.json"
    save_config(get_preset("a8w8"), json_path)
    outputs = []
    for i, config in enumerate(["a8w8", get_preset("a8w8"), str(json_path), None]):
        out = tmp_path / f"q{i}.onnx"
        quantize(model_file, out, config, x, quiet=True)
        outputs.append(out.read_bytes())
    assert len(set(outputs)) == 1
    with pytest.raises(ValueError, match="preset"):
        quantize(model_file, tmp_path / "z.onnx", "no_such_preset", x, quiet=True)


def test_data_forms_dicts_generators_and_npy(model_file, tmp_path) -> None:
    x = random_inputs(small_cnn(), 12)
    np.save(tmp_path / "x.npy", x)
    forms = [
        x,
        [{"x": x[i : i + 5]} for i in range(0, 12, 5)],
        (x[i] for i in range(12)),
        str(tmp_path / "x.npy"),
    ]
    results = [quantize(model_file, None, None, form, batch_size=4, quiet=True).model for form in forms]
    first = results[0].SerializeToString(deterministic=True)
    assert all(r.SerializeToString(deterministic=True) == first for r in results)


def test_report_lists_tensors_float_nodes_and_layer_sqnr(tmp_path) -> None:
    path = tmp_path / "island.onnx"
    onnx.save(float_island_net(), path)
    report_path = tmp_path / "report.json"
    quantize(
        path, tmp_path / "q.onnx", "a8w8", random_inputs(float_island_net(), 16), report_path=report_path, quiet=True
    )
    report = json.loads(report_path.read_text())
    assert {"op_type": "Sin", "name": "sin15", "reason": "no quantization policy for this op type"} in report[
        "float_nodes"
    ]
    for entry in report["activations"]:
        assert {"tensors", "spec", "range", "scale", "zero_point", "dtype"} <= set(entry)
    assert all("scale" in w and "spec" in w for w in report["weights"])
    layers = report["comparison"]["layers"]
    assert layers and all(isinstance(layer["sqnr_db"], float | str) for layer in layers)
    assert report["config"]["name"] == "a8w8"


def test_output_equal_to_input_is_refused_before_any_work(model_file) -> None:
    before = _sha(model_file)
    with pytest.raises(OutputError, match="input model"):
        quantize(model_file, model_file, None, random_inputs(small_cnn(), 4), quiet=True)
    assert _sha(model_file) == before


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"y": np.zeros((4, 3, 16, 16), np.float32)}, "'y'"),
        (np.zeros((4, 3, 8, 8), np.float32), "x"),
        (np.full((4, 3, 16, 16), np.nan, np.float32), "NaN"),
        (np.zeros((0, 3, 16, 16), np.float32), "sample"),
    ],
)
def test_bad_calibration_data_writes_nothing(model_file, tmp_path, data, match) -> None:
    out = tmp_path / "q.onnx"
    with pytest.raises(DataError, match=match):
        quantize(model_file, out, None, data, quiet=True)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["float.onnx"]


def test_a_bad_preset_is_a_config_error_and_a_malformed_model_a_model_error(model_file, tmp_path) -> None:
    out = tmp_path / "q.onnx"
    with pytest.raises(ConfigError, match="preset: 'int7' is not a known preset"):
        quantize(model_file, out, "int7", random_inputs(small_cnn(), 4), quiet=True)
    twice = small_cnn()
    twice.graph.node[1].name = twice.graph.node[0].name
    with pytest.raises(ModelError, match=f"node '{twice.graph.node[0].name}' .*the name is used twice"):
        quantize(twice, out, None, random_inputs(small_cnn(), 4), quiet=True)
    assert not out.exists()


def test_a_missing_config_file_is_a_config_error_before_any_work(model_file, tmp_path) -> None:
    missing, out = str(tmp_path / "nosuch.json"), tmp_path / "q.onnx"
    with pytest.raises(ConfigError, match=f"^config: file '{re.escape(str(missing))}' not found$"):
        quantize(model_file, out, missing, random_inputs(small_cnn(), 4), quiet=True)
    with pytest.raises(ConfigError, match=f"^config: file '{re.escape(str(missing))}' not found$"):
        ModelQuantizer(missing)
    assert not out.exists()


@pytest.mark.parametrize("hold_samples", ["a", -1, 2.0, True])
def test_hold_samples_that_is_not_a_count_fails_at_construction(hold_samples) -> None:
    with pytest.raises(
        ConfigError, match=f"^hold_samples: {re.escape(repr(hold_samples))} is out of range; allowed: an integer >= 0$"
    ):
        ModelQuantizer("a8w8", hold_samples=hold_samples)


def test_phases_and_hooks_form_a_seam(model_file) -> None:
    seen = {}

    def model_hook(model: onnx.ModelProto) -> onnx.ModelProto:
        seen["model_nodes"] = len(model.graph.node)
        return model

    def calibrated_hook(calibrated, held):
        seen["held"] = sum(len(b["x"]) for b in held)
        return calibrated.evolve(activation_qparams=dict(calibrated.activation_qparams))

    quantizer = ModelQuantizer(
        "a8w8", model_hooks=[model_hook], calibrated_hooks=[calibrated_hook], hold_samples=6, quiet=True
    )
    prepared = quantizer.prepare(model_file)
    calibrated = quantizer.calibrate(prepared, random_inputs(small_cnn(), 10), batch_size=4)
    quantized = quantizer.write(calibrated).model
    assert seen == {"model_nodes": len(small_cnn().graph.node), "held": 6}
    assert "QuantizeLinear" in {n.op_type for n in quantized.graph.node}
    assert prepared.model is calibrated.model


def test_config_algorithms_run_and_are_reported(tmp_path) -> None:
    from quant_core.algorithm_config import BiasCorrectionConfig, CLEConfig

    model = small_cnn()
    x = random_inputs(model, 32)
    config = get_preset("xint8").evolve(algorithms=(CLEConfig(), BiasCorrectionConfig()))
    batches = ({"x": x[i : i + 8]} for i in range(0, 32, 8))  # one-shot: the algorithms need it held
    result = quantize(model, tmp_path / "q.onnx", config, batches, report_path=tmp_path / "r.json", quiet=True)
    report = json.loads((tmp_path / "r.json").read_text())
    assert set(report["algorithms"]) == {"cle", "bias_correction"}
    assert report["algorithms"]["cle"]["chains"]
    plain = quantize(model, None, "xint8", x, quiet=True).model
    expected = ort_run(model, x)[0]
    assert sqnr_db(expected, ort_run(result.model, x)[0]) > sqnr_db(expected, ort_run(plain, x)[0])


def test_unnamed_nodes_and_constant_weights_are_handled(tmp_path) -> None:
    b = GraphBuilder()
    x = b.input("x", ["N", 3, 4, 4])
    w = (b.rng.normal(size=(4, 3, 1, 1))).astype(np.float32)
    b.nodes.append(onnx.helper.make_node("Constant", [], ["w_const"], value=onnx.numpy_helper.from_array(w, "w_value")))
    b.nodes.append(onnx.helper.make_node("Conv", [x, "w_const"], ["y"]))
    model = b.model(["y"], rank=4)
    data = random_inputs(model, 8)
    result = quantize(model, None, "a8w8", data, quiet=True)
    ops = [n.op_type for n in result.model.graph.node]
    # Input, weight, output, and the bias the preset's bias correction gives the Conv.
    assert "Constant" not in ops and ops.count("DequantizeLinear") == 4
    assert sqnr_db(ort_run(model, data)[0], ort_run(result.model, data)[0]) > 30


def test_package_exports() -> None:
    assert quant_onnx.DEFAULT_PRESET == "a8w8"
    assert set(quant_onnx.__all__) >= {"quantize", "ModelQuantizer", "CalibratedModel", "quantize_dynamic"}


@pytest.mark.parametrize(("build", "opset"), [(small_cnn, 11), (small_cnn, 21), (op_zoo, 13), (op_zoo, 17)])
def test_opsets_and_op_coverage_end_to_end(build, opset) -> None:
    model = build(opset=opset)
    x = random_inputs(model, 16)
    result = quantize(model, None, "a8w8", x, quiet=True)
    assert result.calibrated.plan.float_nodes == ()
    assert result.model.opset_import[0].version >= max(13, opset)
    assert sqnr_db(ort_run(model, x)[0], ort_run(result.model, x)[0]) > 30
