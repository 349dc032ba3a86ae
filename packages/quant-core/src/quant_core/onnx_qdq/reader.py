"""A QDQ ONNX model read as an integer program: which integer tensors exist, their fix
positions, and which compute node reads and writes which.

In the QDQ convention (both backends write it) an activation is quantized once by a
``QuantizeLinear`` after its producer and read through one ``DequantizeLinear`` per
consumer; a weight or bias is an integer initializer behind a ``DequantizeLinear``. An
*integer tensor* is keyed by the QuantizeLinear's output name (activations) or by the
DequantizeLinear's output name (constants).

Example:
    >>> import numpy as np
    >>> from onnx import TensorProto, helper, numpy_helper
    >>> inits = [numpy_helper.from_array(np.array(0.25, np.float32), "s"),
    ...          numpy_helper.from_array(np.array(128, np.uint8), "z")]
    >>> nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
    ...          helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
    ...          helper.make_node("Relu", ["xd"], ["y"], name="relu"),
    ...          helper.make_node("QuantizeLinear", ["y", "s", "z"], ["yq"])]
    >>> g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
    ...     [helper.make_tensor_value_info("yq", TensorProto.UINT8, [1])], inits)
    >>> qdq = QDQGraph(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]))
    >>> t = qdq.tensors["xq"]
    >>> t.position, t.value_range, t.is_symmetric
    (2, (-128, 127), True)
    >>> [(n.node.name, n.data_inputs, n.output) for n in qdq.compute_nodes]
    [('relu', ('xq',), 'yq')]
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import numpy as np
import onnx

from quant_core.dtypes import DType
from quant_core.errors import ModelError
from quant_core.onnx_qdq.graph import GraphIndex, int_attribute, is_default_domain, node_label
from quant_core.qparams import pow2_fix_pos, scale_from_fix_pos

QUANTIZE = "QuantizeLinear"
DEQUANTIZE = "DequantizeLinear"
HOST_OPS = frozenset({"Shape", "Size"})
"""Ops that read only a tensor's shape: never on the data path."""


@attrs.frozen(eq=False)
class QuantTensor:
    """One integer tensor of the model.

    Args:
        key: the QuantizeLinear output (activations) or DequantizeLinear output (constants).
        scale, zero_point: as stored (``()`` per tensor, ``(C,)`` per channel).
        elem_type: ONNX element type of the codes.
        axis: per-channel axis, or None.
        codes: the integer codes of a constant, else None.
        float_name: the float tensor a QuantizeLinear reads (activations), or None.
        initializer: the integer initializer's name (constants), or None.

    Example:
        >>> t = QuantTensor("k", np.array(0.5, np.float32), np.array(0), onnx.TensorProto.INT8, None)
        >>> t.position, t.value_range, t.bits
        (1, (-128, 127), 8)
    """

    key: str
    scale: np.ndarray
    zero_point: np.ndarray
    elem_type: int
    axis: int | None
    codes: np.ndarray | None = None
    float_name: str | None = None
    initializer: str | None = None

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(self.elem_type))

    @property
    def dtype(self) -> DType:
        """The storage format (int4/uint4 included)."""
        return DType.parse(self.numpy_dtype.name)

    @property
    def bits(self) -> int:
        return self.dtype.bits

    @property
    def signed(self) -> bool:
        return self.dtype.signed

    @property
    def symmetric_offset(self) -> int:
        """The zero point of a symmetric tensor of this storage type (uint8: 128)."""
        return 0 if self.signed else 2 ** (self.bits - 1)

    @property
    def is_symmetric(self) -> bool:
        return bool(np.all(self.zero_point == self.symmetric_offset))

    @property
    def is_constant(self) -> bool:
        return self.codes is not None

    @property
    def fix_pos(self) -> np.ndarray | None:
        """Positions when every scale is an exact power of two, else None."""
        pos = pow2_fix_pos(self.scale)
        return pos if np.array_equal(scale_from_fix_pos(pos), self.scale.astype(np.float32)) else None

    @property
    def position(self) -> int | None:
        """The fix position of a per-tensor power-of-two tensor, else None."""
        pos = self.fix_pos
        if pos is None or pos.size != 1 or (self.axis is not None and self.scale.ndim):
            return None
        return int(pos.reshape(-1)[0])

    @property
    def value_range(self) -> tuple[int, int]:
        """Range of the signed values ``q - zero_point`` (per-tensor zero point)."""
        zp = int(np.asarray(self.zero_point).reshape(-1)[0])
        return self.dtype.qmin - zp, self.dtype.qmax - zp

    def values(self) -> np.ndarray:
        """A constant's signed integer values ``q - zero_point`` (int64)."""
        if self.codes is None:
            raise ModelError(f"tensor {self.key!r} is not a constant")
        zp = np.asarray(self.zero_point, np.int64)
        if self.axis is not None and zp.ndim:
            shape = [1] * self.codes.ndim
            shape[self.axis] = -1
            zp = zp.reshape(shape)
        return self.codes.astype(np.int64) - zp

    def real_values(self) -> np.ndarray:
        """A constant's real values ``(q - zp) * scale`` in float64 (exact for these formats)."""
        scale = np.asarray(self.scale, np.float64)
        values = self.values()
        if self.axis is not None and scale.ndim:
            shape = [1] * values.ndim
            shape[self.axis] = -1
            scale = scale.reshape(shape)
        return values.astype(np.float64) * scale

    def describe(self) -> str:
        """``int8@5``-style text for messages."""
        dtype = self.dtype.value
        pos = self.fix_pos
        if pos is None:
            return f"{dtype} scale {float(np.asarray(self.scale).reshape(-1)[0]):.6g}"
        if pos.size == 1:
            return f"{dtype}@{int(pos.reshape(-1)[0])}"
        return f"{dtype}@[{int(pos.min())}..{int(pos.max())}] per channel"


@attrs.frozen(eq=False)
class ComputeNode:
    """A node on the data path with its integer inputs and output resolved (see the
    module example: ``relu`` reads ``xq`` and writes ``yq``).

    Args:
        node: the ONNX node.
        data_inputs: per input index, the key of the integer tensor it reads through a
            DequantizeLinear, or None (a float, constant or shape input).
        output: key of the QuantizeLinear reading ``node.output[0]``, or None.
    """

    node: onnx.NodeProto
    data_inputs: tuple[str | None, ...]
    output: str | None

    @property
    def op_type(self) -> str:
        return self.node.op_type

    @property
    def name(self) -> str:
        return node_label(self.node)


class QDQGraph:
    """Integer tensors and compute nodes of a QDQ model (a snapshot; ``model`` is not
    modified; see the module example). Raises ModelError with one line when a
    QuantizeLinear/DequantizeLinear has non-constant qparams.
    """

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.graph = model.graph
        self.index = GraphIndex(model.graph)
        self.tensors: dict[str, QuantTensor] = {}
        self.quantizers: dict[str, onnx.NodeProto] = {}
        self.dequantizers: dict[str, list[onnx.NodeProto]] = {}
        self.dequantized: dict[str, str] = {}  # DequantizeLinear output -> key
        self.quantized: dict[str, str] = {}  # float tensor -> key of its QuantizeLinear
        self.host_values: set[str] = set()
        self.order = self.index.topological_order()
        self.compute_nodes: list[ComputeNode] = []
        for node in self.order:
            if node.op_type == QUANTIZE and is_default_domain(node):
                self._read_quantize(node)
        for node in self.order:
            if node.op_type == DEQUANTIZE and is_default_domain(node):
                self._read_dequantize(node)
        constants = {t.name for t in self.graph.initializer}
        for node in self.order:
            if node.op_type in (QUANTIZE, DEQUANTIZE) and is_default_domain(node):
                continue
            if node.op_type == "Constant" or self._is_host(node, constants):
                self.host_values.update(o for o in node.output if o)
                continue
            inputs = tuple(self.dequantized.get(name) if name else None for name in node.input)
            output = self.quantized.get(node.output[0]) if node.output else None
            self.compute_nodes.append(ComputeNode(node, inputs, output))

    # ------------------------------------------------------------------ reading
    def _qparams(self, node: onnx.NodeProto) -> tuple[np.ndarray, np.ndarray | None]:
        scale = self.index.constant(node.input[1])
        if scale is None:
            raise ModelError(f"node {node_label(node)!r}: {node.op_type} scale is not a constant")
        zero_point = None
        if len(node.input) > 2 and node.input[2]:
            zero_point = self.index.constant(node.input[2])
            if zero_point is None:
                raise ModelError(f"node {node_label(node)!r}: {node.op_type} zero point is not a constant")
        return np.asarray(scale, np.float32), zero_point

    def _axis(self, node: onnx.NodeProto, scale: np.ndarray) -> int | None:
        return int_attribute(node, "axis", 1) if scale.ndim else None

    def _read_quantize(self, node: onnx.NodeProto) -> None:
        scale, zero_point = self._qparams(node)
        elem_type = int_attribute(node, "output_dtype", 0) or onnx.TensorProto.UINT8
        if zero_point is not None:
            elem_type = int(onnx.helper.np_dtype_to_tensor_dtype(zero_point.dtype))
        key = node.output[0]
        zp = np.zeros(scale.shape, np.int64) if zero_point is None else zero_point.astype(np.int64)
        self.tensors[key] = QuantTensor(key, scale, zp, elem_type, self._axis(node, scale), float_name=node.input[0])
        self.quantizers[key] = node
        self.quantized.setdefault(node.input[0], key)

    def _read_dequantize(self, node: onnx.NodeProto) -> None:
        source = node.input[0]
        if source in self.tensors and source in self.quantizers:
            key = source
        else:
            codes = self.index.constant(source)
            scale, zero_point = self._qparams(node)
            if codes is None:  # an integer graph input read directly
                elem_type = self.index.elem_type(source) or onnx.TensorProto.INT8
            else:
                elem_type = onnx.helper.np_dtype_to_tensor_dtype(codes.dtype)
            zp = np.zeros(scale.shape, np.int64) if zero_point is None else zero_point.astype(np.int64)
            key = node.output[0] if codes is not None else source
            self.tensors[key] = QuantTensor(
                key, scale, zp, elem_type, self._axis(node, scale), codes=codes, initializer=source
            )
        self.dequantizers.setdefault(key, []).append(node)
        self.dequantized[node.output[0]] = key

    def _is_host(self, node: onnx.NodeProto, constants: set[str]) -> bool:
        """Shape computations: Shape/Size, and nodes whose every input is a constant or a
        host value (their outputs depend only on shapes and constants)."""
        if node.op_type in HOST_OPS:
            return True
        names = [n for n in node.input if n]
        return all(n in constants or n in self.host_values for n in names)

    # ------------------------------------------------------------------ queries
    def position(self, key: str | None) -> int | None:
        """Fix position of a per-tensor power-of-two tensor (None for unknown keys)."""
        tensor = self.tensors.get(key) if key else None
        return None if tensor is None else tensor.position

    def consumers(self, name: str) -> list[onnx.NodeProto]:
        return self.index.consumers(name)

    def producer(self, name: str) -> onnx.NodeProto | None:
        return self.index.producer(name)

    def constant(self, name: str) -> np.ndarray | None:
        """Value of a float/int constant input (initializer or Constant node)."""
        return self.index.constant(name) if name else None

    def constant_input(self, node: onnx.NodeProto, index: int) -> np.ndarray | None:
        """Input ``index`` of ``node`` as a constant (a Resize's scales...), or None when it
        is absent, empty or computed."""
        return self.constant(node.input[index]) if len(node.input) > index else None

    def activation_keys(self) -> Iterator[str]:
        """Keys of every non-constant integer tensor, in graph order."""
        return (k for k, t in self.tensors.items() if not t.is_constant)

    def is_graph_output_key(self, key: str) -> bool:
        """Whether a DequantizeLinear of ``key`` writes a graph output."""
        return any(self.index.is_graph_output(d.output[0]) for d in self.dequantizers.get(key, ()))

    def readers(self, key: str) -> list[onnx.NodeProto]:
        """Nodes reading ``key`` through its DequantizeLinear nodes (each once)."""
        seen: dict[int, onnx.NodeProto] = {}
        for dq in self.dequantizers.get(key, ()):
            for node in self.index.consumers(dq.output[0]):
                seen.setdefault(id(node), node)
        return list(seen.values())
