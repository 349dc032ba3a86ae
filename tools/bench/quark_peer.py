"""AMD Quark as a peer column: quantize one model with a Quark default config, timed like our rows.

Runs **inside the Quark virtual environment** (``amd-quark==0.13`` with its own onnxruntime, torch
and transformers pins; never installed into the dev venv). Our benches call it as a subprocess and
score the model it writes with their own scorers:

    /work/quark-venv/bin/python tools/bench/quark_peer.py --model M.onnx --calib C.npy --out Q.onnx

It quantizes in a fresh child interpreter through :func:`tools.bench.common.measure_in_subprocess`
(imports, model and data loading are the memory baseline; the ``quantize_model`` call is timed),
then writes ``--results`` (default: ``--out`` with ``.json``): ``ok``, ``wall_s``,
``peak_increase_mb``, the config and options actually used, and what fast finetune reported per
layer. The calibration reader hands Quark **one sample per call**: Quark's fast finetune stacks the
reader's items with ``np.array`` and, when their batch sizes differ (a ragged last batch), it skips
*every* layer with exit status 0 ("setting an array element with a sequence"); one-sample items
cannot be ragged. ``layers_failed`` in the results counts such skips anyway.

Example:
    $ /work/quark-venv/bin/python tools/bench/quark_peer.py --model .cache/models/efficientnet_lite0.onnx \\
        --calib .cache/bench/data/photos_calib_256.npy --out .cache/bench/quark/xint8_adaround.onnx
    $ ... --config XINT8 --no-cle                       # plain XINT8 without Quark's CLE
    $ ... --fast-finetune '{"NumIterations": 500}'      # override FastFinetune options
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import resource
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a file: make `tools.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench import common

# Where our benches look for the Quark interpreter (override with --quark-python or this variable).
QUARK_PYTHON_ENV = "QUARK_PYTHON"
DEFAULT_QUARK_PYTHON = "/work/quark-venv/bin/python"
CONFIGS = ("XINT8", "XINT8_ADAROUND", "XINT8_ADAQUANT")
# Quark's fast-finetune log lines this script counts (quark/onnx/algorithm/finetuning/fast_finetune.py,
# train_torch/train_model.py in 0.13).
_OPTIMIZED = re.compile(r"recons metrics was optimized from ([-+0-9.eE]+) to ([-+0-9.eE]+)")
_FAILED = re.compile(r"Optimizing #(\d+) module failed")


def quark_python() -> str | None:
    """The Quark interpreter our benches use, or None when it is not installed.

    Example:
        >>> isinstance(quark_python(), str | None)
        True
    """
    path = os.environ.get(QUARK_PYTHON_ENV, DEFAULT_QUARK_PYTHON)
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


def process_cpu_seconds() -> float:
    """User + system CPU seconds of this process so far (all its threads): unlike wall time, it does
    not grow when other jobs share the cores.

    Example:
        >>> process_cpu_seconds() > 0
        True
    """
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _SampleReader:
    """Quark ``CalibrationDataReader``: one ``{input: (1, ...)}`` feed per call, ``len`` = samples."""

    def __init__(self, name: str, data: np.ndarray):
        self.name, self.data, self.index = name, data, 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.index >= len(self.data):
            return None
        self.index += 1
        return {self.name: np.ascontiguousarray(self.data[self.index - 1 : self.index])}

    def rewind(self) -> None:
        self.index = 0

    def __len__(self) -> int:
        return len(self.data)


class _Lines(logging.Handler):
    """Keeps the messages of Quark's loggers (``*_screen`` loggers that do not propagate)."""

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def build_config(name: str, include_cle: bool | None, fast_finetune: dict[str, Any], extra: dict[str, Any]) -> Any:
    """Quark's default config ``name`` with CLE switched and FastFinetune/extra options merged in."""
    from quark.onnx import QConfig

    config = QConfig.get_default_config(name)
    q = config.global_quant_config
    if include_cle is not None:
        q.include_cle = include_cle
    q.print_summary = False
    q.extra_options.update(extra)
    if fast_finetune:
        if not q.include_fast_ft:
            raise ValueError(f"--fast-finetune: config {name} runs no fast finetune; use XINT8_ADAROUND/ADAQUANT")
        q.extra_options.setdefault("FastFinetune", {}).update(fast_finetune)
    return config


def quark_job(
    model_in: str,
    model_out: str,
    calib_path: str,
    num_calib: int,
    config: str,
    include_cle: bool | None,
    fast_finetune: dict[str, Any],
    extra: dict[str, Any],
) -> Callable[[], dict[str, Any]]:
    """Subprocess setup (``measure_in_subprocess``): import Quark, load model and data; the work quantizes."""
    import onnx

    common.load_torch_runtime()  # as the torch rows of tools.bench.algos do
    # Imported here so that their loggers exist when the work attaches to them.
    import quark.onnx.algorithm.finetuning.fast_finetune
    import quark.onnx.algorithm.finetuning.train_torch.train_model  # noqa: F401
    from quark.onnx import ModelQuantizer

    # Quark writes quantized_info.csv (its per-step timings) into the working directory: keep it beside the model.
    os.chdir(Path(model_out).parent)
    model = onnx.load(model_in)
    initializers = {t.name for t in model.graph.initializer}
    name = next(i.name for i in model.graph.input if i.name not in initializers)
    data = np.load(calib_path)[:num_calib].astype(np.float32)
    if len(data) < num_calib:
        raise ValueError(f"--num-calib: {num_calib} samples asked, {calib_path} holds {len(data)}")
    cfg = build_config(config, include_cle, fast_finetune, extra)
    q = cfg.global_quant_config
    used = {
        "config": config,
        "include_cle": q.include_cle,
        "include_fast_ft": q.include_fast_ft,
        "calibrate_method": str(q.calibrate_method),
        "activation_type": str(q.activation_type),
        "weight_type": str(q.weight_type),
        "extra_options": json.loads(json.dumps(q.extra_options, default=str)),
        "num_calib": len(data),
    }

    def work() -> dict[str, Any]:
        lines = _Lines()
        loggers = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict) if n.endswith("_screen")]
        for logger in loggers:
            logger.addHandler(lines)
        cpu = process_cpu_seconds()
        try:
            with common.atomic_path(model_out, ".onnx") as tmp:
                ModelQuantizer(cfg).quantize_model(model, str(tmp), _SampleReader(name, data))
                if not tmp.exists() or tmp.stat().st_size == 0:
                    raise RuntimeError("Quark wrote no model")
        finally:
            for logger in loggers:
                logger.removeHandler(lines)
        cpu = process_cpu_seconds() - cpu
        optimized = [(float(a), float(b)) for a, b in (m.groups() for m in map(_OPTIMIZED.search, lines.lines) if m)]
        failed = sorted({int(m.group(1)) for m in map(_FAILED.search, lines.lines) if m})
        return {
            "cpu_s": cpu,
            "quark": used,
            "layers_optimized": len(optimized),
            "layers_failed": failed,
            "recons_before_after": optimized,
            "errors": [line for line in lines.lines if "error" in line.lower()][:20],
        }

    return work


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="float ONNX model")
    parser.add_argument("--calib", type=Path, required=True, help=".npy calibration set, first axis = samples")
    parser.add_argument("--out", type=Path, required=True, help="quantized model to write")
    parser.add_argument("--results", type=Path, default=None, help="timing JSON (default: --out with .json)")
    parser.add_argument("--config", default="XINT8_ADAROUND", choices=CONFIGS)
    parser.add_argument("--num-calib", type=int, default=None, help="first N samples of --calib (default: all)")
    cle = parser.add_mutually_exclusive_group()
    cle.add_argument("--cle", dest="include_cle", action="store_const", const=True, default=None)
    cle.add_argument("--no-cle", dest="include_cle", action="store_const", const=False)
    parser.add_argument("--fast-finetune", type=json.loads, default={}, help="JSON merged into FastFinetune")
    parser.add_argument("--extra", type=json.loads, default={}, help="JSON merged into extra_options")
    parser.add_argument("--timeout", type=float, default=10800, help="seconds (XINT8_ADAROUND: ~900 s quiet)")
    parser.add_argument("--mem-limit-mb", type=float, default=20000)
    parser.add_argument("--verbose", action="store_true", help="show Quark's own output")
    args = parser.parse_args(argv)
    if args.num_calib is None:
        args.num_calib = int(np.load(args.calib, mmap_mode="r").shape[0])
    if args.num_calib < 1:
        parser.error(f"--num-calib: {args.num_calib}; allowed: >= 1")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = common.measure_in_subprocess(
        "tools.bench.quark_peer:quark_job",
        {
            "model_in": str(args.model.resolve()),
            "model_out": str(args.out.resolve()),
            "calib_path": str(args.calib.resolve()),
            "num_calib": args.num_calib,
            "config": args.config,
            "include_cle": args.include_cle,
            "fast_finetune": args.fast_finetune,
            "extra": args.extra,
        },
        timeout_s=args.timeout,
        mem_limit_mb=args.mem_limit_mb,
        quiet=not args.verbose,
    )
    results = args.results or args.out.with_suffix(".json")
    common.write_json(results, result)
    extras = result.get("extras") or {}
    if result.get("ok"):
        print(
            f"{args.config}: {result['wall_s']:.1f} s (CPU {extras.get('cpu_s', 0):.0f} s), peak +{result['peak_increase_mb']:.0f} MB, "
            f"fast finetune {extras.get('layers_optimized', 0)} layers, failed {extras.get('layers_failed', [])}"
        )
    else:
        print(f"{args.config}: FAILED: {result.get('error')}\n{result.get('stderr', '')[-2000:]}", file=sys.stderr)
    print(f"results: {results}")
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
