"""What a QDQ ONNX file quantizes, and what onnxruntime makes of it (onnx and onnxruntime only).

* :func:`dq_fed_inputs`: of the Conv/Gemm/MatMul inputs (Conv/Gemm: weight and activation;
  MatMul: both inputs, each a weight when it is a constant), how many a DequantizeLinear feeds;
* :func:`kernel_coverage`: after onnxruntime's ``ORT_ENABLE_ALL`` optimisation, how many of those
  nodes stayed float and how many became integer kernels, by op type;
* :func:`kernel_fidelity`: every QuantizeLinear output of the file in onnxruntime's default
  session against the same file run node by node (``ORT_DISABLE_ALL``): the fraction of quantized
  tensors within one code, and the worst one by name.

Example:
    >>> import numpy as np, onnx
    >>> from onnx import helper, numpy_helper
    >>> w = numpy_helper.from_array(np.ones((2, 2), np.int8), "w_q")
    >>> s = numpy_helper.from_array(np.array(0.5, np.float32), "s")
    >>> graph = helper.make_graph(
    ...     [helper.make_node("DequantizeLinear", ["w_q", "s"], ["w"]), helper.make_node("MatMul", ["x", "w"], ["y"])],
    ...     "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 2])],
    ...     [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 2])], [w, s])
    >>> dq_fed_inputs(helper.make_model(graph))
    {'weights': 1, 'weights_dq': 1, 'activations': 1, 'activations_dq': 0, 'nodes': 1}
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import numpy as np

from tools.bench import common

COMPUTE = ("Conv", "ConvTranspose", "Gemm", "MatMul")
# Integer kernels onnxruntime fuses QDQ groups into (contrib and standard ops).
INTEGER_KERNELS = frozenset(
    {
        "QLinearConv",
        "NhwcQLinearConv",
        "QGemm",
        "QLinearMatMul",
        "MatMulInteger",
        "MatMulIntegerToFloat",
        "ConvInteger",
        "DynamicQuantizeMatMul",
        "QAttention",
        "QLinearConvTranspose",
    }
)
# common's float compute ops (NCHWc convolutions included), and ConvTranspose.
FLOAT_KERNELS = common.FLOAT_COMPUTE_OPS | {("", "ConvTranspose")}


def _is_constant(name: str, initializers: set[str], producers: dict[str, Any]) -> bool:
    """A tensor computed from initializers alone (through DequantizeLinear, Transpose, Reshape...)."""
    seen: set[str] = set()
    stack = [name]
    while stack:
        tensor = stack.pop()
        if tensor in seen or tensor == "" or tensor in initializers:
            continue
        seen.add(tensor)
        node = producers.get(tensor)
        if node is None:
            return False  # a graph input
        if node.op_type != "Constant":
            stack.extend(node.input)
    return True


def dq_fed_inputs(model: Any) -> dict[str, int]:
    """Counts of Conv/ConvTranspose/Gemm/MatMul weight and activation inputs, and of those a DequantizeLinear feeds.

    Conv and Gemm: input 1 is the weight, input 0 the activation. MatMul: both inputs count, each
    as a weight when it is computed from initializers alone, else as an activation.
    """
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    producers = {out: node for node in graph.node for out in node.output}
    counts = Counter({"weights": 0, "weights_dq": 0, "activations": 0, "activations_dq": 0, "nodes": 0})
    for node in graph.node:
        if node.op_type not in COMPUTE or node.domain not in ("", "ai.onnx"):
            continue
        counts["nodes"] += 1
        for slot, tensor in enumerate(node.input[:2]):
            if node.op_type == "MatMul":
                kind = "weights" if _is_constant(tensor, initializers, producers) else "activations"
            else:
                kind = "weights" if slot == 1 else "activations"
            counts[kind] += 1
            producer = producers.get(tensor)
            counts[f"{kind}_dq"] += producer is not None and producer.op_type == "DequantizeLinear"
    return dict(counts)


def kernel_coverage(path: str | os.PathLike[str]) -> dict[str, Any]:
    """onnxruntime's ``ORT_ENABLE_ALL`` graph of ``path``: compute nodes left float, integer kernels by type."""
    optimised = common.optimized_graph_ops(path)
    float_ops: Counter[str] = Counter()
    integer_ops: Counter[str] = Counter()
    for node in optimised.graph.node:
        if node.op_type in INTEGER_KERNELS:
            integer_ops[node.op_type] += 1
        elif (node.domain, node.op_type) in FLOAT_KERNELS:
            float_ops[node.op_type] += 1
    return {
        "float": sum(float_ops.values()),
        "integer": sum(integer_ops.values()),
        "float_ops": dict(float_ops),
        "integer_ops": dict(integer_ops),
    }


def quantize_outputs(model: Any) -> list[tuple[str, str]]:
    """``(node name, output)`` of every QuantizeLinear, in graph order."""
    return [
        (node.name or node.output[0], node.output[0]) for node in model.graph.node if node.op_type == "QuantizeLinear"
    ]


def with_outputs(model: Any, names: list[str]) -> bytes:
    """``model`` serialised with ``names`` added as graph outputs (types left to onnxruntime)."""
    import onnx

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    present = {o.name for o in copy.graph.output}
    for name in names:
        if name not in present:
            copy.graph.output.append(onnx.ValueInfoProto(name=name))
    return copy.SerializeToString()


def run_outputs(serialised: bytes, x: np.ndarray, level: str, names: list[str]) -> dict[str, np.ndarray]:
    session = common.make_session(serialised, level=level)
    feed = {session.get_inputs()[0].name: x}
    return dict(zip(names, session.run(names, feed), strict=True))


def step_differences(pairs: list[tuple[str, np.ndarray, np.ndarray, float]]) -> dict[str, Any]:
    """Summary of ``(name, a, b, step)`` tensor pairs compared in units of ``step``: the fraction of
    tensors within one step everywhere, the fraction of all elements more than one step apart,
    the first tensor (in the given order) beyond one step, and the worst.

    Example:
        >>> a = np.zeros(4)
        >>> step_differences([("x", a, a, 1.0), ("y", a, np.array([0, 0, 0, 3.0]), 1.0)])
        {'tensors': 2, 'within_one': 0.5, 'elements_beyond_one': 0.125, 'first_beyond_one': 'y', 'worst': 'y', 'worst_steps': 3.0}
    """
    within, beyond, elements = 0, 0, 0
    first, worst, worst_steps = None, None, -1.0
    for name, a, b, step in pairs:
        steps = np.abs(a.astype(np.float64) - b.astype(np.float64)) / step
        largest = float(steps.max(initial=0.0))
        far = int(np.count_nonzero(steps > 1.0 + 1e-3))
        within += far == 0
        beyond, elements = beyond + far, elements + steps.size
        if far and first is None:
            first = name
        if largest > worst_steps:
            worst, worst_steps = name, largest
    return {
        "tensors": len(pairs),
        "within_one": within / len(pairs) if pairs else None,
        "elements_beyond_one": beyond / elements if elements else None,
        "first_beyond_one": first,
        "worst": worst,
        "worst_steps": worst_steps if pairs else None,
    }


def kernel_fidelity(path: str | os.PathLike[str], x: np.ndarray) -> dict[str, Any]:
    """Every QuantizeLinear output of ``path`` on input ``x``: onnxruntime's default session
    (``ORT_ENABLE_ALL``, integer kernels) against node by node (``ORT_DISABLE_ALL``), in codes."""
    import onnx

    model = onnx.load(str(path))
    outputs = quantize_outputs(model)
    names = [out for _node, out in outputs]
    serialised = with_outputs(model, names)
    fused = run_outputs(serialised, x, "all", names) if names else {}
    plain = run_outputs(serialised, x, "disable", names) if names else {}
    return step_differences([(node, fused[out], plain[out], 1.0) for node, out in outputs])
