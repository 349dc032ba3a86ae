"""Ranges cut where every reader saturates: a tensor read only by HardSwish (0 below -3),
HardSigmoid (constant outside [-beta/alpha, (1 - beta)/alpha]) or an unfused Relu/Clip
spends its codes where a reader sees a difference, and the cut changes no reader's output."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quant_core.observer_config import MinMax, Percentile, PowerOfTwoMSE
from quant_core.observers import make_observer
from quant_core.plan import (
    PlanGraph,
    PlanNode,
    RangeBound,
    calibrated_qparams,
    fresh_observers,
    plan_quantization,
)
from quant_core.presets import get_preset
from quant_core.qparams import dequantize, qparams_from_range, quantize
from quant_core.spec import QuantSpec

W = np.ones((4, 4, 1, 1), dtype=np.float32)


def _graph(*readers: PlanNode, output: str = "y") -> PlanGraph:
    nodes = [PlanNode("conv", "Conv", ("x", "w"), ("c",)), *readers]
    return PlanGraph(nodes, inputs=("x",), outputs=(output,), constant={"w": W}.get)


def _bound(plan, tensor: str) -> tuple[float, float] | None:
    group = plan.group_of(tensor)
    bound = None if group is None else plan.bound_of(group.key)
    return None if bound is None else (bound.lo, bound.hi)


def test_a_conv_output_read_only_by_a_hardswish_is_cut_at_minus_three() -> None:
    plan = plan_quantization(_graph(PlanNode("hs", "HardSwish", ("c",), ("y",))), get_preset("a8w8"))
    assert _bound(plan, "c") == (-3.0, math.inf)
    assert any("saturating" in note for note in plan.notes)


def test_hardsigmoid_bounds_follow_its_attributes_and_readers_take_the_hull() -> None:
    torch_like = PlanNode("hsig", "HardSigmoid", ("c",), ("s",), {"alpha": 1 / 6, "beta": 0.5})
    plan = plan_quantization(_graph(torch_like, PlanNode("mul", "Mul", ("s", "s"), ("y",))), get_preset("a8w8"))
    assert _bound(plan, "c") == pytest.approx((-3.0, 3.0))
    onnx_default = PlanNode("hsig", "HardSigmoid", ("c",), ("s",))
    both = [onnx_default, PlanNode("hs", "HardSwish", ("c",), ("t",)), PlanNode("add", "Add", ("s", "t"), ("y",))]
    plan = plan_quantization(_graph(*both), get_preset("a8w8"))
    assert _bound(plan, "c") == (-3.0, math.inf)  # -2.5..2.5 and -3..inf: values below -3 change neither


@pytest.mark.parametrize(
    "readers",
    [
        [PlanNode("hs", "HardSwish", ("c",), ("h",)), PlanNode("add", "Add", ("c", "h"), ("y",))],  # a residual read
        [PlanNode("sig", "Sigmoid", ("c",), ("y",))],  # saturates only in the limit: not exact
    ],
    ids=["another_reader", "sigmoid"],
)
def test_no_cut_when_a_reader_does_not_saturate(readers: list[PlanNode]) -> None:
    assert _bound(plan_quantization(_graph(*readers), get_preset("a8w8")), "c") is None


def test_no_cut_on_a_graph_output_or_a_fused_activation() -> None:
    plan = plan_quantization(
        _graph(PlanNode("hs", "HardSwish", ("c",), ("y",)), output="c"), get_preset("a8w8")
    )  # the conv output is also a result
    assert _bound(plan, "c") is None
    fused = plan_quantization(_graph(PlanNode("relu", "Relu", ("c",), ("y",))), get_preset("a8w8"))
    assert fused.bounds == ()  # the Relu's own range already decides


def test_calibration_cuts_the_selected_range_and_the_reader_sees_no_difference() -> None:
    plan = plan_quantization(_graph(PlanNode("hs", "HardSwish", ("c",), ("y",))), get_preset("a8w8"))
    group = plan.group_of("c")
    assert group is not None
    values = np.random.default_rng(0).normal(0.0, 8.0, 10_000).astype(np.float32)
    observers = fresh_observers(plan)
    for key, observer in observers.items():
        observer.update(values if key == group.key else np.maximum(values, 0.0))
    cut = calibrated_qparams(plan, observers, {"w": W}.get).activations[group.key]
    plain = observers[group.key].qparams(group.spec)
    assert cut.scale < 0.6 * plain.scale  # the codes below -3 went where the HardSwish reads them

    def hardswish(x: np.ndarray) -> np.ndarray:
        return x * np.clip(x / 6 + 0.5, 0, 1)

    seen = dequantize(quantize(values, cut), cut)
    lowest = float(np.min(seen))
    assert lowest <= -3.0 and hardswish(np.array([lowest]))[0] == 0.0
    exact = hardswish(np.clip(values, lowest, None))
    np.testing.assert_array_equal(hardswish(seen[values < -3.0]), exact[values < -3.0])


@settings(max_examples=400, deadline=None)
@given(
    bound=st.floats(-8.0, -0.5),
    below=st.floats(0.2, 57.0),
    hi=st.floats(0.05, 60.0),
    spec=st.sampled_from(
        [
            QuantSpec(dtype="uint8", symmetric=False),
            QuantSpec(dtype="int8"),
            QuantSpec(dtype="int8", scale_type="power_of_two"),
            QuantSpec(dtype="uint16", symmetric=False),
        ]
    ),
    upper=st.sampled_from([math.inf, 3.0]),
)
def test_the_cut_grid_still_reaches_the_bound(
    bound: float, below: float, hi: float, spec: QuantSpec, upper: float
) -> None:
    """The widened cut keeps the grid's lowest (highest) value at or beyond the bound after
    the zero point is rounded and after a power-of-two scale is chosen (the nearest power
    may stop short: then the covering one), so a value past it still gives the reader the
    bound's output; and the cut never widens the observed range."""
    lo = bound - below
    observer = make_observer(spec)
    observer.update(np.array([lo, hi], np.float32))
    (cut_lo, cut_hi), qp = RangeBound("g", bound, upper).selection(observer, spec)
    plain_lo, plain_hi = observer.selection(spec)[0]
    assert plain_lo <= cut_lo <= bound + 1e-9 and cut_hi <= plain_hi
    grid = dequantize(np.array([qp.qmin, qp.qmax]), qp)
    if plain_lo < bound:
        assert grid[0] <= bound + 1e-6 * max(1.0, abs(lo))
    if upper < math.inf and plain_hi > upper:
        assert grid[1] >= upper - 1e-6 * max(1.0, hi)
    covering = qparams_from_range(cut_lo, cut_hi, spec, covering=True)
    assert qp in (qparams_from_range(cut_lo, cut_hi, spec), covering)


@pytest.mark.parametrize(
    "observer", [PowerOfTwoMSE(bins=2048, search_below=1, search_above=3), Percentile(99.99), MinMax()]
)
def test_a_symmetric_grid_is_sized_by_the_values_the_readers_tell_apart(observer) -> None:
    """A HardSwish input reaching -20 but only +2.5 above: a symmetric selection folds both
    sides, so the negative tail would set the scale; selected from the values clipped at -3
    (what the HardSwish sees), the scale is sized by 3 and the grid still reaches -3."""
    spec = QuantSpec(dtype="int8", scale_type="power_of_two", observer=observer)
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.uniform(-20.0, -3.0, 4000), rng.uniform(-3.0, 2.5, 4000)]).astype(np.float32)
    stats = make_observer(spec)
    stats.update(values)
    (_lo, _hi), cut = RangeBound("g", -3.0, math.inf).selection(stats, spec)
    plain = stats.qparams()
    assert float(cut.scale) * 127 >= 3.0  # reaches the bound
    assert float(cut.scale) <= float(plain.scale) / 4  # 20 -> 3: two powers of two finer at least
    reader_in = dequantize(quantize(values, cut), cut)
    hardswish = reader_in * np.clip(reader_in + 3, 0, 6) / 6
    exact = values * np.clip(values + 3, 0, 6) / 6
    coarse_in = dequantize(quantize(values, plain), plain)
    coarse = coarse_in * np.clip(coarse_in + 3, 0, 6) / 6
    assert np.abs(hardswish - exact).max() < np.abs(coarse - exact).max()
