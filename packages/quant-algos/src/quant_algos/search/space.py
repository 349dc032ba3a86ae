"""The recipes a search tries, and the order it tries them in.

A :class:`SearchSpace` is a few axes, searched one after another (a greedy coordinate
search), each stage's candidates in order of expected cost:

1. **observers**: each format (a preset's specs, its algorithms dropped) with each
   activation and weight observer, no algorithm;
2. **corrections**: the best recipe so far with each cheap combination (CLE, SmoothQuant,
   bias correction and their pairs);
3. **learned rounding**: the best recipe so far with AdaRound or AdaQuant added;
4. **mixed precision** (the middle tier: some 16-bit tensors): the best 8-bit recipe of
   stages 1-2 with mixed precision to each output-SQNR target;
5. **16-bit**: the all-16-bit presets, as they are.

"Best" is the highest score on the selection data (ties: the earlier). When the
observers a stage has scored differ from each other by far less than the best of them
misses the target by (:func:`axis_is_flat`), the observer axis is unlikely to close the
gap: the stage's remaining candidates are deferred until after the corrections (stage
2), which usually move the metric more, and run then only if no correction met the
target. The order changes, not the set: nothing is dropped. Stages 1-3 hold
only all-8-bit models, so a model that meets the target in 8 bits is preferred over
one with 16-bit tensors, whatever it costs to find; an expensive algorithm is tried
once, on the best observer and pre-pass the cheap stages found, not on every
combination. :func:`expected_cost` orders each stage, in units of one pass of the float
model over the calibration set (a fixed table: the order never depends on a timing).
Every :class:`Candidate` is a complete :class:`~quant_core.config.QuantConfig` that
``quant-onnx quantize --config`` runs on its own.

Example:
    >>> calibration = CalibrationConfig(num_samples=64, batch_size=16)
    >>> [c.name for c in observer_stage(default_space(), calibration)][:3]
    ['a8w8/minmax', 'a8w8/percentile(99.999)', 'a8w8/percentile(99.99)']
    >>> base = observer_stage(default_space(), calibration)[0]
    >>> [c.name for c in refine(base, default_space().corrections)][:2]
    ['a8w8/minmax+cle', 'a8w8/minmax+smoothquant']
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from quant_core.algorithm_config import (
    AdaQuantConfig,
    AdaRoundConfig,
    AlgorithmConfig,
    BiasCorrectionConfig,
    CLEConfig,
    GPTQConfig,
    MixedPrecisionConfig,
    SmoothQuantConfig,
    algorithm_label,
)
from quant_core.config import CalibrationConfig, OperatorConfig, QuantConfig
from quant_core.errors import ConfigError
from quant_core.observer_config import MSE, Entropy, MinMax, ObserverConfig, Percentile, PowerOfTwoMSE
from quant_core.presets import get_preset
from quant_core.spec import QuantSpec

#: Cost of selecting an observer's ranges, per method, in calibration passes
#: (fmnist_mobilenetv2, 256 samples: a pass 0.6 s; range selection over its 60 tensor
#: groups: percentile 0.3 s, power-of-two MinMSE 1 s, entropy 7 s, MSE 14 s).
OBSERVER_COST = {"minmax": 0.0, "percentile": 0.5, "minmse_pow2": 1.5, "entropy": 12.0, "mse": 24.0}
#: Cost of each algorithm, in calibration passes: what it adds to the plain min-max recipe
#: over one statistics pass (the walk's unit), as ``python -m tools.bench.algorithm_costs``
#: measures them on fmnist_mobilenetv2 with 128 calibration samples (a pass 0.09 s; CLE
#: adds 0.2 s, SmoothQuant 0.3-0.6 s, bias correction 0.7 s, mixed precision at 30 dB
#: 18 s, AdaQuant 35 s, AdaRound as ``xint8_adaround`` runs it 53 s; medians of three runs
#: for the first three, one run for the rest, on a shared 2-core machine; later, the
#: analytic bias correction 0.07 s and GPTQ 1.0 s, medians of three), rounded. So
#: AdaQuant goes before AdaRound in the learned stage, and a budget skips what it expects
#: to outrun: the learned algorithms train for a fixed number of steps, so on a model with
#: more calibration samples per step they cost fewer passes than here.
ALGORITHM_COST = {
    "cle": 2.0,
    "smoothquant": 3.5,
    "activation_equalization": 3.5,
    "bias_correction": 7.0,
    "bias_correction(analytic)": 1.5,
    "gptq": 16.0,
    "mixed_precision": 150.0,
    "adaround": 570.0,
    "adaquant": 380.0,
}
#: The tiers: what the model costs to run (the order of the stages).
TIER_8BIT, TIER_MIXED, TIER_16BIT = 0, 1, 2

#: AdaRound as the ``xint8_adaround`` preset runs it (learning rate 0.1, minibatches of 4:
#: better and faster than the defaults on every benchmark model).
ADAROUND = AdaRoundConfig(learning_rate=0.1, batch_size=4)

#: Stage 2 of the default spaces: each cheap algorithm alone, CLE with bias correction.
CORRECTIONS: tuple[tuple[AlgorithmConfig, ...], ...] = (
    (CLEConfig(),),
    (SmoothQuantConfig(),),
    (BiasCorrectionConfig(),),
    (CLEConfig(), BiasCorrectionConfig()),
)
#: What a space's ``learned`` stage may hold: the algorithms that choose the weight codes.
_LEARNED_KINDS = ("gptq", "adaround", "adaquant")
#: Stage 3 of the default spaces (by cost: GPTQ, a closed form, before the two optimisers).
LEARNED: tuple[AlgorithmConfig, ...] = (GPTQConfig(), ADAROUND, AdaQuantConfig())


def _combinations(value: Iterable[Iterable[AlgorithmConfig]]) -> tuple[tuple[AlgorithmConfig, ...], ...]:
    return tuple(tuple(c) for c in value)


# Typed converters: attrs' ``converter=tuple`` loses the element type for mypy.
def _names(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


def _observers(value: Iterable[ObserverConfig]) -> tuple[ObserverConfig, ...]:
    return tuple(value)


def _weight_observers(value: Iterable[ObserverConfig | None]) -> tuple[ObserverConfig | None, ...]:
    return tuple(value)


def _algorithms(value: Iterable[AlgorithmConfig]) -> tuple[AlgorithmConfig, ...]:
    return tuple(value)


def _mixed(value: Iterable[MixedPrecisionConfig]) -> tuple[MixedPrecisionConfig, ...]:
    return tuple(value)


@attrs.frozen
class SearchSpace:
    """The axes a search walks (module docstring).

    Args:
        formats: preset names whose specs the 8-bit recipes use (their algorithms are
            dropped: the later stages bring algorithms).
        activation_observers: calibration methods of the activations (stage 1).
        weight_observers: calibration methods of the weights (``None``: the format's own).
        corrections: algorithm combinations added to the best recipe (stage 2).
        learned: AdaRound/AdaQuant settings added to the best recipe (stage 3).
        mixed_precision: mixed-precision settings added to the best 8-bit recipe of
            stages 1-2 (stage 4).
        wide_formats: preset names tried last, as they are (stage 5).

    Example:
        >>> SearchSpace(formats=("xint8",), activation_observers=(PowerOfTwoMSE(),)).size
        1
    """

    formats: tuple[str, ...] = attrs.field(converter=_names)
    activation_observers: tuple[ObserverConfig, ...] = attrs.field(converter=_observers)
    weight_observers: tuple[ObserverConfig | None, ...] = attrs.field(default=(None,), converter=_weight_observers)
    corrections: tuple[tuple[AlgorithmConfig, ...], ...] = attrs.field(default=(), converter=_combinations)
    learned: tuple[AlgorithmConfig, ...] = attrs.field(default=(), converter=_algorithms)
    mixed_precision: tuple[MixedPrecisionConfig, ...] = attrs.field(default=(), converter=_mixed)
    wide_formats: tuple[str, ...] = attrs.field(default=(), converter=_names)

    def __attrs_post_init__(self) -> None:
        for field in ("formats", "activation_observers", "weight_observers"):
            if not getattr(self, field):
                raise ConfigError(f"search space: {field} is empty; allowed: one or more entries")
        for name in (*self.formats, *self.wide_formats):
            get_preset(name)  # an unknown name fails here, listing the presets
        for combination in self.corrections:
            kinds = [a.kind for a in combination]
            if not kinds or len(set(kinds)) != len(kinds) or {"mixed_precision", *_LEARNED_KINDS} & set(kinds):
                raise ConfigError(
                    f"search space: corrections entry {kinds}; allowed: non-empty combinations of cle, "
                    "activation_equalization, smoothquant, bias_correction, each kind once"
                )
        for algorithm in self.learned:
            if algorithm.kind not in _LEARNED_KINDS:
                raise ConfigError(f"search space: learned holds {algorithm.kind}; allowed: {', '.join(_LEARNED_KINDS)}")
        # A candidate's name is its recipe: the walk runs a name once, so two entries of an
        # axis that would name their candidates alike must not both be there.
        _check_unique("activation_observers", self.activation_observers, observer_label)
        _check_unique("weight_observers", self.weight_observers, lambda o: "" if o is None else observer_label(o))
        _check_unique("corrections", self.corrections, lambda c: "+".join(algorithm_label(a) for a in c))
        _check_unique("learned", self.learned, algorithm_label)
        _check_unique("mixed_precision", self.mixed_precision, algorithm_label)

    @property
    def size(self) -> int:
        """How many candidates a search of this space tries at most."""
        first = len(self.formats) * len(self.activation_observers) * len(self.weight_observers)
        later = len(self.corrections) + len(self.learned) + len(self.mixed_precision)
        return first + later + len(self.wide_formats)


def _check_unique(field: str, entries: Sequence[Any], label: Callable[[Any], str]) -> None:
    seen: dict[str, Any] = {}
    for entry in entries:
        name = label(entry)
        if name in seen:
            raise ConfigError(
                f"search space: {field} holds two entries named {name!r} ({seen[name]!r} and {entry!r}); "
                "allowed: entries whose names in a recipe differ"
            )
        seen[name] = entry


def default_space() -> SearchSpace:
    """The space for onnxruntime on x86 (``quant-onnx search``): ``a8w8``'s formats with
    five activation observers, then CLE, SmoothQuant, bias correction, GPTQ, AdaRound,
    AdaQuant, mixed precision to 30 and 40 dB output SQNR, and ``a16w8`` last.

    Example:
        >>> default_space().size
        15
    """
    return SearchSpace(
        formats=("a8w8",),
        activation_observers=(MinMax(), Percentile(99.999), Percentile(99.99), Entropy(), MSE()),
        corrections=CORRECTIONS,
        learned=LEARNED,
        mixed_precision=(
            MixedPrecisionConfig(accuracy_target=30.0),
            MixedPrecisionConfig(accuracy_target=40.0),
        ),
        wide_formats=("a16w8",),
    )


def power_of_two_space() -> SearchSpace:
    """The space of power-of-two symmetric formats (NPUs, ``quant-npu search``): ``xint8``
    with MinMSE, min-max and percentile activation positions and min-max or MinMSE weight
    positions, then the same algorithms; no 16-bit stage (the NPU's activations are 8-bit).

    Example:
        >>> power_of_two_space().size
        13
    """
    return SearchSpace(
        formats=("xint8",),
        activation_observers=(PowerOfTwoMSE(), MinMax(), Percentile(99.999)),
        weight_observers=(None, PowerOfTwoMSE()),
        corrections=CORRECTIONS,
        learned=LEARNED,
    )


@attrs.frozen
class Candidate:
    """One recipe: its name (``format/activation observer[/w:weight observer][+algorithm...]``),
    the whole config, its tier and expected cost.

    Example:
        >>> first = observer_stage(default_space(), CalibrationConfig())[0]
        >>> first.config.name, first.tier, first.cost
        ('a8w8/minmax', 0, 0.0)
    """

    name: str
    config: QuantConfig
    tier: int
    cost: float


def make_candidate(name: str, config: QuantConfig, tier: int) -> Candidate:
    """A candidate named ``name`` (also its config's name), its cost from :func:`expected_cost`.

    Example:
        >>> make_candidate("x", get_preset("xint8"), TIER_8BIT).cost
        1.5
    """
    config = config.evolve(name=name)
    return Candidate(name, config, tier, expected_cost(config))


def by_cost(found: Sequence[Candidate]) -> list[Candidate]:
    """``found`` by expected cost (ties keep their order)."""
    return sorted(found, key=lambda c: c.cost)


def expected_cost(config: QuantConfig) -> float:
    """The cost of ``config`` (module docstring), in calibration passes.

    Example:
        >>> expected_cost(get_preset("xint8_adaround"))  # power-of-two MinMSE, CLE, AdaRound
        573.5
    """
    methods = {s.observer.method for s in _activation_specs(config)}
    methods |= {s.observer.method for s in _weight_specs(config) if s.observer.method == "minmse_pow2"}
    observers = sum(OBSERVER_COST.get(m, 0.0) for m in methods)
    return observers + sum(ALGORITHM_COST.get(_cost_key(a), 0.0) for a in config.algorithms)


def _cost_key(algorithm: AlgorithmConfig) -> str:
    """An algorithm's row of :data:`ALGORITHM_COST`: its kind, the analytic bias correction apart."""
    label = algorithm_label(algorithm)
    return label if label in ALGORITHM_COST else algorithm.kind


def _operator_configs(config: QuantConfig) -> list[OperatorConfig]:
    return [config.global_config, *config.op_type_overrides.values(), *config.name_overrides.values()]


def _activation_specs(config: QuantConfig) -> list[QuantSpec]:
    return [s for op in _operator_configs(config) for s in (op.input, op.output) if s is not None and s.is_quantized]


def _weight_specs(config: QuantConfig) -> list[QuantSpec]:
    return [op.weight for op in _operator_configs(config) if op.weight is not None and op.weight.is_quantized]


def activation_and_weight_specs(config: QuantConfig) -> tuple[list[QuantSpec], list[QuantSpec]]:
    """The quantized activation specs and weight specs ``config`` names anywhere.

    Example:
        >>> [len(specs) for specs in activation_and_weight_specs(get_preset("a8w8"))]
        [2, 1]
    """
    return _activation_specs(config), _weight_specs(config)


def with_observers(
    config: QuantConfig, activation: ObserverConfig | None, weight: ObserverConfig | None = None
) -> QuantConfig:
    """``config`` with every quantized activation spec calibrated by ``activation`` and
    every quantized weight spec by ``weight`` (``None``: unchanged).

    Example:
        >>> cfg = with_observers(get_preset("a8w8"), Percentile(99.9))
        >>> cfg.global_config.input.observer
        Percentile(percentile=99.9, bins=2048)
    """

    def spec(s: QuantSpec | None, observer: ObserverConfig | None) -> QuantSpec | None:
        return s if s is None or observer is None or not s.is_quantized else s.evolve(observer=observer)

    def operator(op: OperatorConfig) -> OperatorConfig:
        return attrs.evolve(
            op, input=spec(op.input, activation), output=spec(op.output, activation), weight=spec(op.weight, weight)
        )

    return config.evolve(
        global_config=operator(config.global_config),
        op_type_overrides={k: operator(v) for k, v in config.op_type_overrides.items()},
        name_overrides={k: operator(v) for k, v in config.name_overrides.items()},
    )


def observer_label(observer: ObserverConfig) -> str:
    """Short name of an observer config in a candidate's name.

    Example:
        >>> observer_label(Percentile(99.99)), observer_label(PowerOfTwoMSE())
        ('percentile(99.99)', 'minmse_pow2')
        >>> observer_label(Entropy(bins=512))  # a setting that is not the default is named
        'entropy(bins=512)'
    """
    settings = [
        f"{field.name}={getattr(observer, field.name):.10g}"
        for field in attrs.fields(type(observer))
        if field.name != "percentile" and getattr(observer, field.name) != field.default
    ]
    if isinstance(observer, Percentile):
        settings.insert(0, f"{observer.percentile:.10g}")  # 99.99999 is not 100
    return f"{observer.method}({','.join(settings)})" if settings else observer.method


#: :func:`axis_is_flat`: the gap to the target, in spreads of the scores so far, beyond
#: which the rest of an axis is deferred.
FLAT_AXIS_FACTOR = 2.0


def axis_is_flat(scores: Sequence[float], target: float) -> bool:
    """Whether the scores of an axis's candidates so far (at least two distinct models)
    spread over less than 1/:data:`FLAT_AXIS_FACTOR` of what the best still misses the
    target by: the rest of the axis is then unlikely to hold the winner (module docstring).

    Example:
        >>> axis_is_flat([0.72, 0.71], 0.885)  # 0.01 apart, 0.165 short
        True
        >>> axis_is_flat([0.80, 0.86], 0.885)  # 0.06 apart, 0.025 short
        False
        >>> axis_is_flat([0.72], 0.885)  # one point says nothing about the spread
        False
    """
    if len(scores) < 2:
        return False
    best = max(scores)
    return target - best > FLAT_AXIS_FACTOR * (best - min(scores))


def observer_stage(space: SearchSpace, calibration: CalibrationConfig) -> list[Candidate]:
    """Stage 1: every format with every observer choice, no algorithm, by cost; each
    calibrated as ``calibration`` says (the later stages keep it).

    Example:
        >>> len(observer_stage(power_of_two_space(), CalibrationConfig()))
        6
    """
    found = []
    for format_name in space.formats:
        base = get_preset(format_name).evolve(algorithms=(), calibration=calibration)
        for activation in space.activation_observers:
            for weight in space.weight_observers:
                name = f"{format_name}/{observer_label(activation)}"
                if weight is not None:
                    name += f"/w:{observer_label(weight)}"
                found.append(make_candidate(name, with_observers(base, activation, weight), TIER_8BIT))
    return by_cost(found)


def refine(base: Candidate, additions: Sequence[Sequence[AlgorithmConfig]], tier: int = TIER_8BIT) -> list[Candidate]:
    """``base`` with each combination of ``additions`` added to its algorithms (a kind it
    already runs is replaced), by cost.

    Example:
        >>> base = observer_stage(default_space(), CalibrationConfig())[0]
        >>> [c.name for c in refine(base, [(ADAROUND,)])]
        ['a8w8/minmax+adaround']
    """
    found = []
    for addition in additions:
        kinds = {a.kind for a in addition}
        kept = tuple(a for a in base.config.algorithms if a.kind not in kinds)
        algorithms = (*kept, *addition)
        stem = base.name.split("+")[0]
        name = "+".join([stem, *(algorithm_label(a) for a in algorithms)])
        found.append(make_candidate(name, base.config.evolve(algorithms=algorithms), tier))
    return by_cost(found)


def wide_stage(space: SearchSpace, calibration: CalibrationConfig) -> list[Candidate]:
    """Stage 5: the 16-bit presets as they are, by cost.

    Example:
        >>> [c.name for c in wide_stage(default_space(), CalibrationConfig())]
        ['a16w8/minmax+gptq+bias_correction(analytic)']
    """
    found = []
    for format_name in space.wide_formats:
        preset = get_preset(format_name).evolve(calibration=calibration)
        methods = sorted({s.observer.method for s in _activation_specs(preset)})
        name = "+".join([f"{format_name}/{'/'.join(methods)}", *(algorithm_label(a) for a in preset.algorithms)])
        found.append(make_candidate(name, preset, TIER_16BIT))
    return by_cost(found)


def restrict(found: Sequence[Candidate], allowed: Callable[[QuantConfig], str | None]) -> list[Candidate]:
    """The candidates ``allowed(config) -> reason | None`` accepts, in order.

    Example:
        >>> found = observer_stage(default_space(), CalibrationConfig())
        >>> len(restrict(found, lambda c: "slow" if "mse" in c.name else None))
        4
    """
    return [c for c in found if allowed(c.config) is None]
