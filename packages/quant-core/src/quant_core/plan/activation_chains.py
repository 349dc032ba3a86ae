"""Activation chains: the element-wise steps between two layers that read one activation
and constants only, quantized once at their end instead of after every step.

PP-OCRv4's recogniser (a PP-LCNetV3 backbone) writes each activation between two Convs as
``Mul(s1) -> Add(b1) -> x * Clip(x + 3, 0, 6) / 6 -> Mul(s2) -> Add(b2)``: a scalar affine
before and after a decomposed HardSwish. Quantized op by op, the tensor between the layers
is rounded to 8 bits seven times; no integer kernel reads six of them (onnxruntime runs
these element-wise ops on float data, an NPU fuses them into the layer's activation). With
the chain's internals float, the pretrained recogniser's ``a8w8`` error against the float
reading fell from 11.3% to 9.9% of characters (``docs/benchmarks.md``).

:func:`find_chains` follows, from every float tensor a node writes, the steps that read it
alone (their intermediate tensors read inside the step only, none a graph output):

- **scalar affine**: ``Mul``/``Add``/``Sub``/``Div`` of the tensor by a one-element constant
  (``c / x`` is not affine and ends the chain); by a constant tensor (a per-channel scale),
  a step too, across which no saturation bound is mapped;
- **single activations**: ``Relu``, ``Clip`` with constant bounds, ``HardSigmoid``,
  ``HardSwish``, ``Sigmoid``;
- **gated products** ``x * g(x)``, the gate computed from ``x`` alone: HardSwish as
  ``x * Clip(x + 3, 0, 6) / 6`` (the division before or after the product) or
  ``x * HardSigmoid(x)``, SiLU as ``x * Sigmoid(x)`` and Swish as ``x * Sigmoid(beta * x)``.

The tensors strictly inside a chain of two or more steps, and the constants only chain
steps read, are :attr:`ActivationChains.float_tensors`: float under every format but
power-of-two (an integer-only device runs no float op; there the planner quantizes them as
before). A chain's first tensor is read by the chain alone, so a value beyond the first
saturating step's interval (mapped back through the scalar affine steps before it) changes
nothing downstream: :attr:`ActivationChains.bounds` gives that interval, where the planner
cuts the tensor's range (:class:`~quant_core.plan.planner.RangeBound`).

Example (a Conv, a scalar affine, a decomposed HardSwish, the next Conv):
    >>> import numpy as np
    >>> from quant_core.plan.graph import PlanGraph, PlanNode
    >>> c = {"w": np.ones((2, 2, 1, 1), np.float32), "s": np.float32(2.0), "b": np.float32(1.0),
    ...      "three": np.float32(3.0), "zero": np.float32(0.0), "six": np.float32(6.0)}
    >>> nodes = [PlanNode("conv", "Conv", ("x", "w"), ("y",)), PlanNode("mul", "Mul", ("s", "y"), ("m",)),
    ...          PlanNode("add", "Add", ("m", "b"), ("a",)), PlanNode("plus3", "Add", ("a", "three"), ("p",)),
    ...          PlanNode("clip", "Clip", ("p", "zero", "six"), ("c",)), PlanNode("prod", "Mul", ("a", "c"), ("h",)),
    ...          PlanNode("div", "Div", ("h", "six"), ("z",)), PlanNode("conv2", "Conv", ("z", "w"), ("o",))]
    >>> chains = find_chains(PlanGraph(nodes, inputs=("x",), outputs=("o",), constant=c.get))
    >>> sorted(chains.float_tensors), chains.bounds["y"]
    (['a', 'b', 'c', 'h', 'm', 'p', 's', 'six', 'three', 'zero'], (-2.0, inf))
    >>> sorted(chains.heads), sorted(chains.ends)
    (['y'], ['z'])
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import attrs

from quant_core.plan.graph import GraphView, PlanNode, scalar_constant, sole_reader
from quant_core.plan.ops import clip_bounds, saturation_interval

_AFFINE = frozenset({"Mul", "Add", "Sub", "Div"})
_SINGLE = frozenset({"Relu", "Clip", "HardSigmoid", "HardSwish", "Sigmoid"})
_GATES = frozenset({"Sigmoid", "HardSigmoid", "Relu", "Clip"})
_MAX_STEPS = 64


@attrs.frozen
class _Step:
    output: str
    nodes: tuple[PlanNode, ...]
    internal: tuple[str, ...] = ()
    affine: tuple[float, float] | None = None
    """``(a, b)``: the step computes ``a * x + b``."""
    saturates: tuple[float, float] | None = None
    """The input interval outside which the step's output no longer changes."""


@attrs.frozen
class ActivationChains:
    """What :func:`find_chains` recognised.

    Attributes:
        chains: how many chains of two or more steps were found (a chain inside a longer
            one not counted).
        float_tensors: the tensors inside those chains and the constants only chain
            steps read.
        bounds: chain input -> the interval outside which the chain's output no longer
            changes (only where a step saturates).
        heads: the first tensor of each chain of two or more steps (read by the chain
            alone, quantized where the layer before writes it).
        ends: the last tensor of each such chain (the one the planner quantizes).

    Example:
        >>> ActivationChains().summary()
        ''
    """

    chains: int = 0
    float_tensors: frozenset[str] = frozenset()
    bounds: Mapping[str, tuple[float, float]] = attrs.field(factory=dict)
    heads: frozenset[str] = frozenset()
    ends: frozenset[str] = frozenset()

    def summary(self) -> str:
        """One line for the report; ``""`` when nothing was recognised."""
        if not self.chains:
            return ""
        return (
            f"{self.chains} activation chain{'s' * (self.chains != 1)} between layers: "
            f"{len(self.float_tensors)} internal tensors and constants float, each chain quantized at its end"
        )


def _constant_operand(graph: GraphView, node: PlanNode, x: str) -> str | None:
    """The constant ``node`` combines ``x`` with element-wise (``Mul``/``Add``/``Sub``/``Div``;
    a Div only as ``x / c``), or ``None``."""
    if node.op_type not in _AFFINE or not node.standard or len(node.inputs) != 2 or x not in node.inputs:
        return None
    first = node.inputs[0] == x
    other = node.inputs[1] if first else node.inputs[0]
    if (node.op_type == "Div" and not first) or graph.constant(other) is None:
        return None
    return other


def _affine(graph: GraphView, node: PlanNode, x: str) -> tuple[float, float] | None:
    """``(a, b)`` when ``node`` computes ``a * x + b`` from ``x`` and a scalar constant."""
    operand = _constant_operand(graph, node, x)
    c = None if operand is None else scalar_constant(graph, operand)
    if c is None or not math.isfinite(c):
        return None
    if node.op_type == "Mul":
        return (c, 0.0) if c != 0.0 else None
    if node.op_type == "Add":
        return 1.0, c
    if node.op_type == "Sub":
        return (1.0, -c) if node.inputs[0] == x else (-1.0, c)
    return (1.0 / c, 0.0) if c != 0.0 else None  # Div, as x / c


def _gate_product(graph: GraphView, x: str, readers: list[PlanNode]) -> _Step | None:
    """``x * g(x)``: ``readers`` are a product of ``x`` and a gate computed from ``x``
    alone: ``Sigmoid(x)`` (SiLU), ``HardSigmoid(x)`` or ``Clip(x + 3, 0, 6) / 6``
    (HardSwish), the ``/ 6`` before or after the product."""
    if len(readers) != 2:
        return None
    for product, start in ((readers[0], readers[1]), (readers[1], readers[0])):
        if product.op_type == "Mul" and product.standard and len(product.inputs) == 2:
            found = _gate(graph, x, start, product)
            if found is not None:
                return found
    return None


def _gate(graph: GraphView, x: str, start: PlanNode, product: PlanNode) -> _Step | None:
    """``product = x * gate`` where ``gate`` is computed from ``x`` alone by ``start`` and the
    nodes after it, each the sole reader of the last: scalar affine steps, one ``Sigmoid``,
    ``HardSigmoid``, ``Relu`` or constant-bounds ``Clip``, then scalar scaling. Where the
    gate is 0 beyond an input bound (a HardSigmoid or a Clip/Relu at 0 with no offset
    after it), the product saturates there too."""
    if x not in product.inputs or len(product.inputs) != 2:
        return None
    gate = product.inputs[1] if product.inputs[0] == x else product.inputs[0]
    if gate == x or graph.constant(gate) is not None:
        return None
    nodes: list[PlanNode] = []
    internal: list[str] = []
    a, b = 1.0, 0.0
    zero_below: float | None = None  # the gate is 0 where its nonlinearity's input is below this
    nonlinear = False
    node: PlanNode | None = start
    tensor = x
    while node is not None and node.standard and node.outputs and len(nodes) < 8:
        affine = _affine(graph, node, tensor)
        if affine is not None and not nonlinear:
            a, b = affine[0] * a, affine[0] * b + affine[1]
        elif affine is not None:
            zero_below = zero_below if affine[1] == 0.0 else None
        elif not nonlinear and node.op_type in _GATES and node.input(0) == tensor:
            nonlinear = True
            zero_below = _zero_below(graph, node)
            if node.op_type == "Clip" and clip_bounds(node, graph.constant) is None:
                return None
        else:
            return None
        nodes.append(node)
        tensor = node.outputs[0]
        if tensor == gate:
            break
        internal.append(tensor)
        node = sole_reader(graph, tensor)
    if tensor != gate or not nonlinear or sole_reader(graph, gate) is not product:
        return None
    saturates = None
    if zero_below is not None:
        edge = (zero_below - b) / a
        saturates = (edge, math.inf) if a > 0 else (-math.inf, edge)
    return _Step(product.outputs[0], (*nodes, product), (*internal, gate), saturates=saturates)


def _zero_below(graph: GraphView, node: PlanNode) -> float | None:
    """The input below which ``node`` writes 0 (``None``: nowhere, or not known)."""
    if node.op_type == "Sigmoid":
        return None
    interval = saturation_interval(node, graph.constant)
    if interval is None or interval[0] == -math.inf:
        return None
    if node.op_type == "HardSigmoid":
        return interval[0]
    return interval[0] if interval[0] == 0.0 else None  # Relu, Clip(0, hi)


def _step(graph: GraphView, x: str) -> _Step | None:
    """The step that alone reads ``x``, or ``None``."""
    if graph.is_graph_output(x):
        return None
    readers = list(graph.consumers(x))
    if len(readers) == 2:
        return _gate_product(graph, x, readers)
    if len(readers) != 1 or not readers[0].standard or not readers[0].outputs or not readers[0].outputs[0]:
        return None
    node = readers[0]
    affine = _affine(graph, node, x)
    if affine is not None:
        return _Step(node.outputs[0], (node,), affine=affine)
    if _constant_operand(graph, node, x) is not None:  # a per-channel scale or offset (SmoothQuant's Mul)
        return _Step(node.outputs[0], (node,))
    if node.op_type not in _SINGLE or node.input(0) != x:
        return None
    if node.op_type == "Sigmoid":
        return _Step(node.outputs[0], (node,))
    interval = saturation_interval(node, graph.constant)
    return None if interval is None else _Step(node.outputs[0], (node,), saturates=interval)


def _input_interval(steps: list[_Step]) -> tuple[float, float] | None:
    """The interval of the chain's input outside which its first saturating step (after
    scalar affine steps only) saturates."""
    a, b = 1.0, 0.0
    for step in steps:
        if step.affine is not None:
            a, b = step.affine[0] * a, step.affine[0] * b + step.affine[1]
            continue
        if step.saturates is None:
            return None
        lo, hi = ((s - b) / a for s in step.saturates)
        return (lo, hi) if a > 0 else (hi, lo)
    return None


def find_chains(graph: GraphView) -> ActivationChains:
    """Recognise the activation chains of ``graph`` (see the module docstring)."""
    bounds: dict[str, tuple[float, float]] = {}
    starts: list[tuple[str, list[_Step]]] = []
    for node in graph.nodes:
        for x in node.outputs:
            if not x or not graph.is_float(x) or graph.constant(x) is not None:
                continue
            steps: list[_Step] = []
            tensor = x
            while len(steps) < _MAX_STEPS and (step := _step(graph, tensor)) is not None:
                steps.append(step)
                tensor = step.output
            interval = _input_interval(steps)
            if interval is not None and (interval[0] > -math.inf or interval[1] < math.inf):
                bounds[x] = interval
            if len(steps) >= 2 or any(step.internal for step in steps):
                starts.append((x, steps))
    inside: set[str] = set()
    chain_nodes: set[str] = set()
    for _x, steps in starts:
        inside |= {step.output for step in steps[:-1]} | {t for step in steps for t in step.internal}
        chain_nodes |= {n.name for step in steps for n in step.nodes}
    constants = {
        name
        for node in graph.nodes
        if node.name in chain_nodes
        for name in node.inputs
        if name and graph.constant(name) is not None
    }
    internal = inside | {c for c in constants if {r.name for r in graph.consumers(c)} <= chain_nodes}
    outermost = [(x, steps) for x, steps in starts if x not in inside]
    heads = frozenset(x for x, _ in outermost)
    ends = frozenset(steps[-1].output for _, steps in outermost)
    return ActivationChains(len(outermost), frozenset(internal), bounds, heads, ends)
