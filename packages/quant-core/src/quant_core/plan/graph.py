"""The graph the planner reads, whatever backend it came from.

A backend maps its own graph (an ONNX ``ModelProto``, a ``torch.export`` FX graph) onto
:class:`PlanNode` s named with ONNX operator names, the vocabulary a config's
``op_type_overrides`` uses, so one config file means the same thing on every backend.
:class:`GraphView` is all the planner asks of the result; :class:`PlanGraph` implements
it from a node list, which is what the backends build.

Example:
    >>> import numpy as np
    >>> w = np.ones((4, 3, 1, 1), np.float32)
    >>> graph = PlanGraph(
    ...     [PlanNode("conv", "Conv", ("x", "w"), ("c",)), PlanNode("relu", "Relu", ("c",), ("y",))],
    ...     inputs=("x",), outputs=("y",), constant={"w": w}.get)
    >>> graph.producer("c").name, [n.name for n in graph.consumers("c")], graph.constant("w").shape
    ('conv', ['relu'], (4, 3, 1, 1))
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, Protocol

import attrs
import numpy as np

from quant_core.errors import ModelError

ConstantLookup = Callable[[str], "np.ndarray | None"]
"""Tensor name -> its constant value, or ``None`` when it is computed or fed at run time."""


def _frozen_mapping(value: Mapping[str, Any]) -> Mapping[str, Any]:
    return dict(value)


def _names(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


@attrs.frozen
class PlanNode:
    """One operation, in the ONNX operator vocabulary.

    Args:
        name: unique node name (config name globs match it).
        op_type: an ONNX operator name (``"Conv"``, ``"Add"``, ``"Concat"``...).
        inputs: ordered input tensor names; ``""`` for an omitted optional input.
        outputs: ordered output tensor names.
        attributes: ONNX attribute names and values (strings as ``str``, lists as tuples).
        standard: ``False`` for an op outside the ONNX vocabulary (a custom domain): no
            policy applies and it stays float.
        implicit_inputs: tensors read without being listed as inputs (the bodies of
            ONNX ``If``/``Loop``): they count as consumers.

    Example:
        >>> PlanNode("fc", "Gemm", ("x", "w"), ("y",), {"transB": 1}).attr("transB", 0)
        1
    """

    name: str
    op_type: str
    inputs: tuple[str, ...] = attrs.field(converter=_names)
    outputs: tuple[str, ...] = attrs.field(converter=_names)
    attributes: Mapping[str, Any] = attrs.field(factory=dict, converter=_frozen_mapping)
    standard: bool = True
    implicit_inputs: tuple[str, ...] = attrs.field(default=(), converter=_names)

    def attr(self, name: str, default: Any = None) -> Any:
        """Attribute ``name``, or ``default`` when the node does not set it."""
        return self.attributes.get(name, default)

    def input(self, index: int) -> str:
        """Input ``index``, or ``""`` when the node has fewer inputs (an omitted optional one)."""
        return self.inputs[index] if index < len(self.inputs) else ""


class GraphView(Protocol):
    """What the planner (and graph-level algorithms such as CLE's chain search) read."""

    @property
    def nodes(self) -> Sequence[PlanNode]:
        """Every node, in topological order."""
        ...

    def constant(self, tensor: str) -> np.ndarray | None:
        """The value of a constant tensor (weights, initializers), else ``None``."""
        ...

    def is_float(self, tensor: str) -> bool:
        """True for float tensors and tensors of unknown type: integer tensors (shapes,
        indices) are never quantized."""
        ...

    def is_graph_input(self, tensor: str) -> bool: ...

    def is_graph_output(self, tensor: str) -> bool: ...

    def producer(self, tensor: str) -> PlanNode | None: ...

    def consumers(self, tensor: str) -> Sequence[PlanNode]:
        """Nodes reading ``tensor`` (explicitly or implicitly), each once, in graph order."""
        ...


def _no_constants(_tensor: str) -> None:
    return None


class PlanGraph:
    """A :class:`GraphView` over a list of nodes in topological order.

    Args:
        nodes: the nodes, producers before consumers.
        inputs: tensors fed at run time.
        outputs: the graph's outputs.
        constant: constant lookup (weights); called lazily and cached (``None``: no constants).
        non_float: tensors known to hold integers or booleans.

    Example:
        >>> g = PlanGraph([PlanNode("s", "Shape", ("x",), ("n",))], inputs=("x",), outputs=("n",), non_float={"n"})
        >>> g.is_float("x"), g.is_float("n"), g.is_graph_output("n")
        (True, False, True)
    """

    def __init__(
        self,
        nodes: Sequence[PlanNode],
        *,
        inputs: Collection[str],
        outputs: Collection[str],
        constant: ConstantLookup | None = None,
        non_float: Collection[str] = (),
    ) -> None:
        self._nodes = tuple(nodes)
        self._inputs = frozenset(inputs)
        self._outputs = frozenset(outputs)
        self._constant = constant or _no_constants
        self._cache: dict[str, np.ndarray | None] = {}
        self._non_float = frozenset(non_float)
        self._producers: dict[str, PlanNode] = {}
        self._consumers: dict[str, list[PlanNode]] = {}
        names: set[str] = set()
        for node in self._nodes:
            if node.name in names:
                raise ModelError(
                    f"node {node.name!r} ({node.op_type}): the name is used twice; nodes need unique names"
                )
            names.add(node.name)
            for out in node.outputs:
                if out:
                    self._producers[out] = node
            for tensor in dict.fromkeys((*node.inputs, *node.implicit_inputs)):
                if tensor:
                    self._consumers.setdefault(tensor, []).append(node)

    @property
    def nodes(self) -> Sequence[PlanNode]:
        return self._nodes

    def constant(self, tensor: str) -> np.ndarray | None:
        if tensor not in self._cache:
            self._cache[tensor] = self._constant(tensor) if tensor else None
        return self._cache[tensor]

    def is_float(self, tensor: str) -> bool:
        return tensor not in self._non_float

    def is_graph_input(self, tensor: str) -> bool:
        return tensor in self._inputs

    def is_graph_output(self, tensor: str) -> bool:
        return tensor in self._outputs

    def producer(self, tensor: str) -> PlanNode | None:
        return self._producers.get(tensor)

    def consumers(self, tensor: str) -> Sequence[PlanNode]:
        return tuple(self._consumers.get(tensor, ()))


def scalar_constant(graph: GraphView, tensor: str) -> float | None:
    """The value of ``tensor`` when it is a one-element constant, else ``None``.

    Example:
        >>> g = PlanGraph([], inputs=(), outputs=(), constant={"k": np.float32([2.5]), "v": np.ones(3)}.get)
        >>> scalar_constant(g, "k"), scalar_constant(g, "v"), scalar_constant(g, "")
        (2.5, None, None)
    """
    value = graph.constant(tensor) if tensor else None
    if value is None or np.size(value) != 1:
        return None
    return float(np.asarray(value).reshape(-1)[0])


def uniform_value(graph: GraphView, tensor: str) -> float | None:
    """The one value every element of ``tensor`` holds, where the graph says so: a
    one-element constant (:func:`scalar_constant`), or the fill of a ``ConstantOfShape``
    (0 when it sets none: ``zeros_like`` of a mask), else ``None``.

    Example:
        >>> g = PlanGraph([PlanNode("z", "ConstantOfShape", ("s",), ("zeros",))], inputs=("s",), outputs=("zeros",))
        >>> uniform_value(g, "zeros"), uniform_value(g, "s")
        (0.0, None)
    """
    value = scalar_constant(graph, tensor)
    if value is not None or not tensor:
        return value
    producer = graph.producer(tensor)
    if producer is None or producer.op_type != "ConstantOfShape":
        return None
    fill = np.asarray(producer.attr("value", 0.0), np.float64)
    return float(fill.reshape(-1)[0]) if fill.size == 1 else None


def sole_reader(graph: GraphView, tensor: str) -> PlanNode | None:
    """The one node reading ``tensor``, or ``None`` when more or none read it or it is a
    graph output (something outside the graph reads it too).

    Example:
        >>> g = PlanGraph([PlanNode("r", "Relu", ("x",), ("y",))], inputs=("x",), outputs=("y",))
        >>> sole_reader(g, "x").name, sole_reader(g, "y")
        ('r', None)
    """
    readers = graph.consumers(tensor)
    if len(readers) != 1 or graph.is_graph_output(tensor):
        return None
    return readers[0]
