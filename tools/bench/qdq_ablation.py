"""Which quantized activations cost a QDQ file its output SQNR: remove the
QuantizeLinear/DequantizeLinear pairs of one class of tensors at a time (or keep only that
class quantized), run the file in onnxruntime (default session) and score its output against
the float file's.

The files are the zoo's (``python -m tools.bench.zoo --models NAME ...`` writes
``.cache/bench/zoo/files/NAME_float.onnx`` and ``NAME_quant_onnx.onnx``), the data the zoo's
evaluation noise. A class is a predicate on an activation tensor's neighbourhood in the file
(its producer, its readers, whether an integer-kernel layer lies downstream); weights and
constants stay quantized in every row.

Example:
    $ python -m tools.bench.zoo --models yolov8n_style --quick --no-pt2e --no-measures
    $ python -m tools.bench.qdq_ablation --models yolov8n_style
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import attrs
import numpy as np

if __package__ in (None, ""):  # run as a file: make `tools.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench import common

FILES = common.CACHE_DIR / "bench" / "zoo" / "files"
LAYERS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})


@attrs.frozen
class Activation:
    """One quantized activation tensor of a QDQ file and its float neighbourhood."""

    tensor: str
    producer: str  # op type of the node writing it ("" for a graph input)
    readers: tuple[str, ...]  # op types reading its dequantized copies
    layer_downstream: bool  # a Conv/Gemm/MatMul reads it or something computed from it
    graph_output: bool  # a dequantized copy is a graph output


def activations(model) -> list[Activation]:  # model: onnx.ModelProto
    """Every activation QuantizeLinear of ``model`` (not a constant's), with its neighbourhood."""
    graph = model.graph
    constants = {t.name for t in graph.initializer} | {
        o for n in graph.node if n.op_type == "Constant" for o in n.output
    }
    producer = {out: node for node in graph.node for out in node.output}
    readers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}

    def real_readers(tensor: str) -> list:
        """Readers of ``tensor`` looking through its Q -> DQ copies."""
        found = []
        for node in readers.get(tensor, []):
            if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
                found += real_readers(node.output[0])
            else:
                found.append(node)
        return found

    memo: dict[str, bool] = {}

    def layer_downstream(tensor: str, depth: int = 0) -> bool:
        if tensor not in memo:
            memo[tensor] = False
            nodes = real_readers(tensor)
            memo[tensor] = any(n.op_type in LAYERS for n in nodes) or (
                depth < 200 and any(layer_downstream(o, depth + 1) for n in nodes for o in n.output if o)
            )
        return memo[tensor]

    found = []
    for node in graph.node:
        if node.op_type != "QuantizeLinear" or node.input[0] in constants:
            continue
        tensor = node.input[0]
        writer = producer.get(tensor)
        copies = [d.output[0] for d in readers.get(node.output[0], []) if d.op_type == "DequantizeLinear"]
        found.append(
            Activation(
                tensor,
                writer.op_type if writer is not None else "",
                tuple(sorted({n.op_type for n in real_readers(tensor)})),
                layer_downstream(tensor),
                any(c in outputs for c in copies),
            )
        )
    return found


def without_qdq(model, tensors: set[str]):  # -> onnx.ModelProto
    """A copy of ``model`` with the activation Q/DQ pairs of ``tensors`` removed (readers read
    the float tensor); ``model`` is not modified."""
    import onnx

    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    rename: dict[str, str] = {}
    drop: set[int] = set()  # node indices (protobuf wrappers have no stable identity)
    nodes = list(graph.node)
    for i, node in enumerate(nodes):
        if node.op_type == "QuantizeLinear" and node.input[0] in tensors:
            drop.add(i)
            rename[node.output[0]] = node.input[0]  # a Shape may read the codes
            for j, dq in enumerate(nodes):
                if dq.op_type == "DequantizeLinear" and dq.input[0] == node.output[0]:
                    drop.add(j)
                    rename[dq.output[0]] = node.input[0]
    kept = [n for i, n in enumerate(nodes) if i not in drop]
    outputs = {o.name for o in graph.output}
    for node in kept:
        for i, name in enumerate(node.input):
            node.input[i] = rename.get(name, name)
    bridges = [onnx.helper.make_node("Identity", [rename[o]], [o]) for o in outputs if o in rename]
    del graph.node[:]
    graph.node.extend(kept + bridges)
    return out


def float_values(float_model, names: list[str], x: np.ndarray) -> dict[str, np.ndarray]:
    """The float file's values of ``names`` (initializers, or tensors it computes from
    constants, which the quantized file folded), computed on ``x``."""
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    values = {t.name: numpy_helper.to_array(t) for t in float_model.graph.initializer}
    computed = [n for n in names if n not in values]
    if computed:
        probe = onnx.ModelProto()
        probe.CopyFrom(float_model)
        probe.graph.output.extend(onnx.ValueInfoProto(name=n) for n in computed)
        session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
        got = session.run(computed, {session.get_inputs()[0].name: x})
        values.update(zip(computed, got, strict=True))
    return values


def constants_float(model, float_model, readers: tuple[str, ...] | None, x: np.ndarray):  # -> onnx.ModelProto
    """A copy of ``model`` whose constants (weights, biases, constant operands) that ``readers``
    op types read (``None``: every reader) are the float file's values again."""
    import onnx
    from onnx import numpy_helper

    inits = {t.name for t in model.graph.initializer}
    wanted = [
        n.input[0].removesuffix("_quantized")
        for n in model.graph.node
        if n.op_type == "DequantizeLinear" and n.input[0] in inits
    ]
    known = {o.name for o in float_model.graph.initializer} | {o for n in float_model.graph.node for o in n.output}
    values = float_values(float_model, [w for w in wanted if w in known], x[:1])
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    nodes = list(graph.node)
    used_by = {i: n.op_type for n in nodes for i in n.input}
    kept, added = [], []
    for node in nodes:
        original = node.input[0].removesuffix("_quantized")
        if (
            node.op_type == "DequantizeLinear"
            and node.input[0] in inits
            and original in values
            and (readers is None or used_by.get(node.output[0]) in readers)
        ):
            added.append(numpy_helper.from_array(values[original].astype(np.float32), node.output[0]))
            continue
        kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)
    graph.initializer.extend(added)
    return out


def score(model, x: np.ndarray, reference: np.ndarray) -> float:
    import onnxruntime as ort

    from quant_core.qparams import sqnr_db

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3  # removed pairs leave their qparams unused: not news
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    got = np.concatenate([session.run(None, {name: x[i : i + 8]})[0] for i in range(0, len(x), 8)])
    return sqnr_db(reference, got)


Predicate = Callable[[Activation], bool]
CLASSES: dict[str, Predicate] = {
    "tail: no Conv/Gemm/MatMul downstream": lambda a: not a.layer_downstream,
    "graph-output producers": lambda a: a.graph_output,
    "Conv outputs into Sigmoid (SiLU inputs)": lambda a: a.producer == "Conv" and "Sigmoid" in a.readers,
    "Sigmoid outputs": lambda a: a.producer == "Sigmoid",
    "Mul outputs (SiLU / SE products)": lambda a: a.producer == "Mul",
    "Concat inputs and outputs": lambda a: a.producer == "Concat" or "Concat" in a.readers,
    "Add outputs": lambda a: a.producer == "Add",
    "Softmax inputs and outputs": lambda a: a.producer == "Softmax" or "Softmax" in a.readers,
    "pooling outputs": lambda a: a.producer in ("GlobalAveragePool", "AveragePool", "MaxPool", "ReduceMean"),
    "Conv outputs (any reader)": lambda a: a.producer == "Conv",
    "data movement (Reshape/Transpose/Split/Slice) outputs": lambda a: (
        a.producer in ("Reshape", "Transpose", "Split", "Slice", "Flatten", "Resize")
    ),
    "Gemm/MatMul outputs": lambda a: a.producer in ("Gemm", "MatMul"),
}

CONSTANT_CLASSES: dict[str, tuple[str, ...] | None] = {
    "constant operands of Add/Sub/Mul/Div (float; last column: and every activation)": ("Add", "Sub", "Mul", "Div"),
    "Conv/Gemm/MatMul weights and biases (float; last column: and every activation)": tuple(LAYERS),
}


def ablate(name: str, size: int, num: int) -> list[tuple[str, int, float, float]]:
    import onnx

    from tools.bench.zoo import DATA_SEEDS, noise

    model = onnx.load(str(FILES / f"{name}_quant_onnx.onnx"))
    reference_model = onnx.load(str(FILES / f"{name}_float.onnx"))
    side = reference_model.graph.input[0].type.tensor_type.shape.dim[2].dim_value or size
    x = noise(num, side, DATA_SEEDS["eval"])
    import onnxruntime as ort

    session = ort.InferenceSession(reference_model.SerializeToString(), providers=["CPUExecutionProvider"])
    input_name = session.get_inputs()[0].name
    reference = np.concatenate([session.run(None, {input_name: x[i : i + 8]})[0] for i in range(0, len(x), 8)])
    acts = activations(model)
    everything = {a.tensor for a in acts}
    rows = [("none float (the file)", len(acts), score(model, x, reference), float("nan"))]
    for label, predicate in CLASSES.items():
        chosen = {a.tensor for a in acts if predicate(a)}
        if not chosen:
            continue
        rows.append(
            (
                label,
                len(chosen),
                score(without_qdq(model, chosen), x, reference),
                score(without_qdq(model, everything - chosen), x, reference),
            )
        )
    for label, readers in CONSTANT_CLASSES.items():
        floated = constants_float(model, reference_model, readers, x)
        rows.append((label, -1, score(floated, x, reference), score(without_qdq(floated, everything), x, reference)))
    rows.append(
        (
            "all activations float (weights only)",
            len(acts),
            score(without_qdq(model, everything), x, reference),
            float("nan"),
        )
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--models", nargs="+", required=True)
    parser.add_argument("--size", type=int, default=96, help="input side the zoo run used")
    parser.add_argument("--eval", type=int, default=8, help="evaluation samples (the zoo's --quick: 8)")
    args = parser.parse_args(argv)
    for name in args.models:
        headers = ["tensor class", "count", "SQNR dB, this class float", "SQNR dB, only this class 8-bit"]
        print_rows(name, headers, ablate(name, args.size, args.eval))
    return 0


def print_rows(name: str, headers: list[str], rows: list[tuple[str, object, float, float | None]]) -> None:
    """One model's ablation rows as a markdown table (SQNR to 4 figures)."""
    print(f"\n### {name}\n")
    print(common.markdown_table(headers, [(label, n, common.fmt(a, 4), common.fmt(b, 4)) for label, n, a, b in rows]))


if __name__ == "__main__":
    raise SystemExit(main())
