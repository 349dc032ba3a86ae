"""The search loop, for both backends: candidates in order of expected cost
(:mod:`~quant_algos.search.space`), the first that meets the target on the selection part
of the evaluation data wins, the winner is re-scored on the held-out part, every row goes
into the Pareto table (:mod:`~quant_algos.search.results`).

A backend plugs in through :class:`Backend`: it builds a candidate (quantizes the model
with the candidate's config, sharing what it can between candidates: statistics passes,
pre-passes, weight qparams) and runs the result; everything else is decided here:

- **the order and the stages** (:func:`run_stages`): observers, then corrections, the
  observers a flat axis deferred, learned rounding, mixed precision, 16-bit;
- **early stopping**: a per-sample metric stops scoring a candidate as soon as even
  perfect remaining samples could not lift it to the target (an exact bound:
  :func:`~quant_algos.search.evaluation.score_outputs`), the samples the float model is
  least sure of first (:func:`~quant_algos.search.evaluation.hardest_first`), where a
  candidate's misses gather; a stage ranks its candidates on the samples they have in
  common;
- **the same model**: a candidate whose built model has the digest of one an earlier
  candidate built is not run again: its row repeats that candidate's scores (``same_as``);
- **the budget**: the first candidate always runs; later ones start while time is left
  and their expected cost, in measured statistics passes, fits what is left;
- **the acceptance** (:class:`Goal`): a per-sample metric meets the target when the lower
  confidence bound of its mean does (:class:`~quant_algos.search.evaluation.Acceptance`),
  so that the winner holds beyond the samples it was selected on;
- **the fallback and the held-out check** (:func:`conclude`): with no winner, the best
  candidate is scored in full and chosen; the chosen one is re-scored on the held-out part
  in the session it was scored in.

Example: see :func:`quant_onnx.search` and :func:`quant_torch_fx.search`.
"""

from __future__ import annotations

import logging
import os
import statistics as stats
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs
import numpy as np

from quant_algos.progress import progress_bar
from quant_algos.search.evaluation import (
    Acceptance,
    EvaluationData,
    Runner,
    Scored,
    check_metric,
    collect,
    hardest_first,
    lower_bound,
    prefix_better,
    score_outputs,
)
from quant_algos.search.metrics import Metric
from quant_algos.search.results import CandidateResult, SearchResult, StatisticsPass, mark_pareto, write_search_report
from quant_algos.search.space import (
    TIER_MIXED,
    Candidate,
    SearchSpace,
    axis_is_flat,
    observer_stage,
    refine,
    wide_stage,
)
from quant_core.algorithm_config import check_in_range
from quant_core.config import CalibrationConfig
from quant_core.errors import ConfigError, DataError, one_line

_LOG = logging.getLogger(__name__)


@attrs.frozen(eq=False)
class Build:
    """A candidate as a backend built it, before it is run.

    Attributes:
        model: the model as deployed (what :attr:`SearchResult.model` holds if it is chosen).
        digest: bytes that are equal exactly when two builds are the same model.
        size_bytes, wide_share, legal, legal_detail, statistics: the row's columns
            (:class:`~quant_algos.search.results.CandidateResult`).

    Example:
        >>> Build(None, b"x", 10, 0.0, None, "", "calibrated").legal is None
        True
    """

    model: Any
    digest: bytes
    size_bytes: int
    wide_share: float
    legal: bool | None
    legal_detail: str
    statistics: str

    def columns(self) -> dict[str, Any]:
        return {
            "size_bytes": self.size_bytes,
            "wide_share": self.wide_share,
            "legal": self.legal,
            "legal_detail": self.legal_detail,
            "statistics": self.statistics,
        }


class Backend(Protocol):
    """What the loop needs from a backend (module docstring)."""

    @property
    def name(self) -> str:
        """The report's ``deployment``: ``onnxruntime``, ``torch:xint8``..."""

    @property
    def requires_legal(self) -> bool:
        """Whether a build must be legal (``Build.legal``) to be scored."""

    @property
    def pass_seconds(self) -> Sequence[float]:
        """The measured statistics passes so far (the budget's unit of time)."""

    def allows(self, config: Any) -> str | None:
        """Why ``config`` cannot be built here (one line), or ``None``."""

    def build(self, candidate: Candidate) -> Build:
        """Quantize (and deploy) ``candidate``; raises ValueError, ImportError or RuntimeError."""

    def runner(self, build: Build) -> Runner:
        """Runs the built model on a batch of feeds."""

    def latency_ms(self, build: Build, runner: Runner, feeds: Mapping[str, np.ndarray], scored: Scored) -> float:
        """The median time of one evaluation batch (``feeds``) of the built model."""

    def statistics(self) -> tuple[StatisticsPass, ...]:
        """The statistics passes and what each served, for the report."""

    def reuse(self) -> dict[str, Any]:
        """What the candidates shared, for the report."""


def check_arguments(
    target: Any,
    budget_s: Any,
    confidence: Any = 0.9,
    eval_batch_size: Any = 32,
    eval_samples: Any = None,
    *,
    seed: Any = 0,
) -> Acceptance:
    """The search's :class:`~quant_algos.search.evaluation.Acceptance`, or one-line errors
    for a ``target`` that is not a finite number, a ``budget_s`` that is not positive, a
    ``confidence`` out of range, an evaluation batch size or sample count below 1, or a
    held-out split ``seed`` numpy cannot take (not an integer >= 0), before any work (both
    backends' searches call it).

    Example:
        >>> check_arguments(float("nan"), None)
        Traceback (most recent call last):
        ...
        quant_core.errors.ConfigError: target: nan is not allowed; allowed: a finite number
    """
    if isinstance(target, bool) or not isinstance(target, int | float) or not np.isfinite(target):
        raise ConfigError(f"target: {target!r} is not allowed; allowed: a finite number")
    if budget_s is not None and not budget_s > 0:
        raise ConfigError(f"budget_s: {budget_s!r} is out of range; allowed: a number > 0")
    check_in_range("eval_batch_size", eval_batch_size, lambda v: isinstance(v, int) and v >= 1, "an integer >= 1")
    check_in_range(
        "eval_samples", eval_samples, lambda v: v is None or (isinstance(v, int) and v >= 1), "null or an integer >= 1"
    )
    check_in_range("seed", seed, lambda v: isinstance(v, int | np.integer) and v >= 0, "an integer >= 0")
    return Acceptance(float(target), confidence)


@attrs.frozen(eq=False)
class Goal:
    """What every candidate is scored against and when one wins: the evaluation data and
    its split, the float model's outputs on every sample (run once), the output names, the
    metric, the acceptance (target and confidence), ``selection``, the selection part in the
    order every candidate scores it, ``by_margin``, whether that order is the float model's
    least certain samples first (:func:`hardest_first`), and ``notes``, what the search
    warned of before it started (also logged; the report keeps them).

    Example: see :func:`float_goal`.
    """

    evaluation: EvaluationData
    reference: Sequence[np.ndarray]
    output_names: Sequence[str]
    metric: Metric
    acceptance: Acceptance
    selection: np.ndarray
    by_margin: bool
    notes: tuple[str, ...] = ()

    @property
    def target(self) -> float:
        return self.acceptance.target

    def score(self, runner: Runner, indices: np.ndarray, *, early_stop: bool) -> Scored:
        """``runner`` scored on ``indices``; ``early_stop``: stop once it cannot be accepted."""
        acceptance = self.acceptance if early_stop else None
        return score_outputs(
            runner, self.output_names, self.reference, self.metric, self.evaluation, indices, acceptance=acceptance
        )

    def estimate(self, scored: Scored) -> float | None:
        """What the flat-observer test takes a candidate's score over the whole selection
        part to be: its score when complete; when it stopped early, its bound if the hardest
        samples came first (those left are the ones it is least likely to miss; the bound
        is never below the full score, so the test defers less, never more), else the mean
        over the samples it ran (in index order the bound would flatter it)."""
        if scored.score is not None:
            return scored.score
        return scored.bound if self.by_margin else scored.running

    def met(self, scored: Scored) -> bool:
        """Whether a complete score is accepted (:class:`~quant_algos.search.evaluation.Acceptance`)."""
        if not scored.complete or scored.score is None:
            return False
        return self.acceptance.meets(scored.score, scored.samples, per_sample=self.metric.per_sample)


@attrs.frozen
class Budget:
    """The search's time limit (``seconds``; ``None``: none), its clock and when it started.

    Example:
        >>> Budget(10.0, lambda: 4.0, 1.0).elapsed()
        3.0
    """

    seconds: float | None
    clock: Callable[[], float]
    started: float

    def elapsed(self) -> float:
        return self.clock() - self.started


def float_goal(
    run: Runner,
    evaluation: EvaluationData,
    metric: Metric,
    acceptance: Acceptance,
    output_names: Sequence[str] | None = None,
) -> tuple[Goal, float]:
    """The :class:`Goal` of a search and the seconds the float model took: the float
    model's outputs on every evaluation sample (run once; every candidate is scored
    against them), the output names (``None``: ``output_0``, ``output_1``...) and the
    scoring order of the selection part (:func:`hardest_first`); the metric is tried on
    them first (``check_metric``), so a metric that cannot work fails before
    any candidate is built.

    Example:
        >>> from quant_algos.search.evaluation import evaluation_data
        >>> from quant_algos.search.metrics import resolve_metric
        >>> data = evaluation_data({"x": np.eye(4, dtype=np.float32)}, holdout=0.0)
        >>> goal, _ = float_goal(lambda feeds: [feeds["x"]], data, resolve_metric(None), Acceptance(0.6))
        >>> goal.output_names, goal.reference[0].shape, goal.target
        (['output_0'], (4, 4), 0.6)
    """
    started = time.perf_counter()
    reference = collect(run, evaluation, np.arange(evaluation.count), output_names)
    seconds = time.perf_counter() - started
    names = list(output_names) if output_names is not None else [f"output_{i}" for i in range(len(reference))]
    check_metric(metric, names, reference, evaluation)
    count = len(evaluation.select)
    notes = []
    if metric.per_sample and not acceptance.reachable(1.0, count):
        # Legal (a walk over the whole space), but every candidate then stops after one
        # batch and the fallback ranks them on it: say so before the search starts.
        best = lower_bound(1.0, count, acceptance.confidence)
        notes.append(
            f"target: {acceptance.target:g} cannot be met on {count} selection samples at confidence "
            f"{acceptance.confidence:g} (a perfect score's lower bound is {best:.4f}), so every candidate stops "
            f"after one batch and the best is chosen on it; a target up to {best:.4f}, a lower confidence or more "
            "evaluation samples make the search score them"
        )
        _LOG.warning(notes[-1])
    order = hardest_first(reference, evaluation.select) if metric.per_sample else None
    selection = evaluation.select if order is None else order
    goal = Goal(evaluation, reference, names, metric, acceptance, selection, order is not None, tuple(notes))
    return goal, seconds


def with_report(result: SearchResult, report_path: str | os.PathLike[str] | None) -> SearchResult:
    """``result`` with its JSON report (:meth:`SearchResult.to_dict`), also written to
    ``report_path`` when given."""
    report = result.to_dict()
    if report_path is not None:
        write_search_report(report, report_path)
    return attrs.evolve(result, report=report)


def median_batch_ms(run: Runner, feeds: Mapping[str, np.ndarray], timed: Sequence[float], runs: int = 3) -> float:
    """Median time of a batch: the scoring runs after the first (which warms the runtime
    up), topped up with runs of ``feeds`` to ``runs``.

    Example:
        >>> median_batch_ms(lambda feeds: [], {}, (9.0, 0.002, 0.004, 0.003))
        3.0
    """
    seconds = list(timed[1:])
    if not timed:
        run(feeds)
    while len(seconds) < runs:
        started = time.perf_counter()
        run(feeds)
        seconds.append(time.perf_counter() - started)
    return 1000.0 * stats.median(seconds)


@attrs.frozen(eq=False)
class _Built:
    """A candidate as built and the runner it was scored in (kept for the winner and the
    best so far only: the held-out part runs in the same runner)."""

    build: Build
    runner: Runner


def _row(candidate: Candidate, status: str, **fields: Any) -> CandidateResult:
    values: dict[str, Any] = {
        "score": None,
        "bound": None,
        "samples": 0,
        "latency_ms": None,
        "size_bytes": None,
        "wide_share": None,
        "legal": None,
        "legal_detail": "",
        "seconds": 0.0,
        "statistics": "",
        "error": "",
    }
    values.update(fields)
    return CandidateResult(candidate.name, candidate.config, candidate.tier, candidate.cost, status, **values)


def run_stages(walk: Walk, space: SearchSpace | Sequence[Candidate], calibration: CalibrationConfig) -> None:
    """A list of candidates in its order, or the stages of ``search.space``, each on the
    best recipe the earlier found (observers a flat observer axis deferred run after the
    corrections)."""
    if isinstance(space, Sequence):
        walk.stage(list(space), rank=False)
        return
    observers = observer_stage(space, calibration)
    best = walk.stage(observers, rank=True, defer=True)
    if best is None or walk.done:
        return
    corrected = walk.stage(refine(best, space.corrections), rank=True)
    best = corrected if corrected is not None and walk.better(corrected, best) else best
    if walk.done:
        return
    deferred = walk.stage([c for c in observers if c.name in walk.deferred], rank=True)
    best = deferred if deferred is not None and walk.better(deferred, best) else best
    if walk.done:
        return
    walk.stage(refine(best, [(a,) for a in space.learned]), rank=False)
    if walk.done:
        return
    walk.stage(refine(best, [(mp,) for mp in space.mixed_precision], TIER_MIXED), rank=False)
    if walk.done:
        return
    walk.stage(wide_stage(space, calibration), rank=False)


def search_with(
    backend: Backend,
    goal: Goal,
    space: SearchSpace | Sequence[Candidate],
    calibration: CalibrationConfig,
    *,
    budget: Budget,
    reference_seconds: float,
    quiet: bool,
) -> SearchResult:
    """Walk ``space`` with ``backend`` and conclude (module docstring); the result has no
    output path or report yet (the backend writes its model)."""
    walk = Walk(backend, goal, budget)
    with progress_bar(total=None, desc="searching", unit="recipe", quiet=quiet) as bar:
        walk.bar = bar
        run_stages(walk, space, calibration)
    return conclude(walk, reference_seconds)


def conclude(walk: Walk, reference_seconds: float) -> SearchResult:
    """The result of a finished walk: the winner, else the best candidate scored in full;
    the chosen one re-scored on the held-out part; the Pareto front marked."""
    goal = walk.goal
    rows = walk.rows
    chosen = walk.winner
    best = walk.best
    stopped_by = "target" if chosen is not None else ("budget" if walk.out_of_budget or walk.over_budget else "space")

    def score(built: _Built, indices: np.ndarray) -> Scored:
        # The candidate's own runner (built once), not a second one.
        return goal.score(built.runner, indices, early_stop=False)

    met = chosen is not None
    if chosen is None and best is not None:
        row, built = best
        if row.score is None:  # stopped early: score it in full to report what it reaches
            scored = score(built, goal.selection)
            full: dict[str, Any] = {
                "status": "missed",  # scored in full now, and below the target (else it had met)
                "score": scored.score,
                "bound": scored.bound,
                "samples": scored.samples,
                "running": scored.running,
            }
            row = attrs.evolve(row, **full)
            # Rows of the same model carry its scores: they change with it.
            rows = [
                row if r.name == row.name else attrs.evolve(r, **full) if r.same_as == row.name else r for r in rows
            ]
        chosen = (row, built)
    holdout_score = holdout_met = None
    if chosen is not None and len(goal.evaluation.holdout):
        holdout_score = score(chosen[1], goal.evaluation.holdout).score
        holdout_met = holdout_score is not None and holdout_score >= goal.target
    rows = mark_pareto(rows)
    chosen_row = None if chosen is None else next(r for r in rows if r.name == chosen[0].name)
    return SearchResult(
        model=None if chosen is None else chosen[1].build.model,
        chosen=chosen_row,
        met=met,
        target=goal.target,
        confidence=goal.acceptance.confidence if goal.metric.per_sample else None,
        metric=goal.metric.name,
        deployment=walk.backend.name,
        holdout_score=holdout_score,
        holdout_met=holdout_met,
        candidates=tuple(rows),
        statistics=walk.backend.statistics(),
        stopped_by=stopped_by,
        seconds=walk.budget.elapsed(),
        reference_seconds=reference_seconds,
        select_samples=len(goal.evaluation.select),
        holdout_samples=len(goal.evaluation.holdout),
        reuse=walk.backend.reuse() | walk.early_stops(rows),
        notes=tuple(goal.notes),
    )


class Walk:
    """Runs candidates stage by stage, keeps the rows, the winner and the best so far."""

    def __init__(self, backend: Backend, goal: Goal, budget: Budget) -> None:
        self.backend = backend
        self.goal = goal
        self.budget = budget
        self.rows: list[CandidateResult] = []
        self.scored: dict[str, Scored] = {}
        self.built: dict[bytes, tuple[str, Scored, float]] = {}  # model digest -> first builder
        self.winner: tuple[CandidateResult, _Built] | None = None
        self.best: tuple[CandidateResult, _Built] | None = None
        self.out_of_budget = False
        self.over_budget = False  # a candidate was skipped for its expected cost
        self.deferred: list[str] = []
        self.bar: Any = None

    @property
    def done(self) -> bool:
        return self.winner is not None or self.out_of_budget

    def better(self, challenger: Candidate, incumbent: Candidate) -> bool:
        """Whether ``challenger`` scored above ``incumbent``: a per-sample metric compares
        the samples both ran (the common prefix of the selection part, the whole of it
        when both ran it all), a whole-set metric the scores; ties keep the incumbent.
        The fallback ranks rows the same way: nothing is assumed of samples a row did not
        run."""
        return self._scored_above(challenger.name, incumbent.name)

    def _scored_above(self, challenger: str, incumbent: str) -> bool:
        new, old = self.scored.get(challenger), self.scored.get(incumbent)
        if new is None:
            return False
        if old is None:
            return True
        if new.sample_scores is not None and old.sample_scores is not None:
            return prefix_better(new.sample_scores, old.sample_scores)
        return new.score is not None and (old.score is None or new.score > old.score)

    def early_stops(self, rows: Sequence[CandidateResult] | None = None) -> dict[str, Any]:
        """How much scoring the exact early stop saved, for the report (``rows``: the final
        rows, where the fallback re-scored one in full; default the walk's own)."""
        rows = self.rows if rows is None else rows
        stopped = [row for row in rows if row.status == "stopped"]
        run = [row for row in rows if row.samples and not row.same_as]
        return {
            "deferred": list(self.deferred),  # past the corrections; those run later have rows
            "deferred_run": [name for name in self.deferred if any(row.name == name for row in rows)],
            "stopped_early": [row.name for row in stopped],
            "same_model_as": {row.name: row.same_as for row in rows if row.same_as},
            "samples_scored": sum(row.samples for row in run),
            "samples_if_scored_in_full": len(run) * len(self.goal.evaluation.select),
        }

    def stage(self, found: Sequence[Candidate], *, rank: bool, defer: bool = False) -> Candidate | None:
        """Run ``found`` in order until one meets the target; returns the best scored
        candidate of the stage (``rank``: ranked on the samples candidates have in
        common, :meth:`better`; otherwise ``None``). ``defer``: once the stage's scores
        are flat (``space.axis_is_flat``), the rest go to :attr:`deferred` unrun."""
        best: Candidate | None = None
        distinct: list[float] = []
        for position, candidate in enumerate(found):
            if self.done:
                break
            if defer and axis_is_flat(distinct, self.goal.target):
                self.deferred = [c.name for c in found[position:]]
                break
            if any(row.name == candidate.name for row in self.rows):
                continue  # a later stage proposed a recipe an earlier one ran
            reason = self.backend.allows(candidate.config)
            if reason is not None:
                self.rows.append(_row(candidate, "skipped", error=f"{self.backend.name}: {reason}"))
                continue
            if not self._fits(candidate):
                continue
            if self.bar is not None:
                self.bar.set_postfix_str(candidate.name)
            row, built = self._run(candidate)
            self.rows.append(row)
            if self.bar is not None:
                self.bar.update(1)
            if rank and candidate.name in self.scored and (best is None or self.better(candidate, best)):
                best = candidate
            if candidate.name in self.scored and not row.same_as:
                estimate = self.goal.estimate(self.scored[candidate.name])
                distinct.extend([] if estimate is None else [estimate])
            if built is None or row.status not in ("met", "missed", "stopped"):
                continue
            if self.best is None or self._scored_above(row.name, self.best[0].name):
                self.best = (row, built)
            if row.status == "met":
                self.winner = (row, built)
        return best

    def _fits(self, candidate: Candidate) -> bool:
        """The budget rule: the first candidate that can run always runs (one the backend
        refused does not count); later ones start while time is left and their expected
        cost (in measured statistics passes) fits what is left."""
        limit = self.budget.seconds
        if limit is None or all(row.status == "skipped" for row in self.rows):
            return True
        elapsed = self.budget.elapsed()
        if elapsed >= limit:
            self.out_of_budget = True
            return False
        passes = self.backend.pass_seconds
        if passes:
            expected = candidate.cost * stats.median(passes)
            if expected > limit - elapsed:
                self.over_budget = True
                self.rows.append(
                    _row(candidate, "skipped", error=f"expected {expected:.0f} s; {limit - elapsed:.0f} s left")
                )
                return False
        return True

    def _run(self, candidate: Candidate) -> tuple[CandidateResult, _Built | None]:
        """Build and score one candidate; a recipe that fails is a row, not the end. Bad
        calibration data, which every candidate's build reads, ends the search (a user's
        metric that fails on one candidate's outputs fails that row)."""
        started = time.perf_counter()

        def failed(exc: Exception) -> tuple[CandidateResult, None]:
            return _row(candidate, "failed", seconds=time.perf_counter() - started, error=one_line(str(exc))), None

        try:
            build = self.backend.build(candidate)
        except DataError:
            raise
        except (ValueError, ImportError, RuntimeError) as exc:
            return failed(exc)
        try:
            columns = build.columns()
            if build.legal is False and self.backend.requires_legal:
                return _row(candidate, "illegal", seconds=time.perf_counter() - started, **columns), None
            if build.digest in self.built:  # the same model scores the same: do not run it again
                name, scored, latency = self.built[build.digest]
                self.scored[candidate.name] = scored
                row = self._scored_row(candidate, scored, latency, started, columns)
                return attrs.evolve(row, same_as=name), None
            runner = self.backend.runner(build)
            evaluation = self.goal.evaluation
            scored = self.goal.score(runner, self.goal.selection, early_stop=True)
            first = evaluation.feeds(evaluation.chunks(self.goal.selection)[0])
            latency = self.backend.latency_ms(build, runner, first, scored)
        except (ValueError, ImportError, RuntimeError) as exc:
            return failed(exc)
        self.scored[candidate.name] = scored
        self.built[build.digest] = (candidate.name, scored, latency)
        return self._scored_row(candidate, scored, latency, started, columns), _Built(build, runner)

    def _scored_row(
        self, candidate: Candidate, scored: Scored, latency: float, started: float, columns: Mapping[str, Any]
    ) -> CandidateResult:
        if not scored.complete or scored.score is None:
            status = "stopped"
        else:
            status = "met" if self.goal.met(scored) else "missed"
        return _row(
            candidate,
            status,
            score=scored.score,
            bound=scored.bound,
            samples=scored.samples,
            running=scored.running,
            latency_ms=latency,
            seconds=time.perf_counter() - started,
            **columns,
        )


def latency_runs(scored: Scored) -> int:
    """How many batch times the latency column takes: a row stopped early is off the
    Pareto front (no score), one warm batch time is enough for its column, and it does not
    run batches it skipped scoring.

    Example:
        >>> latency_runs(Scored(None, 0.5, 32, False, ()))
        1
    """
    return 3 if scored.complete else 1
