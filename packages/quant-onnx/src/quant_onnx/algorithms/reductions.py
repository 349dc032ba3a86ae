"""Per-channel statistics of activations, reduced inside onnxruntime.

An algorithm that needs a few numbers per channel of many activations (SmoothQuant's
``max |x|``, analytic bias correction's mean input) asks for them here: the model gains,
for each requested tensor, the nodes that reduce it and an output of its shape, and one
pass over the samples moves those small results out of the session instead of every
activation (PP-OCRv4's recogniser, SmoothQuant: 6.7 -> 2.5 s).

Example:
    >>> Reduction("x", "ReduceSum", axes=(0,)).absolute
    False
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import attrs
import numpy as np
import onnx
from onnx import helper

from quant_core.onnx_qdq.graph import GraphIndex
from quant_core.onnx_qdq.model_io import opset_version
from quant_onnx.algorithms.capture import Feeds, TensorCapture
from quant_onnx.graph_edit import copy_model, set_initializer


@attrs.frozen
class Reduction:
    """One statistic of one tensor: ``op`` (``ReduceMax``, ``ReduceSum``...) over ``axes``
    of the tensor, reshaped first to ``shape`` when given (ONNX Reshape semantics: 0 keeps
    a dimension, -1 takes the rest), of its absolute value when ``absolute``."""

    tensor: str
    op: str
    axes: tuple[int, ...]
    shape: tuple[int, ...] | None = None
    absolute: bool = False


def reduction_model(model: onnx.ModelProto, reductions: Sequence[Reduction]) -> tuple[onnx.ModelProto, list[str]]:
    """A copy of ``model`` with two outputs per reduction, in order: the reduced value
    (``keepdims=0``) and the tensor's shape."""
    out = copy_model(model)
    index = GraphIndex(out.graph)
    opset = opset_version(out)
    outputs: list[str] = []
    for r in reductions:
        source = r.tensor
        nodes = []
        if r.absolute:
            name = index.unique_name(f"{r.tensor}_abs")
            nodes.append(helper.make_node("Abs", [source], [name], name=name))
            source = name
        if r.shape is not None:
            target = index.unique_name(f"{r.tensor}_rows_shape")
            set_initializer(out.graph, target, np.array(r.shape, np.int64))
            name = index.unique_name(f"{r.tensor}_rows")
            nodes.append(helper.make_node("Reshape", [source, target], [name], name=name))
            source = name
        reduced = index.unique_name(f"{r.tensor}_{r.op.lower()}")
        inputs = [source]
        # ReduceSum takes its axes as an input from opset 13, the other reductions from 18.
        if opset >= (13 if r.op == "ReduceSum" else 18):
            axes = index.unique_name(f"{r.tensor}_{r.op.lower()}_axes")
            set_initializer(out.graph, axes, np.array(r.axes, np.int64))
            inputs.append(axes)
        node = helper.make_node(r.op, inputs, [reduced], name=reduced, keepdims=0)
        if len(inputs) == 1:
            node.attribute.append(helper.make_attribute("axes", list(r.axes)))
        shape = index.unique_name(f"{r.tensor}_shape")
        nodes += [node, helper.make_node("Shape", [r.tensor], [shape], name=shape)]
        out.graph.node.extend(nodes)
        outputs += [reduced, shape]
    return out, outputs


# A max or min over the batch axis and others is taken in two steps: the other axes inside
# onnxruntime, the batch axis (a few rows) in numpy. onnxruntime reduces non-adjacent axes
# slowly: min and max of PP-OCRv4's 38 Conv outputs over 128 lines took 1.75 s in one step
# and 1.59 s in two in batches of 16 (a float pass: 1.33 s), 7.0 s and 3.1 s in one batch
# of 128. Exact either way.
_SPLIT_BATCH_AXIS = frozenset({"ReduceMax", "ReduceMin"})
_NUMPY = {"ReduceMax": np.max, "ReduceMin": np.min}


def reduce_over(
    model: onnx.ModelProto, reductions: Sequence[Reduction], feeds: Sequence[Feeds]
) -> Iterator[list[tuple[np.ndarray, np.ndarray]]]:
    """Per batch of ``feeds``: each reduction's ``(value, shape of the tensor)``, in order."""
    split = [r.op in _SPLIT_BATCH_AXIS and 0 in r.axes and len(r.axes) > 1 for r in reductions]
    in_graph = [
        attrs.evolve(r, axes=tuple(a for a in r.axes if a != 0)) if s else r
        for r, s in zip(reductions, split, strict=True)
    ]
    augmented, outputs = reduction_model(model, in_graph)
    for values in TensorCapture(augmented, outputs).iterate(feeds):
        yield [
            (_NUMPY[r.op](values[reduced], axis=0) if s else values[reduced], values[shape])
            for r, s, reduced, shape in zip(reductions, split, outputs[::2], outputs[1::2], strict=True)
        ]
