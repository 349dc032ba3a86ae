"""Keeping quantization parameters identical across ``torch.distributed`` ranks.

- Calibration (PTQ, or QAT's initial pass): each rank feeds its observers its own
  shard; :func:`merge_observers` then gathers every rank's observer state and merges them
  in rank order, so every rank holds the same statistic, the one a single process
  gets on the union of the data (min-max and histograms merge exactly).
- QAT without a calibration loader calibrates on the first batch the same way: every
  rank's first batch, merged.
- Learnable scales and thresholds are parameters: DDP averages their gradients like
  any other, so they stay identical once initialised identically.

Without an initialised process group (or with one process) everything here is a no-op.

Example:
    >>> distributed_world() is None
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from quant_core.observers import Observer, make_observer
from quant_torch_fx.quantizer import FakeQuantizer


def distributed_world() -> tuple[int, int] | None:
    """``(rank, world size)`` inside a process group of more than one process, else ``None``."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    size = dist.get_world_size()
    return (dist.get_rank(), size) if size > 1 else None


def gathered_batches(held: list[Any]) -> list[Any]:
    """Every rank's held calibration batches, in rank order, on every rank (``held`` itself
    outside a process group). The data-driven algorithms (activation equalization, bias
    correction, CLE's absorption, AdaRound...) measure what they read: on each rank's own
    shard every rank would equalize and correct differently and end with another model."""
    if distributed_world() is None:
        return held
    device_of = [[t.device if isinstance(t, torch.Tensor) else None for t in batch] for batch in held]
    local = [tuple(t.cpu() if isinstance(t, torch.Tensor) else t for t in batch) for batch in held]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    device = next((d for devices in device_of for d in devices if d is not None), None)
    return [
        tuple(t.to(device) if isinstance(t, torch.Tensor) and device is not None else t for t in batch)
        for part in everyone
        for batch in part
    ]


def merge_observers(quantizers: Sequence[FakeQuantizer]) -> None:
    """Replace each quantizer's observer by the merge of every rank's (in rank order), on
    every rank. All ranks must pass the same quantizers in the same order."""
    if distributed_world() is None or not quantizers:
        return
    states = [q.observer.state_dict() for q in quantizers]
    gathered: list[list[dict[str, object]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, states)
    for index, fq in enumerate(quantizers):
        merged: Observer = make_observer(fq.spec)
        for rank_states in gathered:
            assert rank_states is not None
            merged.merge(Observer.from_state_dict(rank_states[index]))  # type: ignore[arg-type]
        fq.observer = merged
