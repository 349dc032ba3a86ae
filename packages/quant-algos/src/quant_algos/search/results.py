"""What a search found: one row per candidate (the Pareto table), the statistics passes
it shared, the winner and its held-out score.

Example:
    >>> row = CandidateResult("a8w8/minmax", None, 0, 0.0, "missed", 0.93, 0.93, 64, 1.2, 1000, 0.0, None, "", 0.5, "s0")
    >>> format_table([row]).splitlines()[2].split()[:3]
    ['1', 'a8w8/minmax', 'missed']
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from quant_algos.search.evaluation import lower_bound
from quant_core.atomic_io import atomic_write
from quant_core.config import QuantConfig
from quant_core.errors import ConfigError
from quant_core.serialization import report_json, to_data

#: Row statuses: the target was met; scored in full and missed; stopped early (the target
#: was out of reach); illegal on the deployment; failed (the recipe raised); skipped
#: (not enough budget left for its expected cost).
STATUSES = ("met", "missed", "stopped", "illegal", "failed", "skipped")


@attrs.frozen(eq=False)
class CandidateResult:
    """One candidate as the search measured it.

    Attributes:
        name: ``format/observer[+algorithm...]``.
        config: the whole recipe (``quant-onnx quantize --config`` or ``ModelQuantizer(config)`` runs it as is).
        tier, cost: the order's keys (:mod:`quant_algos.search.space`).
        status: one of :data:`STATUSES`.
        score: the metric on the selection part (``None`` if not scored in full).
        bound: the most the metric could have reached (``score`` when complete).
        samples: samples scored.
        latency_ms: time per evaluation batch (median) in the deployment's runtime
            (onnxruntime; torch for quant-torch-fx), ``None`` if not run.
        size_bytes: the deployed model's serialized size (ONNX bytes; torch: its ``state_dict``).
        wide_share: share of the quantized activation tensors (and layer inputs mixed
            precision requantizes) stored in 16 bits.
        legal: against the deployment's rules (``None``: it has none).
        legal_detail: what breaks them, or what legalising changed.
        seconds: wall time spent on this candidate (building, algorithms, scoring).
        statistics: where its qparams came from (the statistics pass it reused, or
            ``"calibrated"`` when its specs cannot be derived from histograms).
        error: the one-line error of a failed candidate.
        running: the metric over the ``samples`` scored (a per-sample metric; for a
            row stopped early, over the part of the selection samples it ran: the
            hardest ones when the float model's margins ordered them, so below what the
            row would score in full).
        same_as: the earlier candidate whose deployed model this one's is, byte for
            byte (its scores are that candidate's; it was not run again).
        pareto: on the Pareto front (:func:`mark_pareto`).
    """

    name: str
    config: QuantConfig | None
    tier: int
    cost: float
    status: str
    score: float | None
    bound: float | None
    samples: int
    latency_ms: float | None
    size_bytes: int | None
    wide_share: float | None
    legal: bool | None
    legal_detail: str
    seconds: float
    statistics: str
    error: str = ""
    running: float | None = None
    same_as: str = ""
    pareto: bool = False

    def to_dict(self) -> dict[str, Any]:
        data = attrs.asdict(self, recurse=False)
        data["config"] = None if self.config is None else to_data(self.config)
        return {key: _json(value) for key, value in data.items()}


@attrs.frozen
class StatisticsPass:
    """One pass of a float model over the calibration set that filled histograms of its
    tensors, and the candidates whose qparams were derived from them.

    Example:
        >>> StatisticsPass("none", 2048, 120, 1.5, ("a8w8/minmax",)).to_dict()["pre_passes"]
        'none'
    """

    pre_passes: str
    bins: int
    tensors: int
    seconds: float
    served: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self) | {"served": list(self.served)}


@attrs.frozen(eq=False)
class SearchResult:
    """What :func:`quant_onnx.search` and :func:`quant_torch_fx.search` return.

    Attributes:
        model: the chosen model as deployed (the winner's, else the best candidate's): an
            ``onnx.ModelProto`` from quant-onnx, a frozen ``nn.Module`` from quant-torch-fx.
        chosen: the chosen candidate's row (``None`` when no candidate could be built).
        met: whether ``chosen`` meets the target on the selection part.
        target, metric, deployment: what was searched for, and where.
        confidence: the confidence at which a per-sample metric's score had to meet the
            target (its lower bound did: :class:`~quant_algos.search.evaluation.Acceptance`);
            ``None`` for a whole-set metric, whose score itself had to.
        holdout_score: ``chosen`` re-scored on the held-out part the search never selected on.
        holdout_met: whether that score meets the target too.
        candidates: every row, in search order (the Pareto table).
        statistics: the statistics passes and what each served.
        stopped_by: ``"target"`` (a candidate met it), ``"budget"`` or ``"space"`` (none left).
        seconds: the whole search's wall time.
        reference_seconds: running the float model over the evaluation data.
        select_samples, holdout_samples: the split.
        reuse: what candidates shared and what scoring skipped: statistics passes, weight
            qparams selected once and reused, the candidates stopped early, those whose
            model an earlier candidate built (``same_model_as``), the observers deferred
            past the corrections (``deferred``; ``deferred_run``: those that ran after
            all), the samples scored against the samples a full scoring of each
            candidate would run.
        output_path: where the model was written (``None``: not written).
        report: the JSON report (also written when a report path was given).
        notes: what the search warned of (a target no score could meet...).
    """

    model: Any
    chosen: CandidateResult | None
    met: bool
    target: float
    metric: str
    deployment: str
    holdout_score: float | None
    holdout_met: bool | None
    candidates: tuple[CandidateResult, ...]
    statistics: tuple[StatisticsPass, ...]
    stopped_by: str
    seconds: float
    reference_seconds: float
    select_samples: int
    holdout_samples: int
    confidence: float | None = None
    reuse: dict[str, Any] = attrs.field(factory=dict)
    output_path: Path | None = None
    report: dict[str, Any] = attrs.field(factory=dict)
    notes: tuple[str, ...] = ()

    @property
    def select_lower_bound(self) -> float | None:
        """The lower confidence bound of the chosen candidate's selection score (what met
        the target), ``None`` for a whole-set metric or when nothing was scored."""
        if self.confidence is None or self.chosen is None or self.chosen.score is None:
            return None
        return lower_bound(self.chosen.score, self.chosen.samples, self.confidence)

    @property
    def winner(self) -> CandidateResult | None:
        """The candidate that met the target (``None``: none did)."""
        return self.chosen if self.met else None

    def to_dict(self) -> dict[str, Any]:
        """The JSON report."""
        return {
            "target": self.target,
            "metric": self.metric,
            "deployment": self.deployment,
            "met": self.met,
            "chosen": None if self.chosen is None else self.chosen.name,
            "select_score": None if self.chosen is None else _json(self.chosen.score),
            "confidence": self.confidence,
            "select_lower_bound": _json(self.select_lower_bound),
            "holdout_score": _json(self.holdout_score),
            "holdout_met": self.holdout_met,
            "split": {"select": self.select_samples, "holdout": self.holdout_samples},
            "stopped_by": self.stopped_by,
            "seconds": self.seconds,
            "reference_seconds": self.reference_seconds,
            "statistics_reused": [s.to_dict() for s in self.statistics],
            "reuse": dict(self.reuse),
            "candidates": [c.to_dict() for c in self.candidates],
            "output": None if self.output_path is None else str(self.output_path),
            "notes": list(self.notes),
        }


def _json(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def mark_pareto(rows: Sequence[CandidateResult]) -> list[CandidateResult]:
    """``rows`` with ``pareto`` set on each fully scored (and legal, where that is checked)
    row that no other such row beats on metric, latency and size at once (a row that
    repeats an earlier candidate's model is that candidate's point, not a second one).

    Example:
        >>> a = CandidateResult("a", None, 0, 0, "missed", 0.9, 0.9, 8, 1.0, 100, 0, None, "", 1, "")
        >>> b = attrs.evolve(a, name="b", score=0.8, latency_ms=2.0)
        >>> [r.pareto for r in mark_pareto([a, b])]
        [True, False]
    """

    def eligible(row: CandidateResult) -> bool:
        return row.score is not None and row.legal is not False and row.latency_ms is not None and not row.same_as

    def key(row: CandidateResult) -> tuple[float, float, float]:
        assert row.score is not None and row.latency_ms is not None
        return (-row.score, row.latency_ms, float(row.size_bytes or 0))

    scored = [r for r in rows if eligible(r)]
    marked = []
    for row in rows:
        dominated = eligible(row) and any(
            all(x <= y for x, y in zip(key(o), key(row), strict=True)) and key(o) != key(row) for o in scored
        )
        marked.append(attrs.evolve(row, pareto=eligible(row) and not dominated))
    return marked


def format_table(rows: Sequence[CandidateResult]) -> str:
    """The Pareto table as text: one line per candidate (``*`` marks the Pareto front,
    ``=#n`` a candidate whose model is row n's)."""
    header = f"{'#':>3} {'candidate':<44} {'status':<8} {'metric':>9} {'latency':>9} {'size':>9} {'16-bit':>7} {'npu':>5} {'time':>8}"
    lines = [header, "-" * len(header)]
    numbers = {row.name: number for number, row in enumerate(rows, 1)}
    for number, row in enumerate(rows, 1):
        if row.score is not None:
            metric = f"{row.score:.4f}"
        elif row.bound is not None:
            metric = f"<{row.bound:.4f}"
        else:
            metric = "-"
        latency = "-" if row.latency_ms is None else f"{row.latency_ms:.2f}ms"
        size = "-" if row.size_bytes is None else f"{row.size_bytes / 1024:.0f}KiB"
        wide = "-" if row.wide_share is None else f"{100 * row.wide_share:.0f}%"
        legal = "-" if row.legal is None else ("yes" if row.legal else "no")
        name = row.name + (" *" if row.pareto else "") + (f" =#{numbers[row.same_as]}" if row.same_as else "")
        lines.append(
            f"{number:>3} {name:<44} {row.status:<8} {metric:>9} {latency:>9} {size:>9} {wide:>7} {legal:>5} {row.seconds:>7.1f}s"
        )
    return "\n".join(lines)


def write_search_report(report: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write a search's JSON report (:meth:`SearchResult.to_dict`) atomically."""
    return atomic_write(path, report_json(report))


def check_report_path(path: str | os.PathLike[str] | None) -> None:
    """A one-line error when the report's folder does not exist (checked before any work).

    Example:
        >>> check_report_path("/no/such/folder/report.json")
        Traceback (most recent call last):
        ...
        quant_core.errors.ConfigError: report_path: folder '/no/such/folder' does not exist
    """
    if path is not None and not Path(path).resolve().parent.is_dir():
        raise ConfigError(f"report_path: folder '{Path(path).parent}' does not exist")
