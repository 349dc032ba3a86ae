"""Node-by-node fidelity of an exported QDQ model against the frozen torch model, in any
runtime (``run(model, feeds) -> {output name: array}``: onnx's reference evaluator by
default, an onnxruntime session in the caller's hands): each ``QuantizeLinear`` output of
the file is compared, in codes, with the frozen model's fake-quantized tensor it stands for
(found by shape, qparams and value).

- ``chain``: the file run end to end from the model input (a step of difference in one
  layer travels on, as it would in deployment);
- ``isolated``: every quantized tensor computed from the frozen model's own codes of the
  tensors it reads (each QuantizeLinear output replaced by its frozen codes for its
  readers), so each difference is that node's own.

:func:`first_departure` says where an end-to-end difference starts: the first quantized
tensor of the file (in graph order) whose codes differ from the frozen model's, and how far
the two computations' values before rounding lie from the half step between the codes
they chose. A distance of a few float32 roundings is a tie two float implementations may
break either way (another summation order); a layer whose gain in steps exceeds one then
spreads that step on (a random-weight MobileNetV2: one code of 49152 at a tie, 88 steps
twenty layers on).

Example:
    >>> import torch
    >>> from quant_torch_fx import ModelQuantizer
    >>> from quant_torch_fx.export import onnx_model
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(16, 2))
    >>> q = ModelQuantizer("a8w8", quiet=True)
    >>> frozen = q.freeze(q.quantize_model(net, torch.randn(1, 3, 4, 4), [torch.randn(8, 3, 4, 4)]))
    >>> fidelity = node_by_node(onnx_model(frozen, (torch.randn(1, 3, 4, 4),), opset=19), frozen, (torch.randn(5, 3, 4, 4),))
    >>> len(fidelity.chain), fidelity.within_one_step("chain"), fidelity.within_one_step("isolated")
    (3, 1.0, 1.0)
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from quant_core.qdq import encode_activation
from quant_torch_fx.prepare import activation_quantizers, quantized_graphs

Runner = Callable[[onnx.ModelProto, dict[str, np.ndarray]], dict[str, np.ndarray]]


@attrs.frozen
class Recorded:
    """One quantizer call of the frozen model: its stored scale, zero point and codes (and the
    value it rounded, ``before``, when :func:`record` is asked to keep it)."""

    scale: float
    zero_point: int
    codes: np.ndarray
    before: np.ndarray | None = None


def record(
    frozen: torch.nn.Module, inputs: tuple[torch.Tensor, ...], encoding: str = "x86_uint8", keep_before: bool = False
) -> tuple[list[Recorded], object]:
    """Every activation quantizer call's output as stored codes (and, with ``keep_before``,
    the value it rounded), and the model's output."""
    seen: list[Recorded] = []
    handles = []
    for gm in quantized_graphs(frozen):
        for _key, fq in activation_quantizers(gm):
            qp = encode_activation(fq.current_qparams(), encoding)  # type: ignore[arg-type]

            def hook(_m: object, args: tuple[torch.Tensor, ...], out: torch.Tensor, qp: object = qp) -> None:
                scale, zero_point = np.float32(qp.scale), int(qp.zero_point)  # type: ignore[attr-defined]
                codes = np.rint(out.detach().numpy() / scale).astype(np.int64) + zero_point
                before = args[0].detach().numpy().copy() if keep_before else None
                seen.append(Recorded(float(scale), zero_point, codes, before))

            handles.append(fq.register_forward_hook(hook))
    try:
        with torch.no_grad():
            output = frozen(*inputs)
    finally:
        for handle in handles:
            handle.remove()
    return seen, output


def quantized_tensors(model: onnx.ModelProto) -> dict[str, tuple[float, int, int]]:
    """QuantizeLinear output -> (scale, zero point, element type) of each per-tensor Q whose
    qparams are initializers."""
    inits = {t.name: t for t in model.graph.initializer}
    found = {}
    for node in model.graph.node:
        if node.op_type == "QuantizeLinear" and node.input[1] in inits:
            scale = float(numpy_helper.to_array(inits[node.input[1]]).reshape(-1)[0])
            zero = inits[node.input[2]]
            found[node.output[0]] = (scale, int(numpy_helper.to_array(zero).reshape(-1)[0]), zero.data_type)
    return found


def _with_outputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    present = {o.name for o in copy.graph.output}
    copy.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names if n not in present)
    return copy


def _match(
    tensors: dict[str, tuple[float, int, int]], got: dict[str, np.ndarray], seen: list[Recorded]
) -> dict[str, int]:
    mapping = {}
    for name, (scale, zero_point, _type) in tensors.items():
        codes = got[name].astype(np.int64)
        candidates = [
            (float(np.abs(r.codes - codes).mean()), i)
            for i, r in enumerate(seen)
            if r.codes.shape == codes.shape and abs(r.scale - scale) <= 1e-7 * scale and r.zero_point == zero_point
        ]
        if candidates:
            mapping[name] = min(candidates)[1]
    return mapping


def _forced(model: onnx.ModelProto, names: list[str], types: dict[str, int]) -> onnx.ModelProto:
    copy = _with_outputs(model, names)
    forced = {n: f"{n}__frozen" for n in names}
    for node in copy.graph.node:
        if node.op_type == "QuantizeLinear" and node.output[0] in forced:
            continue
        for i, name in enumerate(node.input):
            if name in forced:
                node.input[i] = forced[name]
    copy.graph.input.extend(helper.make_tensor_value_info(forced[n], types[n], None) for n in names)
    return copy


def _end_to_end(
    model: onnx.ModelProto,
    frozen: torch.nn.Module,
    inputs: tuple[torch.Tensor, ...],
    feeds: dict[str, np.ndarray],
    run: Runner,
    encoding: str,
    keep_before: bool = False,
) -> tuple[dict[str, tuple[float, int, int]], list[Recorded], dict[str, np.ndarray], dict[str, int]]:
    """The file's quantized tensors, the frozen model's quantizer calls, every quantized tensor
    of the file (and the value each QuantizeLinear rounded, with ``keep_before``) run end to
    end, and which call each tensor stands for."""
    tensors = quantized_tensors(model)
    seen, _output = record(frozen, inputs, encoding, keep_before)
    rounded = [n.input[0] for n in model.graph.node if keep_before and n.output[0] in tensors]
    got = run(_with_outputs(model, [*tensors, *rounded]), feeds)
    return tensors, seen, got, _match(tensors, got, seen)


@attrs.frozen
class Fidelity:
    """Steps (codes) apart per quantized tensor of the file: end to end and isolated."""

    chain: dict[str, int]
    isolated: dict[str, int]
    unmatched: list[str]
    output: np.ndarray

    def within_one_step(self, which: str) -> float:
        steps = getattr(self, which)
        return float(np.mean([s <= 1 for s in steps.values()])) if steps else 1.0


def node_by_node(
    model: onnx.ModelProto,
    frozen: torch.nn.Module,
    inputs: tuple[torch.Tensor, ...],
    run: Runner | None = None,
    encoding: str = "x86_uint8",
) -> Fidelity:
    """Steps apart, per quantized tensor, of ``model`` (exported with ``encoding``) run by
    ``run`` (default: onnx's reference evaluator) on ``inputs`` and of the frozen model
    (see the module docstring)."""
    run = run or reference_runner
    feeds = {i.name: x.numpy() for i, x in zip(model.graph.input, inputs, strict=False)}
    tensors, seen, got, mapping = _end_to_end(model, frozen, inputs, feeds, run, encoding)
    names = list(tensors)
    chain = {n: int(np.abs(got[n].astype(np.int64) - seen[i].codes).max()) for n, i in mapping.items()}
    matched = list(mapping)
    forced = _forced(model, matched, {n: tensors[n][2] for n in matched})
    dtypes = {n: helper.tensor_dtype_to_np_dtype(tensors[n][2]) for n in matched}
    forced_feeds = dict(feeds) | {f"{n}__frozen": seen[mapping[n]].codes.astype(dtypes[n]) for n in matched}
    alone = run(forced, forced_feeds)
    isolated = {n: int(np.abs(alone[n].astype(np.int64) - seen[mapping[n]].codes).max()) for n in matched}
    output = got[model.graph.output[0].name]
    return Fidelity(chain, isolated, [n for n in names if n not in mapping], output)


def output_tolerance(model: onnx.ModelProto, output: str | None = None) -> float | None:
    """How far graph ``output`` (default: the first) moves when the quantized tensor it is
    computed from moves by one step: the step of a per-tensor DequantizeLinear that writes
    it; for a float result a Gemm/MatMul computes from a dequantized input and dequantized
    constant weights (a classifier's logits, left float by the planner's result tail), the
    input's step times the largest sum of absolute weights into one output, with float
    rounding; None for any other output. Two runs whose quantized tensors agree within one
    step agree within this at the output.

    Example (a Gemm reading 8-bit input codes of step 0.5, weights ``[[1, -2], [3, 0.5]]``
    read as ``transB``: row sums 3 and 3.5):
        >>> from onnx import TensorProto, numpy_helper
        >>> inits = [numpy_helper.from_array(np.float32(0.5), "xs"), numpy_helper.from_array(np.uint8(0), "xz"),
        ...          numpy_helper.from_array(np.array([[2, -4], [6, 1]], np.int8), "wq"),
        ...          numpy_helper.from_array(np.float32(0.5), "ws")]
        >>> nodes = [helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["x"]),
        ...          helper.make_node("DequantizeLinear", ["wq", "ws"], ["w"]),
        ...          helper.make_node("Gemm", ["x", "w"], ["y"], transB=1)]
        >>> g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("xq", TensorProto.UINT8, [1, 2])],
        ...                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])], inits)
        >>> round(output_tolerance(helper.make_model(g)), 4)
        1.75
    """
    from quant_core.onnx_qdq.graph import GraphIndex

    index = GraphIndex(model.graph)
    name = output or model.graph.output[0].name
    node = index.producer(name)

    def constant(tensor: str) -> bool:  # a float constant, or the DequantizeLinear of an integer one
        producer = index.producer(tensor)
        if producer is not None and producer.op_type == "DequantizeLinear":
            return index.is_constant(producer.input[0])
        return index.is_constant(tensor)

    if node is not None and node.op_type == "Add":  # a linear layer's bias
        data = [i for i in node.input if not constant(i)]
        node = index.producer(data[0]) if len(data) == 1 else None
    if node is None:
        return None
    if node.op_type == "DequantizeLinear":
        scale = index.constant(node.input[1])
        return None if scale is None or scale.size != 1 else float(scale)
    if node.op_type not in ("Gemm", "MatMul"):
        return None
    x_dq, w_dq = index.producer(node.input[0]), index.producer(node.input[1])
    if x_dq is None or w_dq is None or {x_dq.op_type, w_dq.op_type} != {"DequantizeLinear"}:
        return None
    step, codes, scale = (index.constant(x_dq.input[1]), index.constant(w_dq.input[0]), index.constant(w_dq.input[1]))
    if step is None or codes is None or scale is None or step.size != 1 or codes.ndim != 2:
        return None
    stored_zero = index.constant(w_dq.input[2]) if len(w_dq.input) > 2 and w_dq.input[2] else None
    zero = np.zeros(()) if stored_zero is None else stored_zero
    axis = int(next((a.i for a in w_dq.attribute if a.name == "axis"), 1))
    shape = [1, 1]
    if scale.size > 1:
        shape[axis] = -1
    weights = (codes.astype(np.float64) - np.reshape(zero, shape)) * np.reshape(scale, shape)
    transposed = node.op_type == "Gemm" and any(a.name == "transB" and a.i for a in node.attribute)
    into_output = np.abs(weights).sum(axis=1 if transposed else 0)
    return float(step) * float(into_output.max()) * (1 + 1e-5) + 1e-6


def reference_runner(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run ``model`` with onnx's reference evaluator (every output by name)."""
    from onnx.reference import ReferenceEvaluator

    evaluator = ReferenceEvaluator(model)
    outputs = evaluator.run(None, feeds)
    return dict(zip(evaluator.output_names, outputs, strict=True))


@attrs.frozen
class Departure:
    """Where the file's codes first differ from the frozen model's (end to end, graph order).

    ``tensor``: the QuantizeLinear output; ``elements``: how many of its codes differ;
    ``steps``: the largest difference in codes; ``tie_distance``: at the differing elements,
    the largest distance (in steps) of either computation's value before rounding from the
    half step between the two codes (meaningful where ``steps`` is 1).
    """

    tensor: str
    elements: int
    steps: int
    tie_distance: float


def first_departure(
    model: onnx.ModelProto,
    frozen: torch.nn.Module,
    inputs: tuple[torch.Tensor, ...],
    run: Runner | None = None,
    encoding: str = "x86_uint8",
) -> Departure | None:
    """The first quantized tensor of ``model`` (graph order) whose codes, run end to end by
    ``run``, differ from the frozen model's on ``inputs``; None when every matched tensor
    agrees.

    Example:
        >>> import torch
        >>> from quant_torch_fx import ModelQuantizer
        >>> from quant_torch_fx.export import onnx_model
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
        >>> q = ModelQuantizer("a8w8", quiet=True)
        >>> frozen = q.freeze(q.quantize_model(net, torch.randn(1, 3, 4, 4), [torch.randn(8, 3, 4, 4)]))
        >>> print(first_departure(onnx_model(frozen, (torch.randn(1, 3, 4, 4),), opset=19), frozen, (torch.randn(5, 3, 4, 4),)))
        None
    """
    feeds = {i.name: x.numpy() for i, x in zip(model.graph.input, inputs, strict=False)}
    tensors, seen, got, mapping = _end_to_end(model, frozen, inputs, feeds, run or reference_runner, encoding, True)
    quantized_from = {n.output[0]: n.input[0] for n in model.graph.node if n.output[0] in tensors}
    for node in model.graph.node:
        name = node.output[0]
        if name not in mapping:
            continue
        frozen_side = seen[mapping[name]]
        codes = got[name].astype(np.int64)
        differ = codes != frozen_side.codes
        if not differ.any():
            continue
        assert frozen_side.before is not None
        scale, zero_point = np.float64(frozen_side.scale), frozen_side.zero_point
        half = np.minimum(codes, frozen_side.codes)[differ] - zero_point + 0.5
        distance = np.maximum(
            np.abs(frozen_side.before[differ] / scale - half),
            np.abs(got[quantized_from[name]][differ] / scale - half),
        )
        steps = int(np.abs(codes - frozen_side.codes).max())
        return Departure(name, int(differ.sum()), steps, float(distance.max()))
    return None
