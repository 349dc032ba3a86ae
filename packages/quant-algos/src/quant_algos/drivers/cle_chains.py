"""Find cross-layer-equalization chains in a float graph, through the planner's graph
protocol (:class:`quant_core.plan.GraphView`), so every backend finds the same chains.

A link ``A -> B`` joins two weighted layers when A's output reaches B's data input
through single-consumer tensors and ops that commute with a positive per-channel
scale (Relu, LeakyRelu, PRelu, Clip(0, inf), MaxPool, AveragePool, a zero Pad), plus
Clip(0, 6) when it may be replaced by Relu. A and B are both Conv (NCHW channels) or
both Gemm/MatMul (``[.., C]``), and their weights (and biases) are constants that no
other node reads and the backend can rewrite. Links ``A -> depthwise -> C`` become
triples, the rest pairs.

Example:
    >>> import numpy as np
    >>> from quant_core.plan import PlanGraph, PlanNode
    >>> weights = {"w1": np.ones((4, 3, 1, 1), np.float32), "w2": np.ones((2, 4, 1, 1), np.float32)}
    >>> nodes = [PlanNode("c1", "Conv", ("x", "w1"), ("a",)), PlanNode("r", "Relu", ("a",), ("b",)),
    ...          PlanNode("c2", "Conv", ("b", "w2"), ("y",))]
    >>> found = find_chains(PlanGraph(nodes, inputs=("x",), outputs=("y",), constant=weights.get), replace_relu6=True)
    >>> found.chains, [link.activations for link in found.links.values()]
    ([('c1', 'c2')], [('r',)])
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import attrs
import numpy as np

from quant_algos.layer import Layer
from quant_core.errors import ModelError
from quant_core.plan import (
    CHANNEL_WISE_POOLS,
    HOMOGENEOUS_ACTIVATIONS,
    GraphView,
    PlanNode,
    activation_kind,
    pads_keep_channels,
    sole_reader,
    weight_is_transposed,
)

# Ops across which high-bias absorption can move a constant:
# relu(x - c) + c == relu(x) for x >= c; max pool commutes with a constant shift, and an
# average pool does where it reads no padding (:func:`_adds_zeros`).
_ABSORBABLE = ("Relu", "MaxPool", "AveragePool")

Writable = Callable[[str], bool]
"""Whether the backend can replace the constant tensor of this name (ONNX: an initializer)."""


@attrs.frozen(eq=False)
class LayerRef:
    """A weighted node whose weight CLE may rescale.

    Attributes:
        node: the Conv/Gemm/MatMul node.
        weight_name, bias_name: constant tensor names (bias_name ``None`` when absent).
        transposed: the weight is stored ``[in, out]`` (MatMul, Gemm with transB=0).
        layer: weight and bias in quant_algos' ``[out, in, ...]`` layout.

    Example:
        >>> ref = LayerRef(PlanNode("fc", "Gemm", ("x", "w"), ("y",)), "w", None, True, Layer(np.ones((2, 3))))
        >>> ref.family
        'dense'
    """

    node: PlanNode
    weight_name: str
    bias_name: str | None
    transposed: bool
    layer: Layer

    @property
    def family(self) -> str:
        return "conv" if self.node.op_type == "Conv" else "dense"

    def stored_weight(self, weight: np.ndarray) -> np.ndarray:
        """A ``[out, in, ...]`` weight back in the layout the graph stores."""
        return weight.T if self.transposed else weight


@attrs.frozen
class Link:
    """Path from one layer's output to the next layer's input.

    Attributes:
        first, second: layer node names.
        activations: nodes between them (in order).
        relu6: the Clip(0, 6) nodes among them (to be replaced by Relu).
        absorbable: a constant can be moved across the path (high-bias absorption).
    """

    first: str
    second: str
    activations: tuple[str, ...]
    relu6: tuple[str, ...]
    absorbable: bool


@attrs.frozen(eq=False)
class ChainSearch:
    """Result of :func:`find_chains`: the layers by node name, the links by first
    layer, and the chains (pairs and depthwise triples) to equalize."""

    layers: dict[str, LayerRef]
    links: dict[str, Link]
    chains: list[tuple[str, ...]]


def _owned_constant(graph: GraphView, name: str, writable: Writable) -> np.ndarray | None:
    value = graph.constant(name)
    # A weight that is also a graph output is read by the model's user: rescaling it would
    # change that output.
    if value is None or not writable(name) or len(graph.consumers(name)) != 1 or graph.is_graph_output(name):
        return None
    return value


def layer_ref(node: PlanNode, graph: GraphView, writable: Writable) -> LayerRef | None:
    """The node as a rescalable layer, or ``None`` (not Conv/Gemm/MatMul, weight not an
    owned writable constant, unsupported Gemm attributes)."""
    if not node.standard or node.op_type not in ("Conv", "Gemm", "MatMul") or len(node.inputs) < 2:
        return None
    weight_name = node.inputs[1]
    weight = _owned_constant(graph, weight_name, writable)
    if weight is None or weight.dtype != np.float32 or weight.ndim < 2:
        return None
    bias_name = node.input(2) or None
    bias = None
    if bias_name is not None:
        bias = _owned_constant(graph, bias_name, writable)
        if bias is None:
            return None
    groups = int(node.attr("group", 1)) if node.op_type == "Conv" else 1
    transposed = False
    if node.op_type != "Conv":
        if weight.ndim != 2:
            return None
        if node.op_type == "Gemm" and (
            node.attr("transA", 0) or node.attr("alpha", 1.0) != 1.0 or node.attr("beta", 1.0) != 1.0
        ):
            return None
        transposed = weight_is_transposed(node)
        if transposed:
            weight = weight.T
    if bias is not None and bias.shape != (weight.shape[0],):
        return None
    try:
        layer = Layer(weight, bias, groups=groups)
    except ModelError:  # a layout CLE does not handle: the chain is left alone
        return None
    return LayerRef(node, weight_name, bias_name, transposed, layer)


def _zero_pad(node: PlanNode, graph: GraphView) -> bool:
    """A Pad that adds zeros around the spatial axes only: the channels keep their order,
    so a channel's scale reaches the next layer's same input channel. Padding or cropping
    the batch or channel axis (``pads`` not a constant, or non-zero there) would shift them."""
    if node.attr("mode", "constant") != "constant" or node.attr("value", 0.0) != 0.0:
        return False
    if node.input(2):
        value = graph.constant(node.input(2))
        if value is None or not bool(np.all(np.asarray(value) == 0)):
            return False
    pads = graph.constant(node.input(1)) if node.input(1) else node.attr("pads", None)
    if pads is None or node.input(3):  # opset 18's axes input: which axes the pads name varies
        return False
    return pads_keep_channels(pads)


def _adds_zeros(node: PlanNode) -> bool:
    """Whether ``node`` (a convolution, pool or Pad) reads zeros past the input's borders.
    High-bias absorption moves a constant ``c`` out of a tensor and ``W2 c`` into the next
    layer's bias, which is exact only where that layer reads no padding: at a zero-padded
    border the padding never held ``c``. On small maps the borders are much of the output
    (a 3x3 conv over 8x8 maps: 30.2 -> 14.2 dB at ``int8_cnn_cle``)."""
    if node.op_type == "Pad":
        return True
    if node.op_type not in ("Conv", "AveragePool"):
        return False
    if str(node.attr("auto_pad", "NOTSET")) not in ("NOTSET", "VALID"):
        return True
    return any(int(p) != 0 for p in node.attr("pads", ()) or ())


def _takes_absorbed_bias(layer: LayerRef) -> bool:
    """Whether the second layer of a link can take high-bias absorption's ``W2 c``: it
    reads no zero padding, and has a bias or an input for one (a MatMul has none)."""
    if _adds_zeros(layer.node):
        return False
    return layer.bias_name is not None or layer.node.op_type != "MatMul"


def _may_replace(node: PlanNode, replace_relu6: bool | Collection[str]) -> bool:
    return replace_relu6 if isinstance(replace_relu6, bool) else node.name in replace_relu6


def _follow(
    ref: LayerRef, graph: GraphView, layers: dict[str, LayerRef], replace_relu6: bool | Collection[str]
) -> tuple[str, tuple[str, ...], tuple[str, ...], bool] | None:
    """The next layer reached from ``ref`` through commuting single-consumer ops."""
    tensor = ref.node.outputs[0]
    passed: list[str] = []
    relu6: list[str] = []
    absorbable = True
    while True:
        node = sole_reader(graph, tensor)
        if node is None or not node.standard or node.input(0) != tensor:
            return None
        if node.name in layers:
            nxt = layers[node.name]
            if nxt.family != ref.family or any(i == tensor for i in nxt.node.inputs[1:]):
                return None
            return node.name, tuple(passed), tuple(relu6), absorbable and _takes_absorbed_bias(nxt)
        kind = activation_kind(node, graph.constant)
        if kind == "relu6" and _may_replace(node, replace_relu6):
            relu6.append(node.name)
        elif kind == "relu" or (node.op_type in CHANNEL_WISE_POOLS and ref.family == "conv"):
            pass
        elif node.op_type in HOMOGENEOUS_ACTIVATIONS:
            absorbable = False
        elif node.op_type == "Pad" and ref.family == "conv" and _zero_pad(node, graph):
            pass
        else:
            return None
        if (node.op_type not in _ABSORBABLE and kind is None) or _adds_zeros(node):
            absorbable = False
        if len(node.outputs) != 1 or not node.name:
            return None
        passed.append(node.name)
        tensor = node.outputs[0]


def _always_writable(_tensor: str) -> bool:
    return True


def find_chains(
    graph: GraphView, replace_relu6: bool | Collection[str], writable: Writable | None = None
) -> ChainSearch:
    """Layers, links and chains of ``graph`` (see the module docstring); chains come in
    topological order and every link belongs to exactly one chain. ``replace_relu6``:
    whether chains may pass Clip(0, 6) nodes (to be replaced by Relu), or the names of
    those that may. ``writable``: which constants the backend can rewrite (default all)."""
    can_write = writable or _always_writable
    layers: dict[str, LayerRef] = {}
    for node in graph.nodes:
        ref = layer_ref(node, graph, can_write) if node.name else None
        if ref is not None:
            layers[node.name] = ref
    links: dict[str, Link] = {}
    for name, ref in layers.items():
        found = _follow(ref, graph, layers, replace_relu6)
        if found is not None:
            second, passed, relu6, absorbable = found
            if layers[second].layer.in_channels == ref.layer.out_channels:
                links[name] = Link(name, second, passed, relu6, absorbable)
    chains: list[tuple[str, ...]] = []
    used: set[str] = set()  # first layers of links already in a chain
    for node in graph.nodes:
        first = node.name
        if first not in links or first in used:
            continue
        middle = links[first].second
        if layers[middle].layer.is_depthwise and middle in links:
            chains.append((first, middle, links[middle].second))
            used.update((first, middle))
        else:
            chains.append((first, middle))
            used.add(first)
    return ChainSearch(layers, links, chains)
