#!/usr/bin/env python3
"""Train the task reference models (a transformer classifier, a CTC recogniser, a detector, a
text segmenter, a hard-swish classifier) and export them to ONNX next to the Fashion-MNIST CNNs.

    python tools/train_models.py --model fmnist_deit           # also writes fmnist_deit_decomposed.onnx
    python tools/train_models.py --model ocr_ctc --max-minutes 25
    python tools/train_models.py --model fmnist_yolo --epochs 1 --train-limit 512 --out-dir /tmp/m  # smoke run

Models (definitions in ``tools/reference_models/{transformer_nets,conv_nets}.py``, data and metrics
in ``tools/bench/{synthetic,tasks}.py``):

* ``fmnist_deit`` -- DeiT-style ViT on 32x32 Fashion-MNIST (top-1 on the 10k test images);
  ``fmnist_deit_decomposed`` is the same weights exported with LayerNorm written op by op and GELU
  in its tanh form.
* ``fmnist_hardswish_se`` -- MobileNetV3-style classifier (hard-swish, SE with hard sigmoid).
* ``ocr_ctc`` -- 32x256 rendered text lines, conv stem + 2 transformer blocks, CTC (CER).
* ``fmnist_yolo`` -- 96x96 scenes of pasted Fashion-MNIST items, anchor-free head (mAP@0.5).
* ``text_seg`` -- 128x128 colour scenes with words, text-region probability map (IoU).

Deterministic: fixed seeds, one thread by default (two threads are slower than one while another
process holds a core), ``torch.use_deterministic_algorithms(True)``, data regenerated from seeds.
Each run merges its entries (float metrics, training history, export summary, command) into
``reference_models.json``. ``--max-minutes`` stops after the epoch that crosses the budget and
``--stop-after N`` after epoch N, the learning-rate schedule still planned for every epoch; the
entry then says so, and its command is the deterministic ``--stop-after`` form.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

_TOOLS = Path(__file__).resolve().parent
for _path in (_TOOLS, _TOOLS.parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from export_reference import (  # noqa: E402
    BATCH_AXIS,
    INPUT_NAME,
    OPSET,
    exit_status,
    export_onnx,
    update_manifest,
    verify_onnx,
)
from train_reference import augment, set_determinism  # noqa: E402

from tools.bench import synthetic, tasks  # noqa: E402
from tools.reference_models import conv_nets, transformer_nets  # noqa: E402
from tools.reference_models import data as fdata  # noqa: E402

FMNIST_NORMALISATION = {
    "pixel_scale": "x / 255",
    "pad": f"28x28 zero-padded by {fdata.PAD}px (before normalisation) -> 32x32",
    "mean": fdata.MEAN,
    "std": fdata.STD,
    "formula": "(x/255 - mean) / std",
}
SYNTHETIC_NORMALISATION = {"formula": "x/255 * 2 - 1", "range": [-1.0, 1.0]}


@dataclass(frozen=True)
class Recipe:
    """How one model is built, trained and described."""

    build: Callable[[], torch.nn.Module]
    arch: str
    epochs: int
    batch_size: int
    lr: float
    weight_decay: float
    target: tuple[str, str, float]  # (metric, ">=" or "<=", value) the float model must reach
    output_name: str
    output: str
    dataset: dict
    normalization: dict
    variants: dict[str, tuple[Callable[[], torch.nn.Module], str]] = field(default_factory=dict)


def synthetic_dataset(kind: str, name: str, generator: str, **details: str) -> dict:
    """The registry's description of a generated data set (sizes from :data:`tasks.SYNTHETIC_COUNTS`)."""
    return {"name": name, "generator": f"tools/bench/synthetic.py:{generator}(split, count)", **details}


FMNIST_DATASET = {"name": "Fashion-MNIST", "loader": "tools/reference_models/data.py:load_fashion_mnist(split)"}
RECIPES: dict[str, Recipe] = {
    "fmnist_deit": Recipe(
        build=transformer_nets.fmnist_deit,
        arch="fmnist_deit(): conv patch embedding (Conv-BN-ReLU 3x3/2, Conv 3x3/2: 64 tokens), class token, "
        "learned positions, 4 pre-norm blocks, width 64, 4 heads, MLP x2",
        epochs=8,
        batch_size=128,
        lr=1e-3,
        weight_decay=0.05,
        target=("accuracy", ">=", 0.88),
        output_name="logits",
        output="logits (no softmax)",
        dataset={**FMNIST_DATASET, "eval": "the 10k test images"},
        normalization=FMNIST_NORMALISATION,
        variants={
            "fmnist_deit_decomposed": (
                lambda: transformer_nets.fmnist_deit(norm="decomposed", gelu="tanh"),
                "fmnist_deit(norm='decomposed', gelu='tanh'): LayerNorm as ReduceMean/Sub/Pow/ReduceMean/Add/"
                "Sqrt/Div/Mul/Add, GELU in its tanh form; the weights of fmnist_deit",
            )
        },
    ),
    "fmnist_hardswish_se": Recipe(
        build=conv_nets.fmnist_hardswish_se,
        arch="fmnist_hardswish_se(): MobileNetV3-Small-style, hard-swish, SE with HardSigmoid gates",
        epochs=8,
        batch_size=128,
        lr=4e-3,
        weight_decay=1e-4,
        target=("accuracy", ">=", 0.88),
        output_name="logits",
        output="logits (no softmax)",
        dataset={**FMNIST_DATASET, "eval": "the 10k test images"},
        normalization=FMNIST_NORMALISATION,
    ),
    "ocr_ctc": Recipe(
        build=transformer_nets.ocr_ctc,
        arch="ocr_ctc(): Conv-BN-HardSwish stem (32 x 256 -> 1 x 64), 2 pre-norm blocks, width 96, Linear to 38",
        epochs=5,
        batch_size=64,
        lr=1.5e-3,
        weight_decay=0.01,
        target=("cer", "<=", 0.02),
        output_name="logits",
        output="(batch, 64, 38) per-position logits; class 0 = CTC blank, class i = CHARSET[i-1]",
        dataset=synthetic_dataset(
            "ctc",
            "rendered text lines",
            "text_lines",
            charset=synthetic.CHARSET,
            vocabulary=f"{len(synthetic.WORDS)} English words + {synthetic.NUMBER_RATE:.0%} numbers of 1-4 digits",
        ),
        normalization=SYNTHETIC_NORMALISATION,
    ),
    "fmnist_yolo": Recipe(
        build=conv_nets.fmnist_yolo,
        arch="fmnist_yolo(): Conv-BN-SiLU, C2f, SPPF, upsample+concat neck, decoupled anchor-free head, 12x12 cells",
        epochs=10,
        batch_size=64,
        lr=2e-3,
        weight_decay=5e-4,
        target=("map50", ">=", 0.5),
        output_name="detections",
        output="(batch, 14, 144): rows 0-3 xyxy boxes in pixels, rows 4-13 sigmoid class scores, per cell",
        dataset=synthetic_dataset(
            "detection",
            "Fashion-MNIST items pasted on noisy 96x96 backgrounds",
            "detection_scenes",
            items="train/calib scenes: Fashion-MNIST training images; eval scenes: test images",
        ),
        normalization=SYNTHETIC_NORMALISATION,
    ),
    "text_seg": Recipe(
        build=conv_nets.text_seg,
        arch="text_seg(): MobileNetV3-style backbone (hard-swish, SE), FPN with Resize, ConvTranspose head",
        epochs=8,
        batch_size=32,
        lr=3e-3,
        weight_decay=1e-4,
        target=("iou", ">=", 0.8),
        output_name="prob",
        output="(batch, 1, 128, 128) text-region probability (sigmoid)",
        dataset=synthetic_dataset(
            "segmentation",
            "rendered words and clutter on noisy 128x128 colour backgrounds",
            "text_scenes",
            target="each word's tight box, filled",
        ),
        normalization=SYNTHETIC_NORMALISATION,
    ),
}


NO_DECAY_NAMES = ("pos_embed", "cls_token")


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on conv/linear weights only: not on norms, biases or the ViT embeddings."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim > 1 and not name.endswith(NO_DECAY_NAMES) else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# --------------------------------------------------------------------------- training data
@dataclass
class TrainSet:
    """Training inputs and per-sample targets, and the loss of a batch of them."""

    x: torch.Tensor
    loss: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Generator], torch.Tensor]
    targets: dict[str, torch.Tensor]


def classification_set(limit: int | None) -> TrainSet:
    x, y = fdata.load_fashion_mnist("train")
    fill = float((0.0 - fdata.MEAN) / fdata.STD)

    def loss(model, xb, idx, gen):
        return F.cross_entropy(model(augment(xb, gen, 2, fill)), targets["labels"][idx], label_smoothing=0.1)

    targets = {"labels": torch.from_numpy(y[:limit])}
    return TrainSet(torch.from_numpy(x[:limit]), loss, targets)


def ctc_set(limit: int | None) -> TrainSet:
    images, texts = synthetic.text_lines("train", limit or tasks.SYNTHETIC_COUNTS["ctc"]["train"])
    longest = max(len(t) for t in texts)
    labels = torch.zeros(len(texts), longest, dtype=torch.long)
    for i, text in enumerate(texts):
        labels[i, : len(text)] = torch.tensor(synthetic.encode_text(text))
    lengths = torch.tensor([len(t) for t in texts])

    def loss(model, xb, idx, gen):
        log_probs = model(xb).log_softmax(-1).transpose(0, 1)  # (T, B, C)
        input_lengths = torch.full((len(idx),), log_probs.shape[0], dtype=torch.long)
        return F.ctc_loss(log_probs, labels[idx], input_lengths, lengths[idx], blank=0, zero_infinity=True)

    return TrainSet(torch.from_numpy(tasks.normalise_synthetic(images)), loss, {})


def detection_targets(model: conv_nets.YoloDetector, boxes, classes) -> tuple[torch.Tensor, torch.Tensor]:
    """Per cell: the assigned box ``(N, cells, 4)`` and class ``(N, cells)`` (-1: background).

    A cell is positive for a box when its centre lies inside the box and within 1.5 cells of the box
    centre (FCOS centre sampling); a cell that two boxes claim takes the smaller one.
    """
    centres = model.centres[0, :2].T.numpy()  # (cells, 2) x, y
    radius = 1.5 * model.stride
    assigned_boxes = np.zeros((len(boxes), len(centres), 4), np.float32)
    assigned_classes = np.full((len(boxes), len(centres)), -1, np.int64)
    for i, (b, c) in enumerate(zip(boxes, classes, strict=True)):
        if not len(b):
            continue
        cx, cy = centres[:, 0:1], centres[:, 1:2]
        inside = (cx > b[:, 0]) & (cx < b[:, 2]) & (cy > b[:, 1]) & (cy < b[:, 3])
        near = (np.abs(cx - (b[:, 0] + b[:, 2]) / 2) < radius) & (np.abs(cy - (b[:, 1] + b[:, 3]) / 2) < radius)
        area = np.where(inside & near, ((b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1]))[None, :], np.inf)
        best = area.argmin(1)
        positive = np.isfinite(area.min(1))
        assigned_boxes[i, positive] = b[best[positive]]
        assigned_classes[i, positive] = c[best[positive]]
    return torch.from_numpy(assigned_boxes), torch.from_numpy(assigned_classes)


def giou_loss(pred: torch.Tensor, true: torch.Tensor) -> torch.Tensor:
    """1 - generalised IoU of matching xyxy rows."""
    wh = (torch.min(pred[:, 2:], true[:, 2:]) - torch.max(pred[:, :2], true[:, :2])).clamp(min=0)
    inter = wh[:, 0] * wh[:, 1]
    area_p = (pred[:, 2] - pred[:, 0]) * (pred[:, 3] - pred[:, 1])
    area_t = (true[:, 2] - true[:, 0]) * (true[:, 3] - true[:, 1])
    union = area_p + area_t - inter
    hull = (torch.max(pred[:, 2:], true[:, 2:]) - torch.min(pred[:, :2], true[:, :2])).prod(1)
    return 1 - inter / union + (hull - union) / hull


def detection_set(limit: int | None, model: conv_nets.YoloDetector) -> TrainSet:
    images, boxes, classes = synthetic.detection_scenes("train", limit or tasks.SYNTHETIC_COUNTS["detection"]["train"])
    assigned_boxes, assigned_classes = detection_targets(model, boxes, classes)

    def loss(model, xb, idx, gen):
        box_raw, cls_logits = model.raw(xb)
        cls_true = assigned_classes[idx]  # (B, cells)
        positive = cls_true >= 0
        num_pos = max(int(positive.sum()), 1)
        one_hot = F.one_hot(cls_true.clamp(min=0), model.num_classes).transpose(1, 2).float()
        one_hot = one_hot * positive[:, None, :]
        cls_loss = focal_loss(cls_logits, one_hot).sum() / num_pos
        pred = model.decode(box_raw).transpose(1, 2)[positive]  # (P, 4)
        box_loss = giou_loss(pred, assigned_boxes[idx][positive]).sum() / num_pos
        return cls_loss + 2.0 * box_loss

    return TrainSet(torch.from_numpy(tasks.normalise_synthetic(images)), loss, {})


def focal_loss(logits: torch.Tensor, target: torch.Tensor, alpha: float = 0.25, gamma: float = 2.0):
    """Sigmoid focal loss per element (RetinaNet), without torchvision."""
    p = torch.sigmoid(logits)
    ce = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
    p_t = p * target + (1 - p) * (1 - target)
    return (alpha * target + (1 - alpha) * (1 - target)) * ce * (1 - p_t) ** gamma


def segmentation_set(limit: int | None) -> TrainSet:
    images, masks = synthetic.text_scenes("train", limit or tasks.SYNTHETIC_COUNTS["segmentation"]["train"])
    truth = torch.from_numpy(masks).float()[:, None]

    def loss(model, xb, idx, gen):
        logits = model.logits(xb)
        target = truth[idx]
        prob = torch.sigmoid(logits)
        dice = 1 - (2 * (prob * target).sum((1, 2, 3)) + 1) / (prob.sum((1, 2, 3)) + target.sum((1, 2, 3)) + 1)
        return F.binary_cross_entropy_with_logits(logits, target) + dice.mean()

    return TrainSet(torch.from_numpy(tasks.normalise_synthetic(images)), loss, {})


def training_set(name: str, model: torch.nn.Module, limit: int | None) -> TrainSet:
    kind = tasks.get_task(name).kind
    if kind == "classification":
        return classification_set(limit)
    if kind == "ctc":
        return ctc_set(limit)
    if kind == "detection":
        return detection_set(limit, model)
    return segmentation_set(limit)


# -------------------------------------------------------------------------------- training
def train(name: str, recipe: Recipe, args: argparse.Namespace) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(args.seed)
    model = recipe.build()
    n_params = sum(p.numel() for p in model.parameters())
    t_data = time.time()
    data = training_set(name, model, args.train_limit)
    data_seconds = time.time() - t_data
    epochs = args.epochs or recipe.epochs
    bs = recipe.batch_size
    steps = len(data.x) // bs
    opt = torch.optim.AdamW(param_groups(model, recipe.weight_decay), lr=recipe.lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=recipe.lr, epochs=epochs, steps_per_epoch=steps, pct_start=0.15, div_factor=20.0
    )
    gen = torch.Generator().manual_seed(args.seed + 1000)
    print(
        f"[{name}] {n_params} params, {len(data.x)} samples ({data_seconds:.0f}s to build), "
        f"{epochs} epochs x {steps} steps (bs {bs}), AdamW lr {recipe.lr} wd {recipe.weight_decay}",
        flush=True,
    )
    history, stopped_early, t_start = [], False, time.time()
    for epoch in range(epochs):
        model.train()
        t0, total = time.time(), 0.0
        perm = torch.randperm(len(data.x), generator=gen)
        for s in range(steps):
            idx = perm[s * bs : (s + 1) * bs]
            loss = data.loss(model, data.x[idx], idx, gen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            total += float(loss.detach())
            if not math.isfinite(total):
                raise RuntimeError(f"[{name}] loss is {total} at epoch {epoch + 1} step {s}")
        seconds = time.time() - t0
        probe = tasks.evaluate(name, model.eval(), "eval", num=args.probe)
        history.append(
            {"epoch": epoch + 1, "train_loss": round(total / steps, 4), **probe, "epoch_seconds": round(seconds, 1)}
        )
        print(f"[{name}] epoch {epoch + 1}/{epochs} loss {total / steps:.4f} {probe} ({seconds:.0f}s)", flush=True)
        if epoch + 1 < epochs and (
            epoch + 1 == args.stop_after or (args.max_minutes and time.time() - t_start > 60 * args.max_minutes)
        ):
            stopped_early = True
            print(f"[{name}] stopping after epoch {epoch + 1} of {epochs}", flush=True)
            break
    info = {
        "num_params": n_params,
        "train_samples": len(data.x),
        "epochs": len(history),
        "epochs_planned": epochs,
        "stopped_early": stopped_early,
        "batch_size": bs,
        "optimizer": "AdamW, gradient norm clipped at 5",
        "lr_schedule": f"OneCycleLR(max_lr={recipe.lr}, pct_start=0.15, div_factor=20)",
        "weight_decay": recipe.weight_decay,
        "weight_decay_on": "conv/linear weights only (no norm affine, biases, positional embedding, class token)",
        "seed": args.seed,
        "threads": torch.get_num_threads(),
        "data_seconds": round(data_seconds, 1),
        "train_seconds": round(time.time() - t_start, 1),
        "probe": f"metrics after each epoch on the first {args.probe} eval samples",
        "history": history,
    }
    return model.eval(), info


def export_entry(
    name: str, model: torch.nn.Module, recipe: Recipe, arch: str, args: argparse.Namespace, training: dict
) -> tuple[dict, list[str]]:
    """Export ``model`` as ``name``.onnx, check it against torch and score both on the eval split."""
    task = tasks.get_task(name)
    path = args.out_dir / f"{name}.onnx"
    graph = export_onnx(model, path, (1, *task.input_shape), output_name=recipe.output_name)
    x = tasks.load(name, "eval", args.probe).x
    with torch.no_grad():  # outputs in pixels (boxes) reach hundreds: the tolerance scales with them
        scale = max(1.0, float(model(torch.from_numpy(x[:256])).abs().max()))
    verification = verify_onnx(path, model, x[:256], atol=args.tolerance * scale, strict=False)
    float_metrics = tasks.evaluate(name, model, "eval", num=args.eval_limit)
    ort_metrics = tasks.evaluate(name, path, "eval", num=args.eval_limit)
    print(f"[{name}] float {float_metrics}; onnxruntime {ort_metrics}; {graph['size_bytes'] / 1e6:.2f} MB", flush=True)
    failures = [] if verification["passed"] else [f"{name}: ONNX and torch outputs differ (see verification)"]
    metric, sense, bound = recipe.target
    value = float_metrics[metric]
    if (value < bound) if sense == ">=" else (value > bound):
        failures.append(f"{name}: float {metric} {value:.4f} misses the target {sense} {bound}")
    with torch.no_grad():
        out_shape = [BATCH_AXIS, *model(torch.from_numpy(x[:1])).shape[1:]]
    entry = {
        "onnx": path.name,
        "sha256": graph["sha256"],
        "size_bytes": graph["size_bytes"],
        "architecture": arch,
        "task": f"{task.kind} (tools/bench/tasks.py; evaluate('{name}', run, split))",
        "float_metrics": float_metrics,
        "float_metrics_onnxruntime": ort_metrics,
        "target": f"{metric} {sense} {bound}",
        "input_name": INPUT_NAME,
        "output_name": recipe.output_name,
        "input_shape": [BATCH_AXIS, *task.input_shape],
        "input_dtype": "float32",
        "layout": "NCHW",
        "output_shape": out_shape,
        "output": recipe.output,
        "normalization": recipe.normalization,
        "dataset": {**recipe.dataset, **tasks.SYNTHETIC_COUNTS.get(task.kind, {})},
        "training": training,
        "export": {
            "exporter": "torch.onnx.export(dynamo=False) (TorchScript exporter)",
            "opset": OPSET,
            "do_constant_folding": False,
            "dynamic_axes": {INPUT_NAME: {"0": BATCH_AXIS}, recipe.output_name: {"0": BATCH_AXIS}},
            "batchnorm_nodes": graph["op_counts"].get("BatchNormalization", 0),
            "num_initializers": graph["num_initializers"],
            "initializer_params": graph["initializer_params"],
            "op_counts": graph["op_counts"],
            "ir_version": graph["ir_version"],
        },
        "verification": verification,
        "command": training.pop("command", None)
        or reproducing_command(args.argv, training.get("epochs") if training.get("stopped_early") else None),
    }
    if task.kind == "classification":
        entry["float_test_accuracy"] = float_metrics["accuracy"]
    return entry, failures


def reload(name: str, json_path: Path) -> tuple[torch.nn.Module, dict]:
    """The trained model rebuilt from its ONNX next to ``json_path``, and the training its entry records."""
    import json

    from tools.reference_models.torch_weights import load_reference_model

    entry = json.loads(json_path.read_text())["models"][name]
    training = entry["training"]
    stopped = training["epochs"] if training.get("stopped_early") else None
    command = reproducing_command(entry["command"].split()[2:], stopped)
    return load_reference_model(name, json_path.parent), {**training, "command": command}


def reproducing_command(argv: list[str], stopped_after: int | None) -> str:
    """The command line that gives the same weights: a run that the clock stopped is ``--stop-after`` its epochs.

    Example:
        >>> reproducing_command(["--model", "ocr_ctc", "--max-minutes", "40"], 2)
        'python tools/train_models.py --model ocr_ctc --stop-after 2'
    """
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--max-minutes", "--stop-after"):
            skip = True
        elif not arg.startswith(("--max-minutes=", "--stop-after=")):
            kept.append(arg)
    if stopped_after is not None:
        kept += ["--stop-after", str(stopped_after)]
    return " ".join(["python tools/train_models.py", *kept])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(RECIPES), action="append", required=True, help="repeatable")
    p.add_argument("--out-dir", type=Path, default=_TOOLS / "models")
    p.add_argument("--epochs", type=int, default=None, help="override the recipe's epoch count")
    p.add_argument("--max-minutes", type=float, default=None, help="stop after the epoch that crosses this budget")
    p.add_argument(
        "--stop-after", type=int, default=None, help="stop after N epochs of the planned schedule (deterministic)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--train-limit", type=int, default=None, help="train on the first N samples (smoke runs)")
    p.add_argument("--eval-limit", type=int, default=None, help="score on the first N eval samples (smoke runs)")
    p.add_argument("--probe", type=int, default=500, help="eval samples scored after each epoch")
    p.add_argument(
        "--tolerance",
        type=float,
        default=1e-3,
        help="largest |onnxruntime - torch| output difference, relative to max(1, largest |output|)",
    )
    p.add_argument(
        "--reexport",
        action="store_true",
        help="no training: export and score the weights of the committed ONNX again, keeping the recorded training",
    )
    p.add_argument("--no-check", action="store_true", help="don't fail below the metric targets")
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    set_determinism(args.seed, args.threads)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.out_dir / "reference_models.json"
    failures = []
    for name in args.model:
        recipe = RECIPES[name]
        model, training = reload(name, json_path) if args.reexport else train(name, recipe, args)
        entry, failed = export_entry(name, model, recipe, recipe.arch, args, training)
        update_manifest(json_path, name, entry)
        failures += failed
        for variant, (build, arch) in recipe.variants.items():
            twin = build()
            twin.load_state_dict(model.state_dict())
            entry, failed = export_entry(variant, twin.eval(), recipe, arch, args, {"weights_of": name})
            update_manifest(json_path, variant, entry)
            failures += failed
    print(f"wrote {json_path}", flush=True)
    return exit_status(failures, args.no_check)


if __name__ == "__main__":
    sys.exit(main())
