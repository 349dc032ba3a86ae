"""Accuracy-recovery table (issue 4): float / PTQ / +CLE / +AdaRound / mixed precision, one run.

Rows per model, each quantized by ``quant_onnx.quantize`` in its own subprocess (wall time and
peak-memory increase measured as in ``onnx_ptq``), scored like ``onnx_ptq`` (Fashion-MNIST
top-1 on 10k test images; EfficientNet-Lite0 top-1 agreement with float on crops of photos
never used for calibration):

    float | a8w8 per-tensor, per-channel (references) | xint8 | xint8 + CLE (int8_cnn_cle)
    | xint8 + CLE + AdaRound | xint8 + CLE + bias correction | xint8 + CLE + AdaQuant
    | xint8 + mixed precision | w4a8 | w4a8 + CLE + AdaRound
    | AMD Quark XINT8, XINT8_ADAROUND (peer)

The Quark rows run ``tools/bench/quark_peer.py`` in Quark's own virtual environment (interpreter
from ``--quark-python`` or ``$QUARK_PYTHON``, default ``/work/quark-venv/bin/python``) on the same
calibration file, and are scored like ours; without that interpreter they are skipped with a note.
"time / Quark", "memory / Quark" (peak increase during the work) and "process peak / Quark" (the
process's whole peak resident memory) divide each row by Quark ``XINT8_ADAROUND`` of the same run.
Rows that train with torch (AdaRound, AdaQuant) import its runtime in their setup, as Quark's
import does, so both baselines hold torch;
"CPU s" (user + system seconds of the quantizing process) is the time that does not grow when other
jobs share the cores.

Mixed precision gets an ``evaluate`` callback: top-1 agreement with float on the last
``HELD_OUT`` *calibration* photos, never the evaluation photos. Accuracy is scored node by node
(see ``models.EVAL_LEVEL``); the "ORT integer kernels" column is the same model through
onnxruntime's fused integer kernels on this CPU.

Example:
    $ python -m tools.bench.algos --models efficientnet_lite0 --rows xint8 xint8_cle
    $ python -m tools.bench.algos --quick
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import attrs
import numpy as np

if __package__ in (None, ""):  # run as a file: make `tools.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench import common
from tools.bench.models import (
    EVAL_LEVEL,
    MODELS,
    NUM_CALIB,
    calibration_batches,
    evaluate,
    input_name,
    load_data,
    score_quantized,
)
from tools.bench.quark_peer import QUARK_PYTHON_ENV, process_cpu_seconds, quark_python

WORK_DIR = common.CACHE_DIR / "bench" / "algos"
DEFAULT_RESULTS = WORK_DIR / "results.json"
DEFAULT_MODELS = ("efficientnet_lite0", "fmnist_mobilenetv2", "fmnist_resnet18")
# Mixed precision stops once top-1 agreement with float on the held-out calibration samples reaches this
# (0.90 is out of reach on EfficientNet-Lite0 at xint8 activations: with every layer at A8W16 it measured 0.867).
MIXED_PRECISION_TARGET = 0.80
# How many calibration samples the mixed-precision evaluate callback holds out (taken from the end).
HELD_OUT = 128


@dataclass(frozen=True)
class Row:
    """A table row: label and the quant_core config it runs (None = the float model).

    Example:
        >>> ROWS["xint8_cle"].label
        'xint8 + CLE'
    """

    key: str
    label: str
    build: Callable[[], Any] | None  # -> QuantConfig
    quark: str | None = None  # a Quark default config name: the row runs quark_peer.py instead


def _preset(name: str) -> Callable[[], Any]:
    def build() -> Any:
        from quant_core.presets import get_preset

        return get_preset(name)

    return build


def _with_algorithms(preset: str, *kinds: str) -> Callable[[], Any]:
    def build() -> Any:
        from quant_core.algorithm_config import (
            AdaQuantConfig,
            AdaRoundConfig,
            BiasCorrectionConfig,
            CLEConfig,
            MixedPrecisionConfig,
        )
        from quant_core.presets import get_preset

        factories: dict[str, Callable[[], Any]] = {
            "cle": CLEConfig,
            "adaround": AdaRoundConfig,
            "adaquant": AdaQuantConfig,
            "bias_correction": BiasCorrectionConfig,
            "mixed_precision": lambda: MixedPrecisionConfig(
                # the loss is in the weights (pow2 per-tensor int8), so raise weights to 16 bits
                target_types=("a8w16",),
                metric="evaluate",
                accuracy_target=MIXED_PRECISION_TARGET,
            ),
        }
        config = get_preset(preset)
        algorithms = tuple(factories[k]() for k in kinds)
        return config.evolve(algorithms=algorithms, name=f"{preset}+{'+'.join(kinds)}")

    return build


def xint8_tuned(batch_size: int | None = None, iterations: int | None = None) -> Callable[[], Any]:
    """The ``xint8_adaround`` preset (MinMSE power-of-two weight scales, CLE, AdaRound at
    Quark's learning rate 0.1 on minibatches of 4) with AdaRound's ``batch_size`` and
    ``iterations`` changed where given."""

    def make() -> Any:
        from quant_core.presets import get_preset

        config = get_preset("xint8_adaround")
        changes = {k: v for k, v in (("batch_size", batch_size), ("num_iterations", iterations)) if v is not None}
        if not changes:
            return config
        algorithms = tuple(attrs.evolve(a, **changes) if a.kind == "adaround" else a for a in config.algorithms)
        suffix = "".join(f"_{k}{v}" for k, v in changes.items())
        return config.evolve(algorithms=algorithms, name=f"{config.name}{suffix}")

    return make


def one_side(build: Callable[[], Any], keep: str) -> Callable[[], Any]:
    """``build``'s config with only the weights (``keep="weight"``) or only the activations
    (``keep="activations"``) quantized, the other side left float: how much of a recipe's error
    each side causes."""

    def make() -> Any:
        config = build()
        g = config.global_config
        g = attrs.evolve(g, input=None, output=None) if keep == "weight" else attrs.evolve(g, weight=None)
        return config.evolve(global_config=g, name=f"{config.name} ({keep} only)")

    return make


ROWS: dict[str, Row] = {
    r.key: r
    for r in (
        Row("float", "float", None),
        Row("a8w8_per_tensor", "a8w8 per-tensor MinMax (reference)", _preset("a8w8_per_tensor")),
        Row("a8w8", "a8w8 per-channel MinMax (reference)", _preset("a8w8")),
        Row("xint8", "xint8 PTQ", _preset("xint8")),
        Row("xint8_cle", "xint8 + CLE", _preset("int8_cnn_cle")),
        Row("xint8_cle_adaround", "xint8 + CLE + AdaRound", _with_algorithms("xint8", "cle", "adaround")),
        Row("xint8_adaround", "xint8 + AdaRound", _with_algorithms("xint8", "adaround")),
        Row("xint8_tuned", "xint8, MinMSE weights + CLE + AdaRound (lr 0.1, batch 32)", xint8_tuned(32)),
        *(
            Row(f"xint8_tuned_b{b}", f"xint8, MinMSE weights + CLE + AdaRound (lr 0.1, batch {b})", xint8_tuned(b))
            for b in (2, 8)
        ),
        Row("xint8_tuned_b4", "xint8_adaround preset (MinMSE weights + CLE + AdaRound lr 0.1, batch 4)", xint8_tuned()),
        Row(
            "xint8_tuned_b4_4k",
            "xint8, MinMSE weights + CLE + AdaRound (lr 0.1, batch 4, 4000 iterations)",
            xint8_tuned(iterations=4000),
        ),
        Row(
            "xint8_tuned_b4_weights_only",
            "xint8 weights only (activations float), MinMSE weights + CLE + AdaRound (lr 0.1, batch 4)",
            one_side(xint8_tuned(), "weight"),
        ),
        Row(
            "xint8_cle_activations_only",
            "xint8 activations only (weights float) + CLE",
            one_side(_with_algorithms("xint8", "cle"), "activations"),
        ),
        Row("xint8_cle_bc", "xint8 + CLE + bias correction", _with_algorithms("xint8", "cle", "bias_correction")),
        Row(
            "xint8_cle_adaround_bc",
            "xint8 + CLE + AdaRound + bias correction",
            _with_algorithms("xint8", "cle", "adaround", "bias_correction"),
        ),
        Row("xint8_cle_adaquant", "xint8 + CLE + AdaQuant", _with_algorithms("xint8", "cle", "adaquant")),
        Row("xint8_mixed", "xint8 + mixed precision (A8W16)", _with_algorithms("xint8", "mixed_precision")),
        Row("w4a8", "w4a8 PTQ", _preset("w4a8")),
        Row("w4a8_cle_adaround", "w4a8 + CLE + AdaRound", _with_algorithms("w4a8", "cle", "adaround")),
        Row("quark_xint8", "AMD Quark XINT8 (peer)", None, quark="XINT8"),
        Row("quark_xint8_adaround", "AMD Quark XINT8_ADAROUND (peer)", None, quark="XINT8_ADAROUND"),
    )
}
# The row the "/ Quark" columns divide by.
QUARK_REFERENCE = "quark_xint8_adaround"


def agreement_callback(held_out: np.ndarray, float_path: str) -> Callable[[Any], float]:
    """``evaluate(model) -> top-1 agreement with float`` on ``held_out`` (model: path or ModelProto)."""
    reference = common.top1(common.predict(float_path, held_out, level=EVAL_LEVEL))

    def evaluate_model(model: Any) -> float:
        source = model if isinstance(model, str | Path) else model.SerializeToString()
        return common.agreement(common.top1(common.predict(source, held_out, level=EVAL_LEVEL)), reference)

    return evaluate_model


def algos_job(model_in: str, model_out: str, row: str, calib_path: str, batch_size: int) -> Callable[[], dict]:
    """Subprocess setup: build ``row``'s config and calibration batches; the work quantizes."""
    import quant_onnx  # noqa: F401  (import cost belongs to the baseline)

    batches = calibration_batches(calib_path, input_name(model_in), batch_size)
    config = ROWS[row].build()  # type: ignore[misc]
    if config.algorithm("adaround") is not None or config.algorithm("adaquant") is not None:
        common.load_torch_runtime()  # imports are baseline, as for Quark (whose import loads torch)
    kwargs: dict[str, Any] = {}
    if config.algorithm("mixed_precision") is not None:
        held_out = np.load(calib_path)[-HELD_OUT:]
        kwargs["evaluate"] = agreement_callback(held_out, model_in)

    def work() -> dict[str, Any]:
        cpu = process_cpu_seconds()
        with common.captured_warnings() as seen:
            result = common.quant_onnx_quantize(model_in, model_out, config, batches, **kwargs)
        return {"report": summarise_result(result), "warnings": seen[:20], "cpu_s": process_cpu_seconds() - cpu}

    return work


def describe_algorithms(report: dict[str, Any]) -> str:
    """One table cell: which layers mixed precision raised, how many layers AdaRound changed.

    Example:
        >>> describe_algorithms({"mixed_precision": {"raised": {"conv1": "a16w8"}, "final_score": 0.91}})
        'mixed precision raised 1 layer(s) (final score 0.91): conv1 a16w8'
    """
    parts = []
    mp = report.get("mixed_precision")
    if mp:
        raised = ", ".join(f"{name} {fmt}" for name, fmt in mp.get("raised", {}).items())
        parts.append(
            f"mixed precision raised {len(mp.get('raised', {}))} layer(s) "
            f"(final score {common.fmt(mp.get('final_score'), 3)}): {raised}"
        )
    for kind in ("adaround", "adaquant"):
        rec = report.get(kind)
        if rec:
            layers = rec.get("layers", [])
            parts.append(f"{kind}: {len(layers)} layers")
    return "; ".join(parts)


def summarise_result(result: Any) -> Any:
    """A JSON-able view of what each algorithm did (``QuantizationResult.algorithms``): layers
    raised by mixed precision, CLE chains, AdaRound per-layer losses."""
    algorithms = getattr(result, "algorithms", None)
    return dict(algorithms) if algorithms else None


def run_model(name: str, args: argparse.Namespace, results: dict[str, Any], save: Callable[[], None]) -> None:
    model = MODELS[name]
    print(f"\n== {name}", flush=True)
    float_path = model.ensure()
    data = load_data(model, args.num_calib, args.num_eval)
    # One float run gives both the logits (output SQNR) and the top-1 agreement is measured against.
    float_logits = common.predict(float_path, data.eval_x, level=EVAL_LEVEL)
    reference = common.top1(float_logits) if model.metric else None
    entry = results["models"].setdefault(name, {"rows": {}})
    entry.update({"metric": model.metric, "num_calib": args.num_calib, "num_eval": len(data.eval_x)})
    work = WORK_DIR / name
    for key in args.rows:
        row = ROWS[key]
        done = entry["rows"].get(key, {})
        if args.resume and done.get("ok"):
            written = work / f"{key}.onnx"
            if "sqnr_db" not in done and written.exists():  # scored before the SQNR column existed
                done.update(score_quantized(written, data, reference, model.metric, float_logits))
                save()
            continue
        if row.quark is not None:
            entry["rows"][key] = run_quark(
                row, float_path, data, reference, model.metric, work / f"{key}.onnx", args, float_logits
            )
            save()
            continue
        if row.build is None:
            entry["rows"][key] = {"ok": True, "metric": evaluate(float_path, data, reference, model.metric)}
            continue
        if not common.api_available("quant_onnx", "quantize"):
            entry["rows"][key] = {"ok": False, "error": "quant_onnx.quantize not available yet"}
            continue
        out = work / f"{key}.onnx"
        out.parent.mkdir(parents=True, exist_ok=True)
        print(f"  {row.label:<40}", end=" ", flush=True)
        measured = common.measure_in_subprocess(
            "tools.bench.algos:algos_job",
            {
                "model_in": str(float_path),
                "model_out": str(out),
                "row": key,
                "calib_path": str(data.calib_path),
                "batch_size": args.calib_batch,
            },
            timeout_s=args.timeout,
            mem_limit_mb=args.mem_limit_mb,
            quiet=not args.verbose,
        )
        if measured.get("ok"):
            measured.update(score_quantized(out, data, reference, model.metric, float_logits))
            print(
                f"{measured['wall_s']:7.1f} s  metric {common.fmt(measured['metric'], 4)} "
                f"(kernels {common.fmt(measured['metric_kernels'], 4)})",
                flush=True,
            )
        else:
            print(f"FAILED: {measured.get('error')}", flush=True)
        entry["rows"][key] = measured
        save()


def run_quark(
    row: Row,
    float_path: Path,
    data: Any,
    reference: Any,
    metric: str | None,
    out: Path,
    args: argparse.Namespace,
    float_logits: np.ndarray | None = None,
) -> dict[str, Any]:
    """A Quark row: ``quark_peer.py`` in Quark's interpreter (a note, not a failure, when it is absent)."""
    python = args.quark_python or quark_python()
    if python is None:
        note = f"skipped: no Quark interpreter (install amd-quark==0.13 in its own venv, set ${QUARK_PYTHON_ENV})"
        print(f"  {row.label:<40} {note}", flush=True)
        return {"ok": False, "skipped": True, "error": note}
    print(f"  {row.label:<40}", end=" ", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = [python, str(Path(__file__).with_name("quark_peer.py")), "--model", str(float_path), "--calib"]
    command += [str(data.calib_path), "--out", str(out), "--config", str(row.quark)]
    # Quark's fast finetune takes about twice our AdaRound's time on a quiet machine (894 s on EfficientNet-Lite0).
    command += ["--timeout", str(3 * args.timeout), "--mem-limit-mb", str(args.mem_limit_mb)]
    done = subprocess.run(command, cwd=common.REPO_ROOT, capture_output=True, text=True)
    results = out.with_suffix(".json")
    measured: dict[str, Any] = json.loads(results.read_text()) if results.exists() else {}
    if done.returncode != 0 or not measured.get("ok"):
        measured.update(ok=False, error=measured.get("error") or done.stderr[-2000:])
        print(f"FAILED: {measured['error']}", flush=True)
        return measured
    measured.update(score_quantized(out, data, reference, metric, float_logits))
    print(f"{measured['wall_s']:7.1f} s  metric {common.fmt(measured['metric'], 4)}", flush=True)
    return measured


def tables(results: dict[str, Any]) -> str:
    """Markdown: one row per model and config, with the gap to float and the disagreement vs plain PTQ."""
    rows = []
    position = {key: i for i, key in enumerate(ROWS)}  # table order; unknown keys last
    for name, entry in results["models"].items():
        float_metric = entry["rows"].get("float", {}).get("metric")
        quark = entry["rows"].get(QUARK_REFERENCE, {})
        quark = quark if quark.get("ok") else {}
        ranked = sorted(entry["rows"].items(), key=lambda kv: position.get(kv[0], len(position)))
        for key, r in ranked:
            metric = r.get("metric") if r.get("ok") else None
            base = entry["rows"].get("w4a8" if key.startswith("w4a8") else "xint8", {}).get("metric")
            disagreement_ratio = (
                common.ratio(1 - metric, 1 - base)
                if entry.get("metric") == "agreement" and metric is not None and base is not None and key != "float"
                else None
            )
            extras = r.get("extras") or {}
            notes = describe_algorithms(extras.get("report") or {})
            if "layers_optimized" in extras:
                notes = f"fast finetune: {extras['layers_optimized']} layers, {len(extras['layers_failed'])} skipped"
            rows.append(
                [
                    name,
                    ROWS[key].label if key in ROWS else key,
                    metric,
                    None if metric is None or float_metric is None else 100 * (metric - float_metric),
                    r.get("sqnr_db") if r.get("ok") else None,
                    r.get("float_top1_in_top5") if r.get("ok") else None,
                    disagreement_ratio,
                    r.get("metric_kernels") if r.get("ok") else None,
                    r.get("wall_s"),
                    extras.get("cpu_s"),
                    r.get("peak_increase_mb"),
                    r.get("peak_mb"),
                    common.ratio(r.get("wall_s"), quark.get("wall_s")),
                    common.ratio(r.get("peak_increase_mb"), quark.get("peak_increase_mb")),
                    common.ratio(r.get("peak_mb"), quark.get("peak_mb")),
                    notes or (r.get("error") if not r.get("ok") else None),
                ]
            )
    return common.markdown_table(
        [
            "model",
            "config",
            "top-1 / agreement",
            "Δ vs float (pt)",
            "output SQNR dB",
            "float top-1 in top-5",
            "disagreement / plain PTQ",
            "metric (ORT integer kernels)",
            "quantize s",
            "CPU s",
            "peak +MB",
            "peak MB (process)",
            "time / Quark",
            "memory / Quark",
            "process peak / Quark",
            "notes",
        ],
        rows,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=list(MODELS))
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--num-calib", type=int, default=NUM_CALIB)
    parser.add_argument("--num-eval", type=int, default=None)
    parser.add_argument("--calib-batch", type=int, default=16)
    parser.add_argument("--mem-limit-mb", type=float, default=14000)
    parser.add_argument("--timeout", type=float, default=1800, help="per row; AdaRound's target is < 600 s")
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--quick", action="store_true", help="64 calibration samples, small eval set")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--quark-python", default=None, help="Quark venv interpreter (default: $QUARK_PYTHON)")
    args = parser.parse_args(argv)
    if "float" not in args.rows:
        args.rows = ["float", *args.rows]
    if args.quick:
        args.num_calib = min(args.num_calib, 64)
        args.num_eval = args.num_eval or 256
        if args.results == DEFAULT_RESULTS:
            args.results = WORK_DIR / "results_quick.json"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common.use_checkout_packages()
    results = common.load_results(args.results, args.resume)
    results["settings"] = {"num_calib": args.num_calib, "calib_batch": args.calib_batch, "quick": args.quick}

    def save() -> None:
        common.write_json(args.results, results)

    for name in args.models:
        try:
            run_model(name, args, results, save)
        except FileNotFoundError as exc:
            print(f"  skipped: {exc}")
    save()
    print("\n" + tables(results))
    print(f"results: {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
