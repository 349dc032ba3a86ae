"""What the NPU executes for a QDQ model under a profile: one step per compute node,
with the activations the profile fuses folded into their producer.

A fused activation (Conv + Relu, Add + Relu, ...) is applied by the device to the
unrounded result: the tensor between the two ops never exists on the device. In the QDQ
file it may exist as a QuantizeLinear/DequantizeLinear pair (``skipped``), or the two ops
may be joined by a float edge (what ``legalize`` leaves for LeakyRelu).

Example:
    >>> import numpy as np
    >>> from onnx import TensorProto, helper, numpy_helper
    >>> from quant_npu.profile import NPUProfile
    >>> inits = {"s": np.array(0.25, np.float32), "z": np.array(0, np.int8), "w": np.ones((2, 2, 1, 1), np.int8)}
    >>> nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
    ...          helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
    ...          helper.make_node("DequantizeLinear", ["w", "s", "z"], ["wd"]),
    ...          helper.make_node("Conv", ["xd", "wd"], ["c"], name="conv"),
    ...          helper.make_node("QuantizeLinear", ["c", "s", "z"], ["cq"]),
    ...          helper.make_node("DequantizeLinear", ["cq", "s", "z"], ["cd"]),
    ...          helper.make_node("Relu", ["cd"], ["r"], name="relu"),
    ...          helper.make_node("QuantizeLinear", ["r", "s", "z"], ["rq"]),
    ...          helper.make_node("DequantizeLinear", ["rq", "s", "z"], ["y"])]
    >>> g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 1, 1])],
    ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 1, 1])],
    ...     [numpy_helper.from_array(v, k) for k, v in inits.items()])
    >>> qdq = QDQGraph(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]))
    >>> [(step_label(s), s.skipped, s.output) for s in plan(qdq, NPUProfile())]
    [('conv+relu', 'cq', 'rq')]
"""

from __future__ import annotations

import attrs
import onnx

from quant_core.onnx_qdq.graph import node_label
from quant_core.onnx_qdq.reader import ComputeNode, QDQGraph
from quant_npu.profile import NPUProfile

WEIGHTED_OPS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
ADD_OPS = frozenset({"Add", "Sub"})
COMMUTING_ACTIVATIONS = frozenset({"Relu", "Clip"})
"""Fused activations that give the same integers whether applied before or after rounding."""


@attrs.frozen(eq=False)
class Step:
    """One NPU operation (see the module example).

    Args:
        main: the compute node.
        activation: the activation fused into it, or None.
        output: key of the integer tensor the step writes (after the activation).
        skipped: key of a quantized tensor between ``main`` and ``activation`` that the
            device never materialises, or None.
    """

    main: ComputeNode
    activation: onnx.NodeProto | None = None
    output: str | None = None
    skipped: str | None = None

    @property
    def node(self) -> onnx.NodeProto:
        return self.main.node

    @property
    def op_type(self) -> str:
        return self.main.op_type

    @property
    def name(self) -> str:
        return self.main.name

    @property
    def data_inputs(self) -> tuple[str | None, ...]:
        return self.main.data_inputs

    @property
    def nodes(self) -> tuple[onnx.NodeProto, ...]:
        return (self.main.node,) if self.activation is None else (self.main.node, self.activation)


def _fusable(qdq: QDQGraph, activation: onnx.NodeProto) -> bool:
    if activation.op_type != "Clip":
        return True
    return all(qdq.constant(name) is not None for name in activation.input[1:] if name)


def _fused_activation(qdq: QDQGraph, cn: ComputeNode, profile: NPUProfile) -> tuple[onnx.NodeProto, str | None] | None:
    """``(activation node, skipped key)`` when ``cn``'s only consumer is an activation the
    profile fuses into it."""
    allowed = profile.fusions.get(cn.op_type)
    if not allowed or not cn.node.output:
        return None
    out = cn.node.output[0]
    if qdq.index.is_graph_output(out):
        return None
    consumers = qdq.consumers(out)
    skipped = None
    if cn.output is not None:  # quantized in between: Q -> one DQ -> the activation
        if len(consumers) != 1 or qdq.is_graph_output_key(cn.output):
            return None
        readers = qdq.readers(cn.output)
        dequantizers = qdq.dequantizers.get(cn.output, [])
        if len(readers) != 1 or len(dequantizers) != 1:
            return None
        activation, skipped, source = readers[0], cn.output, dequantizers[0].output[0]
    else:
        if len(consumers) != 1:
            return None
        activation, source = consumers[0], out
    if activation.op_type not in allowed or not activation.input or activation.input[0] != source:
        return None
    return (activation, skipped) if _fusable(qdq, activation) else None


def plan(qdq: QDQGraph, profile: NPUProfile) -> list[Step]:
    """The device's steps for ``qdq`` in execution order (see the module example)."""
    by_node = {id(cn.node): cn for cn in qdq.compute_nodes}
    absorbed: set[int] = set()
    steps: list[Step] = []
    for cn in qdq.compute_nodes:
        if id(cn.node) in absorbed:
            continue
        fused = _fused_activation(qdq, cn, profile)
        if fused is None:
            steps.append(Step(cn, output=cn.output))
            continue
        activation, skipped = fused
        absorbed.add(id(activation))
        act = by_node.get(id(activation))
        steps.append(Step(cn, activation, output=None if act is None else act.output, skipped=skipped))
    return steps


def step_label(step: Step) -> str:
    """``conv+relu``-style name for messages."""
    if step.activation is None:
        return step.name
    return f"{step.name}+{node_label(step.activation)}"


def is_swish(qdq: QDQGraph, step: Step) -> bool:
    """Whether a Mul step computes ``x * hardsigmoid(x)`` (its own shift range)."""
    keys = [k for k in step.data_inputs if k is not None]
    if step.op_type != "Mul" or len(keys) != 2:
        return False
    for a, b in ((keys[0], keys[1]), (keys[1], keys[0])):
        float_name = qdq.tensors[a].float_name
        producer = qdq.producer(float_name) if float_name else None
        if producer is None or producer.op_type != "HardSigmoid" or not producer.input:
            continue
        if qdq.dequantized.get(producer.input[0]) == b:
            return True
    return False
