"""Cross-layer equalization of a float model, on any backend: what to rescale and why.

:func:`plan_equalization` finds the chains (:mod:`~quant_algos.drivers.cle_chains`),
applies the ReLU6 rule, measures what high-bias absorption needs, and runs the math
(:func:`quant_algos.cle.equalize_chains`). It returns the new weights and biases per
layer and the Clip(0, 6) nodes to turn into Relu; the backend writes them.

The ReLU6 rule: with ``replace_relu6_with_relu`` a Clip(0, 6) inside a chain becomes
Relu (as Quark's ``ReplaceClip6Relu`` does) only where the calibration samples show it
clips nothing (no input above 6, :data:`RELU6_CLIPPED_FRACTION`); elsewhere the
replacement changes the float function (unchecked, it takes EfficientNet-Lite0 from 1.0
to 0.23 top-1 agreement with itself). Without samples every one is replaced and the
report says it was unchecked. High-bias absorption needs each first layer's
per-channel pre-activation mean and standard deviation, measured on the samples; without
them it is skipped and the report says so.

Statistics come from a :class:`TensorSource`: the backend runs its float model over the
calibration samples and yields the named tensors batch by batch.

Example:
    >>> import numpy as np
    >>> from quant_core.algorithm_config import CLEConfig
    >>> from quant_core.plan import PlanGraph, PlanNode
    >>> weights = {"w1": np.array([[[[1.0]]], [[[8.0]]]], np.float32), "w2": np.array([[[[2.0]], [[2.0]]]], np.float32)}
    >>> nodes = [PlanNode("c1", "Conv", ("x", "w1"), ("a",)), PlanNode("r", "Relu", ("a",), ("b",)),
    ...          PlanNode("c2", "Conv", ("b", "w2"), ("y",))]
    >>> result = plan_equalization(PlanGraph(nodes, inputs=("x",), outputs=("y",), constant=weights.get), CLEConfig())
    >>> result.report.chains, [round(float(v), 4) for v in result.layers["c1"].weight.ravel()]
    ((('c1', 'c2'),), [1.4142, 4.0])
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any, Protocol

import attrs
import numpy as np

from quant_algos.cle import equalize_chains, expected_min
from quant_algos.drivers.cle_chains import ChainSearch, LayerRef, Writable, find_chains
from quant_algos.layer import Layer
from quant_core.algorithm_config import CLEConfig
from quant_core.errors import DataError
from quant_core.plan import GraphView

#: A Clip(0, 6) may become Relu when at most this fraction of its calibration inputs exceeds 6:
#: even 1e-4 moved 0.75% of EfficientNet-Lite0's top-1 predictions.
RELU6_CLIPPED_FRACTION = 0.0
# Tensors captured per pass over the samples: bounds one batch's intermediate memory.
TENSORS_PER_PASS = 16


class TensorSource(Protocol):
    """A backend's float model run over the calibration samples."""

    def tensors(self, names: Sequence[str]) -> Iterator[Mapping[str, np.ndarray]]:
        """The named tensors, batch by batch."""
        ...


@attrs.frozen
class CLEReport:
    """What :func:`plan_equalization` decided.

    Attributes:
        chains: equalized chains (node names; pairs and depthwise triples).
        replaced_relu6: Clip(0, 6) nodes to replace by Relu.
        absorbed: first layers whose high bias moves into the next layer.
        steps: equalization sweeps done; converged / max_change as in quant_algos.
        notes: what was skipped and why.

    Example:
        >>> CLEReport((("a", "b"),), (), (), 1, True, 0.0, ()).to_dict()["chains"]
        [['a', 'b']]
    """

    chains: tuple[tuple[str, ...], ...]
    replaced_relu6: tuple[str, ...]
    absorbed: tuple[str, ...]
    steps: int
    converged: bool
    max_change: float
    notes: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (for the quantization report)."""
        return {
            "chains": [list(c) for c in self.chains],
            "replaced_relu6": list(self.replaced_relu6),
            "absorbed": list(self.absorbed),
            "steps": self.steps,
            "converged": self.converged,
            "max_change": self.max_change,
            "notes": list(self.notes),
        }


@attrs.frozen(eq=False)
class Equalization:
    """What a backend writes: the changed layers (``[out, in, ...]`` weights and biases)
    with where they live (``refs``: names, storage layout), and the report."""

    layers: dict[str, Layer]
    refs: dict[str, LayerRef]
    report: CLEReport


def _einsum_spec(ndim: int, axis: int) -> str:
    letters = "abcdefghij"[:ndim]
    return f"{letters},{letters}->{letters[axis]}"


class ChannelMoments:
    """Streaming per-channel mean and standard deviation along ``axis``.

    Example:
        >>> m = ChannelMoments(axis=1)
        >>> m.update(np.array([[0.0, 1.0], [2.0, 1.0]]))
        >>> m.mean().tolist(), m.std().tolist()
        ([1.0, 1.0], [1.0, 0.0])
    """

    def __init__(self, axis: int = 1) -> None:
        self.axis = axis
        self._sum: np.ndarray | None = None
        self._sq: np.ndarray | None = None
        self._count = 0

    def update(self, x: np.ndarray) -> None:
        a = np.asarray(x)
        axis = self.axis % a.ndim
        others = tuple(i for i in range(a.ndim) if i != axis)
        # Sums per channel without moving the (large) tensor around; squares in float64.
        s = a.sum(axis=others, dtype=np.float64)
        sq = np.einsum(_einsum_spec(a.ndim, axis), a, a, dtype=np.float64)
        self._sum = s if self._sum is None else self._sum + s
        self._sq = sq if self._sq is None else self._sq + sq
        self._count += a.size // max(a.shape[axis], 1)

    def mean(self) -> np.ndarray:
        if self._sum is None or not self._count:
            raise DataError("ChannelMoments: no values were accumulated")
        return self._sum / self._count

    def std(self) -> np.ndarray:
        assert self._sq is not None
        var = self._sq / self._count - np.square(self.mean())
        return np.sqrt(np.maximum(var, 0.0))


def _passes(names: Sequence[str]) -> Iterator[list[str]]:
    for start in range(0, len(names), TENSORS_PER_PASS):
        yield list(names[start : start + TENSORS_PER_PASS])


def clipped_fractions(graph: GraphView, clips: Collection[str], source: TensorSource) -> dict[str, float]:
    """Fraction of each Clip(0, 6) node's input values above 6 over the samples."""
    inputs = {node.name: node.inputs[0] for node in graph.nodes if node.name in clips}
    names = sorted(inputs)
    above = dict.fromkeys(names, 0)
    total = dict.fromkeys(names, 0)
    for chunk in _passes(names):
        for values in source.tensors([inputs[n] for n in chunk]):
            for name in chunk:
                value = values[inputs[name]]
                above[name] += int(np.count_nonzero(value > 6.0))
                total[name] += int(value.size)
    return {name: above[name] / max(total[name], 1) for name in names}


def _pre_activation_minima(refs: Sequence[LayerRef], source: TensorSource) -> dict[str, np.ndarray]:
    """``mean - 3 std`` per output channel of each layer's output (quant_algos.expected_min)."""
    out: dict[str, np.ndarray] = {}
    by_tensor = {ref.node.outputs[0]: ref for ref in refs}
    for chunk in _passes(list(by_tensor)):
        moments = {t: ChannelMoments(axis=1 if by_tensor[t].family == "conv" else -1) for t in chunk}
        for values in source.tensors(chunk):
            for tensor in chunk:
                moments[tensor].update(values[tensor])
        for tensor in chunk:
            out[by_tensor[tensor].node.name] = expected_min(moments[tensor].mean(), moments[tensor].std())
    return out


def plan_equalization(
    graph: GraphView,
    config: CLEConfig,
    source: TensorSource | None = None,
    *,
    writable: Writable | None = None,
) -> Equalization:
    """Decide CLE for ``graph`` (a float model, BatchNorm folded) under ``config``; see the
    module docstring. ``source``: the calibration samples (``None``: no ReLU6 check, no
    high-bias absorption). ``writable``: constants the backend can rewrite."""
    notes: list[str] = []
    replace: bool | set[str] = config.replace_relu6_with_relu
    if config.replace_relu6_with_relu:
        candidates = sorted({n for link in find_chains(graph, True, writable).links.values() for n in link.relu6})
        if source is None:
            notes.append("Clip(0, 6) replaced by Relu unchecked: no calibration data to check what they clip")
        elif candidates:
            fractions = clipped_fractions(graph, candidates, source)
            replace = {name for name, f in fractions.items() if f <= RELU6_CLIPPED_FRACTION}
            kept = sorted((f, name) for name, f in fractions.items() if f > RELU6_CLIPPED_FRACTION)
            if kept:
                worst = ", ".join(f"{name} ({f:.2%})" for f, name in kept[::-1][:5])
                notes.append(
                    f"kept {len(kept)} Clip(0, 6) of {len(candidates)}: they clip calibration inputs above 6 "
                    f"(Relu would change the float function), e.g. {worst}"
                )
    search: ChainSearch = find_chains(graph, replace, writable)
    if not search.chains:
        notes.append("no equalizable chains found")
        return Equalization({}, {}, CLEReport((), (), (), 0, True, 0.0, tuple(notes)))
    in_chains = {name for chain in search.chains for name in chain}
    expected_mins: dict[str, np.ndarray] = {}
    if config.absorb_high_bias:
        firsts = [
            search.layers[link.first]
            for link in search.links.values()
            if link.absorbable and link.first in in_chains and search.layers[link.first].layer.bias is not None
        ]
        if source is None:
            notes.append("high-bias absorption skipped: no calibration data given")
        elif firsts:
            expected_mins = _pre_activation_minima(firsts, source)
    layers = {name: search.layers[name].layer for name in in_chains}
    result = equalize_chains(layers, search.chains, config, expected_mins or None)
    replaced = sorted({name for chain in search.chains for a in chain[:-1] for name in search.links[a].relu6})
    changed = {name: layer for name, layer in result.layers.items() if layer is not layers[name]}
    absorbed = tuple(name for name, c in result.absorbed.items() if np.any(np.asarray(c) > 0))
    report = CLEReport(
        chains=tuple(search.chains),
        replaced_relu6=tuple(replaced),
        absorbed=absorbed,
        steps=result.steps,
        converged=bool(result.converged),
        max_change=float(result.max_change),
        notes=tuple(notes),
    )
    return Equalization(changed, {name: search.layers[name] for name in changed}, report)
