"""NPU deployment bench (issue 10): what the NPU computes, before a board is needed.

For each model and config (``xint8``, ``xint8 + CLE + AdaRound``), one run:

* quantize with ``quant_onnx.quantize`` (subprocess, as ``tools.bench.algos`` does);
* Float / INT8 (CPU, onnxruntime) / INT8 (NPU simulator): the float model, the QDQ model as
  written (onnxruntime, graph optimisations off: each Q/DQ as written), and the legalised
  model through ``quant_npu``'s integer simulator with the device's rounding (half-up);
  Fashion-MNIST: top-1 accuracy on the 10k test images; EfficientNet-Lite0: top-1 agreement
  with float on crops of photos never used for calibration;
* the simulator against onnxruntime on the same legalised model: top-1 agreement with the
  device's rounding and with onnx rounding (half-to-even), and whether the onnx-rounding
  logits are bit-identical;
* legalize's top-1 change (onnxruntime on the legalised model minus on the original);
* simulator throughput: 10,000 Fashion-MNIST images through the MobileNetV2-shape model in a
  fresh subprocess, beside onnxruntime running the same QDQ model node by node;
* a ``check`` row per shipped preset (Fashion-MNIST ResNet-18, algorithms off): the rules
  its output breaks and whether ``legalize`` fixes them all;
* the NPU path of detectors and segmenters (issue 26, :mod:`tools.bench.npu_path`): each
  step's accuracy (output SQNR against float, IoU), the conversions ``legalize`` makes and
  what they cost, the CPU-partition alternative, and legalize + simulate time. Models:
  ``--models yolo_silu se_decoder`` (``tools/npu_models.py``), more from ``--zoo MODULE``.

Example:
    $ python -m tools.bench.npu                                   # everything (~25 min on 2 cores)
    $ python -m tools.bench.npu --models fmnist_mobilenetv2 --rows xint8 --no-presets
    $ nice -n 10 python -m tools.bench.npu --models efficientnet_lite0 --rows xint8_cle_adaround --resume
    $ python -m tools.bench.npu --models yolo_silu se_decoder --path-rows xint8 "xint8 + conv" --no-presets
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a file: make `tools.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench import common, npu_path
from tools.bench.models import EVAL_LEVEL, MODELS, NUM_CALIB, evaluate, load_data, reference_predictions

WORK_DIR = common.CACHE_DIR / "bench" / "npu"
DEFAULT_RESULTS = WORK_DIR / "results.json"
DEFAULT_MODELS = ("fmnist_resnet18", "fmnist_mobilenetv2", "efficientnet_lite0")
ROW_LABELS = {"xint8": "xint8", "xint8_cle_adaround": "xint8 + CLE + AdaRound"}
THROUGHPUT_MODEL = "fmnist_mobilenetv2"
THROUGHPUT_IMAGES = 10_000
THROUGHPUT_TARGET_S = 60.0
PRESET_MODEL = "fmnist_resnet18"
PRESET_CALIB = 128


# ------------------------------------------------------------------------------ jobs (subprocess)


def simulate_job(model_path: str, data_path: str, rounding: str) -> Callable[[], dict[str, Any]]:
    """Subprocess setup: load the simulator and the images; the work simulates them all."""
    from quant_npu.sim import NPUSimulator

    simulator = NPUSimulator(model_path, rounding=rounding)
    x = np.load(data_path)

    def work() -> dict[str, Any]:
        (logits,) = simulator.run(x, quiet=True).values()
        return {"images": len(x), "checksum": float(np.asarray(logits, np.float64).sum())}

    return work


def ort_job(model_path: str, data_path: str) -> Callable[[], dict[str, Any]]:
    """Subprocess setup: an onnxruntime session (optimisations off, 2 threads); the work predicts."""
    session = common.make_session(model_path, level=EVAL_LEVEL)
    x = np.load(data_path)

    def work() -> dict[str, Any]:
        logits = common.predict(session, x, batch_size=1000)
        return {"images": len(x), "checksum": float(np.asarray(logits, np.float64).sum())}

    return work


# ------------------------------------------------------------------------------ helpers


def quantize_row(name: str, row: str, float_path: Path, calib_path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Quantize ``row``'s config into ``WORK_DIR/name/row.onnx`` in a subprocess (reused with --resume)."""
    out = WORK_DIR / name / f"{row}.onnx"
    if args.resume and out.exists():
        return {"ok": True, "reused": True, "path": str(out)}
    out.parent.mkdir(parents=True, exist_ok=True)
    measured = common.measure_in_subprocess(
        "tools.bench.algos:algos_job",
        {
            "model_in": str(float_path),
            "model_out": str(out),
            "row": row,
            "calib_path": str(calib_path),
            "batch_size": 16,
        },
        timeout_s=args.timeout,
        mem_limit_mb=args.mem_limit_mb,
        threads=args.quantize_threads,
        quiet=not args.verbose,
    )
    measured["path"] = str(out)
    return measured


def score(predictions: np.ndarray, labels: np.ndarray | None, reference: np.ndarray | None) -> float:
    """Top-1 accuracy against labels (Fashion-MNIST) or agreement with float (photos)."""
    target = labels if labels is not None else reference
    assert target is not None
    return common.accuracy(predictions, target)


def simulate(model_path: Path, x: np.ndarray, rounding: str) -> np.ndarray:
    from quant_npu.sim import NPUSimulator

    (logits,) = NPUSimulator(model_path, rounding=rounding).run(x, quiet=True).values()
    return logits


def run_row(name: str, row: str, args: argparse.Namespace, results: dict[str, Any], save: Callable[[], None]) -> None:
    from quant_npu import legalize

    model = MODELS[name]
    entry = results["models"].setdefault(name, {"rows": {}})
    if args.resume and not args.rescore and entry["rows"].get(row, {}).get("ok"):
        return
    float_path = model.ensure()
    data = load_data(model, args.num_calib, args.num_eval)
    reference = reference_predictions(model, float_path, data)
    labels = data.eval_labels
    entry.update({"metric": model.metric, "num_eval": len(data.eval_x)})
    if "float" not in entry:
        entry["float"] = evaluate(float_path, data, reference, model.metric)
    print(f"  {ROW_LABELS[row]:<26}", end=" ", flush=True)
    quantized = quantize_row(name, row, float_path, data.calib_path, args)
    if not quantized.get("ok"):
        print(f"FAILED: {quantized.get('error')}", flush=True)
        entry["rows"][row] = quantized
        save()
        return
    path = Path(quantized["path"])
    legal_path = WORK_DIR / name / f"{row}.legal.onnx"
    legalized = legalize(path, legal_path)
    int32_path = WORK_DIR / name / f"{row}.legal_int32_bias.onnx"
    legalize(path, int32_path, "xint8_int32_bias")
    ort_int32 = common.top1(common.predict(int32_path, data.eval_x, level=EVAL_LEVEL))
    ort_original = common.top1(common.predict(path, data.eval_x, level=EVAL_LEVEL))
    ort_logits = common.predict(legal_path, data.eval_x, level=EVAL_LEVEL)
    ort_legal = common.top1(ort_logits)
    start = time.perf_counter()
    device_logits = simulate(legal_path, data.eval_x, "device")
    device_s = time.perf_counter() - start
    onnx_logits = simulate(legal_path, data.eval_x, "onnx")
    record = {
        "ok": True,
        "quantize_s": quantized.get("wall_s"),
        "int8_ort": score(ort_original, labels, reference),
        "int8_ort_legal": score(ort_legal, labels, reference),
        "npu_device": score(common.top1(device_logits), labels, reference),
        "npu_onnx": score(common.top1(onnx_logits), labels, reference),
        "agreement_device": common.agreement(common.top1(device_logits), ort_legal),
        "agreement_onnx": common.agreement(common.top1(onnx_logits), ort_legal),
        "bit_exact_onnx": bool(np.array_equal(onnx_logits, ort_logits)),
        "max_logit_diff_onnx": float(np.abs(onnx_logits - ort_logits).max()),
        "legalize_ok": legalized.remaining.ok,
        "legalize_changes": legalized.to_dict()["changes_by_kind"],
        "simulate_s": device_s,
    }
    record["legalize_delta_pt"] = 100 * (record["int8_ort_legal"] - record["int8_ort"])
    record["legalize_int32_bias_delta_pt"] = 100 * (score(ort_int32, labels, reference) - record["int8_ort"])
    entry["rows"][row] = record
    print(
        f"ORT {record['int8_ort']:.4f}  NPU {record['npu_device']:.4f}  agree {record['agreement_device']:.4f}"
        f"/{record['agreement_onnx']:.4f}  bit-exact {record['bit_exact_onnx']}  "
        f"legalize {record['legalize_delta_pt']:+.2f} pt",
        flush=True,
    )
    save()


def throughput(args: argparse.Namespace, results: dict[str, Any]) -> None:
    legal = WORK_DIR / THROUGHPUT_MODEL / "xint8.legal.onnx"
    if not legal.exists():
        print("  throughput: run the fmnist_mobilenetv2 xint8 row first", flush=True)
        return
    from tools.reference_models.data import load_fashion_mnist

    x, _ = load_fashion_mnist("test")
    data_path = WORK_DIR / "fmnist_test_10k.npy"
    if not data_path.exists():
        from tools.bench.models import save_npy

        save_npy(data_path, x[:THROUGHPUT_IMAGES])
    # the machine may be shared: the load average says how much of the 2 cores the run had
    record: dict[str, Any] = {"images": THROUGHPUT_IMAGES, "threads": common.DEFAULT_THREADS}
    record["load_average_before"] = os.getloadavg()[0]
    for rounding in ("device", "onnx"):
        record[f"simulator_{rounding}"] = common.measure_in_subprocess(
            "tools.bench.npu:simulate_job",
            {"model_path": str(legal), "data_path": str(data_path), "rounding": rounding},
            threads=common.DEFAULT_THREADS,
        )
    record["ort"] = common.measure_in_subprocess(
        "tools.bench.npu:ort_job",
        {"model_path": str(legal), "data_path": str(data_path)},
        threads=common.DEFAULT_THREADS,
    )
    record["load_average_after"] = os.getloadavg()[0]
    results["throughput"] = record
    device = record["simulator_device"].get("wall_s")
    print(f"  throughput: simulator {common.fmt(device)} s for {THROUGHPUT_IMAGES} images", flush=True)


def presets(args: argparse.Namespace, results: dict[str, Any]) -> None:
    import quant_onnx
    from quant_core.presets import PRESETS, get_preset
    from quant_npu import check, legalize_model

    float_path = MODELS[PRESET_MODEL].ensure()
    data = load_data(MODELS[PRESET_MODEL], args.num_calib, 16)
    calibration = np.load(data.calib_path)[:PRESET_CALIB]
    rows = {}
    for name in PRESETS:
        config = get_preset(name).evolve(algorithms=())
        model = quant_onnx.quantize(str(float_path), None, config, calibration, quiet=True).model
        before = check(model)
        after = legalize_model(model)
        rows[name] = {
            "counts": before.counts(),
            "unfixable": len(before.unfixable()),
            "legalized_ok": after.remaining.ok,
            "remaining": after.remaining.counts(),
        }
        print(f"  check {name:<20} {before.counts()} -> legalized ok: {after.remaining.ok}", flush=True)
    results["presets"] = rows


# ------------------------------------------------------------------------------ tables


def tables(results: dict[str, Any]) -> str:
    main, fidelity = [], []
    for name, entry in results["models"].items():
        metric = "top-1" if entry.get("metric") == "accuracy" else "agreement with float"
        for row, r in entry["rows"].items():
            if not r.get("ok"):
                main.append([name, ROW_LABELS.get(row, row), metric, entry.get("float"), None, None])
                continue
            main.append([name, ROW_LABELS.get(row, row), metric, entry.get("float"), r["int8_ort"], r["npu_device"]])
            fidelity.append(
                [
                    name,
                    ROW_LABELS.get(row, row),
                    r["agreement_device"],
                    r["agreement_onnx"],
                    "yes" if r["bit_exact_onnx"] else f"no (max {r['max_logit_diff_onnx']:.3g})",
                    r["int8_ort_legal"],
                    f"{r['legalize_delta_pt']:+.2f}",
                    None if "legalize_int32_bias_delta_pt" not in r else f"{r['legalize_int32_bias_delta_pt']:+.2f}",
                    ", ".join(f"{k} {v}" for k, v in sorted(r["legalize_changes"].items())),
                    r["npu_onnx"],
                ]
            )
    parts = [
        common.markdown_table(
            ["model", "config", "metric", "Float", "INT8 (CPU, onnxruntime)", "INT8 (NPU simulator)"], main
        ),
        common.markdown_table(
            [
                "model",
                "config",
                "sim vs ORT top-1 (device rounding)",
                "sim vs ORT top-1 (onnx rounding)",
                "bit-exact (onnx rounding)",
                "ORT on legalised",
                "legalize Δ (pt)",
                "legalize Δ, int32 bias target (pt)",
                "legalize changes",
                "NPU sim, onnx rounding",
            ],
            fidelity,
        ),
    ]
    t = results.get("throughput")
    if t:
        rows = []
        ort_s = t["ort"].get("wall_s")
        for rounding in ("device", "onnx"):
            s = t[f"simulator_{rounding}"].get("wall_s")
            rows.append(
                [
                    f"simulator ({rounding} rounding)",
                    s,
                    common.ratio(t["images"], s),
                    common.ratio(s, ort_s),
                    common.ratio(s, THROUGHPUT_TARGET_S),
                    t[f"simulator_{rounding}"].get("peak_increase_mb"),
                ]
            )
        rows.append(["onnxruntime, same QDQ model, node by node", ort_s, common.ratio(t["images"], ort_s), 1.0, None,
                     t["ort"].get("peak_increase_mb")])  # fmt: skip
        parts.append(
            common.markdown_table(
                [
                    "10k Fashion-MNIST images, MobileNetV2 shape",
                    "s",
                    "images/s",
                    "× ORT time",
                    "÷ 60 s target",
                    "peak +MB",
                ],
                rows,
            )
            + f"\n\nload average (1 min) before / after: {common.fmt(t.get('load_average_before'))} / "
            f"{common.fmt(t.get('load_average_after'))} on {os.cpu_count()} cores"
        )
    p = results.get("presets")
    if p:
        rows = [
            [
                name,
                ", ".join(f"{k} {v}" for k, v in sorted(r["counts"].items())) or "passes",
                r["unfixable"],
                "yes" if r["legalized_ok"] else ", ".join(r["remaining"]),
            ]
            for name, r in p.items()
        ]
        parts.append(
            common.markdown_table(
                ["preset", "check (default profile): violations by rule", "not fixable", "passes after legalize"], rows
            )
        )
    return "\n\n".join(parts)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models",
        nargs="+",
        default=list(DEFAULT_MODELS),
        help=f"classifiers ({', '.join(DEFAULT_MODELS)}) and NPU-path models ({', '.join(npu_path.PATH_MODELS)}, "
        "or a --zoo module's)",
    )
    parser.add_argument("--path-rows", nargs="+", default=list(npu_path.ROWS), choices=list(npu_path.ROWS))
    parser.add_argument("--zoo", help="a module whose npu_bench_models() adds NPU-path models (name -> PathModel)")
    parser.add_argument("--rows", nargs="+", default=list(ROW_LABELS), choices=list(ROW_LABELS))
    parser.add_argument("--num-calib", type=int, default=NUM_CALIB)
    parser.add_argument("--num-eval", type=int, default=None)
    parser.add_argument("--mem-limit-mb", type=float, default=14000)
    parser.add_argument("--timeout", type=float, default=1800, help="per quantization subprocess")
    parser.add_argument(
        "--quantize-threads", type=int, help="OMP_NUM_THREADS for quantization (1 helps AdaRound on a busy machine)"
    )
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    parser.add_argument("--resume", action="store_true", help="keep finished rows and quantized models")
    parser.add_argument("--rescore", action="store_true", help="with --resume: score finished rows again")
    parser.add_argument("--no-throughput", action="store_true")
    parser.add_argument("--no-presets", action="store_true")
    parser.add_argument("--verbose", action="store_true")
    return parser.parse_args(argv)


def path_models(args: argparse.Namespace) -> dict[str, Callable[[], npu_path.PathModel]]:
    """The NPU-path registry, with the ``--zoo`` module's models; unknown ``--models`` fail in one line."""
    known = dict(npu_path.PATH_MODELS)
    if args.zoo:
        known.update(npu_path.load_zoo(args.zoo))
    unknown = [m for m in args.models if m not in known and m not in DEFAULT_MODELS]
    if unknown:
        raise SystemExit(f"--models: {unknown[0]!r} is not known; allowed: {', '.join([*DEFAULT_MODELS, *known])}")
    return known


def run_paths(args: argparse.Namespace, results: dict[str, Any], save: Callable[[], None]) -> None:
    known = path_models(args)
    paths = results.setdefault("path", {})
    for name in [m for m in args.models if m in known]:
        print(f"== {name} (NPU path)", flush=True)
        paths[name] = npu_path.run_path(known[name](), args.path_rows, quiet=not args.verbose)
        save()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common.use_checkout_packages()
    results = common.load_results(args.results, args.resume)
    results["settings"] = {"num_calib": args.num_calib, "threads": common.DEFAULT_THREADS}

    def save() -> None:
        common.write_json(args.results, results)

    run_paths(args, results, save)
    args.models = [m for m in args.models if m in DEFAULT_MODELS]

    # AdaRound on EfficientNet-Lite0 takes ~7 minutes: every other row first
    order = [(m, r) for r in args.rows for m in args.models if (m, r) != ("efficientnet_lite0", "xint8_cle_adaround")]
    if "efficientnet_lite0" in args.models and "xint8_cle_adaround" in args.rows:
        order.append(("efficientnet_lite0", "xint8_cle_adaround"))
    for name, row in order:
        print(f"== {name}", flush=True)
        try:
            run_row(name, row, args, results, save)
        except FileNotFoundError as exc:
            print(f"  skipped: {exc}", flush=True)
        if (name, row) == (THROUGHPUT_MODEL, "xint8") and not args.no_throughput:
            throughput(args, results)
            save()
    if not args.no_presets:
        print("== presets", flush=True)
        presets(args, results)
        save()
    print("\n" + tables(results))
    if results.get("path"):
        print("\n" + npu_path.tables(results["path"]))
    print(f"results: {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
