"""Tensor capture with onnxruntime: pruned runs, batch handling, the incremental walk."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from algorithms_models import batches_for, conv_relu_conv, mobilenet_block, quantize_for_passes

from quant_core.errors import DataError, ModelError
from quant_onnx.algorithms.capture import IncrementalRunner, TensorCapture, count_samples, prepare_batches, pruned_model


def test_prepare_batches_limits_samples_and_slices_the_last_batch():
    batches = [{"x": np.zeros((4, 2), np.float32)}] * 3
    out = prepare_batches(iter(batches), num_samples=6)
    assert [b["x"].shape[0] for b in out] == [4, 2] and count_samples(out) == 6
    assert count_samples(prepare_batches(batches)) == 12
    with pytest.raises(DataError, match="no samples"):
        prepare_batches([])


def test_pruned_model_keeps_only_what_the_outputs_need():
    model = mobilenet_block()
    pruned = pruned_model(model, ["r1"])
    assert [n.name for n in pruned.graph.node] == ["conv1", "clip1"]
    assert {t.name for t in pruned.graph.initializer} == {"w1", "b1", "zero", "six"}
    with pytest.raises(ModelError, match="not computed"):
        pruned_model(model, ["nope"])


def test_incremental_runner_matches_whole_model_runs_and_runs_each_node_once():
    model = mobilenet_block()
    batches = batches_for(model, count=3, batch=4)
    _, qdq = quantize_for_passes(model, batches)
    layers = [n for n in qdq.graph.node if n.op_type in ("Conv", "Gemm")]
    runner = IncrementalRunner(batches)
    outputs = [o.name for o in qdq.graph.output]
    reference = TensorCapture(qdq, [layer.input[0] for layer in layers] + outputs).collect(batches)
    for layer in layers:
        got = runner.concat(qdq, layer.input[0])
        np.testing.assert_allclose(got, reference[layer.input[0]], rtol=1e-5, atol=1e-5)
        # Evaluating the layer without committing leaves it pending.
        runner.compute(qdq, [layer.output[0]], commit=False)
    np.testing.assert_allclose(runner.concat(qdq, outputs[0]), reference[outputs[0]], rtol=1e-4, atol=1e-4)
    assert runner.nodes_run == len(qdq.graph.node)
    with pytest.raises(ModelError, match="already released"):
        runner.compute(qdq, [layers[0].input[0]])


def test_capture_reports_missing_inputs():
    model = mobilenet_block()
    with pytest.raises(DataError, match="'x' is missing"):
        TensorCapture(model, ["y"]).run({"other": np.zeros((1, 3, 16, 16), np.float32)})


def test_spilled_live_tensors_give_the_same_walk():
    """A walk whose live tensors wait on disk (budget 0) returns exactly what the in-memory
    walk returns, keeps nothing in memory, and leaves no file behind."""
    model = mobilenet_block()
    batches = batches_for(model, count=3, batch=4)
    _, qdq = quantize_for_passes(model, batches)
    layers = [n for n in qdq.graph.node if n.op_type in ("Conv", "Gemm")]
    in_memory, on_disk = IncrementalRunner(batches), IncrementalRunner(batches, memory_budget=0)
    for layer in layers:
        np.testing.assert_array_equal(in_memory.concat(qdq, layer.input[0]), on_disk.concat(qdq, layer.input[0]))
    assert in_memory.spilled == 0 and on_disk.spilled > 0
    folder = on_disk._live._directory.name
    on_disk.close()
    assert on_disk.spilled == 0 and not Path(folder).exists()


def test_bias_correction_walk_is_identical_when_spilled():
    from quant_algos.drivers import correct_biases
    from quant_core.algorithm_config import BiasCorrectionConfig
    from quant_onnx.algorithms import OnnxLayerRunner

    model = mobilenet_block()
    batches = batches_for(model, count=3, batch=4)
    calibrated, qdq = quantize_for_passes(model, batches)
    models = []
    for budget in (1 << 30, 0):
        runner = OnnxLayerRunner(calibrated, qdq, batches, memory_budget=budget)
        correct_biases(runner, BiasCorrectionConfig(), quiet=True)
        models.append(runner.model.SerializeToString())
    assert models[0] == models[1]


@pytest.mark.parametrize("drop_bias", [False, True])
def test_a_bias_correction_walk_indexes_each_graph_once_and_again_only_after_adding_nodes(monkeypatch, drop_bias):
    """The layer-wise walk indexes the QDQ graph once (finding the layers), each of its two
    walks once, and the quantized walk again only after a layer gained a bias node: not
    once or more per layer, which cost bias correction most of its time."""
    from quant_core.algorithm_config import BiasCorrectionConfig
    from quant_core.onnx_qdq.graph import GraphIndex
    from quant_onnx.algorithms import capture, runner
    from quant_onnx.algorithms.layerwise import apply_bias_correction

    builds: list[int] = []

    class CountingIndex(GraphIndex):
        def __init__(self, *args, **kwargs):
            builds.append(1)
            super().__init__(*args, **kwargs)

    model = conv_relu_conv()
    if drop_bias:  # conv1 gains a bias (a DequantizeLinear node) before conv2 runs
        del next(n for n in model.graph.node if n.name == "conv1").input[2]
    batches = batches_for(model, count=2)
    calibrated, qdq = quantize_for_passes(model, batches)
    monkeypatch.setattr(capture, "GraphIndex", CountingIndex)
    monkeypatch.setattr(runner, "GraphIndex", CountingIndex)
    corrected, _ = apply_bias_correction(calibrated, qdq, batches, BiasCorrectionConfig(), quiet=True)
    added = len(corrected.graph.node) - len(qdq.graph.node)
    assert added == (1 if drop_bias else 0)
    assert len(builds) == 3 + added
