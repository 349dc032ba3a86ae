"""Edits of a QDQ model that ``legalize`` and the ``quant_info.json`` importer make:
new qparams for an activation (its QuantizeLinear and every DequantizeLinear of it), new
codes for a constant, a float constant quantized behind a new DequantizeLinear, a
QuantizeLinear/DequantizeLinear pair removed. Every new tensor gets a fresh name, so
initializers that other nodes share are never changed.

Example:
    >>> float(np.asarray(scale_for(3)))
    0.125
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from quant_core.onnx_qdq.build import tensor_proto
from quant_core.onnx_qdq.graph import GraphIndex
from quant_core.onnx_qdq.reader import QDQGraph
from quant_core.qparams import round_values, scale_from_fix_pos
from quant_core.spec import RoundMode


def scale_for(position: int) -> np.ndarray:
    """``2**-position`` as a float32 scalar."""
    return np.asarray(scale_from_fix_pos(position), np.float32)


def quantize_real(
    values: np.ndarray, position: int, qmin: int, qmax: int, rounding: RoundMode
) -> tuple[np.ndarray, int]:
    """Integer codes of exact real ``values`` at ``position`` and how many saturated.

    Example:
        >>> codes, clipped = quantize_real(np.array([0.3, -9.0]), 4, -127, 127, RoundMode.HALF_EVEN)
        >>> codes.tolist(), clipped
        ([5, -127], 1)
    """
    scaled = round_values(np.ldexp(np.asarray(values, np.float64), position), rounding)
    clipped = int(np.count_nonzero((scaled < qmin) | (scaled > qmax)))
    return np.clip(scaled, qmin, qmax).astype(np.int64), clipped


def _drop_axis(node: onnx.NodeProto) -> None:
    kept = [a for a in node.attribute if a.name != "axis"]
    del node.attribute[:]
    node.attribute.extend(kept)


class ModelEditor:
    """Edits ``model`` in place (callers pass their own copy); ``finish`` drops what the
    edits left unused and sorts the nodes.

    Example:
        >>> editor = ModelEditor(onnx.ModelProto())
        >>> editor.initializer("w", np.zeros(2, np.int8)), [t.name for t in editor.graph.initializer]
        ('w', ['w'])
    """

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.graph = model.graph
        self.names = GraphIndex(model.graph)
        self.retyped: set[str] = set()
        self.removed: set[int] = set()

    def initializer(self, prefix: str, value: np.ndarray) -> str:
        name = self.names.unique_name(prefix)
        self.graph.initializer.append(tensor_proto(name, value))
        return name

    def _replace_initializer(self, name: str, value: np.ndarray) -> str:
        for i, tensor in enumerate(self.graph.initializer):
            if tensor.name == name:
                self.graph.initializer[i].CopyFrom(tensor_proto(name, value))
                self.retyped.add(name)
                return name
        return self.initializer(f"{name}_npu", value)

    def qparams(self, base: str, position: int, zero_point: int, elem_type: int) -> tuple[str, str]:
        dtype = onnx.helper.tensor_dtype_to_np_dtype(elem_type)
        scale = self.initializer(f"{base}_npu_scale", scale_for(position))
        zp = self.initializer(f"{base}_npu_zero_point", np.asarray(zero_point, dtype))
        return scale, zp

    @staticmethod
    def _use(node: onnx.NodeProto, params: tuple[str, str]) -> None:
        while len(node.input) < 3:
            node.input.append("")
        node.input[1], node.input[2] = params
        _drop_axis(node)

    def set_activation(self, qdq: QDQGraph, key: str, position: int, zero_point: int, elem_type: int) -> None:
        """``key``'s QuantizeLinear and DequantizeLinear nodes at ``position``, stored as ``elem_type``."""
        params = self.qparams(key, position, zero_point, elem_type)
        quantizer = qdq.quantizers.get(key)
        if quantizer is not None:
            self._use(quantizer, params)
        for dq in qdq.dequantizers.get(key, ()):
            self._use(dq, params)
        if elem_type != qdq.tensors[key].elem_type:
            self.retyped.add(key)

    def set_constant(self, qdq: QDQGraph, key: str, codes: np.ndarray, position: int) -> None:
        """A constant's DequantizeLinear reads ``codes`` (int8/int32 by their dtype) at ``position``."""
        tensor = qdq.tensors[key]
        base = tensor.initializer or key
        readers = {id(r) for r in self.names.consumers(base)}
        if readers and readers <= {id(d) for d in qdq.dequantizers.get(key, ())}:
            name = self._replace_initializer(base, codes)  # read only here: keep its name
        else:
            name = self.initializer(f"{base}_npu", codes)
        elem_type = helper.np_dtype_to_tensor_dtype(codes.dtype)
        for dq in qdq.dequantizers.get(key, ()):
            dq.input[0] = name
            self._use(dq, self.qparams(base, position, 0, elem_type))

    def dequantized_constant(
        self, base: str, codes: np.ndarray, params: tuple[str, str], axis: int | None = None
    ) -> str:
        """``codes`` behind a new DequantizeLinear reading ``params`` (scale, zero point);
        returns its output."""
        name = self.initializer(f"{base}_npu", codes)
        output = self.names.unique_name(f"{base}_npu_DequantizeLinear_Output")
        dq_name = self.names.unique_name(f"{base}_npu_DequantizeLinear")
        node = helper.make_node("DequantizeLinear", [name, *params], [output], name=dq_name)
        if axis is not None:
            node.attribute.append(helper.make_attribute("axis", axis))
        self.graph.node.append(node)
        return output

    def quantize_input(self, node: onnx.NodeProto, index: int, codes: np.ndarray, position: int) -> None:
        """Replace ``node``'s float constant input ``index`` by ``codes`` behind a new DequantizeLinear."""
        base = node.input[index]
        params = self.qparams(base, position, 0, helper.np_dtype_to_tensor_dtype(codes.dtype))
        node.input[index] = self.dequantized_constant(base, codes, params)

    def quantize_tensor(self, tensor: str, position: int, zero_point: int, elem_type: int) -> str:
        """A QuantizeLinear/DequantizeLinear pair on float ``tensor`` at ``position``;
        returns the DequantizeLinear's output (what readers of the tensor read)."""
        params = self.qparams(tensor, position, zero_point, elem_type)
        codes = self.names.unique_name(f"{tensor}_QuantizeLinear_Output")
        output = self.names.unique_name(f"{tensor}_DequantizeLinear_Output")
        self.graph.node.append(
            helper.make_node("QuantizeLinear", [tensor, *params], [codes], name=self.names.unique_name(f"{tensor}_Q"))
        )
        self.graph.node.append(
            helper.make_node(
                "DequantizeLinear", [codes, *params], [output], name=self.names.unique_name(f"{tensor}_DQ")
            )
        )
        return output

    def insert_clamp(self, qdq: QDQGraph, key: str, lo: float, hi: float | None) -> str:
        """A Clip(lo, hi) (``hi`` None: a Relu, ``lo`` must then be 0) between ``key``'s
        QuantizeLinear and the float tensor it reads; returns the new node's op type."""
        quantizer = qdq.quantizers[key]
        source = quantizer.input[0]
        output = self.names.unique_name(f"{source}_npu_clamp")
        name = self.names.unique_name(f"{source}_npu_clamp")
        if hi is None:
            node = helper.make_node("Relu", [source], [output], name=name)
        else:
            bounds = [
                self.initializer(f"{name}_{side}", np.asarray(v, np.float32)) for side, v in (("min", lo), ("max", hi))
            ]
            node = helper.make_node("Clip", [source, *bounds], [output], name=name)
        self.graph.node.append(node)
        quantizer.input[0] = output
        return node.op_type

    def remove_pair(self, qdq: QDQGraph, key: str) -> None:
        """Remove ``key``'s QuantizeLinear and DequantizeLinear nodes; their readers read the float tensor."""
        quantizer = qdq.quantizers[key]
        source = quantizer.input[0]
        for dq in qdq.dequantizers.get(key, ()):
            for reader in qdq.consumers(dq.output[0]):
                for i, name in enumerate(reader.input):
                    if name == dq.output[0]:
                        reader.input[i] = source
            self.removed.add(id(dq))
        self.removed.add(id(quantizer))

    def finish(self) -> onnx.ModelProto:
        """Drop removed nodes, unused initializers and stale value_info; sort the nodes."""
        kept = [n for n in self.graph.node if id(n) not in self.removed]
        del self.graph.node[:]
        self.graph.node.extend(kept)
        ordered = GraphIndex(self.graph).topological_order()
        copies = [onnx.NodeProto() for _ in ordered]
        for copy, node in zip(copies, ordered, strict=True):
            copy.CopyFrom(node)
        del self.graph.node[:]
        self.graph.node.extend(copies)
        used = {name for node in self.graph.node for name in node.input}
        used |= {o.name for o in self.graph.output}
        inputs = {i.name for i in self.graph.input}
        initializers = [t for t in self.graph.initializer if t.name in used or t.name in inputs]
        del self.graph.initializer[:]
        self.graph.initializer.extend(initializers)
        produced = {o for node in self.graph.node for o in node.output}
        infos = [
            v for v in self.graph.value_info if v.name not in self.retyped and (v.name in produced or v.name in used)
        ]
        del self.graph.value_info[:]
        self.graph.value_info.extend(infos)
        return self.model
