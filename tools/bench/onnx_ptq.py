"""quant-onnx vs ``onnxruntime.quantization.quantize_static``: same model, data and equivalent config, one run.

For every model and config pair (per-tensor / per-channel weights x MinMax / Percentile / Entropy
activation calibration) it measures, each quantizer in its own fresh subprocess:

* calibration + quantization wall time and peak-memory increase (baseline after imports, model
  and data loading), as ratios ours / onnxruntime;
* accuracy: Fashion-MNIST top-1 on the 10k test set, EfficientNet-Lite0 top-1 agreement with
  the float model on natural-photo crops from photos not used for calibration; headline figures
  run each graph node by node (onnxruntime with optimisations off: what the QDQ model means, on any
  CPU), with the figure onnxruntime's fused integer kernels give on this CPU beside it;
* latency at batch 32 (median, rounds interleaved) of the float model cleaned the same way
  (constant folding, Pad folding) vs each quantized model, file size vs float, and the
  Conv/Gemm/MatMul nodes left in float in onnxruntime's optimised graph.

onnxruntime side, following its docs: ``quant_pre_process`` first (timed separately, not counted
in its quantization time), then ``quantize_static`` with QDQ format, QUInt8 activations, QInt8
weights and its default options for each calibration method. Ours: ``quant_onnx.quantize`` with
the ``a8w8`` / ``a8w8_per_tensor`` presets, the activation observer swapped for ORT's settings
``Percentile(99.999, bins=2048)`` / ``Entropy(bins=128, num_quantized_bins=128)``; its time
includes its own pre-processing.

Example:
    $ python -m tools.bench.onnx_ptq --quick                       # smoke run, minutes
    $ python -m tools.bench.onnx_ptq --models efficientnet_lite0   # full, 512 calibration crops
    $ python -m tools.bench.onnx_ptq --quantizers ort --methods minmax --per-channel both
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a file: make `tools.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench import common
from tools.bench.models import (
    METHODS,
    MODELS,
    NUM_CALIB,
    ArrayDataReader,
    BenchModel,
    calibration_batches,
    evaluate,
    input_name,
    load_data,
    reference_predictions,
    score_quantized,
)

REPO_ROOT = common.REPO_ROOT
WORK_DIR = common.CACHE_DIR / "bench" / "onnx_ptq"
DEFAULT_RESULTS = WORK_DIR / "results.json"
QUANTIZERS = ("ort", "ours")

# ORT's defaults per method (calibrate.create_calibrator), spelled out for the report.
ORT_METHOD_DEFAULTS = {
    "minmax": {"symmetric": False},
    "percentile": {"num_bins": 2048, "percentile": 99.999, "symmetric": True},
    "entropy": {"num_bins": 128, "num_quantized_bins": 128, "symmetric": False},
}


@dataclass(frozen=True)
class PairConfig:
    """One equivalent config pair: weight granularity and activation calibration method.

    Example:
        >>> PairConfig(True, "entropy").key
        'per_channel-entropy'
    """

    per_channel: bool
    method: str

    @property
    def key(self) -> str:
        return f"{'per_channel' if self.per_channel else 'per_tensor'}-{self.method}"

    @property
    def label(self) -> str:
        names = {"minmax": "MinMax", "percentile": "Percentile", "entropy": "Entropy"}
        return f"{'per-channel' if self.per_channel else 'per-tensor'} {names[self.method]}"


# --------------------------------------------------------------- quantization jobs


def ort_job(
    model_in: str, model_out: str, per_channel: bool, method: str, calib_path: str, batch_size: int, stride: int = 0
) -> Callable[[], dict[str, Any]]:
    """Subprocess setup for onnxruntime's ``quantize_static``; returns the timed work."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    reader = ArrayDataReader(calibration_batches(calib_path, input_name(model_in), batch_size))
    methods = {
        "minmax": CalibrationMethod.MinMax,
        "percentile": CalibrationMethod.Percentile,
        "entropy": CalibrationMethod.Entropy,
    }
    # Strides count reader items (batches): ORT collects and reduces each stride separately.
    extra_options = {"CalibStridedMinMax": stride} if stride else {}

    def work() -> dict[str, Any]:
        quantize_static(
            model_in,
            model_out,
            reader,
            quant_format=QuantFormat.QDQ,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            per_channel=per_channel,
            calibrate_method=methods[method],
            extra_options=extra_options,
        )
        return {"extra_options": extra_options}

    return work


def our_config(per_channel: bool, method: str, num_samples: int, batch_size: int):  # -> QuantConfig
    """The quant_core config equivalent to ORT's QDQ U8S8 at ``method``."""
    import attrs

    from quant_core.config import CalibrationConfig
    from quant_core.observer_config import Entropy, MinMax, Percentile
    from quant_core.presets import get_preset

    config = get_preset("a8w8" if per_channel else "a8w8_per_tensor")
    # ORT's settings for each method (ORT_METHOD_DEFAULTS): its Entropy bins |x| into 128 bins and
    # looks for 128 quantized bins, so only tensors whose values crowd into fewer bins get clipped.
    observer = {
        "minmax": MinMax(),
        "percentile": Percentile(percentile=99.999, bins=2048),
        "entropy": Entropy(bins=128, num_quantized_bins=128),
    }[method]
    ops = config.global_config
    ops = attrs.evolve(ops, input=ops.input.evolve(observer=observer), output=ops.output.evolve(observer=observer))
    return config.evolve(
        global_config=ops, calibration=CalibrationConfig(num_samples=num_samples, batch_size=batch_size)
    )


def ours_job(
    model_in: str, model_out: str, per_channel: bool, method: str, calib_path: str, batch_size: int, stride: int = 0
) -> Callable[[], dict[str, Any]]:
    """Subprocess setup for ``quant_onnx.quantize``; returns the timed work (``stride`` is ORT-only)."""
    import quant_onnx  # noqa: F401  (import cost belongs to the baseline, like onnxruntime's)

    batches = calibration_batches(calib_path, input_name(model_in), batch_size)
    config = our_config(per_channel, method, sum(len(next(iter(b.values()))) for b in batches), batch_size)

    def work() -> dict[str, Any]:
        with common.captured_warnings() as seen:
            common.quant_onnx_quantize(model_in, model_out, config, batches)
        return {"warnings": seen[:20]}

    return work


JOBS = {"ort": "tools.bench.onnx_ptq:ort_job", "ours": "tools.bench.onnx_ptq:ours_job"}


# ------------------------------------------------------------------------ harness


def ort_preprocess(model_path: Path, out: Path) -> float:
    """onnxruntime's recommended ``quant_pre_process`` (shape inference + optimisation); returns seconds."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    start = time.perf_counter()
    with common.atomic_path(out, ".onnx") as tmp:
        quant_pre_process(str(model_path), str(tmp))
    return time.perf_counter() - start


def run_model(model: BenchModel, args: argparse.Namespace, results: dict[str, Any], save: Callable[[], None]) -> None:
    print(f"\n== {model.name}", flush=True)
    float_path = model.ensure()
    work = WORK_DIR / model.name
    work.mkdir(parents=True, exist_ok=True)
    data = load_data(model, args.num_calib, args.num_eval)
    entry = results["models"].setdefault(model.name, {"configs": {}})
    entry.update(
        {
            "float_path": str(float_path.relative_to(REPO_ROOT)),
            "metric": model.metric,
            "num_calib": args.num_calib,
            "num_eval": len(data.eval_x),
            "float_size_mb": common.file_size_mb(float_path),
        }
    )
    reference = reference_predictions(model, float_path, data)
    entry["float_metric"] = evaluate(float_path, data, reference, model.metric)

    clean_path = work / "float_clean.onnx"
    entry["clean_method"] = common.clean_float_model(float_path, clean_path)
    entry["float_compute"] = _compute_summary(float_path)
    entry["float_clean_compute"] = _compute_summary(clean_path)
    if args.ort_no_preprocess:  # what users who skip the docs' advice get (e.g. Identity-wrapped weights stay)
        ort_in, entry["ort_preprocess_s"] = float_path, None
    else:
        ort_in = work / "ort_preprocessed.onnx"
        entry["ort_preprocess_s"] = ort_preprocess(float_path, ort_in)
    save()

    methods = [m for m in args.methods if m in model.default_methods or args.all_methods]
    pairs = [PairConfig(pc, m) for m in methods for pc in args.per_channel]
    quantized: dict[str, Path] = {}
    for pair in pairs:
        cfg_entry = entry["configs"].setdefault(pair.key, {"label": pair.label})
        for quantizer in args.quantizers:
            out = work / f"{quantizer}_{pair.key}.onnx"
            previous = cfg_entry.get(quantizer)
            if args.resume and previous and previous.get("ok") and out.exists():
                quantized[f"{quantizer}:{pair.key}"] = out
                continue
            if quantizer == "ours" and not common.api_available("quant_onnx", "quantize"):
                cfg_entry[quantizer] = {"ok": False, "error": "quant_onnx.quantize not available yet"}
                continue
            model_in = ort_in if quantizer == "ort" else float_path
            print(f"  {pair.label:<24} {quantizer:<5}", end=" ", flush=True)
            measured = _measure_repeated(
                JOBS[quantizer],
                {
                    "model_in": str(model_in),
                    "model_out": str(out),
                    "per_channel": pair.per_channel,
                    "method": pair.method,
                    "calib_path": str(data.calib_path),
                    "batch_size": args.calib_batch,
                    "stride": args.ort_stride,
                },
                args,
            )
            if measured.get("ok"):
                measured.update(score_quantized(out, data, reference, model.metric))
                measured["compute"] = _compute_summary(out)
                quantized[f"{quantizer}:{pair.key}"] = out
                print(
                    f"{measured['wall_s']:7.1f} s  +{measured['peak_increase_mb']:7.0f} MB  "
                    f"metric {common.fmt(measured['metric'], 4)} (kernels {common.fmt(measured['metric_kernels'], 4)})  "
                    f"float convs "
                    f"{measured['compute']['float']}/{measured['compute']['total']}",
                    flush=True,
                )
            else:
                print(f"FAILED: {measured.get('error')}", flush=True)
                if args.verbose and measured.get("traceback"):
                    print(measured["traceback"], file=sys.stderr)
            cfg_entry[quantizer] = measured
            save()

    if not args.no_latency:
        paths = {"float": float_path, "float_clean": clean_path, **quantized}
        x = data.eval_x[: common.LATENCY_BATCH]
        if len(x) < common.LATENCY_BATCH:  # small eval subsets (--quick): tile up to a full batch
            x = np.concatenate([x] * (common.LATENCY_BATCH // len(x) + 1))[: common.LATENCY_BATCH]
        print(f"  latency at batch {len(x)} over {len(paths)} models ...", flush=True)
        lat = common.latency_ms(paths, np.ascontiguousarray(x), threads=args.threads, repeats=args.repeats)
        entry["latency_ms"] = {"float": lat["float"], "float_clean": lat["float_clean"]}
        for key, value in lat.items():
            if ":" in key:
                quantizer, config_key = key.split(":")
                entry["configs"][config_key][quantizer]["latency_ms"] = value
        save()


def _compute_summary(path: Path) -> dict[str, Any]:
    summary = common.float_compute_nodes(path)
    return {"float": summary["float"], "total": summary["total"], "float_nodes": summary["float_nodes"][:50]}


# ------------------------------------------------------------------------ reporting


def _get(d: dict[str, Any] | None, *keys: str) -> Any:
    for key in keys:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def _time_cell(r: dict[str, Any] | None) -> Any:
    if r and r.get("killed"):
        return f">{r['wall_s_at_kill']:.0f} (killed: {r['killed']})"
    return _get(r, "wall_s")


def _mem_cell(r: dict[str, Any] | None) -> Any:
    if r and r.get("killed"):
        return f">{r['rss_mb_at_kill']:.0f} (killed)"
    return _get(r, "peak_increase_mb")


def _lower_bound(r: dict[str, Any] | None, key: str, killed_key: str) -> float | None:
    # A killed ORT run still bounds the ratio: ours / (at least this) is at most the printed value.
    if r and r.get("killed"):
        return r.get(killed_key)
    return _get(r, key)


def _ratio_cell(ours: Any, ort: dict[str, Any] | None, denominator: float | None) -> Any:
    """ours / ORT, printed as an upper bound ("<x") when ORT was killed before finishing."""
    value = common.ratio(ours, denominator)
    if value is not None and ort and ort.get("killed"):
        return f"<{common.fmt(value, 3)}"
    return value


def _measure_repeated(job: str, params: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """``args.calib_repeats`` fresh-subprocess runs of ``job``: the median wall time (all runs
    kept in ``wall_s_runs``) and the largest peak-memory increase; the first failure ends it."""
    runs = []
    for _ in range(args.calib_repeats):
        measured = common.measure_in_subprocess(
            job, params, timeout_s=args.timeout, mem_limit_mb=args.mem_limit_mb, quiet=not args.verbose
        )
        if not measured.get("ok"):
            return measured
        runs.append(measured)
    result = dict(runs[0])
    walls = sorted(float(r["wall_s"]) for r in runs)
    result["wall_s"] = float(np.median(walls))
    result["wall_s_runs"] = walls
    result["peak_increase_mb"] = max(float(r["peak_increase_mb"]) for r in runs)
    return result


def tables(results: dict[str, Any]) -> str:
    """The markdown tables of ``results`` (quantization cost/accuracy; speed/size)."""
    cost_rows, speed_rows = [], []
    for name, entry in results["models"].items():
        metric = entry.get("metric")
        lat = entry.get("latency_ms", {})
        clean = lat.get("float_clean")
        for cfg in entry.get("configs", {}).values():
            ort, ours = cfg.get("ort"), cfg.get("ours")
            ort_t = _lower_bound(ort, "wall_s", "wall_s_at_kill")
            ort_m = _lower_bound(ort, "peak_increase_mb", "rss_mb_at_kill")
            ort_metric, our_metric = _get(ort, "metric"), _get(ours, "metric")
            delta = None if ort_metric is None or our_metric is None else (our_metric - ort_metric)
            cost_rows.append(
                [
                    name,
                    cfg["label"],
                    _time_cell(ort),
                    _time_cell(ours),
                    _ratio_cell(_get(ours, "wall_s"), ort, ort_t),
                    _mem_cell(ort),
                    _mem_cell(ours),
                    _ratio_cell(_get(ours, "peak_increase_mb"), ort, ort_m),
                    entry.get("float_metric") if metric else None,
                    ort_metric,
                    our_metric,
                    delta,
                ]
            )
            ort_lat, our_lat = _get(ort, "latency_ms"), _get(ours, "latency_ms")
            speed_rows.append(
                [
                    name,
                    cfg["label"],
                    clean,
                    ort_lat,
                    common.ratio(clean, ort_lat),
                    our_lat,
                    common.ratio(clean, our_lat),
                    common.ratio(our_lat, ort_lat),
                    common.ratio(_get(ort, "size_mb"), entry.get("float_size_mb")),
                    common.ratio(_get(ours, "size_mb"), entry.get("float_size_mb")),
                    _convs_cell(ort),
                    _convs_cell(ours),
                    _get(ort, "metric_kernels"),
                    _get(ours, "metric_kernels"),
                ]
            )
    cost = common.markdown_table(
        [
            "model",
            "config",
            "ORT time s",
            "ours s",
            "ours/ORT",
            "ORT peak +MB",
            "ours +MB",
            "ours/ORT",
            "float",
            "ORT",
            "ours",
            "ours − ORT",
        ],
        cost_rows,
    )
    speed = common.markdown_table(
        [
            "model",
            "config",
            "float-clean ms",
            "ORT ms",
            "ORT speedup",
            "ours ms",
            "ours speedup",
            "ours/ORT latency",
            "ORT size/float",
            "ours size/float",
            "float convs ORT",
            "float convs ours",
            "ORT metric (kernels)",
            "ours metric (kernels)",
        ],
        speed_rows,
    )
    floats = common.markdown_table(
        ["model", "float ms", "float-clean ms", "cleaned by", "ORT quant_pre_process s", "float MB", "metric"],
        [
            [
                name,
                e.get("latency_ms", {}).get("float"),
                e.get("latency_ms", {}).get("float_clean"),
                e.get("clean_method"),
                e.get("ort_preprocess_s"),
                e.get("float_size_mb"),
                e.get("metric") or "timing only",
            ]
            for name, e in results["models"].items()
        ],
    )
    return (
        "### Calibration + quantization (metric: Fashion-MNIST top-1 / EfficientNet top-1 agreement with float)\n\n"
        f"{cost}\n\n### Speed (batch {common.LATENCY_BATCH}) and size\n\n{speed}\n\n### Float baselines\n\n{floats}\n"
    )


def _convs_cell(r: dict[str, Any] | None) -> str | None:
    compute = _get(r, "compute")
    return None if compute is None else f"{compute['float']}/{compute['total']}"


def environment() -> dict[str, Any]:
    import onnx
    import onnxruntime

    with open("/proc/cpuinfo") as f:
        lines = f.read().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "?")
    flags = set(next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), []))
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu": cpu,
        # u8 x s8 dot products: VNNI (or AMX) runs them natively; AVX2 alone saturates int16 pair sums
        "int8_dot": sorted(flags & {"avx512_vnni", "avx_vnni", "amx_int8"}) or ["none (AVX2 vpmaddubsw)"],
        "python": platform.python_version(),
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument(
        "--per-channel", choices=("both", "on", "off"), default="both", help="weight granularity of the configs"
    )
    parser.add_argument("--quantizers", nargs="+", default=list(QUANTIZERS), choices=QUANTIZERS)
    parser.add_argument("--all-methods", action="store_true", help="also run histogram methods on timing-only models")
    parser.add_argument("--num-calib", type=int, default=NUM_CALIB)
    parser.add_argument("--num-eval", type=int, default=None, help="evaluation subset (default: all)")
    parser.add_argument("--calib-batch", type=int, default=16, help="calibration batch size (both quantizers)")
    parser.add_argument("--ort-stride", type=int, default=0, help="ORT CalibStridedMinMax (in batches); 0 = off")
    parser.add_argument(
        "--ort-no-preprocess",
        action="store_true",
        help="feed quantize_static the raw float model (no quant_pre_process)",
    )
    parser.add_argument("--threads", type=int, default=common.DEFAULT_THREADS)
    parser.add_argument(
        "--calib-repeats", type=int, default=1, help="runs of each quantizer job; the median time is reported"
    )
    parser.add_argument("--repeats", type=int, default=15, help="latency repeats (median)")
    parser.add_argument("--no-latency", action="store_true")
    parser.add_argument("--mem-limit-mb", type=float, default=14000, help="watchdog: kill a job above this RSS")
    parser.add_argument("--timeout", type=float, default=1800, help="watchdog: kill a job after this many seconds")
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="JSON results file")
    parser.add_argument("--resume", action="store_true", help="keep successful jobs already in --results")
    parser.add_argument("--quick", action="store_true", help="64 calibration samples, MinMax only, small eval set")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.calib_repeats < 1:
        parser.error(f"--calib-repeats: {args.calib_repeats} is not allowed; use 1 or more")
    args.per_channel = {"both": [False, True], "on": [True], "off": [False]}[args.per_channel]
    if args.quick:
        args.num_calib = min(args.num_calib, 64)
        args.num_eval = args.num_eval or 256
        args.methods = ["minmax"] if args.methods == list(METHODS) else args.methods
        args.repeats = min(args.repeats, 5)
        if args.results == DEFAULT_RESULTS:
            args.results = WORK_DIR / "results_quick.json"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common.use_checkout_packages()
    results = common.load_results(args.results, args.resume)
    results["environment"] = environment()
    results["settings"] = {
        "num_calib": args.num_calib,
        "calib_batch": args.calib_batch,
        "threads": args.threads,
        "latency_batch": common.LATENCY_BATCH,
        "ort": ("" if args.ort_no_preprocess else "quant_pre_process, then ")
        + "quantize_static(QDQ, QUInt8 activations, QInt8 weights)",
        "ort_method_defaults": ORT_METHOD_DEFAULTS,
        "ort_calib_strided": args.ort_stride or None,
        "ours": "quant_onnx.quantize with a8w8 / a8w8_per_tensor, activation observer per method",
        "quick": args.quick,
    }

    def save() -> None:
        common.write_json(args.results, results)

    for name in args.models:
        try:
            run_model(MODELS[name], args, results, save)
        except FileNotFoundError as exc:
            print(f"  skipped: {exc}")
            results["models"].setdefault(name, {"configs": {}})["skipped"] = str(exc)
    save()
    text = tables({"models": {k: v for k, v in results["models"].items() if "skipped" not in v}})
    print("\n" + text)
    print(f"results: {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
