"""Small detectors the NPU bench (``tools/bench/npu.py``) measures, trained here on
Fashion-MNIST mosaics so that their activations are those of a trained network:

* ``yolo_silu``: a YOLO-style detector, SiLU (``x * sigmoid(x)``) after every convolution,
  a nearest-upsampling neck with a concatenation, and a head that decodes like YOLOX
  (``sigmoid`` on objectness and class scores): 64x64 canvas -> ``[N, 15, 16, 16]``.
* ``se_decoder``: a MobileNetV3-style segmenter, hard-swish inverted residuals with
  squeeze-excite gates (``x * hardsigmoid(...)``), a ConvTranspose + skip + bilinear Resize
  decoder and a sigmoid mask: 64x64 canvas -> ``[N, 1, 64, 64]``.

Each canvas holds one to three 28x28 Fashion-MNIST items at random places (seeded); the
detector learns object centres on a stride-4 grid, their class and box, the segmenter the
items' pixels. Models are cached under ``.cache/bench/npu/models`` (float ONNX, opset 17,
TorchScript exporter) with their data.

Example:
    $ python -m tools.npu_models yolo_silu se_decoder     # train and export (300 Adam steps each; minutes on 2 free cores)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.bench import common

MODELS_DIR = common.CACHE_DIR / "bench" / "npu" / "models"
CANVAS = 64
GRID = 4  # detector stride


# ------------------------------------------------------------------------------ data


def mosaics(count: int, seed: int, split: str = "train") -> tuple[np.ndarray, np.ndarray, list[list[tuple]]]:
    """``count`` canvases ``[N, 1, 64, 64]`` (normalised), their item masks ``[N, 1, 64, 64]``
    and per canvas ``(class, top, left)`` of each item."""
    from tools.reference_models.data import load_fashion_mnist_raw

    images, labels = load_fashion_mnist_raw(split)
    rng = np.random.default_rng(seed)
    canvases = np.zeros((count, 1, CANVAS, CANVAS), np.float32)
    masks = np.zeros((count, 1, CANVAS, CANVAS), np.float32)
    boxes: list[list[tuple]] = []
    for i in range(count):
        items = []
        for _ in range(int(rng.integers(1, 4))):
            j = int(rng.integers(len(images)))
            top, left = (int(v) for v in rng.integers(0, CANVAS - 28, size=2))
            patch = images[j].astype(np.float32) / 255.0
            region = canvases[i, 0, top : top + 28, left : left + 28]
            np.maximum(region, patch, out=region)
            masks[i, 0, top : top + 28, left : left + 28] = np.maximum(
                masks[i, 0, top : top + 28, left : left + 28], (patch > 0.1).astype(np.float32)
            )
            items.append((int(labels[j]), top, left))
        boxes.append(items)
    return (canvases - 0.2) / 0.3, masks, boxes


def detection_targets(boxes: list[list[tuple]]) -> np.ndarray:
    """Per grid cell: objectness, class one-hot (10), centre offset (2), size (2): ``[N, 15, 16, 16]``."""
    cells = CANVAS // GRID
    target = np.zeros((len(boxes), 15, cells, cells), np.float32)
    for n, items in enumerate(boxes):
        for label, top, left in items:
            cy, cx = top + 14, left + 14
            gy, gx = cy // GRID, cx // GRID
            target[n, 0, gy, gx] = 1.0
            target[n, 1 + label, gy, gx] = 1.0
            target[n, 11:13, gy, gx] = ((cy % GRID) / GRID, (cx % GRID) / GRID)
            target[n, 13:15, gy, gx] = 28 / CANVAS
    return target


# ------------------------------------------------------------------------------ networks


def _torch():  # -> (torch, nn)
    import torch
    from torch import nn

    return torch, nn


def yolo_silu():  # -> nn.Module
    torch, nn = _torch()

    def cbs(cin: int, cout: int, k: int = 3, s: int = 1) -> nn.Module:
        return nn.Sequential(nn.Conv2d(cin, cout, k, s, k // 2, bias=False), nn.BatchNorm2d(cout), nn.SiLU())

    class Block(nn.Module):  # a C2f-style split block
        def __init__(self, c: int) -> None:
            super().__init__()
            self.a, self.b, self.out = cbs(c, c // 2, 1), cbs(c // 2, c // 2), cbs(c + c // 2, c, 1)

        def forward(self, x):
            a = self.a(x)
            return self.out(torch.cat([x, self.b(a) + a], 1))

    class Detector(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = cbs(1, 16, 3, 2)
            self.s4 = nn.Sequential(cbs(16, 32, 3, 2), Block(32))
            self.s8 = nn.Sequential(cbs(32, 64, 3, 2), Block(64))
            self.lateral = cbs(64, 32, 1)
            self.fuse = nn.Sequential(cbs(64, 32), Block(32))
            self.box, self.obj, self.cls = nn.Conv2d(32, 4, 1), nn.Conv2d(32, 1, 1), nn.Conv2d(32, 10, 1)

        def forward(self, x):
            p4 = self.s4(self.stem(x))
            up = nn.functional.interpolate(self.lateral(self.s8(p4)), scale_factor=2.0, mode="nearest")
            h = self.fuse(torch.cat([p4, up], 1))
            return torch.cat([torch.sigmoid(self.obj(h)), torch.sigmoid(self.cls(h)), self.box(h)], 1)

    return Detector()


def se_decoder():  # -> nn.Module
    torch, nn = _torch()

    class SE(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.reduce, self.expand = nn.Conv2d(c, max(8, c // 4), 1), nn.Conv2d(max(8, c // 4), c, 1)

        def forward(self, x):
            s = torch.relu(self.reduce(nn.functional.adaptive_avg_pool2d(x, 1)))
            return x * nn.functional.hardsigmoid(self.expand(s))

    class InvertedResidual(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int, expand: int = 3) -> None:
            super().__init__()
            mid = cin * expand
            self.block = nn.Sequential(
                nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.Hardswish(),
                nn.Conv2d(mid, mid, 3, stride, 1, groups=mid, bias=False), nn.BatchNorm2d(mid), nn.Hardswish(),
                SE(mid),
                nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout),
            )  # fmt: skip
            self.residual = stride == 1 and cin == cout

        def forward(self, x):
            y = self.block(x)
            return x + y if self.residual else y

    class Segmenter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(1, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish())
            self.s4 = nn.Sequential(InvertedResidual(16, 24, 2), InvertedResidual(24, 24, 1))
            self.s8 = nn.Sequential(InvertedResidual(24, 40, 2), InvertedResidual(40, 40, 1))
            self.up = nn.Sequential(nn.ConvTranspose2d(40, 24, 2, 2), nn.BatchNorm2d(24), nn.ReLU())
            self.fuse = nn.Sequential(nn.Conv2d(48, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish())
            self.head = nn.Conv2d(16, 1, 1)

        def forward(self, x):
            p4 = self.s4(self.stem(x))
            h = self.fuse(torch.cat([p4, self.up(self.s8(p4))], 1))
            logits = nn.functional.interpolate(self.head(h), scale_factor=4.0, mode="bilinear", align_corners=False)
            return torch.sigmoid(logits)

    return Segmenter()


# ------------------------------------------------------------------------------ training


def _detector_loss(out, target):
    torch, nn = _torch()
    bce = nn.functional.binary_cross_entropy
    positive = target[:, :1]
    obj = bce(out[:, :1].clamp(1e-6, 1 - 1e-6), positive)
    weight = positive.expand_as(out[:, 1:11])
    cls = (bce(out[:, 1:11].clamp(1e-6, 1 - 1e-6), target[:, 1:11], reduction="none") * weight).sum()
    box = (torch.abs(out[:, 11:] - target[:, 11:]) * positive).sum()
    return obj + (cls + box) / positive.sum().clamp(min=1)


def _segmenter_loss(out, target):
    _torch_mod, nn = _torch()
    return nn.functional.binary_cross_entropy(out.clamp(1e-6, 1 - 1e-6), target)


@dataclass(frozen=True)
class NpuModel:
    """A bench model: its network, how it is trained and how its outputs are scored."""

    name: str
    build: Callable[[], object]
    loss: Callable[[object, object], object]
    metric: str  # besides output SQNR against float: "map50" (the detector), "iou" (the segmenter)
    steps: int = 300

    def path(self) -> Path:
        return MODELS_DIR / f"{self.name}.onnx"

    def targets(self, masks: np.ndarray, boxes: list[list[tuple]]) -> np.ndarray:
        return masks if self.name == "se_decoder" else detection_targets(boxes)

    def ensure(self) -> Path:
        """The float model, trained and exported on first use."""
        if not self.path().exists():
            train_and_export(self)
        return self.path()


NPU_MODELS: dict[str, NpuModel] = {
    m.name: m
    for m in (
        NpuModel("yolo_silu", yolo_silu, _detector_loss, "map50"),
        NpuModel("se_decoder", se_decoder, _segmenter_loss, "iou"),
    )
}


def train_and_export(model_spec: NpuModel, batch: int = 32, seed: int = 0) -> Path:
    torch, _nn = _torch()
    torch.manual_seed(seed)
    torch.set_num_threads(common.DEFAULT_THREADS)
    net = model_spec.build()
    x, masks, boxes = mosaics(batch * 64, seed=seed)
    targets = model_spec.targets(masks, boxes)
    optimizer = torch.optim.Adam(net.parameters(), lr=2e-3)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, model_spec.steps)
    rng = np.random.default_rng(seed)
    net.train()
    for step in range(model_spec.steps):
        idx = rng.choice(len(x), batch, replace=False)
        loss = model_spec.loss(net(torch.from_numpy(x[idx])), torch.from_numpy(targets[idx]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 50 == 0:
            print(f"  {model_spec.name} step {step}: loss {float(loss.detach()):.4f}", flush=True)
    net.eval()
    path = model_spec.path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with common.atomic_path(path, ".onnx") as tmp:
        torch.onnx.export(
            net, (torch.from_numpy(x[:2]),), str(tmp), dynamo=False, opset_version=17,
            input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "N"}, "y": {0: "N"}},
        )  # fmt: skip
    return path


def eval_data(count: int = 256, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Evaluation canvases (test split) and their masks."""
    x, masks, _ = mosaics(count, seed=seed, split="test")
    return x, masks


def eval_boxes(count: int = 256, seed: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    """The evaluation canvases' items as ``(xyxy boxes [n, 4], classes [n])`` per canvas."""
    _x, _masks, boxes = mosaics(count, seed=seed, split="test")
    return [
        (
            np.array([(left, top, left + 28, top + 28) for _c, top, left in items], np.float64).reshape(-1, 4),
            np.array([c for c, _t, _l in items], np.int64),
        )
        for items in boxes
    ]


def decode(outputs: np.ndarray) -> np.ndarray:
    """The detector's ``[N, 15, 16, 16]`` as ``[N, 4 + 10, cells]``: xyxy boxes in canvas
    pixels (cell corner + offset * stride, size * canvas) and class scores (objectness times
    class probability), the layout :func:`tools.bench.tasks.decode_detections` reads.

    Example:
        >>> out = np.zeros((1, 15, 16, 16)); out[0, 0, 5, 6] = out[0, 3, 5, 6] = 1.0
        >>> out[0, 11:13, 5, 6] = 0.5; out[0, 13:15, 5, 6] = 28 / 64
        >>> decoded = decode(out)
        >>> decoded[0, :4, 5 * 16 + 6].tolist(), float(decoded[0, 4 + 2, 5 * 16 + 6])
        ([12.0, 8.0, 40.0, 36.0], 1.0)
    """
    out = np.asarray(outputs, np.float64)
    n, _c, h, w = out.shape
    gy, gx = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    cy, cx = (gy + out[:, 11]) * GRID, (gx + out[:, 12]) * GRID
    half_h, half_w = out[:, 13] * CANVAS / 2, out[:, 14] * CANVAS / 2
    boxes = np.stack([cx - half_w, cy - half_h, cx + half_w, cy + half_h], 1)
    scores = out[:, :1] * out[:, 1:11]
    return np.concatenate([boxes, scores], 1).reshape(n, 14, h * w)


def map50(outputs: np.ndarray, truth: list[tuple[np.ndarray, np.ndarray]]) -> float:
    """mAP@0.5 of the decoded detections against the canvases' items."""
    from tools.bench.tasks import decode_detections, mean_average_precision

    detections = decode_detections(decode(outputs))
    return mean_average_precision(detections, [b for b, _ in truth], [c for _, c in truth], num_classes=10)


def calibration_data(count: int = 128, seed: int = 2) -> np.ndarray:
    return mosaics(count, seed=seed)[0]


def iou(probabilities: np.ndarray, masks: np.ndarray) -> float:
    """Intersection over union of the thresholded mask (0.5) with the ground truth."""
    predicted = probabilities > 0.5
    truth = masks > 0.5
    union = np.logical_or(predicted, truth).sum()
    return float(np.logical_and(predicted, truth).sum() / max(union, 1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", choices=[*NPU_MODELS, []], help=f"default: {', '.join(NPU_MODELS)}")
    args = parser.parse_args(argv)
    for name in args.models or NPU_MODELS:
        print(f"{name}: {NPU_MODELS[name].ensure()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
