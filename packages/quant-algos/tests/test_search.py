"""quant_algos.search, the loop both backends run: the exact early stop, ranking on common
samples, the stages and their order, the same-model skip, the budget, the fallback and
held-out check, the Pareto table, the statistics ledger and the xint8 rule, on a fake
backend whose "models" are numpy functions (no onnx, no torch)."""

from __future__ import annotations

from statistics import NormalDist

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quant_algos.search import (
    Build,
    EvaluationData,
    SearchSpace,
    StatisticsPass,
    default_space,
    evaluation_data,
    format_table,
    observer_stage,
    power_of_two_reason,
    resolve_metric,
    search_with,
    target_space,
)
from quant_algos.search.evaluation import (
    Acceptance,
    Scored,
    hardest_first,
    lower_bound,
    prefix_better,
    score_outputs,
)
from quant_algos.search.metrics import Metric
from quant_algos.search.statistics import StatisticsLedger, statistics_bins_of
from quant_algos.search.walk import Budget, float_goal, median_batch_ms
from quant_core.algorithm_config import AdaRoundConfig, CLEConfig, SmoothQuantConfig
from quant_core.config import CalibrationConfig
from quant_core.errors import ConfigError
from quant_core.observer_config import Entropy, MinMax, Percentile
from quant_core.plan import QuantPlan, TensorGroup
from quant_core.presets import get_preset
from quant_core.spec import QuantSpec


def _given_scores(values: np.ndarray) -> Metric:
    """A per-sample metric that returns ``values`` at the scored sample indices (the runner
    is irrelevant): the early stop sees exactly the per-sample scores we choose."""

    def function(outputs, reference, samples):
        return values[samples.indices]

    return Metric("given", function, per_sample=True)


@settings(max_examples=200, deadline=None)
@given(
    scores=st.lists(st.sampled_from([0.0, 0.25, 1.0]), min_size=1, max_size=60),
    target=st.floats(0.0, 1.0),
    confidence=st.sampled_from([0.5, 0.75, 0.9, 0.99]),
    batch=st.integers(1, 16),
)
def test_early_stop_never_stops_a_candidate_that_would_be_accepted(scores, target, confidence, batch):
    values = np.array(scores)
    count = len(values)
    data = EvaluationData(
        {"x": np.zeros((count, 1), np.float32)}, None, np.arange(count), np.array([], int), batch, None
    )
    reference = [np.zeros((count, 1), np.float32)]
    accept = Acceptance(target, confidence)
    scored = score_outputs(
        lambda feeds: [feeds["x"]], ["y"], reference, _given_scores(values), data, data.select, acceptance=accept
    )
    full = float(np.mean(values))  # independent: the mean over every sample
    accepted = _wilson_lower(full, count, confidence) >= target
    if accepted:
        assert scored.complete and scored.score == pytest.approx(full)
    if not scored.complete:
        assert not accepted and full <= scored.bound + 1e-12  # the bound is an upper bound of the full score
        assert scored.running == pytest.approx(float(np.mean(values[: scored.samples])))
    else:
        assert scored.samples == count


def _wilson_lower(mean: float, count: int, confidence: float) -> float:
    """Wilson's score interval's lower end, from its textbook form (an independent check of
    ``lower_bound``): the p below ``mean`` where ``(mean - p)^2 = z^2 p (1 - p) / n``."""
    z = NormalDist().inv_cdf(confidence)
    if z == 0:
        return mean
    a = 1 + z * z / count
    b = -(2 * mean + z * z / count)
    c = mean * mean
    return (-b - np.sqrt(b * b - 4 * a * c)) / (2 * a)


@settings(max_examples=300, deadline=None)
@given(mean=st.floats(0.0, 1.0), count=st.integers(1, 5000), confidence=st.floats(0.5, 0.999))
def test_the_lower_bound_is_wilsons_and_below_the_mean(mean, count, confidence):
    bound = lower_bound(mean, count, confidence)
    assert bound == pytest.approx(_wilson_lower(mean, count, confidence), abs=1e-9)
    assert bound <= mean + 1e-12 and bound >= -1e-12


def test_a_winner_by_zero_margin_is_not_accepted_at_the_default_confidence():
    """The case the held-out part exposed (fmnist_mobilenetv2 at 0.99: 0.9900 on 700
    selection samples, 0.9733 on 300 held out)."""
    assert not Acceptance(0.99).meets(0.99, 700, per_sample=True)
    assert Acceptance(0.99, confidence=0.5).meets(0.99, 700, per_sample=True)
    assert Acceptance(0.99).meets(0.999, 700, per_sample=True)
    assert Acceptance(30.0).meets(30.0, 700, per_sample=False)  # a whole-set metric: its score itself
    for bad in (1.0, 0.4, True, "0.9"):
        with pytest.raises(ConfigError, match=r"^confidence: .* is out of range; allowed: 0.5 <= confidence < 1$"):
            Acceptance(0.9, bad)


def test_hardest_first_orders_by_the_float_margin_ties_and_odd_outputs_in_index_order():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(50, 7)).astype(np.float32)
    logits[10] = logits[20]  # a tie: index order
    indices = np.sort(rng.choice(50, 30, replace=False))
    order = hardest_first([logits], indices)
    assert sorted(order.tolist()) == indices.tolist()  # a permutation of the part given
    ranked = np.sort(logits[order], axis=1)
    margins = ranked[:, -1] - ranked[:, -2]  # independent: a full sort, not a partition
    assert np.all(np.diff(margins) >= 0)
    tied = [i for i in order.tolist() if i in (10, 20)]
    assert tied in ([], [10], [20], [10, 20])
    nan = logits.copy()
    nan[indices[0], 0] = np.nan
    assert hardest_first([nan], indices)[-1] == indices[0]  # no class: scored last
    # One value per sample (a regression head), or a whole map per sample: no order.
    assert hardest_first([logits[:, :1]], indices) is None
    assert hardest_first([np.zeros((50, 1 << 17), np.float32)], indices) is None
    # The first output decides; one of four axes is flattened, as the metrics read it.
    cube = logits.reshape(50, 7, 1, 1)
    assert hardest_first([cube, np.zeros((50, 1))], indices).tolist() == order.tolist()
    # Three axes (samples, positions, classes): the least certain position of each sample.
    lines = rng.normal(size=(50, 9, 5))
    ranked = np.sort(lines[indices], axis=-1)
    weakest = (ranked[..., -1] - ranked[..., -2]).min(axis=1)
    assert hardest_first([lines], indices).tolist() == indices[np.argsort(weakest, kind="stable")].tolist()


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    count=st.integers(2, 80),
    target=st.floats(0.3, 1.0),
    confidence=st.sampled_from([0.5, 0.9]),
    batch=st.integers(1, 16),
)
def test_the_scoring_order_changes_when_a_candidate_stops_not_whether_it_meets(seed, count, target, confidence, batch):
    rng = np.random.default_rng(seed)
    values = (rng.random(count) < rng.random()).astype(np.float64)
    data = EvaluationData(
        {"x": np.zeros((count, 1), np.float32)}, None, np.arange(count), np.array([], int), batch, None
    )
    reference = [np.zeros((count, 1), np.float32)]
    accept = Acceptance(target, confidence)

    def scored(indices):
        return score_outputs(
            lambda feeds: [feeds["x"]], ["y"], reference, _given_scores(values), data, indices, acceptance=accept
        )

    given_order, shuffled = scored(np.arange(count)), scored(rng.permutation(count))
    wins = [s.complete and accept.meets(s.score, count, per_sample=True) for s in (given_order, shuffled)]
    assert wins[0] == wins[1] == accept.meets(float(values.mean()), count, per_sample=True)
    for s in (given_order, shuffled):
        if s.complete:
            assert s.score == pytest.approx(float(values.mean()))
        else:
            assert values.mean() <= s.bound + 1e-12


def test_the_flat_test_takes_a_stopped_candidate_at_its_bound_only_when_the_hardest_samples_came_first():
    data = evaluation_data({"x": np.eye(40, 3, dtype=np.float32)}, holdout=0.0)
    goal, _ = float_goal(lambda feeds: [feeds["x"]], data, resolve_metric(None), Acceptance(0.9), ["y"])
    stopped = Scored(None, 0.95, 2, False, (), np.array([1.0, 0.0]))  # bound 0.95, mean so far 0.5
    assert goal.by_margin and goal.estimate(stopped) == 0.95  # the easiest samples were left
    assert attrs.evolve(goal, by_margin=False).estimate(stopped) == 0.5  # a random rest: the mean so far
    assert goal.estimate(Scored(0.8, 0.8, 40, True, (), np.full(40, 0.8))) == 0.8
    whole, _ = float_goal(lambda feeds: [feeds["x"]], data, resolve_metric("sqnr"), Acceptance(30.0), ["y"])
    assert not whole.by_margin and whole.selection.tolist() == data.select.tolist()


def test_a_target_no_score_could_meet_is_said_before_the_search_starts(caplog):
    data = evaluation_data({"x": np.eye(40, 3, dtype=np.float32)}, holdout=0.0)
    run = lambda feeds: [feeds["x"]]  # noqa: E731
    with caplog.at_level("WARNING", logger="quant_algos"):
        goal, _ = float_goal(run, data, resolve_metric(None), Acceptance(0.99), ["y"])
    expected = "target: 0.99 cannot be met on 40 selection samples at confidence 0.9 (a perfect score's lower bound is"
    assert len(goal.notes) == 1 and goal.notes[0].startswith(expected)
    assert [r.getMessage() for r in caplog.records] == list(goal.notes)
    caplog.clear()
    with caplog.at_level("WARNING", logger="quant_algos"):
        met = float_goal(run, data, resolve_metric(None), Acceptance(0.99, confidence=0.5), ["y"])[0]  # 1.0 meets it
        whole = float_goal(run, data, resolve_metric("sqnr"), Acceptance(99.0), ["y"])[0]  # a whole-set metric
    assert met.notes == whole.notes == () and not caplog.records


def test_prefix_ranking_compares_the_samples_both_ran():
    assert prefix_better(np.array([1.0, 1.0]), np.array([1.0, 0.0, 0.0]))
    assert not prefix_better(np.array([1.0, 0.0]), np.array([1.0, 0.0]))  # a tie keeps the incumbent
    assert not prefix_better(np.array([]), np.array([1.0]))


class FakeBackend:
    """Each candidate's "model" flips the float model's top-1 class on a fixed share of the
    samples (``flips``: candidate name -> share); equal shares build equal models."""

    name = "fake"
    requires_legal = False

    def __init__(self, flips, refuse=()):
        self.flips = flips
        self.refuse = refuse
        self.built = []
        self.pass_seconds = [1.0]

    def allows(self, config):
        return "refused here" if config.name in self.refuse else None

    def build(self, candidate):
        self.built.append(candidate.name)
        share = self.flips[candidate.name]
        return Build(share, repr(share).encode(), 100, 0.0, None, "", "fake")

    def runner(self, build):
        share = build.model

        def run(feeds):
            x = feeds["x"]
            wrong = (x[:, 0] * 1000).astype(int) % 100 < share * 100
            return [np.where(wrong[:, None], -x, x)]

        return run

    def latency_ms(self, build, runner, feeds, scored):
        return median_batch_ms(runner, feeds, scored.batch_seconds, 1)

    def statistics(self):
        return (StatisticsPass("none", 2048, 1, 0.0, tuple(self.built)),)

    def reuse(self):
        return {"statistics_passes": 1}


def run_fake(flips, target, space, **kwargs):
    rng = np.random.default_rng(0)
    x = rng.random((200, 3)).astype(np.float32)
    x[:, 1] += 0.5  # the float top-1 is class 1 on every sample: a flip moves it
    data = evaluation_data({"x": x}, batch_size=kwargs.pop("batch_size", 20))
    accept = Acceptance(target, kwargs.pop("confidence", 0.9))
    goal, _ = float_goal(lambda feeds: [feeds["x"]], data, resolve_metric(None), accept, ["y"])
    backend = FakeBackend(flips, kwargs.pop("refuse", ()))
    budget = Budget(kwargs.pop("budget_s", None), kwargs.pop("clock", lambda: 0.0), 0.0)
    result = search_with(
        backend, goal, space, CalibrationConfig(), budget=budget, reference_seconds=0.0, quiet=True
    )  # fmt: skip
    return result, backend, data


SPACE = SearchSpace(formats=("a8w8",), activation_observers=(MinMax(), Percentile(99.9)), corrections=((CLEConfig(),),))


class HesitantBackend(FakeBackend):
    """A candidate flips the float model's top-1 class on its ``share`` of the samples the
    float model is least sure of (smallest margin between its two largest logits), as a
    quantized model mostly does."""

    def __init__(self, flips, margins):
        super().__init__(flips)
        self.margins = margins

    def runner(self, build):
        share = build.model
        limit = np.quantile(self.margins, share) if share else -np.inf

        def run(feeds):
            x = feeds["x"]
            top = np.sort(x, axis=1)
            wrong = (top[:, -1] - top[:, -2]) < limit
            return [np.where(wrong[:, None], -x, x)]

        return run


def test_hardest_first_stops_failing_candidates_sooner_and_a_tie_on_their_samples_goes_to_the_cheaper():
    rng = np.random.default_rng(0)
    x = rng.random((400, 3)).astype(np.float32)
    x[:, 1] += 0.5
    top = np.sort(x, axis=1)
    margins = top[:, -1] - top[:, -2]
    # Both candidates miss every one of the hardest samples, so on the samples both ran they
    # tie and the cheaper one is the base for CLE; in index order the better one is.
    flips = {
        "a8w8/minmax": 0.15,
        "a8w8/percentile(99.9)": 0.12,
        "a8w8/minmax+cle": 0.0,
        "a8w8/percentile(99.9)+cle": 0.0,
    }
    results = {}
    for order in ("hardest_first", "index"):
        data = evaluation_data({"x": x}, batch_size=10)
        goal, _ = float_goal(lambda feeds: [feeds["x"]], data, resolve_metric(None), Acceptance(0.95), ["y"])
        assert goal.by_margin
        if order == "index":
            goal = attrs.evolve(goal, selection=data.select, by_margin=False)
        else:
            assert not np.array_equal(goal.selection, data.select)
            assert sorted(goal.selection.tolist()) == data.select.tolist()
        backend = HesitantBackend(flips, margins)
        results[order] = search_with(
            backend, goal, SPACE, CalibrationConfig(), budget=Budget(None, lambda: 0.0, 0.0), reference_seconds=0.0, quiet=True
        )  # fmt: skip
    hard, index = results["hardest_first"], results["index"]
    assert hard.chosen.name == "a8w8/minmax+cle" and index.chosen.name == "a8w8/percentile(99.9)+cle"
    assert hard.met and index.met
    assert hard.chosen.score == index.chosen.score == 1.0 and hard.holdout_score == index.holdout_score
    stopped = [row.samples for row in hard.candidates if row.status == "stopped"]
    assert len(stopped) == 2 and hard.reuse["samples_scored"] < index.reuse["samples_scored"]
    assert max(stopped) <= 20  # each miss lies in the first batches


def test_the_first_candidate_meeting_the_target_in_cost_order_wins_and_is_rescored_held_out():
    flips = {"a8w8/minmax": 0.3, "a8w8/percentile(99.9)": 0.2, "a8w8/percentile(99.9)+cle": 0.0}
    result, backend, data = run_fake(flips, 0.95, SPACE)
    # Observers first (cheapest first), then CLE on the best of them.
    assert backend.built == ["a8w8/minmax", "a8w8/percentile(99.9)", "a8w8/percentile(99.9)+cle"]
    assert result.met and result.chosen.name == "a8w8/percentile(99.9)+cle" and result.chosen.score == 1.0
    assert result.holdout_score == 1.0 and result.holdout_met and result.stopped_by == "target"
    assert [row.status for row in result.candidates] == ["stopped", "stopped", "met"]
    assert result.to_dict()["split"] == {"select": len(data.select), "holdout": len(data.holdout)}
    assert result.reuse["samples_scored"] < result.reuse["samples_if_scored_in_full"]
    assert "a8w8/percentile(99.9)+cle *" in format_table(result.candidates)


def test_the_same_model_is_not_run_twice_and_a_refused_recipe_is_a_skipped_row():
    flips = {"a8w8/minmax": 0.1, "a8w8/percentile(99.9)": 0.1, "a8w8/minmax+cle": 0.1}
    result, backend, _ = run_fake(flips, 0.99, SPACE, refuse=("a8w8/minmax+cle",))
    rows = {row.name: row for row in result.candidates}
    assert rows["a8w8/percentile(99.9)"].same_as == "a8w8/minmax"
    assert rows["a8w8/minmax+cle"].status == "skipped" and rows["a8w8/minmax+cle"].error == "fake: refused here"
    assert "a8w8/minmax+cle" not in backend.built
    # No winner: the best candidate is scored in full and chosen, marked as missed.
    assert not result.met and result.chosen.name == "a8w8/minmax" and result.chosen.status == "missed"
    assert result.chosen.score == pytest.approx(0.9, abs=0.05) and result.stopped_by == "space"


def test_a_candidate_at_the_target_by_zero_margin_does_not_win_at_the_default_confidence():
    flips = {"a8w8/minmax": 0.5, "a8w8/percentile(99.9)": 0.05, "a8w8/percentile(99.9)+cle": 0.0}
    unreachable, _, _ = run_fake(flips | {"a8w8/percentile(99.9)+cle": 0.05}, 2.0, SPACE)
    assert unreachable.chosen.name == "a8w8/percentile(99.9)"  # the best, scored in full
    assert len(unreachable.notes) == 1 and unreachable.to_dict()["notes"] == list(unreachable.notes)
    reached = unreachable.chosen.score
    assert 0.9 < reached < 1.0
    point, _, _ = run_fake(flips, reached, SPACE, confidence=0.5)
    assert point.chosen.name == "a8w8/percentile(99.9)" and point.met  # the mean meets it exactly
    bounded, _, _ = run_fake(flips, reached, SPACE)
    rows = {row.name: row.status for row in bounded.candidates}
    assert rows["a8w8/percentile(99.9)"] in ("missed", "stopped")  # its lower bound does not
    assert bounded.chosen.name == "a8w8/percentile(99.9)+cle" and bounded.met
    assert bounded.confidence == 0.9 and bounded.select_lower_bound < bounded.chosen.score == 1.0
    report = bounded.to_dict()
    assert report["confidence"] == 0.9 and report["select_lower_bound"] == bounded.select_lower_bound


def test_the_budget_skips_what_no_longer_fits_but_always_runs_the_first():
    flips = {"a8w8/minmax": 0.3, "a8w8/percentile(99.9)": 0.2, "a8w8/minmax+cle": 0.0}
    result, backend, _ = run_fake(flips, 0.95, SPACE, budget_s=0.1, clock=lambda: 0.0)
    assert backend.built == ["a8w8/minmax"]  # percentile costs 0.5 passes of 1 s: does not fit 0.1 s
    assert result.stopped_by == "budget" and result.candidates[1].status == "skipped"


def test_a_refused_first_candidate_does_not_use_up_the_first_run_the_budget_allows():
    flips = {"a8w8/minmax": 0.0, "a8w8/percentile(99.9)": 0.0, "a8w8/minmax+cle": 0.0}
    # The float reference already spent more than the whole budget.
    result, backend, _ = run_fake(flips, 0.95, SPACE, budget_s=2.0, clock=lambda: 5.0, refuse=("a8w8/minmax",))
    assert backend.built == ["a8w8/percentile(99.9)"]  # the first candidate that can run
    assert result.met and result.chosen.name == "a8w8/percentile(99.9)"


def test_every_candidate_of_a_space_has_its_own_name():
    """The walk runs a name once: entries that differ only in a setting are named by it,
    and entries that would still share a name are refused."""
    space = SearchSpace(
        formats=("a8w8",),
        activation_observers=(Entropy(bins=512), Entropy(), Percentile(99.99999)),
        corrections=((SmoothQuantConfig(),), (SmoothQuantConfig(alpha=0.8),)),
    )
    names = [c.name for c in observer_stage(space, CalibrationConfig())]
    assert sorted(names) == ["a8w8/entropy", "a8w8/entropy(bins=512)", "a8w8/percentile(99.99999)"]
    flips = dict.fromkeys(names, 0.2) | {"a8w8/entropy(bins=512)": 0.1, "a8w8/entropy(bins=512)+smoothquant": 0.1}
    result, backend, _ = run_fake(flips | {"a8w8/entropy(bins=512)+smoothquant(0.8)": 0.0}, 0.95, space)
    assert backend.built[-2:] == ["a8w8/entropy(bins=512)+smoothquant", "a8w8/entropy(bins=512)+smoothquant(0.8)"]
    assert result.met and result.chosen.name == "a8w8/entropy(bins=512)+smoothquant(0.8)"
    with pytest.raises(ConfigError, match=r"^search space: learned holds two entries named 'adaround'"):
        SearchSpace(
            formats=("a8w8",),
            activation_observers=(MinMax(),),
            learned=(AdaRoundConfig(num_iterations=100), AdaRoundConfig(num_iterations=200)),
        )


def test_the_targets_rule_and_spaces():
    assert target_space("xint8").formats == ("xint8",) and target_space(None) == default_space()
    assert power_of_two_reason(get_preset("xint8")) is None
    assert power_of_two_reason(get_preset("a16w8")) is not None
    with pytest.raises(ConfigError, match=r"^deployment: 'dpu' is not allowed; allowed: xint8$"):
        from quant_algos.search.targets import check_target

        check_target("dpu", "deployment")
    assert [c.name for c in observer_stage(SPACE, CalibrationConfig())] == ["a8w8/minmax", "a8w8/percentile(99.9)"]


def test_the_ledger_runs_one_pass_per_float_model_and_only_for_new_tensors():
    def plan(*tensors, observer=None):
        spec = QuantSpec(dtype="int8", observer=observer or MinMax())
        return QuantPlan(tuple(TensorGroup(t, spec, (t,), (t,)) for t in tensors), (), (), (), (), ())

    asked = []

    def collect_(tensors, bins):
        from quant_core.observers.derived import statistics_observer

        asked.append(list(tensors))
        found = {}
        for t in tensors:
            found[t] = statistics_observer(bins)
            found[t].update(np.array([-1.0, 2.0], np.float32))
        return found

    ledger = StatisticsLedger()
    first = ledger.observers("none", "none", plan("a", "b"), "c1", collect_)
    ledger.observers("none", "none", plan("a", "b", "c"), "c2", collect_)
    ledger.observers("cle", "cle", plan("a"), "c3", collect_)
    assert asked == [["a", "b"], ["c"], ["a"]]
    assert first is not None and first[1] == "statistics pass 1 (none)"
    assert [p.served for p in ledger.passes.values()] == [("c1", "c2"), ("c3",)]
    assert statistics_bins_of(plan("a", observer=Percentile(bins=512))) == 512
    from quant_core.observer_config import MovingAverageMinMax

    assert ledger.observers("none", "none", plan("a", observer=MovingAverageMinMax()), "c4", collect_) is None


def test_each_stage_is_ordered_by_the_cost_table(monkeypatch):
    """The order is a function of ``ALGORITHM_COST`` (measured: AdaQuant costs less than
    AdaRound, so it is tried first); change the table and the order follows."""
    from quant_algos.search import space

    base = observer_stage(space.power_of_two_space(), CalibrationConfig())[0]

    def learned_order() -> list[str]:
        return [c.name.rsplit("+", 1)[1] for c in space.refine(base, [(a,) for a in space.LEARNED])]

    def corrections_order() -> list[str]:
        return [c.name.split("+", 1)[1] for c in space.refine(base, space.CORRECTIONS)]

    assert learned_order() == ["gptq", "adaquant", "adaround"]
    assert corrections_order() == ["cle", "smoothquant", "bias_correction", "cle+bias_correction"]
    monkeypatch.setitem(space.ALGORITHM_COST, "adaquant", space.ALGORITHM_COST["adaround"] + 1)
    monkeypatch.setitem(space.ALGORITHM_COST, "cle", space.ALGORITHM_COST["bias_correction"] + 1)
    assert learned_order() == ["gptq", "adaround", "adaquant"]
    assert corrections_order() == ["smoothquant", "bias_correction", "cle", "cle+bias_correction"]
