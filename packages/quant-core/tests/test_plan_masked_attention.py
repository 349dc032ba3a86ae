"""Masked attention scores under the transformer recipe (quant_core.plan.transformer,
quant_core.plan.planner.DerivedRange): a mask is recognised by its structure, and where
the masked scores are quantized (power-of-two presets) their range, and the mask's, come
from the scores before the mask instead of the fill."""

from __future__ import annotations

import math

import numpy as np
import pytest

from quant_core.observers import make_observer
from quant_core.plan import (
    DerivedRange,
    PlanGraph,
    PlanNode,
    calibrated_qparams,
    fresh_observers,
    observer_feeds,
    plan_quantization,
)
from quant_core.plan.transformer import find_blocks, mask_fill
from quant_core.presets import get_preset
from quant_core.qparams import fake_quantize

RNG = np.random.default_rng(0)
TOKENS = 6
CAUSAL = np.triu(np.full((TOKENS, TOKENS), np.finfo(np.float32).min, np.float32), 1)


def attention(mask_nodes: list[PlanNode], masked: str, extra: dict[str, np.ndarray]) -> PlanGraph:
    """``q @ k -> * scale -> [mask] -> Softmax -> @ v``; ``masked``: what the Softmax reads."""
    constants = {"scale": np.float32(0.5), "zero": np.float32(0.0), **extra}
    nodes = [
        PlanNode("qk", "MatMul", ("q", "k"), ("qk",)),
        PlanNode("scaled", "Mul", ("qk", "scale"), ("s",)),
        *mask_nodes,
        PlanNode("softmax", "Softmax", (masked,), ("p",), {"axis": -1}),
        PlanNode("av", "MatMul", ("p", "v"), ("o",)),
    ]
    inputs = ("q", "k", "v", "keep")
    return PlanGraph(nodes, inputs=inputs, outputs=("o",), constant=constants.get, non_float=("keep",))


GRAPHS = {
    "causal constant": lambda: attention([PlanNode("add", "Add", ("s", "mask"), ("m",))], "m", {"mask": CAUSAL}),
    "swin -100 through Unsqueeze": lambda: attention(
        [PlanNode("unsq", "Unsqueeze", ("win",), ("mask",)), PlanNode("add", "Add", ("mask", "s"), ("m",))],
        "m",
        {"win": np.where(RNG.random((TOKENS, TOKENS)) > 0.5, -100.0, 0.0).astype(np.float32)},
    ),
    "boolean Where(keep, 0, -inf)": lambda: attention(
        [PlanNode("w", "Where", ("keep", "zero", "fill"), ("mask",)), PlanNode("add", "Add", ("s", "mask"), ("m",))],
        "m",
        {"fill": np.float32(-np.inf)},
    ),
    # nn.MultiheadAttention with attn_mask and key_padding_mask: the two masks added
    "sum of a causal constant and a boolean Where": lambda: attention(
        [
            PlanNode("w", "Where", ("keep", "zero", "fill"), ("pad",)),
            PlanNode("unsq", "Unsqueeze", ("causal",), ("moved",)),
            PlanNode("both", "Add", ("moved", "pad"), ("mask",)),
            PlanNode("add", "Add", ("s", "mask"), ("m",)),
        ],
        "m",
        {"causal": CAUSAL, "fill": np.float32(-np.inf)},
    ),
    "masked_fill on the scores": lambda: attention(
        [PlanNode("w", "Where", ("keep", "s", "fill"), ("m",))], "m", {"fill": np.float32(-1e4)}
    ),
}


def bias_graph(bias: np.ndarray) -> PlanGraph:
    return attention([PlanNode("add", "Add", ("s", "bias"), ("m",))], "m", {"bias": bias})


@pytest.mark.parametrize("form", list(GRAPHS))
def test_masks_are_recognised_by_structure(form: str) -> None:
    (found,) = find_blocks(GRAPHS[form]()).masked_scores
    assert (found.output, found.scores, found.softmax_output) == ("m", "s", "p")
    assert found.mask == ("" if form == "masked_fill on the scores" else "mask")


@pytest.mark.parametrize(
    "bias",
    [
        RNG.standard_normal((TOKENS, TOKENS)).astype(np.float32),  # a relative-position bias
        -np.abs(RNG.standard_normal((TOKENS, TOKENS))).astype(np.float32),  # every value <= 0 (ALiBi-like)
        np.where(RNG.random((TOKENS, TOKENS)) > 0.5, -1.0, 0.0).astype(np.float32),  # two values, a small one
        np.where(RNG.random((TOKENS, TOKENS)) > 0.5, 100.0, 0.0).astype(np.float32),  # a large positive one
    ],
    ids=["gaussian", "non-positive", "zero_or_minus_one", "zero_or_plus_100"],
)
def test_an_additive_bias_is_not_a_mask(bias: np.ndarray) -> None:
    graph = bias_graph(bias)
    assert mask_fill(graph, "bias") is None
    assert find_blocks(graph).masked_scores == ()
    assert plan_quantization(graph, get_preset("xint8")).derived == ()


def test_where_between_two_fills_or_a_small_value_is_not_a_mask() -> None:
    graph = attention(
        [PlanNode("w", "Where", ("keep", "zero", "small"), ("mask",)), PlanNode("add", "Add", ("s", "mask"), ("m",))],
        "m",
        {"small": np.float32(-5.0)},
    )
    assert mask_fill(graph, "mask") is None and find_blocks(graph).masked_scores == ()


@pytest.mark.parametrize("form", ["causal constant", "boolean Where(keep, 0, -inf)"])
def test_xint8_derives_the_masked_scores_and_the_mask_from_the_scores(form: str) -> None:
    plan = plan_quantization(GRAPHS[form](), get_preset("xint8"))
    masked, mask = plan.group_of("m"), plan.group_of("mask")
    assert masked is not None and mask is not None
    scores = plan.group_of("s")
    assert scores is not None
    margin = 8 * math.log(2.0)  # the int8 softmax output
    assert plan.derived_of(masked.key) == DerivedRange(masked.key, (scores.key,), margin, masked=False)
    assert plan.derived_of(mask.key) == DerivedRange(mask.key, (scores.key,), margin, masked=True)
    # neither is observed: a computed -inf fill could not be
    assert "m" not in observer_feeds(plan) and "mask" not in observer_feeds(plan)
    assert masked.key not in fresh_observers(plan) and mask.key not in fresh_observers(plan)


@pytest.mark.parametrize("preset", ["a8w8", "a16w8"])
def test_float_scale_presets_keep_scores_and_mask_float(preset: str) -> None:
    plan = plan_quantization(GRAPHS["boolean Where(keep, 0, -inf)"](), get_preset(preset))
    assert plan.derived == ()
    assert all(plan.group_of(t) is None for t in ("s", "mask", "m"))


@pytest.mark.parametrize("preset", ["a8w8", "a16w8"])
@pytest.mark.parametrize("fill", [-100.0, -np.inf], ids=["swin", "minus_inf"])
def test_float_scale_presets_keep_a_constant_mask_read_through_data_movement_float(preset: str, fill: float) -> None:
    # nn.MultiheadAttention unsqueezes its attn_mask (nn.Transformer's causal mask is -inf):
    # the Unsqueeze quantized the constant, whose observer then refused the -inf.
    win = np.triu(np.full((TOKENS, TOKENS), fill, np.float32), 1)
    graph = attention(
        [PlanNode("unsq", "Unsqueeze", ("win",), ("mask",)), PlanNode("add", "Add", ("mask", "s"), ("m",))],
        "m",
        {"win": win},
    )
    plan = plan_quantization(graph, get_preset(preset))
    assert all(plan.group_of(t) is None for t in ("win", "mask", "m", "s")), plan.groups
    assert "win" not in observer_feeds(plan)


def test_masked_positions_stay_masked_and_visible_scores_keep_their_grid() -> None:
    """Calibrated as the backends do: the visible scores get the step they would get
    without a mask, and every masked position quantizes to a value whose softmax weight
    rounds to zero on the int8 [0, 1] grid."""
    graph = GRAPHS["causal constant"]()
    plan = plan_quantization(graph, get_preset("xint8"))
    observers = fresh_observers(plan)
    scores = RNG.standard_normal((64, TOKENS, TOKENS)).astype(np.float32) * 3
    for tensor, keys in observer_feeds(plan).items():
        value = graph.constant(tensor)
        for key in keys:
            observers[key].update(scores if value is None else value)  # the scores stand in for every input
    q = calibrated_qparams(plan, observers, graph.constant)
    masked_key, mask_key, scores_key = (plan.group_of(t).key for t in ("m", "mask", "s"))  # type: ignore[union-attr]
    alone = make_observer(plan.group_of("m").spec)  # type: ignore[union-attr]
    alone.update(scores)
    assert float(q.activations[masked_key].scale) <= 2 * float(alone.qparams().scale)
    lo = q.ranges[scores_key][0]
    assert float(q.ranges[masked_key][0]) == pytest.approx(float(lo) - 8 * math.log(2.0))
    # the backends' arithmetic: mask and sum each quantized, then softmax of the sum
    mask_q = fake_quantize(CAUSAL, q.activations[mask_key])
    summed = fake_quantize(fake_quantize(scores, q.activations[scores_key]) + mask_q, q.activations[masked_key])
    weights = np.exp(summed - summed.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    hidden = np.broadcast_to(CAUSAL < 0, weights.shape)
    assert weights[hidden].max() < 1 / 256  # rounds to 0 on the int8 softmax grid (step 1/128)
    # and without the rule the fill sets the range: the visible scores fall to a code or two
    fill_range = make_observer(plan.group_of("m").spec)  # type: ignore[union-attr]
    fill_range.update(scores + CAUSAL)
    assert float(fill_range.qparams().scale) > 1e30


SUM = "sum of a causal constant and a boolean Where"


def test_a_sum_of_two_masks_is_a_mask_and_a_mask_plus_a_bias_is_not() -> None:
    graph = GRAPHS[SUM]()
    assert mask_fill(graph, "mask") == float(CAUSAL.min())  # the larger fill: -inf + the causal one
    (found,) = find_blocks(graph).masked_scores
    assert set(found.mask_tensors) == {"mask", "moved", "causal", "pad"}
    bias = RNG.standard_normal((TOKENS, TOKENS)).astype(np.float32)
    graph_with_bias = attention(
        [
            PlanNode("w", "Where", ("keep", "zero", "fill"), ("pad",)),
            PlanNode("both", "Add", ("bias", "pad"), ("mask",)),
            PlanNode("add", "Add", ("s", "mask"), ("m",)),
        ],
        "m",
        {"bias": bias, "fill": np.float32(-np.inf)},
    )
    assert mask_fill(graph_with_bias, "mask") is None and find_blocks(graph_with_bias).masked_scores == ()


@pytest.mark.parametrize("preset", ["a8w8", "a16w8", "xint8"])
def test_a_sum_of_masks_is_float_or_derived_never_observed(preset: str) -> None:
    # before: each summand was its own group, observed with its -inf (calibration refused it)
    plan = plan_quantization(GRAPHS[SUM](), get_preset(preset))
    feeds = observer_feeds(plan)
    assert not {"causal", "moved", "pad", "mask", "m"} & set(feeds)
    if preset == "xint8":  # quantized where an integer device runs them, on ranges from the scores
        for tensor in ("moved", "pad", "mask"):
            group = plan.group_of(tensor)
            assert group is not None and plan.derived_of(group.key) is not None, tensor
