"""The main job on the built-in example: the Fashion-MNIST MobileNetV2-shape model shipped
in tools/models/, quantized through both backends and run on the NPU simulator.

    python tools/demo.py [--model fmnist_mobilenetv2] [--num-calib 256] [--qat-steps 150] [--out out/] [--quiet]

Rows (each evaluated on the 10,000 Fashion-MNIST test images):

- float: the float ONNX model in onnxruntime;
- PTQ a8w8, PTQ xint8, PTQ xint8_adaround (the NPU recipe: MinMSE power-of-two weights,
  CLE, AdaRound): quant-onnx on the float ONNX model, calibrated on ``--num-calib``
  training images;
- QAT xint8 (TQT): quant-torch-fx on the same model as an ``nn.Module`` with the recipe
  docs/benchmarks.md recommends: the PTQ recipe's formats and CLE, batch norm folded
  into the convolutions, then a short quantization-aware finetune (``--qat-steps``
  batches of 64, distilled from the float model; it learns the rounding AdaRound would
  choose, so AdaRound is left out), frozen and exported to QDQ ONNX, run in onnxruntime;
- NPU simulator: the xint8_adaround model legalised for the ``xint8`` NPU
  profile and run by quant-npu's integer-only simulator.

Prints one table: top-1, change from float, file size, batch-32 latency in onnxruntime
(simulator: its batch-32 time) and the seconds each row took to produce.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.reference_models.data import load_fashion_mnist  # noqa: E402

EVAL_BATCH = 500
LATENCY_BATCH = 32


def _session(path: Path):  # -> onnxruntime.InferenceSession
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = os.cpu_count() or 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _predict_ort(path: Path) -> Callable[[np.ndarray], np.ndarray]:
    session = _session(path)
    name = session.get_inputs()[0].name
    return lambda x: session.run(None, {name: x})[0]


def _predict_simulator(path: Path) -> Callable[[np.ndarray], np.ndarray]:
    from quant_npu.sim import NPUSimulator

    simulator = NPUSimulator(path, rounding="device")
    return lambda x: next(iter(simulator.run(x, quiet=True).values()))


def _accuracy(predict: Callable[[np.ndarray], np.ndarray], images: np.ndarray, labels: np.ndarray) -> float:
    correct = 0
    for start in range(0, len(images), EVAL_BATCH):
        logits = predict(images[start : start + EVAL_BATCH])
        correct += int((logits.argmax(axis=1) == labels[start : start + EVAL_BATCH]).sum())
    return correct / len(images)


def _latency_ms(predict: Callable[[np.ndarray], np.ndarray], batch: np.ndarray, repeats: int = 20) -> float:
    for _ in range(3):
        predict(batch)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        predict(batch)
        times.append(time.perf_counter() - start)
    return 1000.0 * float(np.median(times))


def _ptq(float_path: Path, out: Path, config, calib: np.ndarray, quiet: bool) -> Path:
    import quant_onnx

    quant_onnx.quantize(float_path, out, config, calib, batch_size=32, quiet=quiet)
    return out


def _qat(model_name: str, out: Path, calib: np.ndarray, train_x: np.ndarray, steps: int, quiet: bool) -> Path:
    import torch

    from quant_core.algorithm_config import CLEConfig
    from quant_core.presets import get_preset
    from quant_torch_fx import ModelQuantizer, train_qat
    from tools.reference_models.torch_weights import load_reference_model

    torch.manual_seed(0)
    model = load_reference_model(model_name)
    example = (torch.from_numpy(calib[:1]),)
    # The PTQ recipe (xint8_adaround's MinMSE power-of-two formats and CLE) as the start;
    # training takes AdaRound's place.
    quantizer = ModelQuantizer(get_preset("xint8_adaround").evolve(algorithms=(CLEConfig(),)), quiet=quiet)
    calib_batches = [torch.from_numpy(calib[i : i + 64]) for i in range(0, len(calib), 64)]
    qat = quantizer.prepare_qat(model, example, calib_loader=calib_batches, fold_batch_norm=True)
    order = np.random.default_rng(0).permutation(len(train_x))[: steps * 64]
    batches = [torch.from_numpy(train_x[order[i : i + 64]]) for i in range(0, len(order), 64)]
    # No labels: distillation from the float model, as with unlabeled deployment data.
    # Small steps: each weight moves by at most a fraction of its quantization step per
    # update (weight_lr_per_step), the rest at 1e-5, so training refines the PTQ start.
    train_qat(
        qat, batches, teacher=model, epochs=1, lr=1e-5, weight_lr_per_step=0.002, freeze_batch_norm=True, quiet=quiet
    )
    quantizer.export_onnx(quantizer.freeze(qat), example, out)
    return out


def _npu(quantized: Path, out: Path) -> Path:
    from quant_npu import legalize

    result = legalize(quantized, out, "xint8")
    if not result.remaining.ok:
        raise SystemExit(f"legalised model still breaks rules of the xint8 profile: {result.remaining}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="fmnist_mobilenetv2", choices=["fmnist_mobilenetv2", "fmnist_resnet18"])
    parser.add_argument("--out", type=Path, default=ROOT / "out")
    parser.add_argument("--num-calib", type=int, default=256)
    parser.add_argument("--qat-steps", type=int, default=150, help="QAT batches of 64 (0: skip the QAT row)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)

    float_path = ROOT / "tools" / "models" / f"{args.model}.onnx"
    train_x, _ = load_fashion_mnist("train")
    test_x, test_y = load_fashion_mnist("test")
    calib = train_x[-args.num_calib :]  # QAT draws from the rest of the training set
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / args.model

    jobs: list[tuple[str, str, Callable[[], Path], str]] = [
        ("float", "onnxruntime", lambda: float_path, "ort"),
        (
            "PTQ a8w8",
            "quant-onnx",
            lambda: _ptq(float_path, Path(f"{stem}.a8w8.onnx"), "a8w8", calib, args.quiet),
            "ort",
        ),
        (
            "PTQ xint8",
            "quant-onnx",
            lambda: _ptq(float_path, Path(f"{stem}.xint8.onnx"), "xint8", calib, args.quiet),
            "ort",
        ),
        (
            "PTQ xint8_adaround",
            "quant-onnx",
            lambda: _ptq(float_path, Path(f"{stem}.xint8_adaround.onnx"), "xint8_adaround", calib, args.quiet),
            "ort",
        ),
    ]
    if args.qat_steps > 0:
        train_pool = train_x[: -args.num_calib]
        jobs.append(
            (
                f"QAT xint8 TQT, CLE, folded BN ({args.qat_steps} steps)",
                "quant-torch-fx",
                lambda: _qat(args.model, Path(f"{stem}.xint8_qat.onnx"), calib, train_pool, args.qat_steps, args.quiet),
                "ort",
            )
        )
    jobs.append(
        (
            "NPU simulator (xint8_adaround)",
            "quant-npu",
            lambda: _npu(Path(f"{stem}.xint8_adaround.onnx"), Path(f"{stem}.xint8_npu.onnx")),
            "sim",
        )
    )

    rows = []
    start_all = time.perf_counter()
    for index, (name, backend, produce, runner) in enumerate(jobs, 1):
        print(f"[{index}/{len(jobs)}] {name} ({backend}) ...", flush=True)
        start = time.perf_counter()
        path = produce()
        seconds = time.perf_counter() - start
        predict = _predict_ort(path) if runner == "ort" else _predict_simulator(path)
        accuracy = _accuracy(predict, test_x, test_y)
        latency = _latency_ms(predict, test_x[:LATENCY_BATCH], repeats=20 if runner == "ort" else 5)
        rows.append((name, backend, accuracy, path.stat().st_size / 1024, latency, seconds))
        print(f"      top-1 {accuracy:.4f}, {seconds:.1f} s -> {path}", flush=True)

    base = rows[0][2]
    print(
        f"\n{args.model}: top-1 on the 10,000 Fashion-MNIST test images, calibrated on {args.num_calib} training images"
    )
    print(
        "| row | backend | top-1 | vs float | file size | latency b32 | time to produce |\n|---|---|---|---|---|---|---|"
    )
    for name, backend, accuracy, size_kb, latency, seconds in rows:
        kind = " (simulated)" if backend == "quant-npu" else ""
        made = "—" if name == "float" else f"{seconds:.1f} s"
        print(
            f"| {name} | {backend} | {accuracy:.4f} | {100 * (accuracy - base):+.2f} pt | {size_kb:.0f} KiB | "
            f"{latency:.2f} ms{kind} | {made} |"
        )
    print(f"\ntotal {time.perf_counter() - start_all:.0f} s; models in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
