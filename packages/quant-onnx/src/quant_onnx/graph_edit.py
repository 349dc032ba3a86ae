"""Small graph edits shared by the pre-processing passes, the algorithm passes and the
writer: copies, attribute and initializer replacement, renames, node removal.

Example:
    >>> import numpy as np
    >>> from onnx import TensorProto, helper, numpy_helper
    >>> g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="r")], "g",
    ...     [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
    ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    ...     [numpy_helper.from_array(np.ones(2, np.float32), "w")])
    >>> m = copy_model(helper.make_model(g))
    >>> set_initializer(m.graph, "w", np.zeros(2, np.float32))
    >>> numpy_helper.to_array(m.graph.initializer[0]).tolist()
    [0.0, 0.0]
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import onnx
from onnx import numpy_helper


def copy_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """Deep copy (passes never edit their argument)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def set_attr(node: onnx.NodeProto, name: str, value: object) -> None:
    """Replace (or add) attribute `name` keeping the other attributes in order."""
    for i, attr in enumerate(node.attribute):
        if attr.name == name:
            node.attribute[i].CopyFrom(onnx.helper.make_attribute(name, value))
            return
    node.attribute.append(onnx.helper.make_attribute(name, value))


def rename_inputs(graph: onnx.GraphProto, mapping: Mapping[str, str]) -> None:
    """Make every reader of a tensor in `mapping` read its replacement, subgraph bodies included.

    A subgraph that defines a name locally shadows the outer one and is left alone.
    """
    if not mapping:
        return
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in mapping:
                node.input[i] = mapping[name]
        for attr in node.attribute:
            for sub in [*attr.graphs, *([attr.g] if attr.HasField("g") else [])]:
                local = {v.name for v in sub.input} | {t.name for t in sub.initializer}
                for inner in sub.node:
                    local.update(inner.output)
                inner_map = {k: v for k, v in mapping.items() if k not in local}
                rename_inputs(sub, inner_map)
                for out in sub.output:
                    if out.name in inner_map:
                        out.name = inner_map[out.name]


def rename_tensor(graph: onnx.GraphProto, old: str, new: str) -> None:
    """Rename a node-produced tensor everywhere: its producer, readers and value_info."""
    rename_tensors(graph, {old: new})


def rename_tensors(graph: onnx.GraphProto, mapping: Mapping[str, str]) -> None:
    """rename_tensor for many tensors in one sweep over the graph."""
    if not mapping:
        return
    for node in graph.node:
        for i, name in enumerate(node.output):
            if name in mapping:
                node.output[i] = mapping[name]
    rename_inputs(graph, mapping)
    for vi in graph.value_info:
        if vi.name in mapping:
            vi.name = mapping[vi.name]


def remove_nodes(graph: onnx.GraphProto, nodes: Iterable[onnx.NodeProto]) -> None:
    """Drop the given node objects (identity comparison) keeping the order of the rest."""
    doomed = {id(n) for n in nodes}
    if not doomed:
        return
    keep = [n for n in graph.node if id(n) not in doomed]
    del graph.node[:]
    graph.node.extend(keep)


def set_initializer(
    graph: onnx.GraphProto, name: str, value: np.ndarray | onnx.TensorProto, *, fresh: bool = False
) -> None:
    """Add or replace an initializer called `name` (`fresh=True`: the name is known to be new, skip the search)."""
    tensor = value if isinstance(value, onnx.TensorProto) else numpy_helper.from_array(np.asarray(value), name)
    if tensor.name != name:
        copy = onnx.TensorProto()
        copy.CopyFrom(tensor)
        copy.name = name
        tensor = copy
    if not fresh:
        for i, existing in enumerate(graph.initializer):
            if existing.name == name:
                graph.initializer[i].CopyFrom(tensor)
                return
    graph.initializer.append(tensor)


def drop_value_info(graph: onnx.GraphProto, names: Iterable[str]) -> None:
    """Forget value_info of tensors that no longer exist or changed meaning."""
    doomed = set(names)
    keep = [vi for vi in graph.value_info if vi.name not in doomed]
    del graph.value_info[:]
    graph.value_info.extend(keep)
