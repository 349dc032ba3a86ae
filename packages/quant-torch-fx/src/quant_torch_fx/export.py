"""``export_onnx``: a frozen model as a QDQ ONNX model that onnxruntime runs with its
integer kernels.

The frozen graph is exported with torch's TorchScript ONNX exporter after each
quantizer is swapped for a module whose ``symbolic`` writes the QDQ form directly:

- an activation quantizer becomes ``QuantizeLinear -> DequantizeLinear`` with the
  group's qparams (int8 stored as uint8 with zero point + 128 for x86 by default,
  :func:`quant_core.qdq.encode_activation`), wherever the plan put it;
- a weight becomes an integer initializer (its codes, ``quant_core.qparams.quantize``)
  behind a ``DequantizeLinear`` (per-channel ``axis`` from the plan);
- a bias becomes the int32 initializer :func:`quant_core.bias.encode_bias` produced at
  freeze, behind a ``DequantizeLinear`` at ``input_scale * weight_scale``.

The torch forward of each swapped module is the exact fake quantization the frozen
model computes, so the traced values, and the exported model's outputs, match the
frozen model's. A small ONNX pass afterwards makes ``Shape``/``Size`` read the quantized
tensor (an extra float consumer would keep a convolution out of the integer kernels)
and raises the opset where 16-bit formats need it. The file is written atomically.

Example:
    >>> import io, torch, onnx
    >>> from quant_core.presets import get_preset
    >>> from quant_torch_fx import ModelQuantizer
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.ReLU())
    >>> q = ModelQuantizer(get_preset("a8w8"), quiet=True)
    >>> frozen = q.freeze(q.quantize_model(net, torch.randn(1, 3, 4, 4), [torch.randn(8, 3, 4, 4)]))
    >>> model = onnx_model(frozen, (torch.randn(1, 3, 4, 4),))
    >>> [n.op_type for n in model.graph.node]
    ['QuantizeLinear', 'DequantizeLinear', 'DequantizeLinear', 'DequantizeLinear', 'Conv', 'QuantizeLinear', 'DequantizeLinear']
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from torch import nn
from torch.fx import GraphModule, Node

from quant_core.atomic_io import atomic_write
from quant_core.dtypes import DType
from quant_core.qdq import (
    ACTIVATION_ENCODINGS,
    MATMUL_WEIGHT_AXIS,
    ActivationEncoding,
    encode_activation,
    guard_matmul_weight,
    required_opset,
)
from quant_core.qparams import QParams, quantize
from quant_core.spec import RoundMode
from quant_torch_fx.capture import as_args, copy_captured
from quant_torch_fx.fake_quantize import fake_quantize_tensors
from quant_torch_fx.prepare import (
    activation_quantizers,
    graph_info,
    quantized_graphs,
    unique_name,
    weight_quantizers,
)

DEFAULT_OPSET = 17
MAX_TORCHSCRIPT_OPSET = 20
_ROUNDING = list(RoundMode)
# The TorchScript exporter cannot type uint16 tensors. Such codes and zero points travel as
# int32 through nodes of this placeholder domain, which the exporter leaves untyped; after
# the export :func:`_restore_uint16` makes them standard Q/DQ nodes on uint16 initializers.
_UINT16_DOMAIN = "quant_torch_fx.uint16"
_TORCH_DTYPES = {
    DType.INT8: torch.int8,
    DType.UINT8: torch.uint8,
    DType.INT16: torch.int16,
    DType.UINT16: torch.int32,  # through the placeholder domain above
    DType.INT32: torch.int32,
}


def _torch_dtype(dtype: DType) -> torch.dtype:
    if dtype not in _TORCH_DTYPES:
        allowed = ", ".join(d.value for d in _TORCH_DTYPES)
        raise ValueError(f"export: {dtype.value} codes cannot be written by this exporter; allowed: {allowed}")
    return _TORCH_DTYPES[dtype]


def _qdq_domain(dtype: DType) -> str:
    return f"{_UINT16_DOMAIN}::" if dtype == DType.UINT16 else ""


class _QuantizeDequantize(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        scale: torch.Tensor,
        zero_point: torch.Tensor,
        qmin: int,
        qmax: int,
        rounding: int,
        domain: str,
    ) -> torch.Tensor:
        zp = zero_point.to(torch.float32)
        return fake_quantize_tensors(x, scale, zp, qmin, qmax, _ROUNDING[rounding])

    @staticmethod
    def symbolic(g: Any, x: Any, scale: Any, zero_point: Any, qmin: int, qmax: int, rounding: int, domain: str) -> Any:
        q = g.op(f"{domain}QuantizeLinear", x, scale, zero_point)
        out = g.op(f"{domain}DequantizeLinear", q, scale, zero_point)
        if domain:
            out.setType(x.type())  # a placeholder node's output type is the float input's
        return out


class _Dequantize(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int, domain: str
    ) -> torch.Tensor:  # type: ignore[override]
        if axis < 0 or scale.dim() == 0:
            return (codes.to(torch.float64) - zero_point.to(torch.float64)).to(torch.float32) * scale
        shape = [1] * codes.dim()
        shape[axis] = -1
        centred = codes.to(torch.float64) - zero_point.to(torch.float64).reshape(shape)
        return centred.to(torch.float32) * scale.reshape(shape)

    @staticmethod
    def symbolic(g: Any, codes: Any, scale: Any, zero_point: Any, axis: int, domain: str) -> Any:
        attributes = {} if axis < 0 else {"axis_i": axis}
        out = g.op(f"{domain}DequantizeLinear", codes, scale, zero_point, **attributes)
        if domain:
            out.setType(scale.type().with_sizes(codes.type().sizes()))
        return out


class QuantizeDequantize(nn.Module):
    """An activation's ``QuantizeLinear -> DequantizeLinear`` for export.

    Example:
        >>> m = QuantizeDequantize(QParams.per_tensor(0.5, 128, "uint8"))
        >>> m(torch.tensor([0.26, -100.0])).tolist()
        [0.5, -64.0]
    """

    def __init__(self, qp: QParams) -> None:
        super().__init__()
        if qp.axis is not None:
            raise ValueError("export: activations are quantized per tensor")
        self.register_buffer("scale", torch.as_tensor(np.asarray(qp.scale, np.float32)))
        self.register_buffer("zero_point", torch.as_tensor(np.asarray(qp.zero_point), dtype=_torch_dtype(qp.dtype)))
        self.qmin, self.qmax = qp.qmin, qp.qmax
        self.rounding = _ROUNDING.index(qp.rounding)
        self.domain = _qdq_domain(qp.dtype)

    def forward(self, x: torch.Tensor, observe_batch: bool = True, redundant: bool = False) -> torch.Tensor:
        out: torch.Tensor = _QuantizeDequantize.apply(
            x, self.scale, self.zero_point, self.qmin, self.qmax, self.rounding, self.domain
        )
        return out


class Dequantize(nn.Module):
    """Integer codes (an initializer) behind a ``DequantizeLinear``: weights and biases.

    Example:
        >>> qp = QParams.per_tensor(0.25, 0, "int8")
        >>> Dequantize(np.array([4, -8], np.int8), qp)().tolist()
        [1.0, -2.0]
    """

    def __init__(self, codes: np.ndarray, qp: QParams) -> None:
        super().__init__()
        dtype = _torch_dtype(qp.dtype)
        self.register_buffer("codes", torch.from_numpy(np.ascontiguousarray(codes)).to(dtype))
        self.register_buffer("scale", torch.as_tensor(np.asarray(qp.scale, np.float32)))
        self.register_buffer("zero_point", torch.as_tensor(np.asarray(qp.zero_point), dtype=dtype))
        self.axis = -1 if qp.axis is None else int(qp.axis)
        self.domain = _qdq_domain(qp.dtype)

    def forward(self, *_unused: Any, **_ignored: Any) -> torch.Tensor:
        out: torch.Tensor = _Dequantize.apply(self.codes, self.scale, self.zero_point, self.axis, self.domain)
        return out


def _export_form(frozen: nn.Module, encoding: ActivationEncoding) -> tuple[nn.Module, set[DType]]:
    """A copy of ``frozen`` whose quantizers write QDQ, and the stored formats."""
    model = copy_captured(frozen)
    formats: set[DType] = set()
    graphs = quantized_graphs(model)
    if not graphs:
        raise ValueError(
            "export: the model holds no quantized graph; quantize it first "
            "(ModelQuantizer.quantize_model or prepare_qat, then freeze)"
        )
    for gm in graphs:
        info = graph_info(gm)
        if not info.frozen:
            raise ValueError("export: the model is not frozen; call ModelQuantizer.freeze first")
        for _key, fq in list(activation_quantizers(gm)):
            qp = encode_activation(fq.current_qparams(), encoding)
            formats.add(qp.dtype)
            _swap(gm, fq, QuantizeDequantize(qp).to(fq.scale.device))
        weight_nodes = {node: gm.get_submodule(path) for node, path in info.weights.items()}
        by_name = {n.name: n for n in gm.graph.nodes}
        calls = _calls_by_target(gm)
        for node, fq in list(weight_quantizers(gm)):
            qp = fq.current_qparams()
            formats.add(qp.dtype)
            for call in calls.get(info.weights[node], []):
                weight_node = call.args[0]
                assert isinstance(weight_node, Node)
                value = _get_attr(gm, weight_node).detach().float().cpu().numpy()
                call.args, call.kwargs = (), {}
                if not weight_node.users:
                    gm.graph.erase_node(weight_node)
                _swap(gm, weight_nodes[node], Dequantize(quantize(value, qp), qp).to(fq.scale.device))
        for node, encoded in info.biases.items():
            if encoded.codes is None or encoded.qparams is None:
                continue
            consumer = by_name[info.weighted[node]]
            slot = next(s for s in info.plan.biases if s.node == node)
            bias_node = consumer.args[slot.input_index]
            assert isinstance(bias_node, Node)
            path = f"bias_dequantizers.{len(list(_bias_paths(gm)))}"
            device = _get_attr(gm, bias_node).device
            gm.add_submodule(path, Dequantize(encoded.codes.reshape(-1), encoded.qparams).to(device))
            formats.add(encoded.qparams.dtype)
            with gm.graph.inserting_before(consumer):
                dq = gm.graph.call_module(path, ())
            consumer.replace_input_with(bias_node, dq)
            if not bias_node.users:
                gm.graph.erase_node(bias_node)
        _dynamic_shapes_for_tracing(gm)
        gm.graph.lint()
        gm.recompile()
    model.eval()
    return model, formats


def _bias_paths(gm: GraphModule) -> list[str]:
    try:
        holder = gm.get_submodule("bias_dequantizers")
    except AttributeError:
        return []
    return [name for name, _ in holder.named_children()]


def _calls_by_target(gm: GraphModule) -> dict[str, list[Node]]:
    calls: dict[str, list[Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            calls.setdefault(str(node.target), []).append(node)
    return calls


def _get_attr(gm: GraphModule, node: Node) -> torch.Tensor:
    value: Any = gm
    for part in str(node.target).split("."):
        value = getattr(value, part)
    assert isinstance(value, torch.Tensor)
    return value


def _swap(gm: GraphModule, old: nn.Module, new: nn.Module) -> None:
    for name, module in gm.named_modules():
        if module is old:
            gm.set_submodule(name, new)


def _is_symbolic(value: Any) -> bool:
    if isinstance(value, Node):
        meta = value.meta.get("val")
        return isinstance(meta, torch.SymInt | torch.SymFloat | torch.SymBool)
    if isinstance(value, list | tuple):
        return any(_is_symbolic(v) for v in value)
    return False


def _dynamic_shapes_for_tracing(gm: GraphModule) -> None:
    """``sym_size`` and ATen calls taking sizes become Tensor method calls, which the
    TorchScript tracer records as shape arithmetic (ATen overloads would freeze the batch)."""
    for node in list(gm.graph.nodes):
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        name = target._schema.name.split("::", 1)[-1]
        if name == "sym_size":
            node.op, node.target = "call_method", "size"
        elif _is_symbolic(node.args) and hasattr(torch.Tensor, name):
            node.op, node.target = "call_method", name


def onnx_model(
    frozen: nn.Module,
    example_inputs: Any,
    *,
    opset: int = DEFAULT_OPSET,
    activation_encoding: ActivationEncoding = "x86_uint8",
    dynamic_batch: bool = True,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
) -> onnx.ModelProto:
    """The QDQ ``ModelProto`` of a frozen model (see the module docstring)."""
    if activation_encoding not in ACTIVATION_ENCODINGS:
        raise ValueError(
            f"activation_encoding: {activation_encoding!r} is not allowed; allowed: {', '.join(ACTIVATION_ENCODINGS)}"
        )
    model, formats = _export_form(frozen, activation_encoding)
    args = as_args(example_inputs)
    needed = required_opset(formats)
    export_opset = min(max(opset, 13), MAX_TORCHSCRIPT_OPSET)
    names_in = list(input_names) if input_names is not None else _default_names("input", len(args))
    with torch.no_grad():
        outputs = _leaves(model(*args))
    names_out = list(output_names) if output_names is not None else _default_names("output", len(outputs))
    axes: dict[str, dict[int, str]] = {}
    if dynamic_batch:
        for name, value in (*zip(names_in, args, strict=False), *zip(names_out, outputs, strict=False)):
            if isinstance(value, torch.Tensor) and value.dim():
                axes[name] = {0: "batch"}
    buffer = io.BytesIO()
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        torch.onnx.export(
            _Traced(model),  # a plain wrapper: the exporter takes a module with a .graph for a ScriptModule
            args,
            buffer,  # type: ignore[arg-type]  # file objects work; the stub says paths only
            dynamo=False,
            opset_version=export_opset,
            input_names=names_in,
            output_names=names_out,
            dynamic_axes=axes or None,
            do_constant_folding=True,
        )
    _pass_on_tracer_warnings(caught)
    proto = onnx.load_from_string(buffer.getvalue())
    _inline_identities(proto)
    _restore_uint16(proto)
    _strip_prefix(proto, "inner.")
    _shape_reads_quantized(proto)
    _keep_matmuls_out_of_matmulnbits(proto)
    _drop_unread(proto)  # what the passes above left unread: int32 copies, bypassed Transposes
    _raise_opset(proto, max(opset, needed))
    return proto


def _pass_on_tracer_warnings(caught: list[warnings.WarningMessage]) -> None:
    """The tracer's warnings say where the file may compute something else than the model
    (float code around ``regions`` with value-dependent Python); its other warnings (the
    legacy exporter's deprecation) say nothing about the model and are dropped."""
    seen = set()
    for item in caught:
        if not issubclass(item.category, torch.jit.TracerWarning):
            continue
        where = f"{item.filename}:{item.lineno}"
        if where in seen:
            continue
        seen.add(where)
        warnings.warn(
            f"export: the TorchScript tracer, which records the code outside the quantized graphs, "
            f"reports at {where}: {str(item.message).rstrip('.!')}. The ONNX model keeps only what the "
            "example inputs did there; make that code traceable or put it inside a quantized region",
            UserWarning,
            stacklevel=2,
        )


class _Traced(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any) -> Any:
        return self.inner(*args)


def _default_names(prefix: str, count: int) -> list[str]:
    return [prefix if count == 1 else f"{prefix}_{i}" for i in range(count)]


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, list | tuple):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


def _raise_opset(model: onnx.ModelProto, opset: int) -> None:
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx") and entry.version < opset:
            entry.version = opset
    if opset >= 21 and model.ir_version < 10:
        model.ir_version = 10


def _inline_identities(model: onnx.ModelProto) -> None:
    """Consumers of ``Identity(initializer)`` read the initializer itself: the exporter
    deduplicates equal buffers (zero points, power-of-two scales) behind Identity nodes,
    and integer kernels want initializers at their Q/DQ inputs."""
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    outputs = {o.name for o in graph.output}
    renamed: dict[str, str] = {}
    kept = []
    for node in graph.node:
        if node.op_type == "Identity" and node.input[0] in initializers and node.output[0] not in outputs:
            renamed[node.output[0]] = node.input[0]
            continue
        kept.append(node)
    for node in kept:
        for i, name in enumerate(node.input):
            if name in renamed:
                node.input[i] = renamed[name]
    del graph.node[:]
    graph.node.extend(kept)


def _restore_uint16(model: onnx.ModelProto) -> None:
    """Placeholder-domain Q/DQ nodes become standard ones reading uint16 copies of their
    int32 initializers (codes, zero points); :func:`_drop_unread` removes the int32 ones
    nothing else reads."""
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    converted: dict[str, str] = {}
    for node in graph.node:
        if node.domain != _UINT16_DOMAIN:
            continue
        node.domain = ""
        for i, name in enumerate(node.input):
            source = initializers.get(name)
            if source is None or source.data_type != onnx.TensorProto.INT32:
                continue
            if name not in converted:
                converted[name] = unique_name(f"{name}_uint16", initializers)
                values = numpy_helper.to_array(source).astype(np.uint16)
                copy = numpy_helper.from_array(values, converted[name])
                graph.initializer.append(copy)
                initializers[copy.name] = copy
            node.input[i] = converted[name]
    kept = [entry for entry in model.opset_import if entry.domain != _UINT16_DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(kept)


def _strip_prefix(model: onnx.ModelProto, prefix: str) -> None:
    """Initializer names without the export wrapper's attribute prefix (module paths as in
    the model's ``state_dict``)."""
    graph = model.graph
    taken = {t.name for t in graph.initializer} | {i.name for i in graph.input}
    mapping = {}
    for tensor in graph.initializer:
        if tensor.name.startswith(prefix) and tensor.name[len(prefix) :] not in taken:
            mapping[tensor.name] = tensor.name[len(prefix) :]
    for tensor in graph.initializer:
        tensor.name = mapping.get(tensor.name, tensor.name)
    scope = "/" + prefix.rstrip(".")
    for node in graph.node:
        for i, name in enumerate(node.input):
            node.input[i] = mapping.get(name, name)
        if node.name.startswith(scope + "/"):
            node.name = node.name[len(scope) :]


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
            if producer is not None and producer.op_type == "DequantizeLinear" and producer.domain in ("", "ai.onnx"):
                node.input[0] = producer.input[0]
            elif source in quantized:
                node.input[0] = quantized[source]
        if node.op_type == "QuantizeLinear" and node.domain in ("", "ai.onnx"):
            quantized.setdefault(node.input[0], node.output[0])
        producers.update((out, node) for out in node.output)


_ONNX_DTYPES: dict[int, DType] = {
    onnx.TensorProto.INT8: DType.INT8,
    onnx.TensorProto.UINT8: DType.UINT8,
    onnx.TensorProto.INT16: DType.INT16,
    onnx.TensorProto.UINT16: DType.UINT16,
}


def _keep_matmuls_out_of_matmulnbits(model: onnx.ModelProto) -> None:
    """A MatMul reading a quantized 2-D weight (``linear`` on inputs of rank > 2 is exported
    as ``Transpose`` of the ``[out, in]`` weight, then MatMul) reads it as ``[in, out]``
    codes behind a DequantizeLinear of :data:`~quant_core.qdq.MATMUL_WEIGHT_AXIS` where
    :func:`~quant_core.qdq.guard_matmul_weight` says so: onnxruntime would otherwise fold the
    Transpose and rewrite the layer into ``MatMulNBits``, which computes something else."""
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    producers = {out: node for node in graph.node for out in node.output}

    def stored(name: str) -> DType | None:
        tensor = initializers.get(name)
        return None if tensor is None else _ONNX_DTYPES.get(tensor.data_type)

    for node in list(graph.node):
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            continue
        weight_source = producers.get(node.input[1])
        transpose = weight_source if weight_source is not None and weight_source.op_type == "Transpose" else None
        dq = producers.get(transpose.input[0]) if transpose is not None else weight_source
        if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in initializers:
            continue
        weight_dtype = stored(dq.input[0])
        if len(initializers[dq.input[0]].dims) != 2 or weight_dtype is None:
            continue
        reader = producers.get(node.input[0])
        activation = None
        if reader is not None and reader.op_type == "DequantizeLinear" and len(reader.input) > 2:
            activation = stored(reader.input[2])
        if not guard_matmul_weight(activation, weight_dtype):
            continue
        axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)
        per_channel = int(np.prod(initializers[dq.input[1]].dims)) > 1
        if transpose is not None:
            axis = 1 - axis % 2
        if per_channel and axis % 2 != 1:
            continue  # channels along K: -1 would name another axis
        codes = numpy_helper.to_array(initializers[dq.input[0]])
        name = unique_name(f"{dq.input[0]}_for_matmul", initializers)
        codes_in_out = codes.T if transpose is not None else codes
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(codes_in_out), name))
        params = [_one_element(graph, initializers, t) for t in dq.input[1:3]]
        guarded = onnx.helper.make_node(
            "DequantizeLinear",
            [name, *params],
            [unique_name(f"{dq.output[0]}_for_matmul", producers)],
            name=unique_name(f"{dq.name}_for_matmul", {n.name for n in graph.node}),
            axis=MATMUL_WEIGHT_AXIS,
        )
        producers[guarded.output[0]] = guarded
        initializers[name] = graph.initializer[-1]
        graph.node.insert(list(graph.node).index(node), guarded)
        node.input[1] = guarded.output[0]


def _one_element(graph: onnx.GraphProto, initializers: dict[str, onnx.TensorProto], name: str) -> str:
    """``name`` as a one-element vector (a new initializer when it is a scalar)."""
    tensor = initializers[name]
    if tensor.dims:
        return name
    vector = onnx.TensorProto()
    vector.CopyFrom(tensor)
    vector.name = unique_name(f"{name}_vector", initializers)
    vector.dims.append(1)
    graph.initializer.append(vector)
    initializers[vector.name] = vector
    return vector.name


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
    for tensor in [t for t in graph.initializer if t.name not in read]:
        graph.initializer.remove(tensor)


def export_onnx(
    frozen: nn.Module,
    example_inputs: Any,
    path: str | os.PathLike[str],
    *,
    opset: int = DEFAULT_OPSET,
    activation_encoding: ActivationEncoding = "x86_uint8",
    dynamic_batch: bool = True,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
) -> Path:
    """Write :func:`onnx_model` to ``path`` atomically; returns the path. Nothing is
    written when anything fails."""
    model = onnx_model(
        frozen,
        example_inputs,
        opset=opset,
        activation_encoding=activation_encoding,
        dynamic_batch=dynamic_batch,
        input_names=input_names,
        output_names=output_names,
    )
    onnx.checker.check_model(model)
    return atomic_write(path, model.SerializeToString())
