"""Evaluate constant subgraphs ahead of time, including shape arithmetic on statically known dims.

Exporters compute things like TF-"same" padding from `x.shape` at run time (Shape -> Gather -> Sub ->
... -> Pad).  onnxruntime has no integer kernel for that arithmetic and cannot fold the Pad into the
Conv while its sizes are computed, so every such chain whose value is known (all inputs constant, or
Shape/Size of dims that shape inference resolved, even with a dynamic batch dim) becomes an initializer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from quant_core.onnx_qdq.graph import GraphIndex, is_default_domain, node_attribute, subgraph_inputs
from quant_core.onnx_qdq.model_io import opset_version
from quant_onnx.graph_edit import copy_model, remove_nodes, set_initializer
from quant_onnx.pipeline.preprocess.shape_inference import infer_shapes_inplace

_LOG = logging.getLogger(__name__)

#: Never folded: quantization nodes carry meaning for later tools; random ops are not constant.
NEVER_FOLD = frozenset(
    {
        "QuantizeLinear",
        "DequantizeLinear",
        "DynamicQuantizeLinear",
        "RandomNormal",
        "RandomUniform",
        "RandomNormalLike",
        "RandomUniformLike",
        "Multinomial",
        "Bernoulli",
        "Constant",
    }
)
#: Folding is skipped when it would store a tensor this many bytes larger than its inputs (Expand,
#: ConstantOfShape, Tile of small constants would otherwise bloat the file).
MAX_GROWTH_BYTES = 1 << 20


def fold_constants(model: onnx.ModelProto, *, max_iterations: int = 8) -> onnx.ModelProto:
    """Return a copy of `model` with every foldable constant subgraph replaced by initializers."""
    out = copy_model(model)
    fold_constants_inplace(out, max_iterations=max_iterations)
    return out


def fold_constants_inplace(model: onnx.ModelProto, *, max_iterations: int = 8) -> int:
    """In-place version; returns the number of nodes folded.

    Repeats shape inference and folding until nothing changes, because a folded Pad size can make a
    later shape static.
    """
    total = 0
    opset = opset_version(model)
    for _ in range(max_iterations):
        infer_shapes_inplace(model)
        folded = _fold_once(model, opset)
        total += folded
        if not folded:
            break
    return total


def _may_train(node: onnx.NodeProto, value: Callable[[str], np.ndarray | None]) -> bool:
    """Whether a Dropout's ``training_mode`` input (opset 12) is given and not a constant
    false: its output is then random."""
    if len(node.input) < 3 or not node.input[2]:
        return False
    mode = value(node.input[2])
    return mode is None or bool(np.asarray(mode).reshape(-1)[0])


def _fold_once(model: onnx.ModelProto, opset: int) -> int:
    graph = model.graph
    index = GraphIndex(graph)
    values: dict[str, np.ndarray] = {}
    # Shape vectors with some unknown entries (dynamic batch): entries are int or None.
    partial_shapes: dict[str, list[int | None]] = {}
    folded: list[onnx.NodeProto] = []

    def value(name: str) -> np.ndarray | None:
        if name in values:
            return values[name]
        v = index.constant(name) if not index.is_graph_input(name) else None
        if v is not None:
            values[name] = v
        return v

    for node in index.topological_order():
        if not is_default_domain(node) or node.op_type in NEVER_FOLD or subgraph_inputs(node):
            continue
        if node.op_type == "Dropout" and _may_train(node, value):
            continue  # a random mask, not a constant
        if any(index.is_graph_output(o) for o in node.output if o):
            continue
        outputs: list[np.ndarray] | None = None
        if node.op_type in ("Shape", "Size"):
            outputs = _fold_shape(node, index, partial_shapes)
        elif all(value(n) is not None for n in node.input if n):
            outputs = _evaluate(node, [value(n) if n else None for n in node.input], opset)
            if outputs is not None and _grows_too_much(outputs, [values[n] for n in node.input if n]):
                outputs = None
        elif node.op_type in ("Gather", "Slice") and node.input[0] in partial_shapes:
            outputs = _fold_partial_shape_pick(node, partial_shapes, value, opset)
        if outputs is None or len(outputs) != len([o for o in node.output]):
            continue
        for name, out in zip(node.output, outputs, strict=True):
            if name:
                values[name] = np.asarray(out)
        folded.append(node)

    existing = {t.name for t in graph.initializer}
    for node in folded:
        for name in node.output:
            if name and index.used(name):
                tensor = numpy_helper.from_array(np.array(values[name], order="C"), name)
                set_initializer(graph, name, tensor, fresh=name not in existing)
    remove_nodes(graph, folded)
    return len(folded)


def _fold_shape(
    node: onnx.NodeProto, index: GraphIndex, partial_shapes: dict[str, list[int | None]]
) -> list[np.ndarray] | None:
    dims = index.shape(node.input[0])
    if dims is None:
        return None
    ints: list[int | None] = [d if isinstance(d, int) else None for d in dims]
    if node.op_type == "Size":
        known = [d for d in ints if d is not None]
        return [np.array(int(np.prod(known)), dtype=np.int64)] if len(known) == len(ints) else None
    start = int(node_attribute(node, "start", 0))
    end_attr = node_attribute(node, "end", None)
    # ONNX Shape's start/end follow Python slicing (negative from the back, clamped).
    picked = ints[start:] if end_attr is None else ints[start : int(end_attr)]  # type: ignore[call-overload]
    if None in picked:
        partial_shapes[node.output[0]] = picked
        return None
    return [np.array(picked, dtype=np.int64)]


def _fold_partial_shape_pick(node, partial_shapes, value, opset) -> list[np.ndarray] | None:  # type: ignore[no-untyped-def]
    """Gather/Slice on a partly known shape: evaluate on positions, fold if all picked dims are known."""
    dims = partial_shapes[node.input[0]]
    rest = [value(n) if n else None for n in node.input[1:]]
    if any(r is None and n for r, n in zip(rest, node.input[1:], strict=True)):
        return None
    positions = _evaluate(node, [np.arange(len(dims), dtype=np.int64), *rest], opset)
    if positions is None:
        return None
    picked = np.asarray(positions[0])
    table = np.array([-1 if d is None else d for d in dims], dtype=np.int64)
    result = table[picked]
    if (result < 0).any():
        return None
    return [result.astype(np.int64)]


def _grows_too_much(outputs: list[np.ndarray], inputs: list[np.ndarray]) -> bool:
    out_bytes = sum(np.asarray(o).nbytes for o in outputs)
    in_bytes = sum(np.asarray(i).nbytes for i in inputs)
    return out_bytes > in_bytes + MAX_GROWTH_BYTES


def _evaluate(node: onnx.NodeProto, inputs: list[np.ndarray | None], opset: int) -> list[np.ndarray] | None:
    """Run one node on constant inputs: onnx reference first, onnxruntime for ops it lacks."""
    try:
        return _evaluate_reference(node, inputs, opset)
    except Exception as exc:  # the reference evaluator raises many types for unsupported ops
        _LOG.debug("reference evaluator cannot fold %s (%s): %s", node.name, node.op_type, exc)
    try:
        return _evaluate_onnxruntime(node, inputs, opset)
    except Exception as exc:
        _LOG.debug("onnxruntime cannot fold %s (%s): %s", node.name, node.op_type, exc)
    return None


def _single_node_model(node: onnx.NodeProto, inputs: list[np.ndarray | None], opset: int):  # type: ignore[no-untyped-def]
    names = [f"in{i}" if n else "" for i, n in enumerate(node.input)]
    outs = [f"out{i}" if n else "" for i, n in enumerate(node.output)]
    copy = helper.make_node(node.op_type, names, outs, domain=node.domain)
    copy.attribute.extend(node.attribute)
    feeds = {n: np.asarray(v) for n, v in zip(names, inputs, strict=True) if n and v is not None}
    graph_inputs = [
        helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape))
        for n, v in feeds.items()
    ]
    graph_outputs = [helper.make_empty_tensor_value_info(o) for o in outs if o]
    graph = helper.make_graph([copy], "fold", graph_inputs, graph_outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return model, feeds, [o for o in outs if o]


def _evaluate_reference(node: onnx.NodeProto, inputs: list[np.ndarray | None], opset: int) -> list[np.ndarray]:
    from onnx.reference import ReferenceEvaluator

    model, feeds, outs = _single_node_model(node, inputs, opset)
    results = ReferenceEvaluator(model).run(None, feeds)
    return _restore_skipped(node, [np.asarray(r) for r in results], outs)


def _evaluate_onnxruntime(node: onnx.NodeProto, inputs: list[np.ndarray | None], opset: int) -> list[np.ndarray]:
    import onnxruntime as ort

    model, feeds, outs = _single_node_model(node, inputs, opset)
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    model.ir_version = min(model.ir_version, 10)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    results = session.run(None, feeds)
    return _restore_skipped(node, [np.asarray(r) for r in results], outs)


def _restore_skipped(node: onnx.NodeProto, results: list[np.ndarray], outs: list[str]) -> list[np.ndarray]:
    # Omitted optional outputs ("") were not computed; give them placeholders so positions line up.
    by_name = dict(zip(outs, results, strict=True))
    return [by_name.get(f"out{i}", np.zeros(0)) for i in range(len(node.output))]
