from __future__ import annotations

from typing import Any

import pytest

from quant_core.algorithm_config import (
    ALGORITHM_CONFIGS,
    AdaQuantConfig,
    AdaRoundConfig,
    BiasCorrectionConfig,
    CLEConfig,
    MixedPrecisionConfig,
    PrecisionTarget,
    SmoothQuantConfig,
)
from quant_core.config import CalibrationConfig, OperatorConfig, QuantConfig
from quant_core.errors import ConfigError
from quant_core.observer_config import MSE, FixedRange, MovingAverageMinMax, Percentile, PowerOfTwoMSE
from quant_core.spec import QuantSpec

ACT = QuantSpec(dtype="uint8", symmetric=False)
W = QuantSpec(dtype="int8", per_channel_axis=0)
GLOBAL = OperatorConfig(input=ACT, weight=W, output=ACT)
CONV = OperatorConfig(input=ACT, weight=W.evolve(dtype="int4"), output=ACT)
HEAD = OperatorConfig(input=ACT.evolve(dtype="uint16"), weight=W, output=ACT)
HEAD_FC = OperatorConfig(input=ACT, weight=W.evolve(per_channel_axis=None), output=ACT)


def _config(**kwargs: Any) -> QuantConfig:
    return QuantConfig(global_config=GLOBAL, **kwargs)


def test_global_applies_without_overrides() -> None:
    assert _config().for_node("conv1", "Conv") is GLOBAL


def test_op_type_override_beats_global() -> None:
    cfg = _config(op_type_overrides={"Conv": CONV})
    assert cfg.for_node("conv1", "Conv") is CONV
    assert cfg.for_node("fc", "Gemm") is GLOBAL


def test_name_override_beats_op_type() -> None:
    cfg = _config(op_type_overrides={"Conv": CONV}, name_overrides={"head/*": HEAD})
    assert cfg.for_node("head/conv", "Conv") is HEAD
    assert cfg.for_node("body/conv", "Conv") is CONV


def test_first_matching_name_override_wins() -> None:
    cfg = _config(name_overrides={"head/fc*": HEAD_FC, "head/*": HEAD})
    assert cfg.for_node("head/fc1", "Gemm") is HEAD_FC
    assert cfg.for_node("head/conv", "Conv") is HEAD
    reordered = _config(name_overrides={"head/*": HEAD, "head/fc*": HEAD_FC})
    assert reordered.for_node("head/fc1", "Gemm") is HEAD


def test_globs_are_case_sensitive_and_whole_name() -> None:
    cfg = _config(name_overrides={"head/?c": HEAD})
    assert cfg.for_node("head/fc", "Gemm") is HEAD
    assert cfg.for_node("head/FC", "Gemm") is GLOBAL
    assert cfg.for_node("x/head/fc", "Gemm") is GLOBAL


def test_exclusion_beats_everything() -> None:
    cfg = _config(
        op_type_overrides={"Softmax": HEAD}, name_overrides={"head/*": HEAD}, exclude=("Softmax", "head/skip*")
    )
    assert cfg.for_node("sm", "Softmax") is None
    assert cfg.for_node("head/skip1", "Conv") is None
    assert cfg.for_node("head/keep", "Conv") is HEAD
    assert cfg.is_excluded("head/skip2", "Add")


def test_exclude_accepts_a_single_string() -> None:
    assert _config(exclude="Softmax").exclude == ("Softmax",)


def test_algorithm_lookup_by_kind() -> None:
    cle = CLEConfig(steps=2)
    cfg = _config(algorithms=[cle, BiasCorrectionConfig()])
    assert cfg.algorithm("cle") is cle
    assert cfg.algorithm("adaround") is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"algorithms": [CLEConfig(), CLEConfig(steps=2)]}, "^algorithms: cle listed twice"),
        ({"algorithms": ["cle"]}, "^algorithms: str is not allowed; allowed: cle, bias_correction"),
        ({"exclude": ["Softmax", 3]}, "^exclude: 3"),
        ({"op_type_overrides": {"Conv": ACT}}, r"^op_type_overrides\['Conv'\]: allowed"),
        ({"name_overrides": []}, "^name_overrides: list is not allowed"),
        ({"global_config": ACT}, "^global_config: QuantSpec is not allowed; allowed: an OperatorConfig"),
        ({"calibration": {"batch_size": 4}}, "^calibration: dict is not allowed; allowed: a CalibrationConfig"),
        ({"name": 3}, "^name: 3 is not allowed; allowed: a string or null"),
    ],
)
def test_invalid_quant_config(kwargs: dict[str, Any], match: str) -> None:
    args = {"global_config": GLOBAL, **kwargs}
    with pytest.raises(ValueError, match=match):
        QuantConfig(**args)


def test_operator_config_rejects_non_specs() -> None:
    with pytest.raises(ValueError, match=r"^weight: str is not allowed; allowed: a QuantSpec or null"):
        OperatorConfig(weight="int8")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("factory", "field"),
    [
        (lambda: CalibrationConfig(num_samples=0), "num_samples"),
        (lambda: CalibrationConfig(batch_size=True), "batch_size"),
        (lambda: CLEConfig(steps=-1), "steps"),
        (lambda: CLEConfig(tolerance=0), "tolerance"),
        (lambda: CLEConfig(absorb_high_bias=1), "absorb_high_bias"),
        (lambda: BiasCorrectionConfig(num_samples=0), "num_samples"),
        (lambda: SmoothQuantConfig(alpha=1.5), "alpha"),
        (lambda: AdaRoundConfig(device="tpu"), "device"),
        (lambda: AdaRoundConfig(warm_start=2.0), "warm_start"),
        (lambda: AdaRoundConfig(num_iterations=0), "num_iterations"),
        (lambda: AdaRoundConfig(beta_start=2.0, beta_end=20.0), "beta_end"),
        (lambda: AdaQuantConfig(batch_size=2.5), "batch_size"),
        (lambda: MixedPrecisionConfig(target_types=["a4w4"], max_layers=1), "target_types"),
        (lambda: MixedPrecisionConfig(metric="loss", max_layers=1), "metric"),
        (lambda: MixedPrecisionConfig(size_budget=0.5), "size_budget"),
        (lambda: MixedPrecisionConfig(target_types=[], max_layers=1), "target_types"),
        (lambda: MixedPrecisionConfig(), "accuracy_target"),
    ],
)
def test_invalid_algorithm_settings_name_the_field(factory: Any, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}"):
        factory()


def test_algorithm_registry_is_complete() -> None:
    assert set(ALGORITHM_CONFIGS) == {
        "cle",
        "bias_correction",
        "smoothquant",
        "activation_equalization",
        "adaround",
        "adaquant",
        "gptq",
        "mixed_precision",
    }


def test_mixed_precision_target_types_accept_a_single_name() -> None:
    cfg = MixedPrecisionConfig(target_types="a16w16", size_budget=1.2)
    assert cfg.target_types == (PrecisionTarget.A16W16,)


def test_evolve_keeps_validation() -> None:
    cfg = _config()
    assert cfg.evolve(name="x").name == "x"
    with pytest.raises(ValueError, match="algorithms"):
        cfg.evolve(algorithms=[CLEConfig(), CLEConfig()])


def test_raising_a_layer_replaces_its_own_name_override() -> None:
    # A literal override of the layer (the user's, or an earlier raise) must not win over
    # the raised one: {**new, **old} kept the old value under the same key.
    from quant_core.algorithm_config import PrecisionTarget
    from quant_core.precision import raised_config
    from quant_core.presets import get_preset

    base = get_preset("a8w8")
    g = base.global_config
    own = base.evolve(name_overrides={"conv1": OperatorConfig(input=g.input, weight=g.weight, output=g.output)})
    raised = raised_config(own, {"conv1": PrecisionTarget.A16W8}, {"conv1": "Conv"})
    assert raised.for_node("conv1", "Conv").input.dtype.value == "uint16"
    twice = raised_config(raised, {"conv1": PrecisionTarget.A16W16}, {"conv1": "Conv"})
    layer = twice.for_node("conv1", "Conv")
    assert (layer.input.dtype.value, layer.weight.dtype.value) == ("uint16", "int16")
    assert list(twice.name_overrides) == ["conv1"]


@pytest.mark.parametrize(
    "build",
    [
        lambda: MovingAverageMinMax(momentum="0.5"),
        lambda: MovingAverageMinMax(momentum=float("nan")),
        lambda: Percentile(percentile=True),
        lambda: Percentile(percentile=40.0),  # asymmetric ends would cross
        lambda: PowerOfTwoMSE(search_below=True),
        lambda: MSE(num_candidates=True),
        lambda: FixedRange(0.0, 1e300),
        lambda: FixedRange(float("-inf"), 1.0),
        lambda: FixedRange("0", 1.0),
        lambda: CLEConfig(tolerance=float("inf")),
        lambda: MixedPrecisionConfig(accuracy_target=float("nan")),
        lambda: MixedPrecisionConfig(size_budget=float("inf")),
        lambda: QuantConfig(GLOBAL, exclude=None),
        lambda: QuantConfig(GLOBAL, exclude=5),
        lambda: QuantConfig(GLOBAL, algorithms=CLEConfig()),
        lambda: QuantConfig(GLOBAL, npu_conversions=None),
    ],
)
def test_values_a_config_file_cannot_hold_are_refused_at_construction(build) -> None:
    # Each was accepted, then failed when saved or loaded back, or raised a bare TypeError.
    with pytest.raises(ConfigError):
        build()


def test_numbers_a_config_file_holds_still_pass() -> None:
    assert Percentile(percentile=99).percentile == 99
    assert FixedRange(-1, 2).max_val == 2.0 and isinstance(FixedRange(-1, 2).max_val, float)
    assert QuantConfig(GLOBAL, exclude="Softmax").exclude == ("Softmax",)
    assert MixedPrecisionConfig(accuracy_target=30, size_budget=1.5).size_budget == 1.5


_BEYOND_FLOAT = 10**400  # a Python int no float holds: math.isfinite and float() overflow


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: MovingAverageMinMax(momentum=_BEYOND_FLOAT), "momentum"),
        (lambda: Percentile(percentile=_BEYOND_FLOAT), "percentile"),
        (lambda: FixedRange(-_BEYOND_FLOAT, 1.0), "min_val"),
        (lambda: FixedRange(0.0, _BEYOND_FLOAT), "max_val"),
        (lambda: CLEConfig(tolerance=_BEYOND_FLOAT), "tolerance"),
        (lambda: SmoothQuantConfig(alpha=_BEYOND_FLOAT), "alpha"),
        (lambda: MixedPrecisionConfig(accuracy_target=_BEYOND_FLOAT), "accuracy_target"),
        (lambda: MixedPrecisionConfig(target_types=None, max_layers=1), "target_types"),
        (lambda: MixedPrecisionConfig(target_types=5, max_layers=1), "target_types"),
    ],
)
def test_values_that_raised_a_bare_error_are_config_errors_naming_the_field(build: Any, field: str) -> None:
    # Each raised OverflowError or TypeError ("'int' object is not iterable") before.
    with pytest.raises(ConfigError, match=rf"^{field}: .*allowed: "):
        build()


def test_mixed_precision_target_types_take_any_iterable_or_one_target() -> None:
    assert MixedPrecisionConfig(target_types=PrecisionTarget.A8W16, max_layers=1).target_types == (
        PrecisionTarget.A8W16,
    )
    assert MixedPrecisionConfig(target_types=iter(["a16w16"]), max_layers=1).target_types == (PrecisionTarget.A16W16,)


def test_configs_whose_name_overrides_match_in_another_order_are_not_equal() -> None:
    # The first matching glob decides, so the order is part of the config; dict equality
    # ignored it, and a round trip that reordered them would still have compared equal.
    first = _config(name_overrides={"head/*": HEAD, "head/fc": HEAD_FC})
    second = _config(name_overrides={"head/fc": HEAD_FC, "head/*": HEAD})
    assert first.for_node("head/fc", "Gemm") != second.for_node("head/fc", "Gemm")
    assert first != second
    # Op types have no order: the same entries in another order are the same config.
    same = _config(op_type_overrides={"Conv": CONV, "Gemm": HEAD}) == _config(
        op_type_overrides={"Gemm": HEAD, "Conv": CONV}
    )
    assert same
    assert hash(first) == hash(_config(name_overrides={"head/*": HEAD, "head/fc": HEAD_FC}))
