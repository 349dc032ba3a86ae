"""Command-line style edits of a :class:`~quant_core.config.QuantConfig`: per-channel or
per-tensor weights, the activation calibration method, extra exclusions, algorithms.

Example:
    >>> from quant_core.algorithm_config import CLEConfig
    >>> from quant_core.presets import get_preset
    >>> cfg = override_config(get_preset("a8w8"), per_channel=False, calib_method="percentile", exclude=["head*"])
    >>> cfg.global_config.weight.per_channel_axis, cfg.global_config.input.observer.method, cfg.exclude
    (None, 'percentile', ('head*',))
    >>> override_config(cfg, per_channel=True).global_config.weight.per_channel_axis
    'output'
    >>> [type(a).kind for a in override_config(cfg, algorithms=[CLEConfig(steps=4)]).algorithms]
    ['activation_equalization', 'bias_correction', 'cle']
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from quant_core.algorithm_config import AlgorithmConfig
from quant_core.config import OperatorConfig, QuantConfig
from quant_core.errors import ConfigError
from quant_core.observer_config import PowerOfTwoMSE, observer_config
from quant_core.spec import OUTPUT_CHANNELS, QuantSpec, ScaleType

CALIB_METHODS = ("minmax", "percentile", "entropy", "mse")


def _activation(spec: QuantSpec | None, method: str | None) -> QuantSpec | None:
    if spec is None or method is None or not spec.is_quantized:
        return spec
    if method not in CALIB_METHODS:
        raise ConfigError(f"calib_method: {method!r} is not allowed; allowed: {', '.join(CALIB_METHODS)}")
    if method == "mse" and spec.scale_type is ScaleType.POWER_OF_TWO:
        return spec.evolve(observer=PowerOfTwoMSE())  # the MSE search over power-of-two positions
    return spec.evolve(observer=observer_config(method))


def _weight(spec: QuantSpec | None, per_channel: bool | None) -> QuantSpec | None:
    if spec is None or per_channel is None or not spec.is_quantized:
        return spec
    # Per output channel, on whichever axis each op keeps them (the planner resolves it).
    return spec.evolve(per_channel_axis=OUTPUT_CHANNELS if per_channel else None)


def _operator(op: OperatorConfig, per_channel: bool | None, method: str | None) -> OperatorConfig:
    return attrs.evolve(
        op,
        input=_activation(op.input, method),
        output=_activation(op.output, method),
        weight=_weight(op.weight, per_channel),
    )


def override_config(
    config: QuantConfig,
    *,
    per_channel: bool | None = None,
    calib_method: str | None = None,
    exclude: Sequence[str] = (),
    algorithms: Sequence[AlgorithmConfig] = (),
) -> QuantConfig:
    """A copy of ``config`` with weight granularity, activation calibration method,
    exclusions and algorithms changed (``None``/empty leaves a setting as it is). An
    algorithm replaces the config's own of the same kind, in place; new kinds go last."""

    def edit(op: OperatorConfig) -> OperatorConfig:
        return _operator(op, per_channel, calib_method)

    return config.evolve(
        global_config=edit(config.global_config),
        op_type_overrides={k: edit(v) for k, v in config.op_type_overrides.items()},
        name_overrides={k: edit(v) for k, v in config.name_overrides.items()},
        exclude=(*config.exclude, *exclude),
        algorithms=_merge_algorithms(config.algorithms, algorithms),
    )


def _merge_algorithms(
    current: Sequence[AlgorithmConfig], extra: Sequence[AlgorithmConfig]
) -> tuple[AlgorithmConfig, ...]:
    given = {type(a).kind: a for a in extra}
    merged = [given.pop(type(a).kind, a) for a in current]
    return (*merged, *given.values())
