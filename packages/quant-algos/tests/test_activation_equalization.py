"""Where activation equalization applies, and its scales."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from quant_algos.activation_equalization import equalization_sites, equalizing_scales
from quant_core.plan.activation_chains import find_chains
from quant_core.plan.graph import PlanGraph, PlanNode

CONSTANTS = {
    "w": np.ones((2, 2, 1, 1), np.float32),
    "dw": np.ones((2, 1, 3, 3), np.float32),
    "three": np.float32(3.0),
    "zero": np.float32(0.0),
    "six": np.float32(6.0),
}


def _sites(nodes: list[PlanNode], outputs: tuple[str, ...] = ("o",)) -> list[tuple[str, str, str, str | None]]:
    graph = PlanGraph(nodes, inputs=("x",), outputs=outputs, constant=CONSTANTS.get)
    return [(s.side, s.tensor, s.layer, s.fold) for s in equalization_sites(graph, find_chains(graph))]


def _silu(x: str, out: str) -> list[PlanNode]:
    return [PlanNode(f"{x}_sig", "Sigmoid", (x,), (f"{x}_g",)), PlanNode(f"{x}_mul", "Mul", (x, f"{x}_g"), (out,))]


def test_conv_relu_depthwise_folds_into_the_conv() -> None:
    nodes = [
        PlanNode("conv", "Conv", ("x", "w"), ("y",)),
        PlanNode("relu", "Relu", ("y",), ("r",)),
        PlanNode("dw", "Conv", ("r", "dw"), ("o",), {"group": 2}),
    ]
    assert _sites(nodes) == [("input", "r", "dw", "conv")]


def test_a_shared_input_or_a_lone_activation_is_no_site() -> None:
    shared = [
        PlanNode("conv", "Conv", ("x", "w"), ("y",)),
        PlanNode("dw", "Conv", ("y", "dw"), ("o",), {"group": 2}),
        PlanNode("other", "Relu", ("y",), ("o2",)),
    ]
    assert _sites(shared, ("o", "o2")) == []
    # A Conv followed by one Relu is fused by the planner (its output is not quantized),
    # and a grouped Conv that is not depthwise takes no input scale.
    lone = [
        PlanNode("conv", "Conv", ("x", "w"), ("y",)),
        PlanNode("relu", "Relu", ("y",), ("r",)),
        PlanNode("conv2", "Conv", ("r", "w"), ("o",)),
    ]
    assert _sites(lone) == []


def test_silu_chain_heads_and_ends() -> None:
    nodes = [
        PlanNode("conv", "Conv", ("x", "w"), ("y",)),
        *_silu("y", "z"),
        PlanNode("dw", "Conv", ("z", "dw"), ("o",), {"group": 2}),
    ]
    assert _sites(nodes) == [("output", "y", "conv", "conv"), ("input", "z", "dw", None)]
    # The head itself a graph output: something outside reads y unscaled.
    assert _sites(nodes, ("o", "y")) == []


@given(
    arrays(np.float64, st.integers(1, 16), elements=st.floats(-1e4, 0.0)),
    arrays(np.float64, st.integers(1, 16), elements=st.floats(0.0, 1e4)),
)
def test_scales_stretch_each_channel_inside_the_tensors_own_range(low: np.ndarray, high: np.ndarray) -> None:
    n = min(low.size, high.size)
    low, high = low[:n], high[:n]
    scales = equalizing_scales(low, high)
    assert np.all(scales > 0) and np.all(scales <= 1.0)
    bottom, top = low.min(), high.max()
    # The tensor's range does not widen...
    assert np.all(low / scales >= bottom * (1 + 1e-9)) and np.all(high / scales <= top * (1 + 1e-9))
    # ...and every live channel unclamped reaches one of its ends.
    live = ((high > 0) | (low < 0)) & (scales > 1e-4)
    reaches = np.isclose(high / scales, top, rtol=1e-9) | np.isclose(low / scales, bottom, rtol=1e-9)
    assert np.all(reaches[live])
    np.testing.assert_array_equal(scales[(high <= 0) & (low >= 0)], 1.0)
