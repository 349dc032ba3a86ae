"""Every preset on every benchmark model: accuracy node by node and in onnxruntime's default
(optimised) session, output SQNR, and how the biases were stored (the bias rule), with a
count of int32 bias codes at the int32 limits (saturated: must be zero). onnxruntime's own
A8W8 / A16W8 per-channel models are measured in the same run on EfficientNet-Lite0.

    python -m tools.bench.presets                                  # all models, all presets
    python -m tools.bench.presets --models efficientnet_lite0 --presets a8w8 a16w8 --bias-correction

Calibration: the first ``--num-calib`` (128) samples of the benchmark calibration set,
batch 16; evaluation as in ``tools/bench/models.py`` (Fashion-MNIST top-1 on the 10k test
images, EfficientNet-Lite0 top-1 agreement with float on held-out photo crops).

Example:
    >>> saturated_bias_codes.__name__
    'saturated_bias_codes'
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a script: make `tools.*` importable
    sys.path.insert(0, str(REPO_ROOT))

from tools.bench import common  # noqa: E402
from tools.bench.models import MODELS, ArrayDataReader, evaluate, input_name, load_data  # noqa: E402

DEFAULT_MODELS = ("fmnist_resnet18", "fmnist_mobilenetv2", "efficientnet_lite0")
RESULTS = common.CACHE_DIR / "bench" / "presets.json"
INT32 = np.iinfo(np.int32)


def saturated_bias_codes(path: Path) -> int:
    """int32 bias codes of Conv/Gemm layers at the int32 limits (what saturation leaves)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    inits = {t.name: t for t in model.graph.initializer}
    producers = {out: node for node in model.graph.node for out in node.output}
    count = 0
    for node in model.graph.node:
        if node.op_type in ("Conv", "Gemm", "ConvTranspose") and len(node.input) > 2 and node.input[2]:
            dq = producers.get(node.input[2])
            if dq is not None and dq.op_type == "DequantizeLinear" and dq.input[0] in inits:
                codes = numpy_helper.to_array(inits[dq.input[0]])
                if codes.dtype == np.int32:
                    count += int(np.count_nonzero((codes == INT32.min) | (codes == INT32.max)))
    return count


def bias_rules(report: dict[str, Any]) -> str:
    counts: dict[str, int] = {}
    for entry in report.get("biases", []):
        counts[entry.get("rule") or "-"] = counts.get(entry.get("rule") or "-", 0) + 1
    fitted = sum(1 for note in report.get("notes", []) if "weight scale raised" in note)
    text = ", ".join(f"{rule} {n}" for rule, n in sorted(counts.items()))
    return text + (f"; weights fitted on {fitted} layers" if fitted else "")


def ours(path: Path, preset: str, feeds: list[dict[str, np.ndarray]], out: Path, bias_correction: bool) -> dict:
    import quant_onnx
    from quant_core.algorithm_config import BiasCorrectionConfig
    from quant_core.presets import get_preset

    config = get_preset(preset)
    if bias_correction:
        config = config.evolve(algorithms=(*config.algorithms, BiasCorrectionConfig()))
    start = time.perf_counter()
    quant_onnx.quantize(path, out, config, feeds, quiet=True, report_path=out.with_suffix(".json"))
    report = json.loads(out.with_suffix(".json").read_text())
    return {"seconds": time.perf_counter() - start, "biases": bias_rules(report)}


def ort_peer(path: Path, activation: str, feeds: list[dict[str, np.ndarray]], out: Path) -> dict:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    pre = out.with_name(out.stem + "_pre.onnx")
    quant_pre_process(str(path), str(pre))
    start = time.perf_counter()
    quantize_static(
        str(pre),
        str(out),
        ArrayDataReader(feeds),
        quant_format=QuantFormat.QDQ,
        activation_type=getattr(QuantType, activation),
        weight_type=QuantType.QInt8,
        per_channel=True,
        calibrate_method=CalibrationMethod.MinMax,
        extra_options={"UseQDQContribOps": activation == "QUInt16"},
    )
    return {"seconds": time.perf_counter() - start, "biases": "onnxruntime"}


def _quantize(job: tuple[str, str], path: Path, feeds: list[dict], out: Path, args: argparse.Namespace) -> dict:
    kind, what = job
    if kind == "ours":
        return ours(path, what, feeds, out, args.bias_correction)
    return ort_peer(path, what, feeds, out)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from quant_core.qparams import sqnr_db

    results: dict[str, Any] = {}
    peers = {"onnxruntime A8W8": ("ort", "QUInt8"), "onnxruntime A16W8": ("ort", "QUInt16")}
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.models:
            model = MODELS[name]
            path = model.ensure()
            data = load_data(model, num_eval=args.num_eval)
            float_logits = common.predict(path, data.eval_x, level="disable")
            reference = common.top1(float_logits)
            calib = np.load(data.calib_path)[: args.num_calib]
            feeds = [{input_name(path): calib[i : i + 16]} for i in range(0, len(calib), 16)]
            jobs = {preset: ("ours", preset) for preset in args.presets}
            if name == "efficientnet_lite0" and not args.no_peer:
                jobs.update(peers)
            for label, job in jobs.items():
                out = Path(scratch) / f"{name}.{label.replace(' ', '_')}.onnx"
                row = _quantize(job, path, feeds, out, args)
                row["node_by_node"] = evaluate(out, data, reference, model.metric)
                row["optimized"] = evaluate(out, data, reference, model.metric, level="all")
                row["sqnr_db"] = sqnr_db(float_logits, common.predict(out, data.eval_x, level="disable"))
                row["saturated_bias_codes"] = saturated_bias_codes(out)
                results.setdefault(name, {})[label] = row
                print(
                    f"{name:20s} {label:22s} {row['node_by_node']:.4f} {row['optimized']:.4f} "
                    f"{row['sqnr_db']:6.2f} dB  saturated {row['saturated_bias_codes']}  {row['biases']}",
                    flush=True,
                )
    return results


def table(results: dict[str, Any]) -> str:
    rows = [
        [model, label, r["node_by_node"], r["optimized"], r["sqnr_db"], r["saturated_bias_codes"], r["biases"]]
        for model, by_label in results.items()
        for label, r in by_label.items()
    ]
    headers = ["model", "config", "node by node", "default session", "output SQNR dB", "saturated bias codes", "biases"]
    return common.markdown_table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    from quant_core.presets import list_presets

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=sorted(MODELS))
    parser.add_argument("--presets", nargs="+", default=list(list_presets()))
    parser.add_argument("--num-calib", type=int, default=128)
    parser.add_argument("--num-eval", type=int, default=None)
    parser.add_argument("--bias-correction", action="store_true", help="add bias correction to every preset")
    parser.add_argument("--no-peer", action="store_true", help="skip onnxruntime's A8W8/A16W8")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    common.use_checkout_packages()
    results = run(args)
    common.write_json(args.results, results)
    print("\n" + table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
