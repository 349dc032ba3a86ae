"""The task metrics and data generators of the trained reference models (tools/bench/tasks.py, synthetic.py).

Metrics are checked on cases worked out by hand and against independent brute-force versions;
the generators for determinism and for ground truth that scores perfectly against itself.
"""

from __future__ import annotations

import doctest
import functools
import sys
from pathlib import Path

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tools.bench import synthetic, tasks  # noqa: E402

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies


# ------------------------------------------------------------------------------ text metrics
@pytest.mark.parametrize(
    ("a", "b", "distance"),
    [("", "", 0), ("abc", "", 3), ("", "ab", 2), ("kitten", "sitting", 3), ("flaw", "lawn", 2), ("ab", "ba", 2)],
)
def test_edit_distance_known_cases(a: str, b: str, distance: int) -> None:
    assert tasks.edit_distance(a, b) == distance
    assert tasks.edit_distance(b, a) == distance


def _levenshtein_recursive(a: str, b: str) -> int:
    @functools.cache
    def d(i: int, j: int) -> int:
        if i == 0 or j == 0:
            return i + j
        return min(d(i - 1, j) + 1, d(i, j - 1) + 1, d(i - 1, j - 1) + (a[i - 1] != b[j - 1]))

    return d(len(a), len(b))


@hypothesis.given(st.text("ab 1", max_size=8), st.text("ab 1", max_size=8))
def test_edit_distance_matches_the_recursive_definition(a: str, b: str) -> None:
    assert tasks.edit_distance(a, b) == _levenshtein_recursive(a, b)


def test_character_error_rate_pools_over_lines() -> None:
    assert tasks.character_error_rate(["hello", "wrld"], ["hello", "world"]) == pytest.approx(1 / 10)
    assert tasks.character_error_rate(["", "x"], ["ab", "x"]) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="undefined"):
        tasks.character_error_rate([""], [""])
    with pytest.raises(ValueError, match="references"):
        tasks.character_error_rate(["a"], ["a", "b"])


def _ctc_logits(texts: list[str], positions: int) -> np.ndarray:
    """One-hot logits spelling each text with a blank after every character (repeats survive)."""
    logits = np.zeros((len(texts), positions, len(synthetic.CHARSET) + 1), np.float32)
    logits[:, :, 0] = 1.0
    for i, text in enumerate(texts):
        for j, cls in enumerate(synthetic.encode_text(text)):
            logits[i, 2 * j] = np.eye(logits.shape[-1])[cls]
    return logits


def test_greedy_ctc_decode_merges_repeats_and_drops_blanks() -> None:
    a, b, blank = 12, 13, 0
    logits = np.eye(38)[[[a, a, b, blank, b, blank, blank, 1, a]]]
    assert tasks.greedy_ctc_decode(logits) == ["abb a"]
    texts = ["letter 1100", "a", "zz 00 zz"]
    assert tasks.greedy_ctc_decode(_ctc_logits(texts, 64)) == texts


def test_encode_text_refuses_characters_outside_the_charset() -> None:
    with pytest.raises(ValueError, match="outside"):
        synthetic.encode_text("Hello")


# ------------------------------------------------------------------------------ mask and boxes
def test_mask_iou_known_cases() -> None:
    truth = np.zeros((2, 4, 4), bool)
    truth[0, :2, :2] = True  # 4 pixels
    predicted = np.zeros_like(truth)
    predicted[0, :2, :3] = True  # 6 pixels, 4 shared
    predicted[1, 3, 3] = True  # one false pixel in the second image
    assert tasks.mask_iou(predicted, truth) == pytest.approx(4 / 7)
    assert tasks.mask_iou(truth, truth) == 1.0
    assert tasks.mask_iou(np.zeros((3, 3), bool), np.zeros((3, 3), bool)) == 1.0
    with pytest.raises(ValueError, match="shapes"):
        tasks.mask_iou(truth, truth[0])


def _box_iou_by_pixels(a: np.ndarray, b: np.ndarray) -> float:
    grid = np.zeros((2, 16, 16), bool)
    for k, (x1, y1, x2, y2) in enumerate((a, b)):
        grid[k, y1:y2, x1:x2] = True
    union = np.count_nonzero(grid[0] | grid[1])
    return np.count_nonzero(grid[0] & grid[1]) / union if union else 0.0


@hypothesis.given(st.lists(st.integers(0, 15), min_size=8, max_size=8))
def test_box_iou_matches_pixel_counting(coords: list[int]) -> None:
    x = np.array(coords).reshape(2, 2, 2)
    boxes = np.concatenate([np.sort(x[:, :, 0], axis=1), np.sort(x[:, :, 1], axis=1)], axis=1)[:, [0, 2, 1, 3]]
    expected = _box_iou_by_pixels(boxes[0], boxes[1])
    assert tasks.box_iou(boxes[:1], boxes[1:])[0, 0] == pytest.approx(expected)


def test_nms_keeps_the_best_of_each_overlapping_group() -> None:
    boxes = np.array([[0, 0, 10, 10], [1, 1, 10, 10], [20, 20, 30, 30], [0, 0, 10, 9]], float)
    scores = np.array([0.5, 0.9, 0.8, 0.7])
    assert tasks.nms(boxes, scores, 0.5).tolist() == [1, 2]
    assert tasks.nms(boxes, scores, 0.95).tolist() == [1, 2, 3, 0]


def _detector_output(boxes: list[np.ndarray], classes: list[np.ndarray], scores: list[np.ndarray]) -> np.ndarray:
    """``(N, 4 + 10, cells)`` with one cell per detection and the rest at score 0."""
    out = np.zeros((len(boxes), 14, 8), np.float32)
    for i, (b, c, s) in enumerate(zip(boxes, classes, scores, strict=True)):
        out[i, :4, : len(b)] = b.T
        out[i, 4 + c, np.arange(len(b))] = s
    return out


def test_mean_average_precision_by_hand() -> None:
    truth_boxes = [np.array([[0, 0, 10, 10], [20, 20, 30, 30]], float), np.array([[0, 0, 10, 10]], float)]
    truth_classes = [np.array([0, 1]), np.array([0])]
    perfect = tasks.decode_detections(_detector_output(truth_boxes, truth_classes, [np.ones(2), np.ones(1)]))
    assert tasks.mean_average_precision(perfect, truth_boxes, truth_classes, 10) == 1.0
    # class 0: a false positive (score 0.9) ranked above the two hits (0.8, 0.7): precision 1/2 at
    # recall 1/2 and 2/3 at recall 1 -> AP = 2/3; class 1 is found -> AP 1; mean 5/6.
    det_boxes = [
        np.array([[40, 40, 50, 50], [0, 0, 10, 10], [20, 20, 30, 30]], float),
        np.array([[0, 0, 10, 10]], float),
    ]
    det_classes = [np.array([0, 0, 1]), np.array([0])]
    det_scores = [np.array([0.9, 0.8, 0.6]), np.array([0.7])]
    found = tasks.decode_detections(_detector_output(det_boxes, det_classes, det_scores))
    assert tasks.mean_average_precision(found, truth_boxes, truth_classes, 10) == pytest.approx(5 / 6)
    # nothing found in the second image: class 0 is found once out of twice
    none = (np.zeros((0, 4)), np.zeros(0), np.zeros(0, np.int64))
    assert tasks.mean_average_precision([perfect[0], none], truth_boxes, truth_classes, 10) == pytest.approx(0.75)
    # a second box on a found item is a false positive; a class never detected scores 0
    a = np.array([[0, 0, 10, 10]], float)
    twice = (np.concatenate([a, a]), np.array([0.9, 0.8]), np.array([0, 0]))
    once = (a, np.array([0.7]), np.array([0]))
    assert tasks.mean_average_precision([twice, once], truth_boxes, truth_classes, 10) == pytest.approx(5 / 12)


def test_average_precision_is_the_area_under_the_envelope() -> None:
    assert tasks.average_precision(np.array([1.0]), np.array([1.0])) == 1.0
    assert tasks.average_precision(np.array([0.5, 0.5, 1.0]), np.array([1.0, 0.5, 2 / 3])) == pytest.approx(5 / 6)


# --------------------------------------------------------------------------------- generators
def test_generated_splits_are_deterministic_prefixes_and_differ_between_splits() -> None:
    pytest.importorskip("PIL")
    lines, texts = synthetic.text_lines("calib", 6)
    again, texts_again = synthetic.text_lines("calib", 3, start=3)
    np.testing.assert_array_equal(lines[3:], again)
    assert texts[3:] == texts_again
    assert synthetic.text_lines("eval", 6)[1] != texts
    assert all(set(t) <= set(synthetic.CHARSET) and 1 <= len(t.split()) <= 4 for t in texts)
    scenes, masks = synthetic.text_scenes("eval", 3)
    np.testing.assert_array_equal(scenes, synthetic.text_scenes("eval", 3)[0])
    assert scenes.shape == (3, 128, 128, 3) and masks.shape == (3, 128, 128)
    assert 0 < masks.mean() < 0.5


def test_detection_boxes_frame_the_pasted_items() -> None:
    pytest.importorskip("PIL")
    data_dir = Path("/usr/share/datasets/fashion-mnist")
    if not data_dir.exists():
        pytest.skip("Fashion-MNIST is not installed")
    images, boxes, classes = synthetic.detection_scenes("eval", 4)
    for image, b, c in zip(images, boxes, classes, strict=True):
        assert 1 <= len(b) <= 4 and len(c) == len(b) and set(c.tolist()) <= set(range(10))
        for x1, y1, x2, y2 in b.astype(int):
            assert 0 <= x1 < x2 <= 96 and 0 <= y1 < y2 <= 96
            assert image[y1:y2, x1:x2].max() > 40  # the item's pixels are inside its box


def test_scoring_the_ground_truth_is_perfect() -> None:
    """Outputs built from each split's own ground truth score perfectly, and SQNR against itself is infinite."""
    pytest.importorskip("PIL")
    lines = tasks.load("ocr_ctc", "eval", 5)
    logits = _ctc_logits(list(lines.texts), 64)
    assert tasks.score("ocr_ctc", logits, "eval", 5) == {"cer": 0.0, "line_accuracy": 1.0}
    metrics = tasks.score("ocr_ctc", logits, "eval", 5, reference=logits)
    assert metrics["cer_vs_float"] == 0.0 and metrics["sqnr_db"] == float("inf")
    scenes = tasks.load("text_seg", "eval", 3)
    assert tasks.score("text_seg", scenes.masks[:, None].astype(np.float32), "eval", 3)["iou"] == 1.0
    assert tasks.evaluate("text_seg", lambda x: np.zeros((len(x), 1, 128, 128)), "eval", 3)["iou"] == 0.0
    with pytest.raises(ValueError, match="rows"):
        tasks.score("text_seg", np.zeros((2, 1, 128, 128)), "eval", 3)
    with pytest.raises(ValueError, match="allowed"):
        tasks.load("no_such_model")


def test_module_examples() -> None:
    for module in (tasks, synthetic):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0, module.__name__


def test_vocabulary_is_a_few_hundred_distinct_words_in_the_charset() -> None:
    assert 300 <= len(set(synthetic.WORDS)) == len(synthetic.WORDS)
    assert set("".join(synthetic.WORDS)) <= set(synthetic.CHARSET)


def test_trained_bench_tables_render_partial_results() -> None:
    from tools.bench import trained

    ok = {
        "ok": True,
        "accuracy": 0.9,
        "agreement": 0.98,
        "sqnr_db": 21.5,
        "compute": {"total": 4, "dequantized_input": 3},
    }
    results = {
        "models": {
            "fmnist_deit": {
                "headline": "accuracy",
                "float": {"accuracy": 0.91},
                "configs": {"a8w8": ok, "ort": {"ok": False, "error": "boom"}},
            }
        }
    }
    lines = trained.tables(results).splitlines()
    assert lines[0] == "| model | metric | float | a8w8 | ORT quantize_static |"
    assert lines[2] == "| fmnist_deit | accuracy | 0.91 | 0.9 (21.5 dB) | failed |"
    assert lines[-1] == "| fmnist_deit | top-1 agreement | 0.98, 3/4 | — |"


@pytest.mark.parametrize(
    "name", ["fmnist_hardswish_se", "fmnist_deit", "fmnist_deit_decomposed", "ocr_ctc", "fmnist_yolo", "text_seg"]
)
def test_committed_task_models_rebuild_as_torch_modules(name: str) -> None:
    """load_reference_model gives the outputs of the committed ONNX file."""
    pytest.importorskip("torch")
    pytest.importorskip("onnxruntime")
    from tools.reference_models.torch_weights import MODELS_DIR, load_reference_model

    if not (MODELS_DIR / f"{name}.onnx").exists():
        pytest.skip(f"{name}.onnx is not trained yet")
    if tasks.get_task(name).kind == "classification" and not Path("/usr/share/datasets/fashion-mnist").exists():
        pytest.skip("Fashion-MNIST is not installed")
    model = load_reference_model(name)
    from_torch = tasks.predict(name, model, "eval", 16)
    from_onnx = tasks.predict(name, MODELS_DIR / f"{name}.onnx", "eval", 16)
    np.testing.assert_allclose(from_torch, from_onnx, rtol=1e-4, atol=1e-3 * max(1.0, float(np.abs(from_onnx).max())))
