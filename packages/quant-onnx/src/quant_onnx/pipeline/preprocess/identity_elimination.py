"""Remove Identity nodes (and inference-mode Dropout) so weights reach their consumers directly.

torch.onnx wraps shared or re-used parameters in Identity nodes; a quantizer that sees an Identity
between an initializer and a Conv leaves the weight float and the Conv never reaches an integer kernel.
"""

from __future__ import annotations

import onnx

from quant_core.onnx_qdq.graph import GraphIndex, is_default_domain
from quant_onnx.graph_edit import copy_model, remove_nodes, rename_inputs, rename_tensor


def eliminate_identities(model: onnx.ModelProto) -> onnx.ModelProto:
    """Return a copy of `model` without Identity / inference Dropout nodes (outputs unchanged)."""
    out = copy_model(model)
    eliminate_identities_inplace(out)
    return out


def eliminate_identities_inplace(model: onnx.ModelProto) -> int:
    """In-place version; returns the number of nodes removed."""
    graph = model.graph
    index = GraphIndex(graph)
    alias: dict[str, str] = {}
    doomed: list[onnx.NodeProto] = []
    to_graph_output: list[str] = []
    for node in graph.node:
        if not _is_pass_through(node, index):
            continue
        src, dst = node.input[0], node.output[0]
        if index.is_graph_output(dst):
            to_graph_output.append(dst)
            continue
        alias[dst] = src
        doomed.append(node)

    def resolve(name: str) -> str:
        while name in alias:
            name = alias[name]
        return name

    rename_inputs(graph, {k: resolve(k) for k in alias})
    remove_nodes(graph, doomed)
    removed = len(doomed)
    # An Identity producing a graph output can go only if its source can take the output's name.
    # (Looked up by output name: remove_nodes rebuilt graph.node, so earlier node objects are stale.)
    for dst in to_graph_output:
        index = GraphIndex(graph)
        identity = index.producer(dst)
        if identity is None:
            continue
        src = identity.input[0]
        producer = index.producer(src)
        if producer is None or index.is_graph_output(src) or index.is_graph_input(src):
            continue
        remove_nodes(graph, [identity])
        rename_tensor(graph, src, dst)
        removed += 1
    return removed


def _is_pass_through(node: onnx.NodeProto, index: GraphIndex) -> bool:
    if not is_default_domain(node) or not node.input or not node.input[0]:
        return False
    if node.op_type == "Identity":
        return True
    if node.op_type != "Dropout":
        return False
    # The mask output must be unused, and training_mode (opset >= 12) must be absent or constant false.
    if len(node.output) > 1 and node.output[1] and index.used(node.output[1]):
        return False
    if len(node.input) > 2 and node.input[2]:
        training = index.constant(node.input[2])
        if training is None or bool(training):
            return False
    return True
