"""Config selectors that select no node are refused before anything is planned."""

from __future__ import annotations

import re

import numpy as np
import pytest

from quant_core.config import OperatorConfig
from quant_core.plan import PlanGraph, PlanNode, check_selectors, plan_quantization, unmatched_selectors
from quant_core.presets import get_preset

NODES = [("stem/conv", "Conv"), ("stem/relu", "Relu"), ("head/fc", "Gemm")]


def _graph() -> PlanGraph:
    nodes = [
        PlanNode("stem/conv", "Conv", ("x", "w"), ("c",)),
        PlanNode("stem/relu", "Relu", ("c",), ("r",)),
        PlanNode("head/fc", "Gemm", ("r", "f"), ("y",), {"transB": 1}),
    ]
    weights = {"w": np.ones((4, 3, 1, 1), np.float32), "f": np.ones((2, 4), np.float32)}
    return PlanGraph(nodes, inputs=("x",), outputs=("y",), constant=weights.get)


@pytest.mark.parametrize("pattern", ["stem/conv", "stem/*", "*fc", "Relu", "Softmax", "MatMul"])
def test_selectors_that_select_or_name_a_quantized_op_type_pass(pattern: str) -> None:
    assert unmatched_selectors(get_preset("a8w8").evolve(exclude=(pattern,)), NODES) == []


@pytest.mark.parametrize("pattern", ["stem/cnv", "NoSuchNode", "tail/*", "relu"])
def test_an_exclusion_that_selects_nothing_is_refused_with_names_to_choose_from(pattern: str) -> None:
    config = get_preset("a8w8").evolve(exclude=("stem/*", pattern))
    with pytest.raises(
        ValueError, match=rf"^exclude: '{re.escape(pattern)}' matches no node .* such as stem/conv, stem/relu"
    ):
        plan_quantization(_graph(), config)


def test_a_name_override_that_selects_nothing_is_refused() -> None:
    override = get_preset("a8w8").global_config
    assert isinstance(override, OperatorConfig)
    config = get_preset("a8w8").evolve(name_overrides={"head/fc": override, "Gemm": override})
    assert unmatched_selectors(config, NODES) == ["name_overrides: 'Gemm' matches no node name of the model"]
    with pytest.raises(ValueError, match=r"^name_overrides: 'Gemm' .*; allowed: node-name globs, such as"):
        check_selectors(config, NODES)


def test_the_check_can_be_left_to_a_backend_planning_part_of_a_model() -> None:
    config = get_preset("a8w8").evolve(exclude=("other_region/conv",))
    plan = plan_quantization(_graph(), config, check_selectors=False)
    assert ("stem/conv", "Conv") in plan.quantized_nodes
    check_selectors(config, [*NODES, ("other_region/conv", "Conv")])  # the whole model: fine


def test_the_names_shown_are_cut_after_eight() -> None:
    nodes = [(f"n{i}", "Relu") for i in range(12)]
    with pytest.raises(ValueError, match=r"such as n0, n1, n2, n3, n4, n5, n6, n7, \.\.\.$"):
        check_selectors(get_preset("a8w8").evolve(exclude=("x",)), nodes)
