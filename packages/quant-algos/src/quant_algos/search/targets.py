"""The hardware targets a search may be restricted to (``--target`` / ``target=``), and
what each allows: one rule for both backends.

``xint8``: only recipes an xint8-style NPU can run, symmetric int8 with power-of-two
scales (:func:`power_of_two_reason`), searched over :func:`~quant_algos.search.space.power_of_two_space`.
Legalising and checking against an NPU profile is ``quant_npu``'s, which sits above both
backends.

Example:
    >>> from quant_core.presets import get_preset
    >>> power_of_two_reason(get_preset("a8w8"))
    'activation spec: scale_type float; allowed: power_of_two'
    >>> power_of_two_reason(get_preset("xint8")) is None
    True
"""

from __future__ import annotations

from quant_algos.search.space import SearchSpace, activation_and_weight_specs, default_space, power_of_two_space
from quant_core.config import QuantConfig
from quant_core.errors import ConfigError
from quant_core.spec import ScaleType

#: The targets a search takes (``None``: the backend's default runtime, every format).
TARGETS = ("xint8",)


def check_target(target: str | None, field: str = "target") -> str | None:
    """``target`` if it is ``None`` or one of :data:`TARGETS`; else a one-line error naming
    ``field`` (the argument that gave it).

    Example:
        >>> check_target("dpu")
        Traceback (most recent call last):
        ...
        quant_core.errors.ConfigError: target: 'dpu' is not allowed; allowed: xint8
    """
    if target is not None and target not in TARGETS:
        raise ConfigError(f"{field}: {target!r} is not allowed; allowed: {', '.join(TARGETS)}")
    return target


def target_space(target: str | None) -> SearchSpace:
    """The space searched for ``target`` when the caller names none.

    Example:
        >>> target_space("xint8").formats, target_space(None).formats
        (('xint8',), ('a8w8',))
    """
    return power_of_two_space() if check_target(target) == "xint8" else default_space()


def power_of_two_reason(config: QuantConfig) -> str | None:
    """Why ``config`` cannot run on an xint8 NPU (the first spec that is not symmetric
    int8 with a power-of-two scale, one line), or ``None``."""
    for role, specs in zip(("activation", "weight"), activation_and_weight_specs(config), strict=True):
        for spec in specs:
            if spec.scale_type is not ScaleType.POWER_OF_TWO:
                return f"{role} spec: scale_type {spec.scale_type.value}; allowed: power_of_two"
            if spec.dtype.bits != 8 or not spec.symmetric:
                return f"{role} spec: {spec.dtype.value} symmetric={spec.symmetric}; allowed: int8 symmetric"
    return None


def target_reason(target: str | None, config: QuantConfig | None) -> str | None:
    """Why ``config`` cannot run on ``target`` (``None``: it can, or no target).

    Example:
        >>> from quant_core.presets import get_preset
        >>> target_reason(None, get_preset("a8w8")) is None
        True
    """
    if target is None or config is None:
        return None
    return power_of_two_reason(config)
