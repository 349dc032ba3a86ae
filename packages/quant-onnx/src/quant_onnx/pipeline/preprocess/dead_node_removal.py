"""Remove nodes that no graph output depends on, and initializers / value_info nobody reads."""

from __future__ import annotations

import onnx

from quant_core.onnx_qdq.graph import node_inputs, topological_sort
from quant_onnx.graph_edit import copy_model, remove_nodes


def remove_dead_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Return a copy of `model` without dead nodes, unused initializers and stale value_info.

    Graph inputs are kept even when unused, so the model's interface does not change.
    """
    out = copy_model(model)
    remove_dead_nodes_inplace(out)
    return out


def remove_dead_nodes_inplace(model: onnx.ModelProto) -> int:
    """In-place version; returns the number of nodes plus initializers removed."""
    graph = model.graph
    needed = {o.name for o in graph.output}
    live: list[onnx.NodeProto] = []
    # Walk backwards over a topological order: a node's readers come after it.
    for node in reversed(topological_sort(graph.node)):
        if any(o in needed for o in node.output if o):
            live.append(node)
            needed.update(node_inputs(node))
    live_ids = {id(n) for n in live}
    dead = [n for n in graph.node if id(n) not in live_ids]
    remove_nodes(graph, dead)
    unused = [t for t in graph.initializer if t.name not in needed]
    keep = [t for t in graph.initializer if t.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    # Initializers that were also listed as graph inputs go with them (they were never real inputs).
    gone = {t.name for t in unused}
    inputs = [v for v in graph.input if v.name not in gone]
    del graph.input[:]
    graph.input.extend(inputs)
    produced = {o for n in graph.node for o in n.output} | {v.name for v in graph.input}
    value_info = [vi for vi in graph.value_info if vi.name in produced]
    del graph.value_info[:]
    graph.value_info.extend(value_info)
    return len(dead) + len(unused)
