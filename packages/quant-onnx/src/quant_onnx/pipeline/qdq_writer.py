"""Write a :class:`~quant_onnx.pipeline.calibrate.CalibratedModel` as a QDQ ONNX model that
onnxruntime runs with its integer kernels (``docs/onnxruntime.md``).

- Weights become integer initializers behind a DequantizeLinear (per-channel axis
  from the plan), biases as the bias rule says (:mod:`quant_core.bias`: int32 at
  ``input_scale * weight_scale`` with zero point 0 whenever that holds them); Gemm's
  ``alpha``/``beta`` are folded so both are 1.
- Every quantized activation gets one QuantizeLinear after its producer and one
  DequantizeLinear per consumer, so each Conv/Gemm/MatMul reads DQs only it consumes
  and writes exactly one Q. Graph outputs stay float: the producer's output is renamed
  and a final DequantizeLinear writes the output name.
- A fused Relu/Clip is dropped when the QuantizeLinear after its producer saturates at
  exactly its bounds; otherwise it stays between a DQ and a Q with the same qparams.
- The written model is finished for onnxruntime by the QDQ layer
  (:func:`quant_core.onnx_qdq.finish.finish_for_onnxruntime`): Shape/Size read quantized
  tensors, float weights of quantized-input layers and MatMul weights no integer kernel
  takes are kept from onnxruntime's own rewrites, unread tensors go.
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
from onnx import helper

from quant_core.bias import BiasRule, EncodedBias, encode_layer_bias
from quant_core.errors import ModelError
from quant_core.onnx_qdq.build import DEQUANTIZE, QUANTIZE, QDQBuilder, output_channels
from quant_core.onnx_qdq.finish import finish_for_onnxruntime, reads_quantized_directly
from quant_core.onnx_qdq.graph import GraphIndex, node_attribute, node_inputs
from quant_core.plan import BiasSlot, FusedActivation, InputRequant
from quant_core.qdq import (
    ActivationEncoding,
    activation_is_absorbed,
    bound_is_absorbed,
    check_activation_encoding,
    encode_activation,
)
from quant_core.qparams import QParams, quantize
from quant_onnx.pipeline.calibrate import CalibratedModel

_LOG = logging.getLogger(__name__)


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
        check_activation_encoding(value)


class _Writer:
    def __init__(self, calibrated: CalibratedModel, options: WriterOptions) -> None:
        self.cal = calibrated
        self.options = options
        self.model = onnx.ModelProto()
        self.model.CopyFrom(calibrated.model)
        self.graph = self.model.graph
        self.builder = QDQBuilder(self.model)
        self.nodes = {node.name: node for node in self.graph.node}
        self.before: dict[str, list[onnx.NodeProto]] = {}  # node name -> DQs to place before it
        self.after: dict[str, list[onnx.NodeProto]] = {}  # node name -> Q (and output DQ) after it
        self.head: list[onnx.NodeProto] = []
        self.removed_nodes: set[str] = set()
        self.replaced: set[str] = set()  # float constants now stored as integers, or no longer read
        self.vanished: set[str] = set()  # tensors that no longer exist
        self.notes: list[str] = []
        self.biases: dict[str, EncodedBias] = {}  # node -> how its bias was stored
        self.float_source: dict[str, str] = {}  # activation -> the float tensor its quantizer reads
        self.folded: dict[str, np.ndarray] = {}  # constants created here (Gemm alpha/beta folded)
        self.weight_shapes: dict[str, tuple[int, ...]] = {}  # node -> its quantized weight's shape

    @property
    def index(self) -> GraphIndex:
        return self.builder.index

    # --- helpers -----------------------------------------------------------------------------
    def dequantize_for_consumers(
        self, quantized: str, float_name: str, params: tuple[str, str], qp: QParams, consumers: list[onnx.NodeProto]
    ) -> None:
        """One DequantizeLinear per consumer node (what lets onnxruntime fuse each one);
        shape readers read ``quantized`` itself (:func:`reads_quantized_directly`)."""
        for consumer in consumers:
            if reads_quantized_directly(consumer, qp.dtype):
                source = quantized
            else:
                source = self.index.unique_name(f"{float_name}_DequantizeLinear_Output")
                dq = self.builder.qdq_node(DEQUANTIZE, quantized, source, params, qp)
                self.before.setdefault(consumer.name, []).append(dq)
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
        name = self.builder.initializer(prefix, value.astype(np.float32))
        self.folded[name] = value.astype(np.float32)
        return name

    def store_constant(self, node: onnx.NodeProto, index: int, codes: np.ndarray, qp: QParams) -> None:
        """Replace ``node``'s constant input ``index`` by integer codes behind a DequantizeLinear."""
        source = node.input[index]
        dq, output = self.builder.dequantized_constant(source, codes, qp)
        self.before.setdefault(node.name, []).append(dq)
        node.input[index] = output
        self.replaced.add(source)

    def write_weights(self) -> None:
        for slot in self.cal.plan.weights:
            node = self.nodes[slot.node]
            if node.op_type == "Gemm":
                self.normalize_gemm(node)
            value = self.constant(node.input[slot.input_index])
            if value is None:  # the float model given to the writer no longer has it constant
                raise ModelError(f"node {slot.node!r}: weight {slot.tensor!r} is not a constant")
            qp = self.cal.weight_qparams[slot.node]
            self.store_constant(node, slot.input_index, quantize(value, qp), qp)
            self.weight_shapes[slot.node] = value.shape

    def write_bias(self, slot: BiasSlot) -> None:
        node = self.nodes[slot.node]
        value = self.constant(node.input[slot.input_index])
        if value is not None:
            value = self.per_channel_bias(node, value)
        input_qp = self.cal.input_qparams(slot.node, slot.input_tensor)
        weight_qp = self.cal.weight_qparams[slot.node]
        encoded, notes = encode_layer_bias(
            slot.node,
            value,
            None if input_qp is None else input_qp.scale,
            weight_qp,
            slot.spec,
            integer_kernel=slot.integer_kernel,
        )
        self.notes.extend(notes)
        if encoded is None:
            return
        self.biases[slot.node] = encoded
        if encoded.codes is not None and encoded.qparams is not None:
            self.store_constant(node, slot.input_index, encoded.codes, encoded.qparams)
        # A bias kept float (BiasRule.FLOAT) stays the float initializer: finishing
        # (keep_float_weights_float) stores it as exact int32 codes where onnxruntime's
        # WeightBiasQuantization would re-quantize it, for both backends alike.

    def per_channel_bias(self, node: onnx.NodeProto, value: np.ndarray) -> np.ndarray:
        """A Gemm's broadcast bias (one value, shape [], [1] or [1, 1]) as one value per output
        channel: the same sums, in the 1-D form the bias rule and onnxruntime's QGemm take."""
        if node.op_type != "Gemm" or value.size != 1 or node.name not in self.weight_shapes:
            return value
        channels = output_channels(node, self.weight_shapes[node.name])
        return np.full(channels, value.reshape(-1)[0], np.float32)

    def write_activation(self, tensor: str, qp: QParams) -> None:
        consumers = self.main_consumers(tensor)
        value = self.index.constant(tensor)
        is_output = self.index.is_graph_output(tensor)
        if not consumers and not is_output:
            return
        if value is not None:  # a constant operand (e.g. Add's): stored as integers
            params = self.builder.qparam_initializers(tensor, qp)
            quantized = self.builder.initializer(f"{tensor}_quantized", quantize(value, qp), qp.dtype)
            self.dequantize_for_consumers(quantized, tensor, params, qp, consumers)
            self.replaced.add(tensor)
            return
        producer = self.index.producer(tensor)
        if producer is None and not consumers:
            return  # a graph input that is only passed through as an output: left as fed
        source = tensor
        # A graph output is written by a DequantizeLinear, its producer renamed; a graph
        # input passed straight through as an output has no producer and stays as fed.
        if is_output and producer is not None:
            source = self.index.unique_name(f"{tensor}_float")
            for i, name in enumerate(producer.output):
                if name == tensor:
                    producer.output[i] = source
        self.float_source[tensor] = source
        params = self.builder.qparam_initializers(tensor, qp)
        quantized = self.index.unique_name(f"{tensor}_QuantizeLinear_Output")
        q_nodes = [self.builder.qdq_node(QUANTIZE, source, quantized, params, qp)]
        if source != tensor:  # the producer was renamed: the output is the dequantized codes
            q_nodes.append(self.builder.qdq_node(DEQUANTIZE, quantized, tensor, params, qp))
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
        params = self.builder.qparam_initializers(base, qp)
        value = self.index.constant(tensor)
        if value is not None:
            quantized = self.builder.initializer(f"{base}_quantized", quantize(value, qp), qp.dtype)
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
        place.append(self.builder.qdq_node(QUANTIZE, source, quantized, params, qp))
        self.dequantize_for_consumers(quantized, tensor, params, qp, [consumer])

    def activation_node(self, source: str, fused: FusedActivation, place: list[onnx.NodeProto]) -> str:
        """A copy of a dropped Relu/Clip applied to ``source`` (appended to ``place``)."""
        output = self.index.unique_name(f"{source}_{fused.op_type}")
        lo, hi = fused.bounds
        if fused.op_type == "Relu" or (lo == 0.0 and not np.isfinite(hi)):
            place.append(helper.make_node("Relu", [source], [output], name=self.index.unique_name(output)))
            return output
        bounds = [
            self.builder.initializer(f"{output}_{end}", np.asarray(b, np.float32))
            for end, b in (("min", lo), ("max", hi))
        ]
        place.append(helper.make_node("Clip", [source, *bounds], [output], name=self.index.unique_name(output)))
        return output

    def assemble(self) -> None:
        ordered: list[onnx.NodeProto] = list(self.head)
        for node in self.graph.node:
            ordered.extend(self.before.get(node.name, ()))
            ordered.append(node)
            ordered.extend(self.after.get(node.name, ()))
        # An If/Loop branch reads outer names implicitly: they are used too.
        used = {name for node in ordered for name in node_inputs(node)} | {o.name for o in self.graph.output}
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
            self.builder.index = GraphIndex(self.graph)
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
        self.assemble()
        finished = finish_for_onnxruntime(self.model)
        self.notes.extend(finished.notes)
        return finished.model


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
