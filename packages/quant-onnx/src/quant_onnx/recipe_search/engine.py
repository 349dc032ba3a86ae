"""The ONNX backend of the search: how a candidate is built and run. The loop itself (the
order, the exact early stop, the same-model skip, the budget, the held-out check, the
Pareto table) is the one both backends share, :mod:`quant_algos.search.walk`.

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
  float model (the report's ``pre_passes_shared``);
- **the plans**: the planner's graph of each float model is built once, and candidates
  whose configs differ only in what the planner never reads (their algorithms,
  :func:`quant_core.plan.planning_key`) share one plan (``plans_reused``);
- **the weights' qparams**: a weight's range is selected once per spec on each float
  model (power-of-two MinMSE over every weight costs about a calibration pass on a small
  model), whichever candidates ask for it;
- **the input means** the analytic bias correction reads: taken in the statistics pass
  (a pass of their own where every statistic was there already) exactly as the
  candidate's own calibration takes them (the same accumulators over the same runs of
  the float model, :func:`~quant_onnx.pipeline.calibrate.collect_statistics`), and reused
  by every later candidate whose calibration would take the same (the report's
  ``input_means_taken``, ``input_means_reused``);
- **the activation equalization's pass**: where ``quant-onnx quantize`` measures the
  equalization in its calibration pass
  (:meth:`~quant_onnx.api.ModelQuantizer.equalizes_in_calibration`: the only pre-pass,
  min-max observers), so does the candidate: one pass over the float model measures its
  per-channel ranges, the observed tensors' ranges and the input means, exactly as
  quantize's pass does (:func:`~quant_onnx.algorithms.equalized_calibration.measure_equalization`),
  and the equalized model's observers follow from them as quantize's do. Candidates whose
  pass would measure the same tensors reuse it (the report's ``equalization_passes``,
  ``equalization_passes_reused``); the others run the equalization as a pre-pass, as
  quantize does;
- **the float model's outputs** on the evaluation data (one run);
- **early stopping** and **the same model** (:mod:`quant_algos.search.walk`): a
  candidate's digest is its deployed model's bytes (observer choices often select the
  same power-of-two scales);
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
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import onnx

from quant_algos.drivers.schedule import schedule
from quant_algos.search.evaluation import DEFAULT_CONFIDENCE, Runner, Scored
from quant_algos.search.metrics import Metric, MetricFunction, check_labels_read, resolve_metric
from quant_algos.search.results import SearchResult, StatisticsPass, format_table
from quant_algos.search.space import Candidate, SearchSpace
from quant_algos.search.statistics import FloatModelKey, StatisticsLedger, float_model_key, pre_label, wide_share
from quant_algos.search.walk import (
    Budget,
    Build,
    check_arguments,
    float_goal,
    latency_runs,
    median_batch_ms,
    search_with,
    with_report,
)
from quant_core.config import CalibrationConfig, QuantConfig
from quant_core.observers.derived import DEFAULT_STATISTICS_BINS
from quant_core.onnx_qdq.model_io import check_output_paths, load_model, save_model
from quant_core.plan import PlanGraph, QuantPlan, observer_feeds, planning_key
from quant_onnx.algorithms.equalized_calibration import (
    EqualizationMeasures,
    equalization_pass,
    equalized_calibration,
    measure_equalization,
)
from quant_onnx.algorithms.layerwise import input_mean_request
from quant_onnx.algorithms.passes import PassesResult, run_pre_passes
from quant_onnx.api import ModelQuantizer, PreparedModel
from quant_onnx.data import CalibrationReader, ImageOptions, for_image_folder
from quant_onnx.pipeline.annotate import plan_graph
from quant_onnx.pipeline.calibrate import (
    CalibratedModel,
    InputMeans,
    MeansTaken,
    collect_statistics,
    from_filled_observers,
)
from quant_onnx.recipe_search.deployment import Deployment, deployment_for, onnxruntime_runner
from quant_onnx.recipe_search.evaluation import load_evaluation_data

_LOG = logging.getLogger("quant_onnx")


@attrs.define
class _Plans:
    """Plans shared between candidates: the planner's graph of each float model is built
    once, and a model is planned once per planning config
    (:func:`quant_core.plan.planning_key`: candidates that differ only in their algorithms
    get the same plan, as the planner reads none of them). Models are told apart by
    identity: the search holds each float model it makes (prepared, pre-passed) until it ends.
    """

    graphs: dict[int, tuple[onnx.ModelProto, PlanGraph]] = attrs.field(factory=dict)
    plans: list[tuple[int, QuantConfig, bool, QuantPlan]] = attrs.field(factory=list)
    lookups: int = 0

    def prepared(
        self, quantizer: ModelQuantizer, model: onnx.ModelProto, preprocess_changes: Mapping[str, int]
    ) -> PreparedModel:
        """``model`` planned under ``quantizer``'s config, as ``quantizer.replan`` plans it."""
        self.lookups += 1
        key, share = planning_key(quantizer.config), quantizer.share_concat_scales
        plan = next((p for i, k, s, p in self.plans if i == id(model) and s == share and k == key), None)
        if plan is not None:
            return PreparedModel(model, plan, dict(preprocess_changes))
        if id(model) not in self.graphs:
            self.graphs[id(model)] = (model, plan_graph(model))
        prepared = quantizer.replan(model, preprocess_changes, graph=self.graphs[id(model)][1])
        self.plans.append((id(model), key, share, prepared.plan))
        return prepared

    def reuse(self) -> dict[str, int]:
        return {
            "plan_graphs": len(self.graphs),
            "plans_made": len(self.plans),
            "plans_reused": self.lookups - len(self.plans),
        }


@attrs.define
class _Shared:
    """What candidates share: prepared float models, pre-passes, plans, statistics, weight
    qparams, input means."""

    source: onnx.ModelProto
    feeds: list[dict[str, np.ndarray]]
    quiet: bool
    prepared: dict[tuple[int, tuple[str, ...]], tuple[onnx.ModelProto, dict[str, int]]] = attrs.field(factory=dict)
    pre: dict[FloatModelKey, PassesResult] = attrs.field(factory=dict)
    pre_users: dict[FloatModelKey, list[str]] = attrs.field(factory=dict)
    plans: _Plans = attrs.field(factory=_Plans)
    ledger: StatisticsLedger = attrs.field(factory=StatisticsLedger)
    #: (float model, samples, the tensors a calibration observes) -> the input means the
    #: analytic bias correction reads, taken as that calibration takes them.
    input_means: dict[tuple[FloatModelKey, int, tuple[str, ...]], InputMeans] = attrs.field(factory=dict)
    input_mean_lookups: int = 0
    #: (pre-processed model, what the pass measures) -> the equalization's one pass.
    equalization_passes: dict[tuple[Any, Hashable], EqualizationMeasures] = attrs.field(factory=dict)
    equalization_lookups: int = 0

    def base(self, quantizer: ModelQuantizer) -> tuple[onnx.ModelProto, dict[str, int]]:
        """The pre-processed float model (and its changes) of ``quantizer``'s opset and NPU
        conversions."""
        key = (quantizer.required_opset(), quantizer.config.npu_conversions)
        if key not in self.prepared:
            self.prepared[key] = quantizer.preprocess(self.source)
        return self.prepared[key]

    def key(self, quantizer: ModelQuantizer) -> FloatModelKey:
        config = quantizer.config
        return float_model_key(config, schedule(config).before_calibration, backend=quantizer.required_opset())

    def equalized(
        self, quantizer: ModelQuantizer, candidate: Candidate
    ) -> tuple[PreparedModel, CalibratedModel, str] | None:
        """The candidate's equalized model and calibration where quantize measures its
        activation equalization in the calibration pass (``None`` elsewhere): the same pass
        over the pre-processed model (shared by candidates that measure the same tensors),
        the same equalization, the same observers followed from it."""
        if quantizer.equalization_only() is None:  # no plan made for the others
            return None
        model, changes = self.base(quantizer)
        base = self.plans.prepared(quantizer, model, changes)
        algorithm = quantizer.equalizes_in_calibration(base)
        if algorithm is None:
            return None
        request = equalization_pass(model, base.plan, quantizer.config, algorithm)
        entry = ((quantizer.required_opset(), quantizer.config.npu_conversions), request.key())
        self.equalization_lookups += 1
        if entry not in self.equalization_passes:
            started = time.perf_counter()
            self.equalization_passes[entry] = measure_equalization(
                model, request, self.feeds, total_batches=len(self.feeds), quiet=self.quiet
            )
            self.ledger.pass_seconds.append(time.perf_counter() - started)  # a pass, for the budget
        measures = self.equalization_passes[entry]
        self.input_mean_lookups += 0 if measures.means is None else len(measures.means.values)
        number = list(self.equalization_passes).index(entry) + 1
        planned: list[PreparedModel] = []

        def plan_of(equalized: onnx.ModelProto) -> QuantPlan:
            planned.append(self.plans.prepared(quantizer, equalized, changes))
            return planned[-1].plan

        result = equalized_calibration(model, quantizer.config, request, measures, plan_of)
        if result.calibrated is None:  # as quantize: the equalized model calibrated again
            return planned[-1], quantizer.calibrate(planned[-1], self.feeds), "calibrated"
        return planned[-1], result.calibrated, f"equalization pass {number}"

    def after_pre_passes(self, quantizer: ModelQuantizer, candidate: Candidate) -> PreparedModel:
        """The candidate's prepared model after its CLE/SmoothQuant (run once per key: the
        same pre-pass configs on the same float model edit it the same way), planned."""
        key = self.key(quantizer)
        model, changes = self.base(quantizer)
        if key.pre_passes:
            if key not in self.pre:
                self.pre[key] = run_pre_passes(model, quantizer.config, self.feeds, quiet=quantizer.quiet)
            self.pre_users.setdefault(key, []).append(candidate.name)
            if self.pre[key].reports:
                model = self.pre[key].model
        return self.plans.prepared(quantizer, model, changes)

    def reuse(self) -> dict[str, Any]:
        """What the pre-passes and plans shared (candidates after the first of a pre-pass
        reused its edited model), beside the statistics' reuse."""
        shared = {users[0]: users[1:] for users in self.pre_users.values() if len(users) > 1}
        taken = sum(len(means.values) for means in self.input_means.values())
        taken += sum(len(p.means.values) for p in self.equalization_passes.values() if p.means is not None)
        return {
            **self.ledger.reuse(),
            "input_means_taken": taken,
            "input_means_reused": self.input_mean_lookups - taken,
            "equalization_passes": len(self.equalization_passes),
            "equalization_passes_reused": self.equalization_lookups - len(self.equalization_passes),
            "pre_passes_run": len(self.pre),
            "pre_passes_shared": shared,
            **self.plans.reuse(),
        }

    def calibrated(
        self, quantizer: ModelQuantizer, candidate: Candidate, prepared: PreparedModel
    ) -> tuple[CalibratedModel, str]:
        """The candidate's calibrated model: derived from the statistics of its float model
        when its specs are derivable (:class:`~quant_algos.search.statistics.StatisticsLedger`),
        with the input means its analytic bias correction reads, else its own calibration."""
        key = self.key(quantizer)
        # The analytic bias correction's input means, as the candidate's own calibration
        # takes them (ModelQuantizer's: in its pass, with its runs): taken in the
        # statistics pass, reused by later candidates whose calibration runs the same.
        request = input_mean_request(prepared.model, quantizer.config)
        runs_as = tuple(observer_feeds(prepared.plan))
        entry = (key, 0 if request is None else request.samples, runs_as)
        taking = MeansTaken(request) if request is not None and entry not in self.input_means else None
        passes: list[str] = []

        def collect(missing: list[str], bins: int = DEFAULT_STATISTICS_BINS) -> dict[str, Any]:
            passes.append("statistics")
            with_means: dict[str, Any] = {} if taking is None else {"input_means": taking, "runs_as": runs_as}
            return collect_statistics(
                prepared.model,
                missing,
                self.feeds,
                bins=bins,
                total_batches=len(self.feeds),
                quiet=self.quiet,
                **with_means,
            )

        derived = self.ledger.observers(key, pre_label(key.pre_passes), prepared.plan, candidate.name, collect)
        if derived is None:
            return quantizer.calibrate(prepared, self.feeds), "calibrated"
        observers, label = derived
        weights = self.ledger.weight_cache(key, prepared.plan)
        calibrated = from_filled_observers(prepared.model, prepared.plan, observers, weights)
        if request is None:
            return calibrated, label
        if taking is not None:
            if not passes:  # every statistic was there already: a pass for the means alone
                collect([])
            found = taking.result()
            assert found is not None  # a request was made
            self.input_means[entry] = found
        means = self.input_means[entry]
        self.input_mean_lookups += len(means.values)
        return calibrated.evolve(input_means=means), label


@attrs.define
class _OnnxBackend:
    """:class:`quant_algos.search.walk.Backend` over :class:`~quant_onnx.api.ModelQuantizer`:
    each candidate is what ``ModelQuantizer(config).quantize`` writes, deployed."""

    shared: _Shared
    where: Deployment

    @property
    def name(self) -> str:
        return self.where.name

    @property
    def requires_legal(self) -> bool:
        return self.where.requires_legal

    @property
    def pass_seconds(self) -> Sequence[float]:
        return self.shared.ledger.pass_seconds

    def allows(self, config: Any) -> str | None:
        return self.where.allows(config)

    def build(self, candidate: Candidate) -> Build:
        shared = self.shared
        quantizer = ModelQuantizer(candidate.config, quiet=True)
        equalized = shared.equalized(quantizer, candidate)
        if equalized is not None:
            prepared, calibrated, source = equalized
        else:
            prepared = shared.after_pre_passes(quantizer, candidate)
            calibrated, source = shared.calibrated(quantizer, candidate, prepared)
        model = quantizer.write(calibrated).model
        if schedule(candidate.config).after_calibration:
            post = quantizer.run_post_passes(calibrated, model, shared.feeds)
            model = post.model
            calibrated = post.calibrated or calibrated
        finished = self.where.finish(model)
        digest = hashlib.blake2b(finished.model.SerializeToString(), digest_size=16).digest()
        return Build(
            finished.model,
            digest,
            int(finished.model.ByteSize()),
            wide_share(calibrated.plan),
            finished.legal,
            finished.detail,
            source,
        )

    def runner(self, build: Build) -> Runner:
        return self.where.runner(build.model)

    def latency_ms(self, build: Build, runner: Runner, feeds: Mapping[str, np.ndarray], scored: Scored) -> float:
        if self.where.scores_in_onnxruntime:
            return median_batch_ms(runner, feeds, scored.batch_seconds, latency_runs(scored))
        return median_batch_ms(onnxruntime_runner(build.model), feeds, (), latency_runs(scored))

    def statistics(self) -> tuple[StatisticsPass, ...]:
        return tuple(self.shared.ledger.passes.values())

    def reuse(self) -> dict[str, Any]:
        return self.shared.reuse()


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
    deployment: Deployment | str | None = None,
    budget_s: float | None = None,
    confidence: float = DEFAULT_CONFIDENCE,
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
            (:mod:`quant_algos.search.metrics`).
        labels: one label per evaluation sample (array or ``.npy`` path), handed to the metric.
        space: a :class:`~quant_algos.search.space.SearchSpace` or a list of
            candidates (default: the deployment's space).
        deployment: where the model runs (default: onnxruntime on the CPU; ``"xint8"``:
            power-of-two int8 formats only, as ``--target xint8``;
            ``quant_npu.recipe_search`` gives an NPU).
        budget_s: stop starting candidates after this many seconds, and skip a candidate
            whose expected cost no longer fits (the first always runs).
        confidence: a per-sample metric (agreement, accuracy) meets the target when the
            lower bound of its mean at this confidence does (0.5: the mean itself), so the
            winner holds beyond the samples it was selected on
            (:class:`~quant_algos.search.evaluation.Acceptance`).
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
    data = {"the calibration data": calibration_data, "the evaluation data": eval_data, "the labels": labels}
    check_output_paths(output, report_path, input_path=input_path, data=data)  # before any work
    acceptance = check_arguments(target, budget_s, confidence, eval_batch_size, eval_samples, seed=seed)
    where: Deployment = deployment_of(deployment)
    started = clock()
    chosen_metric = resolve_metric(metric)
    check_labels_read(chosen_metric, labels)
    source = load_model(model)
    calibration = CalibrationConfig(num_samples=num_samples, batch_size=batch_size or CalibrationConfig().batch_size)
    # The image options serve whichever data is an image folder; with neither a folder, the
    # calibration reader refuses them.
    eval_options = for_image_folder(eval_data, image_options)
    calib_options = image_options if eval_options is None else for_image_folder(calibration_data, image_options)
    evaluation = load_evaluation_data(
        source,
        eval_data,
        labels=labels,
        holdout=holdout,
        seed=seed,
        batch_size=eval_batch_size,
        num_samples=eval_samples,
        image_options=eval_options,
    )
    goal, reference_seconds = float_goal(
        onnxruntime_runner(source), evaluation, chosen_metric, acceptance, [o.name for o in source.graph.output]
    )
    feeds = list(
        CalibrationReader(
            source,
            calibration_data,
            batch_size=calibration.batch_size,
            num_samples=calibration.num_samples,
            image_options=calib_options,
        )
    )
    backend = _OnnxBackend(_Shared(source, feeds, quiet), where)
    result = search_with(
        backend,
        goal,
        space if space is not None else where.space(),
        calibration,
        budget=Budget(budget_s, clock, started),
        reference_seconds=reference_seconds,
        quiet=quiet,
    )
    path = None
    if output is not None and result.model is not None:
        path = save_model(result.model, output, input_path=input_path)
    _LOG.debug("search:\n%s", format_table(result.candidates))
    return with_report(attrs.evolve(result, output_path=path), report_path)


def deployment_of(deployment: Deployment | str | None) -> Deployment:
    """A :class:`Deployment` from one, a target name (``"xint8"``) or ``None`` (onnxruntime).

    Example:
        >>> deployment_of("xint8").name, deployment_of(None).name
        ('onnxruntime:xint8', 'onnxruntime')
    """
    if deployment is None or isinstance(deployment, str):
        return deployment_for(deployment)
    return deployment
