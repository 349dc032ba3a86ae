"""Turn main-graph Constant nodes into initializers (quantizers only see weights in initializers)."""

from __future__ import annotations

import onnx
from onnx import numpy_helper

from quant_core.onnx_qdq.graph import constant_node_value, is_default_domain
from quant_onnx.graph_edit import copy_model, remove_nodes


def constants_to_initializers(model: onnx.ModelProto) -> onnx.ModelProto:
    """Return a copy of `model` whose Constant nodes are initializers of the same name.

    Constants that are graph outputs stay nodes (an initializer cannot be a graph output everywhere).
    """
    out = copy_model(model)
    constants_to_initializers_inplace(out)
    return out


def constants_to_initializers_inplace(model: onnx.ModelProto) -> int:
    """In-place version; returns the number of Constant nodes converted."""
    graph = model.graph
    outputs = {o.name for o in graph.output}
    taken = {t.name for t in graph.initializer}
    doomed = []
    for node in graph.node:
        if node.op_type != "Constant" or not is_default_domain(node):
            continue
        name = node.output[0]
        if name in outputs or name in taken:
            continue
        tensor = _tensor_of(node)
        if tensor is None:
            continue
        tensor.name = name
        graph.initializer.append(tensor)
        taken.add(name)
        doomed.append(node)
    remove_nodes(graph, doomed)
    return len(doomed)


def _tensor_of(node: onnx.NodeProto) -> onnx.TensorProto | None:
    for attr in node.attribute:
        if attr.name == "value":
            # Copy the TensorProto itself so exotic dtypes (bfloat16, float8) survive untouched.
            tensor = onnx.TensorProto()
            tensor.CopyFrom(attr.t)
            return tensor
    value = constant_node_value(node)
    if value is None or value.dtype == object:
        return None
    return numpy_helper.from_array(value)
