#!/usr/bin/env python3
"""Train the small Fashion-MNIST reference models and export them to ONNX.

    python tools/train_reference.py                    # both models (~10 min on 2 idle cores)
    python tools/train_reference.py --only resnet18    # one model; JSON entries are merged

Outputs (``--out-dir``, default ``tools/models/``):

* ``fmnist_resnet18.onnx``    -- ``resnet18_shape(width=16)``
* ``fmnist_mobilenetv2.onnx`` -- ``mobilenetv2_shape(width_mult=0.5)``
* ``reference_models.json``   -- accuracy / input spec / normalisation / sha256 per model

Data: Fashion-MNIST idx files, 28x28 zero-padded to 32x32, normalised with mean 0.2860 /
std 0.3530 (see ``reference_models/data.py``).  Augmentation: random crop (pad 2, fill =
normalised background) + horizontal flip.  Deterministic: fixed seed, 2 threads,
``torch.use_deterministic_algorithms(True)``, seeded generator for shuffling/augmentation.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

_TOOLS = Path(__file__).resolve().parent
if str(_TOOLS) not in sys.path:
    sys.path.insert(0, str(_TOOLS))

from export_reference import (  # noqa: E402
    BATCH_AXIS,
    INPUT_NAME,
    OPSET,
    OUTPUT_NAME,
    exit_status,
    export_onnx,
    torch_predict,
    update_manifest,
    verify_onnx,
)
from reference_models import data as fdata  # noqa: E402
from reference_models.nets import mobilenetv2_shape, resnet18_shape  # noqa: E402

MODELS = {
    "resnet18": dict(
        file="fmnist_resnet18.onnx",
        build=lambda: resnet18_shape(num_classes=10, width=16, in_ch=1),
        arch="resnet18_shape(num_classes=10, width=16, in_ch=1)",
        epochs=5,
        batch_size=128,
        optimizer="sgd",
        lr=0.15,
        weight_decay=5e-4,
        min_test_acc=0.90,
    ),
    "mobilenetv2": dict(
        file="fmnist_mobilenetv2.onnx",
        build=lambda: mobilenetv2_shape(num_classes=10, width_mult=0.5, in_ch=1),
        arch="mobilenetv2_shape(num_classes=10, width_mult=0.5, in_ch=1)",
        epochs=4,
        batch_size=128,
        optimizer="sgd",
        lr=0.1,
        weight_decay=5e-5,
        min_test_acc=0.88,
    ),
}


def set_determinism(seed: int, threads: int) -> None:
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    np.random.seed(seed)
    torch.use_deterministic_algorithms(True)


def augment(x: torch.Tensor, gen: torch.Generator, pad: int, fill: float) -> torch.Tensor:
    """Per-sample random crop (zero-background padding) + random horizontal flip."""
    n, c, h, w = x.shape
    xp = F.pad(x, (pad, pad, pad, pad), value=fill)
    oy = torch.randint(0, 2 * pad + 1, (n,), generator=gen)
    ox = torch.randint(0, 2 * pad + 1, (n,), generator=gen)
    rows = (oy[:, None] + torch.arange(h))[:, None, :, None]  # n,1,h,1
    cols = (ox[:, None] + torch.arange(w))[:, None, None, :]  # n,1,1,w
    out = xp[torch.arange(n)[:, None, None, None], torch.arange(c)[None, :, None, None], rows, cols]
    flip = torch.rand(n, generator=gen) < 0.5
    return torch.where(flip[:, None, None, None], out.flip(3), out)


def param_groups(model: torch.nn.Module, wd: float):
    decay, no_decay = [], []
    for p in model.parameters():
        (decay if p.ndim > 1 else no_decay).append(p)  # no WD on BN affine / biases
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, bs: int = 1000) -> float:
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(x), bs):
            xb = x[i : i + bs].contiguous(memory_format=torch.channels_last)
            correct += int((model(xb).argmax(1) == y[i : i + bs]).sum())
    return correct / len(x)


def train_one(
    name: str, cfg: dict, xtr, ytr, xte, yte, seed: int, epochs: int | None, aug_pad: int
) -> tuple[torch.nn.Module, dict]:
    epochs = epochs or cfg["epochs"]
    torch.manual_seed(seed)
    model = cfg["build"]()
    n_params = sum(p.numel() for p in model.parameters())
    # channels_last is ~1.6x faster for the depthwise convs of MobileNetV2 on CPU
    model = model.to(memory_format=torch.channels_last)
    bs = cfg["batch_size"]
    steps_per_epoch = len(xtr) // bs  # drop last partial batch
    if cfg["optimizer"] == "sgd":
        opt = torch.optim.SGD(param_groups(model, cfg["weight_decay"]), lr=cfg["lr"], momentum=0.9, nesterov=True)
    else:
        opt = torch.optim.AdamW(param_groups(model, cfg["weight_decay"]), lr=cfg["lr"])
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt,
        max_lr=cfg["lr"],
        epochs=epochs,
        steps_per_epoch=steps_per_epoch,
        pct_start=0.25,
        div_factor=20.0,
        final_div_factor=200.0,
    )
    gen = torch.Generator().manual_seed(seed + 1000)
    fill = float((0.0 - fdata.MEAN) / fdata.STD)
    history = []
    print(
        f"[{name}] {cfg['arch']}: {n_params} params, {epochs} epochs x {steps_per_epoch} steps "
        f"(bs {bs}), {cfg['optimizer']} lr {cfg['lr']} wd {cfg['weight_decay']}",
        flush=True,
    )
    t_start = time.time()
    for ep in range(epochs):
        model.train()
        t0 = time.time()
        perm = torch.randperm(len(xtr), generator=gen)
        tot_loss, tot_correct, seen = 0.0, 0, 0
        for s in range(steps_per_epoch):
            idx = perm[s * bs : (s + 1) * bs]
            xb = augment(xtr[idx], gen, aug_pad, fill).contiguous(memory_format=torch.channels_last)
            yb = ytr[idx]
            logits = model(xb)
            loss = F.cross_entropy(logits, yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            tot_loss += float(loss.detach()) * len(yb)
            tot_correct += int((logits.argmax(1) == yb).sum())
            seen += len(yb)
        train_time = time.time() - t0
        acc = evaluate(model, xte, yte)
        rec = {
            "epoch": ep + 1,
            "train_loss": round(tot_loss / seen, 4),
            "train_acc": round(tot_correct / seen, 4),
            "test_acc": acc,
            "epoch_seconds": round(train_time, 1),
        }
        history.append(rec)
        print(
            f"[{name}] epoch {ep + 1}/{epochs}  loss {rec['train_loss']:.4f}  "
            f"train_acc {rec['train_acc']:.4f}  test_acc {acc:.4f}  "
            f"({train_time:.1f}s train, {time.time() - t0:.1f}s total)",
            flush=True,
        )
    total = time.time() - t_start
    model = model.eval().to(memory_format=torch.contiguous_format)
    info = {
        "num_params": n_params,
        "epochs": epochs,
        "batch_size": bs,
        "optimizer": ("SGD(momentum=0.9, nesterov=True)" if cfg["optimizer"] == "sgd" else "AdamW"),
        "lr_schedule": f"OneCycleLR(max_lr={cfg['lr']}, pct_start=0.25, div_factor=20, final_div_factor=200)",
        "weight_decay": cfg["weight_decay"],
        "weight_decay_on": "conv/linear weights only (no BN affine, no biases)",
        "augmentation": f"random crop 32x32 from {aug_pad}px-padded (fill=normalised 0), horizontal flip p=0.5",
        "seed": seed,
        "threads": torch.get_num_threads(),
        "train_seconds": round(total, 1),
        "history": history,
    }
    return model, info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--only", choices=sorted(MODELS), action="append", help="train only this model (repeatable); default: all"
    )
    p.add_argument("--out-dir", type=Path, default=_TOOLS / "models")
    p.add_argument("--data-dir", default=None, help="Fashion-MNIST idx directory")
    p.add_argument("--epochs", type=int, default=None, help="override per-model epoch count")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--aug-pad", type=int, default=2)
    p.add_argument("--train-limit", type=int, default=None, help="use only the first N training images (smoke tests)")
    p.add_argument("--no-check", action="store_true", help="don't fail below the accuracy targets")
    args = p.parse_args(argv)

    set_determinism(args.seed, args.threads)
    t0 = time.time()
    xtr_np, ytr_np = fdata.load_fashion_mnist("train", args.data_dir)
    if args.train_limit:
        xtr_np, ytr_np = xtr_np[: args.train_limit], ytr_np[: args.train_limit]
    xte_np, yte_np = fdata.load_fashion_mnist("test", args.data_dir)
    print(f"data: train {xtr_np.shape} test {xte_np.shape} ({time.time() - t0:.1f}s)", flush=True)
    xtr, ytr = torch.from_numpy(xtr_np), torch.from_numpy(ytr_np)
    xte, yte = torch.from_numpy(xte_np), torch.from_numpy(yte_np)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.out_dir / "reference_models.json"
    common = {
        "description": "Reference models for the quantization toolkit, float32, BatchNorm unfused: the "
        "Fashion-MNIST CNNs of tools/train_reference.py and the task models of tools/train_models.py.",
        "dataset": {
            "name": "Fashion-MNIST",
            "source": "train/t10k idx files (gzip), see tools/reference_models/data.py",
            "loader": "tools/reference_models/data.py:load_fashion_mnist(split)",
            "test_samples": len(yte_np),
            "classes": list(fdata.CLASSES),
        },
        "environment": {
            "torch": torch.__version__,
            "onnx": __import__("onnx").__version__,
            "onnxruntime": __import__("onnxruntime").__version__,
            "python": platform.python_version(),
        },
    }
    failures = []
    for name in args.only or list(MODELS):
        cfg = MODELS[name]
        model, info = train_one(name, cfg, xtr, ytr, xte, yte, args.seed, args.epochs, args.aug_pad)
        logits = torch_predict(model, xte_np)
        float_acc = float(np.mean(logits.argmax(1) == yte_np))
        onnx_path = args.out_dir / cfg["file"]
        graph = export_onnx(model, onnx_path, (1, 1, fdata.IMAGE_SIZE, fdata.IMAGE_SIZE))
        ver = verify_onnx(onnx_path, model, xte_np, yte_np, atol=1e-4, strict=False)
        if not ver["passed"]:
            failures.append(f"{name}: ONNX/torch logits differ (see verification in JSON)")
        print(
            f"[{name}] float test acc {float_acc:.4f}; ONNX {graph['size_bytes'] / 1e6:.2f} MB, "
            f"ORT acc {ver['accuracy_ort_optimized']:.4f}, max|diff| "
            f"{ver['max_abs_diff_ort_optimized']:.2e} (opt) / {ver['max_abs_diff_ort_unoptimized']:.2e} "
            f"(no opt); BN nodes {graph['op_counts'].get('BatchNormalization', 0)}",
            flush=True,
        )
        if float_acc < cfg["min_test_acc"]:
            failures.append(f"{name}: {float_acc:.4f} < {cfg['min_test_acc']}")
        entry = {
            "onnx": cfg["file"],
            "sha256": graph["sha256"],
            "size_bytes": graph["size_bytes"],
            "architecture": cfg["arch"],
            "float_test_accuracy": float_acc,
            "float_test_accuracy_onnxruntime": ver["accuracy_ort_optimized"],
            "input_name": INPUT_NAME,
            "output_name": OUTPUT_NAME,
            "input_shape": [BATCH_AXIS, 1, fdata.IMAGE_SIZE, fdata.IMAGE_SIZE],
            "input_dtype": "float32",
            "layout": "NCHW",
            "output_shape": [BATCH_AXIS, 10],
            "output": "logits (no softmax)",
            "normalization": {
                "pixel_scale": "x / 255",
                "pad": f"28x28 zero-padded by {fdata.PAD}px (before normalisation) -> 32x32",
                "mean": fdata.MEAN,
                "std": fdata.STD,
                "formula": "(x/255 - mean) / std",
            },
            "training": info,
            "export": {
                "exporter": "torch.onnx.export(dynamo=False) (TorchScript exporter)",
                "opset": OPSET,
                "do_constant_folding": False,
                "dynamic_axes": {INPUT_NAME: {"0": BATCH_AXIS}, OUTPUT_NAME: {"0": BATCH_AXIS}},
                "bn_fused": graph["bn_fused"],
                "batchnorm_nodes": graph["op_counts"].get("BatchNormalization", 0),
                "weights_as_initializers": graph["conv_gemm_weights_are_initializers"],
                "num_initializers": graph["num_initializers"],
                "initializer_params": graph["initializer_params"],
                "constant_nodes": graph["constant_nodes"],
                "identity_nodes": graph["identity_nodes"],
                "op_counts": graph["op_counts"],
                "ir_version": graph["ir_version"],
            },
            "verification": ver,
            "command": "python tools/train_reference.py " + " ".join(sys.argv[1:] if argv is None else argv),
        }
        update_manifest(json_path, Path(cfg["file"]).stem, entry, common)
    print(f"wrote {json_path} (total {time.time() - t0:.0f}s)", flush=True)
    return exit_status(failures, args.no_check)


if __name__ == "__main__":
    sys.exit(main())
