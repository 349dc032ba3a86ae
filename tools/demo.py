"""The main job on the built-in example: quantize the Fashion-MNIST ResNet-18-shape
model shipped in tools/models/ with quant-onnx and compare it with the float model.

    python tools/demo.py [--model tools/models/fmnist_resnet18.onnx] [--presets a8w8 xint8] [--out out/]

Calibrates on 512 training images, evaluates top-1 accuracy on the 10k test images,
and prints accuracy, file size and batch-32 latency in onnxruntime for each preset.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import quant_onnx  # noqa: E402
from tools.reference_models.data import load_fashion_mnist  # noqa: E402


def _session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = os.cpu_count() or 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _accuracy(path: Path, images: np.ndarray, labels: np.ndarray) -> float:
    session = _session(path)
    name = session.get_inputs()[0].name
    correct = 0
    for start in range(0, len(images), 500):
        logits = session.run(None, {name: images[start : start + 500]})[0]
        correct += int((logits.argmax(axis=1) == labels[start : start + 500]).sum())
    return correct / len(images)


def _latency_ms(path: Path, batch: np.ndarray, repeats: int = 20) -> float:
    session = _session(path)
    name = session.get_inputs()[0].name
    for _ in range(3):
        session.run(None, {name: batch})
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        session.run(None, {name: batch})
        times.append(time.perf_counter() - start)
    return 1000.0 * float(np.median(times))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / "tools/models/fmnist_resnet18.onnx")
    parser.add_argument("--presets", nargs="+", default=["a8w8", "xint8"])
    parser.add_argument("--out", type=Path, default=ROOT / "out")
    parser.add_argument("--num-calib", type=int, default=512)
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)

    train_x, _ = load_fashion_mnist("train")
    test_x, test_y = load_fashion_mnist("test")
    calib = train_x[: args.num_calib]
    args.out.mkdir(parents=True, exist_ok=True)

    rows = [("float", args.model)]
    for preset in args.presets:
        out = args.out / f"{args.model.stem}.{preset}.onnx"
        start = time.perf_counter()
        quant_onnx.quantize(args.model, out, preset, calib, batch_size=32, quiet=args.quiet)
        print(f"quantized with preset {preset} in {time.perf_counter() - start:.1f} s -> {out}")
        rows.append((preset, out))

    batch = test_x[:32]
    float_latency = None
    print("\n| model | top-1 (10k test) | file size | latency b32 | speed-up |\n|---|---|---|---|---|")
    for name, path in rows:
        latency = _latency_ms(path, batch)
        float_latency = float_latency or latency
        accuracy = _accuracy(path, test_x, test_y)
        size_kb = path.stat().st_size / 1024
        print(f"| {name} | {accuracy:.4f} | {size_kb:.0f} KiB | {latency:.2f} ms | {float_latency / latency:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
