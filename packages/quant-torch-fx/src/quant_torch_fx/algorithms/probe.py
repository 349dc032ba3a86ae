"""Read any tensors of a graph module over held batches: the graph cut down to what
computes them (:func:`probe`), run with the module's own parameters and quantizers, and
a switch that runs a prepared graph as its float model (:func:`float_mode`).

The cut graph shares every submodule, parameter and buffer with the graph it came from,
so a weight the algorithms rewrite is what the next probe computes with; tensors stay
on the model's device.

Example:
    >>> import torch
    >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Tanh()))
    >>> cut = probe(gm, ["_0"])
    >>> [n.op for n in cut.graph.nodes], cut(torch.tensor([-1.0, 2.0]))[0].tolist()
    (['placeholder', 'call_module', 'output'], [0.0, 2.0])
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch.fx import Graph, GraphModule, Node

from quant_core.errors import ModelError
from quant_torch_fx.prepare import activation_quantizers, weight_quantizers

Batch = tuple[Any, ...]
"""One batch of model inputs (already on the model's device)."""


def probe(gm: GraphModule, names: Sequence[str]) -> GraphModule:
    """A graph module computing the FX nodes ``names`` of ``gm`` (a tuple, in that order)
    and nothing downstream of them; it shares ``gm``'s submodules and tensors."""
    graph = Graph()
    env: dict[Node, Node] = {}
    graph.graph_copy(gm.graph, env)
    by_name = {node.name: node for node in gm.graph.nodes}
    missing = [name for name in names if name not in by_name]
    if missing:
        raise ModelError(f"tensors: {missing[0]!r} is not a node of the graph")
    graph.output(tuple(env[by_name[name]] for name in names))
    cut = GraphModule(gm, graph)
    cut.graph.eliminate_dead_code()
    cut.recompile()
    return cut


def sample_count(batch: Batch) -> int:
    return int(next(v for v in batch if isinstance(v, torch.Tensor)).shape[0])


def take_samples(batches: Sequence[Batch], count: int | None) -> list[Batch]:
    """The first ``count`` samples of ``batches`` (all when ``None``), the last batch cut."""
    out: list[Batch] = []
    seen = 0
    for batch in batches:
        if count is not None and seen >= count:
            break
        n = sample_count(batch)
        take = n if count is None else min(n, count - seen)
        out.append(batch if take == n else tuple(v[:take] if isinstance(v, torch.Tensor) else v for v in batch))
        seen += take
    return out


def run_probe(module: GraphModule, batches: Sequence[Batch]) -> Iterator[tuple[torch.Tensor, ...]]:
    """The probe's tensors batch by batch (eval mode, no gradients)."""
    module.eval()
    for batch in batches:
        # Not across the yield: interleaved generators would restore each other's grad mode.
        with torch.no_grad():
            values = tuple(module(*batch))
        yield values


@contextmanager
def float_mode(gm: GraphModule) -> Iterator[GraphModule]:
    """``gm`` with every quantizer passing its tensor through, restored on exit."""
    quantizers = [fq for _k, fq in activation_quantizers(gm)] + [fq for _k, fq in weight_quantizers(gm)]
    states = [(fq.observing, fq.quantizing) for fq in quantizers]
    for fq in quantizers:
        fq.observing, fq.quantizing = False, False
    try:
        yield gm
    finally:
        for fq, (observing, quantizing) in zip(quantizers, states, strict=True):
            fq.observing, fq.quantizing = observing, quantizing


class GraphTensors:
    """The CLE driver's :class:`~quant_algos.drivers.cle.TensorSource` over a float graph
    module: the named tensors (FX node names) batch by batch, as numpy for the driver's
    statistics.

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU()))
        >>> [dict(t)["_0"].tolist() for t in GraphTensors(gm, [(torch.tensor([-1.0, 3.0]),)]).tensors(["_0"])]
        [[0.0, 3.0]]
    """

    def __init__(self, gm: GraphModule, batches: Sequence[Batch]) -> None:
        self.gm = gm
        self.batches = list(batches)

    def tensors(self, names: Sequence[str]) -> Iterator[Mapping[str, np.ndarray]]:
        cut = probe(self.gm, names)
        for values in run_probe(cut, self.batches):
            yield {name: value.detach().float().cpu().numpy() for name, value in zip(names, values, strict=True)}
