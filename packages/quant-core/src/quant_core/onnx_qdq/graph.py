"""Read-only index over an ONNX graph: producers, consumers, constants, shapes, fresh names.

The index is a snapshot: passes that edit the graph build a new index afterwards.

Example:
    >>> import numpy as np
    >>> from onnx import TensorProto, helper, numpy_helper
    >>> w = numpy_helper.from_array(np.ones((2, 2), np.float32), "w")
    >>> x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2])
    >>> y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])
    >>> g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g", [x], [y], [w])
    >>> idx = GraphIndex(g)
    >>> idx.producer("y").name, [n.name for n in idx.consumers("w")], idx.constant("w").shape
    ('mm', ['mm'], (2, 2))
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import onnx

from quant_core.onnx_qdq.tensor_data import to_array, uses_external_data
from quant_core.plan import PlanGraph, PlanNode

DEFAULT_DOMAINS = ("", "ai.onnx")
"""Names of the default ONNX operator domain."""


def is_default_domain(node: onnx.NodeProto) -> bool:
    """Whether ``node`` is a standard ONNX op (not a custom or com.microsoft one)."""
    return node.domain in DEFAULT_DOMAINS


Dim = int | str | None


def node_attribute(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    """Python value of ``node``'s attribute ``name`` (``onnx.helper.get_attribute_value``:
    ints, floats, bytes, lists...), or ``default`` when the node does not set it.

    Example:
        >>> node_attribute(onnx.helper.make_node("Gemm", ["a", "b"], ["c"], transB=1), "transB", 0)
        1
    """
    for attribute in node.attribute:
        if attribute.name == name:
            return onnx.helper.get_attribute_value(attribute)
    return default


def int_attribute(node: onnx.NodeProto, name: str, default: int) -> int:
    """An integer attribute (``group``, ``axis``...), or ``default``.

    Example:
        >>> int_attribute(onnx.helper.make_node("Conv", ["x", "w"], ["y"], group=4), "group", 1)
        4
    """
    value = node_attribute(node, name, default)
    return int(value) if isinstance(value, int | float) else default


def float_attribute(node: onnx.NodeProto, name: str, default: float) -> float:
    """A float attribute (``alpha``, ``beta``...), or ``default``."""
    value = node_attribute(node, name, default)
    return float(value) if isinstance(value, int | float) else default


def str_attribute(node: onnx.NodeProto, name: str, default: str) -> str:
    """A string attribute (``mode``, ``auto_pad``...) decoded, or ``default``.

    Example:
        >>> str_attribute(onnx.helper.make_node("Conv", ["x", "w"], ["y"], auto_pad="SAME_UPPER"), "auto_pad", "NOTSET")
        'SAME_UPPER'
    """
    value = node_attribute(node, name, default)
    return value.decode() if isinstance(value, bytes) else str(value)


def int_list(node: onnx.NodeProto, name: str, default: list[int] | None = None) -> list[int]:
    """An integer-list attribute (``kernel_shape``, ``strides``...), or ``default`` (empty)."""
    value = node_attribute(node, name, None)
    return [int(v) for v in value] if isinstance(value, list | tuple) else list(default or [])


def node_label(node: onnx.NodeProto) -> str:
    """The node's name, or its first output when it has none (for messages)."""
    return node.name or (node.output[0] if node.output else node.op_type)


def subgraph_inputs(node: onnx.NodeProto) -> set[str]:
    """Names a node's subgraphs (If/Loop/Scan bodies) read from the enclosing scope."""
    names: set[str] = set()
    for attr in node.attribute:
        graphs = list(attr.graphs) + ([attr.g] if attr.HasField("g") else [])
        for sub in graphs:
            local = {i.name for i in sub.input} | {t.name for t in sub.initializer}
            for inner in sub.node:
                local.update(inner.output)
            for inner in sub.node:
                names.update(n for n in inner.input if n and n not in local)
                names.update(n for n in subgraph_inputs(inner) if n not in local)
            names.update(o.name for o in sub.output if o.name not in local)
    return names


def node_inputs(node: onnx.NodeProto) -> list[str]:
    """Explicit non-empty inputs plus implicit subgraph inputs, in a stable order."""
    explicit = [n for n in node.input if n]
    implicit = sorted(subgraph_inputs(node) - set(explicit))
    return explicit + implicit


def constant_node_value(node: onnx.NodeProto) -> np.ndarray | None:
    """Value of a Constant node (any of its value attributes), or None for sparse/unknown forms."""
    if node.op_type != "Constant" or not is_default_domain(node):
        return None
    for attr in node.attribute:
        if attr.name == "value":
            return to_array(attr.t)
        if attr.name == "value_float":
            return np.array(attr.f, dtype=np.float32)
        if attr.name == "value_floats":
            return np.array(list(attr.floats), dtype=np.float32)
        if attr.name == "value_int":
            return np.array(attr.i, dtype=np.int64)
        if attr.name == "value_ints":
            return np.array(list(attr.ints), dtype=np.int64)
        if attr.name == "value_string":
            return np.array(attr.s.decode("utf-8"), dtype=object)
        if attr.name == "value_strings":
            return np.array([s.decode("utf-8") for s in attr.strings], dtype=object)
    return None


class GraphIndex:
    """Lookup tables over one GraphProto (main graph; subgraph reads count as consumers).

    Example:
        >>> from onnx import TensorProto, helper
        >>> x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])
        >>> y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])
        >>> g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="r")], "g", [x], [y])
        >>> idx = GraphIndex(g)
        >>> idx.shape("x"), idx.is_graph_output("y"), idx.unique_name("r")
        ([1, 3], True, 'r_1')
    """

    def __init__(self, graph: onnx.GraphProto, value_info: Iterable[onnx.ValueInfoProto] = ()) -> None:
        self.graph = graph
        self._initializers = {t.name: t for t in graph.initializer}
        self._producers: dict[str, onnx.NodeProto] = {}
        self._consumers: dict[str, list[onnx.NodeProto]] = {}
        self._names: set[str] = set()
        for node in graph.node:
            self._names.add(node.name)
            for out in node.output:
                if out:
                    self._producers[out] = node
                    self._names.add(out)
            for name in node_inputs(node):
                self._consumers.setdefault(name, []).append(node)
        self._graph_inputs = {v.name for v in graph.input}
        self._graph_outputs = {v.name for v in graph.output}
        self._value_info: dict[str, onnx.ValueInfoProto] = {}
        for vi in [*graph.input, *graph.output, *graph.value_info, *value_info]:
            self._value_info.setdefault(vi.name, vi)
        self._names.update(self._initializers, self._graph_inputs, self._graph_outputs, self._value_info)
        self._constant_cache: dict[str, np.ndarray | None] = {}

    # --- structure -------------------------------------------------------------------------
    def producer(self, tensor: str) -> onnx.NodeProto | None:
        """Node writing `tensor`, or None for graph inputs and initializers."""
        return self._producers.get(tensor)

    def consumers(self, tensor: str) -> list[onnx.NodeProto]:
        """Nodes reading `tensor` (in graph order; a node reading it twice appears once)."""
        return list(self._consumers.get(tensor, []))

    def is_graph_output(self, tensor: str) -> bool:
        return tensor in self._graph_outputs

    def is_graph_input(self, tensor: str) -> bool:
        """True for real (fed) inputs; initializers also listed as graph inputs count as constants."""
        return tensor in self._graph_inputs and tensor not in self._initializers

    def sole_consumer(self, tensor: str) -> onnx.NodeProto | None:
        """The only node reading ``tensor`` (``None`` if several, none, or it is a graph output)."""
        consumers = self._consumers.get(tensor, [])
        if len(consumers) != 1 or tensor in self._graph_outputs:
            return None
        return consumers[0]

    def used(self, tensor: str) -> bool:
        """True when a node or the graph output reads `tensor`."""
        return bool(self._consumers.get(tensor)) or tensor in self._graph_outputs

    def topological_order(self) -> list[onnx.NodeProto]:
        """Nodes sorted so that every node comes after its producers (stable w.r.t. graph order)."""
        return topological_sort(self.graph.node, available=self._initializers.keys() | self._graph_inputs)

    # --- constants --------------------------------------------------------------------------
    def initializer_proto(self, name: str) -> onnx.TensorProto | None:
        return self._initializers.get(name)

    def constant(self, tensor: str) -> np.ndarray | None:
        """Value of an initializer or Constant-node output; None if computed at run time or fed.

        An initializer that is also a graph input counts as a constant (old exporters list weights as inputs).
        """
        if tensor in self._constant_cache:
            return self._constant_cache[tensor]
        value: np.ndarray | None = None
        if tensor in self._initializers:
            initializer = self._initializers[tensor]
            if uses_external_data(initializer):  # a view of its file: read again rather than held
                return to_array(initializer)
            value = to_array(initializer)
        else:
            node = self._producers.get(tensor)
            if node is not None and node.op_type == "Constant":
                value = constant_node_value(node)
        self._constant_cache[tensor] = value
        return value

    # Alias named in the module map.
    initializer = constant

    def is_constant(self, tensor: str) -> bool:
        """True for the empty name (omitted optional input) and for any constant tensor."""
        if not tensor:
            return True
        if tensor in self._initializers:
            return True
        node = self._producers.get(tensor)
        return node is not None and node.op_type == "Constant" and constant_node_value(node) is not None

    # --- value info ---------------------------------------------------------------------------
    def value_info(self, tensor: str) -> onnx.ValueInfoProto | None:
        return self._value_info.get(tensor)

    def elem_type(self, tensor: str) -> int | None:
        """onnx.TensorProto data type of `tensor` (0/None when unknown)."""
        if tensor in self._initializers:
            return int(self._initializers[tensor].data_type)
        vi = self._value_info.get(tensor)
        if vi is None or not vi.type.HasField("tensor_type"):
            return None
        return int(vi.type.tensor_type.elem_type) or None

    def dtype(self, tensor: str) -> np.dtype | None:
        """numpy dtype of `tensor`, or None when unknown."""
        elem = self.elem_type(tensor)
        return None if elem is None else np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem))

    def shape(self, tensor: str) -> list[Dim] | None:
        """Dims of `tensor`: int for fixed, str for symbolic, None for unknown; None if rank unknown."""
        if tensor in self._initializers:
            return [int(d) for d in self._initializers[tensor].dims]
        vi = self._value_info.get(tensor)
        if vi is None:
            return None
        return value_info_shape(vi)

    # --- names --------------------------------------------------------------------------------
    def unique_name(self, prefix: str) -> str:
        """A tensor/node name not used in the graph, derived from `prefix` (prefix, prefix_1, ...).

        Reserves the name so successive calls give distinct names.
        """
        name = prefix
        counter = 0
        while name in self._names or not name:
            counter += 1
            name = f"{prefix}_{counter}"
        self._names.add(name)
        return name


def value_info_shape(vi: onnx.ValueInfoProto) -> list[Dim] | None:
    """Dims of a tensor ValueInfoProto (int, symbolic str, or None) or None when the rank is unknown."""
    if not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape"):
        return None
    dims: list[Dim] = []
    for d in vi.type.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param"):
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return dims


def data_fits_input(given: np.dtype, expected: np.dtype) -> bool:
    """Whether data of dtype ``given`` may feed a model input of dtype ``expected``: the same
    kind (float64 into float32 is fine), or integers into an integer input (range-checked by
    the caller). Integers or bools into a float input are refused: uint8 pixels without their
    normalisation, labels or masks, far more often than the data meant.

    Example:
        >>> data_fits_input(np.dtype("float64"), np.dtype("float32")), data_fits_input(np.dtype("uint8"), np.dtype("float32"))
        (True, False)
    """
    return given.kind == expected.kind or (given.kind in "iu" and expected.kind in "iu")


def topological_sort(nodes: Iterable[onnx.NodeProto], available: Iterable[str] = ()) -> list[onnx.NodeProto]:
    """Kahn's algorithm, stable: among ready nodes the one earliest in the input order goes first.

    Nodes whose inputs are never produced (graph inputs not listed in `available`) are still emitted,
    so an incomplete list never loses nodes; cycles are appended in their original order.
    """
    node_list = list(nodes)
    produced_by: dict[str, int] = {}
    for i, node in enumerate(node_list):
        for out in node.output:
            if out:
                produced_by[out] = i
    known = set(available)
    deps: list[set[int]] = []
    users: dict[int, list[int]] = {}
    for i, node in enumerate(node_list):
        d = {produced_by[n] for n in node_inputs(node) if n in produced_by and n not in known and produced_by[n] != i}
        deps.append(d)
        for j in d:
            users.setdefault(j, []).append(i)
    ready = [i for i, d in enumerate(deps) if not d]
    heapq.heapify(ready)
    order: list[int] = []
    remaining = [len(d) for d in deps]
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for u in users.get(i, []):
            remaining[u] -= 1
            if remaining[u] == 0:
                heapq.heappush(ready, u)
    if len(order) < len(node_list):
        seen = set(order)
        order.extend(i for i in range(len(node_list)) if i not in seen)
    return [node_list[i] for i in order]


def iter_all_tensor_names(graph: onnx.GraphProto) -> Iterator[str]:
    """Every name defined or used in the main graph (for uniqueness checks)."""
    for node in graph.node:
        yield from (n for n in node.input if n)
        yield from (n for n in node.output if n)
    yield from (t.name for t in graph.initializer)
    yield from (v.name for v in graph.input)
    yield from (v.name for v in graph.output)


def _decode(value: Any) -> Any:
    if isinstance(value, onnx.TensorProto):  # ConstantOfShape's fill, Constant's value
        return to_array(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, list):
        return tuple(_decode(v) for v in value)
    return value


def plan_node(node: onnx.NodeProto) -> PlanNode:
    """``node`` in the planner's vocabulary (subgraph attributes are left out; the tensors
    a subgraph reads become implicit inputs).

    Example:
        >>> plan_node(onnx.helper.make_node("Resize", ["x", "", "s"], ["y"], name="up", mode="cubic")).attr("mode")
        'cubic'
    """
    attributes = {
        a.name: _decode(onnx.helper.get_attribute_value(a))
        for a in node.attribute
        if a.type not in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
    }
    explicit = list(node.input)
    implicit = node_inputs(node)[len([n for n in explicit if n]) :]
    return PlanNode(
        node.name,
        node.op_type,
        tuple(explicit),
        tuple(node.output),
        attributes,
        standard=is_default_domain(node),
        implicit_inputs=tuple(implicit),
    )


def plan_graph(model: onnx.ModelProto, index: GraphIndex | None = None) -> PlanGraph:
    """``model``'s main graph as the planner's :class:`~quant_core.plan.PlanGraph` (graph
    order, which ONNX requires to be topological). Tensors whose element type ``index``
    (default: the model's own types) knows and is not float are marked non-float; a caller
    that plans quantization passes an index completed by shape inference.

    Example:
        >>> g = onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"], name="r")], "g",
        ...     [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
        ...     [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])])
        >>> [n.name for n in plan_graph(onnx.helper.make_model(g)).consumers("x")]
        ['r']
    """
    index = GraphIndex(model.graph) if index is None else index
    graph = model.graph
    names = {name for node in graph.node for name in (*node.input, *node.output) if name}
    names |= {v.name for v in graph.input} | {t.name for t in graph.initializer}
    non_float = {name for name in names if (index.elem_type(name) or onnx.TensorProto.FLOAT) != onnx.TensorProto.FLOAT}
    inputs = [v.name for v in graph.input if index.is_graph_input(v.name)]
    return PlanGraph(
        [plan_node(node) for node in graph.node],
        inputs=inputs,
        outputs=[v.name for v in graph.output],
        constant=index.constant,
        non_float=non_float,
    )
