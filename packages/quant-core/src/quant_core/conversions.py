"""Graph conversions that make a float model computable by an NPU, described once for
every backend: which op becomes what, with which constants, and where the rule comes from.

An NPU of the XINT8 / DPU family computes a few nonlinear functions only, and those with
its own integer constants (``docs/npu.md``). A conversion replaces what such a target
cannot run by what it can: an *approximation* (Sigmoid -> HardSigmoid, AMD Quark's rule;
its cost is measured, not assumed) or an *exact* rewrite (ConvTranspose -> zero insertion +
Conv). Three places apply the same rules:

- ``quant_onnx`` to the float ONNX graph before calibration (``QuantConfig.npu_conversions``,
  ``pipeline.preprocess.npu_conversions``);
- ``quant_torch_fx`` to the captured FX graph before calibration (``graph_passes``);
- ``quant_npu.legalize`` to an already calibrated QDQ graph, for the rules its target
  profile lists, unless a node is kept on the CPU.

:func:`find_matches` says which nodes each rule rewrites, on any graph that offers the
small :class:`ConversionView` interface; each backend then edits its own graph.

Example:
    >>> from quant_core.plan.graph import PlanGraph, PlanNode
    >>> nodes = [PlanNode("s", "Sigmoid", ("x",), ("g",)), PlanNode("m", "Mul", ("x", "g"), ("y",)),
    ...          PlanNode("h", "Sigmoid", ("y",), ("z",))]
    >>> view = float_view(PlanGraph(nodes, inputs=("x",), outputs=("z",)))
    >>> [(m.rule, m.node, m.related) for m in find_matches(view, ("silu", "sigmoid"))]
    [('silu', 's', ('m',)), ('sigmoid', 'h', ())]
    >>> RULES["sigmoid"].constants["alpha"] == 2731 / 16384
    True
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import attrs
import numpy as np

from quant_core.plan.graph import GraphView, PlanNode

HARD_SIGMOID_MULTIPLIER = 2731
HARD_SIGMOID_SHIFT = 14
DEVICE_HARD_SIGMOID_ALPHA = HARD_SIGMOID_MULTIPLIER / (1 << HARD_SIGMOID_SHIFT)
"""The device's 1/6: ``relu6(x + 3) * 2731 / 2**14`` (Vitis AI ``hard-sigmoid-fix``)."""
DEVICE_HARD_SIGMOID_BETA = 3 * HARD_SIGMOID_MULTIPLIER / (1 << HARD_SIGMOID_SHIFT)
"""``3 * 2731 / 2**14`` = 0.50006: the device's 1/2 (exact in float32, like the alpha)."""
NOMINAL_HARD_SIGMOID_ALPHA = 1.0 / 6.0
NOMINAL_HARD_SIGMOID_BETA = 0.5
GELU_SIGMOID_SCALE = 1.702
"""GELU(x) ~ x * sigmoid(1.702 x) (Hendrycks & Gimpel), then the sigmoid as HardSigmoid."""
TANH_SLOPE = 2.0 / 3.0
"""tanh(x) ~ 2 * hardsigmoid(2x) - 1 = clip(2x/3, -1, 1)."""
GLOBAL_POOL_MAX_ELEMENTS = 512
"""Larger global average pools run as two pools (Quark's ``SplitLargeKernelPool``)."""

_DEVICE_HARD_SIGMOID = {"alpha": DEVICE_HARD_SIGMOID_ALPHA, "beta": DEVICE_HARD_SIGMOID_BETA}
_QUARK = "AMD Quark ONNX, postprocess/simulation/simulate_dpu.py"


@attrs.frozen
class ConversionRule:
    """One conversion.

    Args:
        name: what configs and profiles call it.
        matches: what it rewrites.
        becomes: what that becomes.
        exact: ``True`` when the result computes the same function (up to float rounding).
        constants: the numbers the result uses.
        source: where the rule comes from.
        produces: the op types of the result.
        device_form: the result is the device's own arithmetic for an op it runs (its
            constants, its intermediate rounding), written so that onnxruntime computes it
            too: ``legalize`` applies it to ops the target runs.

    Example:
        >>> RULES["conv_transpose"].exact, RULES["silu"].exact
        (True, False)
    """

    name: str
    matches: str
    becomes: str
    exact: bool
    constants: Mapping[str, float] = attrs.field(factory=dict)
    source: str = ""
    produces: tuple[str, ...] = ()
    device_form: bool = False


RULES: Mapping[str, ConversionRule] = {
    rule.name: rule
    for rule in (
        ConversionRule(
            "silu",
            "x * Sigmoid(x) (SiLU / Swish)",
            "x * HardSigmoid(x) with the device's constants (the device's hard-swish form)",
            exact=False,
            constants=_DEVICE_HARD_SIGMOID,
            source=f"{_QUARK} (Sigmoid -> HardSigmoid) and refine.py AdjustShiftSwish; "
            "Vitis AI vai_q_tensorflow2 converts swish to hard-swish",
            produces=("HardSigmoid", "Mul"),
        ),
        ConversionRule(
            "sigmoid",
            "Sigmoid (other than inside x * Sigmoid(x))",
            "HardSigmoid with the device's constants",
            exact=False,
            constants=_DEVICE_HARD_SIGMOID,
            source=f"{_QUARK}: convert_sigmoid_to_hard_sigmoid, then convert_hard_sigmoid_to_dpu_version",
            produces=("HardSigmoid",),
        ),
        ConversionRule(
            "hard_sigmoid",
            "HardSigmoid(alpha=1/6, beta=1/2)",
            "HardSigmoid(alpha=2731/16384, beta=3*2731/16384): what the device computes",
            exact=True,
            constants=_DEVICE_HARD_SIGMOID,
            source=f"{_QUARK}: convert_hard_sigmoid_to_dpu_version; Vitis AI pytorch_nndct hardsigmoid "
            "(relu6(x + 3) * 2731 / 16384)",
            produces=("HardSigmoid",),
            device_form=True,
        ),
        ConversionRule(
            "hard_swish",
            "HardSwish",
            "x * HardSigmoid(x) with the device's constants, the hardsigmoid rounded to int8 in between",
            exact=True,
            constants=_DEVICE_HARD_SIGMOID,
            source="Vitis AI pytorch_nndct hardswish (hardsigmoid requantized at 2**-7, then x * it)",
            produces=("HardSigmoid", "Mul"),
            device_form=True,
        ),
        ConversionRule(
            "tanh",
            "Tanh",
            "Clip(x * 2/3, -1, 1) (= 2 * hardsigmoid(2x) - 1)",
            exact=False,
            constants={"slope": TANH_SLOPE, "min": -1.0, "max": 1.0},
            source="the hard-tanh family the DPU computes natively (Clip); slope fitted to tanh",
            produces=("Mul", "Clip"),
        ),
        ConversionRule(
            "gelu",
            "Gelu, or its erf form x * 0.5 * (1 + Erf(x / sqrt(2)))",
            "x * HardSigmoid(1.702 x) with the device's constants",
            exact=False,
            constants={"scale": GELU_SIGMOID_SCALE, **_DEVICE_HARD_SIGMOID},
            source="GELU(x) ~ x * sigmoid(1.702 x) (Hendrycks & Gimpel 2016), then Quark's Sigmoid rule",
            produces=("Mul", "HardSigmoid"),
        ),
        ConversionRule(
            "conv_transpose",
            "ConvTranspose (2-D, explicit pads)",
            "zero insertion (Unsqueeze, Pad, Reshape, Slice) + Conv with the flipped kernel",
            exact=True,
            source="the definition of a transposed convolution (the DPU's own implementation)",
            produces=("Unsqueeze", "Pad", "Reshape", "Slice", "Conv"),
        ),
        ConversionRule(
            "reduce_mean",
            "ReduceMean over axes 2 and 3, keeping them (a squeeze-excite's spatial mean)",
            "GlobalAveragePool",
            exact=True,
            source="AMD Quark ONNX, optimizations/optimize.py ConvertReduceMeanToGlobalAvgPool",
            produces=("GlobalAveragePool",),
        ),
        ConversionRule(
            "global_pool",
            f"GlobalAveragePool over more than {GLOBAL_POOL_MAX_ELEMENTS} elements",
            "AveragePool(kh1 x kw1, stride kh1 x kw1) + GlobalAveragePool, kh1 the largest factor of the "
            "height up to its square root (kw1 likewise): the device's two stages",
            exact=True,
            source="AMD Quark ONNX, optimizations/optimize.py split_large_kernel_pool (SplitLargeKernelPool)",
            produces=("AveragePool", "GlobalAveragePool"),
            device_form=True,
        ),
        ConversionRule(
            "split",
            "Split",
            "one Slice per output",
            exact=True,
            source="AMD Quark ONNX, optimizations/optimize.py ConvertSplitToSlice",
            produces=("Slice",),
        ),
    )
}
"""Every conversion, by name, in the order they are applied."""

NPU_CONVERSIONS = ("silu", "sigmoid", "hard_sigmoid")
"""What AMD Quark's NPU CNN flow converts (``SimulateDPU``), and what the ``xint8`` presets
and NPU profiles apply by default."""


def parse_conversions(value: Any, field: str = "npu_conversions") -> tuple[str, ...]:
    """Conversion names, checked and put in :data:`RULES` order (application order).

    Example:
        >>> parse_conversions(["sigmoid", "silu"])
        ('silu', 'sigmoid')
        >>> parse_conversions(["swish"])
        Traceback (most recent call last):
        ...
        ValueError: npu_conversions: 'swish' is not allowed; allowed: silu, sigmoid, hard_sigmoid, hard_swish, tanh, gelu, conv_transpose, reduce_mean, global_pool, split
    """
    items = (value,) if isinstance(value, str) else tuple(value)
    for item in items:
        if item not in RULES:
            raise ValueError(f"{field}: {item!r} is not allowed; allowed: {', '.join(RULES)}")
    duplicated = sorted({i for i in items if items.count(i) > 1})
    if duplicated:
        raise ValueError(f"{field}: {', '.join(duplicated)} listed twice; each conversion may appear once")
    return tuple(name for name in RULES if name in items)


def device_hard_sigmoid(x: np.ndarray) -> np.ndarray:
    """The device's hardsigmoid in float64: ``max(x + 3, 0) * 2731 / 2**14`` capped at 1
    (the device caps by saturating at an output position >= 7).

    Example:
        >>> device_hard_sigmoid(np.array([-4.0, 0.0, 3.0])).tolist()
        [0.0, 0.50006103515625, 1.0]
    """
    shifted = np.maximum(np.asarray(x, np.float64) + 3.0, 0.0)
    return np.asarray(np.minimum(shifted * DEVICE_HARD_SIGMOID_ALPHA, 1.0), np.float64)


def is_nominal_hard_sigmoid(alpha: float, beta: float) -> bool:
    """``x/6 + 1/2`` (torch's hardsigmoid; float32 attributes).

    Example:
        >>> is_nominal_hard_sigmoid(0.16666667, 0.5), is_nominal_hard_sigmoid(0.2, 0.5)
        (True, False)
    """
    return abs(alpha - NOMINAL_HARD_SIGMOID_ALPHA) < 1e-6 and abs(beta - NOMINAL_HARD_SIGMOID_BETA) < 1e-6


def is_device_hard_sigmoid(alpha: float, beta: float) -> bool:
    """The device's own constants (``2731 / 2**14``, ``3 * 2731 / 2**14``).

    Example:
        >>> is_device_hard_sigmoid(2731 / 16384, 8193 / 16384), is_device_hard_sigmoid(1 / 6, 0.5)
        (True, False)
    """
    return abs(alpha - DEVICE_HARD_SIGMOID_ALPHA) < 1e-7 and abs(beta - DEVICE_HARD_SIGMOID_BETA) < 1e-7


# ------------------------------------------------------------------------------ matching


class ConversionView(Protocol):
    """What :func:`find_matches` reads of a graph: compute nodes, who reads a value, and
    whether two tensor names hold the same value (in a QDQ graph two DequantizeLinear
    outputs of one integer tensor do)."""

    @property
    def nodes(self) -> Sequence[PlanNode]: ...

    def readers(self, tensor: str) -> Sequence[PlanNode]:
        """Compute nodes reading ``tensor``'s value."""
        ...

    def same_value(self, a: str, b: str) -> bool: ...

    def constant(self, tensor: str) -> np.ndarray | None: ...

    def producer(self, tensor: str) -> PlanNode | None:
        """The compute node whose output ``tensor`` holds."""
        ...


@attrs.frozen
class _FloatView:
    graph: GraphView

    @property
    def nodes(self) -> Sequence[PlanNode]:
        return self.graph.nodes

    def readers(self, tensor: str) -> Sequence[PlanNode]:
        return self.graph.consumers(tensor)

    def same_value(self, a: str, b: str) -> bool:
        return a == b

    def constant(self, tensor: str) -> np.ndarray | None:
        return self.graph.constant(tensor)

    def producer(self, tensor: str) -> PlanNode | None:
        return self.graph.producer(tensor)


def float_view(graph: GraphView) -> ConversionView:
    """A :class:`ConversionView` of a float graph (a tensor's readers are its consumers)."""
    return _FloatView(graph)


@attrs.frozen
class Match:
    """A node a rule rewrites, and the other nodes of its pattern (SiLU's Mul).

    Example:
        >>> Match("sigmoid", "head/sig").related
        ()
    """

    rule: str
    node: str
    related: tuple[str, ...] = ()


def silu_muls(view: ConversionView, sigmoid: PlanNode) -> tuple[str, ...] | None:
    """The Mul nodes of ``x * sigmoid(x)`` when every reader of the sigmoid is such a Mul."""
    if not sigmoid.inputs or not sigmoid.outputs:
        return None
    x = sigmoid.inputs[0]
    readers = view.readers(sigmoid.outputs[0])
    muls = []
    for reader in readers:
        if reader.op_type != "Mul" or len(reader.inputs) != 2:
            return None
        others = [t for t in reader.inputs if not view.same_value(t, sigmoid.outputs[0])]
        if len(others) != 1 or not view.same_value(others[0], x):
            return None
        muls.append(reader.name)
    return tuple(muls) or None


def _is_scalar(view: ConversionView, tensor: str, value: float) -> bool:
    """A one-element constant within 2% of ``value`` (an int8 constant of a QDQ graph holds
    sqrt(2) as 90/64)."""
    constant = view.constant(tensor)
    return constant is not None and constant.size == 1 and abs(float(constant.reshape(-1)[0]) - value) <= 0.02 * value


def _sole_reader(view: ConversionView, node: PlanNode, op_type: str) -> PlanNode | None:
    readers = view.readers(node.outputs[0]) if node.outputs else ()
    return readers[0] if len(readers) == 1 and readers[0].op_type == op_type else None


def erf_gelu(view: ConversionView, erf: PlanNode) -> tuple[str, tuple[str, ...]] | None:
    """``(x, the pattern's other nodes)`` when ``erf`` is GELU's
    ``x * 0.5 * (1 + Erf(x / sqrt(2)))`` as exporters write it (``Div`` by sqrt 2 or ``Mul``
    by its inverse; the halving before or after the product)."""
    scaled = view.producer(erf.input(0))
    if scaled is None or len(scaled.inputs) != 2:
        return None
    if (scaled.op_type == "Div" and _is_scalar(view, scaled.input(1), 2**0.5)) or (
        scaled.op_type == "Mul" and _is_scalar(view, scaled.input(1), 0.5**0.5)
    ):
        x = scaled.input(0)
    else:
        return None
    add = _sole_reader(view, erf, "Add")
    if add is None or not any(_is_scalar(view, t, 1.0) for t in add.inputs):
        return None
    product = _sole_reader(view, add, "Mul")
    if product is None:
        return None
    other = next((t for t in product.inputs if not view.same_value(t, add.outputs[0])), "")
    if view.same_value(other, x):  # (x * (1 + erf)) * 0.5
        half = _sole_reader(view, product, "Mul")
        if half is None or not any(_is_scalar(view, t, 0.5) for t in half.inputs):
            return None
        return x, (scaled.name, add.name, product.name, half.name)
    halved = view.producer(other)  # (x * 0.5) * (1 + erf)
    if halved is None or halved.op_type != "Mul" or not any(view.same_value(t, x) for t in halved.inputs):
        return None
    if not any(_is_scalar(view, t, 0.5) for t in halved.inputs):
        return None
    return x, (scaled.name, add.name, halved.name, product.name)


def _spatial_mean(view: ConversionView, node: PlanNode) -> bool:
    axes = node.attr("axes")
    if axes is None and node.input(1):
        constant = view.constant(node.input(1))
        axes = None if constant is None else constant.reshape(-1).tolist()
    return axes is not None and sorted(int(a) for a in axes) == [2, 3] and int(node.attr("keepdims", 1)) == 1


def _conv_transpose_convertible(view: ConversionView, node: PlanNode) -> bool:
    weight = view.constant(node.input(1))
    auto_pad = str(node.attr("auto_pad", "NOTSET"))
    return weight is not None and weight.ndim == 4 and auto_pad == "NOTSET" and node.attr("output_shape") is None


def _matches(view: ConversionView, node: PlanNode, rule: str) -> Match | None:
    op = node.op_type
    if not node.standard:
        return None
    if rule in ("silu", "sigmoid") and op == "Sigmoid":
        muls = silu_muls(view, node)
        if (rule == "silu") == (muls is not None):
            return Match(rule, node.name, muls or ())
        return None
    if rule == "hard_sigmoid" and op == "HardSigmoid":
        alpha, beta = float(node.attr("alpha", 0.2)), float(node.attr("beta", 0.5))
        return Match(rule, node.name) if is_nominal_hard_sigmoid(alpha, beta) else None
    if rule == "reduce_mean" and op == "ReduceMean":
        return Match(rule, node.name) if _spatial_mean(view, node) else None
    simple = {
        "hard_swish": "HardSwish", "tanh": "Tanh", "gelu": "Gelu", "split": "Split",
        "global_pool": "GlobalAveragePool",
    }  # fmt: skip
    if simple.get(rule) == op:
        return Match(rule, node.name)
    if rule == "gelu" and op == "Erf":
        found = erf_gelu(view, node)
        return None if found is None else Match(rule, node.name, found[1])
    if rule == "conv_transpose" and op == "ConvTranspose" and _conv_transpose_convertible(view, node):
        return Match(rule, node.name)
    return None


def find_matches(view: ConversionView, rules: Iterable[str]) -> list[Match]:
    """Every node the ``rules`` rewrite (in :data:`RULES` order, then graph order; a node
    is matched by one rule at most). See the module example."""
    names = parse_conversions(tuple(rules), "rules")
    found: list[Match] = []
    taken: set[str] = set()
    for rule in names:
        for node in view.nodes:
            if node.name in taken:
                continue
            match = _matches(view, node, rule)
            if match is not None and not taken.intersection(match.related):
                found.append(match)
                taken.update((node.name, *match.related))
    return found


def pool_split(size: int) -> tuple[int, int]:
    """``(first, second)`` with ``first * second == size``: ``first`` the largest factor up
    to ``sqrt(size)`` (Quark's ``_get_factors``; a prime size gives ``(1, size)``).

    Example:
        >>> pool_split(64), pool_split(32), pool_split(7)
        ((8, 8), (4, 8), (1, 7))
    """
    first = int(size**0.5)
    while first > 1 and size % first:
        first -= 1
    return max(first, 1), size // max(first, 1)


# ------------------------------------------------------------------------------ ConvTranspose


@attrs.frozen
class ConvTransposeAsConv:
    """A 2-D ConvTranspose as zero insertion + Conv (exact).

    The input ``[N, C, H, W]`` gets ``stride - 1`` zeros after every pixel (``H * s`` rows:
    the last ``s - 1`` are the trailing zeros of the last pixel), is cropped
    (``crop_begin``/``crop_end``, rows and columns) where the transposed convolution's
    padding exceeds the kernel's reach, and a stride-1 Conv with the flipped, transposed
    kernel and ``pads`` computes the result.

    Example:
        >>> w = np.arange(8, dtype=np.float32).reshape(1, 2, 2, 2)  # [Cin, Cout, kh, kw]
        >>> form = ConvTransposeAsConv.from_attributes({"strides": (2, 2)}, w.shape)
        >>> form.pads, form.crop_end, conv_weight(w, 1).shape
        ((1, 1, 0, 0), (0, 0), (2, 1, 2, 2))
    """

    strides: tuple[int, int]
    dilations: tuple[int, int]
    group: int
    pads: tuple[int, int, int, int]
    crop_begin: tuple[int, int]
    crop_end: tuple[int, int]

    @classmethod
    def from_attributes(cls, attributes: Mapping[str, Any], weight_shape: Sequence[int]) -> ConvTransposeAsConv:
        kernel = tuple(int(k) for k in weight_shape[2:])
        strides = tuple(int(s) for s in attributes.get("strides", (1, 1)))
        dilations = tuple(int(d) for d in attributes.get("dilations", (1, 1)))
        pads = tuple(int(p) for p in attributes.get("pads", (0, 0, 0, 0)))
        extra = tuple(int(p) for p in attributes.get("output_padding", (0, 0)))
        begin, end, crop_begin, crop_end = [], [], [], []
        for axis in range(2):
            reach = dilations[axis] * (kernel[axis] - 1)
            first = reach - pads[axis]
            last = reach - pads[axis + 2] + extra[axis] - (strides[axis] - 1)  # the trailing zeros count
            begin.append(max(first, 0))
            crop_begin.append(max(-first, 0))
            end.append(max(last, 0))
            crop_end.append(max(-last, 0))
        return cls(
            strides=(strides[0], strides[1]),
            dilations=(dilations[0], dilations[1]),
            group=int(attributes.get("group", 1)),
            pads=(begin[0], begin[1], end[0], end[1]),
            crop_begin=(crop_begin[0], crop_begin[1]),
            crop_end=(crop_end[0], crop_end[1]),
        )


def conv_weight(weight: np.ndarray, group: int) -> np.ndarray:
    """A ConvTranspose weight ``[Cin, Cout/g, kh, kw]`` as the equivalent Conv's
    ``[Cout, Cin/g, kh, kw]``: per group transposed, spatially flipped (same dtype: integer
    codes stay codes)."""
    cin, cout_g = weight.shape[:2]
    cin_g = cin // group
    grouped = weight.reshape(group, cin_g, cout_g, *weight.shape[2:])
    moved = np.swapaxes(grouped, 1, 2)[..., ::-1, ::-1]
    return np.ascontiguousarray(moved.reshape(group * cout_g, cin_g, *weight.shape[2:]))


def zero_insert(x: np.ndarray, strides: tuple[int, int]) -> np.ndarray:
    """``stride - 1`` zeros after every pixel of an ``[N, C, H, W]`` array (reference for
    the graph edits: Unsqueeze, Pad, Reshape).

    Example:
        >>> zero_insert(np.array([[[[1, 2]]]]), (1, 2)).tolist()
        [[[[1, 0, 2, 0]]]]
    """
    n, c, h, w = x.shape
    sh, sw = strides
    out = np.zeros((n, c, h, sh, w, sw), x.dtype)
    out[:, :, :, 0, :, 0] = x
    return out.reshape(n, c, h * sh, w * sw)
