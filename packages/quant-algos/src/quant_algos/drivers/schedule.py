"""When each accuracy algorithm of a config runs, decided once for every backend.

Two phases around calibration:

- before it, on the float model: CLE, activation equalization, then SmoothQuant (each
  measures the activations the one before left);
- after it, on the quantized model and the calibrated plan: mixed precision first (it
  chooses the formats the others then work in), GPTQ, AdaRound, AdaQuant, and bias
  correction last (it removes the mean error the others leave).

Within a kind, the config's order is kept. A backend passes the kinds it runs; any other
is refused with one line naming it and what the backend runs instead.

Example:
    >>> from quant_core.algorithm_config import AdaRoundConfig, BiasCorrectionConfig, CLEConfig
    >>> from quant_core.presets import get_preset
    >>> config = get_preset("a8w8").evolve(algorithms=(BiasCorrectionConfig(), AdaRoundConfig(), CLEConfig()))
    >>> plan = schedule(config)
    >>> [a.kind for a in plan.before_calibration], [a.kind for a in plan.after_calibration]
    (['cle'], ['adaround', 'bias_correction'])
"""

from __future__ import annotations

from collections.abc import Collection

import attrs

from quant_core.algorithm_config import (
    ActivationEqualizationConfig,
    AdaQuantConfig,
    AdaRoundConfig,
    AlgorithmConfig,
    BiasCorrectionConfig,
    CLEConfig,
    GPTQConfig,
    MixedPrecisionConfig,
    SmoothQuantConfig,
)
from quant_core.config import QuantConfig
from quant_core.errors import ConfigError

BEFORE_CALIBRATION: tuple[str, ...] = (CLEConfig.kind, ActivationEqualizationConfig.kind, SmoothQuantConfig.kind)
"""Kinds that edit the float model, in run order."""
AFTER_CALIBRATION: tuple[str, ...] = (
    MixedPrecisionConfig.kind,
    GPTQConfig.kind,
    AdaRoundConfig.kind,
    AdaQuantConfig.kind,
    BiasCorrectionConfig.kind,
)
"""Kinds that edit the quantized model, in run order."""
ALL_KINDS: tuple[str, ...] = (*BEFORE_CALIBRATION, *AFTER_CALIBRATION)


@attrs.frozen
class AlgorithmSchedule:
    """A config's algorithms in the order they run, split by phase."""

    before_calibration: tuple[AlgorithmConfig, ...]
    after_calibration: tuple[AlgorithmConfig, ...]

    def kinds(self) -> tuple[str, ...]:
        """Every scheduled kind, in run order (a kind configured twice appears twice)."""
        return tuple(a.kind for a in (*self.before_calibration, *self.after_calibration))


def schedule(
    config: QuantConfig, runs: Collection[str] = ALL_KINDS, *, backend: str = "", elsewhere: str = ""
) -> AlgorithmSchedule:
    """``config.algorithms`` in run order (module docstring). ``runs``: the kinds the
    backend runs; another kind raises :class:`~quant_core.errors.ConfigError` naming it
    and the kinds allowed (``backend`` names the backend in that message, ``elsewhere``
    what runs the kind instead).

    Example:
        >>> from quant_core.algorithm_config import MixedPrecisionConfig
        >>> from quant_core.presets import get_preset
        >>> config = get_preset("a8w8").evolve(algorithms=(MixedPrecisionConfig(max_layers=1),))
        >>> schedule(config, ("cle",), backend="torch")
        Traceback (most recent call last):
        ...
        quant_core.errors.ConfigError: config.algorithms: mixed_precision is not run by the torch backend yet; allowed here: cle
    """
    for algorithm in config.algorithms:
        if algorithm.kind not in runs:
            where = f" by the {backend} backend" if backend else ""
            instead = f" (use {elsewhere} for {algorithm.kind})" if elsewhere else ""
            raise ConfigError(
                f"config.algorithms: {algorithm.kind} is not run{where} yet; allowed here: {', '.join(runs)}{instead}"
            )

    def ordered(kinds: tuple[str, ...]) -> tuple[AlgorithmConfig, ...]:
        return tuple(a for kind in kinds for a in config.algorithms if a.kind == kind)

    return AlgorithmSchedule(ordered(BEFORE_CALIBRATION), ordered(AFTER_CALIBRATION))
