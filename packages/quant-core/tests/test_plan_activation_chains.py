"""Activation chains between layers (``quant_core.plan.activation_chains``): the scalar
affine steps and decomposed activations a layer's output passes through are quantized once,
at the chain's end; the layer's output range is cut where the chain saturates, and the cut
changes nothing the chain writes."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quant_core.plan import PlanGraph, PlanNode, plan_quantization
from quant_core.plan.activation_chains import find_chains
from quant_core.presets import get_preset

W = np.ones((4, 4, 1, 1), dtype=np.float32)


def _constants(**values: float) -> dict[str, np.ndarray]:
    return {"w": W, **{k: np.float32(v) for k, v in values.items()}}


def _lcnet_graph(scale: float = 2.0, offset: float = 1.0, residual: bool = False) -> PlanGraph:
    """Conv -> Mul(s) -> Add(b) -> x * Clip(x + 3, 0, 6) / 6 -> Mul(s2) -> Add(b2) -> Conv,
    as PP-LCNetV3 writes it (``residual``: the affine output is also added to the result)."""
    c = _constants(s=scale, b=offset, three=3, zero=0, six=6, s2=0.5, b2=-0.1)
    nodes = [
        PlanNode("conv", "Conv", ("x", "w"), ("y",)),
        PlanNode("mul", "Mul", ("s", "y"), ("m",)),
        PlanNode("add", "Add", ("m", "b"), ("a",)),
        PlanNode("plus3", "Add", ("a", "three"), ("p",)),
        PlanNode("clip", "Clip", ("p", "zero", "six"), ("c",)),
        PlanNode("prod", "Mul", ("a", "c"), ("h",)),
        PlanNode("div", "Div", ("h", "six"), ("z",)),
        PlanNode("mul2", "Mul", ("z", "s2"), ("z2",)),
        PlanNode("add2", "Add", ("z2", "b2"), ("z3",)),
        PlanNode("conv2", "Conv", ("z3", "w"), ("o",)),
    ]
    if residual:
        nodes.append(PlanNode("res", "Add", ("o", "a"), ("r",)))
    return PlanGraph(nodes, inputs=("x",), outputs=("r" if residual else "o",), constant=c.get)


def _quantized(plan) -> set[str]:
    return {member for group in plan.groups for member in group.members}


def test_a_pp_lcnet_activation_is_quantized_once_at_its_end() -> None:
    plan = plan_quantization(_lcnet_graph(), get_preset("a8w8"))
    quantized = _quantized(plan)
    assert {"x", "y", "z3"} <= quantized  # the layers' inputs and the first layer's output
    assert not quantized & {"m", "a", "p", "c", "h", "z", "z2", "s", "b", "three", "six", "s2", "b2"}
    assert any("activation chain" in note for note in plan.notes)
    bound = plan.bound_of(plan.group_of("y").key)
    assert (bound.lo, bound.hi) == (-2.0, math.inf)  # 2 * y + 1 < -3 <=> y < -2: HardSwish gives 0


def test_power_of_two_formats_and_the_recipe_switch_keep_every_step_quantized() -> None:
    npu = _quantized(plan_quantization(_lcnet_graph(), get_preset("xint8")))
    assert {"m", "a", "h", "z", "z2", "z3"} <= npu  # an integer-only device runs no float op
    off = _quantized(plan_quantization(_lcnet_graph(), get_preset("a8w8").evolve(transformer_recipe=False)))
    assert {"m", "a", "h", "z", "z2"} <= off


def test_a_tensor_another_op_reads_ends_the_chain_before_it() -> None:
    chains = find_chains(_lcnet_graph(residual=True))
    assert "a" not in chains.float_tensors and "m" in chains.float_tensors  # the residual Add reads "a"
    # a gate is recognised only where the product and the gate alone read its input
    assert not {"p", "c", "h"} & chains.float_tensors and {"z", "z2"} <= chains.float_tensors
    assert "y" not in chains.bounds


@pytest.mark.parametrize(
    ("gate", "bound"),
    [
        (
            [
                PlanNode("plus3", "Add", ("y", "three"), ("p",)),
                PlanNode("clip", "Clip", ("p", "zero", "six"), ("c",)),
                PlanNode("div", "Div", ("c", "six"), ("g",)),
            ],
            (-3.0, math.inf),
        ),  # x * (Clip(x + 3, 0, 6) / 6)
        ([PlanNode("hsig", "HardSigmoid", ("y",), ("g",), {"alpha": 1 / 6, "beta": 0.5})], (-3.0, math.inf)),
        (
            [PlanNode("beta", "Mul", ("y", "one"), ("yb",)), PlanNode("sig", "Sigmoid", ("yb",), ("g",))],
            None,
        ),  # Swish x * Sigmoid(beta x): never saturates
        ([PlanNode("sig", "Sigmoid", ("y",), ("g",))], None),  # SiLU
    ],
    ids=["hardswish_divided_first", "hardsigmoid", "swish", "silu"],
)
def test_gated_products_keep_their_gate_float(gate: list[PlanNode], bound: tuple[float, float] | None) -> None:
    nodes = [
        PlanNode("conv", "Conv", ("x", "w"), ("y",)),
        *gate,
        PlanNode("prod", "Mul", ("y", "g"), ("z",)),
        PlanNode("conv2", "Conv", ("z", "w"), ("o",)),
    ]
    graph = PlanGraph(nodes, inputs=("x",), outputs=("o",), constant=_constants(three=3, zero=0, six=6, one=1).get)
    plan = plan_quantization(graph, get_preset("a8w8"))
    internal = {out for node in gate for out in node.outputs}
    assert internal.isdisjoint(_quantized(plan)) and {"y", "z"} <= _quantized(plan)
    group_bound = plan.bound_of(plan.group_of("y").key)
    assert (None if group_bound is None else (group_bound.lo, group_bound.hi)) == bound


def test_a_clip_inside_a_chain_is_not_fused_and_bounds_the_layer_output() -> None:
    """``silu(relu6(conv(x)))``, as the torch getting-started model writes it."""
    nodes = [
        PlanNode("conv", "Conv", ("x", "w"), ("y",)),
        PlanNode("relu6", "Clip", ("y", "zero", "six"), ("r",)),
        PlanNode("sig", "Sigmoid", ("r",), ("g",)),
        PlanNode("prod", "Mul", ("r", "g"), ("z",)),
        PlanNode("conv2", "Conv", ("z", "w"), ("o",)),
    ]
    graph = PlanGraph(nodes, inputs=("x",), outputs=("o",), constant=_constants(zero=0, six=6).get)
    plan = plan_quantization(graph, get_preset("a8w8"))
    assert plan.fused == () and not {"r", "g"} & _quantized(plan)
    bound = plan.bound_of(plan.group_of("y").key)
    assert (bound.lo, bound.hi) == (0.0, 6.0)


def test_a_constant_another_op_reads_stays_quantizable() -> None:
    c = _constants(k=2.0)
    nodes = [
        PlanNode("conv", "Conv", ("x", "w"), ("y",)),
        PlanNode("scale", "Mul", ("y", "k"), ("m",)),
        PlanNode("relu", "Relu", ("m",), ("r",)),
        PlanNode("conv2", "Conv", ("r", "w"), ("o",)),
        PlanNode("other", "Add", ("o", "k"), ("q",)),
    ]
    chains = find_chains(PlanGraph(nodes, inputs=("x",), outputs=("q",), constant=c.get))
    assert "m" in chains.float_tensors and "k" not in chains.float_tensors
    assert chains.bounds["y"] == (0.0, math.inf)


def test_a_reciprocal_is_no_affine_step() -> None:
    c = _constants(one=1.0)
    nodes = [
        PlanNode("conv", "Conv", ("x", "w"), ("y",)),
        PlanNode("inv", "Div", ("one", "y"), ("d",)),
        PlanNode("relu", "Relu", ("d",), ("r",)),
        PlanNode("conv2", "Conv", ("r", "w"), ("o",)),
    ]
    chains = find_chains(PlanGraph(nodes, inputs=("x",), outputs=("o",), constant=c.get))
    assert "y" not in chains.bounds and "d" not in chains.float_tensors


def _hardswish(v: np.ndarray) -> np.ndarray:
    return v * np.clip(v + 3.0, 0.0, 6.0) / 6.0


@settings(max_examples=200, deadline=None)
@given(
    scale=st.floats(-8, 8).filter(lambda v: abs(v) > 1e-3),
    offset=st.floats(-8, 8),
    beyond=st.floats(0.0, 100.0),
)
def test_values_beyond_the_bound_give_the_chain_output_at_the_bound(scale: float, offset: float, beyond: float) -> None:
    lo, hi = find_chains(_lcnet_graph(scale, offset)).bounds["y"]
    edge, outward = (lo, -1.0) if math.isfinite(lo) else (hi, 1.0)
    assert math.isinf(hi if math.isfinite(lo) else lo)  # one side only: HardSwish is linear above 3
    values = np.array([edge, edge + outward * beyond], np.float64)
    chain = _hardswish(np.float32(scale) * values + np.float32(offset))
    assert chain[1] == pytest.approx(chain[0], abs=1e-9 * max(1.0, abs(beyond * scale)))
