from __future__ import annotations

import itertools

import pytest

from quant_algos.mixed_precision import search_mixed_precision
from quant_core.algorithm_config import MixedPrecisionConfig, PrecisionTarget

A16W8, A8W16, A16W16 = PrecisionTarget.A16W8, PrecisionTarget.A8W16, PrecisionTarget.A16W16


def _additive(gains, base=20.0):
    return lambda raised: base + sum(gains[n] for n in raised)


def _brute_force_min(names, score, target):
    for k in range(len(names) + 1):
        for combo in itertools.combinations(names, k):
            if score(dict.fromkeys(combo, A16W8)) >= target:
                return set(combo)
    return None


def test_additive_scores_pick_the_known_optimum():
    gains = {"c1": 1.0, "dw2": 6.0, "pw3": 0.2, "dw4": 4.0, "fc": 0.5}
    score = _additive(gains)
    r = search_mixed_precision(list(gains), score, MixedPrecisionConfig(accuracy_target=30.0), quiet=True)
    assert set(r.raised) == _brute_force_min(list(gains), score, 30.0) == {"dw2", "dw4"}
    assert r.target_met and r.score == pytest.approx(30.0) and r.baseline_score == 20.0
    assert r.ranking[:2] == ("dw2", "dw4") and r.sensitivity["dw2"] == pytest.approx(6.0)
    assert r.size_ratio == 1.0  # A16W8 keeps 8-bit weights
    actions = [s.action for s in r.trajectory]
    assert actions[0] == "baseline" and actions.count("sensitivity") == 5 and "raise" in actions


def test_backward_pruning_removes_layers_made_redundant():
    # "a" alone helps most, but "b" and "c" together reach the target and make "a" redundant.
    def score(raised):
        s = 10.0
        if "b" in raised and "c" in raised:
            return 30.0
        s += 8.0 if "a" in raised else 0.0
        s += 5.0 if "b" in raised else 0.0
        s += 4.0 if "c" in raised else 0.0
        return s

    r = search_mixed_precision(["a", "b", "c", "d"], score, MixedPrecisionConfig(accuracy_target=29.0), quiet=True)
    assert set(r.raised) == {"b", "c"} == _brute_force_min(["a", "b", "c", "d"], score, 29.0)
    assert any(s.action == "drop" and s.layer == "a" and s.kept for s in r.trajectory)


def test_size_budget_and_max_layers():
    gains = {"big": 9.0, "small": 3.0, "tiny": 2.0}
    sizes = {"big": 800.0, "small": 100.0, "tiny": 100.0}
    cfg = MixedPrecisionConfig(target_types=["a8w16"], accuracy_target=100.0, size_budget=1.25)
    r = search_mixed_precision(list(gains), _additive(gains), cfg, sizes=sizes, quiet=True)
    assert set(r.raised) == {"small", "tiny"} and r.size_ratio == pytest.approx(1.2) and r.target_met is False
    r = search_mixed_precision(list(gains), _additive(gains), MixedPrecisionConfig(max_layers=1), quiet=True)
    assert set(r.raised) == {"big"} and r.target_met is None
    with pytest.raises(ValueError, match="sizes"):
        search_mixed_precision(list(gains), _additive(gains), cfg, quiet=True)
    with pytest.raises(ValueError, match="duplicate"):
        search_mixed_precision(["a", "a"], _additive({"a": 1}), cfg, quiet=True)


def test_several_target_types_choose_best_fitting():
    def score(raised):
        return 10.0 + sum({A16W8: 2.0, A16W16: 5.0, A8W16: 1.0}[t] for t in raised.values())

    cfg = MixedPrecisionConfig(target_types=["a16w8", "a16w16"], accuracy_target=15.0)
    r = search_mixed_precision(["x"], score, cfg, sizes={"x": 10.0}, quiet=True)
    assert r.raised == {"x": A16W16} and r.size_ratio == pytest.approx(2.0)
    tight = MixedPrecisionConfig(target_types=["a16w8", "a16w16"], accuracy_target=15.0, size_budget=1.5)
    r = search_mixed_precision(["x"], score, tight, sizes={"x": 10.0}, quiet=True)
    assert r.raised == {"x": A16W8} and not r.target_met


def test_no_target_raises_only_helpful_layers():
    gains = {"a": 2.0, "b": -1.0, "c": 0.0}
    r = search_mixed_precision(list(gains), _additive(gains), MixedPrecisionConfig(max_layers=3), quiet=True)
    assert set(r.raised) == {"a"}


def test_the_size_model_counts_each_layers_own_base_bits():
    # int4 weights raised to 16 bits grow four-fold: a budget an int8 model keeps is broken.
    gains = {"fc1": 3.0, "fc2": 5.0}
    sizes = {"fc1": 4096.0, "fc2": 4096.0}
    cfg = MixedPrecisionConfig(target_types=["a8w16"], max_layers=1, size_budget=1.6)
    int8 = search_mixed_precision(list(gains), _additive(gains), cfg, sizes=sizes, quiet=True)
    assert set(int8.raised) == {"fc2"} and int8.size_ratio == pytest.approx(1.5)
    bits = {"fc1": 4, "fc2": 4}
    int4 = search_mixed_precision(list(gains), _additive(gains), cfg, sizes=sizes, base_bits=bits, quiet=True)
    assert int4.raised == {} and int4.size_ratio == 1.0  # 0.5 -> 2 bytes a weight: 2.5x
    a16w8 = MixedPrecisionConfig(target_types=["a16w8"], max_layers=1, size_budget=1.0)
    kept = search_mixed_precision(list(gains), _additive(gains), a16w8, sizes=sizes, base_bits=bits, quiet=True)
    assert set(kept.raised) == {"fc2"} and kept.size_ratio == 1.0  # its weights stay 4-bit


def test_a_target_out_of_reach_never_ends_below_the_best_raise():
    # Raising b or c lowers the score: before, every layer was raised and the result scored
    # below the baseline.
    gains = {"a": 5.0, "b": -3.0, "c": -4.0}
    r = search_mixed_precision(list(gains), _additive(gains), MixedPrecisionConfig(accuracy_target=30.0), quiet=True)
    assert set(r.raised) == {"a"} and r.score == 25.0 and r.target_met is False

    def interacting(raised):  # b helps alone, but costs once a is raised
        return 20.0 + 5.0 * ("a" in raised) + (1.0 if raised.keys() == {"b"} else -2.0 * ("b" in raised))

    r = search_mixed_precision(["a", "b"], interacting, MixedPrecisionConfig(accuracy_target=30.0), quiet=True)
    assert set(r.raised) == {"a"} and r.score == 25.0
