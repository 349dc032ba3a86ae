"""Read the quantized layers of a standard QDQ model (see ONNXRUNTIME-INT8.md):
Conv/Gemm/MatMul nodes whose weight is an integer initializer behind a
DequantizeLinear (per-tensor or per-channel) and whose bias, if any, is an int32
initializer behind a DequantizeLinear with scale ``input_scale * weight_scale``.

The post-passes (bias correction, AdaRound, AdaQuant) change only those integer
initializers, so the graph structure the writer chose is kept exactly.

Example:
    >>> import numpy as np
    >>> from onnx import TensorProto, helper, numpy_helper
    >>> inits = [numpy_helper.from_array(np.array([[3, -4]], np.int8), "w_q"),
    ...          numpy_helper.from_array(np.array(0.5, np.float32), "w_s")]
    >>> nodes = [helper.make_node("DequantizeLinear", ["w_q", "w_s"], ["w"], name="w_dq"),
    ...          helper.make_node("Gemm", ["x", "w"], ["y"], name="fc", transB=1)]
    >>> g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
    ...                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1])], inits)
    >>> (layer,) = find_qdq_layers(helper.make_model(g))
    >>> layer.name, layer.weight.codes.tolist(), float(layer.weight.qparams.scale)
    ('fc', [[3, -4]], 0.5)
"""

from __future__ import annotations

import attrs
import numpy as np
import onnx
from onnx import TensorProto

from quant_algos.reconstruction_data import ConvGeometry
from quant_core.dtypes import DType
from quant_core.qparams import QParams, dequantize, quantize
from quant_onnx.algorithms._graph import (
    activation_kind,
    attr,
    int_attr,
    is_default_domain,
    nodes_by_name,
    set_initializer,
    sole_consumer,
)
from quant_onnx.errors import ModelError
from quant_onnx.graph import GraphIndex

_DTYPES: dict[int, DType] = {
    TensorProto.INT4: DType.INT4,
    TensorProto.UINT4: DType.UINT4,
    TensorProto.INT8: DType.INT8,
    TensorProto.UINT8: DType.UINT8,
    TensorProto.INT16: DType.INT16,
    TensorProto.UINT16: DType.UINT16,
    TensorProto.INT32: DType.INT32,
}
_INT32 = np.iinfo(np.int32)


def _power_of_two_positions(scale: np.ndarray) -> np.ndarray | None:
    """``-log2(scale)`` when every scale is an exact power of two, else None."""
    s = np.asarray(scale, np.float64)
    if np.any(s <= 0):
        return None
    pos = -np.log2(s)
    return np.rint(pos).astype(np.int64) if np.all(pos == np.rint(pos)) else None


@attrs.frozen(eq=False)
class QuantizedInitializer:
    """An integer initializer read through a DequantizeLinear.

    Attributes:
        codes_name: the initializer holding the integer codes.
        codes: its value (numpy dtype as stored).
        qparams: scale, zero point and axis read from the DequantizeLinear; signed
            weights whose codes never reach the lowest code are taken as narrow range,
            so learned codes stay inside the range the writer used.

    Example:
        >>> import numpy as np
        >>> q = QuantizedInitializer("b", np.array([4], np.int32), QParams.per_tensor(0.25, 0, "int32"))
        >>> q.values().tolist()
        [1.0]
    """

    codes_name: str
    codes: np.ndarray
    qparams: QParams

    def values(self) -> np.ndarray:
        return dequantize(self.codes, self.qparams)

    def with_codes(self, codes: np.ndarray) -> QuantizedInitializer:
        return attrs.evolve(self, codes=np.asarray(codes).astype(self.codes.dtype))


def read_dequantize(node: onnx.NodeProto, index: GraphIndex) -> QuantizedInitializer | None:
    """The integer initializer and qparams behind DequantizeLinear ``node``; None when
    its input is not an integer initializer or its scale/zero point are not constants."""
    if node.op_type != "DequantizeLinear" or not is_default_domain(node):
        return None
    proto = index.initializer_proto(node.input[0])
    dtype = _DTYPES.get(proto.data_type) if proto is not None else None
    scale = index.constant(node.input[1]) if len(node.input) > 1 else None
    if proto is None or dtype is None or scale is None:
        return None
    codes = index.constant(node.input[0])
    assert codes is not None
    zp_name = node.input[2] if len(node.input) > 2 else ""
    zero_point = index.constant(zp_name) if zp_name else np.zeros_like(np.asarray(scale), dtype=np.int64)
    if zero_point is None:
        return None
    scale = np.asarray(scale, np.float32)
    axis: int | None = int_attr(node, "axis", 1) % max(codes.ndim, 1)
    # A one-element 1-D scale is per tensor unless the channel axis really has one channel.
    if scale.ndim != 1 or (scale.size == 1 and codes.ndim and codes.shape[axis] != 1):
        axis = None
        scale = scale.reshape(())
        zero_point = np.asarray(zero_point).reshape(())
    narrow = dtype.signed and dtype is not DType.INT32 and codes.size > 0 and int(codes.min()) > dtype.qmin
    qp = QParams(
        scale=scale,
        zero_point=np.asarray(zero_point).astype(np.int64),
        dtype=dtype,
        axis=axis,
        narrow_range=bool(narrow),
        fix_pos=_power_of_two_positions(scale),
    )
    return QuantizedInitializer(node.input[0], codes, qp)


def _ints(value: object, default: list[int]) -> list[int]:
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else list(default)


@attrs.frozen(eq=False)
class QDQLayer:
    """One quantized Conv/Gemm/MatMul of a QDQ model.

    Attributes:
        node: the node.
        weight: its integer weight (stored layout).
        bias: its int32 bias, or None.
        input_scale: scale of the DequantizeLinear feeding its data input (None when the
            input is float), needed to create a bias.
        transposed: the weight is stored ``[in, out]`` (MatMul, Gemm with transB=0).

    Example:
        >>> import numpy as np
        >>> qp = QParams.per_tensor(1.0, 0, "int8")
        >>> w = QuantizedInitializer("w", np.array([[1, 2]], np.int8), qp)
        >>> layer = QDQLayer(onnx.helper.make_node("MatMul", ["x", "wd"], ["y"], name="mm"), w, None, None, True)
        >>> layer.weight_oi().tolist(), layer.channel_axis
        ([[1], [2]], -1)
    """

    node: onnx.NodeProto
    weight: QuantizedInitializer
    bias: QuantizedInitializer | None
    input_scale: np.ndarray | None
    transposed: bool

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def op_type(self) -> str:
        return self.node.op_type

    @property
    def input_tensor(self) -> str:
        return self.node.input[0]

    @property
    def output_tensor(self) -> str:
        return self.node.output[0]

    @property
    def channel_axis(self) -> int:
        """Output channel axis of the layer's output tensor."""
        return 1 if self.op_type in ("Conv", "Gemm") else -1

    @property
    def out_channels(self) -> int:
        return int(self.weight.codes.shape[1 if self.transposed else 0])

    def to_oi(self, array: np.ndarray) -> np.ndarray:
        return array.T if self.transposed else array

    def weight_oi(self) -> np.ndarray:
        """Codes in ``[out, in, ...]`` layout (what quant_algos expects)."""
        return self.to_oi(self.weight.codes)

    def weight_qparams_oi(self) -> QParams:
        qp = self.weight.qparams
        if self.transposed and qp.axis is not None:
            return attrs.evolve(qp, axis=1 - qp.axis)
        return qp

    def geometry(self, input_hw: tuple[int, int]) -> ConvGeometry | None:
        """Strides, explicit pads, dilations and groups of a 2-D Conv (None for Gemm/MatMul)."""
        if self.op_type != "Conv":
            return None
        kernel = self.weight.codes.shape[2:]
        strides = _ints(attr(self.node, "strides"), [1, 1])
        dilations = _ints(attr(self.node, "dilations"), [1, 1])
        pads = _ints(attr(self.node, "pads"), [0, 0, 0, 0])
        auto_pad = attr(self.node, "auto_pad", b"NOTSET")
        auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else str(auto_pad)
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            pads = [0, 0, 0, 0]
            for i in range(2):
                out = -(-input_hw[i] // strides[i])
                total = max(0, (out - 1) * strides[i] + dilations[i] * (kernel[i] - 1) + 1 - input_hw[i])
                small, big = total // 2, total - total // 2
                pads[i], pads[i + 2] = (small, big) if auto_pad == "SAME_UPPER" else (big, small)
        elif auto_pad == "VALID":
            pads = [0, 0, 0, 0]
        return ConvGeometry(strides=strides, pads=pads, dilations=dilations, groups=int_attr(self.node, "group", 1))


def _layer_of(node: onnx.NodeProto, index: GraphIndex) -> QDQLayer | None:
    if not is_default_domain(node) or node.op_type not in ("Conv", "Gemm", "MatMul") or len(node.input) < 2:
        return None
    if node.op_type == "Gemm" and (attr(node, "transA", 0) or attr(node, "alpha", 1.0) != 1.0):
        return None
    weight_dq = index.producer(node.input[1])
    weight = read_dequantize(weight_dq, index) if weight_dq is not None else None
    if weight is None:
        return None
    if node.op_type == "MatMul" and weight.codes.ndim != 2:
        return None
    bias = None
    if node.op_type in ("Conv", "Gemm") and len(node.input) > 2 and node.input[2]:
        bias_dq = index.producer(node.input[2])
        bias = read_dequantize(bias_dq, index) if bias_dq is not None else None
        if bias is None or bias.codes.ndim != 1 or (node.op_type == "Gemm" and attr(node, "beta", 1.0) != 1.0):
            return None  # a float or broadcast bias: the passes leave this layer alone
    input_dq = index.producer(node.input[0])
    input_scale = None
    if input_dq is not None and input_dq.op_type == "DequantizeLinear":
        input_scale = index.constant(input_dq.input[1])
    transposed = node.op_type == "MatMul" or (node.op_type == "Gemm" and not attr(node, "transB", 0))
    return QDQLayer(
        node, weight, bias, None if input_scale is None else np.asarray(input_scale, np.float32), transposed
    )


def find_qdq_layers(model: onnx.ModelProto) -> list[QDQLayer]:
    """Every quantized Conv/Gemm/MatMul of ``model`` in topological order."""
    index = GraphIndex(model.graph)
    layers = (_layer_of(node, index) for node in index.topological_order())
    return [layer for layer in layers if layer is not None]


def bias_scale(layer: QDQLayer) -> np.ndarray | None:
    """Per-output-channel scale of the layer's int32 bias: the existing bias's, else
    ``input_scale * weight_scale`` (None when the input is not quantized)."""
    if layer.bias is not None:
        return np.broadcast_to(layer.bias.qparams.scale, (layer.out_channels,)).astype(np.float64)
    if layer.input_scale is None or layer.input_scale.size != 1:
        return None
    w_scale = np.broadcast_to(layer.weight.qparams.scale, (layer.out_channels,)).astype(np.float64)
    return float(layer.input_scale.reshape(-1)[0]) * w_scale


def bias_codes(values: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """int32 codes of a float bias at ``scale`` (saturating)."""
    codes = np.rint(np.asarray(values, np.float64) / scale)
    return np.clip(codes, _INT32.min, _INT32.max).astype(np.int32)


def write_bias(model: onnx.ModelProto, layer: QDQLayer, codes: np.ndarray, index: GraphIndex) -> None:
    """Store int32 bias ``codes`` for ``layer`` in ``model`` (a copy the pass owns):
    overwrite the existing bias initializer, or add an int32 initializer behind a new
    DequantizeLinear (scale ``input_scale * weight_scale``, zero point 0)."""
    if layer.bias is not None:
        set_initializer(model, layer.bias.codes_name, np.asarray(codes, np.int32))
        return
    scale = bias_scale(layer)
    if scale is None:
        raise ValueError(f"node {layer.name!r}: cannot add an int32 bias to a layer whose input is not quantized")
    codes_name = index.unique_name(f"{layer.name}_bias_quantized")
    scale_name = index.unique_name(f"{layer.name}_bias_scale")
    zp_name = index.unique_name(f"{layer.name}_bias_zero_point")
    dq_out = index.unique_name(f"{layer.name}_bias")
    set_initializer(model, codes_name, np.asarray(codes, np.int32))
    per_channel = layer.weight.qparams.axis is not None
    set_initializer(model, scale_name, scale.astype(np.float32) if per_channel else np.float32(scale[0]))
    zp = np.zeros(layer.out_channels, np.int32) if per_channel else np.int32(0)
    set_initializer(model, zp_name, zp)
    dq = onnx.helper.make_node(
        "DequantizeLinear", [codes_name, scale_name, zp_name], [dq_out], name=index.unique_name(f"{layer.name}_bias_dq")
    )
    if per_channel:
        dq.attribute.append(onnx.helper.make_attribute("axis", 0))
    for position, node in enumerate(model.graph.node):
        if node.name == layer.name:
            model.graph.node.insert(position, dq)
            target = model.graph.node[position + 1]
            while len(target.input) < 3:
                target.input.append("")
            target.input[2] = dq_out
            return
    raise ValueError(f"node {layer.name!r}: not found in the model")


@attrs.frozen(eq=False)
class MatchedLayer:
    """A quantized layer and its float counterpart (same node name).

    Attributes:
        layer: the QDQ layer.
        float_node: the float model's node.
        float_weight: the float weight in ``[out, in, ...]`` layout.
        activation: "relu"/"relu6" when the float layer's output goes only into such an
            activation (the QDQ writer may have fused it), else None.
    """

    layer: QDQLayer
    float_node: onnx.NodeProto
    float_weight: np.ndarray
    activation: str | None

    @property
    def float_output(self) -> str:
        return self.float_node.output[0]


def match_float_layers(
    float_model: onnx.ModelProto, qdq_model: onnx.ModelProto
) -> tuple[list[MatchedLayer], list[str]]:
    """Pair every quantized layer of ``qdq_model`` with the float model's node of the
    same name. Returns the pairs (topological order) and notes on layers left out.

    ModelError when a matched float weight does not quantize to (about) the stored
    codes (more than 10 % of them more than one step away): the float model is not the one the QDQ model was written from (for
    example, the model from before CLE).
    """
    float_nodes = nodes_by_name(float_model.graph, "float model")
    nodes_by_name(qdq_model.graph, "quantized model")
    index = GraphIndex(float_model.graph)
    pairs: list[MatchedLayer] = []
    notes: list[str] = []
    for layer in find_qdq_layers(qdq_model):
        node = float_nodes.get(layer.name)
        weight = index.constant(node.input[1]) if node is not None and len(node.input) > 1 else None
        if node is None or node.op_type != layer.op_type or weight is None:
            notes.append(f"{layer.name}: no float {layer.op_type} with a constant weight of that name")
            continue
        weight = np.asarray(weight, np.float32)
        weight = weight.T if layer.transposed else weight
        expected = layer.weight_oi()
        if weight.shape != expected.shape:
            raise ModelError(
                f"node {layer.name!r}: float weight {weight.shape} does not match quantized {expected.shape}"
            )
        off = np.abs(quantize(weight, layer.weight_qparams_oi()).astype(np.int64) - expected.astype(np.int64))
        # AdaRound moves codes by one step, AdaQuant by a few; a different float model
        # (e.g. from before CLE) moves most of them further.
        if off.size and np.mean(off > 1) > 0.1:
            raise ModelError(
                f"node {layer.name!r}: the float weight does not quantize to the stored codes; pass the float "
                "model the QDQ model was written from (after CLE/SmoothQuant)"
            )
        consumer = sole_consumer(index, node.output[0])
        activation = activation_kind(consumer, index) if consumer is not None else None
        pairs.append(MatchedLayer(layer, node, weight, activation))
    return pairs, notes
