"""Finish a QDQ model for onnxruntime: the edits that make the file compute in
onnxruntime's default session what it says, and reach its integer kernels. Both
backends' files go through :func:`finish_for_onnxruntime` after they are written
(quant_onnx's writer, quant_torch_fx's export), so these rules exist once.

In order:

1. ``Shape``/``Size`` of a quantized tensor read the quantized tensor
   (:func:`shape_reads_quantized`): an extra float reader would keep the producer out of
   the integer kernels, and a DequantizeLinear there would dequantize a whole activation
   to throw the values away.
2. A Conv/ConvTranspose/Gemm with a quantized input, a float weight or bias, and a
   QuantizeLinear after it is kept from onnxruntime's ``WeightBiasQuantization``
   (:func:`keep_float_weights_float`).
3. A MatMul (or ``Gemm`` without transposes) reading a quantized 2-D weight that no
   integer kernel takes is kept from onnxruntime's ``MatMulNBits`` rewrite
   (:func:`keep_matmuls_out_of_matmulnbits`).
4. Nodes and initializers nothing reads are dropped (:func:`drop_unread`).
5. The Q/DQ formats must be valid at the model's opset: 16-bit pairs below opset 21 are
   in onnxruntime's contrib domain, which is then declared (and noted); a standard pair
   the opset does not take is refused (:func:`check_formats_opset`).

Example:
    >>> import numpy as np
    >>> from onnx import TensorProto, helper, numpy_helper
    >>> inits = [numpy_helper.from_array(np.float32(0.5), "s"), numpy_helper.from_array(np.uint8(128), "z"),
    ...          numpy_helper.from_array(np.ones(3, np.float32), "unused")]
    >>> nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q"),
    ...          helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq"),
    ...          helper.make_node("Shape", ["xd"], ["y"], name="shape")]
    >>> g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
    ...     [helper.make_tensor_value_info("y", TensorProto.INT64, [1])], inits)
    >>> finished = finish_for_onnxruntime(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]))
    >>> [(n.op_type, list(n.input)) for n in finished.model.graph.node], [t.name for t in finished.model.graph.initializer]
    ([('QuantizeLinear', ['x', 's', 'z']), ('Shape', ['xq'])], ['s', 'z'])
"""

from __future__ import annotations

import attrs
import numpy as np
import onnx
from onnx import helper

from quant_core.dtypes import DType
from quant_core.errors import ModelError
from quant_core.onnx_qdq.build import (
    CONTRIB_DOMAIN,
    DEQUANTIZE,
    QUANTIZE,
    QDQBuilder,
    default_opset,
    exact_int32,
    output_channels,
)
from quant_core.onnx_qdq.graph import DEFAULT_DOMAINS, GraphIndex, int_attribute, is_default_domain, node_inputs
from quant_core.onnx_qdq.tensor_types import DTYPE_OF_ONNX
from quant_core.plan.ops import POLICIES, integer_kernel_reads
from quant_core.qdq import MATMUL_WEIGHT_AXIS, guard_matmul_weight, required_opset
from quant_core.qparams import QParams

SHAPE_READERS = frozenset({"Shape", "Size"})
"""Ops whose output depends only on their input's shape."""

ORT_COMPLETED_OPS = frozenset({"Conv", "ConvTranspose", "Gemm"})
"""Ops whose float weight and bias onnxruntime quantizes itself when they read a DequantizeLinear."""


@attrs.frozen(eq=False)
class FinishedModel:
    """The finished ``model`` and the ``notes`` finishing made (for reports)."""

    model: onnx.ModelProto
    notes: tuple[str, ...] = ()


def finish_for_onnxruntime(model: onnx.ModelProto) -> FinishedModel:
    """``model`` (edited in place: callers pass their own copy) after the module's five
    steps; raises :class:`~quant_core.errors.ModelError` when its Q/DQ formats need a
    newer opset than it declares."""
    shape_reads_quantized(model)
    keep_float_weights_float(model)
    keep_matmuls_out_of_matmulnbits(model)
    drop_unread(model)
    return FinishedModel(model, tuple(check_formats_opset(model)))


def reads_quantized_directly(node: onnx.NodeProto, dtype: DType) -> bool:
    """Whether ``node`` reads a tensor quantized to ``dtype`` through no DequantizeLinear:
    a standard Shape/Size (the same shape), except of 4-bit codes, which not every
    onnxruntime Shape kernel takes. Writers ask before adding a DequantizeLinear;
    :func:`shape_reads_quantized` rewires what a writer did not.

    Example:
        >>> reads_quantized_directly(helper.make_node("Shape", ["x"], ["s"]), DType.UINT8)
        True
    """
    return node.op_type in SHAPE_READERS and is_default_domain(node) and dtype.bits >= 8


def shape_reads_quantized(model: onnx.ModelProto) -> None:
    """``Shape``/``Size`` of a tensor that is also quantized read the quantized tensor
    instead (same shape): the input of the DequantizeLinear that produced the tensor they
    read, or the output of a QuantizeLinear of it that comes earlier in the graph (a later
    one would break the nodes' topological order). 4-bit codes excepted: not every
    onnxruntime Shape kernel takes them."""
    quantized: dict[str, str] = {}
    producers: dict[str, onnx.NodeProto] = {}
    four_bit = _four_bit_tensors(model)
    for node in model.graph.node:
        if node.input and reads_quantized_directly(node, DType.INT8):
            source = node.input[0]
            producer = producers.get(source)
            if producer is not None and producer.op_type == DEQUANTIZE and is_default_domain(producer):
                if producer.input[0] not in four_bit:
                    node.input[0] = producer.input[0]
            elif source in quantized:
                node.input[0] = quantized[source]
        if node.op_type == QUANTIZE and is_default_domain(node) and node.output[0] not in four_bit:
            quantized.setdefault(node.input[0], node.output[0])
        producers.update((out, node) for out in node.output)


def _four_bit_tensors(model: onnx.ModelProto) -> set[str]:
    """Integer tensors stored in 4 bits: initializers, and Q outputs whose zero point is 4-bit."""
    four = {onnx.TensorProto.INT4, onnx.TensorProto.UINT4}
    initializers = {t.name: t.data_type for t in model.graph.initializer}
    names = {name for name, data_type in initializers.items() if data_type in four}
    for node in model.graph.node:
        if node.op_type == QUANTIZE and len(node.input) > 2 and initializers.get(node.input[2]) in four:
            names.add(node.output[0])
    return names


def dequantize_qparams(index: GraphIndex, node: onnx.NodeProto) -> QParams | None:
    """The qparams a DequantizeLinear/QuantizeLinear reads, or None when its scale or zero
    point is not a constant (or its format is not an integer one)."""
    scale = index.constant(node.input[1]) if len(node.input) > 1 else None
    zero_name = node.input[2] if len(node.input) > 2 else ""
    zero_point = index.constant(zero_name) if zero_name else None
    if scale is None or (zero_name and zero_point is None):
        return None
    elem_type = index.elem_type(zero_name) if zero_name else onnx.TensorProto.UINT8
    dtype = DTYPE_OF_ONNX.get(elem_type or 0)
    if dtype is None:
        return None
    scale = np.asarray(scale, np.float32)
    zp = np.zeros(scale.shape, np.int64) if zero_point is None else np.asarray(zero_point, np.int64)
    axis = int_attribute(node, "axis", 1) if scale.ndim else None
    return QParams(scale=scale, zero_point=zp, dtype=dtype, axis=axis)


def _activation_reader(index: GraphIndex, tensor: str) -> onnx.NodeProto | None:
    """The DequantizeLinear of an activation (not of a constant) that writes ``tensor``."""
    producer = index.producer(tensor)
    if producer is None or producer.op_type != DEQUANTIZE or not is_default_domain(producer):
        return None
    return None if index.is_constant(producer.input[0]) else producer


def keep_float_weights_float(model: onnx.ModelProto) -> None:
    """Keep onnxruntime from quantizing the float weights and biases of quantized-input nodes.

    onnxruntime's WeightBiasQuantization (graph level BASIC, so in every default session;
    ``onnxruntime/core/optimizer/qdq_transformer/weight_bias_quantization.cc``) takes a
    Conv/ConvTranspose/Gemm that reads a per-tensor DequantizeLinear and feeds a
    QuantizeLinear for an unfinished QDQ unit: it quantizes a float weight initializer to
    int8 per tensor with a min/max zero point, and a float 1-D bias initializer to int32 at
    ``input_scale * weight_scale`` (EfficientNet-Lite0 at 16-bit activations and float
    weights: 3.8 dB in the default session, 51 dB node by node; a16w8 with float biases
    beside quantized weights: 1.7e-5 apart). It leaves a node alone whose input
    DequantizeLinear has more than one scale, whose bias is not an initializer, or whose
    output no QuantizeLinear reads (a float head writing a graph output: onnxruntime 1.32
    runs it as written, so it keeps its float bias). So, where the node feeds a
    QuantizeLinear:

    - a float weight: a multi-channel Conv reads its input through a per-channel
      DequantizeLinear repeating its one scale and zero point (same values; the float Conv
      keeps onnxruntime's NCHWc kernels, which need a constant bias), and any other such
      node gets its bias (zeros when it has none) as :func:`exact_int32` codes behind a
      DequantizeLinear. Neither form can reach an integer kernel: the weight is float;
    - a quantized weight beside a float bias (the bias rule's float case, which it allows
      only where no integer kernel reads the layer): the bias is stored as
      :func:`exact_int32` codes behind a DequantizeLinear."""
    index = GraphIndex(model.graph)
    builder = QDQBuilder(model, index)
    quantized = {node.input[0] for node in model.graph.node if node.op_type == QUANTIZE and node.input}
    placed: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        if node.op_type not in ORT_COMPLETED_OPS or not is_default_domain(node) or len(node.input) < 2:
            continue
        reader = _activation_reader(index, node.input[0])
        if reader is None or node.output[0] not in quantized:
            continue  # not a unit the rewrite completes: it needs a QuantizeLinear after the node
        qp = dequantize_qparams(index, reader)
        if qp is None or qp.axis is not None:
            continue
        weight = index.constant(node.input[1])
        if weight is None:
            dq = _float_bias_beside_quantized_weight(builder, index, node, qp.dtype)
        elif weight.dtype != np.float32:
            continue
        elif node.op_type == "Conv" and int(weight.shape[1]) * int_attribute(node, "group", 1) > 1:
            _spread_scale(builder, reader, qp, int(weight.shape[1]) * int_attribute(node, "group", 1))
            continue
        else:
            dq = _store_exact_bias(builder, index, node, weight.shape)
        if dq is not None:
            placed.setdefault(node.name or node.output[0], []).append(dq)
    if placed:
        _place_before(model, placed)


def _float_bias_beside_quantized_weight(
    builder: QDQBuilder, index: GraphIndex, node: onnx.NodeProto, activation: DType
) -> onnx.NodeProto | None:
    """``node``'s float 1-D bias initializer as exact int32 codes when its weight is
    quantized (read through a DequantizeLinear of a constant) and no integer kernel takes
    the unit (16-bit activations, wider weights, ConvTranspose); else nothing. An integer
    kernel reads its bias at ``input_scale * weight_scale``: there onnxruntime's own int32
    bias is the bias rule's product form, and per-element exact scales would be misread."""
    weight_dq = index.producer(node.input[1])
    if weight_dq is None or weight_dq.op_type != DEQUANTIZE or not index.is_constant(weight_dq.input[0]):
        return None
    weight = DTYPE_OF_ONNX.get(index.elem_type(weight_dq.input[0]) or 0)
    if weight is None or integer_kernel_reads(POLICIES[node.op_type], activation, weight):
        return None
    if len(node.input) < 3 or not node.input[2]:
        return None
    bias = index.constant(node.input[2])  # None for a computed bias (a DequantizeLinear of int32 codes)
    if bias is None or bias.dtype != np.float32:
        return None
    return _store_exact_bias(builder, index, node, ())


def _spread_scale(builder: QDQBuilder, dq: onnx.NodeProto, qp: QParams, channels: int) -> None:
    """Make activation DequantizeLinear ``dq`` per channel (axis 1) with ``qp`` repeated."""
    spread = attrs.evolve(
        qp, scale=np.full(channels, qp.scale, np.float32), zero_point=np.full(channels, qp.zero_point), axis=1
    )
    dq.input[1], dq.input[2] = builder.qparam_initializers(f"{dq.output[0]}_per_channel", spread)
    dq.attribute.append(helper.make_attribute("axis", 1))


def _store_exact_bias(
    builder: QDQBuilder, index: GraphIndex, node: onnx.NodeProto, weight_shape: tuple[int, ...]
) -> onnx.NodeProto | None:
    """Give ``node`` its float bias (zeros when it has none) as exact int32 codes behind a
    DequantizeLinear (returned, to be placed before ``node``)."""
    if len(node.input) > 2 and node.input[2]:
        bias = index.constant(node.input[2])
        if bias is None or bias.ndim != 1:  # onnxruntime rewrites only a 1-D bias initializer
            return None
        source = node.input[2]
    else:
        bias = np.zeros(output_channels(node, weight_shape), np.float32)
        del node.input[2:]
        source = builder.initializer(f"{node.name}_zero_bias", bias)
        node.input.append(source)
    codes, qp = exact_int32(bias)
    dq, output = builder.dequantized_constant(source, codes, qp)
    node.input[2] = output
    return dq


def _place_before(model: onnx.ModelProto, placed: dict[str, list[onnx.NodeProto]]) -> None:
    ordered: list[onnx.NodeProto] = []
    for node in model.graph.node:
        ordered.extend(placed.get(node.name or node.output[0], ()))
        ordered.append(node)
    del model.graph.node[:]
    model.graph.node.extend(ordered)


def _matmulnbits_candidate(node: onnx.NodeProto) -> bool:
    """A node onnxruntime's MatMulNBits rewrite considers: MatMul, or Gemm that is one
    (``transA = transB = 0``; writers fold alpha into the weight)."""
    if not is_default_domain(node):
        return False
    if node.op_type == "MatMul":
        return True
    return node.op_type == "Gemm" and not int_attribute(node, "transA", 0) and not int_attribute(node, "transB", 0)


def keep_matmuls_out_of_matmulnbits(model: onnx.ModelProto) -> None:
    """Keep onnxruntime from turning a MatMul/Gemm outside the integer kernels into MatMulNBits.

    onnxruntime (1.32: the DQ -> MatMulNBits selector of its QDQ transformer, level
    EXTENDED, so in every default session) rewrites a MatMul, or a ``Gemm(transB=0)``,
    whose weight is a 2/4/8-bit rank-2 initializer behind a DequantizeLinear that is per
    tensor (scalar scale) or per channel with ``axis`` 1 (written or by default) into
    ``com.microsoft:MatMulNBits``, unless an integer kernel (QLinearMatMul, QGemm,
    MatMulIntegerToFloat) took the node first, which it does for 8-bit activations and
    8-bit weights (:func:`~quant_core.qdq.guard_matmul_weight`). MatMulNBits quantizes its
    input to int8 blocks on the fly (accuracy level 4), so a 16-bit-activation layer (or a
    float-input one) computes about 150 output steps away from the file. The selector
    accepts no other form, so such a weight is written with ``axis=-1`` (the same last axis
    of the 2-D weight), per tensor as a one-element scale and zero point (the same values).
    Its node stays a float MatMul/Gemm between a DequantizeLinear and a QuantizeLinear,
    which is what the file defines; no integer kernel is lost, since none takes these
    formats."""
    index = GraphIndex(model.graph)
    initializers = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if not _matmulnbits_candidate(node) or len(node.input) < 2:
            continue
        dq = index.producer(node.input[1])
        if dq is None or dq.op_type != DEQUANTIZE or not is_default_domain(dq):
            continue
        codes = initializers.get(dq.input[0])
        weight_dtype = None if codes is None else DTYPE_OF_ONNX.get(codes.data_type)
        if codes is None or weight_dtype is None or len(codes.dims) != 2:
            continue
        reader = _activation_reader(index, node.input[0])
        reader_qp = None if reader is None else dequantize_qparams(index, reader)
        if not guard_matmul_weight(None if reader_qp is None else reader_qp.dtype, weight_dtype):
            continue  # an integer kernel takes it before MatMulNBits is tried
        scale = initializers.get(dq.input[1])
        per_channel = scale is not None and int(np.prod(scale.dims)) > 1
        if per_channel and int_attribute(dq, "axis", 1) % 2 != 1:
            continue  # not the last axis: -1 would mean another axis (and the selector refuses it)
        if not per_channel:
            for name in dq.input[1:3]:
                _one_element(model, index, initializers, dq, name)
        kept = [a for a in dq.attribute if a.name != "axis"]
        del dq.attribute[:]
        dq.attribute.extend([*kept, helper.make_attribute("axis", MATMUL_WEIGHT_AXIS)])


def _one_element(
    model: onnx.ModelProto,
    index: GraphIndex,
    initializers: dict[str, onnx.TensorProto],
    dq: onnx.NodeProto,
    name: str,
) -> None:
    """``dq``'s scalar qparam ``name`` as a one-element vector (still per tensor to every
    reader; rank 0 is what the selector takes): in place when only ``dq`` reads it, else
    as a new initializer."""
    tensor = initializers.get(name)
    if tensor is None or tensor.dims:
        return
    if [c.name for c in index.consumers(name)] == [dq.name]:
        tensor.dims.append(1)
        return
    vector = onnx.TensorProto()
    vector.CopyFrom(tensor)
    vector.name = index.unique_name(f"{name}_vector")
    vector.dims.append(1)
    model.graph.initializer.append(vector)
    initializers[vector.name] = vector
    dq.input[list(dq.input).index(name)] = vector.name


def drop_unread(model: onnx.ModelProto) -> None:
    """Remove the nodes whose outputs nothing reads (repeatedly), then the initializers
    nothing reads (subgraph reads count; graph inputs are kept)."""
    graph = model.graph
    outputs = {o.name for o in graph.output}
    while True:
        read = {name for node in graph.node for name in node_inputs(node)} | outputs
        dead = [n for n in graph.node if not any(out in read for out in n.output if out)]
        if not dead:
            break
        kept = [n for n in graph.node if all(n is not d for d in dead)]
        del graph.node[:]
        graph.node.extend(kept)
    read = {name for node in graph.node for name in node_inputs(node)} | outputs
    inputs = {i.name for i in graph.input}
    if any(t.name not in read and t.name not in inputs for t in graph.initializer):
        kept_initializers = [t for t in graph.initializer if t.name in read or t.name in inputs]
        del graph.initializer[:]
        graph.initializer.extend(kept_initializers)


def check_formats_opset(model: onnx.ModelProto) -> list[str]:
    """Refuse standard Q/DQ formats the model's opset does not take; declare the contrib
    domain where 16-bit pairs went there, with a note (returned)."""
    initializers = {t.name: t for t in model.graph.initializer}
    dtypes: set[DType] = set()
    contrib = False
    for node in model.graph.node:
        if node.op_type not in (QUANTIZE, DEQUANTIZE):
            continue
        if node.domain == CONTRIB_DOMAIN:
            contrib = True
            continue
        if node.domain not in DEFAULT_DOMAINS:
            continue
        zero_point = initializers.get(node.input[2]) if len(node.input) > 2 else None
        dtype = None if zero_point is None else DTYPE_OF_ONNX.get(zero_point.data_type)
        if dtype is not None:
            dtypes.add(dtype)
    opset = default_opset(model)
    needed = required_opset(dtypes)
    if opset < needed:
        raise ModelError(
            f"model opset {opset} is too old for these QDQ formats; allowed: >= {needed} "
            "(ModelQuantizer.prepare raises it)"
        )
    if not contrib:
        return []
    if not any(o.domain == CONTRIB_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(CONTRIB_DOMAIN, 1))
    return [
        f"16-bit QuantizeLinear/DequantizeLinear written in the {CONTRIB_DOMAIN} domain: the model's opset is "
        f"{opset} and the standard ops take 16-bit types from opset 21 (to stay in standard ONNX, "
        "raise it: in Python pass preprocess_options=PreprocessOptions(target_opset=21); for the "
        "quant-onnx command line, convert the float model first with "
        "onnx.version_converter.convert_version(model, 21) and quantize the converted file)"
    ]
