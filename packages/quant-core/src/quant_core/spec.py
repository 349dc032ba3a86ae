"""``QuantSpec``: how one tensor is quantized.

A spec is frozen and checked at construction: an invalid combination raises a
``ConfigError`` (a ``ValueError``) that names the field and the allowed values.

Example:
    >>> from quant_core.spec import QuantSpec, ScaleType
    >>> from quant_core.dtypes import DType
    >>> w = QuantSpec(dtype=DType.INT8, symmetric=True, per_channel_axis=0)
    >>> w.granularity
    <Granularity.PER_CHANNEL: 'per_channel'>
    >>> a = QuantSpec(dtype="int8", scale_type="power_of_two")
    >>> a.scale_type is ScaleType.POWER_OF_TWO and a.symmetric
    True
    >>> QuantSpec(dtype="int8", rounding="nearest")
    Traceback (most recent call last):
    ...
    quant_core.errors.ConfigError: rounding: 'nearest' is not allowed; allowed: half_even, half_up, half_away, floor, ceil, toward_zero
    >>> QuantSpec(dtype="int8", per_channel_axis=OUTPUT_CHANNELS).channel_axis
    Traceback (most recent call last):
    ...
    quant_core.errors.ConfigError: per_channel_axis: 'output' names no axis yet; the planner resolves it to the op's output-channel axis
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, TypeVar

import attrs

from quant_core.dtypes import DType
from quant_core.errors import ConfigError
from quant_core.observer_config import (
    HISTOGRAM_METHODS,
    OBSERVER_CONFIGS,
    MinMax,
    ObserverConfig,
    PowerOfTwoMSE,
)

E = TypeVar("E", bound=enum.Enum)

OUTPUT_CHANNELS = "output"
"""``per_channel_axis`` value meaning "one scale per output channel, on whichever axis the
op's weight layout keeps them" (Conv ``[Cout, Cin/g, k...]``: 0; Gemm ``transB=0`` and
MatMul ``[K, N]``: the last). The planner resolves it per op; an integer axis is taken as
written and refused where it is not the op's output-channel axis."""


class Granularity(enum.Enum):
    PER_TENSOR = "per_tensor"
    PER_CHANNEL = "per_channel"


class ScaleType(enum.Enum):
    FLOAT = "float"
    POWER_OF_TWO = "power_of_two"


class RoundMode(enum.Enum):
    """How a real value becomes an integer code.

    ``half_even`` is what ONNX QuantizeLinear does; ``half_up`` (``floor(x + 0.5)``) is
    what NPU datapaths do; ``half_away`` is Vitis AI's rounding of parameters.
    """

    HALF_EVEN = "half_even"
    HALF_UP = "half_up"
    HALF_AWAY = "half_away"
    FLOOR = "floor"
    CEIL = "ceil"
    TOWARD_ZERO = "toward_zero"


def parse_enum(enum_cls: type[E], value: Any, field: str) -> E:
    """``value`` as a member of ``enum_cls``; the error names ``field`` and the allowed values."""
    if isinstance(value, enum_cls):
        return value
    try:
        return enum_cls(value)
    except ValueError:
        allowed = ", ".join(str(m.value) for m in enum_cls)
        raise ConfigError(f"{field}: {value!r} is not allowed; allowed: {allowed}") from None


def _dtype_converter(value: Any) -> DType:
    return DType.parse(value)


def _scale_type_converter(value: Any) -> ScaleType:
    return parse_enum(ScaleType, value, "scale_type")


def _round_converter(value: Any) -> RoundMode:
    return parse_enum(RoundMode, value, "rounding")


def _validate_observer(_inst: Any, _attribute: Any, value: Any) -> None:
    # The type annotation is not enforced at run time, and ``__attrs_post_init__`` reads
    # ``observer.method``: without this check a method name, ``None`` or a JSON-style dict
    # fails there with an AttributeError that names neither the field nor what it accepts.
    # Strings are refused rather than converted: the JSON form is a tagged object
    # (``{"method": "minmax"}``, which :func:`~quant_core.serialization.from_data` turns
    # into the class before this runs), and ``observer_config`` is the one place a bare
    # method name becomes a config, with that method's parameters.
    if isinstance(value, tuple(OBSERVER_CONFIGS.values())):
        return
    classes = ", ".join(f"{cls.__name__}()" for cls in OBSERVER_CONFIGS.values())
    hint = ""
    if isinstance(value, str) and value in OBSERVER_CONFIGS:
        hint = f"; observer_config({value!r}) builds one from the method name"
    elif isinstance(value, Mapping):
        hint = "; quant_core.serialization.from_data builds one from its JSON object"
    raise ConfigError(
        f"observer: {value!r} is not allowed; allowed: an observer config from quant_core.observer_config "
        f"({classes}){hint}"
    )


@attrs.frozen
class QuantSpec:
    """How one tensor is quantized.

    Args:
        dtype: storage format; a float format (fp16, bf16, fp32) keeps the tensor in float.
        symmetric: zero point fixed at 0 (signed) or at the mid-code (unsigned: 128 for
            uint8, the encoding onnxruntime's fast x86 kernels want for symmetric int8).
        per_channel_axis: ``None`` for one scale per tensor, :data:`OUTPUT_CHANNELS`
            (``"output"``) for one per output channel wherever the op keeps them, or an
            explicit axis.
        scale_type: ``float`` or ``power_of_two`` (``scale = 2**-fix_pos``).
        rounding: see :class:`RoundMode`.
        observer: calibration method and its parameters (``quant_core.observer_config``).
        narrow_range: drop the lowest code (int8: [-127, 127]); symmetric specs only.
        dynamic: activation qparams computed at run time from each batch.

    Example:
        >>> from quant_core.observer_config import Percentile
        >>> QuantSpec(dtype="uint8", symmetric=False, observer=Percentile()).zero_point_is_fixed
        False
    """

    dtype: DType = attrs.field(converter=_dtype_converter)
    symmetric: bool = attrs.field(default=True)
    per_channel_axis: int | str | None = attrs.field(default=None)
    scale_type: ScaleType = attrs.field(default=ScaleType.FLOAT, converter=_scale_type_converter)
    rounding: RoundMode = attrs.field(default=RoundMode.HALF_EVEN, converter=_round_converter)
    observer: ObserverConfig = attrs.field(factory=MinMax, validator=_validate_observer)
    narrow_range: bool = attrs.field(default=False)
    dynamic: bool = attrs.field(default=False)

    def __attrs_post_init__(self) -> None:
        for name in ("symmetric", "narrow_range", "dynamic"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ConfigError(f"{name}: {value!r} is not allowed; allowed: true, false")
        axis = self.per_channel_axis
        explicit = isinstance(axis, int) and not isinstance(axis, bool) and axis >= 0
        if axis is not None and axis != OUTPUT_CHANNELS and not explicit:
            raise ConfigError(
                f"per_channel_axis: {axis!r} is not allowed; allowed: null, {OUTPUT_CHANNELS!r} or an integer >= 0"
            )
        if self.dtype.is_float:
            if self.dynamic or axis is not None or self.scale_type is not ScaleType.FLOAT:
                raise ConfigError(
                    f"dtype: {self.dtype.value} keeps the tensor in float; per_channel_axis, "
                    "scale_type and dynamic must keep their defaults (null, float, false)"
                )
            return
        if self.narrow_range and not self.symmetric:
            raise ConfigError("narrow_range: true needs symmetric: true; allowed with symmetric: false: false")
        method = self.observer.method
        if axis is not None and method == "fixed_range":
            raise ConfigError("observer.method: 'fixed_range' is one range per tensor; allowed per_channel_axis: null")
        if axis is not None and method in HISTOGRAM_METHODS:
            raise ConfigError(
                f"observer.method: {method!r} keeps a per-tensor histogram; allowed with "
                "per_channel_axis set: minmax, moving_average"
            )
        if isinstance(self.observer, PowerOfTwoMSE) and self.scale_type is not ScaleType.POWER_OF_TWO:
            raise ConfigError(
                "observer.method: 'minmse_pow2' searches power-of-two positions; it needs scale_type: power_of_two"
            )
        if self.dynamic:
            if axis is not None:
                raise ConfigError("dynamic: true computes one range per batch; allowed per_channel_axis: null")
            if not isinstance(self.observer, MinMax):
                raise ConfigError(f"observer.method: {method!r} is not allowed with dynamic: true; allowed: minmax")

    @property
    def granularity(self) -> Granularity:
        return Granularity.PER_TENSOR if self.per_channel_axis is None else Granularity.PER_CHANNEL

    @property
    def channel_axis(self) -> int | None:
        """The per-channel axis as an integer (``None`` per tensor); ``ConfigError`` while it
        is still :data:`OUTPUT_CHANNELS`, which only the planner can resolve."""
        axis = self.per_channel_axis
        if isinstance(axis, str):
            raise ConfigError(
                f"per_channel_axis: {axis!r} names no axis yet; the planner resolves it to the op's output-channel axis"
            )
        return axis

    @property
    def is_quantized(self) -> bool:
        """False for float pass-through specs (fp16, bf16, fp32)."""
        return self.dtype.is_integer

    @property
    def zero_point_is_fixed(self) -> bool:
        return self.symmetric

    @property
    def qrange(self) -> tuple[int, int]:
        return self.dtype.qrange(self.narrow_range)

    def evolve(self, **changes: Any) -> QuantSpec:
        """A copy with ``changes`` applied (and validated again).

        Example:
            >>> QuantSpec(dtype="int8").evolve(dtype="int16").dtype
            <DType.INT16: 'int16'>
        """
        result: QuantSpec = attrs.evolve(self, **changes)
        return result
