"""The model zoo (issue 25): public vision architectures through both backends and torchao PT2E.

Known failures of our backends (``EXPECTED_FAILURES``; ``--check`` fails when one of them starts
passing, or when a model not listed fails):

{failures}

Every model of ``tools/zoo_models.py`` (timm architectures with random weights, a YOLOv8-style
detector, DeepLabV3/LR-ASPP heads, ...) runs, in a fresh subprocess each, as a new user would run it:

* quant-torch-fx ``a8w8``: ``quantize_model`` (capture, the preset's algorithms, calibration),
  freeze, ``export_onnx``; the frozen model and the
  exported file (onnxruntime's default session) scored against the float model;
* quant-onnx ``a8w8``: the float model exported with ``torch.onnx.export(dynamo=False,
  opset_version=17)`` (tool side), ``quant_onnx.quantize``, the file in onnxruntime;
* torchao 0.18 PT2E: ``torch.export`` + ``prepare_pt2e`` with ``X86InductorQuantizer``'s default
  config (uint8 histogram activations, int8 per-channel weights), ``convert_pt2e``, torch eager.

Per model: end to end or the failing stage with its one-line error; SQNR of each quantized output
against the float model and top-1 agreement (argmax over the class axis: per image, pixel or
anchor); coverage of each written file (Conv/ConvTranspose/Gemm/MatMul inputs fed by a
DequantizeLinear; after onnxruntime's ``ORT_ENABLE_ALL`` optimisation, the compute nodes left
float and the integer kernels); export against frozen: the output's largest difference in
output quantization steps, next to the rounding floor (the same difference between the frozen
model and itself computed channels-last, and between onnxruntime and onnx's reference evaluator
on the same file: float rounding alone moves a value near a half step to the other code, and a
layer whose gain in steps exceeds one spreads that step), and node by node (each QuantizeLinear
of the exported file, run with ``ORT_DISABLE_ALL``, against the frozen model's fake-quantized
tensor it was traced from: end to end, with the first tensor whose codes differ and how far from
the half step its values before rounding were, and ``isolated``, each computed from the frozen
model's own codes of what it reads, the export's own difference); and
onnxruntime's kernels against node by node (every QuantizeLinear output, default session vs
``ORT_DISABLE_ALL``, in codes); the time of each stage.

Data: seeded normal noise (N(0, 1), NCHW): the natural-photo crops of tools/photo_crops.py need
scikit-image, which is not installed here. Calibration and evaluation sets come from different
seeds.

Example:
    $ nice python -m tools.bench.zoo --json .cache/bench/zoo/results.json   # the whole zoo
    $ python -m tools.bench.zoo --models resnet18 vit_tiny --quick
    $ python -m tools.bench.zoo --check                # the CI subset (nox -s zoo)
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a file: make `tools.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench import common

WORK_DIR = common.CACHE_DIR / "bench" / "zoo"
BACKENDS = ("torch_fx", "quant_onnx", "pt2e")
OURS = ("torch_fx", "quant_onnx")
BACKEND_LABELS = {"torch_fx": "quant-torch-fx", "quant_onnx": "quant-onnx", "pt2e": "PT2E X86"}
DATA_SEEDS = {"calib": 1, "eval": 2}
NODE_SAMPLES = 4  # inputs of the node-by-node comparisons (every quantized tensor is kept)

# The CI subset (nox -s zoo, --check): CNN, SE + hard-swish, SiLU + SE, ViT, MobileViT,
# segmentation (ASPP, LR-ASPP), the YOLO-style detector, ConvTranspose.
CI_MODELS = (
    "resnet18",
    "mobilenetv3_large_100",
    "efficientnet_b0",
    "vit_tiny",
    "mobilevit_xxs",
    "deeplabv3_resnet18",
    "lraspp_mobilenetv3",
    "yolov8n_style",
    "convtranspose_unet",
)
CI_SIZE = 64

# (model, backend, stage) -> what fails and how to reproduce it. Only our two backends are listed:
# PT2E is the peer, its failures are reported, never checked.
EXPECTED_FAILURES: dict[tuple[str, str, str], str] = {}


def _doc() -> str:
    lines = [f"* {m} / {BACKEND_LABELS[b]} / {s}: {why}" for (m, b, s), why in EXPECTED_FAILURES.items()]
    return "\n".join(lines) or "* none"


__doc__ = __doc__.replace("{failures}", _doc()) if __doc__ else __doc__


# ------------------------------------------------------------------------------------------ the job
def noise(num: int, size: int, seed: int) -> np.ndarray:
    """Seeded N(0, 1) images, float32 (num, 3, size, size)."""
    return np.random.default_rng(seed).standard_normal((num, 3, size, size), dtype=np.float32)


def model_job(
    name: str,
    size: int,
    num_calib: int,
    num_eval: int,
    threads: int,
    pt2e: bool = True,
    measures: bool = True,
    seed: int = 0,
    preset: str = "a8w8",
) -> Callable[[], dict[str, Any]]:
    """Subprocess setup (``common.measure_in_subprocess``): build ``name`` with the random
    weights of ``seed``, and its data; the work runs the flows (PT2E unless ``pt2e`` is False;
    coverage and fidelity unless ``measures`` is False; our backends under ``preset``) and
    returns their results."""
    import torch

    from tools.bench import zoo_flows
    from tools.zoo_models import ZOO

    torch.set_num_threads(threads)
    entry = ZOO[name]
    model = entry.build(size, seed)
    side = entry.input_size(size)
    calib, evaluate = noise(num_calib, side, DATA_SEEDS["calib"]), noise(num_eval, side, DATA_SEEDS["eval"])
    work = WORK_DIR / "files"
    work.mkdir(parents=True, exist_ok=True)

    def run() -> dict[str, Any]:
        float_eval = zoo_flows.torch_outputs(model, evaluate)
        data = {"calib": calib, "eval": evaluate, "node": evaluate[:NODE_SAMPLES], "float_eval": float_eval,
                "classes_from": entry.classes_from}  # fmt: skip
        result: dict[str, Any] = {
            "family": entry.family,
            "covers": entry.covers,
            "input_size": side,
            "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
            "output_shape": list(float_eval.shape[1:]),
        }
        flows = {
            "torch_fx": lambda f: zoo_flows.torch_backend(
                f, model, data, work / f"{name}_torch_fx.onnx", measures, preset
            ),
            "quant_onnx": lambda f: zoo_flows.onnx_backend(
                f, model, data, work / f"{name}_float.onnx", work / f"{name}_quant_onnx.onnx", measures, preset
            ),
            "pt2e": lambda f: zoo_flows.pt2e(f, model, data),
        }
        if not pt2e:
            del flows["pt2e"]
        for backend, flow in flows.items():
            start = time.perf_counter()
            result[backend] = zoo_flows.run(flow)
            result[backend]["wall_s"] = time.perf_counter() - start
        # The input model is never modified: its outputs after every flow are the same bits.
        result["model_unchanged"] = bool(np.array_equal(zoo_flows.torch_outputs(model, evaluate), float_eval))
        return result

    return run


def run_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    measured = common.measure_in_subprocess(
        "tools.bench.zoo:model_job",
        {
            "name": name,
            "size": args.size,
            "num_calib": args.calib,
            "num_eval": args.eval,
            "threads": args.threads,
            "pt2e": not args.no_pt2e,
            "measures": not args.no_measures,
            "seed": args.seed,
            "preset": args.preset,
        },
        timeout_s=args.timeout,
        threads=args.threads,
    )
    if not measured.get("ok"):
        error = measured.get("error", "failed")
        stage = "build" if "traceback" in measured else "job"
        return {"job_failed": {"stage": stage, "error": error}, "traceback": measured.get("traceback", "")[-3000:]}
    result = dict(measured["extras"])
    result["wall_s"] = measured["wall_s"]
    result["peak_increase_mb"] = measured["peak_increase_mb"]
    return result


# ----------------------------------------------------------------------------------------- checking
def outcome(result: dict[str, Any], backend: str) -> tuple[str, str] | None:
    """``(stage, error)`` where ``backend`` failed on this model, None when it ran end to end.

    Example:
        >>> outcome({"torch_fx": {"ok": False, "failed": {"stage": "export", "error": "E"}}}, "torch_fx")
        ('export', 'E')
        >>> outcome({"torch_fx": {"ok": True}}, "torch_fx") is None
        True
    """
    if "job_failed" in result:
        return result["job_failed"]["stage"], result["job_failed"]["error"]
    flow = result.get(backend) or {}
    if flow.get("ok"):
        return None
    failed = flow.get("failed") or {"stage": "?", "error": "no result"}
    return failed["stage"], failed["error"]


def check(results: dict[str, dict[str, Any]], expected: dict[tuple[str, str, str], str]) -> list[str]:
    """What contradicts ``expected`` (the known failures) in ``results``: a model that fails on
    one of our backends without being listed, and a listed failure that passes or fails elsewhere.

    Example:
        >>> ok = {"torch_fx": {"ok": True}, "quant_onnx": {"ok": True}}
        >>> check({"m": ok}, {})
        []
        >>> check({"m": ok}, {("m", "torch_fx", "export"): "why"})
        ['m / quant-torch-fx: listed as failing at export but ran end to end: remove it from EXPECTED_FAILURES']
    """
    problems = []
    for name, result in results.items():
        for backend in OURS:
            got = outcome(result, backend)
            listed = [stage for (m, b, stage) in expected if m == name and b == backend]
            label = f"{name} / {BACKEND_LABELS[backend]}"
            if got is None and listed:
                problems.append(
                    f"{label}: listed as failing at {listed[0]} but ran end to end: remove it from EXPECTED_FAILURES"
                )
            elif got is not None and got[0] not in listed:
                where = f" (listed at {listed[0]})" if listed else ""
                problems.append(f"{label}: failed at {got[0]}{where}: {got[1]}")
    return problems


# ------------------------------------------------------------------------------------------ tables
def _get(d: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def _not_run(result: dict[str, Any], backend: str) -> bool:
    return backend not in result and "job_failed" not in result


def status_cell(result: dict[str, Any], backend: str) -> str:
    if _not_run(result, backend):
        return "not run"
    got = outcome(result, backend)
    return "ok" if got is None else f"✗ {got[0]}: {got[1]}".replace("|", "\\|")


def _fraction(part: Any, whole: Any) -> str | None:
    return None if part is None or whole is None else f"{part}/{whole}"


def _coverage(flow: dict[str, Any] | None) -> list[Any]:
    dq, kernels = _get(flow, "dq_fed") or {}, _get(flow, "kernels") or {}
    integer = ", ".join(f"{op} {n}" for op, n in sorted((kernels.get("integer_ops") or {}).items())) or None
    return [
        _fraction(dq.get("weights_dq"), dq.get("weights")),
        _fraction(dq.get("activations_dq"), dq.get("activations")),
        _fraction(kernels.get("float"), None if not kernels else kernels.get("float", 0) + kernels.get("integer", 0)),
        integer,
    ]


def _steps(d: dict[str, Any] | None, first: bool = False) -> list[Any]:
    """Cells of a :func:`qdq_coverage.step_differences` summary (or its error)."""
    width = 4 if first else 3
    if not d or "error" in d:
        return [(d or {}).get("error"), *[None] * (width - 1)]
    worst = None if d.get("worst") is None else f"{d['worst']} ({common.fmt(d.get('worst_steps'))})"
    cells = [d.get("within_one"), d.get("elements_beyond_one"), *([d.get("first_beyond_one")] if first else []), worst]
    return cells


def _difference(d: dict[str, Any] | None, name: str) -> Any:
    """``<name>_steps`` of ``d``, or ``<name>_max_abs`` marked "abs" where the output has no step."""
    if not d or "error" in d:
        return (d or {}).get("error")
    steps, largest = d.get(f"{name}_steps"), d.get(f"{name}_max_abs")
    return steps if steps is not None or largest is None else f"{common.fmt(largest)} abs"


def _departure(d: dict[str, Any] | None) -> list[Any]:
    """Cells of a :func:`zoo_flows.first_departure` summary (or its error)."""
    if not d or "error" in d or d.get("tensor") is None:
        return [(d or {}).get("error", "none" if d else None), None, None]
    return [d["tensor"], f"{d['elements']} ({d['steps']})", common.fmt(d["tie_distance"], 2)]


def _isolated(d: dict[str, Any] | None) -> list[Any]:
    """Cells of a :func:`zoo_flows.export_vs_frozen_isolated` summary (or its error)."""
    if not d or "error" in d:
        return [(d or {}).get("error"), None, None]
    worst = None if d.get("worst") is None else f"{d['worst']} ({d.get('worst_steps')})"
    return [d.get("within_one"), worst, d.get("default_within_one")]


def tables(results: dict[str, dict[str, Any]]) -> str:
    models = results.items()
    status = common.markdown_table(
        ["model", "adds", "input", "quant-torch-fx", "quant-onnx", "PT2E X86 (torchao)"],
        [[n, r.get("covers"), r.get("input_size"), *(status_cell(r, b) for b in BACKENDS)] for n, r in models],
    )
    accuracy = common.markdown_table(
        ["model", "SQNR dB: torch-fx frozen", "torch-fx ONNX (ORT)", "quant-onnx (ORT)", "PT2E",
         "top-1 agree w/ float: torch-fx ONNX", "quant-onnx", "PT2E", "export vs frozen: top-1 agree",
         "max diff (output steps; abs where the output is float)", "rounding floor: torch vs torch channels-last",
         "same file: ORT vs onnx reference"],
        [[n, _get(r, "torch_fx", "sqnr_frozen"), _get(r, "torch_fx", "sqnr_onnx"), _get(r, "quant_onnx", "sqnr_onnx"),
          _get(r, "pt2e", "sqnr"), _get(r, "torch_fx", "agreement_float"), _get(r, "quant_onnx", "agreement_float"),
          _get(r, "pt2e", "agreement_float"), _get(r, "torch_fx", "agreement_export_frozen"),
          _difference(r.get("torch_fx"), "export_frozen"),
          _difference(_get(r, "torch_fx", "rounding_floor"), "torch_channels_last"),
          _difference(_get(r, "torch_fx", "rounding_floor"), "ort_vs_reference")] for n, r in models],
    )  # fmt: skip
    fidelity = common.markdown_table(
        ["model", "export vs frozen, node by node: matched", "tensors within 1 step", "elements > 1 step",
         "first tensor > 1 step", "worst (steps)", "isolated (each node from frozen codes): tensors within 1 step",
         "worst (steps)", "isolated, default session: tensors within 1 step", "first departure end to end: tensor", "codes differing (steps)", "distance from the tie (steps)",
         "ORT kernels vs node by node: torch-fx file, tensors within 1 code",
         "elements > 1 code", "worst (codes)", "quant-onnx file, tensors within 1 code", "elements > 1 code",
         "worst (codes)"],
        [[n, _fraction(_get(r, "torch_fx", "node_by_node", "matched"), _get(r, "torch_fx", "node_by_node", "tensors")),
          *_steps(_get(r, "torch_fx", "node_by_node"), first=True), *_isolated(_get(r, "torch_fx", "isolated")),
          *_departure(_get(r, "torch_fx", "first_departure")),
          *_steps(_get(r, "torch_fx", "kernel_fidelity")),
          *_steps(_get(r, "quant_onnx", "kernel_fidelity"))] for n, r in models],
    )  # fmt: skip
    coverage = common.markdown_table(
        ["model", "torch-fx: weights DQ-fed", "activations DQ-fed", "ORT float / all compute", "ORT integer kernels",
         "quant-onnx: weights DQ-fed", "activations DQ-fed", "ORT float / all compute", "ORT integer kernels"],
        [[n, *_coverage(r.get("torch_fx")), *_coverage(r.get("quant_onnx"))] for n, r in models],
    )  # fmt: skip
    timing = common.markdown_table(
        ["model", "torch-fx quantize s", "freeze", "export", "float ONNX export", "quant-onnx quantize",
         "PT2E prepare", "PT2E calibrate", "PT2E convert", "model total s"],
        [[n, *(_get(r, "torch_fx", "seconds", s) for s in ("quantize", "freeze", "export")),
          _get(r, "quant_onnx", "seconds", "float export"), _get(r, "quant_onnx", "seconds", "quantize"),
          *(_get(r, "pt2e", "seconds", s) for s in ("prepare", "calibrate", "convert")), r.get("wall_s")]
         for n, r in models],
    )  # fmt: skip
    return "\n\n".join(
        [f"### End to end\n\n{status}", f"### Accuracy against the float model\n\n{accuracy}",
         f"### Export fidelity\n\n{fidelity}", f"### Integer-kernel coverage\n\n{coverage}",
         f"### Time per stage (seconds)\n\n{timing}", f"### Failures\n\n{failure_list(results)}"]
    )  # fmt: skip


def failure_list(results: dict[str, dict[str, Any]]) -> str:
    rows = []
    for name, result in results.items():
        for backend in BACKENDS:
            got = None if _not_run(result, backend) else outcome(result, backend)
            if got is not None:
                rows.append([name, BACKEND_LABELS[backend], got[0], got[1].replace("|", "\\|")])
    return common.markdown_table(["model", "backend", "stage", "error"], rows) if rows else "none"


# ------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from tools.zoo_models import ZOO

    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(ZOO),
                        help="default: every model (--check: the CI subset and the listed failures)")  # fmt: skip
    parser.add_argument("--size", type=int, default=None, help=f"input side in pixels (default 96; --check: {CI_SIZE})")
    parser.add_argument("--calib", type=int, default=32, help="calibration samples (seeded noise)")
    parser.add_argument("--eval", type=int, default=32, help="held-out evaluation samples (another seed)")
    parser.add_argument("--quick", action="store_true", help="16 calibration and 8 evaluation samples")
    parser.add_argument("--no-pt2e", action="store_true", help="skip torchao PT2E (the peer; --check never checks it)")
    parser.add_argument("--no-measures", action="store_true",
                        help="end to end and accuracy only: no coverage, no export or kernel fidelity")  # fmt: skip
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when a model fails on one of our backends without being listed in "
                             "EXPECTED_FAILURES, or a listed failure no longer fails")  # fmt: skip
    parser.add_argument("--json", type=Path, default=None, help="write every result here")
    parser.add_argument("--report", type=Path, default=None, help="print the tables of a --json file; run nothing")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (compare over several)")
    parser.add_argument("--preset", default="a8w8", help="the preset of our two backends (PT2E is always its own)")
    parser.add_argument("--threads", type=int, default=common.DEFAULT_THREADS)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per model (a watchdog)")
    args = parser.parse_args(argv)
    if args.quick:
        args.calib, args.eval = 16, 8
    # --check runs the listed failures too, so that one that starts passing is noticed.
    listed = [m for m, _backend, _stage in EXPECTED_FAILURES if m not in CI_MODELS]
    args.models = args.models or (list(dict.fromkeys([*CI_MODELS, *listed])) if args.check else list(ZOO))
    args.size = args.size or (CI_SIZE if args.check else 96)
    from tools.zoo_models import check_size

    try:
        check_size(args.size)
    except ValueError as exc:
        parser.error(str(exc))
    if args.calib < 1 or args.eval < NODE_SAMPLES:
        parser.error(f"--calib must be at least 1 and --eval at least {NODE_SAMPLES}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        import json

        saved = json.loads(args.report.read_text())
        print(f"{saved['environment']}\n\n{tables(saved['models'])}")
        return 0
    from tools.zoo_models import describe_size

    start = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    report: dict[str, Any] = {
        "environment": {"date": datetime.date.today().isoformat(), "python": platform.python_version(),
                        "machine": platform.machine(), "threads": args.threads, "size": describe_size(args.size),
                        "calibration": args.calib, "evaluation": args.eval, "data": "seeded N(0, 1) noise",
                        "weight_seed": args.seed, "preset": args.preset,
                        "command": " ".join(["python -m tools.bench.zoo", *(argv if argv is not None else sys.argv[1:])])},
        "models": results,
    }  # fmt: skip
    for name in args.models:
        print(f"== {name}", end=" ", flush=True)
        results[name] = run_model(name, args)
        print(" ".join(f"{BACKEND_LABELS[b]}: {status_cell(results[name], b)}" for b in BACKENDS),
              f"({common.fmt(results[name].get('wall_s'))} s)", flush=True)  # fmt: skip
        if args.json:
            common.write_json(args.json, report)
    report["environment"]["total_s"] = time.perf_counter() - start
    if args.json:
        common.write_json(args.json, report)
    print()
    print(tables(results))
    print(f"\ntotal {report['environment']['total_s']:.0f} s")
    if args.check:
        problems = check(results, EXPECTED_FAILURES)
        for line in problems:
            print(f"zoo check: {line}", file=sys.stderr)
        print(f"zoo check: {'FAILED' if problems else 'passed'} ({len(results)} models)")
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
