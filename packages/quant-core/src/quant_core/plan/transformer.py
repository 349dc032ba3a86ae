"""The transformer recipe: recognise normalisation, GELU, Softmax and residual blocks in a
graph, and say which of their tensors need another format than the preset's.

Measured on random-weight timm ViT-Tiny (96 px, a8w8, quant-onnx; ``docs/transformers.md``):
the residual stream (the Add outputs a LayerNorm reads) at 8 bits alone costs ~13 dB of
output SQNR (24 dB -> 33-34 dB with it at 16 bits, +0.15 dB more float); the linear biases at
8 bits 0.7 dB.
So, under any preset, :func:`find_blocks` marks

- **residual-stream tensors** (an Add output a recognised norm reads, possibly through
  data-movement ops, and the learned tokens a Concat joins to it): float, as PT2E leaves
  them; no integer kernel reads them on onnxruntime (LayerNorm, the residual Adds run in
  float). A Conv/Gemm/MatMul that reads one directly quantizes it at the preset's format.
  Under power-of-two formats (an integer-only NPU, which runs no float op) they are
  quantized with the preset's activation format widened to 16 bits (:func:`widened`), and
  a weighted op that reads one gets its own 8-bit requantization;
- **block internals** (inside a decomposed LayerNorm ``ReduceMean/Sub/Pow/Sqrt/Div``
  and an ``Erf``/``Tanh`` GELU, and a GELU's input when only the GELU reads it): left
  float. These ops have no integer kernel anywhere; a quantize/dequantize pair between
  them only adds error. A tensor a Conv/Gemm/MatMul reads is never among them;
- **a linear layer's product before its constant bias Add**, and that bias: float (no integer
  kernel reads them; onnxruntime runs the layer with a float output, as PT2E leaves ``linear``
  outputs float; the classifier's logits are the result tail's, :mod:`quant_core.plan.tail`);
- **attention scores** (from the ``Q.K^T`` MatMul through bias/mask Adds into the
  softmax): float (no integer kernel reads them; the MatMul runs with a float output);
- **attention Softmax outputs** (a MatMul reads them): their observed range (finer than
  ``[0, 1]`` where attention is spread out); under power-of-two formats the fixed grid
  ``[0, 1]`` (:class:`~quant_core.observer_config.FixedRange`), the values softmax can take;
- **masked scores** (:class:`MaskedScores`: the scores plus a mask, an ``Add`` of a
  constant ``{0, fill}`` or of a ``Where`` choosing between ``0`` and the fill, or a
  ``Where`` writing the fill into the scores): where they are quantized (power-of-two
  formats) their range is not observed, the fill would set it (``-3.4e38``, ``-1e4``,
  Swin's ``-100``) and leave the visible scores a few codes; the planner derives it from
  the scores before the mask (:class:`~quant_core.plan.planner.DerivedRange`);

None of these blocks occurs in a plain CNN (no LayerNorm, GELU or attention; a classifier's
Softmax is not read by a MatMul), whose plan is unchanged by the recipe.

Example (a residual Add feeding a LayerNorm, then a Softmax):
    >>> from quant_core.plan.graph import PlanGraph, PlanNode
    >>> nodes = [PlanNode("add", "Add", ("x", "y"), ("r",)),
    ...          PlanNode("ln", "LayerNormalization", ("r", "g", "b"), ("n",)),
    ...          PlanNode("sm", "Softmax", ("n",), ("p",)), PlanNode("av", "MatMul", ("p", "v"), ("o",))]
    >>> blocks = find_blocks(PlanGraph(nodes, inputs=("x", "y", "v"), outputs=("o",)))
    >>> sorted(blocks.residual), sorted(blocks.softmax_outputs), blocks.summary()
    (['r'], ['p'], '1 LayerNorm, 0 GELU, 1 Softmax; 1 residual-stream tensor (float, 16 bits on power-of-two formats), 0 block-internal tensors float, 1 Softmax output (observed range, [0, 1] on power-of-two formats)')
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import attrs
import numpy as np

from quant_core.dtypes import DType
from quant_core.observer_config import FixedRange
from quant_core.plan.graph import GraphView, PlanNode, scalar_constant, sole_reader, uniform_value
from quant_core.spec import QuantSpec, ScaleType

WEIGHTED_OPS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
"""Ops whose data inputs must stay quantized (an integer kernel reads them)."""
FLOAT_OUTPUT_KERNELS = frozenset({"Gemm", "MatMul"})
"""Layers onnxruntime still runs as integer kernels with a float output (QGemm,
MatMulIntegerToFloat); a Conv without a quantized output runs float."""

_MOVEMENT = frozenset({"Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Identity"})
_SELECTS = _MOVEMENT | {"Gather", "Slice", "Split"}
_ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Pow"})
_GELU_CORE = frozenset({"Erf", "Tanh"})
#: A GELU region's largest node count: torch's export of the tanh form below opset 20
#: writes x**3 as two Muls, nine nodes in all.
_MAX_GELU_NODES = 10
SOFTMAX_GRID = FixedRange(min_val=0.0, max_val=1.0)
"""The range of every softmax output."""
MASK_FILL_LIMIT = -16 * math.log(2.0)
"""A mask's fill is at most this (``exp(fill) < 2**-16``: the softmax weight it leaves is
under the step of any softmax output of up to 16 bits); a two-valued constant ``{0, -1}``
is a bias, not a mask."""
_MASK_MOVEMENT = _MOVEMENT | {"Expand", "Tile"}


@attrs.frozen
class MaskedScores:
    """Attention scores a mask is applied to before the softmax.

    Attributes:
        output: the masked scores (the mask Add's or Where's output).
        scores: the scores before the mask (the Add's or Where's other data input).
        mask: the additive mask tensor the Add reads (``""`` for a Where on the scores).
        softmax_output: the output of the Softmax the masked scores feed.
        mask_tensors: ``mask`` and what it is computed from (data movement, the masks a
            sum of masks adds), each holding the fill.

    Example:
        >>> MaskedScores("masked", "scores", "mask", "p").mask
        'mask'
    """

    output: str
    scores: str
    mask: str
    softmax_output: str
    mask_tensors: tuple[str, ...] = ()


@attrs.frozen
class TransformerBlocks:
    """What :func:`find_blocks` recognised.

    Attributes:
        norms: names of the recognised normalisation nodes (a decomposed LayerNorm by its
            first ReduceMean).
        gelus: names of the recognised GELU nodes (an ``Erf``/``Tanh`` form by that node).
        softmaxes: names of the Softmax nodes.
        residual: residual-stream tensors (16 bits under power-of-two formats).
        float_stream: the residual-stream tensors no Conv/Gemm/MatMul reads: float under
            every other format (no integer kernel reads them), as PT2E leaves the stream.
        float_tensors: block-internal tensors left float.
        norm_internals: the tensors inside a decomposed LayerNorm (16 bits under
            power-of-two formats, as the stream: a variance in 8 bits loses the model).
        softmax_outputs: Softmax outputs (observed range; fixed ``[0, 1]`` grid under power-of-two formats).
        masked_scores: the attention scores a recognised mask is applied to (:class:`MaskedScores`).

    Example:
        >>> TransformerBlocks().summary()
        ''
    """

    norms: tuple[str, ...] = ()
    gelus: tuple[str, ...] = ()
    softmaxes: tuple[str, ...] = ()
    residual: frozenset[str] = frozenset()
    float_stream: frozenset[str] = frozenset()
    float_tensors: frozenset[str] = frozenset()
    norm_internals: frozenset[str] = frozenset()
    softmax_outputs: frozenset[str] = frozenset()
    masked_scores: tuple[MaskedScores, ...] = ()

    def summary(self) -> str:
        """One line for the report; ``""`` when nothing was recognised."""
        if not (self.norms or self.gelus or self.softmaxes):
            return ""
        return (
            f"{len(self.norms)} LayerNorm, {len(self.gelus)} GELU, {len(self.softmaxes)} Softmax; "
            f"{len(self.residual)} residual-stream tensor{'s' * (len(self.residual) != 1)} "
            "(float, 16 bits on power-of-two formats), "
            f"{len(self.float_tensors)} block-internal tensor{'s' * (len(self.float_tensors) != 1)} float, "
            f"{len(self.softmax_outputs)} Softmax output{'s' * (len(self.softmax_outputs) != 1)} "
            "(observed range, [0, 1] on power-of-two formats)"
        ) + (f"; {len(self.masked_scores)} masked scores" if self.masked_scores else "")


def widened(spec: QuantSpec) -> QuantSpec:
    """``spec`` with a 16-bit integer format of the same signedness when it has fewer bits
    (a residual-stream tensor's format); other specs unchanged.

    Example:
        >>> widened(QuantSpec(dtype="uint8", symmetric=False)).dtype.value
        'uint16'
        >>> widened(QuantSpec(dtype="int16")).dtype.value
        'int16'
    """
    if not spec.is_quantized or spec.dtype.bits >= 16:
        return spec
    return spec.evolve(dtype=DType.INT16 if spec.dtype.signed else DType.UINT16)


def softmax_spec(spec: QuantSpec) -> QuantSpec:
    """``spec`` on the fixed softmax grid ``[0, 1]`` under power-of-two formats (an NPU's
    softmax writes that grid); other specs unchanged: float scales keep the observed range,
    finer where attention is spread out (random-weight ViT-Tiny +0.3 dB, DeiT-Tiny +0.5 dB,
    the trained ``fmnist_deit`` +0.6 dB of output SQNR) and ``[0, max]`` where it peaks.

    Example:
        >>> softmax_spec(QuantSpec(dtype="int8", scale_type="power_of_two")).observer
        FixedRange(min_val=0.0, max_val=1.0)
        >>> softmax_spec(QuantSpec(dtype="uint8", symmetric=False)).observer
        MinMax()
    """
    if not spec.is_quantized or spec.scale_type is not ScaleType.POWER_OF_TWO:
        return spec
    return spec.evolve(observer=SOFTMAX_GRID)


def _other_input(graph: GraphView, node: PlanNode, known: str) -> str | None:
    """The input of binary ``node`` that is not ``known`` (``None``: no such single input)."""
    if len(node.inputs) != 2 or known not in node.inputs:
        return None
    a, b = node.inputs
    return b if a == known else a


def _sole_consumer(graph: GraphView, tensor: str, op_type: str) -> PlanNode | None:
    reader = sole_reader(graph, tensor)
    return reader if reader is not None and reader.op_type == op_type else None


def _with_constant(graph: GraphView, node: PlanNode | None, op_type: str) -> tuple[str, float] | None:
    """``(activation input, constant)`` of a binary ``op_type`` node with one scalar constant input."""
    if node is None or node.op_type != op_type or len(node.inputs) != 2:
        return None
    for data, const in ((node.inputs[0], node.inputs[1]), (node.inputs[1], node.inputs[0])):
        value = scalar_constant(graph, const)
        if value is not None and graph.constant(data) is None:
            return data, value
    return None


@attrs.frozen
class _Block:
    name: str
    input: str
    output: str
    internal: tuple[str, ...]


def _decomposed_layernorm(graph: GraphView, mean: PlanNode) -> _Block | None:
    """``ReduceMean(x) -> Sub(x, m) -> Pow(d, 2) | Mul(d, d) -> ReduceMean -> Add(eps) -> Sqrt
    -> Div(d, s) [-> Mul(gamma)] [-> Add(beta)]``."""
    x = mean.input(0)
    internal = [mean.outputs[0]]
    sub = _sole_consumer(graph, mean.outputs[0], "Sub")
    if sub is None or sub.inputs != (x, mean.outputs[0]):
        return None
    d = sub.outputs[0]
    internal.append(d)
    square = next((c for c in graph.consumers(d) if c.op_type in ("Pow", "Mul") and c.outputs), None)
    if square is None or not (square.inputs == (d, d) or scalar_constant(graph, square.input(1)) == 2.0):
        return None
    chain = [square]
    for op_type in ("ReduceMean", "Add", "Sqrt", "Div"):
        nxt = _sole_consumer(graph, chain[-1].outputs[0], op_type)
        if nxt is None:
            return None
        chain.append(nxt)
    div = chain[-1]
    if div.inputs != (d, chain[-2].outputs[0]) or {c.name for c in graph.consumers(d)} != {square.name, div.name}:
        return None
    internal += [n.outputs[0] for n in chain[:-1]]
    out = div.outputs[0]
    for op_type in ("Mul", "Add"):  # the affine part, when the exporter did not fold it
        consumers = graph.consumers(out)
        if (
            len(consumers) == 1
            and consumers[0].op_type == op_type
            and any(graph.constant(i) is not None for i in consumers[0].inputs)
            and not graph.is_graph_output(out)
        ):
            internal.append(out)
            out = consumers[0].outputs[0]
    return _Block(mean.name, x, out, tuple(internal))


def _gelu(graph: GraphView, core: PlanNode) -> _Block | None:
    """``0.5 * x * (1 + erf(x / sqrt(2)))`` or ``... (1 + tanh(c * (x + 0.044715 x^3)))``,
    in either order of the two Muls."""
    one = _sole_consumer(graph, core.outputs[0], "Add")
    plus = _with_constant(graph, one, "Add")
    if one is None or plus is None or plus[1] != 1.0:
        return None
    mul = _sole_consumer(graph, one.outputs[0], "Mul")
    other = None if mul is None else _other_input(graph, mul, one.outputs[0])
    if mul is None or other is None:
        return None
    internal = [core.outputs[0], one.outputs[0]]
    region = {core.name, one.name, mul.name}
    half = _with_constant(graph, graph.producer(other), "Mul")
    if half is not None and half[1] == 0.5 and _sole_consumer(graph, other, "Mul") is not None:
        x, out = half[0], mul.outputs[0]
        internal.append(other)
        region.add(graph.producer(other).name)  # type: ignore[union-attr]
    else:
        last = _sole_consumer(graph, mul.outputs[0], "Mul")
        scaled = _with_constant(graph, last, "Mul")
        if last is None or scaled is None or scaled[1] != 0.5:
            return None
        x, out = other, last.outputs[0]
        internal.append(mul.outputs[0])
        region.add(last.name)
    # Backwards from the core to x: element-wise ops on x and constants only.
    stack, seen = [core.input(0)], set()
    while stack:
        tensor = stack.pop()
        if tensor == x or tensor in seen or graph.constant(tensor) is not None:
            continue
        seen.add(tensor)
        producer = graph.producer(tensor)
        if producer is None or producer.op_type not in _ELEMENTWISE or len(region) >= _MAX_GELU_NODES:
            return None
        region.add(producer.name)
        internal.append(tensor)
        stack.extend(producer.inputs)
    if not seen:
        return None
    # A GELU's internals are read inside it only.
    if any(c.name not in region for t in internal for c in graph.consumers(t)):
        return None
    if {c.name for c in graph.consumers(x)} <= region and not graph.is_graph_output(x):
        internal.append(x)  # only the GELU reads its input: no integer kernel does
    return _Block(core.name, x, out, tuple(internal))


def _residual_source(graph: GraphView, tensor: str) -> str | None:
    """The Add output that ``tensor`` is, or reaches through data-movement ops."""
    for _ in range(8):
        producer = graph.producer(tensor)
        if producer is None:
            return None
        if producer.op_type == "Add":
            return tensor
        if producer.op_type not in _MOVEMENT:
            return None
        tensor = producer.input(0)
    return None


def _layer_writing(graph: GraphView, tensor: str) -> tuple[PlanNode, tuple[str, ...]] | None:
    """The Conv/Gemm/MatMul whose output ``tensor`` is, and the tensors from that output to
    ``tensor``: directly, after its constant bias Add (a Linear as torch exports it:
    ``MatMul`` then ``Add``), or, for a Gemm/MatMul, after data movement only it reads (a
    Linear over flattened tokens: ``Gemm`` then ``Reshape``/``Transpose`` back to
    ``[B, T, C]``); else ``None``."""
    chain = [tensor]
    producer = graph.producer(tensor)
    for _ in range(8):
        if producer is None or producer.op_type not in _MOVEMENT or len(graph.consumers(producer.input(0))) != 1:
            break
        chain.append(producer.input(0))
        producer = graph.producer(producer.input(0))
    if producer is not None and producer.op_type == "Add" and len(producer.inputs) == 2:
        data = [i for i in producer.inputs if graph.constant(i) is None]
        inner = graph.producer(data[0]) if len(data) == 1 else None
        if inner is not None and inner.op_type == "MatMul" and len(graph.consumers(data[0])) == 1:
            producer = inner
    if producer is None or producer.op_type not in WEIGHTED_OPS:
        return None
    if len(chain) > 1 and producer.op_type not in FLOAT_OUTPUT_KERNELS:
        return None  # a Conv's 8-bit output reaches the stream as data movement: unchanged
    return producer, tuple(chain)


def _shortcuts(graph: GraphView, norms: list[_Block], residual: set[str]) -> set[str]:
    """Norm inputs that a residual Add also reads, whatever produces them (Swin's patch-merging
    Linear starts each stage's stream), with the data-movement steps back to their producer."""
    residual_adds = {p.name for t in residual if (p := graph.producer(t)) is not None}
    found = set()
    for norm in norms:
        chain, tensor = [norm.input], norm.input
        for _ in range(8):
            producer = graph.producer(tensor)
            if producer is None or producer.op_type not in _MOVEMENT:
                break
            tensor = producer.input(0)
            chain.append(tensor)
        if any(c.name in residual_adds for t in chain for c in graph.consumers(t)):
            found.update(chain)
    return found - residual


def _scores(graph: GraphView, tensor: str, depth: int = 0) -> set[str]:
    """The attention scores into a softmax: from the ``Q.K^T`` MatMul's output through the
    bias and mask Adds and data movement, each read on that path only. Float: softmax has
    no integer kernel, and the MatMul runs as ``MatMulIntegerToFloat`` (PT2E keeps the
    whole attention float)."""
    producer = graph.producer(tensor)
    if producer is None or depth > 6 or len(graph.consumers(tensor)) != 1 or graph.is_graph_output(tensor):
        return set()
    if producer.op_type == "MatMul":
        return {tensor}
    if producer.op_type not in _MOVEMENT | {"Add", "Mul", "Div", "Sub", "Where"}:
        return set()
    data = [i for i in producer.inputs if i and graph.constant(i) is None and graph.is_float(i)]
    data = data[:1] if producer.op_type in _MOVEMENT else data
    for candidate in data:
        path = _scores(graph, candidate, depth + 1)
        if path:
            return path | {tensor}
    return set()


def _attention_weights(graph: GraphView, probs: str) -> tuple[str, ...]:
    """``probs`` (a Softmax output) and its NaN guard when a MatMul reads them (attention
    weights), else ``()``. torch's ONNX export of a boolean-masked attention zeroes the rows
    a mask hides everywhere with ``Where(IsNaN(p), 0, p)`` before the MatMul."""
    found = [probs]
    for reader in graph.consumers(probs):
        if (
            reader.op_type == "Where"
            and len(reader.inputs) == 3
            and 0.0 in {scalar_constant(graph, i) for i in reader.inputs}
        ):
            found += [out for out in reader.outputs[:1] if any(c.op_type == "MatMul" for c in graph.consumers(out))]
    reads = any(c.op_type == "MatMul" for t in found for c in graph.consumers(t))
    return tuple(found) if reads else ()


# How many sums of masks deep a mask is followed (nn.MultiheadAttention makes one).
_MAX_MASK_SUMS = 3


def _is_fill(value: float | None) -> bool:
    return value is not None and value <= MASK_FILL_LIMIT


def mask_fill(graph: GraphView, tensor: str, depth: int = 0) -> float | None:
    """The fill of ``tensor`` when it is an additive attention mask, else ``None``: a
    constant whose values are ``0`` and one fill at most :data:`MASK_FILL_LIMIT` (a causal
    mask, Swin's shift mask), or a ``Where`` choosing between ``0`` and such a fill, each a
    scalar or a ``ConstantOfShape`` (a boolean mask made additive at run time, as
    ``nn.MultiheadAttention`` does with ``zeros_like``), or the sum of two masks
    (``nn.MultiheadAttention`` adds its key-padding mask to its attention mask), each possibly
    through data movement and ``Expand``. Recognised by structure; a bias with other values
    is no mask. A sum's fill is the larger of its masks' fills: every value of the sum but 0
    lies at or below it.

    Example:
        >>> import numpy as np
        >>> from quant_core.plan.graph import PlanGraph, PlanNode
        >>> c = {"causal": np.triu(np.full((3, 3), -1e4, np.float32), 1), "bias": np.float32([[0, -1], [-2, 0]]),
        ...      "zero": np.float32(0), "fill": np.float32(-np.inf)}
        >>> nodes = [PlanNode("w", "Where", ("keep", "zero", "fill"), ("m",))]
        >>> graph = PlanGraph(nodes, inputs=("keep",), outputs=("m",), constant=c.get)
        >>> mask_fill(graph, "causal"), mask_fill(graph, "m"), mask_fill(graph, "bias")
        (-10000.0, -inf, None)
    """
    source = _mask_path(graph, tensor)[-1]
    value = graph.constant(source)
    if value is not None:
        values = np.unique(np.asarray(value, np.float64))
        fills = values[values != 0]
        return float(fills[0]) if len(fills) == 1 and _is_fill(float(fills[0])) else None
    producer = graph.producer(source)
    if producer is not None and producer.op_type == "Where" and len(producer.inputs) == 3:
        a, b = uniform_value(graph, producer.inputs[1]), uniform_value(graph, producer.inputs[2])
        chosen = {a, b} - {0.0}
        fill = chosen.pop() if len(chosen) == 1 and 0.0 in (a, b) else None
        return fill if _is_fill(fill) else None
    summed = _mask_sum(graph, source, depth)
    return max(summed.values()) if summed else None


def _mask_sum(graph: GraphView, source: str, depth: int) -> dict[str, float]:
    """Each input of the ``Add`` writing ``source`` with its fill, when both are masks (a
    few sums deep at most), else nothing."""
    producer = graph.producer(source)
    if depth >= _MAX_MASK_SUMS or producer is None or producer.op_type != "Add" or len(producer.inputs) != 2:
        return {}
    fills = {t: mask_fill(graph, t, depth + 1) for t in producer.inputs}
    return {t: f for t, f in fills.items() if f is not None} if None not in fills.values() else {}


def _mask_path(graph: GraphView, tensor: str) -> list[str]:
    """``tensor`` and the tensors it was moved from (data movement only, eight tensors at
    most), back to a constant or to the tensor something else makes."""
    path = [tensor]
    for _ in range(7):
        producer = graph.producer(path[-1])
        if graph.constant(path[-1]) is not None or producer is None or producer.op_type not in _MASK_MOVEMENT:
            break
        path.append(producer.input(0))
    return path


def _mask_tensors(graph: GraphView, mask: str, depth: int = 0) -> set[str]:
    """``mask`` (a :func:`mask_fill` mask) and what it is computed from: the tensors back
    through data movement to where it is made (a ``Where``'s output) or read (a constant:
    ``nn.MultiheadAttention`` unsqueezes a ``-inf`` causal mask, and a data-movement op
    would quantize its constant input, observing the fill), through both masks of a sum."""
    path = _mask_path(graph, mask)
    found = {mask} | set(path)
    for added in _mask_sum(graph, path[-1], depth):
        found |= _mask_tensors(graph, added, depth + 1)
    return found - {""}


def _masked_scores(graph: GraphView, softmax: PlanNode, scores: set[str]) -> MaskedScores | None:
    """The mask applied last to the scores ``softmax`` reads (only data movement after it):
    an ``Add`` of the scores and a :func:`mask_fill` mask, or a ``Where`` writing a fill
    into them. A mask added before a bias is not recognised (the visible scores would then
    be observed nowhere)."""
    tensor = softmax.input(0)
    for _ in range(8):
        producer = graph.producer(tensor)
        if producer is None or tensor not in scores:
            return None
        if producer.op_type == "Add" and len(producer.inputs) == 2:
            for data, mask in (producer.inputs, producer.inputs[::-1]):
                if data in scores and graph.constant(data) is None and mask_fill(graph, mask) is not None:
                    return MaskedScores(
                        tensor, data, mask, softmax.outputs[0], tuple(sorted(_mask_tensors(graph, mask)))
                    )
            return None
        if producer.op_type == "Where" and len(producer.inputs) == 3:
            for data, fill in (producer.inputs[1:], producer.inputs[:0:-1]):
                if data in scores and _is_fill(scalar_constant(graph, fill)):
                    return MaskedScores(tensor, data, "", softmax.outputs[0])
            return None
        if producer.op_type not in _MOVEMENT:
            return None
        tensor = producer.input(0)
    return None


def _branch_outputs(graph: GraphView, residual: set[str]) -> set[str]:
    """The other inputs of the residual Adds (an attention or MLP branch's output, a
    position embedding) that only residual Adds read: they join the stream's format (16
    bits; no 8-bit kernel reads them)."""
    producers = (graph.producer(t) for t in residual)
    adds = {p.name: p for p in producers if p is not None and p.op_type == "Add"}
    found = set()
    for add in adds.values():
        for tensor in add.inputs:
            if (
                tensor
                and tensor not in residual
                and (graph.constant(tensor) is not None or graph.producer(tensor) is not None)
                and not graph.is_graph_output(tensor)
                and all(c.name in adds for c in graph.consumers(tensor))
            ):
                found.add(tensor)
    return found


def _joined_tokens(graph: GraphView, stream: set[str]) -> set[str]:
    """Learned tokens a Concat joins to the stream (ViT's class token, DeiT's distillation
    token: a constant, possibly through ``Expand``/data movement): float with the stream
    where it is float. Quantized with the patch embedding's scale, DeiT's distillation
    token (values ~0.02) rounds to a few codes."""
    found = set()
    for tensor in stream:
        producer = graph.producer(tensor)
        if producer is None or producer.op_type != "Concat":
            continue
        for start in producer.inputs:
            chain, current = [start], start
            for _ in range(8):
                if graph.constant(current) is not None:
                    found.update(chain)
                    break
                step = graph.producer(current)
                if step is None or step.op_type not in _MOVEMENT | {"Expand", "Tile"}:
                    break
                current = step.input(0)
                chain.append(current)
    return found


def _stream_copies(graph: GraphView, stream: set[str], keep: set[str]) -> set[str]:
    """``stream`` and what data movement and Concat make of it up to the tensors a
    Conv/Gemm/MatMul reads (Swin's window shifts and patch merging's four slices
    concatenated into a norm): float with the stream. Quantized, each copy would round the
    stream to 8 bits on its own (Swin-Tiny in quant-torch-fx: 32.75 -> 32.34 dB)."""
    found, stack = set(stream), list(stream)
    while stack:
        tensor = stack.pop()
        if tensor in keep:
            continue
        for consumer in graph.consumers(tensor):
            if consumer.op_type in _SELECTS or consumer.op_type in ("Concat", "Pad"):
                fresh = [o for o in consumer.outputs if o and o not in found and not graph.is_graph_output(o)]
                found.update(fresh)
                stack.extend(fresh)
    return found


def _weighted_inputs(nodes: Iterable[PlanNode]) -> set[str]:
    return {name for node in nodes if node.op_type in WEIGHTED_OPS for name in node.inputs}


def _linear_products(graph: GraphView) -> set[str]:
    """Outputs of ``MatMul(x, W)`` whose only reader adds a constant bias: a linear layer on
    a 3-D input as torch exports it. The layer's output is the Add's; quantizing the
    product before the bias adds a rounding PT2E's ``linear`` never has (onnxruntime runs
    the MatMul as ``MatMulIntegerToFloat``, still an integer kernel)."""
    products = set()
    for node in graph.nodes:
        if node.op_type != "MatMul" or not node.standard or graph.constant(node.input(1)) is None:
            continue
        out = node.outputs[0]
        bias = _sole_consumer(graph, out, "Add")
        other = None if bias is None else _other_input(graph, bias, out)
        if other is not None and graph.constant(other) is not None:
            products.add(out)
    return products


def _linear_biases(graph: GraphView, products: set[str]) -> set[str]:
    """The constant bias of each linear product's Add. Float, as PT2E keeps a ``linear``
    bias and onnxruntime's ``MatMulIntegerToFloat`` takes it (fused with the Add): an 8-bit
    per-tensor bias only adds rounding (0.7 dB of ViT-Tiny's output SQNR)."""
    biases = set()
    for product in products:
        add = graph.consumers(product)[0]
        biases |= {i for i in add.inputs if i != product and graph.constant(i) is not None}
    return biases


def _selected_only(graph: GraphView, tensor: str) -> set[str]:
    """``tensor`` and the tensors after it while only data movement reads them (a norm
    output from which ViT takes its class token: ``Slice``, ``Gather``...), along every
    reader (DeiT's class and distillation tokens, torch's ``slice`` then ``select`` each):
    float, so each layer after the movement quantizes only what it reads, on that range."""
    found: set[str] = set()
    pending = [(tensor, 0)]
    while pending:
        name, depth = pending.pop()
        consumers = graph.consumers(name)
        if (
            depth >= 8
            or name in found
            or not consumers
            or graph.is_graph_output(name)
            or any(c.op_type not in _SELECTS for c in consumers)
        ):
            continue
        found.add(name)
        pending.extend((out, depth + 1) for c in consumers for out in c.outputs if out)
    return found


def find_blocks(graph: GraphView) -> TransformerBlocks:
    """Recognise the transformer blocks of ``graph`` (see the module docstring).

    Example (an ``Erf`` GELU between two MatMuls: its internals float, its output not; the
    graph output the last layer writes is the result tail's, :mod:`quant_core.plan.tail`):
        >>> import numpy as np
        >>> from quant_core.plan.graph import PlanGraph, PlanNode
        >>> c = {"w1": np.ones((4, 4), np.float32), "w2": np.ones((4, 4), np.float32), "s": np.float32(1.4142135),
        ...      "one": np.float32(1.0), "half": np.float32(0.5)}
        >>> nodes = [PlanNode("fc1", "MatMul", ("x", "w1"), ("h",)), PlanNode("div", "Div", ("h", "s"), ("d",)),
        ...          PlanNode("erf", "Erf", ("d",), ("e",)), PlanNode("add", "Add", ("e", "one"), ("a",)),
        ...          PlanNode("mul", "Mul", ("h", "a"), ("m",)), PlanNode("half", "Mul", ("m", "half"), ("g",)),
        ...          PlanNode("fc2", "MatMul", ("g", "w2"), ("y",))]
        >>> blocks = find_blocks(PlanGraph(nodes, inputs=("x",), outputs=("y",), constant=c.get))
        >>> blocks.gelus, sorted(blocks.float_tensors)
        (('erf',), ['a', 'd', 'e', 'h', 'm'])
    """
    norms: list[_Block] = []
    gelus: list[_Block] = []
    softmaxes: list[PlanNode] = []
    for node in graph.nodes:
        if not node.standard or not node.outputs or not node.outputs[0]:
            continue
        if node.op_type == "LayerNormalization":
            norms.append(_Block(node.name, node.input(0), node.outputs[0], ()))
        elif node.op_type == "ReduceMean":
            block = _decomposed_layernorm(graph, node)
            if block is not None:
                norms.append(block)
        elif node.op_type == "Gelu":
            x = node.input(0)
            only_gelu = [c.name for c in graph.consumers(x)] == [node.name] and not graph.is_graph_output(x)
            gelus.append(_Block(node.name, x, node.outputs[0], (x,) if only_gelu else ()))
        elif node.op_type in _GELU_CORE:
            block = _gelu(graph, node)
            if block is not None:
                gelus.append(block)
        elif node.op_type == "Softmax" and _attention_weights(graph, node.outputs[0]):
            softmaxes.append(node)  # attention: a classifier's output softmax keeps its own range
    residual = {source for norm in norms if (source := _residual_source(graph, norm.input)) is not None}
    residual |= _shortcuts(graph, norms, residual)
    residual |= _branch_outputs(graph, residual)
    # A stream tensor a layer writes (a branch's last Linear, Swin's patch merging): float
    # for a Gemm/MatMul, which keeps an integer kernel with a float output; a Conv's stays at
    # the preset's format (its kernel needs an 8-bit output). A 16-bit quantize after either
    # would leave the layer float on onnxruntime.
    layers = {t: writer for t in residual if (writer := _layer_writing(graph, t)) is not None}
    residual -= set(layers)
    written = {c for layer, chain in layers.values() if layer.op_type in FLOAT_OUTPUT_KERNELS for c in chain}
    keep = _weighted_inputs(graph.nodes)
    internal = {t for block in (*norms, *gelus) for t in block.internal} | written
    # A norm output only data-movement reads (ViT's class-token Gather before the head):
    # quantized where a layer reads it, on the range of what that layer reads.
    for norm in norms:
        internal |= _selected_only(graph, norm.output)
    masked = []
    for softmax in softmaxes:
        scores = _scores(graph, softmax.input(0))
        internal |= scores
        found = _masked_scores(graph, softmax, scores)
        if found is not None:
            masked.append(found)
            # float where the scores are (no integer kernel reads it), back to where it is
            # made; a computed -inf fill could not even be observed
            internal |= set(found.mask_tensors)
    if norms or gelus or softmaxes:
        products = _linear_products(graph)
        internal |= products | _linear_biases(graph, products)
    internal -= keep | residual
    return TransformerBlocks(
        norms=tuple(b.name for b in norms),
        gelus=tuple(b.name for b in gelus),
        softmaxes=tuple(n.name for n in softmaxes),
        residual=frozenset(residual),
        float_stream=frozenset(_stream_copies(graph, residual | _joined_tokens(graph, residual), keep) - keep),
        float_tensors=frozenset(internal),
        norm_internals=frozenset(t for block in norms for t in block.internal) - keep - residual,
        softmax_outputs=frozenset(t for n in softmaxes for t in _attention_weights(graph, n.outputs[0])),
        masked_scores=tuple(masked),
    )
