"""The ONNX calibration floor: the whole ``quant-onnx quantize`` process against float inference
of the same calibration set in onnxruntime's default session (issue 28).

Each round runs, in fresh interpreters and interleaved so that a change of load hits every
variant alike: float inference of the crops at the calibration batch size (timed inside the
process, after imports and loading: the floor), then ``quant-onnx quantize`` as a user runs it
(the whole process's wall time: imports, loading, pre-processing, calibration, writing), once
per observed-bytes budget in ``--chunk-mb`` (``quant_onnx.pipeline.calibrate.CHUNK_BYTES``: a
batch whose observed tensors exceed it runs in pieces) and per ``--spinning`` setting
(``quant_onnx.ort_session.ALLOW_SPINNING``). The float inference runs in onnxruntime's
default session, as a user runs it. Prints the medians and each one's ratio to the floor.

Example:
    $ python -m tools.bench.onnx_floor --chunk-mb 32 512 --spinning sleep spin --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `tools.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench import common

MODEL = common.CACHE_DIR / "models" / "efficientnet_lite0.onnx"
CROPS = common.CACHE_DIR / "bench" / "data" / "photos_calib_218.npy"

_FLOAT = """
import sys, time, numpy as np, onnxruntime as ort
model, crops, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
x = np.load(crops)
options = ort.SessionOptions()
options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
name = session.get_inputs()[0].name
start = time.perf_counter()
for i in range(0, len(x), batch):
    session.run(None, {name: x[i:i + batch]})
print(time.perf_counter() - start)
"""

_QUANTIZE = """
import sys
import quant_onnx.ort_session as ort_session
import quant_onnx.pipeline.calibrate as calibrate
calibrate.CHUNK_BYTES = int(sys.argv[1]) << 20
ort_session.ALLOW_SPINNING = {"spin": True, "sleep": False}.get(sys.argv[2])
from quant_onnx.cli.main import main
sys.exit(main(sys.argv[3:]))
"""


def float_seconds(batch: int) -> float:
    out = subprocess.run(
        [sys.executable, "-c", _FLOAT, str(MODEL), str(CROPS), str(batch)], check=True, capture_output=True, text=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def quantize_seconds(chunk_mb: int, spinning: str, preset: str, batch: int, out: Path) -> float:
    args = ["quantize", str(MODEL), str(out), "--calib-data", str(CROPS), "--preset", preset]
    args += ["--batch-size", str(batch), "--quiet"]
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", _QUANTIZE, str(chunk_mb), spinning, *args], check=True, capture_output=True)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk-mb", type=int, nargs="+", default=[32, 512], help="CHUNK_BYTES budgets, MiB")
    parser.add_argument(
        "--spinning",
        nargs="+",
        default=["load"],
        choices=["load", "sleep", "spin"],
        help="ALLOW_SPINNING settings (load: decided by the machine's load, the default)",
    )
    parser.add_argument("--preset", default="a8w8")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if not MODEL.exists() or not CROPS.exists():
        sys.exit(f"needs {MODEL} and {CROPS}: run `python -m tools.bench.onnx_ptq --quick` once to build them")
    variants = [(mb, spin) for mb in args.chunk_mb for spin in args.spinning]
    times: dict[str, list[float]] = {"float inference": []}
    times |= {f"quantize, {mb} MiB, threads {spin}": [] for mb, spin in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            times["float inference"].append(float_seconds(args.batch))
            for mb, spin in variants:
                seconds = quantize_seconds(mb, spin, args.preset, args.batch, Path(tmp) / "q.onnx")
                times[f"quantize, {mb} MiB, threads {spin}"].append(seconds)
    floor = statistics.median(times["float inference"])
    rows = [
        [name, f"{statistics.median(v):.2f}", " ".join(f"{t:.1f}" for t in v), f"{statistics.median(v) / floor:.2f}"]
        for name, v in times.items()
    ]
    print(f"EfficientNet-Lite0, {CROPS.name}, batch {args.batch}, preset {args.preset}, {args.rounds} rounds")
    print(common.markdown_table(["run", "median s", "rounds s", "/ float inference"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
