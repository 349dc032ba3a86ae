"""The benchmark models and their data, shared by ``onnx_ptq`` and ``algos``.

* Fashion-MNIST ResNet-18 / MobileNetV2 shapes (``tools/models/*.onnx``, trained by
  ``tools/train_reference.py``): calibrate on 512 seeded training images, score top-1 accuracy
  on the full 10k test set.
* EfficientNet-Lite0 with ImageNet weights and the random-weight ResNet-18 224
  (``tools/export_efficientnet.py``): calibrate on natural-photo crops, score top-1 agreement
  with the float model on crops of *other* photos (``tools/photo_crops.py``).

Example:
    >>> MODELS["fmnist_resnet18"].metric
    'accuracy'
    >>> ArrayDataReader([{"x": np.zeros((2, 3))}]).get_next()["x"].shape
    (2, 3)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tools.bench import common

REPO_ROOT = common.REPO_ROOT
DATA_DIR = common.CACHE_DIR / "bench" / "data"
METHODS = ("minmax", "percentile", "entropy")
NUM_CALIB = 512


@dataclass(frozen=True)
class BenchModel:
    """A benchmark model: where its float ONNX comes from and how it is scored.

    Example:
        >>> MODELS["efficientnet_lite0"].metric
        'agreement'
    """

    name: str
    data: str  # "fmnist" or "photos"
    metric: str | None  # "accuracy", "agreement", or None (timing only)
    default_methods: tuple[str, ...] = METHODS

    def path(self) -> Path:
        if self.data == "fmnist":
            return REPO_ROOT / "tools" / "models" / f"{self.name}.onnx"
        from tools.export_efficientnet import model_path

        return model_path(self.name)

    def ensure(self) -> Path:
        """The float model, exported first where this repo builds it; FileNotFoundError if not trained yet."""
        if self.data == "fmnist":
            path = self.path()
            if not path.exists():
                raise FileNotFoundError(f"{path} is missing: train it with tools/train_reference.py first")
            return path
        from tools.export_efficientnet import ensure_model

        return ensure_model(self.name)


MODELS: dict[str, BenchModel] = {
    m.name: m
    for m in (
        BenchModel("fmnist_resnet18", "fmnist", "accuracy"),
        BenchModel("fmnist_mobilenetv2", "fmnist", "accuracy"),
        BenchModel("efficientnet_lite0", "photos", "agreement"),
        # Random weights: its predictions mean nothing; it is there for speed (issue 3's 3x target).
        BenchModel("resnet18_224", "photos", None, default_methods=("minmax",)),
    )
}


@dataclass
class BenchData:
    """Calibration set on disk (for subprocesses) and the evaluation set in memory."""

    calib_path: Path  # .npy, first axis = samples
    eval_x: np.ndarray
    eval_labels: np.ndarray | None


def load_data(model: BenchModel, num_calib: int = NUM_CALIB, num_eval: int | None = None) -> BenchData:
    """Calibration set (saved as .npy for the subprocesses) and evaluation set of ``model``."""
    calib_path = DATA_DIR / f"{model.data}_calib_{num_calib}.npy"
    if model.data == "fmnist":
        from tools.reference_models.data import load_fashion_mnist

        if not calib_path.exists():
            train_x, _ = load_fashion_mnist("train")
            # A seeded random subset, sorted: the same file whatever order numpy draws in.
            idx = np.sort(np.random.default_rng(0).choice(len(train_x), num_calib, replace=False))
            save_npy(calib_path, train_x[idx])
        eval_x, labels = load_fashion_mnist("test")
        if num_eval is not None:
            eval_x, labels = eval_x[:num_eval], labels[:num_eval]
        return BenchData(calib_path, eval_x, labels)
    from tools.photo_crops import load_photo_crops

    if not calib_path.exists():
        save_npy(calib_path, load_photo_crops("calibration", num=num_calib))
    return BenchData(calib_path, load_photo_crops("evaluation", num=num_eval), None)


def save_npy(path: Path, array: np.ndarray) -> None:
    with common.atomic_path(path, ".npy") as tmp, open(tmp, "wb") as f:
        np.save(f, array)


def calibration_batches(calib_path: str | Path, input_name: str, batch_size: int) -> list[dict[str, np.ndarray]]:
    """The calibration set as a list of ``{input_name: batch}`` (ragged last batch), loaded fully."""
    data = np.load(calib_path)
    return [{input_name: np.ascontiguousarray(data[i : i + batch_size])} for i in range(0, len(data), batch_size)]


def input_name(model_path: str | Path) -> str:
    """The model's single data input (graph inputs that are not initializers)."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    initializers = {t.name for t in model.graph.initializer}
    return next(i.name for i in model.graph.input if i.name not in initializers)


def reference_predictions(model: BenchModel, float_path: Path, data: BenchData) -> np.ndarray | None:
    """Float top-1 predictions on the evaluation set (what agreement is measured against)."""
    return common.top1(common.predict(float_path, data.eval_x, level=EVAL_LEVEL)) if model.metric else None


# Headline accuracy runs every node as the graph states it (no fusion into integer kernels): that is
# the accuracy the quantized model defines, the same on every CPU. x86 CPUs without VNNI run
# onnxruntime's u8 x s8 kernels through vpmaddubsw, whose int16 pair sums saturate; the benches
# report that kernel-level figure beside it ("level='all'").
EVAL_LEVEL = "disable"


def evaluate(
    model_path: Path,
    data: BenchData,
    reference: np.ndarray | None,
    metric: str | None,
    *,
    level: str = EVAL_LEVEL,
) -> float | None:
    """Top-1 accuracy (labels) or agreement with ``reference`` predictions; None for timing-only models.

    ``level`` is onnxruntime's optimisation level for the run (see :func:`common.make_session`).
    """
    if metric is None:
        return None
    return metric_of(common.top1(common.predict(model_path, data.eval_x, level=level)), data, reference, metric)


def metric_of(predictions: np.ndarray, data: BenchData, reference: np.ndarray | None, metric: str) -> float:
    """Top-1 accuracy (labels) or agreement with ``reference`` of top-1 ``predictions``."""
    if metric == "accuracy":
        if data.eval_labels is None:
            raise ValueError("metric 'accuracy' needs labels; this data set has none")
        return common.accuracy(predictions, data.eval_labels)
    if reference is None:
        raise ValueError("metric 'agreement' needs the float model's reference predictions")
    return common.agreement(predictions, reference)


def score_quantized(
    model_path: Path,
    data: BenchData,
    reference: np.ndarray | None,
    metric: str | None,
    float_logits: np.ndarray | None = None,
) -> dict:
    """A quantized model's headline metric, the metric through this CPU's integer kernels, and file
    size; with the float model's ``float_logits`` on the evaluation set, also the output SQNR and how
    often the float top-1 class is among the quantized model's top 5."""
    scores = {
        "metric_kernels": evaluate(model_path, data, reference, metric, level="all"),
        "size_mb": common.file_size_mb(model_path),
    }
    if float_logits is None:
        scores["metric"] = evaluate(model_path, data, reference, metric)
        return scores
    from quant_core.qparams import sqnr_db

    logits = common.predict(model_path, data.eval_x, level=EVAL_LEVEL)
    scores["metric"] = None if metric is None else metric_of(common.top1(logits), data, reference, metric)
    top5 = np.argsort(-logits, axis=1)[:, :5]
    scores["sqnr_db"] = float(sqnr_db(float_logits, logits))
    scores["float_top1_in_top5"] = float(np.mean(np.any(top5 == common.top1(float_logits)[:, None], axis=1)))
    return scores


class ArrayDataReader:
    """onnxruntime ``CalibrationDataReader`` over a list of feed dicts (supports CalibStridedMinMax).

    Example:
        >>> r = ArrayDataReader([{"x": np.zeros((2, 3))}, {"x": np.ones((1, 3))}])
        >>> [d["x"].shape[0] for d in iter(r.get_next, None)]
        [2, 1]
    """

    def __init__(self, batches: list[dict[str, np.ndarray]]):
        self.batches = batches
        self.start, self.end = 0, len(batches)
        self._iter: Iterator[dict[str, np.ndarray]] = iter(self.batches)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._iter, None)

    def rewind(self) -> None:
        self._iter = iter(self.batches[self.start : self.end])

    def set_range(self, start_index: int, end_index: int) -> None:
        self.start, self.end = start_index, end_index
        self.rewind()

    def __len__(self) -> int:
        return len(self.batches)
