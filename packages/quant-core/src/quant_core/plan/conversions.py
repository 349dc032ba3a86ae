"""Which nodes the NPU conversions of :mod:`quant_core.conversions` rewrite, found on the
planner's view of a graph.

:func:`find_matches` reads any graph that offers the small :class:`ConversionView`
interface: :func:`float_view` of a :class:`~quant_core.plan.graph.GraphView` (quant-onnx's
float ONNX graph, quant-torch-fx's FX graph) or quant_npu's view of a QDQ graph; each caller
then edits its own graph (:mod:`quant_core.onnx_qdq.conversions` for ONNX). The rules
themselves, their constants and sources are :data:`quant_core.conversions.RULES`.

Example:
    >>> from quant_core.plan.graph import PlanGraph, PlanNode
    >>> nodes = [PlanNode("s", "Sigmoid", ("x",), ("g",)), PlanNode("m", "Mul", ("x", "g"), ("y",)),
    ...          PlanNode("h", "Sigmoid", ("y",), ("z",))]
    >>> view = float_view(PlanGraph(nodes, inputs=("x",), outputs=("z",)))
    >>> [(m.rule, m.node, m.related) for m in find_matches(view, ("silu", "sigmoid"))]
    [('silu', 's', ('m',)), ('sigmoid', 'h', ())]
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import attrs
import numpy as np

from quant_core.conversions import Match, is_nominal_hard_sigmoid, parse_conversions
from quant_core.plan.graph import GraphView, PlanNode


class ConversionView(Protocol):
    """What :func:`find_matches` reads of a graph: compute nodes, who reads a value, and
    whether two tensor names hold the same value (in a QDQ graph two DequantizeLinear
    outputs of one integer tensor do)."""

    @property
    def nodes(self) -> Sequence[PlanNode]: ...

    def readers(self, tensor: str) -> Sequence[PlanNode]:
        """Compute nodes reading ``tensor``'s value."""
        ...

    def same_value(self, a: str, b: str) -> bool: ...

    def constant(self, tensor: str) -> np.ndarray | None: ...

    def producer(self, tensor: str) -> PlanNode | None:
        """The compute node whose output ``tensor`` holds."""
        ...

    def rank(self, tensor: str) -> int | None:
        """``tensor``'s number of axes, None where the graph does not say."""
        ...


@attrs.frozen
class _FloatView:
    graph: GraphView

    @property
    def nodes(self) -> Sequence[PlanNode]:
        return self.graph.nodes

    def readers(self, tensor: str) -> Sequence[PlanNode]:
        return self.graph.consumers(tensor)

    def same_value(self, a: str, b: str) -> bool:
        return a == b

    def constant(self, tensor: str) -> np.ndarray | None:
        return self.graph.constant(tensor)

    def producer(self, tensor: str) -> PlanNode | None:
        return self.graph.producer(tensor)

    def rank(self, tensor: str) -> int | None:
        return None  # the planner's graphs hold no shapes


def float_view(graph: GraphView) -> ConversionView:
    """A :class:`ConversionView` of a float graph (a tensor's readers are its consumers)."""
    return _FloatView(graph)


def silu_muls(view: ConversionView, sigmoid: PlanNode) -> tuple[str, ...] | None:
    """The Mul nodes of ``x * sigmoid(x)`` when every reader of the sigmoid is such a Mul."""
    if not sigmoid.inputs or not sigmoid.outputs:
        return None
    x = sigmoid.inputs[0]
    readers = view.readers(sigmoid.outputs[0])
    muls = []
    for reader in readers:
        if reader.op_type != "Mul" or len(reader.inputs) != 2:
            return None
        others = [t for t in reader.inputs if not view.same_value(t, sigmoid.outputs[0])]
        if len(others) != 1 or not view.same_value(others[0], x):
            return None
        muls.append(reader.name)
    return tuple(muls) or None


def _is_scalar(view: ConversionView, tensor: str, value: float) -> bool:
    """A one-element constant within 2% of ``value`` (an int8 constant of a QDQ graph holds
    sqrt(2) as 90/64)."""
    constant = view.constant(tensor)
    return constant is not None and constant.size == 1 and abs(float(constant.reshape(-1)[0]) - value) <= 0.02 * value


def _sole_reader(view: ConversionView, node: PlanNode, op_type: str) -> PlanNode | None:
    readers = view.readers(node.outputs[0]) if node.outputs else ()
    return readers[0] if len(readers) == 1 and readers[0].op_type == op_type else None


def erf_gelu(view: ConversionView, erf: PlanNode) -> tuple[str, tuple[str, ...]] | None:
    """``(x, the pattern's other nodes)`` when ``erf`` is GELU's
    ``x * 0.5 * (1 + Erf(x / sqrt(2)))`` as exporters write it (``Div`` by sqrt 2 or ``Mul``
    by its inverse; the halving before or after the product)."""
    scaled = view.producer(erf.input(0))
    if scaled is None or len(scaled.inputs) != 2:
        return None
    if (scaled.op_type == "Div" and _is_scalar(view, scaled.input(1), 2**0.5)) or (
        scaled.op_type == "Mul" and _is_scalar(view, scaled.input(1), 0.5**0.5)
    ):
        x = scaled.input(0)
    else:
        return None
    add = _sole_reader(view, erf, "Add")
    if add is None or not any(_is_scalar(view, t, 1.0) for t in add.inputs):
        return None
    product = _sole_reader(view, add, "Mul")
    if product is None:
        return None
    other = next((t for t in product.inputs if not view.same_value(t, add.outputs[0])), "")
    if view.same_value(other, x):  # (x * (1 + erf)) * 0.5
        half = _sole_reader(view, product, "Mul")
        if half is None or not any(_is_scalar(view, t, 0.5) for t in half.inputs):
            return None
        return x, (scaled.name, add.name, product.name, half.name)
    halved = view.producer(other)  # (x * 0.5) * (1 + erf)
    if halved is None or halved.op_type != "Mul" or not any(view.same_value(t, x) for t in halved.inputs):
        return None
    if not any(_is_scalar(view, t, 0.5) for t in halved.inputs):
        return None
    return x, (scaled.name, add.name, halved.name, product.name)


def _spatial_mean(view: ConversionView, node: PlanNode) -> bool:
    """A ReduceMean over axes 2 and 3, keeping them: written ``[2, 3]``, or counted from the
    end (PyTorch's exporter writes ``x.mean((-2, -1), keepdim=True)`` as ``[-2, -1]``) where
    the view knows the input is 4-D."""
    axes = node.attr("axes")
    if axes is None and node.input(1):
        constant = view.constant(node.input(1))
        axes = None if constant is None else constant.reshape(-1).tolist()
    if axes is None or int(node.attr("keepdims", 1)) != 1:
        return False
    if view.rank(node.input(0)) == 4:
        axes = [int(a) % 4 if -4 <= int(a) < 0 else int(a) for a in axes]
    return sorted(int(a) for a in axes) == [2, 3]


def _conv_transpose_convertible(view: ConversionView, node: PlanNode) -> bool:
    weight = view.constant(node.input(1))
    auto_pad = str(node.attr("auto_pad", "NOTSET"))
    return weight is not None and weight.ndim == 4 and auto_pad == "NOTSET" and node.attr("output_shape") is None


def _matches(view: ConversionView, node: PlanNode, rule: str) -> Match | None:
    op = node.op_type
    if not node.standard:
        return None
    if rule in ("silu", "sigmoid") and op == "Sigmoid":
        muls = silu_muls(view, node)
        if (rule == "silu") == (muls is not None):
            return Match(rule, node.name, muls or ())
        return None
    if rule == "sigmoid_tanh" and op == "Sigmoid":
        return Match(rule, node.name)
    if rule == "hard_sigmoid" and op == "HardSigmoid":
        alpha, beta = float(node.attr("alpha", 0.2)), float(node.attr("beta", 0.5))
        return Match(rule, node.name) if is_nominal_hard_sigmoid(alpha, beta) else None
    if rule == "reduce_mean" and op == "ReduceMean":
        return Match(rule, node.name) if _spatial_mean(view, node) else None
    simple = {
        "hard_swish": "HardSwish", "tanh": "Tanh", "gelu": "Gelu", "split": "Split",
        "global_pool": "GlobalAveragePool",
    }  # fmt: skip
    if simple.get(rule) == op:
        return Match(rule, node.name)
    if rule == "gelu" and op == "Erf":
        found = erf_gelu(view, node)
        return None if found is None else Match(rule, node.name, found[1])
    if rule == "conv_transpose" and op == "ConvTranspose" and _conv_transpose_convertible(view, node):
        return Match(rule, node.name)
    return None


def find_matches(view: ConversionView, rules: Iterable[str]) -> list[Match]:
    """Every node the ``rules`` rewrite (in :data:`RULES` order, then graph order; a node
    is matched by one rule at most). See the module example."""
    names = parse_conversions(tuple(rules), "rules")
    found: list[Match] = []
    taken: set[str] = set()
    for rule in names:
        for node in view.nodes:
            if node.name in taken:
                continue
            match = _matches(view, node, rule)
            if match is not None and not taken.intersection(match.related):
                found.append(match)
                taken.update((node.name, *match.related))
    return found
