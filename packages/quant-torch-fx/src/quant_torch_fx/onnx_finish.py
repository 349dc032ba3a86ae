"""``finish``: the passes that make an emitted QDQ model run in onnxruntime as the file
defines it, in one function (the interface the shared ONNX QDQ layer will take over):

- ``Shape``/``Size`` read the quantized tensor (the codes) instead of a float one that is
  also quantized: an extra float reader keeps the producer out of the integer kernels;
- a MatMul (or Gemm without transposes) whose weight onnxruntime would rewrite into
  ``MatMulNBits`` (:func:`quant_core.qdq.guard_matmul_weight`) reads it at ``axis=-1``, per
  tensor as one-element vectors: the rewrite refuses that form;
- a Conv/ConvTranspose/Gemm that reads a quantized input but keeps a float weight (an
  excluded layer) or a float bias (the bias rule's float case) is left nothing for
  onnxruntime's ``WeightBiasQuantization`` to quantize: a multi-channel Conv with a float
  weight reads its input through a per-channel DequantizeLinear repeating its one scale,
  any other such node gets its float bias (zeros when it has none) as exact int32 codes
  (:func:`quant_core.qdq.exact_int32`) behind a DequantizeLinear;
- nodes and initializers nothing reads are dropped;
- the opset and IR version are raised to what the stored formats need.

Example:
    >>> from onnx import helper, TensorProto
    >>> g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
    ...     [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
    ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    ...     [helper.make_tensor("unread", TensorProto.FLOAT, [1], [0.0])])
    >>> m = finish(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=7), opset=21)
    >>> [t.name for t in m.graph.initializer], m.opset_import[0].version, m.ir_version
    ([], 21, 10)
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from quant_core.dtypes import DType
from quant_core.onnx_qdq.build import exact_int32, output_channels
from quant_core.qdq import MATMUL_WEIGHT_AXIS, guard_matmul_weight
from quant_core.qparams import QParams

_DEFAULT_DOMAINS = ("", "ai.onnx")
_STORED = {getattr(onnx.TensorProto, d.value.upper()): d for d in DType if d.is_integer}
"""ONNX integer element types -> stored formats."""


def finish(model: onnx.ModelProto, *, opset: int) -> onnx.ModelProto:
    """Run every finishing pass on ``model`` (changed in place and returned) and raise its
    default-domain opset to at least ``opset``."""
    _shape_reads_quantized(model)
    _keep_matmuls_out_of_matmulnbits(model)
    _keep_float_weights_float(model)
    _drop_unread(model)
    _raise_opset(model, opset)
    return model


class _Graph:
    """Lookups over a graph that the passes keep up to date."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.initializers = {t.name: t for t in graph.initializer}
        self.producers = {out: node for node in graph.node for out in node.output}
        self.names = set(self.initializers) | set(self.producers) | {i.name for i in graph.input}

    def unique(self, base: str) -> str:
        name, index = base, 1
        while name in self.names:
            name, index = f"{base}_{index}", index + 1
        self.names.add(name)
        return name

    def add_initializer(self, value: np.ndarray, base: str) -> str:
        name = self.unique(base)
        tensor = numpy_helper.from_array(np.array(value, order="C"), name)
        self.graph.initializer.append(tensor)
        self.initializers[name] = tensor
        return name

    def stored(self, name: str) -> DType | None:
        tensor = self.initializers.get(name)
        return None if tensor is None else _STORED.get(tensor.data_type)

    def dequantize_of(self, tensor: str) -> onnx.NodeProto | None:
        node = self.producers.get(tensor)
        if node is None or node.op_type != "DequantizeLinear" or node.domain not in _DEFAULT_DOMAINS:
            return None
        return node


def _attribute(node: onnx.NodeProto, name: str, default: int) -> int:
    return next((int(a.i) for a in node.attribute if a.name == name), default)


def _shape_reads_quantized(model: onnx.ModelProto) -> None:
    """``Shape``/``Size`` of a tensor that is also quantized read the quantized tensor
    instead (same shape; the float tensor then has the Q as its only consumer): the input
    of the DequantizeLinear that produced it, or the output of a QuantizeLinear of it that
    comes earlier in the graph (a later one would break the nodes' topological order)."""
    quantized: dict[str, str] = {}
    producers: dict[str, onnx.NodeProto] = {}
    for node in model.graph.node:
        if node.op_type in ("Shape", "Size") and node.input:
            source = node.input[0]
            producer = producers.get(source)
            if producer is not None and producer.op_type == "DequantizeLinear" and producer.domain in _DEFAULT_DOMAINS:
                node.input[0] = producer.input[0]
            elif source in quantized:
                node.input[0] = quantized[source]
        if node.op_type == "QuantizeLinear" and node.domain in _DEFAULT_DOMAINS:
            quantized.setdefault(node.input[0], node.output[0])
        producers.update((out, node) for out in node.output)


def _matmulnbits_candidate(node: onnx.NodeProto) -> bool:
    if node.domain not in _DEFAULT_DOMAINS or len(node.input) < 2:
        return False
    if node.op_type == "MatMul":
        return True
    return node.op_type == "Gemm" and not _attribute(node, "transA", 0) and not _attribute(node, "transB", 0)


def _keep_matmuls_out_of_matmulnbits(model: onnx.ModelProto) -> None:
    """A MatMul reading a 2-D integer weight behind a DequantizeLinear, per tensor or along
    its last axis, that :func:`~quant_core.qdq.guard_matmul_weight` says onnxruntime would
    rewrite into ``MatMulNBits`` (which computes something else) reads it at
    :data:`~quant_core.qdq.MATMUL_WEIGHT_AXIS`, per tensor as one-element vectors."""
    view = _Graph(model.graph)
    for node in model.graph.node:
        if not _matmulnbits_candidate(node):
            continue
        dq = view.dequantize_of(node.input[1])
        if dq is None or dq.input[0] not in view.initializers or len(view.initializers[dq.input[0]].dims) != 2:
            continue
        weight = view.stored(dq.input[0])
        reader = view.dequantize_of(node.input[0])
        activation = view.stored(reader.input[2]) if reader is not None and len(reader.input) > 2 else None
        if weight is None or not guard_matmul_weight(activation, weight):
            continue
        per_channel = int(np.prod(view.initializers[dq.input[1]].dims)) > 1
        if per_channel and _attribute(dq, "axis", 1) % 2 != 1:
            continue  # channels along K: -1 would name another axis (and the rewrite refuses it anyway)
        if not per_channel:
            for name in dq.input[1:3]:
                tensor = view.initializers.get(name)
                if tensor is not None and not tensor.dims:
                    tensor.dims.append(1)
        kept = [a for a in dq.attribute if a.name != "axis"]
        del dq.attribute[:]
        dq.attribute.extend([*kept, helper.make_attribute("axis", MATMUL_WEIGHT_AXIS)])


def _per_tensor_reader(view: _Graph, tensor: str) -> onnx.NodeProto | None:
    dq = view.dequantize_of(tensor)
    if dq is None or dq.input[1] not in view.initializers:
        return None
    return dq if int(np.prod(view.initializers[dq.input[1]].dims)) == 1 else None


def _keep_float_weights_float(model: onnx.ModelProto) -> None:
    """Leave onnxruntime's ``WeightBiasQuantization`` (graph level basic: every default
    session) nothing to quantize: it takes a Conv/ConvTranspose/Gemm that reads a per-tensor
    DequantizeLinear and feeds a QuantizeLinear for an unfinished QDQ unit and quantizes its
    float weight to per-tensor int8 and its float bias to int32 at ``input_scale *
    weight_scale`` (a layer whose output is not quantized, a float head, is left as it is). It leaves a node
    alone whose input DequantizeLinear has more than one scale or whose bias is not an
    initializer (see ``docs/onnxruntime.md``)."""
    view = _Graph(model.graph)
    quantized = {node.input[0] for node in model.graph.node if node.op_type == "QuantizeLinear"}
    for node in list(model.graph.node):
        if node.op_type not in ("Conv", "ConvTranspose", "Gemm") or node.domain not in _DEFAULT_DOMAINS:
            continue
        weight = view.initializers.get(node.input[1]) if len(node.input) > 1 else None
        reader = _per_tensor_reader(view, node.input[0])
        if reader is None or node.output[0] not in quantized:
            continue  # not a unit the rewrite completes: it needs a QuantizeLinear after the node
        if weight is None:  # a quantized weight: a float bias beside it would be re-quantized
            bias = view.initializers.get(node.input[2]) if len(node.input) > 2 else None
            if bias is not None and bias.data_type == onnx.TensorProto.FLOAT and len(bias.dims) == 1:
                _store_exact_bias(view, node, ())
            continue
        if weight.data_type != onnx.TensorProto.FLOAT:
            continue
        group = _attribute(node, "group", 1)
        channels = int(weight.dims[1]) * group if node.op_type == "Conv" else 1
        if channels > 1:
            _spread_scale(view, node, reader, channels)
        else:
            _store_exact_bias(view, node, tuple(int(d) for d in weight.dims))


def _spread_scale(view: _Graph, node: onnx.NodeProto, reader: onnx.NodeProto, channels: int) -> None:
    """``node`` reads its input through a per-channel (axis 1) copy of ``reader`` repeating
    its one scale and zero point: the same values, which onnxruntime's rewrite skips."""
    scale = numpy_helper.to_array(view.initializers[reader.input[1]]).reshape(-1)
    zero_point = numpy_helper.to_array(view.initializers[reader.input[2]]).reshape(-1)
    base = f"{reader.output[0]}_per_channel"
    inputs = [
        reader.input[0],
        view.add_initializer(np.full(channels, scale[0], scale.dtype), f"{base}_scale"),
        view.add_initializer(np.full(channels, zero_point[0], zero_point.dtype), f"{base}_zero_point"),
    ]
    output = view.unique(base)
    spread = helper.make_node(
        "DequantizeLinear", inputs, [output], name=view.unique(f"{reader.name}_per_channel"), axis=1
    )
    position = list(view.graph.node).index(node)
    view.graph.node.insert(position, spread)
    node.input[0] = output


def _store_exact_bias(view: _Graph, node: onnx.NodeProto, weight_shape: tuple[int, ...]) -> None:
    """``node``'s float bias (zeros when it has none) as exact int32 codes behind a DequantizeLinear."""
    bias = view.initializers.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    if len(node.input) > 2 and node.input[2] and (bias is None or len(bias.dims) != 1):
        return  # not a 1-D initializer: onnxruntime leaves it alone
    if bias is None:
        channels = output_channels(node, weight_shape)
        values = np.zeros(channels, np.float32)
        base = f"{node.name}_zero_bias"
    else:
        values = numpy_helper.to_array(bias).astype(np.float32)
        base = node.input[2]
    codes, qp = exact_int32(values)
    output = _exact_dequantize(view, node, codes, qp, base)
    del node.input[2:]
    node.input.append(output)


def _exact_dequantize(view: _Graph, node: onnx.NodeProto, codes: np.ndarray, qp: QParams, base: str) -> str:
    inputs = [
        view.add_initializer(codes, f"{base}_exact"),
        view.add_initializer(np.asarray(qp.scale, np.float32), f"{base}_exact_scale"),
        view.add_initializer(np.zeros(codes.shape, np.int32), f"{base}_exact_zero_point"),
    ]
    output = view.unique(f"{base}_exact_DequantizeLinear_Output")
    dq = helper.make_node(
        "DequantizeLinear", inputs, [output], name=view.unique(f"{base}_exact_DequantizeLinear"), axis=0
    )
    view.graph.node.insert(list(view.graph.node).index(node), dq)
    return output


def _drop_unread(model: onnx.ModelProto) -> None:
    """Remove nodes whose outputs nothing reads, then initializers nothing reads."""
    graph = model.graph
    outputs = {o.name for o in graph.output}
    while True:
        read = {name for node in graph.node for name in node.input} | outputs
        dead = [n for n in graph.node if not any(out in read for out in n.output)]
        if not dead:
            break
        for node in dead:
            graph.node.remove(node)
    read = {name for node in graph.node for name in node.input} | outputs
    kept = [t for t in graph.initializer if t.name in read]
    del graph.initializer[:]
    graph.initializer.extend(kept)


def _raise_opset(model: onnx.ModelProto, opset: int) -> None:
    for entry in model.opset_import:
        if entry.domain in _DEFAULT_DOMAINS and entry.version < opset:
            entry.version = opset
    versions = [helper.make_opsetid(e.domain, e.version) for e in model.opset_import if e.domain in _DEFAULT_DOMAINS]
    model.ir_version = max(model.ir_version, helper.find_min_ir_version_for(versions))
