from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from quant_core_strategies import specs

from quant_core.dtypes import DType
from quant_core.errors import ConfigError
from quant_core.observer_config import (
    MSE,
    Entropy,
    MinMax,
    MovingAverageMinMax,
    Percentile,
    PowerOfTwoMSE,
    observer_config,
)
from quant_core.serialization import from_data, to_data
from quant_core.spec import Granularity, QuantSpec, RoundMode, ScaleType, parse_enum

# (keyword arguments, field the error must name)
INVALID: list[tuple[dict[str, Any], str]] = [
    ({"dtype": "int7"}, "dtype"),
    ({"dtype": "int8", "scale_type": "log2"}, "scale_type"),
    ({"dtype": "int8", "rounding": "nearest"}, "rounding"),
    ({"dtype": "int8", "symmetric": 1}, "symmetric"),
    ({"dtype": "int8", "narrow_range": "yes"}, "narrow_range"),
    ({"dtype": "int8", "dynamic": None}, "dynamic"),
    ({"dtype": "int8", "per_channel_axis": -1}, "per_channel_axis"),
    ({"dtype": "int8", "per_channel_axis": True}, "per_channel_axis"),
    ({"dtype": "int8", "per_channel_axis": "0"}, "per_channel_axis"),
    ({"dtype": "fp16", "per_channel_axis": 0}, "dtype"),
    ({"dtype": "bf16", "scale_type": "power_of_two"}, "dtype"),
    ({"dtype": "fp32", "dynamic": True}, "dtype"),
    ({"dtype": "uint8", "symmetric": False, "narrow_range": True}, "narrow_range"),
    ({"dtype": "int8", "per_channel_axis": 0, "observer": Percentile()}, "observer.method"),
    ({"dtype": "int8", "per_channel_axis": 1, "observer": Entropy()}, "observer.method"),
    ({"dtype": "int8", "per_channel_axis": 0, "observer": MSE()}, "observer.method"),
    ({"dtype": "int8", "observer": PowerOfTwoMSE()}, "observer.method"),
    ({"dtype": "int8", "dynamic": True, "per_channel_axis": 0}, "dynamic"),
    ({"dtype": "int8", "dynamic": True, "observer": MovingAverageMinMax()}, "observer.method"),
    # Not an observer config at all: a method name, null, a JSON-style object, the class itself.
    ({"dtype": "int8", "observer": "minmax"}, "observer"),
    ({"dtype": "int8", "observer": None}, "observer"),
    ({"dtype": "int8", "observer": {"method": "minmax"}}, "observer"),
    ({"dtype": "int8", "observer": MinMax}, "observer"),
    ({"dtype": "fp16", "observer": "minmax"}, "observer"),
]


@pytest.mark.parametrize(("kwargs", "field"), INVALID)
def test_invalid_combination_names_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError) as info:
        QuantSpec(**kwargs)
    message = str(info.value)
    assert message.startswith(f"{field}:"), message
    assert "allowed" in message or "must" in message or "needs" in message, message


@pytest.mark.parametrize(
    ("factory", "field"),
    [
        (lambda: Percentile(percentile=0), "percentile"),
        (lambda: Percentile(bins=15), "bins"),
        (lambda: Percentile(bins=True), "bins"),
        (lambda: MovingAverageMinMax(momentum=1.0), "momentum"),
        (lambda: Entropy(bins=64, num_quantized_bins=128), "num_quantized_bins"),
        (lambda: MSE(num_candidates=1), "num_candidates"),
        (lambda: PowerOfTwoMSE(search_above=17), "search_above"),
        (lambda: PowerOfTwoMSE(search_below=-1), "search_below"),
        (lambda: observer_config("kl"), "observer.method"),
        (lambda: observer_config(["percentile"]), "observer.method"),  # was a bare TypeError
        (lambda: observer_config("percentile", foo=1), "observer.foo"),  # was a bare TypeError
        (lambda: observer_config("minmax", bins=8), "observer.bins"),
    ],
)
def test_invalid_observer_config_names_the_field(factory: Any, field: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{field}: .*allowed"):
        factory()


@pytest.mark.parametrize("bad", ["minmax", "kl", None, {"method": "minmax"}, 3, MinMax])
def test_observer_of_the_wrong_type_lists_the_configs(bad: Any) -> None:
    # Every observer config class is named, so the message says what to write instead.
    with pytest.raises(ValueError, match=r"^observer: .* is not allowed; allowed: ") as info:
        QuantSpec(dtype="int8", observer=bad)
    for cls in (MinMax, MovingAverageMinMax, Percentile, Entropy, MSE, PowerOfTwoMSE):
        assert f"{cls.__name__}()" in str(info.value)
    with pytest.raises(ValueError, match=r"^observer: "):
        QuantSpec(dtype="int8").evolve(observer=bad)


def test_observer_error_points_at_the_builders() -> None:
    with pytest.raises(ValueError, match=r"observer_config\('minmax'\) builds one"):
        QuantSpec(dtype="int8", observer="minmax")
    with pytest.raises(ValueError, match=r"from_data builds one from its JSON object"):
        QuantSpec(dtype="int8", observer={"method": "percentile"})


def test_observer_from_json_is_a_tagged_object() -> None:
    # The JSON form names the method in an object; from_data builds the config class, which
    # the validator accepts. A bare string is refused there too, with the JSON path.
    spec = from_data(QuantSpec, {"dtype": "int8", "observer": {"method": "percentile", "bins": 64}})
    assert spec.observer == Percentile(bins=64)
    assert from_data(QuantSpec, to_data(spec)) == spec
    with pytest.raises(ValueError, match=r"^\$\.observer: "):
        from_data(QuantSpec, {"dtype": "int8", "observer": "minmax"})


def test_defaults() -> None:
    spec = QuantSpec(dtype="int8")
    assert spec.symmetric and spec.granularity is Granularity.PER_TENSOR
    assert spec.scale_type is ScaleType.FLOAT and spec.rounding is RoundMode.HALF_EVEN
    assert spec.observer == MinMax() and spec.qrange == (-128, 127) and spec.is_quantized


def test_strings_convert_to_enums() -> None:
    spec = QuantSpec(dtype="uint16", scale_type="power_of_two", rounding="half_up", observer=PowerOfTwoMSE())
    assert spec.dtype is DType.UINT16 and spec.scale_type is ScaleType.POWER_OF_TWO
    assert spec.rounding is RoundMode.HALF_UP


def test_float_spec_is_not_quantized() -> None:
    assert not QuantSpec(dtype="bf16").is_quantized


def test_narrow_range_qrange() -> None:
    assert QuantSpec(dtype="int8", narrow_range=True).qrange == (-127, 127)


def test_evolve_validates_again() -> None:
    spec = QuantSpec(dtype="uint8", symmetric=False)
    assert spec.evolve(dtype="uint16").dtype is DType.UINT16
    with pytest.raises(ValueError, match=r"^narrow_range:"):
        spec.evolve(narrow_range=True)


def test_frozen() -> None:
    spec = QuantSpec(dtype="int8")
    with pytest.raises(AttributeError):
        spec.dtype = DType.INT16  # type: ignore[misc]


def test_parse_enum_lists_allowed_values() -> None:
    assert parse_enum(ScaleType, "float", "x") is ScaleType.FLOAT
    with pytest.raises(ValueError, match=r"^x.y: 'pow2' is not allowed; allowed: float, power_of_two$"):
        parse_enum(ScaleType, "pow2", "x.y")


@given(specs())
def test_generated_specs_are_equal_to_their_copies(spec: QuantSpec) -> None:
    # Equality and hashing are by value (the serialiser's round trip relies on it).
    copy = spec.evolve()
    assert copy == spec and hash(copy) == hash(spec)
