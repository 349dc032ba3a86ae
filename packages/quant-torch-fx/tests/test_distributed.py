"""torch.distributed (gloo, 2 CPU processes): every rank ends with identical qparams, equal
to one process on the union of the data, for PTQ calibration and for QAT."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from models import conv_bn_net, images

from quant_torch_fx import ModelQuantizer, train_qat
from quant_torch_fx.prepare import qparams_table
from quant_torch_fx.training import learnable_quantizers

WORLD = 2
EXAMPLE = torch.randn(1, 3, 8, 8)


def _data() -> list[torch.Tensor]:
    return images(6, batch=8, seed=21)


def _labelled(batches: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x, (x[:, 0].mean((1, 2)) > 0).long()) for x in batches]


def _worker(rank: int, init_file: str, out_dir: str, preset: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        shard = _data()[rank::WORLD]
        q = ModelQuantizer(preset, quiet=True)
        ptq = qparams_table(q.quantize_model(conv_bn_net(), EXAMPLE, shard))
        qat = q.prepare_qat(conv_bn_net(), EXAMPLE)
        ddp = torch.nn.parallel.DistributedDataParallel(qat)
        train_qat(ddp, _labelled(shard)[:1], epochs=1, lr=0.0, quiet=True)  # first batch: learnables start
        init = qparams_table(qat)
        train_qat(ddp, _labelled(shard), epochs=2, lr=1e-3, quiet=True)
        learned = {name: p.detach().clone() for name, p in qat.named_parameters()}
        thresholds = [fq.learned.detach().clone() for fq in learnable_quantizers(qat)]
        torch.save(
            {"ptq": ptq, "init": init, "learned": learned, "thresholds": thresholds}, Path(out_dir) / f"{rank}.pt"
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("preset", ["xint8", "a8w8"])
def test_ranks_agree_with_one_process_on_the_union(preset: str) -> None:
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.start_processes(_worker, args=(init_file, tmp, preset), nprocs=WORLD, start_method="spawn", join=True)
        results = [torch.load(Path(tmp) / f"{rank}.pt", weights_only=False) for rank in range(WORLD)]

    q = ModelQuantizer(preset, quiet=True)
    union = qparams_table(q.quantize_model(conv_bn_net(), EXAMPLE, _data()))
    assert results[0]["ptq"] == results[1]["ptq"] == union

    # QAT: learnable qparams start from both ranks' first batches together
    data = _data()
    first = torch.cat([data[0], data[1]])
    single = q.prepare_qat(conv_bn_net(), EXAMPLE)
    train_qat(single, _labelled([first]), epochs=1, lr=0.0, quiet=True)
    assert results[0]["init"] == results[1]["init"] == qparams_table(single)

    # and stay identical while DDP trains
    for name, value in results[0]["learned"].items():
        assert torch.equal(value, results[1]["learned"][name]), name
    assert results[0]["thresholds"] and all(
        torch.equal(a, b) for a, b in zip(results[0]["thresholds"], results[1]["thresholds"], strict=True)
    )


def _rank_worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.Hardswish(), torch.nn.Conv2d(4, 4, 1)).eval()
        # Each rank's shard spans other channel ranges: equalized alone, they would differ.
        shard = [torch.randn(8, 3, 8, 8) * (1 + 3 * rank) + rank for _ in range(2)]
        model = ModelQuantizer("a8w8", quiet=True).quantize_model(net, EXAMPLE, shard)
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)},
                   Path(out_dir) / f"state{rank}.pt")  # fmt: skip
    finally:
        dist.destroy_process_group()


def test_the_data_driven_algorithms_give_every_rank_the_same_model() -> None:
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.start_processes(_rank_worker, args=(init_file, tmp), nprocs=WORLD, start_method="spawn", join=True)
        states = [torch.load(Path(tmp) / f"state{rank}.pt", weights_only=False) for rank in range(WORLD)]
    assert states[0].keys() == states[1].keys()
    for name, value in states[0].items():
        assert torch.equal(value, states[1][name]), name
