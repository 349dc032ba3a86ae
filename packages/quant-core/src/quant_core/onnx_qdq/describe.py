"""What an already-quantized ONNX model is: QDQ, QOperator (``QLinearConv``...) or dynamic
(``ConvInteger``...), the formats of its weights and activations, and which ops run
quantized.

``quant-onnx inspect`` prints this instead of a quantization plan when a model is already
quantized, and the summary after ``quant-onnx quantize`` reads the written model with it,
so both say what the file holds, not what a config asked for.

Example:
    >>> import numpy as np
    >>> from onnx import helper, numpy_helper, TensorProto
    >>> inits = [numpy_helper.from_array(np.full((4, 3, 1, 1), 2, np.int8), "w_q"),
    ...          numpy_helper.from_array(np.full(4, 0.25, np.float32), "w_s"),
    ...          numpy_helper.from_array(np.float32(0.5), "x_s"), numpy_helper.from_array(np.uint8(128), "x_z")]
    >>> nodes = [helper.make_node("QuantizeLinear", ["x", "x_s", "x_z"], ["x_q"]),
    ...          helper.make_node("DequantizeLinear", ["x_q", "x_s", "x_z"], ["x_dq"]),
    ...          helper.make_node("DequantizeLinear", ["w_q", "w_s"], ["w"], axis=0),
    ...          helper.make_node("Conv", ["x_dq", "w"], ["y"])]
    >>> g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 2, 2])],
    ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 2, 2])], inits)
    >>> info = describe_quantized(helper.make_model(g))
    >>> print("\\n".join(info.lines()))
    already quantized: QDQ (2 DequantizeLinear, 1 QuantizeLinear)
      weights: 1 int8 per-channel symmetric, power-of-two scales
      activations: 1 uint8 per-tensor symmetric, power-of-two scales
      quantized ops: Conv 1
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import numpy as np
import onnx
from onnx import TensorProto

from quant_core.onnx_qdq.graph import GraphIndex

QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})
DYNAMIC_OPS = frozenset({"ConvInteger", "MatMulInteger", "DynamicQuantizeLinear"})
# QOperator ops with a weight: (weight index, weight scale index, activation zero-point indices).
_QOPERATOR_LAYOUT = {
    "QLinearConv": (3, 4, (2, 7)),
    "QLinearMatMul": (3, 4, (2, 7)),
    "QGemm": (3, 4, (2, 8)),
}


def is_quantized_op(node: onnx.NodeProto) -> bool:
    """Whether a node belongs to a quantized format (Q/DQ, QLinear*, QGemm, integer kernels)."""
    op = node.op_type
    return op in QDQ_OPS or op in DYNAMIC_OPS or op.startswith("QLinear") or op in ("QGemm", "QAttention")


@attrs.frozen
class FormatCount:
    """How many tensors share one storage format.

    Example:
        >>> FormatCount("int8", "per-channel", True, False, 20).describe()
        '20 int8 per-channel symmetric'
    """

    dtype: str
    granularity: str
    symmetric: bool | None
    power_of_two: bool | None
    count: int

    def describe(self) -> str:
        symmetry = "" if self.symmetric is None else (" symmetric" if self.symmetric else " asymmetric")
        if self.granularity.startswith("per-"):
            return f"{self.count} {self.dtype} {self.granularity}{symmetry}"
        return f"{self.count} {self.dtype}{symmetry} ({self.granularity})"


@attrs.frozen
class QuantizedModelInfo:
    """An already-quantized model, as :func:`describe_quantized` found it.

    Example:
        >>> QuantizedModelInfo("QDQ", {"QuantizeLinear": 2}, (), (), (), {"Conv": 1}).to_data()["format"]
        'QDQ'
    """

    format: str
    format_ops: Mapping[str, int]
    weights: tuple[FormatCount, ...]
    activations: tuple[FormatCount, ...]
    biases: tuple[FormatCount, ...]
    quantized_ops: Mapping[str, int]

    def lines(self) -> list[str]:
        """Human-readable lines (``inspect``'s text output)."""
        ops = ", ".join(f"{count} {op}" for op, count in self.format_ops.items())
        lines = [f"already quantized: {self.format} ({ops})"]
        for label, formats in (("weights", self.weights), ("activations", self.activations), ("biases", self.biases)):
            if formats:
                lines.append(f"  {label}: {describe_formats(formats)}")
        if self.quantized_ops:
            lines.append("  quantized ops: " + ", ".join(f"{op} {n}" for op, n in self.quantized_ops.items()))
        return lines

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> QuantizedModelInfo:
        """Inverse of :meth:`to_data`."""
        formats = {key: tuple(FormatCount(**f) for f in data[key]) for key in ("weights", "activations", "biases")}
        return cls(data["format"], dict(data["format_ops"]), **formats, quantized_ops=dict(data["quantized_ops"]))

    def to_data(self) -> dict[str, Any]:
        """JSON-ready form (:meth:`from_data` reads it back)."""
        return {
            "format": self.format,
            "format_ops": dict(self.format_ops),
            "weights": [attrs.asdict(f) for f in self.weights],
            "activations": [attrs.asdict(f) for f in self.activations],
            "biases": [attrs.asdict(f) for f in self.biases],
            "quantized_ops": dict(self.quantized_ops),
        }


def describe_formats(formats: Iterable[FormatCount]) -> str:
    """``'20 int8 per-channel symmetric, 1 int8 per-tensor symmetric, scales not powers of two'``."""
    formats = list(formats)
    text = ", ".join(f.describe() for f in formats)
    pow2 = {f.power_of_two for f in formats} - {None}
    if pow2 == {True}:
        return f"{text}, power-of-two scales"
    if pow2 == {False}:
        return f"{text}, scales not powers of two"
    return f"{text}, power-of-two scales on some" if pow2 else text


class _Formats:
    """Collects (dtype, granularity, symmetric, power-of-two) per tensor."""

    def __init__(self) -> None:
        self.counts: collections.Counter[tuple[str, str, bool | None, bool | None]] = collections.Counter()
        self.seen: set[str] = set()

    def add(self, key: str, dtype: int | None, scale: np.ndarray | None, zero_point: np.ndarray | None) -> None:
        if key in self.seen:
            return
        self.seen.add(key)
        name = _dtype_name(dtype)
        granularity = "per-tensor" if scale is None or scale.size <= 1 else "per-channel"
        self.counts[(name, granularity, _symmetric(dtype, zero_point), _power_of_two(scale))] += 1

    def add_rescaled(self, key: str, dtype: int | None, zero_point: np.ndarray | None) -> None:
        """A weight of an integer op (ConvInteger...) whose scale is applied by a later Mul."""
        if key not in self.seen:
            self.seen.add(key)
            self.counts[
                (_dtype_name(dtype), "scale applied after the integer op", _symmetric(dtype, zero_point), None)
            ] += 1

    def add_dynamic(self, key: str) -> None:
        """An activation DynamicQuantizeLinear quantizes with a range found at run time."""
        if key not in self.seen:
            self.seen.add(key)
            self.counts[("uint8", "range found per tensor at run time", False, None)] += 1

    def result(self) -> tuple[FormatCount, ...]:
        return tuple(FormatCount(*key, count) for key, count in sorted(self.counts.items(), key=lambda kv: -kv[1]))


def _feeds_a_bias(index: GraphIndex, tensor: str) -> bool:
    """Whether ``tensor`` is a layer's bias input (a bias is one whatever its dtype: an int8
    one in ``xint8_int8_bias`` and in NPU-legalised models)."""
    return any(
        node.op_type in ("Conv", "ConvTranspose", "Gemm") and len(node.input) > 2 and node.input[2] == tensor
        for node in index.consumers(tensor)
    )


def describe_quantized(model: onnx.ModelProto) -> QuantizedModelInfo | None:
    """What the quantized model holds, or ``None`` for a float model (no quantized op)."""
    graph = model.graph
    format_ops = collections.Counter(n.op_type for n in graph.node if is_quantized_op(n))
    if not format_ops:
        return None
    index = GraphIndex(graph)
    weights, activations, biases = _Formats(), _Formats(), _Formats()
    quantized_ops: collections.Counter[str] = collections.Counter()

    def constant(name: str) -> np.ndarray | None:
        return index.constant(name) if name else None

    def input_at(node: onnx.NodeProto, i: int) -> str:
        return node.input[i] if len(node.input) > i else ""

    for node in graph.node:
        op = node.op_type
        if op == "DequantizeLinear":
            x = node.input[0]
            if index.is_constant(x):
                dtype = index.elem_type(x)
                target = biases if dtype == TensorProto.INT32 or _feeds_a_bias(index, node.output[0]) else weights
                target.add(x, dtype, constant(input_at(node, 1)), constant(input_at(node, 2)))
        elif op == "QuantizeLinear":
            zero_point = input_at(node, 2)
            dtype = index.elem_type(zero_point) if zero_point else _output_dtype(node)
            activations.add(node.output[0], dtype, constant(input_at(node, 1)), constant(zero_point))
        elif op in _QOPERATOR_LAYOUT:
            w, w_scale, zero_points = _QOPERATOR_LAYOUT[op]
            weight = input_at(node, w)
            if index.is_constant(weight):
                weights.add(weight, index.elem_type(weight), constant(input_at(node, w_scale)), None)
            for zp_index in zero_points:
                zp = input_at(node, zp_index)
                if zp:
                    activations.add(f"{node.name}:{zp_index}", index.elem_type(zp), None, constant(zp))
            quantized_ops[op] += 1
        elif op == "DynamicQuantizeLinear":
            activations.add_dynamic(node.output[0])
        elif op.startswith("QLinear") or op in ("ConvInteger", "MatMulInteger"):
            weight = input_at(node, 1)
            if op in ("ConvInteger", "MatMulInteger") and index.is_constant(weight):
                weights.add_rescaled(weight, index.elem_type(weight), constant(input_at(node, 3)))
            quantized_ops[op] += 1
        elif any(_is_dequantized(index, name) for name in node.input if name):
            quantized_ops[op] += 1
    return QuantizedModelInfo(
        format=_format_name(format_ops),
        format_ops=dict(sorted(format_ops.items())),
        weights=weights.result(),
        activations=activations.result(),
        biases=biases.result(),
        quantized_ops=dict(sorted(quantized_ops.items())),
    )


def _is_dequantized(index: GraphIndex, tensor: str) -> bool:
    producer = index.producer(tensor)
    return producer is not None and producer.op_type == "DequantizeLinear"


def _format_name(ops: Mapping[str, int]) -> str:
    names = []
    if any(op in QDQ_OPS for op in ops):
        names.append("QDQ")
    if any(op.startswith("QLinear") or op in ("QGemm", "QAttention") for op in ops):
        names.append("QOperator")
    if any(op in DYNAMIC_OPS for op in ops):
        names.append("dynamic")
    return " + ".join(names)


def _output_dtype(node: onnx.NodeProto) -> int:
    for attribute in node.attribute:
        if attribute.name == "output_dtype" and attribute.i:
            return int(attribute.i)
    return TensorProto.UINT8  # QuantizeLinear's default without a zero point


def _dtype_name(dtype: int | None) -> str:
    if not dtype:
        return "unknown"
    return str(TensorProto.DataType.Name(dtype)).lower() if dtype in TensorProto.DataType.values() else str(dtype)


def _symmetric(dtype: int | None, zero_point: np.ndarray | None) -> bool | None:
    """Zero point at the middle of the range: 0 for signed types, 2**(bits-1) for unsigned."""
    if zero_point is None:
        return None if dtype is None else True  # an omitted zero point is 0
    if zero_point.size == 0:
        return None
    values = np.asarray(zero_point, np.int64)
    middle = 0
    if dtype in (TensorProto.UINT8, TensorProto.UINT16, TensorProto.UINT4):
        bits = {int(TensorProto.UINT8): 8, int(TensorProto.UINT16): 16, int(TensorProto.UINT4): 4}[dtype]
        middle = 1 << (bits - 1)
        if np.all(values == 0):
            return False  # unsigned with zero point 0: a one-sided (asymmetric) range
    return bool(np.all(values == middle))


def _power_of_two(scale: np.ndarray | None) -> bool:
    if scale is None or scale.size == 0:
        return False
    values = np.asarray(scale, np.float64)
    if not np.all(values > 0) or not np.all(np.isfinite(values)):
        return False
    exponent = np.log2(values)
    return bool(np.all(exponent == np.round(exponent)))
