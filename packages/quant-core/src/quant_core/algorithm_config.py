"""Typed settings of the accuracy-recovery algorithms (run by ``quant_algos`` through a
backend). One frozen attrs class per algorithm; its ``kind`` tag names it in JSON.

Example:
    >>> from quant_core.algorithm_config import CLEConfig, AdaRoundConfig
    >>> CLEConfig(steps=0).adaptive
    True
    >>> AdaRoundConfig(learning_rate=-1)
    Traceback (most recent call last):
    ...
    quant_core.errors.ConfigError: learning_rate: -1 is out of range; allowed: a finite number > 0
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, ClassVar

import attrs

from quant_core.errors import ConfigError, listed
from quant_core.observer_config import is_finite_number
from quant_core.spec import parse_enum


def check_in_range(field: str, value: Any, cond: Callable[[Any], Any], allowed: str) -> None:
    """Raise ``ConfigError`` ("``field``: ``value`` is out of range; allowed: ``allowed``")
    unless ``cond(value)`` holds. A bool is never in range (it is an ``int`` to Python, never
    what a count or a size means), and a ``cond`` that raises ``TypeError`` on a value of
    the wrong type refuses it, so callers need not test the type first.

    Example:
        >>> check_in_range("hold_samples", -1, lambda v: isinstance(v, int) and v >= 0, "an integer >= 0")
        Traceback (most recent call last):
        ...
        quant_core.errors.ConfigError: hold_samples: -1 is out of range; allowed: an integer >= 0
    """
    try:
        ok = not isinstance(value, bool) and bool(cond(value))
    except TypeError:
        ok = False
    if not ok:
        raise ConfigError(f"{field}: {value!r} is out of range; allowed: {allowed}")


def in_range(cond: Callable[[Any], Any], allowed: str) -> Any:
    """An attrs validator: :func:`check_in_range` on the attribute's value."""

    def validator(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:  # type: ignore[type-arg]
        check_in_range(attribute.name, value, cond, allowed)

    return validator


def _bool(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:  # type: ignore[type-arg]
    if not isinstance(value, bool):
        raise ConfigError(f"{attribute.name}: {value!r} is not allowed; allowed: true, false")


DEFAULT_NUM_SAMPLES = 256
"""Calibration samples an accuracy algorithm uses when its config leaves ``num_samples``
unset (``None``). The layer-wise ones keep per-sample state, so this bounds their time
and memory; 256 natural images were enough for every benchmark model."""

RECONSTRUCTION_THREADS = 1
"""torch intra-op threads AdaRound and AdaQuant use by default. Their per-layer loops are
thousands of small ops: a second thread gains little on a quiet machine, and on a machine
whose cores are shared every parallel op waits for whichever thread the OS parked (the whole
``xint8_adaround`` quantization of the Fashion-MNIST MobileNetV2 took 136 s on two threads
against 23 s on one beside other work, docs/benchmarks.md). One thread also rounds the same
whatever the machine's core count: torch splits its float sums by thread count."""

_positive_int = in_range(lambda v: isinstance(v, int) and v > 0, "an integer > 0")
_optional_positive_int = in_range(lambda v: v is None or (isinstance(v, int) and v > 0), "null or an integer > 0")
_positive = in_range(lambda v: is_finite_number(v) and v > 0, "a finite number > 0")
_unit = in_range(lambda v: is_finite_number(v) and 0.0 <= v <= 1.0, "a number from 0 to 1")


def _device(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:  # type: ignore[type-arg]
    ok = isinstance(value, str) and (value in ("cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()))
    if not ok:
        raise ConfigError(f"{attribute.name}: {value!r} is not allowed; allowed: cpu, cuda, cuda:N")


@attrs.frozen
class CLEConfig:
    """Cross-layer equalization of conv->conv and conv->depthwise->conv chains.

    Args:
        steps: equalization sweeps over the network; 0 means adaptive (repeat until
            the relative change of the scales is below ``tolerance``, at most
            ``max_steps`` sweeps).
        tolerance: adaptive mode stops when no scale changes by more than this (relative).
        max_steps: most sweeps in adaptive mode.
        replace_relu6_with_relu: rewrite Clip(0, 6)/Relu6 as Relu so that scaling
            across the activation is exact (Quark's ``ReplaceClip6Relu``).
        bias_in_scale: include the bias range when choosing the scales
            (Quark's ``cle_scale_append_bias``).
        absorb_high_bias: move large biases that the next layer can absorb.
        num_samples: calibration samples the ReLU6 check and high-bias absorption
            measure (statistics of a few layers' outputs: 64 are plenty).

    Example:
        >>> CLEConfig(steps=3).adaptive
        False
    """

    kind: ClassVar[str] = "cle"
    steps: int = attrs.field(
        default=1, validator=in_range(lambda v: isinstance(v, int) and v >= 0, "an integer >= 0 (0: adaptive)")
    )
    tolerance: float = attrs.field(default=1e-3, validator=_positive)
    max_steps: int = attrs.field(default=32, validator=_positive_int)
    replace_relu6_with_relu: bool = attrs.field(default=True, validator=_bool)
    bias_in_scale: bool = attrs.field(default=False, validator=_bool)
    absorb_high_bias: bool = attrs.field(default=True, validator=_bool)
    num_samples: int = attrs.field(default=64, validator=_positive_int)

    @property
    def adaptive(self) -> bool:
        return self.steps == 0


BIAS_CORRECTION_METHODS = ("empirical", "analytic")


@attrs.frozen
class BiasCorrectionConfig:
    """Bias correction: remove the per-channel mean that quantization adds to each
    layer's output, by shifting its bias.

    Args:
        num_samples: calibration samples measured (``None``: ``DEFAULT_NUM_SAMPLES``).
        method: ``"empirical"`` walks the layers in order and measures each one's mean
            output error on the calibration data, every earlier layer already corrected
            (it also removes the shift its quantized inputs carry). ``"analytic"`` computes
            ``(W_q - W) E[x]`` from the float model's mean input of each layer, in one
            float pass: it removes what each layer's own weight rounding shifts, at a
            fraction of the walk's cost.

    Example:
        >>> BiasCorrectionConfig(num_samples=64).num_samples
        64
        >>> BiasCorrectionConfig(method="exact")
        Traceback (most recent call last):
        ...
        quant_core.errors.ConfigError: method: 'exact' is not allowed; allowed: empirical, analytic
    """

    kind: ClassVar[str] = "bias_correction"
    num_samples: int | None = attrs.field(default=None, validator=_optional_positive_int)
    method: str = attrs.field(default="empirical")

    @method.validator
    def _known(self, attribute: attrs.Attribute, value: str) -> None:  # type: ignore[type-arg]
        if value not in BIAS_CORRECTION_METHODS:
            raise ConfigError(
                f"{attribute.name}: {value!r} is not allowed; allowed: {', '.join(BIAS_CORRECTION_METHODS)}"
            )

    @property
    def analytic(self) -> bool:
        return self.method == "analytic"


@attrs.frozen
class SmoothQuantConfig:
    """SmoothQuant: move activation outliers into the weights with per-input-channel
    scales ``s = max|x|**alpha / max|w|**(1 - alpha)``.

    Args:
        alpha: migration strength (0: nothing moves into the weights, 1: everything).
        num_samples: calibration samples measured (``None``: ``DEFAULT_NUM_SAMPLES``).

    Example:
        >>> SmoothQuantConfig(alpha=0.75).alpha
        0.75
    """

    kind: ClassVar[str] = "smoothquant"
    alpha: float = attrs.field(default=0.5, validator=_unit)
    num_samples: int | None = attrs.field(default=None, validator=_optional_positive_int)


@attrs.frozen
class ActivationEqualizationConfig:
    """Even out the channels of the activations one per-tensor grid serves, where that
    costs nothing: weights per output channel absorb the per-channel scales exactly, and
    the compensating scale runs in an activation chain that stays float anyway
    (``quant_algos.activation_equalization``). Two places:

    - a Conv's output read only by an activation chain (a BN-folded Conv before its
      HardSwish): the Conv computes ``y / s`` per channel, a ``Mul`` by ``s`` starts the
      chain;
    - a depthwise Conv's input: filter ``c`` takes ``s_c``, and ``1 / s`` goes into the
      Conv that writes the input (its output channels) or a ``Mul`` that ends the chain
      writing it.

    The float function is unchanged. Formats with per-tensor or power-of-two weights, or
    power-of-two activations (the chains are quantized there), are left alone.

    Args:
        num_samples: calibration samples measured (``None``: ``DEFAULT_NUM_SAMPLES``).

    Example:
        >>> ActivationEqualizationConfig().kind
        'activation_equalization'
    """

    kind: ClassVar[str] = "activation_equalization"
    num_samples: int | None = attrs.field(default=None, validator=_optional_positive_int)


@attrs.frozen
class AdaRoundConfig:
    """AdaRound: learn whether each weight rounds up or down by reconstructing each
    layer's float output from quantized upstream inputs (needs ``quant-algos[torch]``).

    Args:
        device: where the optimisation runs (``cpu``, ``cuda``, ``cuda:N``).
        batch_size: samples per minibatch (each contributes a bounded number of positions).
        num_iterations: optimisation steps per layer.
        learning_rate: Adam's learning rate for the rounding variables.
        reg_param: weight of the regulariser that pushes every rounding to up or down.
        beta_start, beta_end: the regulariser's exponent, annealed from start down to end
            (a falling exponent is what pushes each rounding to up or down; ``beta_end``
            above ``beta_start`` is refused).
        warm_start: fraction of the iterations before the regulariser starts.
        early_stop: stop a layer once every rounding has settled.
        num_samples: calibration samples used (``None``: ``DEFAULT_NUM_SAMPLES``).
        num_threads: torch intra-op threads of the per-layer loops (``None``: torch's
            setting). One by default: the loops are thousands of small ops that gain little
            from a second thread and wait on parked threads when cores are shared; one
            thread also rounds the same whatever the machine's core count
            (``RECONSTRUCTION_THREADS``).

    Example:
        >>> AdaRoundConfig(device="cuda:0", num_iterations=500).device
        'cuda:0'
    """

    kind: ClassVar[str] = "adaround"
    device: str = attrs.field(default="cpu", validator=_device)
    batch_size: int = attrs.field(default=32, validator=_positive_int)
    num_iterations: int = attrs.field(default=1000, validator=_positive_int)
    learning_rate: float = attrs.field(default=1e-2, validator=_positive)
    reg_param: float = attrs.field(default=0.01, validator=_positive)
    beta_start: float = attrs.field(default=20.0, validator=_positive)
    beta_end: float = attrs.field(default=2.0, validator=_positive)
    warm_start: float = attrs.field(default=0.2, validator=_unit)
    early_stop: bool = attrs.field(default=True, validator=_bool)
    num_samples: int | None = attrs.field(default=None, validator=_optional_positive_int)
    num_threads: int | None = attrs.field(default=RECONSTRUCTION_THREADS, validator=_optional_positive_int)

    @beta_end.validator
    def _falls(self, _attribute: attrs.Attribute, value: float) -> None:  # type: ignore[type-arg]
        if value > self.beta_start:
            raise ConfigError(
                f"beta_end: {value!r} is above beta_start {self.beta_start!r}; allowed: a value <= beta_start "
                "(the exponent is annealed downwards)"
            )


@attrs.frozen
class AdaQuantConfig:
    """AdaQuant: learn each layer's weights and bias (with quantization in the loop)
    to reconstruct its float output (needs ``quant-algos[torch]``).

    Args:
        device: where the optimisation runs (``cpu``, ``cuda``, ``cuda:N``).
        batch_size: samples per minibatch.
        num_iterations: optimisation steps per layer.
        learning_rate: Adam's learning rate for weights and bias.
        early_stop: stop a layer once its score stops improving.
        num_samples: calibration samples used (``None``: ``DEFAULT_NUM_SAMPLES``).
        num_threads: torch intra-op threads of the per-layer loops (``None``: torch's
            setting; one by default, as for AdaRound).

    Example:
        >>> AdaQuantConfig(learning_rate=1e-5).learning_rate
        1e-05
    """

    kind: ClassVar[str] = "adaquant"
    device: str = attrs.field(default="cpu", validator=_device)
    batch_size: int = attrs.field(default=32, validator=_positive_int)
    num_iterations: int = attrs.field(default=500, validator=_positive_int)
    learning_rate: float = attrs.field(default=1e-5, validator=_positive)
    early_stop: bool = attrs.field(default=True, validator=_bool)
    num_samples: int | None = attrs.field(default=None, validator=_optional_positive_int)
    num_threads: int | None = attrs.field(default=RECONSTRUCTION_THREADS, validator=_optional_positive_int)


class PrecisionTarget(enum.Enum):
    """Wider formats a sensitive layer can be raised to (activation / weight bits)."""

    A16W8 = "a16w8"
    A8W16 = "a8w16"
    A16W16 = "a16w16"


class SensitivityMetric(enum.Enum):
    SQNR = "sqnr"
    EVALUATE = "evaluate"


def _targets(value: Any) -> tuple[PrecisionTarget, ...]:
    allowed = f"a list of {', '.join(t.value for t in PrecisionTarget)}"
    items = (
        (value,) if isinstance(value, PrecisionTarget) else listed(value, "target_types", allowed, any_iterable=True)
    )
    return tuple(parse_enum(PrecisionTarget, v, "target_types") for v in items)


def _metric(value: Any) -> SensitivityMetric:
    return parse_enum(SensitivityMetric, value, "metric")


@attrs.frozen
class GPTQConfig:
    """GPTQ: each layer's weights rounded one input column at a time, each column's
    rounding error spread, in closed form, over the columns not yet rounded through the
    inverse of the layer's input Hessian ``X^T X`` (its inputs in the quantized model,
    every earlier layer already rounded). No optimiser and no torch: one linear solve per
    layer, so it costs a small fraction of AdaRound.

    Args:
        damping: added to the Hessian's diagonal, as a fraction of its mean (keeps the
            inverse stable where inputs are nearly dependent).
        num_samples: calibration samples whose inputs make the Hessian (``None``:
            ``DEFAULT_NUM_SAMPLES``).
        act_order: round the columns of the largest inputs first (GPTQ's "act-order").

    Example:
        >>> GPTQConfig().damping
        0.01
        >>> GPTQConfig(damping=0)
        Traceback (most recent call last):
        ...
        quant_core.errors.ConfigError: damping: 0 is out of range; allowed: a number > 0 and <= 1
    """

    kind: ClassVar[str] = "gptq"
    damping: float = attrs.field(
        default=0.01, validator=in_range(lambda v: is_finite_number(v) and 0 < v <= 1, "a number > 0 and <= 1")
    )
    num_samples: int | None = attrs.field(default=None, validator=_optional_positive_int)
    act_order: bool = attrs.field(default=False, validator=_bool)


@attrs.frozen
class MixedPrecisionConfig:
    """Auto mixed precision: rank layers by sensitivity and raise the most sensitive
    to a wider type until ``accuracy_target`` (an output SQNR in dB for the ``sqnr``
    metric, else the user evaluate function's score) or ``size_budget`` (model size
    relative to all-int8, e.g. 1.1) is met. The ``sqnr`` metric scores the first
    ``num_samples`` calibration samples (each of the search's evaluations runs them).

    Args:
        target_types: the wider formats a layer may be raised to (a16w8, a8w16, a16w16).
        metric: ``sqnr`` (output SQNR against float, dB) or ``evaluate`` (the user's score).
        accuracy_target: the score to reach (stop raising once met).
        size_budget: largest model size allowed, relative to the base model.
        max_layers: most layers raised.
        num_samples: calibration samples each evaluation scores (metric ``sqnr``).

    Example:
        >>> MixedPrecisionConfig(target_types=["a16w8"], accuracy_target=30.0).target_types
        (<PrecisionTarget.A16W8: 'a16w8'>,)
    """

    kind: ClassVar[str] = "mixed_precision"
    target_types: tuple[PrecisionTarget, ...] = attrs.field(default=(PrecisionTarget.A16W8,), converter=_targets)
    metric: SensitivityMetric = attrs.field(default=SensitivityMetric.SQNR, converter=_metric)
    accuracy_target: float | None = attrs.field(
        default=None, validator=in_range(lambda v: v is None or is_finite_number(v), "null or a finite number")
    )
    size_budget: float | None = attrs.field(
        default=None,
        validator=in_range(lambda v: v is None or (is_finite_number(v) and v >= 1.0), "null or a finite number >= 1"),
    )
    max_layers: int | None = attrs.field(default=None, validator=_optional_positive_int)
    num_samples: int = attrs.field(default=64, validator=_positive_int)

    def __attrs_post_init__(self) -> None:
        if not self.target_types:
            raise ConfigError("target_types: empty; allowed: one or more of a16w8, a8w16, a16w16")
        if self.accuracy_target is None and self.size_budget is None and self.max_layers is None:
            raise ConfigError("accuracy_target, size_budget, max_layers: set at least one stopping rule")


def samples_to_use(config: object) -> int:
    """How many calibration samples an algorithm config asks for (its ``num_samples``, or
    :data:`DEFAULT_NUM_SAMPLES` when unset).

    Example:
        >>> samples_to_use(BiasCorrectionConfig()), samples_to_use(BiasCorrectionConfig(num_samples=64))
        (256, 64)
    """
    count = getattr(config, "num_samples", None)
    return DEFAULT_NUM_SAMPLES if count is None else int(count)


def algorithm_label(algorithm: AlgorithmConfig) -> str:
    """An algorithm config's short name, as a recipe's name and the presets table show it:
    its ``kind``, with what tells two configs of that kind apart in recipes.

    Example:
        >>> algorithm_label(MixedPrecisionConfig(accuracy_target=30.0))
        'mixed_precision(30dB)'
        >>> algorithm_label(BiasCorrectionConfig(method="analytic")), algorithm_label(CLEConfig())
        ('bias_correction(analytic)', 'cle')
        >>> algorithm_label(SmoothQuantConfig(alpha=0.8))
        'smoothquant(0.8)'
    """
    if isinstance(algorithm, MixedPrecisionConfig):
        target = algorithm.accuracy_target
        return f"mixed_precision({target:g}dB)" if target is not None else "mixed_precision"
    if isinstance(algorithm, BiasCorrectionConfig) and algorithm.analytic:
        return "bias_correction(analytic)"
    if isinstance(algorithm, SmoothQuantConfig) and algorithm.alpha != SmoothQuantConfig().alpha:
        return f"smoothquant({algorithm.alpha:g})"
    return algorithm.kind


AlgorithmConfig = (
    CLEConfig
    | BiasCorrectionConfig
    | SmoothQuantConfig
    | ActivationEqualizationConfig
    | AdaRoundConfig
    | AdaQuantConfig
    | GPTQConfig
    | MixedPrecisionConfig
)

ALGORITHM_CONFIGS: dict[str, type] = {
    cls.kind: cls
    for cls in (
        CLEConfig,
        BiasCorrectionConfig,
        SmoothQuantConfig,
        ActivationEqualizationConfig,
        AdaRoundConfig,
        AdaQuantConfig,
        GPTQConfig,
        MixedPrecisionConfig,
    )
}
