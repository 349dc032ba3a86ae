"""The torch backend on a CUDA device: PTQ calibration, QAT and DDP, each against its float
counterpart measured in the same process (issue 28).

Parts, each printed as one JSON line and gathered in ``--out``:

* ``ptq``: calibration throughput against float inference (``a8w8``: min-max observers,
  ``xint8``: power-of-two MinMSE histograms), same batch, interleaved, medians; and the
  qparams of a calibration on the device against the same calibration on the CPU (the
  observers reduce on the tensor's device, so they must be equal, histograms included).
* ``qat``: ``xint8`` QAT training step against the float training step (eager, with
  ``compile_fake_quant`` on CPU, and the whole prepared model under ``torch.compile``).
* ``ddp``: two ranks sharing the one GPU (gloo, which takes CUDA tensors; NCCL refuses two
  ranks on one device) calibrate and train QAT under ``DistributedDataParallel``: their
  qparams must be identical to each other and to one process on the union of the shards.

Models are timm's (random weights, 224 px), built offline.

Example:
    $ python -m tools.bench.cuda --out cuda.json                       # on a machine with a GPU
    $ python -m tools.bench.cuda --device cpu --models resnet18 --batch 4 --size 64 --repeats 2  # smoke test
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make `tools.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench.common import interleaved_medians
from tools.bench.torch_fx import train_step

DEFAULT_MODELS = ("resnet50", "efficientnet_b0", "mobilenetv3_large_100")


def device_sync(device: str) -> Callable[[], Any] | None:
    """What makes a clock reading mean the device has finished (None on the CPU)."""
    import torch

    return torch.cuda.synchronize if device.startswith("cuda") else None


def build(name: str, size: int) -> Any:
    import torch

    try:
        import torchvision  # noqa: F401  (timm needs it; a GPU machine has a working one)
    except ImportError:
        from tools.zoo_models import use_torchvision_shim

        use_torchvision_shim()
    import timm

    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, num_classes=1000).eval(), torch.zeros(1, 3, size, size)


def calibration_pass(prepared: Any, batches: list[Any], signature: Any) -> None:
    """The observing forward passes over ``batches``, then every activation observer read, so
    that statistics kept on the device (:func:`quant_torch_fx.observe.observe_later`) reach
    the host inside the timed region, as they do once per calibration."""
    from quant_torch_fx.calibrate import run_batches
    from quant_torch_fx.prepare import activation_quantizers, quantized_graphs

    run_batches(prepared, batches, signature, quiet=True)
    for gm in quantized_graphs(prepared):
        for _key, fq in activation_quantizers(gm):
            _ = fq.observer


def part_ptq(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from quant_torch_fx import ModelQuantizer
    from quant_torch_fx import observe as observe_module
    from quant_torch_fx.calibrate import start_observing
    from quant_torch_fx.prepare import qparams_table

    model, example = build(name, args.size)
    gen = torch.Generator().manual_seed(1)
    x_cpu = torch.randn(args.batch, 3, args.size, args.size, generator=gen)
    row: dict[str, Any] = {"model": name, "part": "ptq", "batch": args.batch, "device": args.device}
    dev_model = copy.deepcopy(model).to(args.device)
    x = x_cpu.to(args.device)

    def infer() -> None:
        with torch.no_grad():
            for _ in range(args.timed_batches):
                dev_model(x)

    for preset in ("a8w8", "xint8"):
        q = ModelQuantizer(preset, quiet=True)
        prepared = q.prepare(copy.deepcopy(model).to(args.device), example.to(args.device))
        signature = q.signature(example.to(args.device))
        observing = start_observing(prepared)

        def calibrate(prepared: Any = prepared, signature: Any = signature) -> None:
            calibration_pass(prepared, [x] * args.timed_batches, signature)

        if preset == "a8w8":  # the prepared graph with its quantizers idle: what observing adds to
            for fq in observing:
                fq.observing = False
            infer()
            calibrate()
            infer_s, graph_s = interleaved_medians(infer, calibrate, args.repeats, device_sync(args.device))
            row["graph_alone_throughput_ratio"] = infer_s / graph_s
            start_observing(prepared)  # fresh observers, observing again

        # Statistics kept on the device until read (the default), then fed batch by batch.
        for keep, label in (("accelerators", preset), ("none", f"{preset}_batch_by_batch")):
            observe_module.KEEP_STATISTICS_ON = keep
            infer()
            calibrate()
            infer_s, calib_s = interleaved_medians(infer, calibrate, args.repeats, device_sync(args.device))
            row[f"{label}_throughput_ratio"] = infer_s / calib_s
            row[f"{label}_calib_s_per_batch"] = calib_s / args.timed_batches
            row["infer_s_per_batch"] = infer_s / args.timed_batches
        observe_module.KEEP_STATISTICS_ON = "accelerators"
        # The same calibration on the device and on the CPU: identical qparams.
        on_device = qparams_table(q.quantize_model(copy.deepcopy(model).to(args.device), example.to(args.device), [x]))
        on_cpu = qparams_table(q.quantize_model(copy.deepcopy(model), example, [x_cpu]))
        differing = [k for k in on_cpu if on_cpu[k] != on_device.get(k)]
        row[f"{preset}_qparams_equal_to_cpu"] = not differing
        row[f"{preset}_qparams_differing"] = differing[:5]
    return row


def compiled_graph_count() -> int:
    """How many graphs torch's compiler has built since :func:`reset_compiled_graph_count`."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def reset_compiled_graph_count() -> None:
    from torch._dynamo.utils import counters

    counters["stats"].clear()


def part_qat(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from quant_torch_fx import ModelQuantizer

    model, example = build(name, args.size)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(args.batch, 3, args.size, args.size, generator=gen).to(args.device)
    y = torch.randint(0, 1000, (args.batch,), generator=gen).to(args.device)
    float_step = train_step(copy.deepcopy(model).to(args.device).train(), x, y)
    row: dict[str, Any] = {"model": name, "part": "qat", "batch": args.batch, "device": args.device}
    # compile_fake_quant compiles on CPU only (on a GPU it is the eager path); torch.compile
    # of the whole prepared model is what a GPU user would reach for.
    ways = [("eager", False, False), ("whole_model_compiled", False, True)]
    if args.device == "cpu":
        ways.insert(1, ("compiled", True, False))
    for label, compiled, whole in ways:
        reset_compiled_graph_count()
        try:
            q = ModelQuantizer("xint8", compile_fake_quant=compiled, quiet=True)
            qat = q.prepare_qat(copy.deepcopy(model).to(args.device), example.to(args.device), calib_loader=[x])
            qat_step = train_step(torch.compile(qat.train()) if whole else qat.train(), x, y)
            started = time.perf_counter()
            for _ in range(3):
                float_step()
                qat_step()
            row[f"{label}_warmup_s"] = time.perf_counter() - started
            float_s, qat_s = interleaved_medians(float_step, qat_step, args.repeats, device_sync(args.device))
            row[f"{label}_ratio"] = qat_s / float_s
            row[f"{label}_float_step_s"] = float_s
            if compiled or whole:  # past torch's recompile limit a function runs eagerly, unfused
                row[f"{label}_graphs"] = compiled_graph_count()
        except Exception as exc:  # a compile failure on this torch/device is a finding, not a crash
            row[f"{label}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return row


WORLD = 2


def _ddp_worker(rank: int, init_file: str, out_dir: str, name: str, size: int, batch: int, device: str) -> None:
    import torch
    import torch.distributed as dist

    from quant_torch_fx import ModelQuantizer, train_qat
    from quant_torch_fx.prepare import qparams_table

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        model, example = build(name, size)
        data = _ddp_data(size, batch)
        shard = [b.to(device) for b in data[rank::WORLD]]
        q = ModelQuantizer("xint8", quiet=True)
        t = time.perf_counter()
        ptq = qparams_table(q.quantize_model(copy.deepcopy(model).to(device), example.to(device), shard))
        ptq_s = time.perf_counter() - t
        qat = q.prepare_qat(copy.deepcopy(model).to(device), example.to(device), calib_loader=shard[:1])
        ddp = torch.nn.parallel.DistributedDataParallel(qat)
        labelled = [(b, torch.zeros(b.shape[0], dtype=torch.long, device=device)) for b in shard]
        t = time.perf_counter()
        train_qat(ddp, labelled, epochs=1, lr=1e-4, quiet=True)
        qat_s = time.perf_counter() - t
        after = qparams_table(qat)
        torch.save({"ptq": ptq, "after": after, "ptq_s": ptq_s, "qat_s": qat_s}, Path(out_dir) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def _ddp_data(size: int, batch: int) -> list[Any]:
    import torch

    gen = torch.Generator().manual_seed(3)
    return [torch.randn(batch, 3, size, size, generator=gen) for _ in range(4)]


def part_ddp(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.multiprocessing as mp

    from quant_torch_fx import ModelQuantizer
    from quant_torch_fx.prepare import qparams_table

    row: dict[str, Any] = {"model": name, "part": "ddp", "world": WORLD, "backend": "gloo", "device": args.device}
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.start_processes(
            _ddp_worker,
            args=(init_file, tmp, name, args.size, args.batch, args.device),
            nprocs=WORLD,
            start_method="spawn",
            join=True,
        )
        ranks = [torch.load(Path(tmp) / f"{r}.pt", weights_only=False) for r in range(WORLD)]
    model, example = build(name, args.size)
    union = qparams_table(
        ModelQuantizer("xint8", quiet=True).quantize_model(
            model.to(args.device),
            example.to(args.device),
            [b.to(args.device) for b in _ddp_data(args.size, args.batch)],
        )
    )
    row["ptq_ranks_equal"] = ranks[0]["ptq"] == ranks[1]["ptq"]
    row["ptq_equal_to_union"] = ranks[0]["ptq"] == union
    row["qat_ranks_equal_after_training"] = ranks[0]["after"] == ranks[1]["after"]
    row["ptq_s"] = max(r["ptq_s"] for r in ranks)
    row["qat_epoch_s"] = max(r["qat_s"] for r in ranks)
    return row


PARTS = {"ptq": part_ptq, "qat": part_qat, "ddp": part_ddp}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timed-batches", type=int, default=4)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    import torch

    env = {"torch": torch.__version__, "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    print(json.dumps(env), flush=True)
    rows: list[dict[str, Any]] = []
    for part in args.parts:
        for name in args.models:
            try:
                row = PARTS[part](name, args)
            except Exception as exc:  # one failing row must not lose the others
                row = {"model": name, "part": part, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                args.out.write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
