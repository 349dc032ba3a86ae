"""The NPU conversion rules: names, matching on a float graph, the device's hardsigmoid,
and ConvTranspose as zero insertion + Conv against a direct scatter implementation."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from quant_core.config import QuantConfig
from quant_core.conversions import (
    DEVICE_HARD_SIGMOID_ALPHA,
    DEVICE_HARD_SIGMOID_BETA,
    NPU_CONVERSIONS,
    RULES,
    ConvTransposeAsConv,
    conv_weight,
    device_hard_sigmoid,
    parse_conversions,
    zero_insert,
)
from quant_core.errors import ConfigError
from quant_core.plan.conversions import find_matches, float_view
from quant_core.plan.graph import PlanGraph, PlanNode
from quant_core.presets import get_preset
from quant_core.serialization import config_from_json, config_to_json


def test_every_rule_says_where_it_comes_from_and_the_defaults_exist() -> None:
    assert all(rule.source and rule.becomes for rule in RULES.values())
    assert set(NPU_CONVERSIONS) <= set(RULES)


def test_device_constants_are_exact_in_float32() -> None:
    for value in (DEVICE_HARD_SIGMOID_ALPHA, DEVICE_HARD_SIGMOID_BETA):
        assert float(np.float32(value)) == value
    # relu6(x + 3) * 2731 / 2**14, and 1 where the device saturates
    x = np.linspace(-5, 5, 101)
    expected = np.minimum(np.clip(x + 3, 0, None) * 2731 / 16384, 1.0)
    np.testing.assert_array_equal(device_hard_sigmoid(x), expected)


def test_config_field_is_checked_ordered_and_round_trips() -> None:
    config = get_preset("xint8").evolve(npu_conversions=("sigmoid", "silu"))
    assert config.npu_conversions == ("silu", "sigmoid")
    assert config_from_json(config_to_json(config)) == config
    with pytest.raises(ValueError, match=r"^npu_conversions: 'hardswish' is not allowed; allowed: silu, "):
        get_preset("xint8").evolve(npu_conversions=("hardswish",))
    with pytest.raises(ValueError, match="listed twice"):
        parse_conversions(["silu", "silu"])
    with pytest.raises(ConfigError, match=r"^npu_conversions: \['silu'\] is not allowed"):  # was a bare TypeError
        parse_conversions([["silu"]])
    assert QuantConfig(global_config=get_preset("a8w8").global_config).npu_conversions == ()


def _graph(nodes: list[PlanNode], constants: dict[str, np.ndarray] | None = None) -> PlanGraph:
    return PlanGraph(nodes, inputs=("x",), outputs=(nodes[-1].outputs[0],), constant=(constants or {}).get)


def test_silu_and_sigmoid_are_told_apart() -> None:
    nodes = [
        PlanNode("s1", "Sigmoid", ("x",), ("g1",)),
        PlanNode("m1", "Mul", ("g1", "x"), ("a",)),  # x * sigmoid(x), either order
        PlanNode("s2", "Sigmoid", ("a",), ("g2",)),
        PlanNode("m2", "Mul", ("x", "g2"), ("b",)),  # a gate: sigmoid(a) * x is no SiLU
        PlanNode("h", "HardSigmoid", ("b",), ("c",), {"alpha": 1 / 6, "beta": 0.5}),
        PlanNode("h2", "HardSigmoid", ("c",), ("d",), {"alpha": 0.2, "beta": 0.5}),  # not the device's
        PlanNode("t", "Tanh", ("d",), ("e",)),
    ]
    view = float_view(_graph(nodes))
    found = [(m.rule, m.node, m.related) for m in find_matches(view, ("tanh", "hard_sigmoid", "sigmoid", "silu"))]
    assert found == [("silu", "s1", ("m1",)), ("sigmoid", "s2", ()), ("hard_sigmoid", "h", ()), ("tanh", "t", ())]
    assert [m.node for m in find_matches(view, ("sigmoid",))] == ["s2"]


def test_sigmoid_tanh_takes_every_sigmoid_the_other_rules_leave() -> None:
    """``sigmoid_tanh`` rewrites a Sigmoid wherever it is (SiLU's included); listed with
    ``silu``, the SiLUs go to ``silu`` (RULES order) and the rest to ``sigmoid_tanh``."""
    nodes = [
        PlanNode("s1", "Sigmoid", ("x",), ("g1",)),
        PlanNode("m1", "Mul", ("g1", "x"), ("a",)),
        PlanNode("s2", "Sigmoid", ("a",), ("y",)),
    ]
    view = float_view(_graph(nodes))
    assert [(m.rule, m.node) for m in find_matches(view, ("sigmoid_tanh",))] == [
        ("sigmoid_tanh", "s1"),
        ("sigmoid_tanh", "s2"),
    ]
    assert [(m.rule, m.node) for m in find_matches(view, ("sigmoid_tanh", "silu"))] == [
        ("silu", "s1"),
        ("sigmoid_tanh", "s2"),
    ]
    assert RULES["sigmoid_tanh"].exact


@given(st.floats(-30.0, 30.0))
def test_sigmoid_tanh_constants_give_the_sigmoid(x: float) -> None:
    from quant_core.conversions import SIGMOID_TANH_OFFSET, SIGMOID_TANH_SCALE

    expected = 1.0 / (1.0 + math.exp(-x))
    assert abs(SIGMOID_TANH_SCALE * math.tanh(SIGMOID_TANH_SCALE * x) + SIGMOID_TANH_OFFSET - expected) < 1e-12


def test_sigmoid_read_by_another_op_is_not_a_silu() -> None:
    nodes = [
        PlanNode("s", "Sigmoid", ("x",), ("g",)),
        PlanNode("m", "Mul", ("x", "g"), ("a",)),
        PlanNode("add", "Add", ("a", "g"), ("y",)),
    ]
    assert [(m.rule, m.node) for m in find_matches(float_view(_graph(nodes)), NPU_CONVERSIONS)] == [("sigmoid", "s")]


def _conv_transpose_reference(x: np.ndarray, w: np.ndarray, attrs: dict) -> np.ndarray:
    """Scatter every input pixel times the kernel (the definition of ONNX ConvTranspose)."""
    n, cin, h, wd = x.shape
    group = attrs.get("group", 1)
    cout_g, kh, kw = w.shape[1:]
    sh, sw = attrs.get("strides", (1, 1))
    dh, dw = attrs.get("dilations", (1, 1))
    top, left, bottom, right = attrs.get("pads", (0, 0, 0, 0))
    eh, ew = attrs.get("output_padding", (0, 0))
    full_h = (h - 1) * sh + dh * (kh - 1) + 1 + eh
    full_w = (wd - 1) * sw + dw * (kw - 1) + 1 + ew
    out = np.zeros((n, cout_g * group, full_h, full_w))
    cin_g = cin // group
    for g, ci, i, j in itertools.product(range(group), range(cin_g), range(h), range(wd)):
        c = g * cin_g + ci
        for a, b in itertools.product(range(kh), range(kw)):
            out[:, g * cout_g : (g + 1) * cout_g, i * sh + a * dh, j * sw + b * dw] += (
                x[:, c, i, j][:, None] * w[c, :, a, b][None, :]
            )
    return out[:, :, top : full_h - bottom, left : full_w - right]


def _conv_reference(x: np.ndarray, w: np.ndarray, pads, dilations, group: int) -> np.ndarray:
    top, left, bottom, right = pads
    x = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)))
    n, _cin, h, wd = x.shape
    cout, cin_g, kh, kw = w.shape
    dh, dw = dilations
    oh, ow = h - dh * (kh - 1), wd - dw * (kw - 1)
    out = np.zeros((n, cout, oh, ow))
    cout_g = cout // group
    for o in range(cout):
        g = o // cout_g
        for a, b in itertools.product(range(kh), range(kw)):
            patch = x[:, g * cin_g : (g + 1) * cin_g, a * dh : a * dh + oh, b * dw : b * dw + ow]
            out[:, o] += np.einsum("nchw,c->nhw", patch, w[o, :, a, b])
    return out


@pytest.mark.parametrize(
    "attrs",
    [
        {"strides": (2, 2)},
        {"strides": (2, 2), "pads": (1, 1, 1, 1), "output_padding": (1, 1)},
        {"strides": (2, 1), "pads": (2, 0, 1, 1)},
        {"strides": (2, 2), "pads": (3, 2, 2, 2)},  # pads beyond the kernel's reach: cropped
        {"strides": (3, 2), "dilations": (2, 1), "pads": (0, 1, 2, 0)},
        {"strides": (2, 2), "group": 2, "pads": (1, 0, 0, 1)},
    ],
)
def test_conv_transpose_as_zero_insertion_and_conv(attrs: dict) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 4, 3, 4))
    w = rng.normal(size=(4, 3, 3, 2))
    expected = _conv_transpose_reference(x, w, attrs)
    form = ConvTransposeAsConv.from_attributes(attrs, w.shape)
    if attrs.get("pads") == (3, 2, 2, 2):
        assert form.crop_begin == (1, 1) and form.crop_end == (1, 2)
    z = zero_insert(x, form.strides)
    (cb_h, cb_w), (ce_h, ce_w) = form.crop_begin, form.crop_end
    z = z[:, :, cb_h : z.shape[2] - ce_h, cb_w : z.shape[3] - ce_w]
    got = _conv_reference(z, conv_weight(w, form.group), form.pads, form.dilations, form.group)
    np.testing.assert_allclose(got, expected, atol=1e-12)


def test_conv_weight_keeps_integer_codes() -> None:
    codes = np.arange(-8, 8, dtype=np.int8).reshape(2, 2, 2, 2)
    moved = conv_weight(codes, 1)
    assert moved.dtype == np.int8 and sorted(moved.ravel()) == sorted(codes.ravel())
    assert moved[1, 0, 0, 0] == codes[0, 1, 1, 1]
