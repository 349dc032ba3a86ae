"""A frozen model's export form and its one ATen graph: what :mod:`quant_torch_fx.onnx_emit`
translates to ONNX.

The export form is a copy of the frozen model in which every quantizer calls one of the
custom ops of :mod:`quant_torch_fx.qdq_ops`, so that each QDQ construct is one graph node:

- an activation quantizer call becomes ``quantize_dequantize(x, scale, zero_point, ...)``
  with the group's qparams in the stored encoding (:func:`quant_core.qdq.encode_activation`);
- a weight quantizer call becomes ``dequantize(codes, scale, zero_point, axis)``; the codes
  (``quant_core.qparams.quantize`` of the frozen weight) replace the float weight at its own
  path in the model, so the ONNX initializer keeps the weight's ``state_dict`` name;
- a bias the freeze encoded becomes ``dequantize`` of its integer codes, again at the
  bias's own path, with ``<path>_scale`` and ``<path>_zero_point`` beside it.

Each op computes exactly what the frozen model computes there, so the export form's outputs
equal the frozen model's bit for bit. :func:`aten_graph` then runs ``torch.export`` on the
whole export form (a captured graph, or a user module whose ``regions`` are captured graphs
with plain Python around them), batch dimension dynamic (:mod:`quant_torch_fx.capture`).
Python around the regions that branches on tensor values cannot be exported soundly; it is
traced with ``torch.export.draft_export``, which keeps the branch the example inputs took,
and a warning names each such place.

Example:
    >>> import torch
    >>> from quant_torch_fx import ModelQuantizer
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.ReLU())
    >>> q = ModelQuantizer("a8w8", quiet=True)
    >>> frozen = q.freeze(q.quantize_model(net, torch.randn(1, 3, 4, 4), [torch.randn(8, 3, 4, 4)]))
    >>> form = export_form(frozen, "x86_uint8")
    >>> x = torch.randn(2, 3, 4, 4)
    >>> bool(torch.equal(form.model(x), frozen(x))), sorted(d.value for d in form.formats)
    (True, ['int32', 'int8', 'uint8'])
    >>> gm = aten_graph(form.model, (x,), dynamic_batch=True)
    >>> [n.target.__name__ for n in gm.graph.nodes if n.op == "call_function"]
    ['quantize_dequantize.default', 'dequantize.default', 'dequantize.default', 'conv2d.default', 'quantize_dequantize.default']
"""

from __future__ import annotations

import gc
import os
import re
import warnings
from collections.abc import Iterable
from typing import Any

import attrs
import numpy as np
import torch
from torch import nn
from torch.fx import GraphModule, Node

from quant_core.dtypes import DType
from quant_core.errors import ModelError
from quant_core.qdq import ActivationEncoding, encode_activation
from quant_core.qparams import QParams, quantize
from quant_torch_fx.attention import decompose_attention
from quant_torch_fx.capture import (
    batched,
    copy_captured,
    describe_failure,
    export_dynamic_batch,
    export_program,
    quiet_torch,
)
from quant_torch_fx.graph_passes import get_attr_value
from quant_torch_fx.prepare import graph_info, quantized_graphs
from quant_torch_fx.qdq_ops import DEQUANTIZE, QUANTIZE_DEQUANTIZE

_TORCH_CODES = {
    DType.INT4: torch.int8,
    DType.UINT4: torch.uint8,
    DType.INT8: torch.int8,
    DType.UINT8: torch.uint8,
    DType.INT16: torch.int16,
    DType.UINT16: torch.int32,  # no uint16 arithmetic in torch; the ONNX file stores uint16
    DType.INT32: torch.int32,
}
"""The torch type holding each format's codes (and zero points) in the export form."""


@attrs.frozen(eq=False)
class ExportForm:
    """The export form of a frozen model and the integer formats it stores."""

    model: nn.Module
    formats: frozenset[DType]


def _codes_type(dtype: DType) -> torch.dtype:
    if dtype not in _TORCH_CODES:
        allowed = ", ".join(d.value for d in _TORCH_CODES)
        raise ModelError(f"export: {dtype.value} codes cannot be written by this exporter; allowed: {allowed}")
    return _TORCH_CODES[dtype]


def _qparam_holder(qp: QParams) -> nn.Module:
    """A module holding ``qp``'s scale (float32) and zero point (the codes' torch type)."""
    holder = nn.Module()
    holder.register_buffer("scale", torch.as_tensor(np.asarray(qp.scale, np.float32)).clone())
    zero_point = torch.as_tensor(np.asarray(qp.zero_point).astype(np.int64)).to(_codes_type(qp.dtype))
    holder.register_buffer("zero_point", zero_point)
    return holder


def _owner(gm: GraphModule, target: str) -> tuple[nn.Module, str]:
    owner, _, leaf = target.rpartition(".")
    return (gm.get_submodule(owner) if owner else gm), leaf


def _set_tensor(gm: GraphModule, target: str, value: torch.Tensor) -> None:
    """Put ``value`` at ``target`` as a buffer (replacing a parameter or buffer there)."""
    parent, leaf = _owner(gm, target)
    if hasattr(parent, leaf):
        delattr(parent, leaf)
    parent.register_buffer(leaf, value)


def _free_target(gm: GraphModule, base: str) -> str:
    parent, leaf = _owner(gm, base)
    name, index = leaf, 1
    while hasattr(parent, name):
        name, index = f"{leaf}_{index}", index + 1
    owner = base.rpartition(".")[0]
    return f"{owner}.{name}" if owner else name


def _readers(gm: GraphModule, target: str) -> list[Node]:
    return [u for n in gm.graph.nodes if n.op == "get_attr" and n.target == target for u in n.users]


def _store_codes(gm: GraphModule, source: Node, codes: torch.Tensor, only_reader: Node) -> str:
    """Where the codes of the constant ``source`` reads go: its own path when nothing but
    ``only_reader`` reads it, else a free path beside it."""
    target = str(source.target)
    if _readers(gm, target) != [only_reader]:
        target = _free_target(gm, f"{target}_codes")
    _set_tensor(gm, target, codes)
    return target


def _dequantize_call(gm: GraphModule, before: Node, codes: str, params: str, qp: QParams) -> Node:
    """``dequantize(codes, params.scale, params.zero_point)`` inserted before ``before``."""
    with gm.graph.inserting_before(before):
        args = [gm.graph.get_attr(codes), gm.graph.get_attr(f"{params}scale"), gm.graph.get_attr(f"{params}zero_point")]
        axis = None if qp.axis is None else int(qp.axis)
        return gm.graph.call_function(DEQUANTIZE, (*args, axis, qp.dtype.value))


def _calls(gm: GraphModule, path: str) -> list[Node]:
    return [n for n in gm.graph.nodes if n.op == "call_module" and n.target == path]


def _swap_activations(gm: GraphModule, encoding: ActivationEncoding, formats: set[DType]) -> None:
    info = graph_info(gm)
    for path in dict.fromkeys(info.activation.values()):
        fq = gm.get_submodule(path)
        qp = encode_activation(fq.current_qparams(), encoding)  # type: ignore[operator]
        if qp.axis is not None:
            raise ModelError("export: activations are quantized per tensor")
        formats.add(qp.dtype)
        gm.set_submodule(path, _qparam_holder(qp).to(fq.get_buffer("scale").device))
        for call in _calls(gm, path):
            with gm.graph.inserting_before(call):
                scale, zero_point = gm.graph.get_attr(f"{path}.scale"), gm.graph.get_attr(f"{path}.zero_point")
                extra = (qp.qmin, qp.qmax, qp.rounding.value, qp.dtype.value)
                new = gm.graph.call_function(QUANTIZE_DEQUANTIZE, (call.args[0], scale, zero_point, *extra))
            new.meta = dict(call.meta)
            call.replace_all_uses_with(new)
            gm.graph.erase_node(call)


def _swap_weights(gm: GraphModule, formats: set[DType]) -> None:
    info = graph_info(gm)
    for path in info.weights.values():
        fq = gm.get_submodule(path)
        qp = fq.current_qparams()  # type: ignore[operator]
        formats.add(qp.dtype)
        device = fq.get_buffer("scale").device
        gm.set_submodule(path, _qparam_holder(qp).to(device))
        for call in _calls(gm, path):
            source = call.args[0]
            if not (isinstance(source, Node) and source.op == "get_attr"):
                raise ModelError(
                    f"export: the weight of {path!r} is computed in the graph ({getattr(source, 'name', source)!r}), "
                    "not held by the model; only constant weights are written as integer codes"
                )
            value = get_attr_value(gm, source).detach().float().cpu().numpy()
            codes = torch.from_numpy(quantize(value, qp).astype(np.int64)).to(_codes_type(qp.dtype)).to(device)
            target = _store_codes(gm, source, codes, call)
            new = _dequantize_call(gm, call, target, f"{path}.", qp)
            new.meta = dict(call.meta)
            call.replace_all_uses_with(new)
            gm.graph.erase_node(call)
            if not source.users:
                gm.graph.erase_node(source)


def _swap_biases(gm: GraphModule, formats: set[DType]) -> None:
    info = graph_info(gm)
    by_name = {n.name: n for n in gm.graph.nodes}
    for node, encoded in info.biases.items():
        if encoded.codes is None or encoded.qparams is None:
            continue
        consumer = by_name[info.weighted[node]]
        slot = next(s for s in info.plan.biases if s.node == node)
        source = consumer.args[slot.input_index]
        assert isinstance(source, Node) and source.op == "get_attr"
        qp: QParams = encoded.qparams
        formats.add(qp.dtype)
        device = get_attr_value(gm, source).device
        codes = torch.from_numpy(np.asarray(encoded.codes).reshape(-1).astype(np.int64)).to(_codes_type(qp.dtype))
        target = _store_codes(gm, source, codes.to(device), consumer)
        parent, leaf = _owner(gm, target)
        holder = _qparam_holder(qp).to(device)
        for name in ("scale", "zero_point"):
            parent.register_buffer(f"{leaf}_{name}", getattr(holder, name))
        new = _dequantize_call(gm, consumer, target, f"{target}_", qp)
        consumer.replace_input_with(source, new)
        if not source.users:
            gm.graph.erase_node(source)


def export_form(frozen: nn.Module, encoding: ActivationEncoding) -> ExportForm:
    """The export form of ``frozen`` (a copy; ``frozen`` is not changed)."""
    model = copy_captured(frozen)
    graphs = quantized_graphs(model)
    if not graphs:
        raise ModelError(
            "export: the model holds no quantized graph; quantize it first "
            "(ModelQuantizer.quantize_model or prepare_qat, then freeze)"
        )
    formats: set[DType] = set()
    for gm in graphs:
        if not graph_info(gm).frozen:
            raise ModelError("export: the model is not frozen; call ModelQuantizer.freeze first")
        _swap_activations(gm, encoding, formats)
        _swap_weights(gm, formats)
        _swap_biases(gm, formats)
        gm.graph.lint()
        gm.recompile()
    model.eval()
    return ExportForm(model, frozenset(formats))


def aten_graph(model: nn.Module, args: tuple[Any, ...], *, dynamic_batch: bool) -> GraphModule:
    """``model``'s ATen graph from ``torch.export`` (batch dimension dynamic with
    ``dynamic_batch``), parameters and buffers as ``get_attr`` nodes at their
    ``state_dict`` paths, attention written out (:mod:`quant_torch_fx.attention`).
    Value-dependent Python is traced as the example inputs run it, with a warning per
    place (see the module docstring)."""
    capture_args, shapes = batched(args) if dynamic_batch else (args, None)
    try:
        program = export_dynamic_batch(model, args) if dynamic_batch else export_program(model, args, None)
    except Exception as exc:  # torch raises many unrelated types here
        if shapes is not None and _batch_specialised(exc):
            warnings.warn(
                "export: the model fixes its batch size (torch.export: "
                f"{describe_failure(exc)[0]}); the ONNX model takes batches of {_batch_of(args)} only",
                UserWarning,
                stacklevel=3,
            )
            return aten_graph(model, args, dynamic_batch=False)
        if not _data_dependent(exc):
            # torch's message runs to many lines (a graph dump, a stack): one line, naming
            # the example inputs the model was traced on, which are the usual cause.
            construct, location = describe_failure(exc)
            given = ", ".join(str(list(a.shape)) for a in args if isinstance(a, torch.Tensor))
            where = f" at {location}" if location else ""
            raise ModelError(f"export: the model does not run on example_inputs ({given}): {construct}{where}") from exc
        program = _draft_export(model, capture_args, shapes, exc)
    gm = program.module(check_guards=False)
    assert isinstance(gm, GraphModule)
    decompose_attention(gm)  # float parts of the model too: written as the prepared graph writes it
    return gm


def _batch_specialised(exc: BaseException) -> bool:
    text = str(exc)
    return "Constraints violated" in text or "specialized" in text or "specialised" in text


def _batch_of(args: tuple[Any, ...]) -> int:
    return next((int(a.shape[0]) for a in args if isinstance(a, torch.Tensor) and a.dim()), 1)


def _data_dependent(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}"
    return "data-dependent" in text or "DataDependent" in text or "GuardOnDataDependentSymNode" in text


def _draft_export(model: nn.Module, args: tuple[Any, ...], shapes: Any, cause: BaseException) -> Any:
    draft = getattr(torch.export, "draft_export", None)
    if draft is None:  # torch < 2.7
        raise cause
    with warnings.catch_warnings(), quiet_torch():
        warnings.simplefilter("ignore")
        program = draft(model, args, dynamic_shapes=shapes, strict=False)
        gc.collect()  # draft_export leaves a log file to the collector, which would warn about it later
    report = getattr(program, "_report", None)
    for where in _failure_places(report):
        warnings.warn(
            f"export: torch.export, which records the code outside the quantized graphs, cannot follow "
            f"the value-dependent Python at {where}; the ONNX model keeps only what the example inputs "
            "did there. Make that code independent of tensor values or put it inside a quantized region",
            UserWarning,
            stacklevel=3,
        )
    return program


def _failure_places(report: Any) -> Iterable[str]:
    """``file:line: code`` of the user code behind each draft-export failure, once each."""
    if report is None:
        return []
    filenames = dict(getattr(report, "str_to_filename", {}))
    try:  # the report's table can miss files interned before it was made
        from torch._logging.structured import INTERN_TABLE

        filenames.update({index: name for name, index in INTERN_TABLE.items() if index not in filenames})
    except ImportError:
        pass
    torch_dir = os.path.dirname(torch.__file__)
    places: dict[str, None] = {}
    for failure in getattr(report, "failures", []):
        data = failure.data if isinstance(failure.data, dict) else {}
        frames = [
            (str(filenames.get(f.get("filename"), f.get("filename"))), f.get("line"), f.get("loc", ""))
            for f in data.get("user_stack", [])
        ]
        user = [f for f in frames if not f[0].startswith(torch_dir)]
        if user:
            filename, line, code = user[-1]
            code = re.sub(r"\s+", " ", str(code)).strip()
            places[f"{filename}:{line}: {code}"] = None
    return list(places)
