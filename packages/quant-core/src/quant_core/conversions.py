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

:func:`quant_core.plan.conversions.find_matches` says which nodes each rule rewrites, on
the planner's view of any of those graphs; each backend then edits its own graph (ONNX:
:mod:`quant_core.onnx_qdq.conversions`). This module imports nothing of the planner: a
:class:`~quant_core.config.QuantConfig` checks its ``npu_conversions`` against :data:`RULES`.

Example:
    >>> RULES["sigmoid"].constants["alpha"] == 2731 / 16384
    True
    >>> parse_conversions(["silu", "tanh"])
    ('silu', 'tanh')
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from quant_core.errors import ConfigError, listed

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
SIGMOID_TANH_SCALE = 0.5
SIGMOID_TANH_OFFSET = 0.5
"""sigmoid(x) = 0.5 * tanh(0.5 x) + 0.5: both multiplications are one fix position."""
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
            "sigmoid_tanh",
            "Sigmoid (standalone or inside x * Sigmoid(x))",
            "0.5 * Tanh(0.5 x) + 0.5 (the same function: the NPU runs Tanh)",
            exact=True,
            constants={"scale": SIGMOID_TANH_SCALE, "offset": SIGMOID_TANH_OFFSET},
            source="sigmoid(x) = (1 + tanh(x / 2)) / 2; Tanh is in the Ryzen AI XINT8 operator table "
            "(the device's Tanh implementation is not public: the simulator rounds the exact function once)",
            produces=("Mul", "Tanh", "Mul", "Add"),
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
        quant_core.errors.ConfigError: npu_conversions: 'swish' is not allowed; allowed: silu, sigmoid, sigmoid_tanh, hard_sigmoid, hard_swish, tanh, gelu, conv_transpose, reduce_mean, global_pool, split
    """
    items = listed(value, field, f"a list of {', '.join(RULES)}")
    for item in items:
        if not isinstance(item, str) or item not in RULES:  # a list inside the list is unhashable
            raise ConfigError(f"{field}: {item!r} is not allowed; allowed: {', '.join(RULES)}")
    duplicated = sorted({i for i in items if items.count(i) > 1})
    if duplicated:
        raise ConfigError(f"{field}: {', '.join(duplicated)} listed twice; each conversion may appear once")
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
