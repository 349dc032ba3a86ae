"""Smoke tests of the benchmark helpers (tools/bench, tools/photo_crops.py) on tiny inputs.

Nothing heavy runs here: no model export, no real calibration, no timing assertions.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
for path in (REPO_ROOT, *sorted((REPO_ROOT / "packages").glob("*/src"))):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from tools.bench import common  # noqa: E402


def test_markdown_table_formats_cells() -> None:
    text = common.markdown_table(["a", "b", "c"], [["x", 1.23456, None], ["y", 12345.6, float("nan")]])
    assert text.splitlines() == ["| a | b | c |", "|---|---|---|", "| x | 1.23 | — |", "| y | 12346 | — |"]
    with pytest.raises(ValueError, match="one per header"):
        common.markdown_table(["a"], [[1, 2]])


def test_ratio_handles_missing_values() -> None:
    assert common.ratio(1.0, 4.0) == 0.25
    assert common.ratio(None, 4.0) is None
    assert common.ratio(1.0, 0) is None


def test_write_json_is_atomic_and_strict(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "r.json"
    common.write_json(target, {"x": float("inf"), "y": np.float32(0.5), "p": Path("a/b")})
    assert json.loads(target.read_text()) == {"x": None, "y": 0.5, "p": "a/b"}
    assert [p.name for p in target.parent.iterdir()] == ["r.json"]  # no temp file left behind


def test_atomic_path_leaves_target_untouched_on_error(tmp_path: Path) -> None:
    target = tmp_path / "keep.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError), common.atomic_path(target) as tmp:
        tmp.write_text("new")
        raise RuntimeError("boom")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_measure_in_subprocess_reports_peak_increase() -> None:
    result = common.measure_in_subprocess("tools.bench.common:_demo_job", {"mb": 64})
    assert result["ok"], result
    assert 60 <= result["peak_increase_mb"] < 200
    assert result["extras"] == {"size": 64 * 1024 * 1024 // 8}


def test_measure_in_subprocess_watchdog_and_errors() -> None:
    killed = common.measure_in_subprocess("tools.bench.common:_demo_job", {"mb": 1024}, mem_limit_mb=300)
    assert killed["ok"] is False and killed["killed"] == "memory"
    failed = common.measure_in_subprocess("tools.bench.common:_demo_job", {"no_such_argument": 1})
    assert failed["ok"] is False and "TypeError" in failed["error"]


def test_scores() -> None:
    assert common.accuracy(np.array([1, 2, 3]), np.array([1, 2, 0])) == pytest.approx(2 / 3)
    assert common.top1(np.array([[0.1, 0.9], [2.0, -1.0]])).tolist() == [1, 0]
    with pytest.raises(ValueError, match="equal, non-empty"):
        common.agreement(np.array([1]), np.array([1, 2]))


# ------------------------------------------------------------------ onnxruntime helpers


def _conv_models(tmp_path: Path) -> tuple[Path, Path]:
    """A float Conv model and its QDQ form (uint8 activations, int8 weights, int32 bias)."""
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = rng.normal(size=(16, 16, 3, 3)).astype(np.float32)
    b = rng.normal(size=16).astype(np.float32)
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 16, 8, 8])
    y_info = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)

    def save(nodes: list, initializers: list, name: str) -> Path:
        graph = helper.make_graph(nodes, name, [x_info], [y_info], initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        path = tmp_path / f"{name}.onnx"
        onnx.save(model, str(path))
        return path

    float_path = save(
        [helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
        "conv_float",
    )
    x_scale, w_scale = np.float32(0.05), np.float32(np.abs(w).max() / 127)
    inits = [
        numpy_helper.from_array(np.array(x_scale), "xs"),
        numpy_helper.from_array(np.array(128, np.uint8), "xz"),
        numpy_helper.from_array(np.round(w / w_scale).astype(np.int8), "wq"),
        numpy_helper.from_array(np.array(w_scale), "ws"),
        numpy_helper.from_array(np.array(0, np.int8), "wz"),
        numpy_helper.from_array(np.round(b / (x_scale * w_scale)).astype(np.int32), "bq"),
        numpy_helper.from_array(np.array(x_scale * w_scale, np.float32), "bs"),
        numpy_helper.from_array(np.array(0, np.int32), "bz"),
        numpy_helper.from_array(np.array(np.float32(0.5)), "ys"),
        numpy_helper.from_array(np.array(128, np.uint8), "yz"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
        helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"]),
        helper.make_node("DequantizeLinear", ["bq", "bs", "bz"], ["bd"]),
        helper.make_node("Conv", ["xd", "wd", "bd"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("QuantizeLinear", ["c", "ys", "yz"], ["cq"]),
        helper.make_node("DequantizeLinear", ["cq", "ys", "yz"], ["y"]),
    ]
    return float_path, save(nodes, inits, "conv_qdq")


def test_float_compute_nodes_sees_integer_kernels(tmp_path: Path) -> None:
    float_path, qdq_path = _conv_models(tmp_path)
    assert common.float_compute_nodes(float_path)["float"] == 1
    summary = common.float_compute_nodes(qdq_path)
    assert summary["float"] == 0 and summary["total"] == 1, summary["op_types"]


def test_sessions_predict_and_latency(tmp_path: Path) -> None:
    float_path, qdq_path = _conv_models(tmp_path)
    x = np.random.default_rng(1).uniform(-1, 1, (5, 16, 8, 8)).astype(np.float32)
    out = common.predict(float_path, x, batch_size=2)  # ragged last batch
    assert out.shape == (5, 16, 8, 8)
    np.testing.assert_allclose(common.predict(float_path.read_bytes(), x), out, rtol=1e-5, atol=1e-5)
    lat = common.latency_ms({"f": float_path, "q": qdq_path}, x, repeats=2, warmup=1)
    assert set(lat) == {"f", "q"} and all(v > 0 for v in lat.values())


def test_clean_float_model_keeps_the_function(tmp_path: Path) -> None:
    float_path, _ = _conv_models(tmp_path)
    clean = tmp_path / "clean.onnx"
    how = common.clean_float_model(float_path, clean)
    assert how in ("quant_onnx.pipeline.preprocess", "onnxruntime basic optimisation")
    x = np.random.default_rng(2).normal(size=(2, 16, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(common.predict(clean, x), common.predict(float_path, x), rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- photo crops


def test_photo_crops_are_deterministic_and_normalised() -> None:
    pytest.importorskip("PIL")
    from tools import photo_crops

    image = np.random.default_rng(0).integers(0, 256, (300, 400, 3), dtype=np.uint8)
    a = photo_crops.random_crops([image], 4, np.random.default_rng(7), size=32)
    b = photo_crops.random_crops([image], 4, np.random.default_rng(7), size=32)
    assert a.shape == (4, 32, 32, 3) and a.dtype == np.uint8
    np.testing.assert_array_equal(a, b)
    x = photo_crops.normalise(a)
    assert x.shape == (4, 3, 32, 32) and x.dtype == np.float32
    assert x.min() >= -1.0 and x.max() <= 1.0
    with pytest.raises(ValueError, match="RGB"):
        photo_crops.normalise(a[..., 0])


def test_photo_splits_are_disjoint_by_source() -> None:
    from tools import photo_crops

    calibration = set(photo_crops.SPLIT_SOURCES["calibration"])
    evaluation = set(photo_crops.SPLIT_SOURCES["evaluation"])
    assert not calibration & evaluation
    assert calibration | evaluation <= set(photo_crops.SOURCES)
    with pytest.raises(ValueError, match="split"):
        photo_crops.build_crops("training", 4)


# ------------------------------------------------------------------------------ harnesses


def test_array_data_reader_supports_strides() -> None:
    from tools.bench.models import ArrayDataReader

    reader = ArrayDataReader([{"x": np.full((2, 1), i)} for i in range(4)])
    assert len(reader) == 4
    reader.set_range(start_index=2, end_index=4)
    assert [int(d["x"][0, 0]) for d in iter(reader.get_next, None)] == [2, 3]


def test_calibration_batches_are_ragged(tmp_path: Path) -> None:
    from tools.bench.models import calibration_batches

    path = tmp_path / "c.npy"
    np.save(path, np.zeros((5, 1, 2, 2), np.float32))
    assert [b["in"].shape[0] for b in calibration_batches(path, "in", 2)] == [2, 2, 1]


def test_our_config_swaps_the_activation_observer() -> None:
    pytest.importorskip("attrs")
    pytest.importorskip("quant_core.presets")
    from tools.bench.onnx_ptq import our_config

    config = our_config(per_channel=False, method="entropy", num_samples=512, batch_size=16)
    assert config.global_config.input.observer.method == "entropy"
    assert config.global_config.output.observer.method == "entropy"
    assert config.global_config.weight.per_channel_axis is None
    assert config.calibration.num_samples == 512
    assert our_config(True, "minmax", 8, 4).global_config.weight.per_channel_axis == "output"


def test_onnx_ptq_tables_render_partial_results() -> None:
    from tools.bench.onnx_ptq import tables

    results = {
        "models": {
            "m": {
                "metric": "agreement",
                "float_metric": 1.0,
                "float_size_mb": 4.0,
                "latency_ms": {"float": 10.0, "float_clean": 8.0},
                "configs": {
                    "per_tensor-entropy": {
                        "label": "per-tensor Entropy",
                        "ort": {"ok": False, "killed": "memory", "wall_s_at_kill": 50.0, "rss_mb_at_kill": 9000.0},
                        "ours": {
                            "ok": True,
                            "wall_s": 5.0,
                            "peak_increase_mb": 300.0,
                            "metric": 0.9,
                            "size_mb": 1.0,
                            "latency_ms": 4.0,
                            "compute": {"float": 0, "total": 3},
                        },
                    }
                },
            }
        }
    }
    text = tables(results)
    assert "| m | per-tensor Entropy | >50 (killed: memory) | 5 | <0.1 | >9000 (killed) | 300 | <0.0333 |" in text
    assert "| 0/3 |" in text


def test_algos_rows_build_configs() -> None:
    pytest.importorskip("quant_core.presets")
    from tools.bench.algos import ROWS

    assert ROWS["float"].build is None
    assert ROWS["xint8"].build().name == "xint8"  # type: ignore[misc]
    assert [type(a).kind for a in ROWS["xint8_cle"].build().algorithms] == ["cle"]  # type: ignore[misc]
    kinds = [type(a).kind for a in ROWS["xint8_cle_adaquant"].build().algorithms]  # type: ignore[misc]
    assert kinds == ["cle", "adaquant"]


def test_algorithm_costs_times_the_search_own_candidates() -> None:
    """tools/bench/algorithm_costs.py measures each algorithm as the search adds it (the
    cost table's basis): the plain min-max candidate and that candidate refined."""
    from quant_algos.search.space import ADAROUND
    from tools.bench.algorithm_costs import _candidates

    chosen = _candidates(["cle", "adaround", "mixed_precision"])
    assert {name: (plain.name, refined.name) for name, (plain, refined) in chosen.items()} == {
        "cle": ("xint8/minmax", "xint8/minmax+cle"),
        "adaround": ("xint8/minmax", "xint8/minmax+adaround"),
        "mixed_precision": ("a8w8/minmax", "a8w8/minmax+mixed_precision(30dB)"),
    }
    assert chosen["adaround"][1].config.algorithms == (ADAROUND,)


def test_one_sided_rows_leave_the_other_side_float() -> None:
    pytest.importorskip("quant_core.presets")
    from tools.bench.algos import ROWS

    weights = ROWS["xint8_tuned_b4_weights_only"].build().global_config  # type: ignore[misc]
    activations = ROWS["xint8_cle_activations_only"].build().global_config  # type: ignore[misc]
    assert weights.input is None and weights.output is None and weights.weight is not None
    assert activations.weight is None and activations.input is not None and activations.output is not None


def test_npu_detector_map_is_one_for_outputs_that_encode_the_items() -> None:
    """tools/npu_models.py's decoding: an output holding each item's centre cell, class,
    offset and size (what the detector is trained to write) scores mAP@0.5 = 1; shifting
    every box by half its size scores 0."""
    from tools import npu_models

    truth = [
        (np.array([[5.0, 9.0, 33.0, 37.0], [30.0, 20.0, 58.0, 48.0]]), np.array([3, 7])),
        (np.array([[0.0, 36.0, 28.0, 64.0]]), np.array([3])),
    ]
    out = np.zeros((2, 15, 16, 16))
    for n, (boxes, classes) in enumerate(truth):
        for (left, top, _r, _b), c in zip(boxes, classes, strict=True):
            cy, cx = top + 14, left + 14
            gy, gx = int(cy // 4), int(cx // 4)
            out[n, 0, gy, gx] = out[n, 1 + c, gy, gx] = 1.0
            out[n, 11:13, gy, gx] = ((cy % 4) / 4, (cx % 4) / 4)
            out[n, 13:15, gy, gx] = 28 / 64
    assert npu_models.map50(out, truth) == 1.0
    shifted = [(boxes + 14.0, classes) for boxes, classes in truth]
    assert npu_models.map50(out, shifted) == 0.0


def _tiny_qdq_matmul() -> tuple:
    """x -> Q/DQ (int8, step 2**-4) -> MatMul with DQ(int8 weight, step 2**-6) -> y, and the float weight."""
    import onnx
    from onnx import helper, numpy_helper

    w = np.random.default_rng(0).normal(0, 0.3, (4, 3)).astype(np.float32)
    codes = np.clip(np.round(w / 2**-6), -127, 127).astype(np.int8)
    inits = [
        numpy_helper.from_array(np.array(2**-4, np.float32), "xs"), numpy_helper.from_array(np.array(0, np.int8), "xz"),
        numpy_helper.from_array(codes, "w_quantized"), numpy_helper.from_array(np.array(2**-6, np.float32), "ws"),
        numpy_helper.from_array(np.array(0, np.int8), "wz"),
    ]  # fmt: skip
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
        helper.make_node("DequantizeLinear", ["w_quantized", "ws", "wz"], ["wd"]),
        helper.make_node("MatMul", ["xd", "wd"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3])], inits,
    )  # fmt: skip
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets), w


def test_xint8_ablation_requantizes_to_16_bits_and_float() -> None:
    """tools/bench/xint8_ablation.py: an activation and a weight moved to int16 (onnxruntime's
    com.microsoft ops) land within a 16-bit step of the float product; floated, exactly on it."""
    import onnxruntime as ort

    from tools.bench.qdq_ablation import without_qdq
    from tools.bench.xint8_ablation import (
        floated_constants,
        mse_position,
        requantized_activations,
        requantized_constants,
    )

    model, w = _tiny_qdq_matmul()
    x = np.random.default_rng(1).normal(0, 1, (2, 4)).astype(np.float32)

    def run(m) -> np.ndarray:
        return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]

    exact = x @ w
    written = run(model)
    wide = run(requantized_constants(requantized_activations(model, {"x": (2**-12, np.int16)}), {"w_quantized": w},
                                     {"w_quantized": 2**-14}, np.int16))  # fmt: skip
    floated = run(without_qdq(floated_constants(model, {"w_quantized": w}, {"w_quantized"}), {"x"}))
    assert np.abs(wide - exact).max() < np.abs(written - exact).max() / 20
    np.testing.assert_allclose(floated, exact, rtol=1e-6, atol=1e-6)
    assert model.graph.node[0].domain == ""  # the input model is not modified
    # The MSE position is never coarser than the min-max one.
    assert mse_position(w.reshape(-1)) <= 2.0 ** np.ceil(np.log2(np.abs(w).max() / 127))
