"""The search loop: candidates in order of expected cost, the first that meets the target
on the selection part of the evaluation data wins, the winner is re-scored on the
held-out part.

What it shares between candidates:

- **one statistics pass per float model**: the float model (after a candidate's CLE or
  SmoothQuant, which change it) runs once over the calibration set, filling a histogram
  per tensor (:func:`~quant_onnx.pipeline.calibrate.collect_statistics`); every
  candidate on that float model gets its observers derived from those histograms
  (:func:`quant_core.plan.observers_from_statistics`): the same qparams, bit for bit, as
  its own calibration would give, for every derivable spec (per-tensor min-max,
  percentile, entropy, MSE, power-of-two MinMSE). A candidate whose specs cannot be
  derived calibrates itself (the report says ``"calibrated"``);
- **the pre-passes**: candidates with the same CLE/SmoothQuant settings share the edited
  float model;
- **the weights' qparams**: a weight's range is selected once per spec on each float
  model (power-of-two MinMSE over every weight costs about a calibration pass on a small
  model), whichever candidates ask for it;
- **the float model's outputs** on the evaluation data (one run);
- **early stopping**: a per-sample metric stops scoring a candidate as soon as even
  perfect remaining samples could not lift it to the target (an exact bound: a candidate
  stopped early scores below the target on the whole selection part). A stage ranks its
  candidates on the samples they have in common (each scores the selection part in the
  same order), so ranking does not force a hopeless candidate through the whole set;
- **the same model**: a candidate whose deployed model is byte for byte one an earlier
  candidate built (observer choices often select the same power-of-two scales) is not
  run again: its row repeats that candidate's scores and says so (``same_as``);
- **the winner's session**: it scores the held-out part too. Every candidate is built and
  run in memory (an onnxruntime session on the serialized ModelProto): no file is written
  before the chosen model.

Algorithms after calibration (bias correction, mixed precision, AdaRound, AdaQuant) run
only on the candidates that list them. Each candidate is what
:class:`~quant_onnx.api.ModelQuantizer` writes for its config, so the chosen model is
bit for bit ``quant-onnx quantize --config`` of the winning recipe (deployed, for an NPU,
as legalised).

Example: see :func:`quant_onnx.search`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import statistics as stats
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import onnx

from quant_algos.drivers.schedule import schedule
from quant_algos.progress import progress_bar
from quant_core.config import CalibrationConfig
from quant_core.errors import ConfigError, one_line
from quant_core.observers.derived import DEFAULT_STATISTICS_BINS, derivable, statistics_bins
from quant_core.observers.histogram import HistogramObserver
from quant_core.onnx_qdq.model_io import check_output_paths, load_model, save_model
from quant_core.plan import QuantPlan, WeightCache, observer_feeds, observer_specs, observers_from_statistics
from quant_core.plan.calibrated import DerivedCache
from quant_onnx.api import ModelQuantizer, PreparedModel
from quant_onnx.data import CalibrationReader, ImageOptions
from quant_onnx.pipeline.calibrate import CalibratedModel, collect_statistics, from_filled_observers
from quant_onnx.recipe_search.deployment import Deployment, Finished, OnnxRuntime, onnxruntime_runner
from quant_onnx.recipe_search.evaluation import (
    EvaluationData,
    Runner,
    Scored,
    check_metric,
    collect,
    load_evaluation_data,
    prefix_better,
    score_outputs,
)
from quant_onnx.recipe_search.metrics import Metric, MetricFunction, resolve_metric
from quant_onnx.recipe_search.results import CandidateResult, SearchResult, StatisticsPass, format_table, mark_pareto
from quant_onnx.recipe_search.space import (
    TIER_MIXED,
    Candidate,
    SearchSpace,
    axis_is_flat,
    observer_stage,
    refine,
    wide_stage,
)
from quant_onnx.reporting.report import write_report

_LOG = logging.getLogger("quant_onnx")
PreKey = tuple[int, tuple[Any, ...]]


def wide_share(plan: QuantPlan) -> float:
    """Share of the plan's quantized activation tensors (groups and per-layer input
    requantizations) stored in 16 bits or more.

    Example:
        >>> wide_share(QuantPlan((), (), (), (), (), ()))
        0.0
    """
    specs = [g.spec for g in plan.groups] + [r.spec for r in plan.requants]
    return 0.0 if not specs else sum(s.dtype.bits >= 16 for s in specs) / len(specs)


def _pre_label(pre_passes: Sequence[Any]) -> str:
    return "+".join(a.kind for a in pre_passes) or "none"


@attrs.define
class _Shared:
    """What candidates share: prepared float models, pre-passes, statistics."""

    source: onnx.ModelProto
    feeds: list[dict[str, np.ndarray]]
    quiet: bool
    prepared: dict[int, PreparedModel] = attrs.field(factory=dict)
    pre: dict[PreKey, tuple[PreparedModel, dict[str, Any]]] = attrs.field(factory=dict)
    statistics: dict[tuple[PreKey, int], dict[str, HistogramObserver]] = attrs.field(factory=dict)
    derived: dict[tuple[PreKey, int], DerivedCache] = attrs.field(factory=dict)
    passes: dict[tuple[PreKey, int], StatisticsPass] = attrs.field(factory=dict)
    pass_seconds: list[float] = attrs.field(factory=list)
    weights: dict[PreKey, WeightCache] = attrs.field(factory=dict)
    weight_lookups: int = 0

    def base(self, quantizer: ModelQuantizer) -> PreparedModel:
        opset = quantizer.required_opset()
        if opset not in self.prepared:
            self.prepared[opset] = quantizer.prepare(self.source)
        return self.prepared[opset]

    def key(self, quantizer: ModelQuantizer) -> PreKey:
        return (quantizer.required_opset(), schedule(quantizer.config).before_calibration)

    def after_pre_passes(self, quantizer: ModelQuantizer) -> PreparedModel:
        """The candidate's prepared model after its CLE/SmoothQuant (shared by key)."""
        key = self.key(quantizer)
        base = self.base(quantizer)
        if not key[1]:
            return quantizer.replan(base.model, base.preprocess_changes)
        if key not in self.pre:
            self.pre[key] = quantizer.run_pre_passes(quantizer.replan(base.model, base.preprocess_changes), self.feeds)
        edited, reports = self.pre[key]
        return quantizer.replan(edited.model, edited.preprocess_changes) if reports else edited

    def calibrated(
        self, quantizer: ModelQuantizer, candidate: Candidate, prepared: PreparedModel
    ) -> tuple[CalibratedModel, str]:
        """The candidate's calibrated model: derived from the statistics of its float model
        when its specs are derivable (a pass over the calibration data only for tensors no
        earlier candidate observed), else its own calibration."""
        bins = _bins(prepared.plan)
        if bins is None:
            return quantizer.calibrate(prepared, self.feeds), "calibrated"
        entry = (self.key(quantizer), bins)
        have = self.statistics.setdefault(entry, {})
        missing = [t for t in observer_feeds(prepared.plan) if t not in have]
        found = self.passes.get(entry) or StatisticsPass(_pre_label(entry[0][1]), bins, 0, 0.0, ())
        if missing:
            started = time.perf_counter()
            have.update(
                collect_statistics(
                    prepared.model, missing, self.feeds, bins=bins, total_batches=len(self.feeds), quiet=self.quiet
                )
            )
            seconds = time.perf_counter() - started
            self.pass_seconds.append(seconds)
            found = attrs.evolve(found, tensors=found.tensors + len(missing), seconds=found.seconds + seconds)
        self.passes[entry] = attrs.evolve(found, served=(*found.served, candidate.name))
        observers = observers_from_statistics(prepared.plan, have, self.derived.setdefault(entry, {}))
        label = f"statistics pass {list(self.passes).index(entry) + 1} ({_pre_label(entry[0][1])})"
        self.weight_lookups += len(prepared.plan.weights)
        weights = self.weights.setdefault(entry[0], {})
        return from_filled_observers(prepared.model, prepared.plan, observers, weights), label

    def reuse(self) -> dict[str, int]:
        """What the derived candidates shared, for the report."""
        selected = sum(len(cache) for cache in self.weights.values())
        return {
            "statistics_passes": len(self.passes),
            "weight_qparams_selected": selected,
            "weight_qparams_reused": self.weight_lookups - selected,
        }


def _bins(plan: QuantPlan) -> int | None:
    """The one histogram bin count the plan's specs derive from (default when all are
    min-max), or ``None`` when a spec cannot be derived or they need different counts."""
    specs = list(observer_specs(plan).values())
    if not all(derivable(s) for s in specs):
        return None
    counts = {statistics_bins(s) for s in specs} - {None}
    if len(counts) > 1:
        return None
    return counts.pop() if counts else DEFAULT_STATISTICS_BINS


def _latency_ms(run: Runner, feeds: Mapping[str, np.ndarray], timed: Sequence[float], runs: int = 3) -> float:
    """Median onnxruntime time of a batch: the scoring runs after the first (which warms
    the session up), topped up with runs of ``feeds`` to ``runs``."""
    seconds = list(timed[1:])
    if not timed:
        run(feeds)
    while len(seconds) < runs:
        started = time.perf_counter()
        run(feeds)
        seconds.append(time.perf_counter() - started)
    return 1000.0 * stats.median(seconds)


def search(
    model: str | os.PathLike[str] | bytes | onnx.ModelProto,
    output: str | os.PathLike[str] | None,
    calibration_data: Any,
    eval_data: Any,
    *,
    target: float,
    metric: str | MetricFunction | Metric | None = None,
    labels: Any = None,
    space: SearchSpace | Sequence[Candidate] | None = None,
    deployment: Deployment | None = None,
    budget_s: float | None = None,
    holdout: float = 0.3,
    seed: int = 0,
    num_samples: int | None = None,
    batch_size: int | None = None,
    eval_batch_size: int = 32,
    eval_samples: int | None = None,
    image_options: ImageOptions | None = None,
    report_path: str | os.PathLike[str] | None = None,
    quiet: bool = False,
    clock: Callable[[], float] = time.perf_counter,
) -> SearchResult:
    """Search recipes for ``model`` until one reaches ``target`` on ``eval_data``.

    Args:
        model: float ONNX model (path, bytes or ModelProto; never modified).
        output: where to write the chosen model (``None``: only returned). Its folder
            must exist; checked before any work.
        calibration_data: as :func:`quant_onnx.quantize` takes it.
        eval_data: the evaluation samples (any form calibration data takes).
        target: the metric value to reach (top-1 agreement by default).
        metric: ``None`` (agreement), ``"accuracy"`` (needs ``labels``), ``"sqnr"``,
            ``"module:function"``, ``"file.py:function"`` or a function
            (:mod:`quant_onnx.recipe_search.metrics`).
        labels: one label per evaluation sample (array or ``.npy`` path), handed to the metric.
        space: a :class:`~quant_onnx.recipe_search.space.SearchSpace` or a list of
            candidates (default: the deployment's space).
        deployment: where the model runs (default: onnxruntime on the CPU;
            ``quant_npu.recipe_search`` gives an NPU).
        budget_s: stop starting candidates after this many seconds, and skip a candidate
            whose expected cost no longer fits (the first always runs).
        holdout: fraction of ``eval_data`` held out (seeded by ``seed``): the winner is
            re-scored on it, never selected on it.
        num_samples, batch_size: calibration samples and batch size (every candidate's
            ``calibration`` config).
        eval_batch_size, eval_samples: evaluation batch size and sample count.
        image_options: for image-folder data.
        report_path: also write the JSON report here.
        quiet: no progress bars.
        clock: the time source of the budget (tests pass a fake one).
    """
    input_path = model if isinstance(model, str | os.PathLike) else None
    check_output_paths(output, report_path, input_path=input_path)  # before any work
    if not isinstance(target, int | float) or not np.isfinite(target):
        raise ConfigError(f"target: {target!r} is not allowed; allowed: a finite number")
    if budget_s is not None and not budget_s > 0:
        raise ConfigError(f"budget_s: {budget_s!r} is out of range; allowed: a number > 0")
    started = clock()
    source = load_model(model)
    chosen_metric = resolve_metric(metric)
    where: Deployment = deployment or OnnxRuntime()
    calibration = CalibrationConfig(num_samples=num_samples, batch_size=batch_size or CalibrationConfig().batch_size)
    evaluation = load_evaluation_data(
        source,
        eval_data,
        labels=labels,
        holdout=holdout,
        seed=seed,
        batch_size=eval_batch_size,
        num_samples=eval_samples,
        image_options=image_options,
    )
    reference_started = time.perf_counter()
    reference = collect(onnxruntime_runner(source), evaluation, np.arange(evaluation.count))
    reference_seconds = time.perf_counter() - reference_started
    output_names = [o.name for o in source.graph.output]
    check_metric(chosen_metric, output_names, reference, evaluation)
    feeds = list(
        CalibrationReader(
            source,
            calibration_data,
            batch_size=calibration.batch_size,
            num_samples=calibration.num_samples,
            image_options=image_options,
        )
    )
    shared = _Shared(source, feeds, quiet)
    walk = _Walk(
        shared, where, evaluation, reference, output_names, chosen_metric, float(target), budget_s, clock, started
    )
    with progress_bar(total=None, desc="searching", unit="recipe", quiet=quiet) as bar:
        walk.bar = bar
        if isinstance(space, Sequence):
            walk.stage(list(space), rank=False)
        else:
            _stages(walk, space or where.space(), calibration)
    rows = walk.rows
    chosen = walk.winner
    best = walk.best
    stopped_by = "target" if chosen is not None else ("budget" if walk.out_of_budget or walk.over_budget else "space")

    def score(built: _Built, indices: np.ndarray) -> Scored:
        # The candidate's own session (built once, in memory), not a second one.
        return score_outputs(built.runner, output_names, reference, chosen_metric, evaluation, indices)

    met = chosen is not None
    if chosen is None and best is not None:
        row, built = best
        if row.score is None:  # stopped early: score it in full to report what it reaches
            scored = score(built, evaluation.select)
            row = attrs.evolve(
                row,
                status="missed",  # scored in full now, and below the target (else it had met)
                score=scored.score,
                bound=scored.bound,
                samples=scored.samples,
                running=scored.running,
            )
            rows = [row if r.name == row.name else r for r in rows]
        chosen = (row, built)
    holdout_score = holdout_met = None
    if chosen is not None and len(evaluation.holdout):
        holdout_score = score(chosen[1], evaluation.holdout).score
        holdout_met = holdout_score is not None and holdout_score >= target
    rows = mark_pareto(rows)
    chosen_row = None if chosen is None else next(r for r in rows if r.name == chosen[0].name)
    result = SearchResult(
        model=None if chosen is None else chosen[1].finished.model,
        chosen=chosen_row,
        met=met,
        target=float(target),
        metric=chosen_metric.name,
        deployment=where.name,
        holdout_score=holdout_score,
        holdout_met=holdout_met,
        candidates=tuple(rows),
        statistics=tuple(shared.passes.values()),
        stopped_by=stopped_by,
        seconds=clock() - started,
        reference_seconds=reference_seconds,
        select_samples=len(evaluation.select),
        holdout_samples=len(evaluation.holdout),
        reuse=shared.reuse() | walk.early_stops(),
    )
    path = None
    if output is not None and result.model is not None:
        path = save_model(result.model, output, input_path=input_path)
    result = attrs.evolve(result, output_path=path)
    report = result.to_dict()
    if report_path is not None:
        write_report(report, report_path)
    _LOG.debug("search:\n%s", format_table(result.candidates))
    return attrs.evolve(result, report=report)


def _value(row: CandidateResult) -> float:
    """What the fallback ranks rows by: the full score, else the metric over the samples
    a stopped row ran (its bound would flatter it)."""
    value = row.score if row.score is not None else row.running
    return -np.inf if value is None else float(value)


@attrs.frozen(eq=False)
class _Built:
    """A candidate as deployed and the session it was scored in (kept for the winner and
    the best so far only: the held-out part runs in the same session)."""

    finished: Finished
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


def _stages(walk: _Walk, space: SearchSpace, calibration: CalibrationConfig) -> None:
    """The stages of ``recipe_search.space``, each on the best recipe the earlier found
    (observers a flat observer axis deferred run after the corrections)."""
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


class _Walk:
    """Runs candidates stage by stage, keeps the rows, the winner and the best so far."""

    def __init__(
        self,
        shared: _Shared,
        where: Deployment,
        evaluation: EvaluationData,
        reference: Sequence[np.ndarray],
        output_names: Sequence[str],
        metric: Metric,
        target: float,
        budget_s: float | None,
        clock: Callable[[], float],
        started: float,
    ) -> None:
        self.shared = shared
        self.where = where
        self.evaluation = evaluation
        self.reference = reference
        self.output_names = output_names
        self.metric = metric
        self.target = target
        self.budget_s = budget_s
        self.clock = clock
        self.started = started
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
        when both ran it all), a whole-set metric the scores; ties keep the incumbent."""
        new, old = self.scored.get(challenger.name), self.scored.get(incumbent.name)
        if new is None:
            return False
        if old is None:
            return True
        if new.sample_scores is not None and old.sample_scores is not None:
            return prefix_better(new.sample_scores, old.sample_scores)
        return new.score is not None and (old.score is None or new.score > old.score)

    def early_stops(self) -> dict[str, Any]:
        """How much scoring the exact early stop saved, for the report."""
        stopped = [row for row in self.rows if row.status == "stopped"]
        run = [row for row in self.rows if row.samples and not row.same_as]
        return {
            "deferred": list(self.deferred),  # past the corrections; those run later have rows
            "deferred_run": [name for name in self.deferred if any(row.name == name for row in self.rows)],
            "stopped_early": [row.name for row in stopped],
            "same_model_as": {row.name: row.same_as for row in self.rows if row.same_as},
            "samples_scored": sum(row.samples for row in run),
            "samples_if_scored_in_full": len(run) * len(self.evaluation.select),
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
            if defer and axis_is_flat(distinct, self.target):
                self.deferred = [c.name for c in found[position:]]
                break
            if any(row.name == candidate.name for row in self.rows):
                continue  # a later stage proposed a recipe an earlier one ran
            reason = self.where.allows(candidate.config)
            if reason is not None:
                self.rows.append(_row(candidate, "skipped", error=f"{self.where.name}: {reason}"))
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
                running = self.scored[candidate.name].running
                distinct.extend([] if running is None else [running])
            if built is None or row.status not in ("met", "missed", "stopped"):
                continue
            if _value(row) > _best_value(self.best):
                self.best = (row, built)
            if row.status == "met":
                self.winner = (row, built)
        return best

    def _fits(self, candidate: Candidate) -> bool:
        """The budget rule: the first candidate always runs; later ones start while time is
        left and their expected cost (in measured statistics passes) fits what is left."""
        if self.budget_s is None or not self.rows:
            return True
        elapsed = self.clock() - self.started
        if elapsed >= self.budget_s:
            self.out_of_budget = True
            return False
        passes = self.shared.pass_seconds
        if passes:
            expected = candidate.cost * stats.median(passes)
            if expected > self.budget_s - elapsed:
                self.over_budget = True
                self.rows.append(
                    _row(candidate, "skipped", error=f"expected {expected:.0f} s; {self.budget_s - elapsed:.0f} s left")
                )
                return False
        return True

    def _run(self, candidate: Candidate) -> tuple[CandidateResult, _Built | None]:
        """Build, deploy and score one candidate; a recipe that fails is a row, not the end."""
        started = time.perf_counter()
        shared, where = self.shared, self.where
        try:
            quantizer = ModelQuantizer(candidate.config, quiet=True)
            prepared = shared.after_pre_passes(quantizer)
            calibrated, source = shared.calibrated(quantizer, candidate, prepared)
            model = quantizer.write(calibrated).model
            if schedule(candidate.config).after_calibration:
                post = quantizer.run_post_passes(calibrated, model, shared.feeds)
                model = post.model
                calibrated = post.calibrated or calibrated
            finished = where.finish(model)
            common = {
                "size_bytes": int(finished.model.ByteSize()),
                "wide_share": wide_share(calibrated.plan),
                "legal": finished.legal,
                "legal_detail": finished.detail,
                "statistics": source,
            }
            if finished.legal is False and where.requires_legal:
                return _row(candidate, "illegal", seconds=time.perf_counter() - started, **common), None
            digest = hashlib.blake2b(finished.model.SerializeToString(), digest_size=16).digest()
            if digest in self.built:  # the same bytes score the same: do not run them again
                name, scored, latency = self.built[digest]
                self.scored[candidate.name] = scored
                row = self._scored_row(candidate, scored, latency, started, common)
                return attrs.evolve(row, same_as=name), None
            runner = where.runner(finished.model)
            scored = score_outputs(
                runner,
                self.output_names,
                self.reference,
                self.metric,
                self.evaluation,
                self.evaluation.select,
                target=self.target,
            )
            first = self.evaluation.feeds(self.evaluation.chunks(self.evaluation.select)[0])
            # A row stopped early is off the Pareto front (no score): one warm batch time
            # is enough for its column, and it does not run batches it skipped scoring.
            runs = 3 if scored.complete else 1
            if where.scores_in_onnxruntime:
                latency = _latency_ms(runner, first, scored.batch_seconds, runs)
            else:
                latency = _latency_ms(onnxruntime_runner(finished.model), first, (), runs)
        except (ValueError, ImportError, RuntimeError) as exc:
            return _row(candidate, "failed", seconds=time.perf_counter() - started, error=one_line(str(exc))), None
        self.scored[candidate.name] = scored
        self.built[digest] = (candidate.name, scored, latency)
        return self._scored_row(candidate, scored, latency, started, common), _Built(finished, runner)

    def _scored_row(
        self, candidate: Candidate, scored: Scored, latency: float, started: float, common: Mapping[str, Any]
    ) -> CandidateResult:
        if not scored.complete or scored.score is None:
            status = "stopped"
        else:
            status = "met" if scored.score >= self.target else "missed"
        return _row(
            candidate,
            status,
            score=scored.score,
            bound=scored.bound,
            samples=scored.samples,
            running=scored.running,
            latency_ms=latency,
            seconds=time.perf_counter() - started,
            **common,
        )


def _best_value(best: tuple[CandidateResult, _Built] | None) -> float:
    return -np.inf if best is None else _value(best[0])
