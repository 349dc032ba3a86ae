from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from reference_ops import chain, rel_err

from quant_algos.cle import absorb_high_bias, equalize_chains, equalize_pair, equalize_triple, expected_min
from quant_algos.layer import Layer, input_ranges, output_ranges
from quant_core.algorithm_config import CLEConfig


def _imbalanced(rng: np.random.Generator, shape: tuple[int, ...], spread: float = 3.0) -> np.ndarray:
    """Random weights whose output channels differ in range by up to ``e**spread``."""
    w = rng.normal(size=shape)
    return w * np.exp(rng.uniform(-spread, spread, size=(shape[0],) + (1,) * (len(shape) - 1)))


def _ratio(r: np.ndarray) -> float:
    return float(r.max() / r.min())


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def test_pair_keeps_function_and_balances_ranges(rng):
    a = Layer(_imbalanced(rng, (6, 3, 3, 3)), rng.normal(size=6))
    b = Layer(rng.normal(size=(5, 6, 3, 3)), rng.normal(size=5))
    x = rng.normal(size=(2, 3, 9, 9))
    a2, b2, s = equalize_pair(a, b)
    assert rel_err(chain([a2, b2], x, pad=1), chain([a, b], x, pad=1)) < 1e-5
    assert np.allclose(output_ranges(a2), input_ranges(b2))
    assert _ratio(output_ranges(a2)) < _ratio(output_ranges(a))
    assert np.all(s > 0)


def test_pair_with_grouped_second_layer(rng):
    a = Layer(_imbalanced(rng, (8, 4, 1, 1)), rng.normal(size=8))
    b = Layer(rng.normal(size=(6, 4, 3, 3)), None, groups=2)
    x = rng.normal(size=(2, 4, 6, 6))
    a2, b2, _ = equalize_pair(a, b)
    assert rel_err(chain([a2, b2], x, pad=1), chain([a, b], x, pad=1)) < 1e-5
    assert np.allclose(output_ranges(a2), input_ranges(b2))


def test_triple_keeps_function_and_equalizes_all_three(rng):
    a = Layer(_imbalanced(rng, (8, 4, 1, 1)), rng.normal(size=8))
    dw = Layer(_imbalanced(rng, (8, 1, 3, 3)), rng.normal(size=8), groups=8)
    c = Layer(rng.normal(size=(5, 8, 1, 1)), rng.normal(size=5))
    x = rng.normal(size=(2, 4, 7, 7))
    a2, dw2, c2, s12, s23 = equalize_triple(a, dw, c)
    assert rel_err(chain([a2, dw2, c2], x, pad=1), chain([a, dw, c], x, pad=1)) < 1e-5
    assert np.allclose(output_ranges(a2), output_ranges(dw2))
    assert np.allclose(output_ranges(dw2), input_ranges(c2))
    assert _ratio(output_ranges(dw2)) < _ratio(output_ranges(dw))
    assert np.all(s12 > 0) and np.all(s23 > 0)


def test_gemm_chain_and_dead_channel(rng):
    w1 = _imbalanced(rng, (5, 7))
    w1[2] = 0.0  # a dead channel keeps scale 1 instead of dividing by zero
    a, b = Layer(w1, rng.normal(size=5)), Layer(rng.normal(size=(3, 5)), None)
    x = rng.normal(size=(10, 7))
    a2, b2, s = equalize_pair(a, b)
    assert s[2] == 1.0 and np.all(np.isfinite(a2.weight))
    assert rel_err(chain([a2, b2], x), chain([a, b], x)) < 1e-5


@given(
    st.integers(1, 6),
    st.integers(1, 6),
    st.integers(1, 6),
    st.integers(0, 2**31 - 1),
    st.booleans(),
)
def test_pair_property(cin, mid, cout, seed, bias_in_scale):
    rng = np.random.default_rng(seed)
    a = Layer(_imbalanced(rng, (mid, cin)), rng.normal(size=mid))
    b = Layer(rng.normal(size=(cout, mid)), rng.normal(size=cout))
    x = rng.normal(size=(4, cin))
    a2, b2, _ = equalize_pair(a, b, bias_in_scale=bias_in_scale)
    assert rel_err(chain([a2, b2], x), chain([a, b], x)) < 1e-5
    assert np.allclose(output_ranges(a2, include_bias=bias_in_scale), input_ranges(b2))


def test_bias_in_scale_uses_bias_range(rng):
    a = Layer(np.full((2, 1), 1.0), np.array([8.0, 0.0]))
    b = Layer(np.ones((1, 2)), None)
    _, _, plain = equalize_pair(a, b)
    _, _, with_bias = equalize_pair(a, b, bias_in_scale=True)
    assert np.allclose(plain, 1.0) and np.isclose(with_bias[0], np.sqrt(8.0)) and with_bias[1] == 1.0


def test_chains_shared_layers_adaptive_converges_and_is_idempotent(rng):
    layers = {
        "c1": Layer(_imbalanced(rng, (6, 3, 3, 3)), rng.normal(size=6)),
        "c2": Layer(_imbalanced(rng, (8, 6, 1, 1)), rng.normal(size=8)),
        "dw": Layer(_imbalanced(rng, (8, 1, 3, 3)), rng.normal(size=8), groups=8),
        "c3": Layer(rng.normal(size=(4, 8, 1, 1)), rng.normal(size=4)),
    }
    chains = [("c1", "c2"), ("c2", "dw", "c3")]
    x = rng.normal(size=(2, 3, 8, 8))
    order = ["c1", "c2", "dw", "c3"]
    originals = {n: layers[n].weight.copy() for n in order}
    before = chain([layers[n] for n in order], x, pad=1)
    cfg = CLEConfig(steps=0, tolerance=1e-6, max_steps=200)
    result = equalize_chains(layers, chains, cfg)
    assert result.converged and 1 < result.steps < 200
    after = chain([result.layers[n] for n in order], x, pad=1)
    assert rel_err(after, before) < 1e-5
    again = equalize_chains(result.layers, chains, cfg)
    assert again.steps == 1
    for name in order:
        assert np.allclose(again.layers[name].weight, result.layers[name].weight, rtol=1e-5)
    # Fixed steps do exactly that many sweeps, and the inputs are not modified.
    fixed = equalize_chains(layers, chains, CLEConfig(steps=3))
    assert fixed.steps == 3
    assert all(np.array_equal(layers[n].weight, originals[n]) for n in order)
    assert result.output_divisors["c1"].shape == (6,) and set(result.output_divisors) == {"c1", "c2", "dw"}


def test_high_bias_absorption_keeps_function_where_preactivation_is_high(rng):
    # Positive pre-activations with a known lower bound: absorption is exact there.
    a = Layer(rng.normal(size=(4, 3)) * 0.1, np.array([5.0, 3.0, -1.0, 2.0]))
    b = Layer(rng.normal(size=(2, 4)), rng.normal(size=2))
    x = rng.uniform(-1, 1, size=(64, 3))
    pre = x @ a.weight.T + a.bias
    lower = pre.min(axis=0)
    a2, b2, c = absorb_high_bias(a, b, lower)
    assert np.all(c[[0, 1, 3]] > 0) and c[2] == 0.0
    assert np.all(a2.bias <= a.bias)
    assert rel_err(chain([a2, b2], x), chain([a, b], x)) < 1e-5


def test_equalize_chains_absorbs_with_expected_mins_in_original_units(rng):
    layers = {
        "a": Layer(_imbalanced(rng, (4, 3, 1, 1), 1.0) * 0.1, np.array([6.0, 4.0, 5.0, 3.0])),
        "b": Layer(rng.normal(size=(2, 4, 1, 1)), rng.normal(size=2)),
    }
    x = rng.uniform(-1, 1, size=(3, 3, 5, 5))
    pre = chain([layers["a"]], x)
    mins = {"a": expected_min(pre.mean(axis=(0, 2, 3)), pre.std(axis=(0, 2, 3)), num_std=6.0)}
    assert np.all(mins["a"] <= pre.min(axis=(0, 2, 3)))
    result = equalize_chains(layers, [("a", "b")], CLEConfig(steps=2), expected_mins=mins)
    assert "a" in result.absorbed and np.any(result.absorbed["a"] > 0)
    assert rel_err(chain([result.layers["a"], result.layers["b"]], x), chain([layers["a"], layers["b"]], x)) < 1e-5
    off = equalize_chains(layers, [("a", "b")], CLEConfig(steps=2, absorb_high_bias=False), expected_mins=mins)
    assert off.absorbed == {}


def test_invalid_chains_are_named(rng):
    layers = {
        "a": Layer(rng.normal(size=(4, 3, 1, 1))),
        "b": Layer(rng.normal(size=(2, 5, 1, 1))),
        "c": Layer(rng.normal(size=(4, 4, 3, 3))),
        "d": Layer(rng.normal(size=(2, 4, 1, 1))),
    }
    with pytest.raises(ValueError, match="a->b"):
        equalize_chains(layers, [("a", "b")], CLEConfig())
    with pytest.raises(ValueError, match="unknown layer 'zz'"):
        equalize_chains(layers, [("a", "zz")], CLEConfig())
    with pytest.raises(ValueError, match="not depthwise"):
        equalize_chains(layers, [("a", "c", "d")], CLEConfig())
    with pytest.raises(ValueError, match="length 1"):
        equalize_chains(layers, [("a",)], CLEConfig())
    with pytest.raises(ValueError, match="groups"):
        Layer(np.ones((4, 1, 3, 3)), groups=3)
    with pytest.raises(ValueError, match="bias"):
        Layer(np.ones((4, 2)), np.ones(3))
