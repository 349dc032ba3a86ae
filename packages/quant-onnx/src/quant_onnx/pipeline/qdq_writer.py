"""Write a :class:`~quant_onnx.pipeline.calibrate.CalibratedModel` as a QDQ ONNX model that
onnxruntime runs with its integer kernels (``docs/onnxruntime.md``).

- Weights become integer initializers behind a DequantizeLinear (per-channel axis
  from the plan), biases as the bias rule says (:mod:`quant_core.bias`: int32 at
  ``input_scale * weight_scale`` with zero point 0 whenever that holds them); Gemm's
  ``alpha``/``beta`` are folded so both are 1.
- Every quantized activation gets one QuantizeLinear after its producer and one
  DequantizeLinear per consumer, so each Conv/Gemm/MatMul reads DQs only it consumes
  and writes exactly one Q. Ops that read only a tensor's shape (Shape, Size) read the
  quantized tensor itself: a DQ there would dequantize a whole activation (the model
  input, for torch's ``x.view(x.size(0), -1)``) to throw the values away.
  Graph outputs stay float: the producer's output is renamed
  and a final DequantizeLinear writes the output name.
- A fused Relu/Clip is dropped when the QuantizeLinear after its producer saturates at
  exactly its bounds; otherwise it stays between a DQ and a Q with the same qparams.
- A Conv/ConvTranspose/Gemm whose weight the config keeps float but whose input is
  quantized is written so that onnxruntime does not quantize that weight itself (see
  :meth:`_Writer.keep_float_weights_float`).
- ``activation_encoding="x86_uint8"`` (default) stores int8 activations as uint8 with
  the zero point shifted by 128 (the same real values, the encoding x86 kernels take);
  ``"as_spec"`` keeps the spec's dtype.
- A layer the plan gives its own input requantization (a layer mixed precision raised to
  16 bits) reads a QuantizeLinear/DequantizeLinear pair of the float tensor with those
  qparams instead of the group's; a fused activation the group's quantizer absorbed is
  put back in front of it when the requant's range would not apply it.
- 16-bit Q/DQ need opset 21 in the default domain; in an older model they are written in
  onnxruntime's ``com.microsoft`` domain (which takes them at any opset) and a note says
  so (raise the model's opset to 21 to stay in standard ONNX).

Example:
    >>> import numpy as np
    >>> from onnx import helper, numpy_helper, TensorProto
    >>> from quant_core.presets import get_preset
    >>> from quant_onnx.pipeline.annotate import plan_model
    >>> from quant_onnx.pipeline.calibrate import calibrate
    >>> w = numpy_helper.from_array(np.ones((2, 3, 1, 1), np.float32), "w")
    >>> g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
    ...     helper.make_node("Relu", ["c"], ["y"], name="relu")], "g",
    ...     [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 2, 2])],
    ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 2, 2])], [w])
    >>> m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    >>> data = [{"x": np.random.default_rng(0).normal(size=(1, 3, 2, 2)).astype(np.float32)}]
    >>> q = write_qdq(calibrate(m, plan_model(m, get_preset("a8w8")), data, quiet=True))
    >>> [n.op_type for n in q.graph.node]
    ['QuantizeLinear', 'DequantizeLinear', 'DequantizeLinear', 'Conv', 'QuantizeLinear', 'DequantizeLinear']
"""

from __future__ import annotations

import logging

import attrs
import numpy as np
import onnx
from onnx import helper, numpy_helper

from quant_core.bias import BiasRule, EncodedBias, encode_bias
from quant_core.dtypes import DType
from quant_core.plan import BiasSlot, FusedActivation, InputRequant
from quant_core.qdq import (
    BASE_QDQ_OPSET,
    MATMUL_WEIGHT_AXIS,
    ActivationEncoding,
    activation_is_absorbed,
    bound_is_absorbed,
    encode_activation,
    encode_activation_dtype,
    exact_int32,
    guard_matmul_weight,
    required_opset,
)
from quant_core.qdq import output_channels as qdq_output_channels
from quant_core.qparams import QParams, quantize
from quant_onnx.graph import DEFAULT_DOMAINS, GraphIndex, is_default_domain, node_attribute
from quant_onnx.pipeline.calibrate import CalibratedModel
from quant_onnx.tensor_types import DTYPE_OF_ONNX, ONNX_DTYPES

_LOG = logging.getLogger(__name__)

__all__ = [  # the QDQ facts from quant_core.qdq are part of this module's interface
    "BASE_QDQ_OPSET",
    "MS_DOMAIN",
    "SHAPE_READERS",
    "ActivationEncoding",
    "WriterOptions",
    "WrittenModel",
    "activation_is_absorbed",
    "bound_is_absorbed",
    "encode_activation",
    "encode_activation_dtype",
    "exact_int32",
    "output_channels",
    "required_opset",
    "write_qdq",
    "write_qdq_with_notes",
]

MS_DOMAIN = "com.microsoft"
"""onnxruntime's contrib domain: its QuantizeLinear/DequantizeLinear take 16-bit types at any opset."""

# The QDQ facts both backends share (opset per format, x86 uint8 encoding, fused
# activations the quantizer absorbs) live in quant_core.qdq; re-exported here.
SHAPE_READERS = frozenset({"Shape", "Size"})
"""Ops whose output depends only on their input's shape."""

ORT_COMPLETED_OPS = frozenset({"Conv", "ConvTranspose", "Gemm"})
"""Ops whose float weight and bias onnxruntime quantizes itself when they read a DequantizeLinear."""


@attrs.frozen
class WriterOptions:
    """How the QDQ model is encoded.

    Args:
        activation_encoding: ``"x86_uint8"`` stores int8 activations as uint8 with zero
            point + 128 (identical real values; what onnxruntime's x86 kernels fuse);
            ``"as_spec"`` keeps the spec's dtype (NPU flows, ARM).
        drop_fused_activations: remove a fused Relu/Clip when the quantizer's saturation
            reproduces it exactly.

    Example:
        >>> WriterOptions(activation_encoding="as_spec").activation_encoding
        'as_spec'
    """

    activation_encoding: ActivationEncoding = attrs.field(default="x86_uint8")
    drop_fused_activations: bool = True

    @activation_encoding.validator
    def _check(self, _attribute: object, value: str) -> None:
        if value not in ("x86_uint8", "as_spec"):
            raise ValueError(f"activation_encoding: {value!r} is not allowed; allowed: x86_uint8, as_spec")


def output_channels(node: onnx.NodeProto, weight: np.ndarray) -> int:
    """Length of a Conv/ConvTranspose/Gemm bias (its output channels) given its weight.

    Example:
        >>> output_channels(helper.make_node("Gemm", ["a", "b"], ["y"], transB=1), np.zeros((4, 3)))
        4
    """
    group = int(node_attribute(node, "group", 1))
    trans_b = bool(node_attribute(node, "transB", 0))
    return qdq_output_channels(node.op_type, weight.shape, group=group, trans_b=trans_b)


class _Writer:
    def __init__(self, calibrated: CalibratedModel, options: WriterOptions) -> None:
        self.cal = calibrated
        self.options = options
        self.model = onnx.ModelProto()
        self.model.CopyFrom(calibrated.model)
        self.graph = self.model.graph
        self.index = GraphIndex(self.graph)
        self.nodes = {node.name: node for node in self.graph.node}
        self.before: dict[str, list[onnx.NodeProto]] = {}  # node name -> DQs to place before it
        self.after: dict[str, list[onnx.NodeProto]] = {}  # node name -> Q (and output DQ) after it
        self.head: list[onnx.NodeProto] = []
        self.removed_nodes: set[str] = set()
        self.replaced: set[str] = set()  # float constants now stored as integers, or no longer read
        self.vanished: set[str] = set()  # tensors that no longer exist
        self.dequantized: dict[str, str] = {}  # float tensor -> quantized integer initializer name
        self.notes: list[str] = []
        self.biases: dict[str, EncodedBias] = {}  # node -> how its bias was stored
        self.float_source: dict[str, str] = {}  # activation -> the float tensor its quantizer reads
        self.opset = next((o.version for o in self.model.opset_import if o.domain in DEFAULT_DOMAINS), 0)
        self.ms_domain_used = False
        self.folded: dict[str, np.ndarray] = {}  # constants created here (Gemm alpha/beta folded)
        self.activation_dqs: dict[str, tuple[onnx.NodeProto, QParams]] = {}  # DQ output -> (DQ, qparams)
        self.weight_dqs: dict[str, tuple[onnx.NodeProto, QParams, tuple[int, ...]]] = {}  # node -> (DQ, qp, shape)

    # --- helpers -----------------------------------------------------------------------------
    def initializer(self, prefix: str, value: np.ndarray, dtype: DType | None = None) -> str:
        name = self.index.unique_name(prefix)
        if dtype in (DType.INT4, DType.UINT4):
            tensor = helper.make_tensor(name, ONNX_DTYPES[dtype], value.shape, value.reshape(-1).tolist())
        else:
            tensor = numpy_helper.from_array(np.array(value, order="C"), name)
        self.graph.initializer.append(tensor)
        return name

    def qparam_initializers(self, base: str, qp: QParams) -> tuple[str, str]:
        scale = self.initializer(f"{base}_scale", np.asarray(qp.scale, np.float32))
        zero_point = np.asarray(qp.zero_point).astype(qp.dtype.numpy_dtype)
        return scale, self.initializer(f"{base}_zero_point", zero_point, qp.dtype)

    def qdq_node(self, op: str, source: str, output: str, params: tuple[str, str], qp: QParams) -> onnx.NodeProto:
        name = self.index.unique_name(f"{output}_{op}")
        domain = self.domain_for(qp.dtype)
        # An explicit empty domain would be serialized: standard nodes leave it unset.
        node = helper.make_node(op, [source, *params], [output], name=name, **({"domain": domain} if domain else {}))
        if qp.axis is not None:
            node.attribute.append(helper.make_attribute("axis", int(qp.axis)))
        return node

    def domain_for(self, dtype: DType) -> str:
        """The default domain, or com.microsoft for 16-bit Q/DQ below opset 21."""
        if dtype.bits == 16 and self.opset < required_opset([dtype]):
            self.ms_domain_used = True
            return MS_DOMAIN
        return ""

    def dequantize_for_consumers(
        self, quantized: str, float_name: str, params: tuple[str, str], qp: QParams, consumers: list[onnx.NodeProto]
    ) -> None:
        """One DequantizeLinear per consumer node (what lets onnxruntime fuse each one);
        shape readers read ``quantized`` directly (4-bit codes excepted: not every
        onnxruntime Shape kernel takes them)."""
        for consumer in consumers:
            if consumer.op_type in SHAPE_READERS and is_default_domain(consumer) and qp.dtype.bits >= 8:
                source = quantized
            else:
                source = self.index.unique_name(f"{float_name}_DequantizeLinear_Output")
                dq = self.qdq_node("DequantizeLinear", quantized, source, params, qp)
                self.before.setdefault(consumer.name, []).append(dq)
                self.activation_dqs[source] = (dq, qp)
            for i, name in enumerate(consumer.input):
                if name == float_name:
                    consumer.input[i] = source

    def main_consumers(self, tensor: str) -> list[onnx.NodeProto]:
        """Consumers in the main graph (subgraphs keep reading the float tensor) that read
        the tensor's group quantizer (not those with their own requantization)."""
        plan = self.cal.plan
        unique = {
            c.name: c
            for c in self.index.consumers(tensor)
            if tensor in c.input and plan.requant_of(c.name, tensor) is None
        }
        return list(unique.values())

    # --- passes --------------------------------------------------------------------------------
    def drop_fused(self, fused: FusedActivation) -> None:
        qp = self.cal.qparams_of(fused.post_tensor)
        if qp is None:
            return
        if not activation_is_absorbed(qp, fused.bounds):
            self.simplify_kept(fused, qp)
            return
        producer = self.nodes[fused.producer]
        for i, name in enumerate(producer.output):
            if name == fused.pre_tensor:
                producer.output[i] = fused.post_tensor
        self.removed_nodes.add(fused.node)
        self.vanished.add(fused.pre_tensor)
        # A Clip's bounds go with it (assemble() drops them unless something else reads them).
        self.replaced.update(name for name in self.nodes[fused.node].input[1:] if name)

    def simplify_kept(self, fused: FusedActivation, qp: QParams) -> None:
        """A kept Clip whose upper bound saturation already applies loses that bound
        (Clip(0, 6) becomes Relu): onnxruntime converts float bounds to codes and a huge
        ``bound / scale`` (tiny activations) overflows there."""
        node = self.nodes[fused.node]
        lo, hi = fused.bounds
        if node.op_type != "Clip" or not np.isfinite(hi) or not bound_is_absorbed(qp, hi, qp.qmax):
            return
        if lo == 0.0:
            node.op_type = "Relu"
            self.replaced.update(name for name in node.input[1:] if name)
            del node.input[1:]
        elif len(node.input) > 2:
            self.replaced.update(name for name in node.input[2:] if name)
            del node.input[2:]

    def constant(self, name: str) -> np.ndarray | None:
        return self.folded[name] if name in self.folded else self.index.constant(name)

    def normalize_gemm(self, node: onnx.NodeProto) -> None:
        """Fold ``alpha`` into the weight and ``beta`` into the bias (integer Gemm needs 1, 1)."""
        alpha = float(node_attribute(node, "alpha", 1.0))
        beta = float(node_attribute(node, "beta", 1.0))
        if len(node.input) > 2 and node.input[2] and beta != 1.0:
            bias = self.constant(node.input[2])
            if bias is not None:  # a run-time C keeps beta; the Gemm then stays as written
                self.replaced.add(node.input[2])
                node.input[2] = self.fold(f"{node.input[2]}_beta", bias * np.float32(beta))
                beta = 1.0
        if alpha != 1.0:
            weight = self.constant(node.input[1])
            if weight is not None:
                self.replaced.add(node.input[1])
                node.input[1] = self.fold(f"{node.input[1]}_alpha", weight * np.float32(alpha))
                alpha = 1.0
        kept = [a for a in node.attribute if a.name not in ("alpha", "beta")]
        del node.attribute[:]
        node.attribute.extend(kept)
        if alpha != 1.0:
            node.attribute.append(helper.make_attribute("alpha", alpha))
        if beta != 1.0:
            node.attribute.append(helper.make_attribute("beta", beta))

    def fold(self, prefix: str, value: np.ndarray) -> str:
        name = self.initializer(prefix, value.astype(np.float32))
        self.folded[name] = value.astype(np.float32)
        return name

    def store_constant(self, node: onnx.NodeProto, index: int, codes: np.ndarray, qp: QParams) -> onnx.NodeProto:
        """Replace ``node``'s constant input ``index`` by integer codes behind a DequantizeLinear
        (returned)."""
        source = node.input[index]
        quantized = self.initializer(f"{source}_quantized", codes, qp.dtype)
        params = self.qparam_initializers(source, qp)
        output = self.index.unique_name(f"{source}_DequantizeLinear_Output")
        dq = self.qdq_node("DequantizeLinear", quantized, output, params, qp)
        self.before.setdefault(node.name, []).append(dq)
        node.input[index] = output
        self.replaced.add(source)
        return dq

    def write_weights(self) -> None:
        for slot in self.cal.plan.weights:
            node = self.nodes[slot.node]
            if node.op_type == "Gemm":
                self.normalize_gemm(node)
            value = self.constant(node.input[slot.input_index])
            if value is None:  # the float model given to the writer no longer has it constant
                raise ValueError(f"node {slot.node!r}: weight {slot.tensor!r} is not a constant")
            qp = self.cal.weight_qparams[slot.node]
            dq = self.store_constant(node, slot.input_index, quantize(value, qp), qp)
            self.weight_dqs[slot.node] = (dq, qp, value.shape)

    def write_bias(self, slot: BiasSlot) -> None:
        node = self.nodes[slot.node]
        value = self.constant(node.input[slot.input_index])
        input_qp = self.cal.input_qparams(slot.node, slot.input_tensor)
        if value is None or input_qp is None:
            self.notes.append(f"node {slot.node!r}: bias kept float (its input is not quantized)")
            return
        weight_qp = self.cal.weight_qparams[slot.node]
        value = self.per_channel_bias(node, value)
        spec = slot.spec
        # int32 per channel: the default rule, an int32 spec, or a float spec an integer kernel overrides.
        integer = spec is None or spec.dtype is DType.INT32 or (not spec.is_quantized and slot.integer_kernel)
        if integer and weight_qp.scale.ndim and value.size != weight_qp.scale.shape[0]:
            self.notes.append(f"node {slot.node!r}: bias of shape {list(value.shape)} kept float (not one per channel)")
            return
        if integer and weight_qp.scale.ndim:
            value = value.reshape(-1)  # Gemm's C may be [1, N]; the int32 bias is per channel
        encoded = encode_bias(value, input_qp.scale, weight_qp, slot.spec, integer_kernel=slot.integer_kernel)
        self.biases[slot.node] = encoded
        if encoded.note is not None:
            self.notes.append(f"node {slot.node!r}: {encoded.note}")
        if encoded.codes is not None and encoded.qparams is not None:
            self.store_constant(node, slot.input_index, encoded.codes, encoded.qparams)
        elif encoded.rule is BiasRule.FLOAT:
            # A float bias initializer beside a quantized input and weight is what onnxruntime's
            # WeightBiasQuantization re-quantizes at input x weight scale (see keep_float_weights_float):
            # exact int32 codes with a power-of-two scale per element keep it bit for bit.
            codes, qp = exact_int32(value)
            self.store_constant(node, slot.input_index, codes, qp)

    def per_channel_bias(self, node: onnx.NodeProto, value: np.ndarray) -> np.ndarray:
        """A Gemm's broadcast bias (one value, shape [], [1] or [1, 1]) as one value per output
        channel: the same sums, in the 1-D form the bias rule and onnxruntime's QGemm take."""
        if node.op_type != "Gemm" or value.size != 1 or node.name not in self.weight_dqs:
            return value
        weight_shape = self.weight_dqs[node.name][2]
        channels = output_channels(node, np.broadcast_to(np.float32(0), weight_shape))  # a shape, no copy
        return np.full(channels, value.reshape(-1)[0], np.float32)

    def keep_float_weights_float(self) -> None:
        """Keep onnxruntime from quantizing the float weights of quantized-input nodes.

        onnxruntime's WeightBiasQuantization (graph level BASIC, so in every default session;
        ``onnxruntime/core/optimizer/qdq_transformer/weight_bias_quantization.cc``) takes a
        Conv/ConvTranspose/Gemm that reads a per-tensor DequantizeLinear and feeds a
        QuantizeLinear for an unfinished QDQ unit: it quantizes a float weight initializer to
        int8 per tensor with a min/max zero point, and a float 1-D bias initializer to int32 at
        ``input_scale * weight_scale`` (EfficientNet-Lite0 at 16-bit activations and float
        weights: 3.8 dB in the default session, 51 dB node by node). It leaves a node alone
        whose input DequantizeLinear has more than one scale or whose bias is not an
        initializer. So a multi-channel Conv reads its input through a per-channel
        DequantizeLinear repeating its one scale and zero point (same values; the float Conv
        keeps onnxruntime's NCHWc kernels, which need a constant bias), and any other such
        node gets its bias (zeros when it has none) as :func:`exact_int32` codes behind a
        DequantizeLinear. Neither form can reach an integer kernel: the weight is float."""
        for node in self.graph.node:
            if node.op_type not in ORT_COMPLETED_OPS or not is_default_domain(node) or len(node.input) < 2:
                continue
            weight = self.constant(node.input[1])
            reader = self.activation_dqs.get(node.input[0])
            if weight is None or weight.dtype != np.float32 or reader is None:
                continue
            group = int(node_attribute(node, "group", 1))
            channels = int(weight.shape[1]) * group if node.op_type == "Conv" else 1
            if channels > 1:
                self.spread_scale(*reader, channels)
            else:
                self.store_exact_bias(node, weight)

    def spread_scale(self, dq: onnx.NodeProto, qp: QParams, channels: int) -> None:
        """Make activation DequantizeLinear ``dq`` per channel (axis 1) with ``qp`` repeated."""
        spread = attrs.evolve(
            qp, scale=np.full(channels, qp.scale, np.float32), zero_point=np.full(channels, qp.zero_point), axis=1
        )
        dq.input[1], dq.input[2] = self.qparam_initializers(f"{dq.output[0]}_per_channel", spread)
        dq.attribute.append(helper.make_attribute("axis", 1))

    def store_exact_bias(self, node: onnx.NodeProto, weight: np.ndarray) -> None:
        """Give ``node`` its float bias (zeros when it has none) as exact int32 codes behind a DQ."""
        if len(node.input) > 2 and node.input[2]:
            bias = self.constant(node.input[2])
            if bias is None or bias.ndim != 1:  # onnxruntime rewrites only a 1-D bias initializer
                return
        else:
            bias = np.zeros(output_channels(node, weight), np.float32)
            del node.input[2:]
            node.input.append(self.initializer(f"{node.name}_zero_bias", bias))
        codes, qp = exact_int32(bias)
        self.store_constant(node, 2, codes, qp)

    def keep_matmuls_out_of_matmulnbits(self) -> None:
        """Keep onnxruntime from turning a MatMul/Gemm outside the integer kernels into MatMulNBits.

        onnxruntime (1.32: the DQ -> MatMulNBits selector of its QDQ transformer, level
        EXTENDED, so in every default session) rewrites a MatMul, or a ``Gemm(transB=0)``,
        whose weight is a 2/4/8-bit rank-2 initializer behind a DequantizeLinear that is per
        tensor (scalar scale) or per channel with ``axis`` 1 (written or by default) into
        ``com.microsoft:MatMulNBits``, unless an integer kernel (QLinearMatMul, QGemm,
        MatMulIntegerToFloat) took the node first, which it does for 8-bit activations and
        8-bit weights. MatMulNBits quantizes its input to int8 blocks on the fly (accuracy
        level 4), so a 16-bit-activation layer (or a float-input one) computes about 150
        output steps away from the file. The selector accepts no other form, so such a weight
        is written with ``axis=-1`` (the same last axis of the 2-D weight), per tensor as a
        one-element scale and zero point (the same values). Its node stays a float MatMul/Gemm
        between a DequantizeLinear and a QuantizeLinear, which is what the file defines; no
        integer kernel is lost, since none takes these formats."""
        for name, (dq, qp, shape) in self.weight_dqs.items():
            node = self.nodes[name]
            rank = len(shape)
            if not self.matmulnbits_candidate(node) or node.input[1] != dq.output[0]:
                continue
            reader = self.activation_dqs.get(node.input[0])
            if not guard_matmul_weight(None if reader is None else reader[1].dtype, qp.dtype):
                continue  # an integer kernel takes it before MatMulNBits is tried
            if qp.axis is not None and int(qp.axis) % rank != rank - 1:
                continue  # not the last axis: -1 would mean another axis (and the selector refuses it)
            if qp.axis is None:
                self.one_element_qparams(dq)
            kept = [a for a in dq.attribute if a.name != "axis"]
            del dq.attribute[:]
            dq.attribute.extend([*kept, helper.make_attribute("axis", MATMUL_WEIGHT_AXIS)])

    @staticmethod
    def matmulnbits_candidate(node: onnx.NodeProto) -> bool:
        """A node onnxruntime's MatMulNBits rewrite considers: MatMul, or Gemm that is one
        (``transA = transB = 0``; the writer already folded alpha into the weight)."""
        if not is_default_domain(node):
            return False
        if node.op_type == "MatMul":
            return True
        return (
            node.op_type == "Gemm" and not node_attribute(node, "transA", 0) and not node_attribute(node, "transB", 0)
        )

    def one_element_qparams(self, dq: onnx.NodeProto) -> None:
        """Store a per-tensor DequantizeLinear's scalar scale and zero point as 1-element
        vectors (still per tensor to every reader; rank 1 is what the selector refuses)."""
        names = set(dq.input[1:3])
        for tensor in self.graph.initializer:
            if tensor.name in names and not tensor.dims:
                tensor.dims.append(1)

    def write_activation(self, tensor: str, qp: QParams) -> None:
        consumers = self.main_consumers(tensor)
        value = self.index.constant(tensor)
        is_output = self.index.is_graph_output(tensor)
        if not consumers and not is_output:
            return
        if value is not None:  # a constant operand (e.g. Add's): stored as integers
            params = self.qparam_initializers(tensor, qp)
            quantized = self.initializer(f"{tensor}_quantized", quantize(value, qp), qp.dtype)
            self.dequantize_for_consumers(quantized, tensor, params, qp, consumers)
            self.replaced.add(tensor)
            return
        producer = self.index.producer(tensor)
        source = tensor
        if is_output:
            source = self.index.unique_name(f"{tensor}_float")
            if producer is not None:
                for i, name in enumerate(producer.output):
                    if name == tensor:
                        producer.output[i] = source
        self.float_source[tensor] = source
        params = self.qparam_initializers(tensor, qp)
        quantized = self.index.unique_name(f"{tensor}_QuantizeLinear_Output")
        q_nodes = [self.qdq_node("QuantizeLinear", source, quantized, params, qp)]
        if is_output:
            q_nodes.append(self.qdq_node("DequantizeLinear", quantized, tensor, params, qp))
        if producer is None:
            self.head.extend(q_nodes)
        else:
            self.after.setdefault(producer.name, []).extend(q_nodes)
        self.dequantize_for_consumers(quantized, tensor, params, qp, consumers)

    def write_requant(self, requant: InputRequant) -> None:
        """Layer ``requant.node`` reads its own Q/DQ pair of the float tensor."""
        consumer = self.nodes[requant.node]
        tensor = requant.tensor
        qp = encode_activation(self.cal.requant_qparams[requant.key], self.options.activation_encoding)
        base = f"{requant.node}_{tensor}"
        params = self.qparam_initializers(base, qp)
        value = self.index.constant(tensor)
        if value is not None:
            quantized = self.initializer(f"{base}_quantized", quantize(value, qp), qp.dtype)
            self.dequantize_for_consumers(quantized, tensor, params, qp, [consumer])
            return
        source = self.float_source.get(tensor, tensor)
        producer = self.index.producer(source)
        place = self.after.setdefault(producer.name, []) if producer is not None else self.head
        fused = next((f for f in self.cal.plan.fused if f.post_tensor == tensor), None)
        if fused is not None and fused.node in self.removed_nodes and not activation_is_absorbed(qp, fused.bounds):
            # The group's quantizer applied this activation by saturating; this one would not.
            source = self.activation_node(source, fused, place)
        quantized = self.index.unique_name(f"{base}_QuantizeLinear_Output")
        place.append(self.qdq_node("QuantizeLinear", source, quantized, params, qp))
        self.dequantize_for_consumers(quantized, tensor, params, qp, [consumer])

    def activation_node(self, source: str, fused: FusedActivation, place: list[onnx.NodeProto]) -> str:
        """A copy of a dropped Relu/Clip applied to ``source`` (appended to ``place``)."""
        output = self.index.unique_name(f"{source}_{fused.op_type}")
        lo, hi = fused.bounds
        if fused.op_type == "Relu" or (lo == 0.0 and not np.isfinite(hi)):
            place.append(helper.make_node("Relu", [source], [output], name=self.index.unique_name(output)))
            return output
        bounds = [
            self.initializer(f"{output}_{end}", np.asarray(b, np.float32)) for end, b in (("min", lo), ("max", hi))
        ]
        place.append(helper.make_node("Clip", [source, *bounds], [output], name=self.index.unique_name(output)))
        return output

    def assemble(self) -> None:
        ordered: list[onnx.NodeProto] = list(self.head)
        for node in self.graph.node:
            ordered.extend(self.before.get(node.name, ()))
            ordered.append(node)
            ordered.extend(self.after.get(node.name, ()))
        used = {name for node in ordered for name in node.input} | {o.name for o in self.graph.output}
        ordered = [
            n
            for n in ordered
            if not (n.op_type == "Constant" and n.output[0] in self.replaced and n.output[0] not in used)
        ]
        del self.graph.node[:]
        self.graph.node.extend(ordered)
        kept = [t for t in self.graph.initializer if t.name in used or t.name not in self.replaced]
        del self.graph.initializer[:]
        self.graph.initializer.extend(kept)
        inputs = [v for v in self.graph.input if not (v.name in self.replaced and v.name not in used)]
        del self.graph.input[:]
        self.graph.input.extend(inputs)
        infos = [v for v in self.graph.value_info if v.name not in self.vanished]
        del self.graph.value_info[:]
        self.graph.value_info.extend(infos)

    def run(self) -> onnx.ModelProto:
        plan = self.cal.plan
        if self.options.drop_fused_activations:
            for fused in plan.fused:
                self.drop_fused(fused)
            kept = [node for node in self.graph.node if node.name not in self.removed_nodes]
            del self.graph.node[:]
            self.graph.node.extend(kept)
            # extend() copies the protos: re-index the copies (producers changed too).
            self.nodes = {node.name: node for node in self.graph.node}
            self.index = GraphIndex(self.graph)
        self.write_weights()
        for bias in plan.biases:
            if bias.tensor:  # an empty slot: the layer has no bias to store
                self.write_bias(bias)
        for group in plan.groups:
            qp = encode_activation(self.cal.activation_qparams[group.key], self.options.activation_encoding)
            for tensor in group.members:
                if tensor not in self.vanished:
                    self.write_activation(tensor, qp)
        for requant in plan.requants:
            self.write_requant(requant)
        self.keep_float_weights_float()
        self.keep_matmuls_out_of_matmulnbits()
        self.assemble()
        self.check_opset()
        return self.model

    def check_opset(self) -> None:
        """Default-domain Q/DQ formats the model's opset takes; the com.microsoft domain
        declared (and said) where 16-bit pairs went there."""
        initializers = {t.name: t for t in self.graph.initializer}
        dtypes = set()
        for node in self.graph.node:
            if node.op_type in ("QuantizeLinear", "DequantizeLinear") and node.domain in DEFAULT_DOMAINS:
                zero_point = initializers.get(node.input[2]) if len(node.input) > 2 else None
                dtype = None if zero_point is None else DTYPE_OF_ONNX.get(zero_point.data_type)
                if dtype is not None:
                    dtypes.add(dtype)
        needed = required_opset(dtypes)
        if self.opset < needed:
            raise ValueError(
                f"model opset {self.opset} is too old for these QDQ formats; allowed: >= {needed} "
                "(ModelQuantizer.prepare raises it)"
            )
        if self.ms_domain_used:
            if not any(o.domain == MS_DOMAIN for o in self.model.opset_import):
                self.model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
            self.notes.append(
                f"16-bit QuantizeLinear/DequantizeLinear written in the {MS_DOMAIN} domain: the model's opset is "
                f"{self.opset} and the standard ops take 16-bit types from opset 21 (to stay in standard ONNX, "
                "raise it: in Python pass preprocess_options=PreprocessOptions(target_opset=21); for the "
                "quant-onnx command line, convert the float model first with "
                "onnx.version_converter.convert_version(model, 21) and quantize the converted file)"
            )


@attrs.frozen(eq=False)
class WrittenModel:
    """The writer's result: the QDQ ``model``, the ``notes`` it had to make (biases kept
    float or widened, activations left in place) and how each layer's bias was stored
    (``biases``: node name -> :class:`~quant_core.bias.EncodedBias`), for reports.

    Example:
        >>> WrittenModel(onnx.ModelProto(), [], {}).bias_rules()
        {}
    """

    model: onnx.ModelProto
    notes: list[str]
    biases: dict[str, EncodedBias]

    def bias_rules(self) -> dict[str, BiasRule]:
        return {node: encoded.rule for node, encoded in self.biases.items()}


def write_qdq(calibrated: CalibratedModel, options: WriterOptions | None = None) -> onnx.ModelProto:
    """The QDQ model for ``calibrated`` (a new model; the calibrated one is not modified)."""
    return write_qdq_with_notes(calibrated, options).model


def write_qdq_with_notes(calibrated: CalibratedModel, options: WriterOptions | None = None) -> WrittenModel:
    """:func:`write_qdq` plus what the writer had to decide (biases kept float or at a
    wider scale, activations kept in place), for reports."""
    writer = _Writer(calibrated, options or WriterOptions())
    model = writer.run()
    for note in writer.notes:
        _LOG.warning(note)
    return WrittenModel(model, list(writer.notes), dict(writer.biases))
