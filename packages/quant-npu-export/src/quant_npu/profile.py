"""What an NPU target accepts, as a frozen, JSON-loadable profile.

The default profile (``xint8``) follows the integer rules of AMD's Ryzen AI NPU as AMD
Quark's NPU passes state them (see ``docs/npu.md``). Every rule on which public sources
disagree is a field, so a target that differs is one JSON file away::

    {"base": "xint8", "name": "my_npu", "weight_qmin": -128, "shift_bias_max": 16}

Example:
    >>> p = NPUProfile()
    >>> p.name, p.weight_qmin, p.shift_cut_range, p.bias_format.value
    ('xint8', -127, (0, 16), 'int8_own_position')
    >>> NPUProfile.from_dict({"base": "xint8", "name": "t", "shift_bias_max": 16}).shift_bias_max
    16
    >>> NPUProfile.from_dict({"shift_cut": [0, 16]})
    Traceback (most recent call last):
    ...
    quant_core.errors.ConfigError: profile field 'shift_cut' is not known; allowed: base, name, description, ...
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

from quant_core.conversions import (
    GLOBAL_POOL_MAX_ELEMENTS,
    HARD_SIGMOID_MULTIPLIER,
    HARD_SIGMOID_SHIFT,
    NPU_CONVERSIONS,
    parse_conversions,
)
from quant_core.errors import ConfigError
from quant_core.spec import RoundMode, parse_enum


class BiasFormat(enum.Enum):
    """How a Conv/Gemm bias is stored on the device."""

    INT8_OWN_POSITION = "int8_own_position"
    """int8 at its own fix position, shifted into the accumulator (Quark's XINT8 code, Vitis AI)."""
    INT32_INPUT_PLUS_WEIGHT = "int32_input_plus_weight"
    """int32 at ``ipos + wpos`` (Quark's docs table; what onnxruntime's integer kernels fuse)."""


Range = tuple[int, int]


def _range(value: Any) -> Range:
    lo, hi = (int(v) for v in value)
    return lo, hi


def _names(value: Iterable[str]) -> frozenset[str]:
    if isinstance(value, str):
        raise ConfigError(f"expected a list of op types, got the string {value!r}")
    return frozenset(str(v) for v in value)


def _fusions(value: Mapping[str, Iterable[str]]) -> Mapping[str, frozenset[str]]:
    return {str(k): _names(v) for k, v in dict(value).items()}


def _factors(value: Mapping[str, Iterable[int]]) -> Mapping[str, tuple[int, int]]:
    factors = {}
    for key, pair in dict(value).items():
        kh, _, kw = str(key).partition("x")
        if not (kh.isdigit() and kw.isdigit()):
            raise ConfigError(f"average_pool_factors: key {key!r} is not allowed; allowed: 'KHxKW' such as '3x3'")
        n, m = (int(v) for v in pair)
        factors[f"{int(kh)}x{int(kw)}"] = (n, m)
    return factors


def _conversions(value: Any) -> tuple[str, ...]:
    return parse_conversions(value, "conversions")


def _activation_rounding(value: Any) -> RoundMode:
    return parse_enum(RoundMode, value, "activation_rounding")


def _weight_rounding(value: Any) -> RoundMode:
    return parse_enum(RoundMode, value, "weight_rounding")


def _bias_rounding(value: Any) -> RoundMode:
    return parse_enum(RoundMode, value, "bias_rounding")


_XINT8_OPS = frozenset(
    {
        "Conv",
        "Gemm",
        "MatMul",
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Concat",
        "MaxPool",
        "AveragePool",
        "GlobalAveragePool",
        "LeakyRelu",
        "Relu",
        "Clip",
        "HardSigmoid",
        "HardSwish",
        "ConvTranspose",
        "Resize",
        "Slice",
        "Pad",
        "Softmax",
        "Tanh",
    }
)
_LAYOUT_OPS = frozenset(
    {"Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Identity", "DepthToSpace", "SpaceToDepth"}
)
_ACTIVATIONS = frozenset({"Relu", "Clip", "LeakyRelu"})
_FUSIONS: Mapping[str, frozenset[str]] = {
    "Conv": _ACTIVATIONS,
    "ConvTranspose": _ACTIVATIONS,
    "Gemm": _ACTIVATIONS,
    "MatMul": _ACTIVATIONS,
    "Add": frozenset({"Relu"}),
}
_SHARED_POSITION_OPS = frozenset({"Concat", "MaxPool", "AveragePool", "GlobalAveragePool", "Pad", "Slice"})
_AVERAGE_POOL_FACTORS = {"3x3": (7, 6), "5x5": (10, 8), "6x6": (7, 8), "7x7": (21, 10), "14x14": (21, 12)}


@attrs.frozen
class NPUProfile:
    """Integer rules of an XINT8-class NPU. Positions: a tensor at fix position ``p``
    holds integers ``q`` meaning ``q * 2**-p``.

    Args:
        name, description: what the target is.
        ops: compute op types the NPU runs.
        layout_ops: ops that only move data; their input and output share a position.
        fusions: producer op -> activations the NPU applies to its unrounded result.
        shared_position_ops: ops whose inputs and output take one position (the minimum).
        resize_modes: Resize interpolation modes the NPU runs (``nearest``, ``linear``); the
            output keeps the input's position.
        resize_scale_range: allowed upsampling factor of each spatial axis (integers only).
        resize_weight_bits: a linear Resize's interpolation weights are multiples of
            ``2**-bits`` (exact for power-of-two factors up to ``2**(bits - 1)``).
        add_inputs_share_position: Add/Sub inputs must share one position (some DPUs).
        activation_bits: width of activations (symmetric, signed).
        accept_uint8_offset: uint8 at zero point 128 counts as int8 (the x86 QDQ encoding).
        weight_qmin: lowest weight code: -127 (Quark) or -128 (Vitis AI).
        per_channel_weights: whether weights may have one position per output channel.
        bias_format: see :class:`BiasFormat`.
        activation_rounding: the device's rounding of every requantization (``device`` mode).
        weight_rounding, bias_rounding: how legalisation requantizes parameters.
        shift_cut_range: allowed ``wpos + ipos - opos`` of Conv/Gemm/MatMul.
        shift_bias_max: upper bound of ``wpos + ipos - bpos`` (older DPUs: 16).
        bias_accumulator_bits: the lower bound of shift_bias is ``min(0, shift_cut + 8 - bits)``.
        leaky_relu_shift_bias_min: lower bound of shift_bias when a LeakyRelu is fused (None: no rule).
        add_shift_read_max: largest ``ipos_i - min(ipos)`` of Add/Sub.
        add_shift_write_range: allowed ``min(ipos) - opos`` of Add/Sub.
        mul_shift_range: allowed ``sum(ipos) - opos`` of Mul.
        swish_shift_range: the same for ``x * hardsigmoid(x)``.
        average_pool_factors: ``"KHxKW" -> (N, M)``: the device averages as ``sum * N / 2**M``.
        global_pool_max_elements: larger global pools run in two stages (rows, then columns).
        leaky_relu_alpha_bits: LeakyRelu's alpha becomes ``round(alpha * 2**bits) / 2**bits``.
        hard_sigmoid_multiplier, hard_sigmoid_shift: HardSigmoid is ``relu6(x + 3) * m / 2**shift``.
        hard_sigmoid_input_range, hard_sigmoid_output_min, hard_sigmoid_shift_range: position
            rules of HardSigmoid (shift = ``shift + ipos - opos``).
        hard_swish_sigmoid_position: position of the rounded hardsigmoid inside HardSwish.
        conv_kernel_range, conv_stride_range, depthwise_kernel_range, depthwise_stride_range,
            pool_kernel_max: engine limits.
        conv_transpose_kernel_range, conv_transpose_stride_range: ConvTranspose engine limits.
        conv_transpose_pad_min: lower bound of the device's own ConvTranspose padding
            (``dilation * (kernel - 1) - pad``, at most ``kernel - 1``).
        conversions: :mod:`quant_core.conversions` rules ``legalize`` applies to nodes the
            target cannot run as they are (``hard_sigmoid``: to every nominal HardSigmoid,
            so the QDQ model computes the device's constants).

    Example:
        >>> NPUProfile(weight_qmin=-100)
        Traceback (most recent call last):
        ...
        quant_core.errors.ConfigError: weight_qmin: -100 is not allowed; allowed: -127 (Quark), -128 (Vitis AI)
    """

    name: str = "xint8"
    description: str = "AMD Ryzen AI NPU XINT8 rules as AMD Quark's NPU passes state them"
    ops: frozenset[str] = attrs.field(default=_XINT8_OPS, converter=_names)
    layout_ops: frozenset[str] = attrs.field(default=_LAYOUT_OPS, converter=_names)
    fusions: Mapping[str, frozenset[str]] = attrs.field(factory=lambda: dict(_FUSIONS), converter=_fusions)
    shared_position_ops: frozenset[str] = attrs.field(default=_SHARED_POSITION_OPS, converter=_names)
    resize_modes: frozenset[str] = attrs.field(default=frozenset({"nearest", "linear"}), converter=_names)
    resize_scale_range: Range = attrs.field(default=(1, 8), converter=_range)
    resize_weight_bits: int = 8
    add_inputs_share_position: bool = False
    activation_bits: int = 8
    accept_uint8_offset: bool = True
    weight_qmin: int = attrs.field(default=-127)
    per_channel_weights: bool = False
    bias_format: BiasFormat = attrs.field(
        default=BiasFormat.INT8_OWN_POSITION, converter=lambda v: parse_enum(BiasFormat, v, "bias_format")
    )
    activation_rounding: RoundMode = attrs.field(default=RoundMode.HALF_UP, converter=_activation_rounding)
    weight_rounding: RoundMode = attrs.field(default=RoundMode.HALF_EVEN, converter=_weight_rounding)
    bias_rounding: RoundMode = attrs.field(default=RoundMode.HALF_EVEN, converter=_bias_rounding)
    shift_cut_range: Range = attrs.field(default=(0, 16), converter=_range)
    shift_bias_max: int = 15
    bias_accumulator_bits: int = 24
    leaky_relu_shift_bias_min: int | None = 0
    add_shift_read_max: int = 7
    add_shift_write_range: Range = attrs.field(default=(-7, 25), converter=_range)
    mul_shift_range: Range = attrs.field(default=(0, 32), converter=_range)
    swish_shift_range: Range = attrs.field(default=(0, 15), converter=_range)
    average_pool_factors: Mapping[str, tuple[int, int]] = attrs.field(
        factory=lambda: dict(_AVERAGE_POOL_FACTORS), converter=_factors
    )
    global_pool_max_elements: int = GLOBAL_POOL_MAX_ELEMENTS
    leaky_relu_alpha_bits: int = 8
    hard_sigmoid_multiplier: int = HARD_SIGMOID_MULTIPLIER
    hard_sigmoid_shift: int = HARD_SIGMOID_SHIFT
    hard_sigmoid_input_range: Range = attrs.field(default=(0, 15), converter=_range)
    hard_sigmoid_output_min: int = 7
    hard_sigmoid_shift_range: Range = attrs.field(default=(0, 31), converter=_range)
    hard_swish_sigmoid_position: int = 7
    conv_kernel_range: Range = attrs.field(default=(1, 8), converter=_range)
    conv_stride_range: Range = attrs.field(default=(1, 2), converter=_range)
    depthwise_kernel_range: Range = attrs.field(default=(1, 9), converter=_range)
    depthwise_stride_range: Range = attrs.field(default=(1, 2), converter=_range)
    pool_kernel_max: int = 32
    conv_transpose_kernel_range: Range = attrs.field(default=(1, 16), converter=_range)
    conv_transpose_stride_range: Range = attrs.field(default=(1, 16), converter=_range)
    conv_transpose_pad_min: int = 1
    conversions: tuple[str, ...] = attrs.field(
        default=(*NPU_CONVERSIONS, "hard_swish", "conv_transpose", "reduce_mean", "global_pool", "split"),
        converter=_conversions,
    )

    @weight_qmin.validator
    def _check_weight_qmin(self, _attribute: object, value: int) -> None:
        if value not in (-127, -128):
            raise ConfigError(f"weight_qmin: {value!r} is not allowed; allowed: -127 (Quark), -128 (Vitis AI)")

    def __attrs_post_init__(self) -> None:
        for field in attrs.fields(type(self)):
            value = getattr(self, field.name)
            expected = {"int": int, "bool": bool, "str": str}.get(str(field.type))
            if expected is not None and (type(value) is not expected):
                raise ConfigError(f"{field.name}: {value!r} is not allowed; allowed: a {field.type}")
            if field.converter is _range and value[0] > value[1]:
                raise ConfigError(f"{field.name}: {list(value)} is not allowed; allowed: [lo, hi] with lo <= hi")
        if self.activation_bits not in (8, 16):
            raise ConfigError(f"activation_bits: {self.activation_bits!r} is not allowed; allowed: 8, 16")
        unknown = sorted(self.resize_modes - {"nearest", "linear"})
        if unknown:
            raise ConfigError(f"resize_modes: {unknown[0]!r} is not allowed; allowed: nearest, linear")
        for name in ("global_pool_max_elements", "pool_kernel_max", "hard_sigmoid_multiplier", "resize_weight_bits"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: {getattr(self, name)!r} is not allowed; allowed: an integer >= 1")

    # ------------------------------------------------------------------ queries
    @property
    def accepted_ops(self) -> frozenset[str]:
        """Compute and layout ops together: everything ``check`` accepts."""
        return self.ops | self.layout_ops

    def rounding_for(self, mode: str | RoundMode) -> RoundMode:
        """``"device"`` -> the profile's activation rounding, ``"onnx"`` -> half-even; a
        :class:`RoundMode` or its name is returned as is.

        Example:
            >>> NPUProfile().rounding_for("device"), NPUProfile().rounding_for("onnx")
            (<RoundMode.HALF_UP: 'half_up'>, <RoundMode.HALF_EVEN: 'half_even'>)
        """
        if mode == "device":
            return self.activation_rounding
        if mode == "onnx":
            return RoundMode.HALF_EVEN
        allowed = "device, onnx, " + ", ".join(m.value for m in RoundMode)
        if isinstance(mode, RoundMode):
            return mode
        try:
            return RoundMode(mode)
        except ValueError:
            raise ConfigError(f"rounding: {mode!r} is not allowed; allowed: {allowed}") from None

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data; ``NPUProfile.from_dict(p.to_dict()) == p``.

        Example:
            >>> NPUProfile.from_dict(NPUProfile().to_dict()) == NPUProfile()
            True
        """
        data: dict[str, Any] = {}
        for field in attrs.fields(type(self)):
            value = getattr(self, field.name)
            if isinstance(value, enum.Enum):
                value = value.value
            elif isinstance(value, frozenset):
                value = sorted(value)
            elif isinstance(value, tuple):
                value = list(value)
            elif field.name == "fusions":
                value = {k: sorted(v) for k, v in sorted(value.items())}
            elif field.name == "average_pool_factors":
                value = {k: list(v) for k, v in value.items()}
            data[field.name] = value
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NPUProfile:
        """A profile from JSON data; ``"base"`` names a built-in profile whose fields the
        others override (default: ``xint8``). Unknown fields are errors."""
        data = dict(data)
        base = data.pop("base", "xint8")
        allowed = ["base", *(f.name for f in attrs.fields(cls))]
        for key in data:
            if key not in allowed:
                raise ConfigError(f"profile field {key!r} is not known; allowed: {', '.join(allowed)}")
        fields = get_profile(base).to_dict()
        fields.update(data)
        try:
            return cls(**fields)
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ValueError) and ":" in str(exc):
                raise
            raise ConfigError(f"profile: {exc}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"


def _dpu() -> NPUProfile:
    # Vitis AI DPU (DPUCZDX8G) as the older Vitis AI / Olive refinement states it:
    # full int8 weight range, shift_bias up to 16, wider Add shifts, half-away parameters;
    # PReLU in the conv engine and the VART reference runner (slopes int8 at a shift).
    return NPUProfile(
        ops=_XINT8_OPS | {"PRelu"},
        name="dpu",
        description="Vitis AI DPU rules (Vitis AI quantizer and the older Quark/Olive refinement)",
        weight_qmin=-128,
        weight_rounding=RoundMode.HALF_AWAY,
        bias_rounding=RoundMode.HALF_AWAY,
        shift_bias_max=16,
        add_shift_read_max=15,
        add_shift_write_range=(-15, 15),
    )


def _xint8_int32_bias() -> NPUProfile:
    return NPUProfile(
        name="xint8_int32_bias",
        description="xint8 with int32 biases at ipos + wpos (Quark's docs table; what the xint8 preset writes)",
        bias_format=BiasFormat.INT32_INPUT_PLUS_WEIGHT,
    )


PROFILES = {"xint8": NPUProfile, "xint8_int32_bias": _xint8_int32_bias, "dpu": _dpu}
"""Built-in profiles by name (factories)."""

DEFAULT_PROFILE = "xint8"


def list_profiles() -> tuple[str, ...]:
    """Names of the built-in profiles.

    Example:
        >>> list_profiles()
        ('xint8', 'xint8_int32_bias', 'dpu')
    """
    return tuple(PROFILES)


def get_profile(name: str) -> NPUProfile:
    """The built-in profile ``name``.

    Example:
        >>> get_profile("dpu").weight_qmin
        -128
    """
    factory = PROFILES.get(name)
    if factory is None:
        raise ConfigError(f"target: {name!r} is not a known profile; allowed: {', '.join(PROFILES)} or a .json file")
    return factory()


def load_profile(target: str | os.PathLike[str] | NPUProfile | None = None) -> NPUProfile:
    """A profile from a built-in name, a ``.json`` file, a profile, or ``None`` (``xint8``).

    Example:
        >>> load_profile(None).name, load_profile("dpu").name
        ('xint8', 'dpu')
    """
    if target is None:
        return get_profile(DEFAULT_PROFILE)
    if isinstance(target, NPUProfile):
        return target
    text = str(target)
    if text in PROFILES:
        return get_profile(text)
    path = Path(text)
    if path.suffix.lower() != ".json":
        return get_profile(text)  # raises with the list of names
    if not path.is_file():
        raise ConfigError(f"target: file '{path}' not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"target: '{path}' is not UTF-8 text (byte {exc.start}); allowed: a JSON profile") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"target: '{path}' is not valid JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"target: '{path}' must hold a JSON object of profile fields")
    return NPUProfile.from_dict(data)
