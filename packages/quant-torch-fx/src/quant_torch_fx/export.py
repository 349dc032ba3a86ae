"""``export_onnx``: a frozen model as a QDQ ONNX model that onnxruntime runs with its
integer kernels, computing what the frozen torch model computes.

Three steps, each its own module:

1. :mod:`quant_torch_fx.export_form`: a copy of the frozen model in which every quantizer
   calls one of the QDQ custom ops of :mod:`quant_torch_fx.qdq_ops`, and ``torch.export``
   of it (batch dimension dynamic): one ATen graph for the whole model, ``regions`` and
   the Python around them included;
2. :mod:`quant_torch_fx.onnx_emit`: that graph written as ONNX node for node, by the
   rules of :data:`quant_torch_fx.aten_map.ATEN_OPS` (the planner's table):

   - an activation quantizer becomes ``QuantizeLinear`` with the group's qparams (int8
     stored as uint8 with zero point + 128 for x86 by default,
     :func:`quant_core.qdq.encode_activation`) and a ``DequantizeLinear`` per reader;
   - a weight becomes an integer initializer (its codes, ``quant_core.qparams.quantize``)
     behind a ``DequantizeLinear`` (per-channel ``axis`` from the plan), read directly
     by its Conv, Gemm or MatMul (a linear over tokens is a MatMul reading the codes
     stored ``[in, out]``, then an Add of its bias);
   - a bias becomes the int32 initializer :func:`quant_core.bias.encode_bias` produced at
     freeze, behind a ``DequantizeLinear`` at ``input_scale * weight_scale``;

3. :func:`quant_core.onnx_qdq.finish.finish_for_onnxruntime`, the ONNX QDQ layer both
   backends finish through: what onnxruntime needs to run the file as written (Shape
   reads, the MatMulNBits and WeightBiasQuantization guards, unread initializers). The
   opset is chosen before writing: 17 by default, 21 for 16-bit and 4-bit formats.

The file is written atomically; the same model gives the same bytes.

Example:
    >>> import torch, onnx
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

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import onnx
import torch
from torch import nn

from quant_core.atomic_io import atomic_write
from quant_core.errors import ConfigError
from quant_core.onnx_qdq.finish import finish_for_onnxruntime
from quant_core.qdq import ActivationEncoding, check_activation_encoding, required_opset
from quant_torch_fx.capture import as_args
from quant_torch_fx.export_form import aten_graph, export_form
from quant_torch_fx.onnx_emit import default_names, emit_onnx

DEFAULT_OPSET = 17


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
    check_activation_encoding(activation_encoding)
    newest = onnx.defs.onnx_opset_version()
    if not 13 <= opset <= newest:
        raise ConfigError(f"opset: {opset} is not allowed; allowed: 13 to {newest}")
    form = export_form(frozen, activation_encoding)
    args = as_args(example_inputs)
    with torch.no_grad():
        gm = aten_graph(form.model, args, dynamic_batch=dynamic_batch)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    names_in = input_names if input_names is not None else default_names("input", len(tensors))
    target = max(opset, required_opset(form.formats))
    proto = emit_onnx(gm, opset=target, input_names=names_in, output_names=output_names)
    # Written at an opset that takes every format, so finishing has no notes to pass on
    # (its only note is for 16-bit pairs in the contrib domain, which the emitter never writes).
    return finish_for_onnxruntime(proto).model


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
