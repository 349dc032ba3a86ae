"""The trained task models (transformers, detector, segmenter) through quant-onnx presets and onnxruntime's
``quantize_static``, scored with each task's own metric (``tools/bench/tasks.py``).

For every model in ``tools/models`` trained by ``tools/train_models.py``: calibrate on the model's
``calib`` split (512 samples, seeded), quantize with ``quant_onnx.quantize`` at each preset and
with onnxruntime's ``quantize_static`` (QDQ, QUInt8 activations, QInt8 per-channel weights, MinMax,
after ``quant_pre_process``, as ``tools/bench/onnx_ptq.py`` runs it), then run the float and every
quantized model node by node (:data:`tools.bench.models.EVAL_LEVEL`) on the ``eval`` split and
report the task metric, what the quantized model keeps of the float one (top-1 agreement, CER
against the float text, mAP@0.5 against the float detections, IoU against the float mask), the
SQNR of the raw output, and how many Conv/ConvTranspose/Gemm/MatMul nodes read a dequantized input.

Example:
    $ python -m tools.bench.trained                                   # every model, ~15 min
    $ python -m tools.bench.trained --models ocr_ctc --configs a8w8 ort --num-eval 200
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make `tools.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench import common, tasks
from tools.bench.models import DATA_DIR, calibration_batches, save_npy

MODELS = ("fmnist_deit", "fmnist_deit_decomposed", "fmnist_hardswish_se", "ocr_ctc", "fmnist_yolo", "text_seg")
PRESETS = ("a8w8", "a16w8", "xint8")
CONFIGS = (*PRESETS, "ort")  # the default run; any preset of quant_core can be named
COMPUTE_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
WORK_DIR = common.CACHE_DIR / "bench" / "trained"
RESULTS = common.CACHE_DIR / "bench" / "trained.json"


def quantized_compute(path: Path) -> dict[str, int]:
    """Conv/ConvTranspose/Gemm/MatMul nodes of a QDQ model, and how many read a DequantizeLinear output."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    dequantized = {out for node in graph.node if node.op_type == "DequantizeLinear" for out in node.output}
    compute = [n for n in graph.node if n.op_type in COMPUTE_OPS]
    return {"total": len(compute), "dequantized_input": sum(n.input[0] in dequantized for n in compute)}


def quantize(config: str, float_path: Path, out: Path, calib_path: Path, batch_size: int) -> float:
    """Write ``out`` with ``config`` (a preset or ``ort``); returns the seconds it took (pre-processing included)."""
    from tools.bench.onnx_ptq import ort_job, ort_preprocess

    start = time.perf_counter()
    if config == "ort":
        preprocessed = out.with_name(f"{out.stem}.pre.onnx")
        ort_preprocess(float_path, preprocessed)
        ort_job(str(preprocessed), str(out), True, "minmax", str(calib_path), batch_size)()
    else:
        from tools.bench.models import input_name

        batches = calibration_batches(calib_path, input_name(float_path), batch_size)
        common.quant_onnx_quantize(float_path, out, config, batches)
    return time.perf_counter() - start


def run_model(name: str, args: argparse.Namespace, results: dict[str, Any]) -> None:
    float_path = args.models_dir / f"{name}.onnx"
    if not float_path.exists():
        raise FileNotFoundError(f"{float_path} is missing: train it with tools/train_models.py --model {name}")
    work = WORK_DIR / name
    work.mkdir(parents=True, exist_ok=True)
    calib = tasks.load(name, "calib", args.num_calib).x
    calib_path = DATA_DIR / f"{name}_calib_{len(calib)}.npy"
    save_npy(calib_path, calib)
    float_out = tasks.predict(name, float_path, "eval", args.num_eval)
    entry: dict[str, Any] = {
        "headline": tasks.get_task(name).headline,
        "num_calib": len(calib),
        "num_eval": len(float_out),
        "float": tasks.score(name, float_out, "eval", args.num_eval),
        "configs": {},
    }
    results["models"][name] = entry
    print(f"\n== {name}: float {entry['float']}", flush=True)
    for config in args.configs:
        out = work / f"{config}.onnx"
        try:
            seconds = quantize(config, float_path, out, calib_path, args.calib_batch)
            scores = tasks.evaluate(name, out, "eval", args.num_eval, reference=float_out)
        except Exception as error:  # a failure is a result too: record it and go on
            entry["configs"][config] = {"ok": False, "error": f"{type(error).__name__}: {error}"}
            print(f"  {config:<6} FAILED: {error}", flush=True)
            continue
        entry["configs"][config] = {
            "ok": True,
            "quantize_s": seconds,
            "size_mb": common.file_size_mb(out),
            "compute": quantized_compute(out),
            **scores,
        }
        print(f"  {config:<6} {scores} ({seconds:.1f} s)", flush=True)
        common.write_json(args.out, results)


def tables(results: dict[str, Any]) -> str:
    """Headline metric (output SQNR dB) per model and config, then what each keeps of the float model."""
    named = dict.fromkeys(c for m in results["models"].values() for c in m["configs"])
    configs = [c for c in dict.fromkeys((*CONFIGS, *named)) if c in named]  # the default ones first
    first, second = [], []
    for name, m in results["models"].items():
        cells, kept = [], []
        for c in configs:
            r = m["configs"].get(c)
            if not r or not r.get("ok"):
                cells.append("failed" if r else None)
                kept.append(None)
                continue
            cells.append(f"{common.fmt(r[m['headline']], 4)} ({common.fmt(r['sqnr_db'], 3)} dB)")
            vs = next(k for k in r if k.endswith("_vs_float") or k == "agreement")
            q = r["compute"]
            kept.append(f"{common.fmt(r[vs], 4)}, {q['dequantized_input']}/{q['total']}")
        first.append([name, m["headline"], common.fmt(m["float"][m["headline"]], 4), *cells])
        second.append([name, _vs_name(m), *kept])
    labels = [ORT_LABEL if c == "ort" else c for c in configs]
    return (
        common.markdown_table(["model", "metric", "float", *labels], first)
        + "\n\n"
        + common.markdown_table(["model", "against float", *labels], second)
    )


ORT_LABEL = "ORT quantize_static"


def _preset_names() -> tuple[str, ...]:
    from quant_core.presets import PRESETS as ALL

    return tuple(ALL)


def _vs_name(m: dict[str, Any]) -> str:
    return {
        "accuracy": "top-1 agreement",
        "cer": "CER vs float text",
        "map50": "mAP@0.5 vs float",
        "iou": "IoU vs float",
    }[m["headline"]]


def environment() -> dict[str, Any]:
    import onnx
    import onnxruntime

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "cpu": platform.processor() or platform.machine(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--configs", nargs="+", choices=(*_preset_names(), "ort"), default=list(CONFIGS))
    p.add_argument("--num-calib", type=int, default=512)
    p.add_argument("--calib-batch", type=int, default=32)
    p.add_argument("--num-eval", type=int, default=None, help="first N eval samples (default: the task's split)")
    p.add_argument("--models-dir", type=Path, default=common.REPO_ROOT / "tools" / "models")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    common.use_checkout_packages()
    results: dict[str, Any] = {"environment": environment(), "command": " ".join(sys.argv), "models": {}}
    for name in args.models:
        run_model(name, args, results)
    common.write_json(args.out, results)
    print("\n" + tables(results))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
