"""Fold inference BatchNormalization into the preceding Conv / ConvTranspose / Gemm.

BN(y) = s * (y - mean) + beta with s = gamma / sqrt(var + eps) is linear per output channel, so it
becomes part of the producer's weight and bias.  A BN whose producer is anything else, or whose
producer output is read elsewhere or is a graph output, stays as it is.
"""

from __future__ import annotations

import numpy as np
import onnx

from quant_core.errors import ModelError
from quant_core.onnx_qdq.graph import GraphIndex, is_default_domain, node_attribute
from quant_onnx.graph_edit import copy_model, remove_nodes, rename_tensors, set_attr, set_initializer

FOLDABLE_PRODUCERS = ("Conv", "ConvTranspose", "Gemm")


def fold_batchnorm(model: onnx.ModelProto) -> onnx.ModelProto:
    """Return a copy of `model` with every foldable BatchNormalization merged into its producer."""
    out = copy_model(model)
    fold_batchnorm_inplace(out)
    return out


def fold_batchnorm_inplace(model: onnx.ModelProto) -> int:
    """In-place version; returns the number of BatchNormalization nodes folded."""
    graph = model.graph
    index = GraphIndex(graph)
    doomed: list[onnx.NodeProto] = []
    renames: dict[str, str] = {}
    for bn in list(graph.node):
        if bn.op_type != "BatchNormalization" or not is_default_domain(bn):
            continue
        producer = index.producer(bn.input[0])
        if producer is None or producer.op_type not in FOLDABLE_PRODUCERS or not is_default_domain(producer):
            continue
        y = producer.output[0]
        if len(index.consumers(y)) != 1 or index.is_graph_output(y):
            continue
        if node_attribute(bn, "training_mode", 0) or any(o and index.used(o) for o in bn.output[1:]):
            continue
        params = [index.constant(n) for n in bn.input[1:5]]
        if any(p is None for p in params):
            continue
        gamma, beta, mean, var = (np.asarray(p, dtype=np.float64) for p in params)  # type: ignore[arg-type]
        eps = float(node_attribute(bn, "epsilon", 1e-5))
        if not np.all(var + eps > 0):  # also false for NaN
            raise ModelError(
                f"node '{bn.name}' (BatchNormalization): variance + epsilon must be > 0 in every channel "
                f"(epsilon {eps:g}, smallest variance {float(np.min(var)) if var.size else 0:g})"
            )
        scale = gamma / np.sqrt(var + eps)
        shift = beta - mean * scale
        if not _fold_into(producer, scale, shift, index, graph):
            continue
        doomed.append(bn)
        renames[y] = bn.output[0]
    remove_nodes(graph, doomed)
    rename_tensors(graph, renames)
    return len(doomed)


def _fold_into(
    node: onnx.NodeProto, scale: np.ndarray, shift: np.ndarray, index: GraphIndex, graph: onnx.GraphProto
) -> bool:
    """Scale the producer's weight per output channel and fold `shift` into its bias; False if impossible."""
    weight = index.constant(node.input[1])
    if weight is None or weight.dtype.kind != "f":
        return False
    bias_name = node.input[2] if len(node.input) > 2 else ""
    bias = index.constant(bias_name) if bias_name else None
    if bias_name and bias is None:
        return False
    channels = scale.shape[0]
    w = weight.astype(np.float64)
    if node.op_type == "Conv":
        if w.shape[0] != channels:
            return False
        new_w = w * scale.reshape((-1,) + (1,) * (w.ndim - 1))
        new_b = (np.zeros(channels) if bias is None else bias.astype(np.float64)) * scale + shift
    elif node.op_type == "ConvTranspose":
        group = int(node_attribute(node, "group", 1))
        c_in, c_out_g = w.shape[0], w.shape[1]
        if c_out_g * group != channels or c_in % group:
            return False
        # Weight is [C_in, C_out/group, k...]; output channel g*C_out/group + j sits in block g, column j.
        blocks = w.reshape((group, c_in // group, c_out_g, *w.shape[2:]))
        new_w = (blocks * scale.reshape((group, 1, c_out_g) + (1,) * (w.ndim - 2))).reshape(w.shape)
        new_b = (np.zeros(channels) if bias is None else bias.astype(np.float64)) * scale + shift
    else:
        new = _gemm_fold(node, w, bias, scale, shift)
        if new is None:
            return False
        new_w, new_b = new
    w_name = index.unique_name(f"{node.input[1]}_bn_folded")
    b_name = index.unique_name(f"{bias_name or node.output[0] + '_bias'}_bn_folded")
    set_initializer(graph, w_name, new_w.astype(weight.dtype), fresh=True)
    set_initializer(graph, b_name, new_b.astype(weight.dtype), fresh=True)
    node.input[1] = w_name
    if len(node.input) > 2:
        node.input[2] = b_name
    else:
        node.input.append(b_name)
    return True


def _gemm_fold(
    node: onnx.NodeProto, w: np.ndarray, bias: np.ndarray | None, scale: np.ndarray, shift: np.ndarray
) -> tuple[np.ndarray, np.ndarray] | None:
    """Y = alpha*A*B' + beta*C with output columns = BN channels; result has beta = 1 (what ORT fuses)."""
    if w.ndim != 2:
        return None
    trans_b = int(node_attribute(node, "transB", 0))
    channels = scale.shape[0]
    n = w.shape[0] if trans_b else w.shape[1]
    if n != channels:
        return None
    new_w = w * (scale[:, None] if trans_b else scale[None, :])
    beta = float(node_attribute(node, "beta", 1.0))
    c = np.zeros(channels) if bias is None else bias.astype(np.float64) * beta
    # Only a bias broadcastable to one row can stay a per-column vector.
    if c.size not in (1, channels) or (c.ndim == 2 and c.shape[0] != 1) or c.ndim > 2:
        return None
    c = np.broadcast_to(c.reshape(-1), (channels,))
    set_attr(node, "beta", 1.0)
    return new_w, c * scale + shift
