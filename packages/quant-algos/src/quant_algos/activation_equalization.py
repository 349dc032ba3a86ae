"""Activation equalization: even out an activation's channels where one per-tensor grid
serves them and a per-channel scale costs nothing (backend-neutral: where, and by how much).

A BN-folded Conv's output channels can span ranges thousands of times apart (PP-OCRv3's
recogniser: 0.002 to 8.9 in one tensor); an 8-bit per-tensor grid then leaves the small
channels a handful of codes. Two places let a per-channel scale ``s`` move without changing
the float function or costing precision anywhere else:

- **output**: a Conv whose output only an activation chain reads
  (:mod:`quant_core.plan.activation_chains`: the scalar affine, HardSwish, SiLU... steps
  between layers, float under every format but power-of-two), or a lone HardSwish,
  HardSigmoid or Sigmoid op. The Conv computes ``y / s`` (its per-output-channel weight
  grid scales along, exactly), and a ``Mul`` by ``s`` starts the chain (with a lone
  activation it makes one), where the values are float anyway;
- **input**: a depthwise Conv's input. Channel ``c`` meets only filter ``c``, so the filter
  takes ``s_c`` on its own per-channel grid; ``1 / s`` goes into the Conv that writes the
  input (its output channels, through Relu-like steps that commute with a positive scale)
  or, where a chain or a lone activation of those writes it, into a ``Mul`` after it.

How far (:func:`equalizing_scales`, chosen by measurement on the PP-OCR recognisers): a
Conv output's channels stretch as far as each goes inside the tensor's own range, which
does not widen; a depthwise input's channels all reach the largest max ``|x|``. A chain
head whose chain saturates (HardSwish below -3) loses the planner's cut of its range at
that bound once a per-channel scale stands in between; it is equalized only where the
channels' quantization steps, relative to what each can tell apart, come out smaller even
so (the driver's check).

Measured (``docs/benchmarks.md``, PP-OCR recognisers, ``a8w8``): PP-OCRv3 from 95% of
characters misread to 1.5%, PP-OCRv4 from 9.9% to 3.6%, in one extra reduction pass.

Example (a Conv, a decomposed HardSwish, a depthwise Conv):
    >>> import numpy as np
    >>> from quant_core.plan.activation_chains import find_chains
    >>> from quant_core.plan.graph import PlanGraph, PlanNode
    >>> c = {"w": np.ones((2, 2, 1, 1), np.float32), "dw": np.ones((2, 1, 3, 3), np.float32),
    ...      "three": np.float32(3.0), "zero": np.float32(0.0), "six": np.float32(6.0)}
    >>> nodes = [PlanNode("conv", "Conv", ("x", "w"), ("y",)), PlanNode("plus3", "Add", ("y", "three"), ("p",)),
    ...          PlanNode("clip", "Clip", ("p", "zero", "six"), ("c",)), PlanNode("prod", "Mul", ("y", "c"), ("h",)),
    ...          PlanNode("div", "Div", ("h", "six"), ("z",)),
    ...          PlanNode("dwconv", "Conv", ("z", "dw"), ("o",), {"group": 2})]
    >>> g = PlanGraph(nodes, inputs=("x",), outputs=("o",), constant=c.get)
    >>> [(s.side, s.tensor, s.layer, s.fold) for s in equalization_sites(g, find_chains(g))]
    [('output', 'y', 'conv', 'conv'), ('input', 'z', 'dwconv', None)]
    >>> equalizing_scales(np.array([-1.0, -0.1, 0.0, 0.0]), np.array([8.0, 2.0, 0.5, 0.0])).tolist()
    [1.0, 0.25, 0.0625, 1.0]
"""

from __future__ import annotations

from typing import Literal

import attrs
import numpy as np

from quant_core.plan.activation_chains import ActivationChains
from quant_core.plan.graph import GraphView, PlanNode, sole_reader
from quant_core.plan.ops import crossed_by_channel_scales

# Activations that are one op and no integer kernel reads: a Mul before or after one joins
# it in a float chain (Relu and Clip are left out: a Conv's integer kernel fuses them, and a
# Mul between the two would add a quantized tensor).
ONE_OP_ACTIVATIONS = frozenset({"HardSwish", "HardSigmoid", "Sigmoid"})

# A channel far below the largest keeps at least this fraction of the largest's scale, so
# that weights divided by ``s`` stay well inside float32.
_MIN_SCALE = 1e-4


@attrs.frozen
class EqualizationSite:
    """One activation to equalize.

    Attributes:
        side: ``"output"``: ``layer`` writes ``tensor`` and an activation chain reads it;
            ``"input"``: ``layer`` (a depthwise Conv) is the one reader of ``tensor``.
        tensor: the activation.
        layer: the Conv whose weights take the scales.
        fold: the Conv whose output channels take ``1 / s`` (``"output"``: ``layer``
            itself; ``"input"``: the Conv writing ``tensor``), or ``None`` where a ``Mul``
            at the end of the chain writing ``tensor`` takes it.
    """

    side: Literal["output", "input"]
    tensor: str
    layer: str
    fold: str | None


def _conv_with_weight(graph: GraphView, node: PlanNode | None) -> bool:
    return (
        node is not None
        and node.standard
        and node.op_type == "Conv"
        and graph.constant(node.input(1)) is not None
        and (not node.input(2) or graph.constant(node.input(2)) is not None)
    )


def is_depthwise(graph: GraphView, node: PlanNode) -> bool:
    """A Conv whose input channel ``c`` meets only filter ``c`` (one filter per group)."""
    weight = graph.constant(node.input(1)) if _conv_with_weight(graph, node) else None
    return weight is not None and weight.ndim >= 3 and weight.shape[1] == 1 and node.attr("group", 1) == weight.shape[0]


def _one_op_activation(node: PlanNode | None) -> bool:
    return node is not None and node.standard and node.op_type in ONE_OP_ACTIVATIONS


def _writing_conv(graph: GraphView, tensor: str) -> PlanNode | None:
    """The Conv writing ``tensor``, through Relu-like steps (each the one reader of the
    tensor before it) that commute with a positive per-channel scale."""
    node = graph.producer(tensor)
    while node is not None and node.standard and len(node.inputs) >= 1:
        if _conv_with_weight(graph, node):
            return node if sole_reader(graph, node.outputs[0]) is not None else None
        if not crossed_by_channel_scales(node, graph.constant) or sole_reader(graph, node.inputs[0]) is None:
            return None
        node = graph.producer(node.inputs[0])
    return None


def fold_path(graph: GraphView, site: EqualizationSite) -> tuple[str, ...]:
    """The tensors an ``"input"`` site with a ``fold`` divides by its scales where they are:
    the fold Conv's output, every Relu-like step's output after it, and the site's tensor
    (empty for other sites).

    Example:
        >>> import numpy as np
        >>> from quant_core.plan.graph import PlanGraph, PlanNode
        >>> c = {"w": np.ones((2, 2, 1, 1), np.float32), "dw": np.ones((2, 1, 3, 3), np.float32)}
        >>> g = PlanGraph([PlanNode("c", "Conv", ("x", "w"), ("y",)), PlanNode("r", "Relu", ("y",), ("z",)),
        ...                PlanNode("d", "Conv", ("z", "dw"), ("o",), {"group": 2})],
        ...               inputs=("x",), outputs=("o",), constant=c.get)
        >>> fold_path(g, EqualizationSite("input", "z", "d", "c"))
        ('y', 'z')
    """
    if site.side != "input" or site.fold is None:
        return ()
    path = [site.tensor]
    node = graph.producer(site.tensor)
    while node is not None and node.name != site.fold:
        path.append(node.inputs[0])
        node = graph.producer(node.inputs[0])
    return tuple(reversed(path))


def equalization_sites(graph: GraphView, chains: ActivationChains) -> list[EqualizationSite]:
    """Where :mod:`activation equalization <quant_algos.activation_equalization>` applies
    in ``graph``, given its activation chains (the module docstring), in graph order. The
    backend still checks the formats: per-output-channel weights on every Conv involved,
    and float chains (no power-of-two activations)."""
    sites: list[EqualizationSite] = []
    for node in graph.nodes:
        if not _conv_with_weight(graph, node) or not node.outputs:
            continue
        x, y = node.input(0), node.outputs[0]
        if is_depthwise(graph, node) and sole_reader(graph, x) is node:
            if x in chains.ends or _one_op_activation(graph.producer(x)):
                sites.append(EqualizationSite("input", x, node.name, None))
            elif (writer := _writing_conv(graph, x)) is not None:
                sites.append(EqualizationSite("input", x, node.name, writer.name))
        chain_head = y in chains.heads or _one_op_activation(sole_reader(graph, y))
        if chain_head and not graph.is_graph_output(y):
            sites.append(EqualizationSite("output", y, node.name, node.name))
    return sites


def equalizing_scales(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Per-channel ``s`` that stretch each channel's ``[low, high]`` (divided by ``s``) as
    far as it goes inside the tensor's own ``[min(low, 0), max(high, 0)]``: no channel's
    resolution drops and the tensor's range does not widen (a wider range would cost the
    channels that set it). Dead channels keep 1; none goes below :data:`_MIN_SCALE`."""
    lo = np.minimum(np.asarray(low, np.float64), 0.0)
    hi = np.maximum(np.asarray(high, np.float64), 0.0)
    top, bottom = float(hi.max(initial=0.0)), float(lo.min(initial=0.0))
    zero = np.zeros_like(hi)
    reach = np.maximum(hi / top if top > 0 else zero, lo / bottom if bottom < 0 else zero)
    return np.where(reach > 0.0, np.maximum(reach, _MIN_SCALE), 1.0)
