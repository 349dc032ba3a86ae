"""Where the torch backend's histogram calibration spends its time on a CUDA device, and
what each counting way costs there (issue 28).

The first GPU run of ``tools/bench/cuda.py`` measured ``xint8`` calibration at 0.063 of float
inference's throughput on ResNet-50 (150 ms against 9.4 ms a batch of 64). This tool says
why, in one process on the device:

* ``timing``: float inference, ``a8w8`` (min-max) and ``xint8`` (power-of-two MinMSE
  histograms) calibration per batch, interleaved medians, once per counting way in
  ``--ways`` (:data:`quant_torch_fx.observe.DEVICE_COUNTING`);
* ``profile``: one ``xint8`` calibration batch under ``torch.profiler``: the operators with
  the most device time and host time, and the host-device synchronisations;
* ``steps``: one large activation (the output of the model's first ReLU-like stage) through
  each step of :func:`quant_torch_fx.observe.observe`, timed alone;
* ``equal``: the counts of every way against the CPU's on the same activation (they must be
  identical: the qparams may not depend on where calibration ran).

Example:
    $ python -m tools.bench.cuda_observers --out cuda_observers.json          # on a GPU machine
    $ python -m tools.bench.cuda_observers --device cpu --size 32 --batch 2 --repeats 1  # smoke test
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make `tools.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench.common import interleaved_medians, synced_seconds
from tools.bench.cuda import build, calibration_pass, device_sync


def _median_seconds(fn: Callable[[], Any], sync: Callable[[], Any] | None, repeats: int = 5) -> float:
    return statistics.median(synced_seconds(fn, sync) for _ in range(repeats))


def _prepared(model: Any, example: Any, preset: str) -> tuple[Any, Any]:
    from quant_torch_fx import ModelQuantizer
    from quant_torch_fx.calibrate import start_observing

    q = ModelQuantizer(preset, quiet=True)
    prepared = q.prepare(copy.deepcopy(model), example)
    start_observing(prepared)
    return prepared, q.signature(example)


def part_timing(model: Any, prepared: dict[str, Any], x: Any, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from quant_torch_fx import observe as observe_module

    sync = device_sync(args.device)
    row: dict[str, Any] = {"part": "timing", "model": args.model, "batch": args.batch, "device": args.device}

    def infer() -> None:
        with torch.no_grad():
            for _ in range(args.timed_batches):
                model(x)

    for way in args.ways:
        observe_module.DEVICE_COUNTING = way
        for preset in ("a8w8", "xint8"):
            if preset == "a8w8" and way != args.ways[0]:
                continue  # min-max observers count nothing
            graph, signature = prepared[preset]

            def calibrate(graph: Any = graph, signature: Any = signature) -> None:
                calibration_pass(graph, [x] * args.timed_batches, signature)

            infer()
            calibrate()
            infer_s, calib_s = interleaved_medians(infer, calibrate, args.repeats, sync)
            label = preset if preset == "a8w8" else f"{preset}_{way}"
            row[f"{label}_calib_ms_per_batch"] = 1e3 * calib_s / args.timed_batches
            row[f"{label}_throughput_ratio"] = infer_s / calib_s
            row["infer_ms_per_batch"] = 1e3 * infer_s / args.timed_batches
    observe_module.DEVICE_COUNTING = args.ways[0]
    return row


def part_profile(prepared: dict[str, Any], x: Any, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from quant_torch_fx import observe as observe_module

    row: dict[str, Any] = {"part": "profile", "model": args.model, "device": args.device}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    for way in args.ways:
        observe_module.DEVICE_COUNTING = way
        graph, signature = prepared["xint8"]
        calibration_pass(graph, [x], signature)
        with profile(activities=activities) as prof:
            calibration_pass(graph, [x], signature)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
        events = prof.key_averages()
        device_key = (
            "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
        )
        by_device = sorted(events, key=lambda e: getattr(e, device_key, 0), reverse=True)[:12]
        by_host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
        row[way] = {
            "device_ms": [(e.key, e.count, round(getattr(e, device_key, 0) / 1e3, 3)) for e in by_device],
            "host_ms": [(e.key, e.count, round(e.self_cpu_time_total / 1e3, 3)) for e in by_host],
            "syncs": {
                e.key: e.count
                for e in events
                if any(s in e.key for s in ("Synchronize", "Memcpy", "aten::item", "aten::_local_scalar_dense"))
            },
        }
    observe_module.DEVICE_COUNTING = args.ways[0]
    return row


def _first_big_activation(model: Any, x: Any) -> Any:
    """The largest output of an activation module in ``model`` for ``x``."""
    import torch

    found: list[Any] = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: found.append(out.detach()))
        for m in model.modules()
        if isinstance(m, torch.nn.ReLU | torch.nn.SiLU | torch.nn.GELU | torch.nn.ReLU6 | torch.nn.Hardswish)
    ]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return max(found, key=lambda t: t.numel()) if found else x


def part_steps(model: Any, x: Any, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from quant_core.observers import make_observer
    from quant_core.presets import get_preset
    from quant_torch_fx import observe as observe_module

    sync = device_sync(args.device)
    act = _first_big_activation(model, x)
    spec = get_preset("xint8").global_config.output  # power-of-two MinMSE histograms
    obs = make_observer(spec)
    lo, hi = (float(v) for v in torch.aminmax(act))
    grid = obs.grid_for(lo, hi)
    flat = act.reshape(-1)
    row: dict[str, Any] = {
        "part": "steps",
        "values": flat.numel(),
        "zeros": float((flat == 0).float().mean()),
        "bins": grid.bins,
        "float32_exact": grid.float32_exact,
        "device": args.device,
    }
    steps: dict[str, Callable[[], Any]] = {
        "aminmax": lambda: torch.aminmax(flat),
        "aminmax_to_host": lambda: torch.stack(torch.aminmax(flat)).tolist(),
        "bin_indices": lambda: observe_module.bin_indices(flat, grid),
    }
    idx = observe_module.bin_indices(flat, grid)

    def with_way(way: str, fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            observe_module.DEVICE_COUNTING = way
            return fn()

        return run

    for way in args.ways:
        steps[f"counts_{way}"] = with_way(way, lambda: observe_module._device_counts(idx, grid))
        steps[f"histogram_counts_{way}"] = with_way(way, lambda: observe_module.histogram_counts(flat, grid))
        steps[f"observe_{way}"] = with_way(way, lambda: observe_module.observe(make_observer(spec), act))
    for name, fn in steps.items():
        fn()
        row[f"{name}_ms"] = 1e3 * _median_seconds(fn, sync)
    cpu_counts = observe_module.histogram_counts(flat.cpu(), grid)
    for way in args.ways:
        observe_module.DEVICE_COUNTING = way
        row[f"{way}_counts_equal_cpu"] = bool(
            torch.equal(observe_module.histogram_counts(flat, grid).cpu(), cpu_counts)
        )
    observe_module.DEVICE_COUNTING = args.ways[0]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--timed-batches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ways", nargs="+", default=None, help="DEVICE_COUNTING ways (default: all)")
    parser.add_argument("--parts", nargs="+", default=["steps", "profile", "timing"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    import torch

    from quant_torch_fx import observe as observe_module

    args.ways = args.ways or list(observe_module.DEVICE_COUNTING_WAYS)
    model, example = build(args.model, args.size)
    model = model.to(args.device)
    example = example.to(args.device)
    x = torch.randn(args.batch, 3, args.size, args.size, generator=torch.Generator().manual_seed(1)).to(args.device)
    # One prepared model per preset, shared by the counting ways: after the first batch every
    # way meets observers whose grids are set, as in a calibration of many batches.
    prepared = {preset: _prepared(model, example, preset) for preset in ("a8w8", "xint8")}
    rows = []
    parts: dict[str, Callable[[], dict[str, Any]]] = {
        "steps": lambda: part_steps(model, x, args),
        "profile": lambda: part_profile(prepared, x, args),
        "timing": lambda: part_timing(model, prepared, x, args),
    }
    for part in args.parts:
        row = parts[part]()
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
