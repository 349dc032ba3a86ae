"""Activation equalization on any backend: which activations, by how much, and the new
weights (:mod:`quant_algos.activation_equalization` says why it is free where it applies).

The backend supplies its graph (the planner's view), a ``measure`` callback (per-channel
min and max over the calibration samples of the named tensors, channel axis 1) and which
constants it may rewrite; it writes back :attr:`ActivationEqualization.layers` (as it
writes CLE's) and inserts each :class:`ScaleInsertion` as a ``Mul`` by a constant before
the tensor's readers.

Example:
    >>> import numpy as np
    >>> from quant_core.plan.graph import PlanGraph, PlanNode
    >>> from quant_core.presets import get_preset
    >>> c = {"w": np.ones((2, 1, 1, 1), np.float32), "dw": np.ones((2, 1, 3, 3), np.float32)}
    >>> g = PlanGraph([PlanNode("stem", "Conv", ("x", "w"), ("s",)),
    ...                PlanNode("dw", "Conv", ("s", "dw"), ("o",), {"group": 2})],
    ...               inputs=("x",), outputs=("o",), constant=c.get)
    >>> result = plan_activation_equalization(
    ...     g, get_preset("a8w8"), lambda names: {n: (np.zeros(2), np.array([4.0, 1.0])) for n in names},
    ...     lambda n: True)
    >>> result.layers["stem"].weight.ravel().tolist(), result.layers["dw"].weight[:, 0, 0, 0].tolist()
    ([1.0, 4.0], [1.0, 0.25])
    >>> result.report.to_dict()["equalized"][0]["compensated"]
    'into:stem'
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from quant_algos.activation_equalization import (
    EqualizationSite,
    equalization_sites,
    equalizing_scales,
    fold_path,
)
from quant_algos.drivers.cle_chains import LayerRef, Writable, layer_ref
from quant_algos.layer import Layer, scale_inputs, scale_outputs
from quant_core.config import QuantConfig
from quant_core.plan.activation_chains import ActivationChains, find_chains
from quant_core.plan.graph import GraphView
from quant_core.spec import ScaleType

Measure = Callable[[Sequence[str]], Mapping[str, tuple[np.ndarray, np.ndarray]]]
"""Tensor names -> each one's per-channel (min, max) over the calibration samples (axis 1)."""


@attrs.frozen(eq=False)
class ScaleInsertion:
    """A ``Mul(tensor, multiplier)`` (per channel, axis 1) before every reader of ``tensor``,
    a tensor of ``rank`` dimensions (its Conv's weight's)."""

    tensor: str
    multiplier: np.ndarray
    rank: int


@attrs.frozen
class EqualizedActivation:
    """One equalized activation: its site, where the compensating scale went
    (``"into:<Conv>"`` or ``"mul"``), and how far apart its channels' ranges were (largest
    max ``|x|`` over the smallest live one)."""

    side: str
    tensor: str
    layer: str
    compensated: str
    spread: float


@attrs.frozen
class ActivationEqualizationReport:
    """What the pass did.

    Example:
        >>> ActivationEqualizationReport((), ("no site",)).to_dict()
        {'equalized': [], 'notes': ['no site']}
    """

    equalized: tuple[EqualizedActivation, ...]
    notes: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"equalized": [attrs.asdict(e) for e in self.equalized], "notes": list(self.notes)}


@attrs.frozen(eq=False)
class ActivationEqualization:
    """What a backend writes: the changed layers with where they live (as CLE's), the
    ``Mul`` nodes to insert, and the report. ``divided``: tensor -> the per-channel
    divisor (axis 1) its values take in the equalized model, which keeps its name; an
    inserted ``Mul``'s output holds its input's values (as divided) times the multiplier."""

    layers: dict[str, Layer]
    refs: dict[str, LayerRef]
    insertions: tuple[ScaleInsertion, ...]
    report: ActivationEqualizationReport
    divided: Mapping[str, np.ndarray] = attrs.field(factory=dict)


def merged_ranges(
    batches: Iterable[Mapping[str, tuple[np.ndarray, np.ndarray]]],
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each tensor's per-channel (min, max) over batches that give theirs (what a backend's
    ``measure`` returns).

    Example:
        >>> merged_ranges([{"x": (np.array([-1.0]), np.array([2.0]))}, {"x": (np.array([-3.0]), np.array([1.0]))}])
        {'x': (array([-3.]), array([2.]))}
    """
    ranges: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for batch in batches:
        for tensor, (low, high) in batch.items():
            low, high = np.asarray(low, np.float64), np.asarray(high, np.float64)
            if tensor in ranges:
                low, high = np.minimum(ranges[tensor][0], low), np.maximum(ranges[tensor][1], high)
            ranges[tensor] = (low, high)
    return ranges


def site_cost(config: QuantConfig, site: EqualizationSite) -> str | None:
    """Why a per-channel scale at ``site`` would cost precision under ``config`` (a Conv
    involved without per-output-channel float-scale weights, or power-of-two activations,
    under which the chains are quantized step by step), or ``None`` where it is free."""
    for name in _convs(site):
        operator = config.for_node(name, "Conv")
        weight = operator.weight if operator is not None else None
        if weight is None or weight.per_channel_axis is None or weight.scale_type is ScaleType.POWER_OF_TWO:
            return f"{name}: weights not per output channel with a float scale"
        output = operator.output if operator is not None else None
        if output is not None and output.scale_type is ScaleType.POWER_OF_TWO:
            return f"{name}: power-of-two activations (activation chains are quantized there)"
    return None


@attrs.frozen(eq=False)
class EqualizationCandidates:
    """The sites :func:`plan_activation_equalization` may equalize, decided from the graph
    and the formats before anything is measured (a backend may measure them in a pass it
    runs anyway: :meth:`channel_tensors`)."""

    sites: tuple[EqualizationSite, ...]
    refs: dict[str, LayerRef]
    notes: tuple[str, ...]
    chains: ActivationChains
    paths: Mapping[str, tuple[str, ...]] = attrs.field(factory=dict)

    @property
    def measured(self) -> list[str]:
        """The tensors whose per-channel ranges decide the scales."""
        return [site.tensor for site in self.sites]

    def channel_tensors(self) -> list[str]:
        """Every tensor an equalization of these sites may divide per channel, with the
        measured ones: whose per-channel ranges give every range the equalized model can
        have (:attr:`ActivationEqualization.divided`)."""
        names = [*self.measured, *(t for site in self.sites for t in self.paths.get(site.tensor, ()))]
        return list(dict.fromkeys(names))


def equalization_candidates(graph: GraphView, config: QuantConfig, writable: Writable) -> EqualizationCandidates:
    """The sites of ``graph`` whose per-channel scales are free under ``config``'s formats
    and whose Convs can be rewritten; a note for each site left alone."""
    chains = find_chains(graph) if config.transformer_recipe else ActivationChains()
    nodes = {node.name: node for node in graph.nodes}
    notes: list[str] = []
    refs: dict[str, LayerRef] = {}
    sites: list[EqualizationSite] = []
    for site in equalization_sites(graph, chains):
        why = site_cost(config, site)
        if why is None:
            for name in _convs(site):
                ref = refs.get(name) or layer_ref(nodes[name], graph, writable)
                if ref is None:
                    why = f"{name}: its weights are shared or cannot be rewritten"
                    break
                refs[name] = ref
        if why is None:
            sites.append(site)
        else:
            notes.append(f"{site.tensor} ({site.side} of {site.layer}): left alone; {why}")
    paths = {site.tensor: fold_path(graph, site) for site in sites if site.fold is not None}
    return EqualizationCandidates(tuple(sites), refs, tuple(notes), chains, paths)


def plan_activation_equalization(
    graph: GraphView, config: QuantConfig, measure: Measure, writable: Writable
) -> ActivationEqualization:
    """The equalization of ``graph`` under ``config``'s formats (module docstring)."""
    return equalize(equalization_candidates(graph, config, writable), measure)


def equalize(candidates: EqualizationCandidates, measure: Measure) -> ActivationEqualization:
    """The equalization of ``candidates``, with the per-channel ranges ``measure`` gives."""
    notes, refs, chains = list(candidates.notes), candidates.refs, candidates.chains
    if not candidates.sites:
        return ActivationEqualization(
            {}, {}, (), ActivationEqualizationReport((), (*notes, "no activation to equalize"))
        )
    ranges = measure(candidates.measured)
    layers: dict[str, Layer] = {}
    insertions: list[ScaleInsertion] = []
    equalized: list[EqualizedActivation] = []
    divided: dict[str, np.ndarray] = {}

    def divide(tensors: Sequence[str], scales: np.ndarray) -> None:
        for tensor in tensors:
            divided[tensor] = divided[tensor] * scales if tensor in divided else scales

    for site in candidates.sites:
        low, high = (np.asarray(v, np.float64) for v in ranges[site.tensor])
        layer = layers.get(site.layer, refs[site.layer].layer)
        if site.side == "output":
            # Each channel stretched inside the tensor's own range: the Conv computes y / s,
            # and a Mul by s starts the chain.
            scales = equalizing_scales(low, high)
            bound = chains.bounds.get(site.tensor)
            if np.allclose(scales, 1.0) or not _pays_without_the_cut(low, high, scales, bound):
                continue
            layers[site.layer] = scale_outputs(layer, scales)
            insertions.append(ScaleInsertion(site.tensor, scales, layer.weight.ndim))
            divide([site.tensor], scales)
            compensated = "mul"
        else:
            # Every channel's max |x| brought to the largest. A depthwise input is mostly a
            # HardSwish's output, whose channels nearly all reach its minimum (-0.375): inside
            # the tensor's own range they would hardly stretch, and measured, stretching them
            # this far is what pays (PP-OCRv3 at a8w8: 1.5% against 28% of characters misread).
            reach = np.maximum(np.abs(low), np.abs(high))
            scales = equalizing_scales(-reach, reach)
            if np.allclose(scales, 1.0):
                continue
            # Filter c takes s_c (its bias is untouched: the output does not change); the
            # input is divided by s where it is written.
            layers[site.layer] = scale_inputs(layer, scales)
            if site.fold is None:
                insertions.append(ScaleInsertion(site.tensor, 1.0 / scales, layer.weight.ndim))
                compensated = "mul"
            else:
                layers[site.fold] = scale_outputs(layers.get(site.fold, refs[site.fold].layer), scales)
                divide(candidates.paths[site.tensor], scales)
                compensated = f"into:{site.fold}"
        extent = high - low
        live = extent[extent > 0]
        spread = float(live.max() / live.min()) if live.size else 1.0
        equalized.append(EqualizedActivation(site.side, site.tensor, site.layer, compensated, spread))
    return ActivationEqualization(
        layers,
        {name: refs[name] for name in layers},
        tuple(insertions),
        ActivationEqualizationReport(tuple(equalized), tuple(notes)),
        divided,
    )


def _pays_without_the_cut(
    low: np.ndarray, high: np.ndarray, scales: np.ndarray, bound: tuple[float, float] | None
) -> bool:
    """Whether equalizing a chain head beats its saturation cut. The per-channel ``Mul``
    hides the chain's saturation bound from the planner, which then quantizes the whole
    observed range instead of the part the chain tells apart; compared by each channel's
    quantization step relative to the extent the chain tells apart (geometric mean)."""
    if bound is None:
        return True
    lo, hi = bound
    seen_low, seen_high = float(low.min()), float(high.max())
    cut_low, cut_high = max(seen_low, lo), min(seen_high, hi)
    extent = np.minimum(high, hi) - np.maximum(low, lo)
    live = extent > 0
    if not live.any() or cut_high <= cut_low:
        return False
    step_cut = (cut_high - cut_low) / extent[live]
    step_equalized = (seen_high - seen_low) * scales[live] / extent[live]
    return float(np.mean(np.log(step_equalized))) < float(np.mean(np.log(step_cut)))


def _convs(site: EqualizationSite) -> list[str]:
    """The Convs whose weights a site rescales."""
    return sorted({site.layer} | ({site.fold} if site.fold is not None else set()))
