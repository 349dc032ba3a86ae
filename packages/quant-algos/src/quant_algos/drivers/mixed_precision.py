"""Auto mixed precision on any backend: the search
(:func:`quant_algos.mixed_precision.search_mixed_precision`) over candidates the backend
builds and scores.

The backend supplies ``build(assignment) -> model`` (its quantizer with the raised
layers' formats: ``quant_core.precision.raised_config``, qparams from the calibration it
already did) and ``score(model) -> float`` (output SQNR against the float model, or the
user's metric; higher is better). The returned model is ``build`` of the chosen
assignment; the report gives the search's and the final scores.

Example:
    >>> from quant_core.algorithm_config import MixedPrecisionConfig
    >>> gains = {"a": 5.0, "b": 0.5}
    >>> model, report = run_mixed_precision(
    ...     ["a", "b"], lambda raised: sorted(raised), lambda m: 20.0 + sum(gains[n] for n in m),
    ...     MixedPrecisionConfig(accuracy_target=24.0), quiet=True)
    >>> model, report.raised, report.final_score
    (['a'], {'a': 'a16w8'}, 25.0)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import attrs

from quant_algos.mixed_precision import Assignment, search_mixed_precision
from quant_core.algorithm_config import MixedPrecisionConfig

M = TypeVar("M")


@attrs.frozen
class MixedPrecisionReport:
    """What :func:`run_mixed_precision` did.

    Attributes:
        raised: layer -> format value ("a16w8", ...), the layers that changed.
        baseline_score: score of the all-base model (SQNR dB or the user's metric).
        search_score: score of the chosen assignment as evaluated during the search.
        final_score: score of the returned model.
        target_met: whether ``final_score >= accuracy_target`` (None without a target).
        size_ratio: weight size relative to the all-base model.
        sensitivity: gain of raising each layer alone.
        evaluations: evaluations the search made.
        notes: what the backend had to say (formats, domains, layers left out).

    Example:
        >>> MixedPrecisionReport({"conv": "a16w8"}, 20.0, 31.0, 31.0, True, 1.0, {}, 5, ()).to_dict()["raised"]
        {'conv': 'a16w8'}
    """

    raised: dict[str, str]
    baseline_score: float
    search_score: float
    final_score: float
    target_met: bool | None
    size_ratio: float
    sensitivity: dict[str, float]
    evaluations: int
    notes: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self, recurse=False) | {"notes": list(self.notes)}


def run_mixed_precision(
    layers: Sequence[str],
    build: Callable[[Assignment], M],
    score: Callable[[M], float],
    config: MixedPrecisionConfig,
    *,
    sizes: Mapping[str, float] | None = None,
    total_size: float | None = None,
    base_bits: Mapping[str, int] | None = None,
    notes: Sequence[str] = (),
    quiet: bool = False,
) -> tuple[M, MixedPrecisionReport]:
    """Raise the fewest, most sensitive ``layers`` (see the module docstring)."""
    result = search_mixed_precision(
        list(layers),
        lambda assignment: score(build(assignment)),
        config,
        sizes=sizes,
        total_size=total_size,
        base_bits=base_bits,
        quiet=quiet,
    )
    final = build(dict(result.raised))
    final_score = score(final) if result.raised else result.baseline_score
    target = config.accuracy_target
    report = MixedPrecisionReport(
        raised={name: t.value for name, t in result.raised.items()},
        baseline_score=result.baseline_score,
        search_score=result.score,
        final_score=final_score,
        target_met=None if target is None else final_score >= target,
        size_ratio=result.size_ratio,
        sensitivity=dict(result.sensitivity),
        evaluations=result.evaluations,
        notes=tuple(notes),
    )
    return final, report
