"""plan_weight_qparams: weight qparams from the observer or given (QAT-learned), then the bias fit."""

from __future__ import annotations

import numpy as np

from quant_core.plan import BiasSlot, QuantPlan, WeightSlot, plan_weight_qparams
from quant_core.qparams import QParams
from quant_core.spec import QuantSpec
from quant_core.weights import constant_qparams

SPEC = QuantSpec(dtype="int8", per_channel_axis=0)


def _plan(with_bias: bool) -> QuantPlan:
    weights = (WeightSlot("fc", "Gemm", "w", 1, SPEC),)
    biases = (BiasSlot("fc", "b", 2, "x", "w", None, True),) if with_bias else ()
    return QuantPlan(groups=(), weights=weights, biases=biases, fused=(), quantized_nodes=(), float_nodes=())


VALUES = {"w": np.array([[1e-9, 2e-9], [0.5, -1.0]], np.float32), "b": np.array([4.0, 0.1], np.float32)}
INPUT = QParams.per_tensor(0.02, 128, "uint8")
INT32_MAX = int(np.iinfo(np.int32).max)


def test_without_given_qparams_the_observer_decides() -> None:
    qps, notes = plan_weight_qparams(_plan(False), VALUES.get, lambda n, t: INPUT)
    assert qps["fc"] == constant_qparams(VALUES["w"], SPEC)
    assert notes == []


def test_given_qparams_are_kept_where_the_bias_fits() -> None:
    learned = QParams(np.array([0.5, 0.25], np.float32), np.zeros(2, np.int64), SPEC.dtype, axis=0)
    qps, notes = plan_weight_qparams(_plan(True), VALUES.get, lambda n, t: INPUT, {"fc": learned})
    assert qps["fc"] == learned
    assert notes == []


def test_given_qparams_still_get_the_bias_fit() -> None:
    # A learned scale far too small for channel 0's bias is raised just enough, as for observed ones.
    learned = QParams(np.array([1e-12, 0.25], np.float32), np.zeros(2, np.int64), SPEC.dtype, axis=0)
    qps, notes = plan_weight_qparams(_plan(True), VALUES.get, lambda n, t: INPUT, {"fc": learned})
    assert qps["fc"].scale[0] > 1e-12 and qps["fc"].scale[1] == np.float32(0.25)
    limit = 4.0 / (0.02 * float(qps["fc"].scale[0]))
    assert limit <= np.iinfo(np.int32).max
    assert len(notes) == 1 and "raised on 1 of 2 channels" in notes[0]


def test_the_bias_fit_leaves_room_for_the_layer_products() -> None:
    # The int32 accumulator holds bias + sum of K products (K = 9 * 16 here, inputs reaching
    # 128 codes from their zero point, weights 128): the fitted bias code must leave that much.
    slot = WeightSlot("conv", "Conv", "w", 1, SPEC)
    bias_slot = BiasSlot("conv", "b", 2, "x", "w", None, True)
    plan = QuantPlan(groups=(), weights=(slot,), biases=(bias_slot,), fused=(), quantized_nodes=(), float_nodes=())
    values = {
        "w": (np.random.default_rng(0).standard_normal((2, 16, 3, 3)) * 0.3).astype(np.float32),
        "b": np.array([1e6, 0.5], np.float32),
    }
    qps, notes = plan_weight_qparams(plan, values.get, lambda n, t: INPUT)
    code = 1e6 / (0.02 * float(qps["conv"].scale[0]))
    room = 16 * 9 * 128 * 128
    assert INT32_MAX - room - 5000 < code <= INT32_MAX - room
    assert qps["conv"].scale[1] == constant_qparams(values["w"], SPEC).scale[1]
    assert len(notes) == 1 and "room for the products" in notes[0]
