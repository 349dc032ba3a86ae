"""quant_onnx.search / ``quant-onnx search``: the first candidate meeting the target wins,
one statistics pass serves every observer choice (bit for bit what each recipe's own
calibration gives), the winner is re-scored on held-out data, user metrics over labels,
one-line errors naming the field. Tiny models only; no timing. What keeps it
cheap, checked for honesty: the exact early stop never stops a candidate that would meet
the target on the whole selection part; the winner's reported scores are what a fresh
evaluation gives; weight qparams selected once serve later candidates bit for bit; a
candidate whose model an earlier one built is not run again; a flat observer axis is
deferred, not dropped."""

from __future__ import annotations

import copy
import json

import attrs
import numpy as np
import pytest
from model_builders import hardswish_se_cnn, mlp, random_inputs, small_cnn

from quant_algos.search.space import TIER_8BIT
from quant_core.algorithm_config import CLEConfig
from quant_core.config import CalibrationConfig
from quant_core.errors import ConfigError, DataError
from quant_core.observer_config import MSE, Entropy, MinMax, Percentile, PowerOfTwoMSE
from quant_core.plan import calibrated as calibrated_module
from quant_core.plan import calibrated_qparams
from quant_core.presets import get_preset
from quant_onnx import api as api_module
from quant_onnx.api import ModelQuantizer
from quant_onnx.cli.main import main
from quant_onnx.pipeline.calibrate import calibrate, kernel_values
from quant_onnx.recipe_search import (
    OnnxRuntime,
    SearchSpace,
    deployment,
    deployment_for,
    engine,
    make_candidate,
    observer_stage,
    onnxruntime_runner,
    search,
    split_indices,
)
from quant_onnx.recipe_search.evaluation import load_evaluation_data

CALIBRATION = CalibrationConfig(batch_size=16)


@pytest.fixture(scope="module")
def model():
    return mlp(seed=3)


@pytest.fixture(scope="module")
def calib(model):
    return random_inputs(model, 48, seed=1)


@pytest.fixture(scope="module")
def evaluation(model):
    return random_inputs(model, 80, seed=2)


OBSERVERS = (MinMax(), Percentile(99.9), Entropy(), MSE())


def observer_candidates(formats=("a8w8",), observers=OBSERVERS):
    space = SearchSpace(formats=formats, activation_observers=observers)
    return observer_stage(space, CALIBRATION)


def run(model, calib, evaluation, candidates, target, **kwargs):
    kwargs.setdefault("quiet", True)
    return search(model, None, calib, evaluation, target=target, space=candidates, **kwargs)


def test_stops_at_the_first_candidate_meeting_the_target(model, calib, evaluation):
    candidates = observer_candidates()
    everything = run(model, calib, evaluation, candidates, target=1e9, metric="sqnr")
    assert [r.status for r in everything.candidates] == ["missed"] * len(candidates)
    assert everything.stopped_by == "space" and not everything.met
    scores = [r.score for r in everything.candidates]
    target = max(scores)
    first = next(i for i, s in enumerate(scores) if s >= target)
    assert first > 0, "the cheapest candidate already reaches the best score: the test would not test stopping"

    found = run(model, calib, evaluation, candidates, target=target, metric="sqnr")
    assert [r.name for r in found.candidates] == [c.name for c in candidates[: first + 1]]
    assert [r.status for r in found.candidates] == ["missed"] * first + ["met"]
    assert found.met and found.stopped_by == "target"
    assert found.chosen is not None and found.chosen.name == candidates[first].name
    assert found.chosen.score == pytest.approx(scores[first])


def test_one_statistics_pass_serves_every_observer_candidate(model, calib, evaluation, monkeypatch):
    passes: list[int] = []
    own_calibrations: list[str] = []
    collect = engine.collect_statistics

    def counting_collect(*args, **kwargs):
        passes.append(1)
        return collect(*args, **kwargs)

    def no_own_calibration(self, *args, **kwargs):
        own_calibrations.append(self.config.name)
        raise AssertionError("a derivable candidate calibrated itself")

    monkeypatch.setattr(engine, "collect_statistics", counting_collect)
    monkeypatch.setattr(api_module.ModelQuantizer, "calibrate", no_own_calibration)
    candidates = observer_candidates()
    result = run(model, calib, evaluation, candidates, target=2.0)  # agreement never reaches 2
    assert len(passes) == 1 and not own_calibrations
    assert len(result.statistics) == 1
    assert result.statistics[0].served == tuple(c.name for c in candidates)
    assert {r.statistics for r in result.candidates} == {"statistics pass 1 (none)"}
    assert [s["served"] for s in result.report["statistics_reused"]] == [[c.name for c in candidates]]


@pytest.mark.parametrize("observer", [Entropy(), PowerOfTwoMSE()], ids=["entropy", "minmse_pow2"])
def test_a_derived_candidate_is_bit_for_bit_its_own_quantization(model, calib, evaluation, observer):
    formats = ("xint8",) if isinstance(observer, PowerOfTwoMSE) else ("a8w8",)
    (candidate,) = observer_candidates(formats, (observer,))
    result = run(model, calib, evaluation, [candidate], target=0.0)
    assert result.met and result.model is not None
    alone = ModelQuantizer(candidate.config, quiet=True).quantize(model, None, calib, batch_size=16)
    assert result.model.SerializeToString() == alone.model.SerializeToString()


def _searched_twice_as_quantized(net, preset, calib, evaluation):
    """Search ``preset`` and a twin of it (the same float model and runs): both chosen files
    must be ``quantize``'s byte for byte. Returns the report's reuse entry."""
    from quant_algos.search.space import make_candidate

    candidate = make_candidate(preset, get_preset(preset), TIER_8BIT)
    twin = make_candidate(f"{preset}-again", candidate.config, TIER_8BIT)
    where = Recording()
    result = search(net, None, calib, evaluation, target=2.0, space=[candidate, twin], deployment=where, quiet=True)
    alone = ModelQuantizer(candidate.config, quiet=True).quantize(net, None, calib).model
    assert len(where.finished) == 2
    for built in where.finished:
        assert built.SerializeToString() == alone.SerializeToString()
    return result.report["reuse"]


@pytest.mark.parametrize("preset", ["a16w8", "a8w8"])
def test_a_preset_with_the_analytic_bias_correction_is_its_own_quantization(preset, monkeypatch):
    """The analytic bias correction reads its input means from the statistics pass, taken
    as the recipe's own calibration takes them, and a later candidate on the same float
    model reuses them. Before: a derived candidate carried no means, so the correction
    summed its inputs in a float pass of its own (inside onnxruntime), one float rounding
    away from the calibration's: this MLP's float MatMul bias differed, and a16w8 on
    MobileNetV2 wrote four int32 bias codes 1 apart."""
    from quant_onnx.algorithms import runner as runner_module

    net = mlp(seed=1)
    calib, evaluation = random_inputs(net, 32, seed=1), random_inputs(net, 40, seed=2)
    own_passes: list[int] = []
    reduce_over = runner_module.reduce_over

    def counting(*args, **kwargs):
        own_passes.append(1)
        return reduce_over(*args, **kwargs)

    monkeypatch.setattr(runner_module, "reduce_over", counting)
    reuse = _searched_twice_as_quantized(net, preset, calib, evaluation)
    assert not own_passes, "the bias correction measured its input means itself"
    assert reuse["input_means_taken"] == reuse["input_means_reused"] == 2  # the MatMul's and the Gemm's


@pytest.mark.parametrize("seed", [1, 2])
def test_an_equalization_measured_in_calibration_is_its_own_quantization(seed):
    """a8w8 equalizes its activations in quantize's calibration pass (min-max observers):
    the search measures it in the same pass over the float model (the same outputs, so
    onnxruntime computes each tensor alike), decides the same scales and follows the same
    observers, and a second candidate of that pass reuses it. Before: the search ran the
    equalization as a pre-pass whose reduction model let onnxruntime fuse the residual Add
    into its Conv, so ``conv26_out``'s channel ranges, its ``conv26_out_equaliz_scale``
    (one float step) and the activation scales after it differed from quantize's."""
    net = hardswish_se_cnn(seed=seed)
    calib, evaluation = random_inputs(net, 32, seed=1), random_inputs(net, 40, seed=2)
    reuse = _searched_twice_as_quantized(net, "a8w8", calib, evaluation)
    assert (reuse["equalization_passes"], reuse["equalization_passes_reused"]) == (1, 1)
    assert reuse["statistics_passes"] == reuse["pre_passes_run"] == 0  # a8w8 needs neither


def test_the_winner_is_rescored_on_held_out_samples(model, calib, evaluation):
    candidates = observer_candidates(observers=(MinMax(),))
    result = run(model, calib, evaluation, candidates, target=0.0, holdout=0.25, seed=7)
    select, held = split_indices(len(evaluation), 0.25, seed=7)
    assert (result.select_samples, result.holdout_samples) == (len(select), len(held)) == (60, 20)
    # independent: both models run over the held-out samples only
    quantized = onnxruntime_runner(result.model)({"x": evaluation[held]})[0].argmax(axis=1)
    reference = onnxruntime_runner(model)({"x": evaluation[held]})[0].argmax(axis=1)
    assert result.holdout_score == pytest.approx(float(np.mean(quantized == reference)))
    assert result.holdout_met is True
    assert result.report["holdout_score"] == result.holdout_score
    assert result.report["split"] == {"select": 60, "holdout": 20}


def test_a_user_metric_over_labels(model, calib, evaluation):
    labels = np.arange(len(evaluation)) % 4
    seen: list[int] = []

    def accuracy(outputs, reference, samples):
        seen.append(len(samples.indices))
        return float(np.mean(outputs.argmax(axis=1) == samples.labels))

    candidates = observer_candidates(observers=(MinMax(),))
    result = run(model, calib, evaluation, candidates, target=-1.0, metric=accuracy, labels=labels, holdout=0.5)
    select, held = split_indices(len(evaluation), 0.5, seed=0)
    outputs = onnxruntime_runner(result.model)({"x": evaluation})[0].argmax(axis=1)
    assert result.metric == "accuracy"
    assert result.chosen.score == pytest.approx(float(np.mean(outputs[select] == labels[select])))
    assert result.holdout_score == pytest.approx(float(np.mean(outputs[held] == labels[held])))
    assert sum(seen) >= len(evaluation)


def test_xint8_target_skips_formats_the_npu_cannot_run(model, calib, evaluation):
    a8w8 = make_candidate("a8w8/minmax", get_preset("a8w8").evolve(algorithms=()), TIER_8BIT)
    xint8 = make_candidate("xint8/minmax", get_preset("xint8").evolve(algorithms=()), TIER_8BIT)
    result = run(model, calib, evaluation, [a8w8, xint8], target=0.0, deployment=deployment_for("xint8"))
    assert [(r.name, r.status) for r in result.candidates] == [("a8w8/minmax", "skipped"), ("xint8/minmax", "met")]
    assert "scale_type float; allowed: power_of_two" in result.candidates[0].error
    assert result.deployment == "onnxruntime:xint8"
    assert deployment_for("xint8").space().formats == ("xint8",)


@pytest.mark.parametrize(
    ("kwargs", "error", "field"),
    [
        ({"target": float("nan")}, ConfigError, "target:"),
        ({"target": 0.5, "budget_s": 0}, ConfigError, "budget_s:"),
        ({"target": 0.5, "metric": "top5"}, ConfigError, "metric:"),
        ({"target": 0.5, "metric": "no_such_module_xyz:f"}, ConfigError, "metric:"),
        ({"target": 0.5, "holdout": 1.5}, ValueError, "holdout:"),
        ({"target": 0.5, "confidence": 1.0}, ConfigError, "confidence:"),
        ({"target": 0.5, "metric": "accuracy", "labels": np.zeros(3)}, DataError, "labels:"),
        ({"target": 0.5, "labels": np.zeros(3)}, ConfigError, "labels: read only by metric 'accuracy'"),
        ({"target": 9.0, "metric": "sqnr", "labels": np.zeros(3)}, ConfigError, "metric 'sqnr' compares"),
        ({"target": 0.5, "metric": "accuracy"}, DataError, "labels"),
        ({"target": 0.5, "eval_batch_size": 0}, ConfigError, "eval_batch_size:"),
        ({"target": 0.5, "eval_samples": -5}, ConfigError, "eval_samples:"),
        ({"target": 0.5, "seed": -1}, ConfigError, "seed: -1 is out of range; allowed: an integer >= 0"),
    ],
)
def test_bad_arguments_fail_with_one_line_naming_the_field(model, calib, evaluation, kwargs, error, field):
    target = kwargs.pop("target")
    with pytest.raises(error) as caught:
        run(model, calib, evaluation, observer_candidates(observers=(MinMax(),)), target=target, **kwargs)
    message = str(caught.value)
    assert field in message and "\n" not in message


def test_cli_search_writes_the_model_and_the_report(model, calib, evaluation, tmp_path, capsys):
    import onnx

    paths = {name: tmp_path / f"{name}.npy" for name in ("calib", "eval", "labels")}
    np.save(paths["calib"], calib)
    np.save(paths["eval"], evaluation)
    np.save(paths["labels"], np.arange(len(evaluation)) % 4)
    (tmp_path / "my_metric.py").write_text(
        "import numpy as np\n"
        "def accuracy(outputs, reference, samples):\n"
        "    return (outputs.argmax(axis=1) == samples.labels).astype(float)\n"
        "accuracy.per_sample = True\n"
    )
    onnx.save(model, tmp_path / "m.onnx")
    common = ["search", str(tmp_path / "m.onnx"), str(tmp_path / "out.onnx"), "--calib-data", str(paths["calib"])]
    common += ["--eval-data", str(paths["eval"]), "--target", "xint8", "--budget-s", "60"]
    status = main([*common, "--target-agreement", "0.0", "--report", str(tmp_path / "r.json"), "--quiet"])
    assert status == 0 and capsys.readouterr().out == ""
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["notes"] == []
    assert report["met"] and report["chosen"] == "xint8/minmax" and report["candidates"][0]["status"] == "met"
    assert report["holdout_score"] is not None and report["deployment"] == "onnxruntime:xint8"
    assert onnx.load(tmp_path / "out.onnx").graph.node

    metric = f"{tmp_path / 'my_metric.py'}:accuracy"
    extra = ["--eval-labels", str(paths["labels"]), "--metric", metric, "--target-score", "2.0"]
    assert main([*common, *extra]) == 1  # accuracy never reaches 2: searched, best written, exit 1
    captured = capsys.readouterr()
    out = captured.out
    assert "held out:" in out and "misses" in out and "statistics passes reused: none:" in out
    # No score reaches 2: said once, as a note (not a Python warning with a source line).
    assert captured.err.count("quant-onnx: note: target: 2 cannot be met on ") == 1
    assert "UserWarning" not in captured.err
    agreement = ["--target-agreement", "0.5", "--num-eval", "40"]
    assert main([*common, *agreement, "--holdout", "0.25"]) == 0  # the first candidate meets it, with a margin
    assert "at 90% confidence)" in capsys.readouterr().out
    assert "stopped early" in out and "weight qparams reused" in out


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        (["--target-agreement", "0.9", "--metric", "accuracy"], "--metric"),
        (["--target-agreement", "0.9", "--num-eval", "0"], "--num-eval"),
        (["--target-agreement", "0.9", "--target", "dpu"], "--target"),
        (["--target-agreement", "0.9", "--confidence", "0.3"], "--confidence: 0.3 is out of range"),
        (["--target-agreement", "0.9", "--seed", "-1"], "--seed: -1 is out of range; allowed: an integer >= 0"),
        (["--target-agreement", "0.9", "--eval-labels", "l.npy"], "--eval-labels: read only by metric 'accuracy'"),
        (["--target-score", "30", "--metric", "sqnr", "--eval-labels", "l.npy"], "--eval-labels: read only by"),
        (["--target-score", "0.9", "--eval-labels", "l.npy"], "--eval-labels: read only by"),
        ([], "--target-agreement"),
    ],
)
def test_cli_bad_arguments_exit_2_with_one_line(tmp_path, capsys, extra, field):
    args = ["search", "m.onnx", str(tmp_path / "o.onnx"), "--calib-data", "c.npy", "--eval-data", "e.npy"]
    assert main([*args, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert field in err and len(err.splitlines()) == 1


class Recording(OnnxRuntime):
    """onnxruntime, remembering every model it finished and every session it opened."""

    def __init__(self) -> None:
        super().__init__()
        object.__setattr__(self, "finished", [])
        object.__setattr__(self, "sessions", [])

    def finish(self, model):
        self.finished.append(model)
        return super().finish(model)

    def runner(self, model):
        self.sessions.append(model)
        return super().runner(model)


def test_winner_scores_equal_a_fresh_full_evaluation_after_early_stops():
    cnn = small_cnn(seed=5)
    calib, evaluation = random_inputs(cnn, 32, seed=1), random_inputs(cnn, 120, seed=2)
    space = SearchSpace(
        formats=("xint8",),
        activation_observers=(MinMax(), PowerOfTwoMSE(), Percentile(99.9)),
        weight_observers=(None, PowerOfTwoMSE()),
    )
    select, held = split_indices(len(evaluation), 0.3, seed=0)
    reference = onnxruntime_runner(cnn)({"x": evaluation})[0].argmax(axis=1)

    def agreement(candidate, indices):  # independent: the recipe alone, every sample run
        alone = ModelQuantizer(candidate.config, quiet=True).quantize(cnn, None, calib, batch_size=16).model
        top1 = onnxruntime_runner(alone)({"x": evaluation})[0].argmax(axis=1)
        return float(np.mean(top1[indices] == reference[indices]))

    candidates = observer_stage(space, CALIBRATION)
    full = {c.name: agreement(c, select) for c in candidates}
    ordered = sorted(candidates, key=lambda c: full[c.name])  # the best last: the others run first
    target = full[ordered[-1].name]
    assert target > full[ordered[0].name], "the candidates score alike: the test would test nothing"
    result = search(
        cnn, None, calib, evaluation, target=target, confidence=0.5, space=ordered, quiet=True, eval_batch_size=4
    )  # the mean itself must meet it: the target is the best mean
    assert result.met and result.chosen is not None
    assert result.chosen.score == pytest.approx(agreement(result.chosen, select))
    assert result.holdout_score == pytest.approx(agreement(result.chosen, held))
    assert result.chosen.samples == len(select)
    stopped = [row for row in result.candidates if row.status == "stopped"]
    assert stopped, "no candidate stopped early: the test would not test the early stop"
    for row in stopped:  # stopped early: it really misses on the whole selection part
        assert full[row.name] < target and row.samples < len(select) and row.bound >= full[row.name]
    reuse = result.report["reuse"]
    assert reuse["samples_scored"] < reuse["samples_if_scored_in_full"]
    assert set(reuse["stopped_early"]) == {row.name for row in stopped}


def test_weight_cache_gives_the_qparams_of_a_fresh_selection(model, calib, monkeypatch):
    (candidate,) = observer_stage(
        SearchSpace(formats=("xint8",), activation_observers=(MinMax(),), weight_observers=(PowerOfTwoMSE(),)),
        CALIBRATION,
    )
    quantizer = ModelQuantizer(candidate.config, quiet=True)
    prepared = quantizer.prepare(model)
    batches = [{"x": calib[i : i + 16]} for i in range(0, len(calib), 16)]
    calibrated = calibrate(prepared.model, prepared.plan, batches, quiet=True)
    selections: list[str] = []
    real = calibrated_module.constant_qparams

    def counting(value, spec):
        selections.append(spec.observer.method)
        return real(value, spec)

    monkeypatch.setattr(calibrated_module, "constant_qparams", counting)
    values = kernel_values(prepared.model)
    fresh = calibrated_qparams(prepared.plan, calibrated.observers, values)
    cache: dict = {}
    first = calibrated_qparams(prepared.plan, calibrated.observers, values, cache)
    again = calibrated_qparams(prepared.plan, calibrated.observers, values, cache)
    slots = len(prepared.plan.weights)
    assert slots and len(selections) == 2 * slots  # fresh + first; `again` selected nothing
    for node, qp in fresh.weights.items():
        assert qp == first.weights[node] == again.weights[node]


def test_every_derived_candidate_is_its_own_quantization_bit_for_bit(model, calib, evaluation):
    space = SearchSpace(
        formats=("xint8",),
        activation_observers=(MinMax(), PowerOfTwoMSE(), Percentile(99.99)),
        weight_observers=(None, PowerOfTwoMSE()),
    )
    candidates = observer_stage(space, CALIBRATION)
    where = Recording()
    result = search(model, None, calib, evaluation, target=2.0, space=candidates, deployment=where, quiet=True)
    assert len(where.finished) == len(candidates)
    assert result.report["reuse"]["weight_qparams_reused"] > 0  # the cache served later candidates
    for candidate, built in zip(candidates, where.finished, strict=True):
        alone = ModelQuantizer(candidate.config, quiet=True).quantize(model, None, calib, batch_size=16)
        assert built.SerializeToString() == alone.model.SerializeToString(), candidate.name


def test_a_model_built_before_is_not_run_again(model, calib, evaluation):
    (first,) = observer_stage(SearchSpace(formats=("a8w8",), activation_observers=(MinMax(),)), CALIBRATION)
    twin = make_candidate("a8w8/minmax-again", first.config, TIER_8BIT)  # another name, the same recipe
    where = Recording()
    result = search(model, None, calib, evaluation, target=2.0, space=[first, twin], deployment=where, quiet=True)
    one, two = result.candidates
    assert len(where.sessions) == 1  # the twin opened no session and ran no sample
    # the first, chosen as the best, was then scored in full (in its own session): the
    # twin's row, the same model, carries that full scoring too
    assert one.samples == result.select_samples and one.status == "missed"
    assert two.same_as == first.name and (two.status, two.score, two.samples) == ("missed", one.score, one.samples)
    assert result.report["reuse"]["same_model_as"] == {twin.name: first.name}
    assert not two.pareto


def test_a_flat_observer_axis_is_deferred_after_the_corrections_not_dropped(model, calib, evaluation):
    space = SearchSpace(
        formats=("a8w8",),
        activation_observers=(MinMax(), Percentile(99.999), Percentile(99.99), Percentile(99.9)),
        corrections=((CLEConfig(),),),
    )
    stage = [c.name for c in observer_stage(space, CALIBRATION)]
    result = search(model, None, calib, evaluation, target=2.0, space=space, quiet=True, batch_size=16)
    names = [r.name for r in result.candidates]
    deferred = result.report["reuse"]["deferred"]
    assert deferred, "the observer scores were not flat against an unreachable target"
    ran_first = [n for n in stage if n not in deferred]
    corrected = [n for n in names if "+cle" in n]
    assert len(corrected) == 1
    assert names == ran_first + corrected + deferred  # deferred after the corrections
    assert result.report["reuse"]["deferred_run"] == deferred
    assert sorted(n for n in names if "+" not in n) == sorted(stage)  # nothing dropped


def test_rows_record_the_running_score_of_a_stopped_candidate(model, calib, evaluation):
    candidates = observer_stage(SearchSpace(formats=("xint8",), activation_observers=(MinMax(),)), CALIBRATION)
    result = search(model, None, calib, evaluation, target=1.0, space=candidates, quiet=True, eval_batch_size=4)
    (row,) = result.candidates
    if row.status == "stopped":  # the fallback re-scored it in full: running is over every sample
        assert row.score is not None and row.samples == result.select_samples
    assert row.running == pytest.approx(row.score)
    assert attrs.evolve(row).to_dict()["running"] == row.running


def test_candidates_share_a_pre_pass_and_their_plans_and_each_is_its_own_quantization(monkeypatch):
    """Candidates with the same CLE config share one CLE run; the planner's graph of each
    float model is built once and a plan is made once per planning config (the
    algorithms aside); every built model is still its recipe's own quantization."""
    from quant_algos.search.space import refine
    from quant_core.algorithm_config import BiasCorrectionConfig

    cnn = small_cnn(seed=5)
    calib, evaluation = random_inputs(cnn, 32, seed=1), random_inputs(cnn, 40, seed=2)
    (base,) = observer_stage(SearchSpace(formats=("xint8",), activation_observers=(MinMax(),)), CALIBRATION)
    refined = refine(base, [(CLEConfig(),), (CLEConfig(), BiasCorrectionConfig()), (BiasCorrectionConfig(),)])
    cle, cle_bc = (
        next(c for c in refined if c.name == f"{base.name}{suffix}") for suffix in ("+cle", "+cle+bias_correction")
    )
    candidates = [base, *refined]
    calls = {"pre": 0, "graph": 0}
    pre_passes, graph_of = engine.run_pre_passes, engine.plan_graph

    def counting(name, function):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(engine, "run_pre_passes", counting("pre", pre_passes))
    monkeypatch.setattr(engine, "plan_graph", counting("graph", graph_of))
    where = Recording()
    result = search(cnn, None, calib, evaluation, target=2.0, space=candidates, deployment=where, quiet=True)
    reuse = result.report["reuse"]
    assert calls == {"pre": 1, "graph": 2}  # the prepared model and the one after CLE
    assert reuse["pre_passes_run"] == 1 and reuse["pre_passes_shared"] == {cle.name: [cle_bc.name]}
    assert (reuse["plan_graphs"], reuse["plans_made"], reuse["plans_reused"]) == (2, 2, 2)
    for candidate, built in zip(candidates, where.finished, strict=True):
        alone = ModelQuantizer(candidate.config, quiet=True).quantize(cnn, None, calib, batch_size=16)
        assert built.SerializeToString() == alone.model.SerializeToString(), candidate.name


def per_sample_cnn(first_output_dim="N"):
    """small_cnn with its output shape declared ``[first_output_dim, 10]``, as an exporter declares it."""
    cnn = small_cnn(seed=4)
    dims = cnn.graph.output[0].type.tensor_type.shape.dim
    if isinstance(first_output_dim, str):
        dims[0].dim_param = first_output_dim
    else:
        dims[0].dim_value = first_output_dim
    dims[1].dim_value = 10
    return cnn


def counted_runs(monkeypatch):
    """The batch length of every run of the sessions onnxruntime_runner opens from now on."""
    runs = []
    original = deployment.inference_session

    def counted(model, level):
        session = original(model, level)
        run = session.run
        session.run = lambda names, feeds, *rest: runs.append(len(feeds["x"])) or run(names, feeds, *rest)
        return session

    monkeypatch.setattr(deployment, "inference_session", counted)
    return runs


def test_a_batch_of_large_samples_runs_in_pieces_with_the_outputs_of_one_run(monkeypatch):
    cnn = per_sample_cnn()
    batch = random_inputs(cnn, 10, seed=5)
    whole = onnxruntime_runner(cnn)({"x": batch})[0]
    runs = counted_runs(monkeypatch)
    monkeypatch.setattr(deployment, "RUN_INPUT_BYTES", 4 * batch[0].nbytes)  # four samples a run
    pieces = onnxruntime_runner(cnn)({"x": batch})[0]
    assert runs == [4, 4, 2]  # as few runs as four samples a run allow
    assert pieces.tobytes() == whole.tobytes()


def test_outputs_that_are_not_per_sample_run_whole(monkeypatch):
    runs = counted_runs(monkeypatch)
    monkeypatch.setattr(deployment, "RUN_INPUT_BYTES", 1)
    batch = random_inputs(small_cnn(seed=4), 10, seed=5)
    for model in (small_cnn(seed=4), per_sample_cnn(10), per_sample_cnn("M")):  # unknown, fixed, another dim
        assert not deployment.per_sample_outputs(model)
        assert onnxruntime_runner(model)({"x": batch})[0].shape == (10, 10)
    assert runs == [10, 10, 10]
    assert deployment.per_sample_outputs(per_sample_cnn())


def test_evaluation_data_of_an_array_is_read_without_a_copy(model, evaluation):
    data = load_evaluation_data(model, evaluation)
    assert np.shares_memory(data.inputs["x"], evaluation)
    assert data.inputs["x"].tobytes() == evaluation.tobytes()


@pytest.mark.parametrize("second_first", [False, True])
def test_candidates_share_a_float_model_only_where_it_is_the_same(second_first) -> None:
    """A candidate's model is what quantizing its recipe alone writes, whichever candidate
    the search built first: NPU conversions change the pre-processed float model, and
    activation equalization reads the formats (it leaves power-of-two activations alone)."""
    from model_builders import hardswish_se_cnn

    from quant_algos.search.space import make_candidate, with_observers
    from quant_core.algorithm_config import ActivationEqualizationConfig
    from quant_onnx.data import CalibrationReader
    from quant_onnx.recipe_search import engine
    from quant_onnx.recipe_search.deployment import deployment_for

    model = hardswish_se_cnn(seed=0)
    calib = random_inputs(model, 32, seed=1)
    calibration = CalibrationConfig(batch_size=16)

    def candidate(preset: str, name: str, **changes) -> object:
        config = get_preset(preset).evolve(calibration=calibration, **changes)
        return make_candidate(name, with_observers(config, MinMax()), TIER_8BIT)

    pairs = [
        [
            candidate("a8w8", "plain", algorithms=()),
            candidate("a8w8", "converted", algorithms=(), npu_conversions=("hard_sigmoid", "hard_swish")),
        ],
        [
            candidate("a8w8", "a8w8+ae", algorithms=(ActivationEqualizationConfig(),)),
            candidate("xint8", "xint8+ae", algorithms=(ActivationEqualizationConfig(),)),
        ],
    ]
    for pair in pairs:
        feeds = list(CalibrationReader(model, calib, batch_size=16, num_samples=None))
        backend = engine._OnnxBackend(engine._Shared(model, feeds, True), deployment_for(None))
        for found in pair[::-1] if second_first else pair:
            alone = ModelQuantizer(found.config, quiet=True).quantize(model, None, calib, batch_size=16).model
            built = backend.build(found).model
            assert built.SerializeToString() == alone.SerializeToString(), found.name


def _keyerror_on_candidates(outputs, expected, samples):
    # Works on the float model's outputs (equal to the expected ones), fails on a candidate's.
    if not np.array_equal(np.asarray(outputs), np.asarray(expected)):
        raise KeyError("no group")
    return 1.0


def test_a_metric_that_raises_on_a_candidate_fails_that_row_not_the_search(model, calib, evaluation):
    # Before: a KeyError or IndexError from the user's metric ended the search with a traceback.
    candidates = observer_candidates(observers=(MinMax(), Percentile(99.9)))
    result = run(model, calib, evaluation, candidates, target=0.5, metric=_keyerror_on_candidates)
    assert [r.status for r in result.candidates] == ["failed", "failed"]
    assert all("raised KeyError" in (r.error or "") for r in result.candidates)


def test_a_model_that_fixes_its_batch_is_scored_on_every_evaluation_sample(model, calib, evaluation):
    # Before: the last partial batch was dropped (as "calibration" samples), and fewer
    # samples than the batch were refused; the evaluation pads a short last batch itself.
    fixed = copy.deepcopy(model)
    for value in (*fixed.graph.input, *fixed.graph.output):
        dim = value.type.tensor_type.shape.dim[0]
        dim.ClearField("dim_param")
        dim.dim_value = 8
    candidates = observer_candidates(observers=(MinMax(),))
    for count in (78, 5):
        result = run(fixed, calib, evaluation[:count], candidates, target=0.5)
        assert result.select_samples + result.holdout_samples == count


def test_the_report_agrees_with_the_rows_after_the_best_is_scored_in_full(model, calib, evaluation):
    # CLE finds no chain in this MLP: its row is the same model as the best observer's.
    space = SearchSpace(
        formats=("a8w8",), activation_observers=(MinMax(), Percentile(99.9)), corrections=[[CLEConfig()]]
    )
    result = search(model, None, calib, evaluation, target=0.999999, confidence=0.5, space=space, quiet=True)
    chosen = result.chosen
    assert chosen is not None and chosen.status == "missed"
    reuse = result.reuse
    assert chosen.name not in reuse["stopped_early"]
    assert reuse["samples_scored"] == sum(r.samples for r in result.candidates if r.samples and not r.same_as)
    for row in result.candidates:
        if row.same_as == chosen.name:
            assert (row.status, row.score, row.samples) == (chosen.status, chosen.score, chosen.samples)
