"""A per-tensor power-of-two weight its min-max grid cannot hold (one outlier element, as
timm's trunc_normal_ init draws in random-weight Swin-Tiny) gets its position by squared
error; every other weight keeps the preset's observer."""

from __future__ import annotations

import numpy as np

from quant_core.observer_config import MinMax, PowerOfTwoMSE
from quant_core.plan import plan_quantization
from quant_core.plan.graph import PlanGraph, PlanNode
from quant_core.presets import get_preset
from quant_core.qparams import fake_quantize, sqnr_db
from quant_core.weights import constant_qparams


def _weights(outlier: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    # large enough for the outlier to carry little of the weight's power (Swin's: 0.2%)
    w1, w2 = (rng.normal(0, 0.02, (384, 384)).astype(np.float32) for _ in range(2))
    if outlier:
        w2[7, 11] = 2.0
    return {"w1": w1, "w2": w2}


def _plan(preset: str, outlier: bool):  # type: ignore[no-untyped-def]
    values = _weights(outlier)
    nodes = [PlanNode("fc1", "MatMul", ("x", "w1"), ("h",)), PlanNode("fc2", "MatMul", ("h", "w2"), ("y",))]
    graph = PlanGraph(nodes, inputs=("x",), outputs=("y",), constant=values.get)
    return plan_quantization(graph, get_preset(preset)), values


def test_an_outlier_weight_gets_its_position_by_squared_error_under_xint8() -> None:
    plan, values = _plan("xint8", outlier=True)
    specs = {slot.node: slot.spec for slot in plan.weights}
    assert specs["fc1"].observer == MinMax()
    assert specs["fc2"].observer == PowerOfTwoMSE(search_below=0, search_above=16)
    assert any("node 'fc2': weight 'w2': its min-max grid (step 0.015625) keeps" in note for note in plan.notes)
    minmax = constant_qparams(values["w2"], specs["fc2"].evolve(observer=MinMax()))
    searched = constant_qparams(values["w2"], specs["fc2"])
    assert float(searched.scale) < float(minmax.scale)  # the outlier clipped further than the nearest power does
    kept = sqnr_db(values["w2"], fake_quantize(values["w2"], minmax))
    assert kept < 15.0 and sqnr_db(values["w2"], fake_quantize(values["w2"], searched)) > kept + 2.0


def test_held_weights_and_other_formats_keep_the_preset_observer() -> None:
    xint8, _ = _plan("xint8", outlier=False)
    assert [slot.spec.observer for slot in xint8.weights] == [MinMax(), MinMax()]
    # per-channel float-scale weights: the outlier costs one channel only; no rule
    a8w8, _ = _plan("a8w8", outlier=True)
    assert [slot.spec for slot in a8w8.weights] == [slot.spec for slot in _plan("a8w8", outlier=False)[0].weights]
    assert not any("min-max grid" in note for note in a8w8.notes + xint8.notes)
