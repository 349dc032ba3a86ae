"""Turn main-graph Constant nodes and sparse initializers into initializers (quantizers
only see weights in dense initializers)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from quant_core.onnx_qdq.graph import constant_node_value, is_default_domain
from quant_onnx.graph_edit import copy_model, remove_nodes


def constants_to_initializers(model: onnx.ModelProto) -> onnx.ModelProto:
    """Return a copy of `model` whose Constant nodes and sparse initializers are (dense)
    initializers of the same name.

    Constants that are graph outputs stay nodes (an initializer cannot be a graph output everywhere).
    """
    out = copy_model(model)
    constants_to_initializers_inplace(out)
    return out


def constants_to_initializers_inplace(model: onnx.ModelProto) -> int:
    """In-place version; returns the number of Constant nodes and sparse initializers converted."""
    graph = model.graph
    outputs = {o.name for o in graph.output}
    taken = {t.name for t in graph.initializer}
    # A sparse weight was neither a constant to the planner nor a tensor onnxruntime can
    # hand back for calibration (static mode failed, dynamic mode left it float).
    sparse = [dense_tensor(s) for s in graph.sparse_initializer if s.values.name not in taken]
    graph.initializer.extend(sparse)
    taken.update(t.name for t in sparse)
    del graph.sparse_initializer[:]
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
    return len(doomed) + len(sparse)


def dense_tensor(sparse: onnx.SparseTensorProto) -> onnx.TensorProto:
    """The dense tensor a sparse one stands for (named as its values), zeros elsewhere.

    Example:
        >>> from onnx import helper
        >>> values = numpy_helper.from_array(np.array([5.0, 7.0], np.float32), "w")
        >>> sparse = helper.make_sparse_tensor(values, numpy_helper.from_array(np.array([1, 3], np.int64)), [2, 2])
        >>> numpy_helper.to_array(dense_tensor(sparse)).tolist()
        [[0.0, 5.0], [0.0, 7.0]]
    """
    values = numpy_helper.to_array(sparse.values)
    indices = numpy_helper.to_array(sparse.indices).astype(np.int64)
    dense = np.zeros(tuple(sparse.dims), values.dtype)
    if indices.ndim == 1:  # positions in the flattened tensor
        dense.flat[indices] = values
    else:  # one row of coordinates per value
        dense[tuple(indices.T)] = values
    return numpy_helper.from_array(dense, sparse.values.name)


def _tensor_of(node: onnx.NodeProto) -> onnx.TensorProto | None:
    for attr in node.attribute:
        if attr.name == "sparse_value":
            return dense_tensor(attr.sparse_tensor)
        if attr.name == "value":
            # Copy the TensorProto itself so exotic dtypes (bfloat16, float8) survive untouched.
            tensor = onnx.TensorProto()
            tensor.CopyFrom(attr.t)
            return tensor
    value = constant_node_value(node)
    if value is None or value.dtype == object:
        return None
    return numpy_helper.from_array(value)
