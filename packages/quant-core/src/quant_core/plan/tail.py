"""The result tail: what a model computes after its last integer layer.

A tensor from which no Conv/ConvTranspose/Gemm/MatMul can be reached (nothing downstream
of it is read by a layer) only assembles the model's results: a classifier's logits and
their softmax, a detector's box decoding (DFL expectation, anchor offsets, strides) and its
score sigmoid, a segmentation head's upsampling. No integer kernel needs it at 8 bits, and
each quantize/dequantize pair there adds its rounding to the output unfiltered. PT2E leaves
the same tensors float. Measured on random-weight models (96 px, ``a8w8``, quant-onnx files
in onnxruntime; ``docs/benchmarks.md``): the YOLOv8-style detector 46.9 -> 58.9 dB (its
strides ``8, 16, 32`` shared one 8-bit scale: boxes scaled by 1.004), EfficientNet-B0 39.3
-> 41.5 dB (the 8-bit logits).

:func:`result_tail` names these tensors, the constants they are computed with included;
the planner leaves them float except under power-of-two formats (an integer-only device,
which runs no float op). A Conv's output (and a Relu/Clip fused into it) keeps its format
even there: onnxruntime's ``QLinearConv`` needs a quantized output, a Gemm/MatMul does not
(``QGemm``, ``MatMulIntegerToFloat`` write float).

Example (a Conv, a Gemm head, a softmax over the logits):
    >>> from quant_core.plan.graph import PlanGraph, PlanNode
    >>> nodes = [PlanNode("conv", "Conv", ("x", "w"), ("c",)), PlanNode("relu", "Relu", ("c",), ("r",)),
    ...          PlanNode("fc", "Gemm", ("r", "w2"), ("logits",)), PlanNode("sm", "Softmax", ("logits",), ("p",))]
    >>> sorted(result_tail(PlanGraph(nodes, inputs=("x",), outputs=("p",))))
    ['logits', 'p']
"""

from __future__ import annotations

from quant_core.plan.graph import GraphView, PlanNode
from quant_core.plan.ops import OpKind, policy_for

LAYERS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
"""Ops that read their inputs as integers on an integer runtime."""
QUANTIZED_OUTPUT_LAYERS = frozenset({"Conv"})
"""Layers whose integer kernel writes a quantized output (onnxruntime's ``QLinearConv``)."""
_OPAQUE = frozenset({"If", "Loop", "Scan"})
"""Ops whose bodies the planner does not see: what they read may reach a layer."""


def _reaches_layer(graph: GraphView, node: PlanNode, reaches: dict[str, bool]) -> bool:
    if node.op_type in LAYERS | _OPAQUE or not node.standard:
        return True
    return any(reaches.get(out, False) for out in node.outputs if out and graph.is_float(out))


def result_tail(graph: GraphView) -> frozenset[str]:
    """The float tensors of ``graph`` computed from a layer's output from which no layer is
    reachable (see the module docstring), and the constants and inputs only they are computed
    with; without the outputs of a :data:`QUANTIZED_OUTPUT_LAYERS` layer and of a Relu/Clip
    that alone reads one. A graph without layers has no tail: its ops are all it computes.

    Example (a detector's decoding: the box layer's output keeps its format, the offset by
    a constant anchor and the scaling by a constant stride do not):
        >>> import numpy as np
        >>> from quant_core.plan.graph import PlanGraph, PlanNode
        >>> c = {"w": np.ones((4, 3, 1, 1), np.float32), "anchor": np.ones(4, np.float32), "stride": np.float32(8)}
        >>> nodes = [PlanNode("box", "Conv", ("x", "w"), ("d",)), PlanNode("off", "Add", ("d", "anchor"), ("a",)),
        ...          PlanNode("scale", "Mul", ("a", "stride"), ("y",))]
        >>> sorted(result_tail(PlanGraph(nodes, inputs=("x",), outputs=("y",), constant=c.get)))
        ['a', 'anchor', 'stride', 'y']
        >>> sorted(result_tail(PlanGraph(nodes[1:], inputs=("d",), outputs=("y",), constant=c.get)))
        []
    """
    after: set[str] = set()  # computed from a layer's output
    for node in graph.nodes:
        if node.op_type in LAYERS or any(i in after for i in node.inputs):
            after.update(out for out in node.outputs if out and graph.is_float(out))
    reaches: dict[str, bool] = {}
    tail: set[str] = set()
    for node in reversed(graph.nodes):  # consumers before producers
        for out in node.outputs:
            if out:
                reaches[out] = any(_reaches_layer(graph, c, reaches) for c in graph.consumers(out))
                if out in after and not reaches[out]:
                    tail.add(out)
        # What only the tail is computed with (anchors, strides) belongs to it.
        for tensor in node.inputs:
            if tensor and tensor not in after and graph.is_float(tensor) and _feeds_only(graph, tensor, tail, reaches):
                tail.add(tensor)
    return frozenset(tail - _quantized_layer_outputs(graph))


def _feeds_only(graph: GraphView, tensor: str, tail: set[str], reaches: dict[str, bool]) -> bool:
    """No layer reads ``tensor`` and every reader writes float outputs, all in ``tail``."""
    readers = graph.consumers(tensor)
    if not readers or graph.is_graph_output(tensor) or any(_reaches_layer(graph, c, reaches) for c in readers):
        return False
    outputs = [out for c in readers for out in c.outputs if out and graph.is_float(out)]
    return bool(outputs) and all(out in tail for out in outputs)


def _quantized_layer_outputs(graph: GraphView) -> set[str]:
    """Outputs of the layers whose kernels write quantized outputs, and of the Relu/Clip
    alone reading one (fused into the layer, quantized after it)."""
    kept = set()
    for node in graph.nodes:
        if node.op_type not in QUANTIZED_OUTPUT_LAYERS or not node.outputs or not node.outputs[0]:
            continue
        out = node.outputs[0]
        kept.add(out)
        readers = graph.consumers(out)
        if len(readers) == 1 and not graph.is_graph_output(out):
            rule = policy_for(readers[0], graph.constant)
            if rule is not None and rule.kind is OpKind.ACTIVATION and readers[0].outputs:
                kept.add(readers[0].outputs[0])
    return kept
