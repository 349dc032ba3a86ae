"""Auto mixed precision on the quantizer's own path: the known-sensitive layer is raised,
its 16-bit qparams come from the calibration's observers, and the model says which
domain its 16-bit Q/DQ use."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from algorithms_models import batches_for, outlier_mlp, quantize_for_passes, run

from quant_core.algorithm_config import MixedPrecisionConfig
from quant_core.dtypes import DType
from quant_core.presets import get_preset
from quant_core.qparams import sqnr_db
from quant_onnx.algorithms.mixed_precision import apply_mixed_precision
from quant_onnx.api import ModelQuantizer
from quant_onnx.pipeline.preprocess import PreprocessOptions


@pytest.fixture(scope="module")
def setup():
    model = outlier_mlp()
    batches = batches_for(model, count=4, batch=16)
    calibrated, qdq = quantize_for_passes(model, batches)
    return model, batches, calibrated, qdq


def _sixteen_bit_qdq(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    inits = {t.name: t for t in model.graph.initializer}
    return [
        n
        for n in model.graph.node
        if n.op_type in ("QuantizeLinear", "DequantizeLinear")
        and inits[n.input[2]].data_type in (onnx.TensorProto.UINT16, onnx.TensorProto.INT16)
    ]


def test_the_sensitive_layer_is_raised_and_the_target_met(setup):
    model, batches, calibrated, qdq = setup
    base_sqnr = sqnr_db(run(model, batches), run(qdq, batches))
    target = base_sqnr + 10.0
    mp = MixedPrecisionConfig(target_types=["a16w8"], accuracy_target=target)
    out, chosen, report = apply_mixed_precision(calibrated, get_preset("a8w8"), batches, mp, quiet=True)
    assert report.raised == {"fc2": "a16w8"}
    assert report.target_met and report.final_score >= target
    assert max(report.sensitivity, key=report.sensitivity.get) == "fc2"
    assert report.final_score == pytest.approx(report.search_score)
    assert sqnr_db(run(model, batches)[:64], run(out, batches)[:64]) == pytest.approx(report.final_score, abs=1e-6)
    # fc2 reads its own 16-bit pair; its qparams come from the group's observer (same range)
    (requant,) = chosen.plan.requants
    group = chosen.plan.group_of(requant.tensor)
    wide = chosen.requant_qparams[requant.key]
    assert requant.node == "fc2" and wide.dtype is DType.UINT16
    assert wide == calibrated.observers[group.key].qparams(requant.spec)
    pairs = _sixteen_bit_qdq(out)
    assert len(pairs) == 2 and {n.domain for n in pairs} == {"com.microsoft"}  # opset 17 model
    assert any("com.microsoft" in note for note in report.notes)


def test_opset_21_keeps_16_bit_pairs_in_the_default_domain(setup):
    model, batches, _, _ = setup
    mp = MixedPrecisionConfig(target_types=["a16w8"], max_layers=1)
    quantizer = ModelQuantizer(
        get_preset("a8w8").evolve(algorithms=(mp,)), preprocess_options=PreprocessOptions(target_opset=21), quiet=True
    )
    result = quantizer.quantize(model, None, batches)
    pairs = _sixteen_bit_qdq(result.model)
    assert pairs and {n.domain for n in pairs} == {""}
    assert result.algorithms["mixed_precision"]["notes"] == []


def test_the_com_microsoft_note_gives_advice_that_works(setup):
    # The note once advised "quant-onnx's --opset 21", a flag the command line does not have.
    model, batches, calibrated, _ = setup
    mp = MixedPrecisionConfig(target_types=["a16w8"], max_layers=1)
    _out, _chosen, report = apply_mixed_precision(calibrated, get_preset("a8w8"), batches, mp, quiet=True)
    (note,) = [note for note in report.notes if "com.microsoft" in note]
    assert "--opset" not in note
    assert "PreprocessOptions(target_opset=21)" in note and "convert_version(model, 21)" in note
    # The command-line route: the converted model needs no option to keep 16-bit pairs standard.
    from onnx import version_converter

    converted = version_converter.convert_version(model, 21)
    result = ModelQuantizer(get_preset("a8w8").evolve(algorithms=(mp,)), quiet=True).quantize(converted, None, batches)
    pairs = _sixteen_bit_qdq(result.model)
    assert pairs and {n.domain for n in pairs} == {""}
    assert result.algorithms["mixed_precision"]["notes"] == []


def test_max_layers_and_weight_targets(setup):
    _, batches, calibrated, _ = setup
    mp = MixedPrecisionConfig(target_types=["a8w16", "a16w16"], max_layers=1)
    _out, chosen, report = apply_mixed_precision(calibrated, get_preset("a8w8"), batches, mp, quiet=True)
    assert len(report.raised) == 1 and report.target_met is None
    assert report.size_ratio > 1.0  # 16-bit weights grow the model
    (name,) = report.raised
    assert chosen.weight_qparams[name].dtype is DType.INT16


def test_user_evaluate_metric(setup):
    model, batches, calibrated, _ = setup
    reference = run(model, batches)

    def evaluate(m):
        return -float(np.mean((run(m, batches) - reference) ** 2))

    config = MixedPrecisionConfig(target_types=["a16w8"], metric="evaluate", max_layers=1)
    _, _, report = apply_mixed_precision(calibrated, get_preset("a8w8"), batches, config, evaluate=evaluate, quiet=True)
    assert report.raised == {"fc2": "a16w8"}
    with pytest.raises(ValueError, match="evaluate"):
        apply_mixed_precision(calibrated, get_preset("a8w8"), batches, config, quiet=True)
