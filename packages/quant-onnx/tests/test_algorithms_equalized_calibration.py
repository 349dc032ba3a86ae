"""Activation equalization measured in the calibration pass: the equalized model's ranges
and input means, followed from the float model's per-channel ranges, against calibrating
the equalized model itself (the two-pass path, which observes its real tensors)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from algorithms_models import run
from test_algorithms_activation_equalization import recogniser_block

from quant_core import get_preset
from quant_core.algorithm_config import ActivationEqualizationConfig, BiasCorrectionConfig
from quant_core.config import QuantConfig
from quant_core.errors import ModelError
from quant_core.plan import QuantPlan
from quant_core.qparams import sqnr_db
from quant_onnx import ModelQuantizer, quantize
from quant_onnx.algorithms.equalized_calibration import NOTE, calibrate_with_equalization

MEASURED_AE = "measured in the calibration pass"


def _two_passes(model: onnx.ModelProto, config: QuantConfig, batches: list[dict]):
    """The equalized model calibrated on its own: the reference."""
    quantizer = ModelQuantizer(config, quiet=True)
    prepared = quantizer.prepare(model)
    feeds = list(quantizer.calibration_batches(prepared, batches))
    equalized, reports = quantizer.run_pre_passes(prepared, feeds)
    return equalized, quantizer.calibrate(equalized, feeds), reports


@pytest.mark.parametrize("num_samples", [None, 8])
def test_ranges_and_means_follow_from_one_pass(num_samples) -> None:
    model, batches = recogniser_block()
    config = get_preset("a8w8")
    config = config.evolve(
        algorithms=(ActivationEqualizationConfig(num_samples=num_samples), BiasCorrectionConfig(method="analytic"))
    )
    equalized, reference, _ = _two_passes(model, config, batches)
    result = quantize(model, None, config, batches, quiet=True, report_path=None)
    one = result.calibrated
    # The same equalization (decided from the same float values, over the first samples).
    assert [n.op_type for n in one.model.graph.node] == [n.op_type for n in equalized.model.graph.node]
    assert len(one.model.graph.node) > len(model.graph.node)  # Muls were inserted
    assert one.activation_ranges.keys() == reference.activation_ranges.keys()
    for key, (low, high) in reference.activation_ranges.items():
        np.testing.assert_allclose(one.activation_ranges[key], (low, high), rtol=1e-5, atol=1e-7, err_msg=key)
    # Every tensor an equalization touches is observed: the fold path, the Conv outputs
    # divided per channel, a Mul's output.
    assert {"s", "y1", "d1", "h1_equalized"} <= set(one.activation_ranges)
    assert one.input_means is not None and reference.input_means is not None
    assert one.input_means.samples == reference.input_means.samples
    assert one.input_means.values.keys() == reference.input_means.values.keys()
    for tensor, mean in reference.input_means.values.items():
        np.testing.assert_allclose(one.input_means.values[tensor], mean, rtol=1e-4, atol=1e-6, err_msg=tensor)
    assert "h1_equalized" in one.input_means.values  # a depthwise input behind an inserted Mul


def test_the_quantized_model_matches_the_two_pass_one(tmp_path) -> None:
    model, batches = recogniser_block()
    config = get_preset("a8w8")
    _, reference, _ = _two_passes(model, config, batches)
    quantizer = ModelQuantizer(config, quiet=True)
    two = quantizer.run_post_passes(reference, quantizer.write(reference).model, batches).model
    one = quantize(model, str(tmp_path / "one.onnx"), config, batches, quiet=True, report_path=tmp_path / "r.json")
    float_out, one_out, two_out = run(model, batches), run(one.model, batches), run(two, batches)
    # Ranges equal up to float rounding: a code that sat on a rounding tie may flip, so a
    # few outputs move by a step or so; the rest agree, and both files stay as close to float.
    step = float(float_out.max() - float_out.min()) / 255
    moved = np.abs(one_out - two_out) > 0.1 * step
    assert moved.mean() < 0.01, moved.mean()
    assert np.abs(one_out - two_out).max() < 10 * step
    assert abs(sqnr_db(float_out, one_out) - sqnr_db(float_out, two_out)) < 0.2
    notes = one.report["algorithms"]["activation_equalization"]["notes"]
    assert NOTE in notes


def test_other_observers_keep_the_two_passes(tmp_path) -> None:
    model, batches = recogniser_block()
    result = quantize(model, None, "a8w8_percentile", batches, quiet=True, report_path=tmp_path / "r.json")
    notes = result.report["algorithms"]["activation_equalization"]["notes"]
    assert result.report["algorithms"]["activation_equalization"]["equalized"]
    assert not any(MEASURED_AE in note for note in notes), notes


def test_a_tensor_the_pass_did_not_keep_sends_the_caller_to_calibrate() -> None:
    model, batches = recogniser_block()
    config = get_preset("a8w8")
    quantizer = ModelQuantizer(config, quiet=True)
    prepared = quantizer.prepare(model)
    nothing_kept = QuantPlan((), (), (), (), (), ())  # a float plan that observed nothing
    result = calibrate_with_equalization(
        prepared.model,
        nothing_kept,
        config,
        ActivationEqualizationConfig(),
        batches,
        lambda m: quantizer.replan(m, prepared.preprocess_changes).plan,
        quiet=True,
    )
    assert result.calibrated is None
    assert result.reason == "x was not observed in the pass"
    assert any("calibrated again: x was not observed" in note for note in result.report.notes)
    assert result.report.equalized  # the equalization itself was measured


def test_a_channel_that_overflows_names_its_tensor() -> None:
    model, batches = recogniser_block()
    bad = [{"x": b["x"].copy()} for b in batches]
    bad[1]["x"][0, :, :, :] = 3e38  # finite inputs; the stem's output overflows to Inf
    with pytest.raises(ModelError, match="calibration: tensor '"):
        quantize(model, None, "a8w8", bad, quiet=True)


def test_an_empty_batch_adds_nothing_to_the_channel_ranges() -> None:
    from quant_onnx.algorithms.equalized_calibration import _ChannelRanges
    from quant_onnx.pipeline.calibrate import FirstSamples

    batch = np.arange(24, dtype=np.float32).reshape(2, 3, 4) - 5.0
    empty = np.zeros((0, 3, 4), np.float32)
    alone, after_empty = _ChannelRanges(FirstSamples(1)), _ChannelRanges(FirstSamples(1))
    for ranges, stream in ((alone, [batch]), (after_empty, [empty, batch])):
        for part in ranges.window.marked({"x": b} for b in stream):  # cut at the first sample
            ranges.update(part["x"])  # as observers ignore it, an empty batch adds nothing
    assert alone.all is not None and after_empty.all is not None
    for got, expected in ((after_empty.all, alone.all), (after_empty.first, alone.first)):
        np.testing.assert_array_equal(got[0], expected[0])
        np.testing.assert_array_equal(got[1], expected[1])
    np.testing.assert_array_equal(alone.first[1], [-2.0, 2.0, 6.0])  # the first sample only


def test_the_first_samples_are_input_samples_where_a_tensor_has_more_rows() -> None:
    """A Reshape folds each sample into two rows of the equalized Conv's input: the
    equalization measures its first two input samples (four rows) in either path."""
    from conftest import make_model, tensor, vi
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(1)
    spread = np.array([8.0, 0.01, 1.0, 0.003], np.float32)
    inits = [
        tensor("shape", np.array([-1, 4, 6, 6], np.int64)),
        tensor("w1", (rng.normal(size=(4, 4, 1, 1)) * spread[:, None, None, None]).astype(np.float32)),
        tensor("b1", (rng.normal(size=4) * spread).astype(np.float32)),
        tensor("w2", rng.normal(size=(3, 4, 1, 1)).astype(np.float32)),
        tensor("b2", np.zeros(3, np.float32)),
    ]
    nodes = [
        helper.make_node("Reshape", ["x", "shape"], ["r"], name="reshape"),
        helper.make_node("Conv", ["r", "w1", "b1"], ["y1"], name="c1"),
        helper.make_node("HardSwish", ["y1"], ["h1"], name="hs"),
        helper.make_node("Conv", ["h1", "w2", "b2"], ["y"], name="c2"),
    ]
    model = make_model(nodes, [vi("x", ["N", 8, 6, 6])], [vi("y", ["M", 3, 6, 6])], inits, opset=17)
    # Later samples are larger: which samples are measured decides the scales.
    scale = np.array([1.0, 5.0, 9.0, 20.0], np.float32)[:, None, None, None]
    batches = [{"x": (rng.normal(size=(4, 8, 6, 6)) * scale).astype(np.float32)}]
    config = get_preset("a8w8").evolve(algorithms=(ActivationEqualizationConfig(num_samples=2),))
    equalized, reference, _ = _two_passes(model, config, batches)
    one = quantize(model, None, config, batches, quiet=True, report_path=None).calibrated
    scales = [
        {i.name: numpy_helper.to_array(i) for i in m.graph.initializer if "equaliz" in i.name}
        for m in (one.model, equalized.model)
    ]
    assert scales[0].keys() == scales[1].keys() and scales[0]
    for name, value in scales[1].items():
        np.testing.assert_allclose(scales[0][name], value, rtol=1e-6, err_msg=name)
    for key, (low, high) in reference.activation_ranges.items():
        np.testing.assert_allclose(one.activation_ranges[key], (low, high), rtol=1e-5, atol=1e-7, err_msg=key)
