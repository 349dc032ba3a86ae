"""Per-channel scales moved through an ONNX graph without changing its function: folded
into what writes a tensor, a ``Mul`` inserted before its readers, rescaled layers written
back (CLE, SmoothQuant and activation equalization share these edits).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import helper

from quant_algos.drivers.cle_chains import LayerRef, layer_ref
from quant_algos.layer import Layer, scale_outputs
from quant_core.onnx_qdq.graph import GraphIndex, is_default_domain, node_attribute, plan_graph, plan_node
from quant_core.plan import crossed_by_channel_scales
from quant_onnx.graph_edit import set_initializer


def owned_constant(index: GraphIndex, name: str) -> np.ndarray | None:
    """An initializer only one node reads and no graph output is (so rescaling it changes
    nothing else)."""
    if index.initializer_proto(name) is None or len(index.consumers(name)) != 1 or index.is_graph_output(name):
        return None
    return index.constant(name)


def fold_into_producer(
    model: onnx.ModelProto, index: GraphIndex, tensor: str, family: str, rank: int | None, mult: np.ndarray
) -> str | None:
    """Fold ``x *= mult`` (per channel) into what produces ``tensor``; the node's name, or None."""
    current = tensor
    crossed = False
    while True:
        node = index.producer(current)
        if node is None or not is_default_domain(node) or len(node.output) != 1:
            return None
        if crossed and index.sole_consumer(node.output[0]) is None:
            return None
        if crossed_by_channel_scales(plan_node(node), index.constant, channels_last=family != "conv"):
            current, crossed = node.input[0], True
            continue
        break
    # The layer's weights and readers as ``index`` (current) holds them; no element types
    # are needed, so no shape inference.
    ref = layer_ref(plan_node(node), plan_graph(model, index), lambda name: index.initializer_proto(name) is not None)
    if ref is not None and ref.family == family and ref.layer.out_channels == mult.size:
        scaled = scale_outputs(ref.layer, 1.0 / mult)
        set_initializer(model.graph, ref.weight_name, np.ascontiguousarray(ref.stored_weight(scaled.weight)))
        if ref.bias_name is not None and scaled.bias is not None:
            set_initializer(model.graph, ref.bias_name, scaled.bias)
        return node.name
    if crossed or rank is None:
        return None  # the remaining forms are only exact directly on the tensor
    axis = 1 if family == "conv" else rank - 1
    shape = [1] * rank
    shape[axis] = -1
    m = mult.reshape(shape)
    if node.op_type == "Mul":
        for i in (0, 1):
            c = owned_constant(index, node.input[i])
            if c is not None and c.ndim <= rank:
                new = (c.astype(np.float64) * m).astype(c.dtype)
                if new.ndim == rank and new.shape[axis] == mult.size:
                    set_initializer(model.graph, node.input[i], new)
                    return node.name
        return None
    if node.op_type in ("LayerNormalization", "BatchNormalization"):
        if node.op_type == "LayerNormalization" and (
            family != "dense" or node_attribute(node, "axis", -1) not in (-1, rank - 1)
        ):
            return None
        if node.op_type == "BatchNormalization" and family != "conv":
            return None
        params = [node.input[1]] + ([node.input[2]] if len(node.input) > 2 and node.input[2] else [])
        values = [owned_constant(index, p) for p in params]
        if any(v is None or v.shape != (mult.size,) for v in values):
            return None
        for p, v in zip(params, values, strict=True):
            assert v is not None
            set_initializer(model.graph, p, (v.astype(np.float64) * mult).astype(v.dtype))
        return node.name
    return None


def insert_mul(
    model: onnx.ModelProto,
    index: GraphIndex,
    tensor: str,
    family: str,
    rank: int | None,
    mult: np.ndarray,
    label: str = "smooth",
) -> onnx.NodeProto:
    """Insert ``Mul(tensor, mult)`` (per channel: the last axis for ``family`` ``"dense"``,
    axis 1 otherwise) before every reader of ``tensor``; the new node. ``label`` names the
    new node, constant and tensor after ``tensor``."""
    shape = [-1] if family == "dense" else [-1] + [1] * max((rank or 4) - 2, 0)
    const = index.unique_name(f"{tensor}_{label}_scale")
    out = index.unique_name(f"{tensor}_{label}ed")
    name = index.unique_name(f"{tensor}_{label}")
    set_initializer(model.graph, const, mult.astype(np.float32).reshape(shape))
    readers = {n.name for n in index.consumers(tensor)}
    position = 0
    for i, node in enumerate(model.graph.node):
        if tensor in node.output:
            position = i + 1
        if node.name in readers:
            for j, inp in enumerate(node.input):
                if inp == tensor:
                    node.input[j] = out
    node = helper.make_node("Mul", [tensor, const], [out], name=name)
    model.graph.node.insert(position, node)
    return node


def write_layers(model: onnx.ModelProto, layers: Mapping[str, Layer], refs: Mapping[str, LayerRef]) -> None:
    """Write rescaled layers (``[out, in, ...]`` weights and biases) where ``refs`` says they
    live; a layer that gained a bias gets a new initializer."""
    index = GraphIndex(model.graph)
    nodes = {node.name: node for node in model.graph.node}
    for name, layer in layers.items():
        ref = refs[name]
        set_initializer(model.graph, ref.weight_name, np.ascontiguousarray(ref.stored_weight(layer.weight), np.float32))
        if layer.bias is None:
            continue
        if ref.bias_name is not None:
            set_initializer(model.graph, ref.bias_name, np.asarray(layer.bias, np.float32))
        else:  # high-bias absorption gave a bias-free layer a bias
            bias_name = index.unique_name(f"{name}_bias")
            set_initializer(model.graph, bias_name, np.asarray(layer.bias, np.float32))
            node = nodes[name]
            while len(node.input) < 3:
                node.input.append("")
            node.input[2] = bias_name
