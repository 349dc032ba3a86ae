"""Shape inference that never fails: unknown ops keep unknown shapes, errors leave the model as it is."""

from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import helper

from quant_core.onnx_qdq.graph import GraphIndex
from quant_onnx.graph_edit import copy_model, drop_value_info

_LOG = logging.getLogger(__name__)
#: Initializers with more elements than this are handed to shape inference as typed graph inputs
#: instead of data: weights never drive shapes, and serialising them on every pass dominated run time.
_SKELETON_MIN_ELEMENTS = 4096


def infer_shapes(model: onnx.ModelProto, *, refresh: bool = False) -> onnx.ModelProto:
    """Return a copy of `model` with value_info filled by onnx.shape_inference (strict_mode=False).

    `refresh=True` first forgets value_info of tensors no node produces any more (after passes that
    renamed or removed tensors, so no stale entry survives).
    """
    out = copy_model(model)
    infer_shapes_inplace(out, refresh=refresh)
    return out


def infer_shapes_inplace(model: onnx.ModelProto, *, refresh: bool = False) -> bool:
    """In-place version; returns False when inference could not run."""
    if refresh:
        live = {n for node in model.graph.node for n in node.output}
        drop_value_info(model.graph, [vi.name for vi in model.graph.value_info if vi.name not in live])
    inferred = _infer(model)
    if inferred is None:
        return False
    del model.graph.value_info[:]
    model.graph.value_info.extend(inferred.graph.value_info)
    # Graph outputs may gain shapes/dtypes (exporters sometimes leave them untyped).
    inferred_outputs = {o.name: o for o in inferred.graph.output}
    for output in model.graph.output:
        if output.name in inferred_outputs:
            output.CopyFrom(inferred_outputs[output.name])
    return True


def inferred_value_info(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """value_info (intermediates and graph outputs) that shape inference finds; `model` is not modified."""
    inferred = _infer(model)
    if inferred is None:
        return list(model.graph.value_info)
    return [*inferred.graph.value_info, *inferred.graph.output]


def typed_index(model: onnx.ModelProto) -> GraphIndex:
    """A :class:`GraphIndex` over ``model.graph`` (the caller's own node objects) whose
    tensors carry element types and shapes: the model's own when every node output has a
    type (pre-processing ran shape inference), else completed by inference on a
    weightless copy. ``model`` is not modified."""
    index = GraphIndex(model.graph)
    if all(index.elem_type(out) for node in model.graph.node for out in node.output if out):
        return index
    return GraphIndex(model.graph, inferred_value_info(model))


def _infer(model: onnx.ModelProto) -> onnx.ModelProto | None:
    try:
        return onnx.shape_inference.infer_shapes(
            _weightless_copy(model), check_type=False, strict_mode=False, data_prop=True
        )
    except Exception as exc:  # onnx raises several unrelated types for malformed/unknown ops
        text = str(exc).strip()
        _LOG.warning("shape inference failed, keeping known shapes: %s", text.splitlines()[0] if text else repr(exc))
        return None


def _weightless_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with large initializers turned into typed graph inputs (same types, no payload)."""
    skeleton = onnx.ModelProto()
    skeleton.ir_version = model.ir_version
    skeleton.opset_import.extend(model.opset_import)
    skeleton.functions.extend(model.functions)
    graph = skeleton.graph
    source = model.graph
    graph.name = source.name
    graph.node.extend(source.node)
    graph.output.extend(source.output)
    graph.value_info.extend(source.value_info)
    graph.sparse_initializer.extend(source.sparse_initializer)
    listed = {v.name for v in source.input}
    graph.input.extend(source.input)
    for tensor in source.initializer:
        if int(np.prod(tensor.dims, dtype=np.int64)) > _SKELETON_MIN_ELEMENTS:
            if tensor.name not in listed:
                graph.input.append(helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
        else:
            graph.initializer.append(tensor)
    return skeleton
