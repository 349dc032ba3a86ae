"""Profiles: the default follows NPU-TARGET's rules, JSON round trips, bad fields are named."""

from __future__ import annotations

import json

import pytest

from quant_core.spec import RoundMode
from quant_npu.profile import BiasFormat, NPUProfile, get_profile, list_profiles, load_profile


def test_default_profile_follows_the_target_rules() -> None:
    p = load_profile()
    assert p.name == "xint8"
    assert p.shift_cut_range == (0, 16)
    assert p.shift_bias_max == 15 and p.bias_accumulator_bits == 24 and p.leaky_relu_shift_bias_min == 0
    assert p.add_shift_read_max == 7 and p.add_shift_write_range == (-7, 25)
    assert p.mul_shift_range == (0, 32) and p.swish_shift_range == (0, 15)
    assert p.bias_format is BiasFormat.INT8_OWN_POSITION
    assert p.weight_qmin == -127
    assert p.activation_rounding is RoundMode.HALF_UP
    assert p.average_pool_factors["3x3"] == (7, 6) and p.average_pool_factors["14x14"] == (21, 12)
    assert (p.hard_sigmoid_multiplier, p.hard_sigmoid_shift) == (2731, 14)
    assert p.hard_sigmoid_input_range == (0, 15) and p.hard_sigmoid_output_min == 7
    assert p.leaky_relu_alpha_bits == 8
    assert "Sigmoid" not in p.ops and "Sigmoid" not in p.accepted_ops  # Quark converts it to HardSigmoid
    assert {"Conv", "ConvTranspose", "Gemm", "Add", "Concat", "HardSigmoid", "HardSwish", "Softmax", "Tanh"} <= p.ops
    assert {"DepthToSpace", "SpaceToDepth"} <= p.layout_ops and p.resize_modes == {"nearest", "linear"}
    assert p.conversions == (
        "silu", "sigmoid", "hard_sigmoid", "hard_swish", "conv_transpose", "reduce_mean", "global_pool", "split"
    )  # fmt: skip
    assert p.conv_transpose_kernel_range == (1, 16) and p.conv_transpose_pad_min == 1


def test_builtin_profiles_differ_where_sources_disagree() -> None:
    assert list_profiles() == ("xint8", "xint8_int32_bias", "dpu")
    assert get_profile("xint8_int32_bias").bias_format is BiasFormat.INT32_INPUT_PLUS_WEIGHT
    dpu = get_profile("dpu")
    assert (dpu.weight_qmin, dpu.shift_bias_max, dpu.add_shift_read_max) == (-128, 16, 15)
    assert dpu.weight_rounding is RoundMode.HALF_AWAY
    assert "PRelu" in dpu.ops and "PRelu" not in get_profile("xint8").ops  # Vitis AI 6.2: no INT8 PRelu


def test_json_round_trip_and_base(tmp_path) -> None:
    for name in list_profiles():
        profile = get_profile(name)
        assert NPUProfile.from_dict(json.loads(profile.to_json())) == profile
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"base": "dpu", "name": "mine", "shift_cut_range": [1, 12], "ops": ["Conv", "Relu"]}))
    mine = load_profile(path)
    assert (mine.name, mine.weight_qmin, mine.shift_cut_range) == ("mine", -128, (1, 12))
    assert mine.ops == frozenset({"Conv", "Relu"})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"shift_cut": [0, 1]}, "profile field 'shift_cut' is not known"),
        ({"bias_format": "int16"}, "bias_format: 'int16' is not allowed; allowed: int8_own_position"),
        ({"activation_rounding": "nearest"}, "activation_rounding: 'nearest' is not allowed"),
        ({"shift_cut_range": [5, 1]}, "shift_cut_range: [5, 1] is not allowed"),
        ({"weight_qmin": -100}, "weight_qmin: -100 is not allowed"),
        ({"shift_bias_max": "15"}, "shift_bias_max: '15' is not allowed; allowed: a int"),
        ({"average_pool_factors": {"3by3": [1, 2]}}, "average_pool_factors: key '3by3'"),
        ({"base": "npu9"}, "target: 'npu9' is not a known profile"),
        ({"conversions": ["swish"]}, "conversions: 'swish' is not allowed; allowed: silu, sigmoid"),
        ({"resize_modes": ["cubic"]}, "resize_modes: 'cubic' is not allowed; allowed: nearest, linear"),
    ],
)
def test_bad_fields_are_named(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        NPUProfile.from_dict(fields)


def test_load_profile_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"file '.*missing\.json' not found"):
        load_profile(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_profile(broken)
    with pytest.raises(ValueError, match=r"allowed: xint8, xint8_int32_bias, dpu or a \.json file"):
        load_profile("npu9")


def test_rounding_modes() -> None:
    p = load_profile("dpu")
    assert p.rounding_for("device") is RoundMode.HALF_UP
    assert p.rounding_for("onnx") is RoundMode.HALF_EVEN
    assert p.rounding_for("half_away") is RoundMode.HALF_AWAY
    with pytest.raises(ValueError, match="rounding: 'up' is not allowed; allowed: device, onnx"):
        p.rounding_for("up")
