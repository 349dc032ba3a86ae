"""Auto mixed precision: raise the fewest, most sensitive layers to a wider format
until a score target is met, within a size budget.

The backend supplies ``evaluate(assignment) -> score`` where ``assignment`` maps the
raised layers to their :class:`PrecisionTarget` (every other layer stays at the base
format) and a higher score is better (output SQNR in dB, accuracy, agreement, ...).

Search:

1. **Sensitivity = gain when the layer alone is raised** (one evaluation per layer
   and target type, plus the all-base baseline). Raising alone, rather than quantizing
   alone in an otherwise float model, measures exactly what the greedy step buys: the
   improvement of the fully quantized model, interactions with the other quantized
   layers included, and it needs no float-execution path from the backend.
2. **Greedy forward pass**: raise layers in order of decreasing gain, re-evaluating
   after each, until ``accuracy_target`` is met; layers that would exceed
   ``size_budget`` are skipped, and at most ``max_layers`` are raised. Only layers
   with a positive gain are tried, and a raise that lowers the score is not kept, so a
   target out of reach ends at the best assignment the pass found, never below the
   baseline.
3. **Backward pruning** (only when the target was met): try dropping each raised layer,
   least sensitive first, and keep it dropped when the target still holds, so the
   result raises no layer it does not need.

Example:
    >>> from quant_core.algorithm_config import MixedPrecisionConfig
    >>> gains = {"conv1": 5.0, "conv2": 0.5, "dw3": 8.0}
    >>> score = lambda raised: 20.0 + sum(gains[n] for n in raised)
    >>> r = search_mixed_precision(list(gains), score, MixedPrecisionConfig(accuracy_target=28.0), quiet=True)
    >>> sorted(r.raised), r.score
    (['dw3'], 28.0)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import attrs
from tqdm.auto import tqdm

from quant_core.algorithm_config import MixedPrecisionConfig, PrecisionTarget
from quant_core.errors import ConfigError, ModelError
from quant_core.precision import raised_weight_bits

Assignment = Mapping[str, PrecisionTarget]

#: Weight bits of a layer whose base format the caller does not give.
DEFAULT_BASE_BITS = 8


@attrs.frozen
class Step:
    """One evaluation of the search: ``action`` is "baseline", "sensitivity", "raise"
    or "drop"; ``layer``/``target`` what changed; ``score`` the result; ``kept``
    whether the change stayed in the assignment."""

    action: str
    layer: str | None
    target: PrecisionTarget | None
    score: float
    kept: bool


@attrs.frozen
class MixedPrecisionResult:
    """Outcome of :func:`search_mixed_precision`.

    Attributes:
        raised: the layers raised and their formats (all others stay at the base format).
        baseline_score: score with no layer raised.
        score: score of ``raised``.
        target_met: whether ``score >= accuracy_target`` (None without a target).
        sensitivity: gain of raising each layer alone (best target type).
        ranking: layers by decreasing gain.
        size_ratio: model weight size relative to all-base (1.0 when nothing grows).
        trajectory: every evaluation, in order.
    """

    raised: dict[str, PrecisionTarget]
    baseline_score: float
    score: float
    target_met: bool | None
    sensitivity: dict[str, float]
    ranking: tuple[str, ...]
    size_ratio: float
    trajectory: tuple[Step, ...]

    @property
    def evaluations(self) -> int:
        return len(self.trajectory)


class _SizeModel:
    """Weight size of an assignment relative to all-base, in bytes: each layer's weight
    elements at its own base bits (int4 weights raised to 16 bits grow 4x, not 2x)."""

    def __init__(
        self, sizes: Mapping[str, float] | None, total: float | None, base_bits: Mapping[str, int] | None
    ) -> None:
        self.sizes = dict(sizes or {})
        self.bits = {name: (base_bits or {}).get(name, DEFAULT_BASE_BITS) for name in self.sizes}
        base = sum(count * self.bits[name] / 8 for name, count in self.sizes.items())
        self.total = float(total if total is not None else base)

    def ratio(self, assignment: Assignment) -> float:
        if self.total <= 0:
            return 1.0
        extra = 0.0
        for name, t in assignment.items():
            bits = self.bits.get(name, DEFAULT_BASE_BITS)
            extra += self.sizes.get(name, 0.0) * (raised_weight_bits(bits, t) - bits) / 8
        return (self.total + extra) / self.total


def search_mixed_precision(
    layers: Sequence[str],
    evaluate: Callable[[Assignment], float],
    config: MixedPrecisionConfig,
    sizes: Mapping[str, float] | None = None,
    total_size: float | None = None,
    base_bits: Mapping[str, int] | None = None,
    quiet: bool = False,
) -> MixedPrecisionResult:
    """Choose which layers to raise (see the module docstring for the search).

    Args:
        layers: candidate layer names (Conv/Gemm nodes).
        evaluate: score of an assignment (raised layers -> format); higher is better.
        config: target types, ``accuracy_target``, ``size_budget``, ``max_layers``.
        sizes: weight elements per layer; needed for ``size_budget``.
        total_size: the base model's size in bytes (default: the layers' weights at
            their base bits).
        base_bits: each layer's base weight bits (default 8).
        quiet: no progress bar.
    """
    names = list(dict.fromkeys(layers))
    if len(names) != len(layers):
        raise ModelError("layers: duplicate names")
    if config.size_budget is not None and sizes is None:
        raise ConfigError("sizes: needed when size_budget is set (weight size per layer)")
    size = _SizeModel(sizes, total_size, base_bits)
    target = config.accuracy_target
    trajectory: list[Step] = []
    # One bar per phase, each with a total known when it starts (it never grows).
    bar = tqdm(total=1 + len(names) * len(config.target_types), desc="mixed precision: sensitivity", disable=quiet)

    def next_phase(desc: str, total: int) -> None:
        nonlocal bar
        bar.close()
        bar = tqdm(total=total, desc=f"mixed precision: {desc}", disable=quiet)

    def score_of(assignment: Assignment, action: str, layer: str | None, t: PrecisionTarget | None) -> float:
        value = float(evaluate(dict(assignment)))
        trajectory.append(Step(action, layer, t, value, action != "sensitivity"))
        bar.update(1)
        return value

    def fits(assignment: Assignment) -> bool:
        return config.size_budget is None or size.ratio(assignment) <= config.size_budget + 1e-12

    def met(value: float) -> bool:
        return target is not None and value >= target

    try:
        baseline = score_of({}, "baseline", None, None)
        # Per layer, target types by decreasing gain (ties keep the config's order).
        options: dict[str, list[tuple[float, PrecisionTarget]]] = {}
        for name in names:
            scored = [(score_of({name: t}, "sensitivity", name, t) - baseline, t) for t in config.target_types]
            order = sorted(range(len(scored)), key=lambda i: (-scored[i][0], i))
            options[name] = [scored[i] for i in order]
        sensitivity = {name: options[name][0][0] for name in names}
        ranking = tuple(sorted(names, key=lambda n: (-sensitivity[n], names.index(n))))

        raised: dict[str, PrecisionTarget] = {}
        current = baseline
        limit = len(ranking) if config.max_layers is None else min(len(ranking), config.max_layers)
        next_phase("raise", limit)
        for name in ranking:
            if met(current) or (config.max_layers is not None and len(raised) >= config.max_layers):
                break
            if sensitivity[name] <= 0:  # raising it alone did not help: neither will it now
                break
            choice = next((t for _, t in options[name] if fits({**raised, name: t})), None)
            if choice is None:
                continue
            value = score_of({**raised, name: choice}, "raise", name, choice)
            if value < current:  # with the others raised it costs: not kept
                trajectory[-1] = attrs.evolve(trajectory[-1], kept=False)
                continue
            raised[name] = choice
            current = value

        if met(current):
            next_phase("pruning", len(raised))
            for name in sorted(raised, key=lambda n: (sensitivity[n], -ranking.index(n))):
                trial = {k: v for k, v in raised.items() if k != name}
                value = score_of(trial, "drop", name, raised[name])
                if met(value):
                    raised, current = trial, value
                else:
                    trajectory[-1] = attrs.evolve(trajectory[-1], kept=False)
    finally:
        bar.close()
    return MixedPrecisionResult(
        raised=raised,
        baseline_score=baseline,
        score=current,
        target_met=None if target is None else current >= target,
        sensitivity=sensitivity,
        ranking=ranking,
        size_ratio=size.ratio(raised),
        trajectory=tuple(trajectory),
    )
