"""The ONNX :class:`~quant_algos.drivers.runner.LayerRunner`: onnxruntime runs the float
model and the QDQ model the quantizer wrote; the layer-wise drivers of ``quant_algos``
(AdaRound, AdaQuant, bias correction) walk them and write back through it.

Everything a driver needs to quantize comes from the calibrated plan
(:class:`~quant_onnx.pipeline.calibrate.CalibratedModel`): weight qparams (rounding,
narrow range, power-of-two position included) and the bias rule's inputs. The QDQ model
is read only for where things are stored (which integer initializer holds a layer's
codes, which its bias) and for the bias values an earlier pass left there. Both models
run through :class:`~quant_onnx.algorithms.capture.IncrementalRunner`: each node runs
once over the samples, about one forward pass per model for a whole walk.

Example:
    See ``tests/test_algorithms_runner.py``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import attrs
import numpy as np
import onnx
from onnx import helper, numpy_helper

from quant_algos.bias_correction import InputMeanAccumulator
from quant_algos.drivers.layers import GeometryUnknown, bias_allowed, describe_layer
from quant_algos.drivers.runner import QuantLayer
from quant_core.bias import accumulation_headroom, encode_bias, one_per_channel
from quant_core.errors import ModelError
from quant_core.onnx_qdq.graph import GraphIndex, node_attribute, plan_node
from quant_core.onnx_qdq.tensor_types import DTYPE_OF_ONNX
from quant_core.plan import activation_kind, weight_is_transposed
from quant_core.qparams import QParams, dequantize, quantize
from quant_onnx.algorithms.capture import LIVE_MEMORY_BYTES, Feeds, IncrementalRunner, prepare_batches
from quant_onnx.algorithms.reductions import Reduction, reduce_over
from quant_onnx.graph_edit import copy_model, set_attr, set_initializer
from quant_onnx.pipeline.calibrate import CalibratedModel
from quant_onnx.pipeline.preprocess.shape_inference import typed_index

WEIGHTED_OPS = ("Conv", "Gemm", "MatMul")


@attrs.frozen(eq=False)
class _Storage:
    """Where one layer lives in the QDQ model."""

    node: str
    codes: str  # integer initializer of the weight codes
    codes_dtype: np.dtype
    transposed: bool
    input_tensor: str  # the float model's input tensor of the layer (the plan's name)
    float_output: str
    added_bias: str | None = None  # a MatMul's bias: the constant an Add adds to its output
    biased_output: str | None = None  # ... and what that Add adds it to (the output, dequantized)


def _per_channel(node: onnx.NodeProto, bias: np.ndarray, channels: int) -> np.ndarray:
    """``bias`` flattened, one value per output channel; a single value (Gemm's C broadcasts
    [], [1] and [1, 1] over every channel) is repeated, so correcting it per channel works."""
    flat = bias.reshape(-1)
    if flat.size == 1 and channels != 1:
        return np.full(channels, flat[0], np.float32)
    per_channel = one_per_channel(bias, channels)  # a per-row [M, 1] C is not, even when M == channels
    if per_channel is None:
        raise ModelError(
            f"node {node.name!r} ({node.op_type}): bias of shape {list(bias.shape)} is neither one value "
            f"nor one per output channel ({channels})"
        )
    return per_channel


def _added_bias(node: onnx.NodeProto, index: GraphIndex, channels: int) -> tuple[str, str, np.ndarray] | None:
    """The constant an ``Add`` adds to ``node``'s output, one value per output column
    (shape ``[C]`` or ``[1, ..., C]``): a linear layer's bias that its exporter wrote as
    MatMul then Add, the output quantized or not between them; returned with the tensor the
    Add adds it to and its value (float32, as the Add reads it). The constant is a float initializer or, where the config quantizes the
    Add's inputs (xint8), one behind a per-tensor DequantizeLinear. ``None`` when a tensor
    on the way has other readers, the Add is not that, or the constant is not the Add's own
    (rewriting a shared one would change its other readers)."""
    tensor = node.output[0]
    add = index.sole_consumer(tensor)
    if add is not None and add.op_type == "QuantizeLinear" and not index.is_graph_output(tensor):
        quantized = add.output[0]
        dq = index.sole_consumer(quantized)
        if dq is None or dq.op_type != "DequantizeLinear" or index.is_graph_output(quantized):
            return None
        tensor = dq.output[0]
        add = index.sole_consumer(tensor)
    if add is None or add.op_type != "Add" or index.is_graph_output(tensor) or len(add.input) != 2:
        return None
    other = add.input[1] if add.input[0] == tensor else add.input[0]
    if index.consumers(other) != [add] or index.is_graph_output(other):
        return None
    found = _added_constant(index, other)
    if found is None:
        return None
    shape = np.shape(found[0])
    if not shape or shape[-1] != channels or any(d != 1 for d in shape[:-1]):
        return None
    return other, tensor, np.asarray(found[0], np.float32)


def _added_constant(index: GraphIndex, tensor: str) -> tuple[np.ndarray, QParams | None, str] | None:
    """The value of an added bias (:func:`_added_bias`), the qparams of its stored codes
    (``None``: a float initializer) and the initializer that holds it; ``None`` when it is
    neither a float initializer nor integer codes behind a per-tensor DequantizeLinear that
    nothing else reads."""
    proto = index.initializer_proto(tensor)
    if proto is not None:
        value = index.constant(tensor)
        if value is None or not np.issubdtype(value.dtype, np.floating):
            return None
        return value, None, tensor
    dq = index.producer(tensor)
    if dq is None or dq.op_type != "DequantizeLinear" or len(dq.input) < 2:
        return None
    codes_proto = index.initializer_proto(dq.input[0])
    codes, scale = index.constant(dq.input[0]), index.constant(dq.input[1])
    zero_point = index.constant(dq.input[2]) if len(dq.input) > 2 and dq.input[2] else None
    if (
        codes_proto is None
        or codes_proto.data_type not in DTYPE_OF_ONNX
        or index.consumers(dq.input[0]) != [dq]
        or codes is None
        or scale is None
        or np.size(scale) != 1
        or (zero_point is None and len(dq.input) > 2 and dq.input[2])
    ):
        return None
    qp = QParams.per_tensor(
        float(np.asarray(scale).reshape(())),
        0 if zero_point is None else int(np.asarray(zero_point).reshape(())),
        DTYPE_OF_ONNX[codes_proto.data_type],
    )
    return dequantize(codes, qp).astype(np.float32), qp, dq.input[0]


def _oi(qp: QParams, transposed: bool) -> QParams:
    """Weight qparams in ``[out, in]`` layout (a transposed 2-D weight swaps its axes)."""
    return qp.evolve(axis=1 - qp.axis) if transposed and qp.axis is not None else qp


class OnnxLayerRunner:
    """A :class:`~quant_algos.drivers.runner.LayerRunner` over ``calibrated.model`` (float)
    and ``qdq_model`` (written from it), on ``batches``. The QDQ model is copied;
    :attr:`model` is the copy with everything written back. ``learned_codes``: an AdaRound
    or AdaQuant pass over this calibrated model wrote ``qdq_model``'s weight codes, so they
    may lie any distance from the float weights' rounding (the check that the float model is
    the one the file was written from is skipped). ``bias_layers_only``: only the layers a
    bias can be written to (what bias correction walks); the others' weights are never read,
    which keeps a big model of MatMuls without an added bias out of memory.

    Example:
        >>> OnnxLayerRunner.__name__
        'OnnxLayerRunner'
    """

    def __init__(
        self,
        calibrated: CalibratedModel,
        qdq_model: onnx.ModelProto,
        batches: Sequence[Feeds],
        *,
        memory_budget: int = LIVE_MEMORY_BYTES,
        learned_codes: bool = False,
        bias_layers_only: bool = False,
    ) -> None:
        self.calibrated = calibrated
        self.learned_codes = learned_codes
        self._bias_layers_only = bias_layers_only
        self.float_model = calibrated.model
        self.model = copy_model(qdq_model)
        self._batches = batches
        self._count = sum(int(next(iter(b.values())).shape[0]) for b in batches)
        self.notes: list[str] = []
        # Each walk holds at most ``memory_budget`` bytes of live tensors; the rest wait on disk.
        self._quantized = IncrementalRunner(batches, memory_budget)
        self._reference = IncrementalRunner(batches, memory_budget)
        self._storage: dict[str, _Storage] = {}
        self._layers = self._find_layers()

    @property
    def num_samples(self) -> int:
        return self._count

    def close(self) -> None:
        """Delete the live tensors the walks left on disk."""
        self._quantized.close()
        self._reference.close()

    def layers(self) -> Sequence[QuantLayer]:
        return self._layers

    # --- discovery ---------------------------------------------------------------------
    def _find_layers(self) -> list[QuantLayer]:
        qdq = GraphIndex(self.model.graph)
        floats = typed_index(self.float_model)
        float_nodes = {node.name: node for node in self.float_model.graph.node}
        layers = []
        for node in qdq.topological_order():
            if node.op_type not in WEIGHTED_OPS or node.name not in self.calibrated.weight_qparams:
                continue
            float_node = float_nodes.get(node.name)
            if float_node is None or float_node.op_type != node.op_type:
                self.notes.append(f"{node.name}: no float {node.op_type} of that name")
                continue
            if self._bias_layers_only and not self._may_take_bias(node, float_node, qdq, floats):
                continue
            layer = self._describe(node, float_node, qdq, floats)
            if layer is not None:
                layers.append(layer)
        return layers

    def _may_take_bias(
        self, node: onnx.NodeProto, float_node: onnx.NodeProto, qdq: GraphIndex, floats: GraphIndex
    ) -> bool:
        """:func:`~quant_algos.drivers.layers.bias_allowed` from the graph alone (no weight
        read): a MatMul's float bias is the constant an Add adds after it."""
        proto = floats.initializer_proto(float_node.input[1])
        float_bias = (
            node.op_type == "MatMul"
            and proto is not None
            and len(proto.dims) == 2
            and _added_bias(node, qdq, int(proto.dims[1])) is not None
        )
        return bias_allowed(node.op_type, input_quantized=self._input_quantized(node.name), float_bias=float_bias)

    def _input_quantized(self, layer: str) -> bool:
        slot = self.calibrated.plan.bias_of(layer)
        return slot is not None and self.calibrated.qparams_of(slot.input_tensor) is not None

    def _describe(
        self, node: onnx.NodeProto, float_node: onnx.NodeProto, qdq: GraphIndex, floats: GraphIndex
    ) -> QuantLayer | None:
        name = node.name
        dq = qdq.producer(node.input[1])
        proto = qdq.initializer_proto(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
        weight = floats.constant(float_node.input[1])
        if dq is None or proto is None or proto.data_type not in DTYPE_OF_ONNX or weight is None:
            self.notes.append(f"{name}: weight is not an integer initializer behind a DequantizeLinear")
            return None
        if node.op_type == "Gemm" and (node_attribute(node, "transA", 0) or node_attribute(node, "alpha", 1.0) != 1.0):
            self.notes.append(f"{name}: Gemm with transA or alpha is left alone")
            return None
        if node.op_type == "Gemm":
            # The writer folded the float Gemm's alpha into the weight it quantized.
            weight = np.asarray(weight, np.float32) * np.float32(node_attribute(float_node, "alpha", 1.0))
        transposed = weight_is_transposed(plan_node(node))
        float_weight = np.asarray(weight.T if transposed else weight, np.float32)
        if node.op_type == "MatMul" and weight.ndim != 2:
            self.notes.append(f"{name}: MatMul with a rank-{weight.ndim} weight is left alone")
            return None
        shape = floats.shape(float_node.input[0])
        hw = (
            shape[2:4]
            if shape is not None and len(shape) == 4 and all(isinstance(d, int) for d in shape[2:4])
            else None
        )
        input_quantized = self._input_quantized(name)
        consumer = floats.sole_consumer(float_node.output[0])
        activation = activation_kind(plan_node(consumer), floats.constant) if consumer is not None else None
        qp = _oi(self.calibrated.weight_qparams[name], transposed)
        stored = np.asarray(qdq.constant(dq.input[0])).astype(np.int64)
        off = np.abs(quantize(float_weight, qp).astype(np.int64) - (stored.T if transposed else stored))
        # AdaRound moves codes by one step; a model the QDQ file was not written from (e.g.
        # the float model from before CLE) moves most of them further. AdaQuant learns the
        # weights themselves: EfficientNet-Lite0's codes moved more than a step in over a
        # tenth of a layer's weights, so after a learned pass only the shape is checked.
        if off.shape != float_weight.shape or (not self.learned_codes and off.size and np.mean(off > 1) > 0.1):
            raise ModelError(
                f"node {name!r}: the float weight does not quantize to the stored codes; pass the calibrated "
                "model the QDQ model was written from (after CLE/SmoothQuant)"
            )
        added_bias = _added_bias(node, qdq, int(float_weight.shape[0])) if node.op_type == "MatMul" else None
        bias: np.ndarray | None
        try:
            if added_bias is not None:
                bias = added_bias[2].reshape(-1)
            else:
                bias = self._current_bias(node, qdq, int(float_weight.shape[0]))
        except ModelError as error:  # e.g. a per-row Gemm C: not a per-channel bias to correct
            self.notes.append(f"{name}: left alone: {error}")
            return None
        try:
            layer = describe_layer(
                name,
                node.op_type,
                plan_node(node).attributes,
                float_weight,
                qp,
                bias,
                activation,
                input_quantized=input_quantized,
                input_hw=hw,  # type: ignore[arg-type]
                float_bias=added_bias is not None,
            )
        except GeometryUnknown as unknown:
            self.notes.append(f"{name}: {unknown}: shape inference did not give it")
            return None
        self._storage[name] = _Storage(
            name,
            dq.input[0],
            np.asarray(qdq.constant(dq.input[0])).dtype,
            transposed,
            float_node.input[0],
            float_node.output[0],
            *(added_bias[:2] if added_bias is not None else (None, None)),
        )
        return layer

    @staticmethod
    def _current_bias(node: onnx.NodeProto, index: GraphIndex, channels: int) -> np.ndarray | None:
        """The bias the QDQ model holds now, one value per output channel (real values: codes
        dequantized with the stored scale, or a float initializer; a Gemm's broadcast bias,
        shape [], [1] or [1, 1], repeated for every channel)."""
        if len(node.input) < 3 or not node.input[2]:
            return None
        dq = index.producer(node.input[2])
        if dq is None:
            value = index.constant(node.input[2])
            return None if value is None else _per_channel(node, np.asarray(value, np.float32), channels)
        codes, scale = index.constant(dq.input[0]), index.constant(dq.input[1])
        if codes is None or scale is None:
            return None
        zero_point = index.constant(dq.input[2]) if len(dq.input) > 2 and dq.input[2] else None
        zp = np.zeros_like(scale, np.int64) if zero_point is None else np.asarray(zero_point, np.int64)
        qp = QParams(
            np.asarray(scale, np.float32),
            zp,
            DTYPE_OF_ONNX[index.initializer_proto(dq.input[0]).data_type],  # type: ignore[union-attr]
            axis=0 if np.ndim(scale) else None,
        )
        return _per_channel(node, dequantize(codes, qp).astype(np.float32), channels)

    def _drop_float_bias(self, node: onnx.NodeProto, index: GraphIndex) -> None:
        """Unhook ``node``'s float constant bias (a broadcast Gemm C the writer kept float),
        deleting its initializer when nothing else reads it; the corrected codes replace it."""
        if len(node.input) < 3 or not node.input[2]:
            return
        old = node.input[2]
        node.input[2] = ""
        if index.consumers(old) == [node] and not index.is_graph_output(old):
            kept = [t for t in self.model.graph.initializer if t.name != old]
            del self.model.graph.initializer[:]
            self.model.graph.initializer.extend(kept)

    # --- data ----------------------------------------------------------------------------
    def _node_input(self, layer: QuantLayer) -> str:
        return next(n for n in self.model.graph.node if n.name == layer.name).input[0]

    def quantized_inputs(self, layer: QuantLayer) -> Iterator[np.ndarray]:
        tensor = self._node_input(layer)
        yield from (batch[tensor] for batch in self._quantized.compute(self.model, [tensor]))

    def quantized_outputs(self, layer: QuantLayer) -> Iterator[np.ndarray]:
        node = next(n for n in self.model.graph.node if n.name == layer.name)
        self._quantized.advance(self.model, [node.input[0]])  # everything upstream, as written back
        # A MatMul's added bias is compared where the Add adds it: after the output's own
        # quantization, when the plan quantizes it.
        tensor = self._storage[layer.name].biased_output or node.output[0]
        outputs = self._quantized.compute(self.model, [tensor], commit=False)
        yield from (batch[tensor] for batch in outputs)

    def float_outputs(self, layer: QuantLayer) -> Iterator[np.ndarray]:
        tensor = self._storage[layer.name].float_output
        yield from (batch[tensor] for batch in self._reference.compute(self.float_model, [tensor]))

    def float_input_means(self, layers: Sequence[QuantLayer], count: int) -> dict[str, np.ndarray]:
        stored = self.calibrated.input_means
        if stored is not None:  # taken in the calibration pass, over the same first samples
            found = {
                layer.name: stored.of(self._storage[layer.name].input_tensor, layer.is_conv, count) for layer in layers
            }
            if all(mean is not None for mean in found.values()):
                return {name: mean for name, mean in found.items() if mean is not None}
        # One pass of the float model with each input summed inside onnxruntime: a Conv's
        # over the samples (its map kept), a dense layer's over every axis but the last.
        wanted = {(self._storage[layer.name].input_tensor, layer.is_conv): layer for layer in layers}
        reductions = [
            Reduction(tensor, "ReduceSum", (0,), None if conv else (-1, layer.float_weight.shape[1]))
            for (tensor, conv), layer in wanted.items()
        ]
        sums = [InputMeanAccumulator(conv) for _tensor, conv in wanted]
        for batch in reduce_over(self.float_model, reductions, prepare_batches(self._batches, count)):
            for acc, (total, shape) in zip(sums, batch, strict=True):
                rows = int(shape[0]) if acc.conv else int(np.prod(shape[:-1]))
                acc.add(total, rows)
        by_key = dict(zip(wanted, sums, strict=True))
        return {layer.name: by_key[(self._storage[layer.name].input_tensor, layer.is_conv)].mean() for layer in layers}

    def quantized_weight(self, layer: QuantLayer) -> np.ndarray:
        where = self._storage[layer.name]
        # Read from the graph, not an index: an earlier pass or set_weight_codes may have
        # replaced the initializer since any index cached it.
        codes = next(numpy_helper.to_array(t) for t in self.model.graph.initializer if t.name == where.codes)
        return dequantize(codes.T if where.transposed else codes, layer.weight_qparams)

    # --- write back ----------------------------------------------------------------------
    def set_weight_codes(self, layer: QuantLayer, codes: np.ndarray) -> None:
        where = self._storage[layer.name]
        stored = np.asarray(codes).T if where.transposed else np.asarray(codes)
        set_initializer(self.model.graph, where.codes, np.ascontiguousarray(stored).astype(where.codes_dtype))

    def set_bias(self, layer: QuantLayer, values: np.ndarray) -> str | None:
        added = self._storage[layer.name].added_bias
        if added is not None:
            self._store_added_bias(added, np.asarray(values, np.float32))
            return None
        slot = self.calibrated.plan.bias_of(layer.name)
        input_qp = None if slot is None else self.calibrated.input_qparams(layer.name, slot.input_tensor)
        if slot is None or input_qp is None:
            return "no bias: the layer's input is not quantized"
        weight_qp = self.calibrated.weight_qparams[layer.name]
        flat = np.asarray(values, np.float32).reshape(-1)
        # The new bias must leave the int32 accumulator room for the layer's products.
        headroom = accumulation_headroom(layer.float_weight.shape, flat.size, input_qp, weight_qp)
        encoded = encode_bias(
            flat, input_qp.scale, weight_qp, slot.spec, integer_kernel=slot.integer_kernel, headroom=headroom
        )
        if encoded.codes is None or encoded.qparams is None:
            return f"bias left as it was: {encoded.note or 'the config keeps it float'}"
        self._store_bias(layer.name, encoded.codes, encoded.qparams)
        return None

    def _store_added_bias(self, tensor: str, values: np.ndarray) -> None:
        """Write a MatMul's bias (what its Add adds) in its own shape and dtype: the float
        initializer, or the codes behind its DequantizeLinear on their stored grid."""
        found = _added_constant(GraphIndex(self.model.graph), tensor)
        assert found is not None  # found when the layer was described; nothing rewires it since
        _old, qp, name = found
        # On the grid the codes are stored at (int8 at its power-of-two position under xint8,
        # uint8 with its zero point where the activations are encoded so): the Add still reads
        # what the plan's qparams give; a correction below one step of it is lost.
        old = next(t for t in self.model.graph.initializer if t.name == name)
        stored = values if qp is None else quantize(values, qp)
        set_initializer(
            self.model.graph,
            name,
            stored.reshape(tuple(old.dims)).astype(helper.tensor_dtype_to_np_dtype(old.data_type)),
        )

    def _store_bias(self, name: str, codes: np.ndarray, qp: QParams) -> None:
        # The quantized walk's index of this model: its structure is current (adding the
        # bias's nodes below makes the walk index the model again); values are read below
        # only from the graph.
        index = self._quantized.index(self.model)
        node = next(n for n in self.model.graph.node if n.name == name)
        dq = index.producer(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        scale = np.asarray(qp.scale, np.float32)
        # The bias spec's own format (int32 by the bias rule; int8 for device formats that take it).
        stored = qp.dtype.numpy_dtype
        zero_point = np.asarray(qp.zero_point).astype(stored).reshape(scale.shape)
        if dq is not None and dq.op_type == "DequantizeLinear":
            set_initializer(self.model.graph, dq.input[0], codes.astype(stored))
            set_initializer(self.model.graph, dq.input[1], scale)
            if len(dq.input) > 2 and dq.input[2]:
                set_initializer(self.model.graph, dq.input[2], zero_point)
            if qp.axis is not None:  # a broadcast bias stored per tensor is now one code per channel
                set_attr(dq, "axis", 0)
            return
        if dq is not None or (len(node.input) > 2 and node.input[2] and not index.is_constant(node.input[2])):
            raise ModelError(
                f"node {name!r} ({node.op_type}): its bias is neither a float constant nor an integer "
                "initializer behind a DequantizeLinear"
            )
        self._drop_float_bias(node, index)
        names = [index.unique_name(f"{name}_bias_{part}") for part in ("quantized", "scale", "zero_point", "dq")]
        set_initializer(self.model.graph, names[0], codes.astype(stored))
        set_initializer(self.model.graph, names[1], scale)
        set_initializer(self.model.graph, names[2], zero_point)
        output = index.unique_name(f"{name}_bias")
        dq_node = helper.make_node("DequantizeLinear", names[:3], [output], name=names[3])
        if qp.axis is not None:
            dq_node.attribute.append(helper.make_attribute("axis", 0))
        position = next(i for i, n in enumerate(self.model.graph.node) if n.name == name)
        self.model.graph.node.insert(position, dq_node)
        target = self.model.graph.node[position + 1]
        while len(target.input) < 3:
            target.input.append("")
        target.input[2] = output
