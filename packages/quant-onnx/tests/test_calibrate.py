"""Streaming calibration: ranges, batching, memory, errors."""

from __future__ import annotations

import gc
import importlib
import weakref

import attrs
import numpy as np
import pytest
from model_builders import GraphBuilder, ort_run, random_inputs, small_cnn

from quant_core.errors import DataError
from quant_core.observer_config import MovingAverageMinMax
from quant_core.presets import get_preset
from quant_onnx.cli.config_overrides import override_config
from quant_onnx.pipeline.annotate import plan_model
from quant_onnx.pipeline.calibrate import augmented_model, calibrate


def _batches(x: np.ndarray, size: int):
    return [{"x": x[i : i + size]} for i in range(0, len(x), size)]


def _concat_model():
    b = GraphBuilder()
    x = b.input("x", ["N", 3, 4, 4])
    left = b.conv(x, 3, 4)
    right = b.node("Mul", [x, b.const(np.array(5.0, np.float32))])
    joined = b.node("Concat", [left, right], axis=1)
    # A layer reads it: a Concat that only writes the result (the result tail) stays float.
    return b.model([b.conv(joined, 7, 4)], rank=4), left, right


def test_minmax_ranges_match_numpy_over_every_batch_size() -> None:
    model, left, right = _concat_model()
    x = random_inputs(model, 10)
    ann = plan_model(model, get_preset("a8w8"))
    lefts, rights = ort_run(augmented_model(model, [left, right]), x, "basic")[1:]
    expected = (min(lefts.min(), rights.min()), max(lefts.max(), rights.max()))
    for size in (1, 3, 4, 10):  # 3 and 4 leave a ragged last batch
        cal = calibrate(model, ann, _batches(x, size), quiet=True)
        lo, hi = cal.activation_ranges[ann.group_of(left).key]
        assert (float(lo), float(hi)) == pytest.approx(expected, rel=1e-6)
        x_lo, x_hi = cal.activation_ranges["x"]
        assert (float(x_lo), float(x_hi)) == (float(x.min()), float(x.max()))


def test_concat_inputs_share_the_union_range() -> None:
    model, left, right = _concat_model()
    ann = plan_model(model, get_preset("a8w8"))
    cal = calibrate(model, ann, _batches(random_inputs(model, 8), 4), quiet=True)
    assert cal.qparams_of(left) == cal.qparams_of(right)


def test_weight_qparams_come_from_the_weights() -> None:
    model = small_cnn()
    ann = plan_model(model, get_preset("a8w8"))
    cal = calibrate(model, ann, _batches(random_inputs(model, 4), 4), quiet=True)
    slot = ann.weights[0]
    w = next(t for t in model.graph.initializer if t.name == slot.tensor)
    from onnx import numpy_helper

    amax = np.abs(numpy_helper.to_array(w)).reshape(w.dims[0], -1).max(axis=1)
    np.testing.assert_allclose(cal.weight_qparams[slot.node].scale, amax / 127, rtol=1e-6)


def test_calibration_releases_every_batch() -> None:
    """Peak memory must not grow with the sample count: nothing keeps earlier batches."""
    model = small_cnn()
    ann = plan_model(model, get_preset("a8w8"))
    alive: list[weakref.ref] = []

    def stream():
        for i in range(6):
            batch = random_inputs(model, 4, seed=i)
            alive.append(weakref.ref(batch))
            yield {"x": batch}

    calibrate(model, ann, stream(), quiet=True)
    gc.collect()
    assert sum(ref() is not None for ref in alive) == 0


@pytest.mark.parametrize("method", ["percentile", "entropy", "mse"])
def test_histogram_methods_calibrate(method: str) -> None:
    model = small_cnn()
    config = override_config(get_preset("a8w8"), calib_method=method)
    ann = plan_model(model, config)
    cal = calibrate(model, ann, _batches(random_inputs(model, 8), 4), quiet=True)
    lo, hi = cal.activation_ranges["x"]
    assert lo < 0 < hi


def test_no_batches_is_a_data_error() -> None:
    model = small_cnn()
    with pytest.raises(DataError, match="no samples"):
        calibrate(model, plan_model(model, get_preset("a8w8")), [], quiet=True)


def test_quiet_shows_no_progress_bar(capsys) -> None:
    model = small_cnn()
    calibrate(model, plan_model(model, get_preset("a8w8")), _batches(random_inputs(model, 4), 2), quiet=True)
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""


class _RecordingSession:
    """Wraps an onnxruntime session and records the batch size of every run."""

    def __init__(self, session, sizes: list[int], output_bytes: list[int]) -> None:
        self._session, self._sizes, self._output_bytes = session, sizes, output_bytes

    def run(self, outputs, feeds):
        self._sizes.append(len(next(iter(feeds.values()))))
        values = self._session.run(outputs, feeds)
        self._output_bytes.append(sum(v.nbytes for v in values))
        return values


def _record_runs(monkeypatch) -> tuple[list[int], list[int]]:
    """From now on, every calibration run's batch size and observed output bytes."""
    calibrate_module = importlib.import_module(
        "quant_onnx.pipeline.calibrate"
    )  # the package re-exports a function of that name

    sizes: list[int] = []
    output_bytes: list[int] = []
    real = calibrate_module.inference_session
    monkeypatch.setattr(
        calibrate_module, "inference_session", lambda *a: _RecordingSession(real(*a), sizes, output_bytes)
    )
    return sizes, output_bytes


def test_large_batches_run_in_chunks_with_the_same_ranges(monkeypatch) -> None:
    calibrate_module = importlib.import_module(
        "quant_onnx.pipeline.calibrate"
    )  # the package re-exports a function of that name

    model, _, _ = _concat_model()
    x = random_inputs(model, 10)
    ann = plan_model(model, get_preset("a8w8"))
    whole = calibrate(model, ann, _batches(x, 10), quiet=True)
    sizes, output_bytes = _record_runs(monkeypatch)
    calibrate(model, ann, _batches(x[:1], 1), quiet=True)
    per_sample = output_bytes[0]
    sizes.clear()
    # Room for three samples' observed tensors per run.
    monkeypatch.setattr(calibrate_module, "CHUNK_BYTES", 3 * per_sample + 1)
    chunked = calibrate(model, ann, _batches(x, 10), quiet=True)
    assert sizes == [1, 3, 3, 3]
    for key, (lo, hi) in whole.activation_ranges.items():
        assert (float(lo), float(hi)) == tuple(float(v) for v in chunked.activation_ranges[key])
    # Room for four: the nine rows after the sizing run go as three runs of three, not 4 + 4 + 1.
    sizes.clear()
    monkeypatch.setattr(calibrate_module, "CHUNK_BYTES", 4 * per_sample + 1)
    calibrate(model, ann, _batches(x, 10), quiet=True)
    assert sizes == [1, 3, 3, 3]


def test_moving_average_sees_the_users_batches(monkeypatch) -> None:
    calibrate_module = importlib.import_module(
        "quant_onnx.pipeline.calibrate"
    )  # the package re-exports a function of that name

    model, _, _ = _concat_model()
    config = get_preset("a8w8")
    ops = config.global_config
    moving = MovingAverageMinMax()
    ops = attrs.evolve(ops, input=ops.input.evolve(observer=moving), output=ops.output.evolve(observer=moving))
    config = config.evolve(global_config=ops)
    sizes, _ = _record_runs(monkeypatch)
    monkeypatch.setattr(calibrate_module, "CHUNK_BYTES", 1)
    calibrate(model, plan_model(model, config), _batches(random_inputs(model, 10), 4), quiet=True)
    assert sizes == [4, 4, 2]
