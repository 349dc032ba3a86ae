"""The planner's Concat rules: shared qparams inside the graph, float where it only assembles results."""

from __future__ import annotations

import numpy as np
import pytest

from quant_core.plan import PlanGraph, PlanNode, plan_quantization
from quant_core.plan.planner import RESULT_CONCAT_REASON
from quant_core.presets import get_preset


def _detector_head(concat_read: bool) -> PlanGraph:
    """Boxes (Conv -> Exp-like Mul) beside scores (Conv -> Sigmoid), concatenated."""
    w = np.ones((4, 3, 1, 1), dtype=np.float32)
    nodes = [
        PlanNode("box_conv", "Conv", ("x", "wb"), ("b",)),
        PlanNode("box_add", "Add", ("b", "b"), ("boxes",)),
        PlanNode("cls_conv", "Conv", ("x", "wc"), ("c",)),
        PlanNode("sigmoid", "Sigmoid", ("c",), ("scores",)),
        PlanNode("concat", "Concat", ("boxes", "scores"), ("out",), {"axis": 1}),
    ]
    outputs: tuple[str, ...] = ("out",)
    if concat_read:  # a layer reads the Concat: it is no longer the result tail
        nodes.append(PlanNode("fuse", "Conv", ("out", "wf"), ("y",)))
        outputs = ("out", "y")
    constants = {"wb": w, "wc": w, "wf": np.ones((4, 8, 1, 1), dtype=np.float32)}
    return PlanGraph(nodes, inputs=("x",), outputs=outputs, constant=constants.get)


@pytest.mark.parametrize("preset", ["a8w8", "xint8", "a16w8"])
def test_a_concat_that_only_writes_results_stays_float_and_its_inputs_keep_their_own_scales(preset: str) -> None:
    plan = plan_quantization(_detector_head(concat_read=False), get_preset(preset))
    assert [(f.name, f.reason) for f in plan.float_nodes if f.op_type == "Concat"] == [("concat", RESULT_CONCAT_REASON)]
    group_of = {member: group.key for group in plan.groups for member in group.members}
    assert "out" not in group_of
    assert group_of["b"] != group_of["c"]  # the layers' outputs, each on its own range
    if preset == "xint8":  # an integer-only device: the result tail keeps the preset's format
        assert group_of["boxes"] != group_of["scores"]
    else:  # the result tail (quant_core.plan.tail) is float
        assert "boxes" not in group_of and "scores" not in group_of


def test_a_concat_read_inside_the_graph_still_shares_one_group() -> None:
    plan = plan_quantization(_detector_head(concat_read=True), get_preset("a8w8"))
    assert not [f for f in plan.float_nodes if f.op_type == "Concat"]
    group_of = {member: group.key for group in plan.groups for member in group.members}
    assert group_of["boxes"] == group_of["scores"] == group_of["out"]
