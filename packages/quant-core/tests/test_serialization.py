from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from quant_core_strategies import quant_configs, specs

from quant_core.algorithm_config import AdaRoundConfig, CLEConfig, MixedPrecisionConfig
from quant_core.config import QuantConfig
from quant_core.errors import ConfigError
from quant_core.observer_config import MinMax, Percentile
from quant_core.presets import get_preset, list_presets
from quant_core.serialization import (
    config_from_json,
    config_to_json,
    from_data,
    load_config,
    save_config,
    tag_name,
    to_data,
)
from quant_core.spec import QuantSpec

# --------------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", list_presets())
def test_preset_json_round_trip_is_identity(name: str) -> None:
    cfg = get_preset(name)
    text = config_to_json(cfg)
    back = config_from_json(text)
    assert back == cfg
    assert config_to_json(back) == text  # deterministic text, too


@settings(max_examples=60, deadline=None)
@given(quant_configs)
def test_random_config_json_round_trip_is_identity(cfg: QuantConfig) -> None:
    text = config_to_json(cfg)
    back = config_from_json(text)
    assert back == cfg
    # Dict equality ignores order, but name overrides are matched first to last.
    assert list(back.name_overrides) == list(cfg.name_overrides)
    assert [type(a) for a in back.algorithms] == [type(a) for a in cfg.algorithms]
    assert config_to_json(back) == text


@given(specs())
def test_spec_data_round_trip_is_identity(spec: QuantSpec) -> None:
    data = to_data(spec)
    assert json.loads(json.dumps(data)) == data  # JSON-ready
    assert from_data(QuantSpec, data) == spec


def test_to_data_forms() -> None:
    data = to_data(QuantSpec(dtype="int8", observer=Percentile(99.0)))
    assert data["dtype"] == "int8" and data["scale_type"] == "float" and data["rounding"] == "half_even"
    assert data["observer"] == {"method": "percentile", "percentile": 99.0, "bins": 2048}
    mp = to_data(MixedPrecisionConfig(target_types=["a16w8", "a16w16"], max_layers=3))
    assert mp["kind"] == "mixed_precision" and mp["target_types"] == ["a16w8", "a16w16"]


def test_to_data_rejects_what_json_cannot_hold() -> None:
    with pytest.raises(ValueError, match="finite"):
        to_data(float("nan"))
    with pytest.raises(TypeError, match="not serialisable"):
        to_data(object())
    with pytest.raises(TypeError, match="key"):
        to_data({1: "a"})


def test_tag_names() -> None:
    assert tag_name(MinMax) == "method"
    assert tag_name(CLEConfig) == "kind"
    assert tag_name(QuantSpec) is None


def test_short_hand_written_config_takes_defaults() -> None:
    text = json.dumps(
        {
            "schema_version": 2,
            "global_config": {"input": {"dtype": "uint8", "symmetric": False}, "weight": {"dtype": "int8"}},
            "exclude": ["Softmax"],
            "algorithms": [{"kind": "cle"}, {"kind": "adaround", "num_iterations": 10}],
        }
    )
    cfg = config_from_json(text)
    assert cfg.global_config.input == QuantSpec(dtype="uint8", symmetric=False)
    assert cfg.algorithms == (CLEConfig(), AdaRoundConfig(num_iterations=10))
    assert cfg.exclude == ("Softmax",)


def test_ints_are_accepted_for_float_fields() -> None:
    cfg = from_data(AdaRoundConfig, {"learning_rate": 1})
    assert cfg.learning_rate == 1.0 and isinstance(cfg.learning_rate, float)


# ------------------------------------------------------------------------- errors


def _base() -> dict[str, Any]:
    data = json.loads(config_to_json(get_preset("int8_cnn_accurate")))
    assert isinstance(data, dict)
    return data


def _error(data: dict[str, Any]) -> str:
    with pytest.raises(ValueError) as info:
        config_from_json(json.dumps(data))
    return str(info.value)


def _set(data: dict[str, Any], path: list[Any], value: Any) -> dict[str, Any]:
    data = copy.deepcopy(data)
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return data


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        # unknown keys
        (
            ["global_config", "weight", "scale"],
            1,
            "$.global_config.weight: unknown key 'scale'; allowed: dtype, symmetric",
        ),
        (["extra"], 1, "$: unknown key 'extra'; allowed: global_config, op_type_overrides"),
        (["algorithms", 0, "lr"], 1, "$.algorithms[0]: unknown key 'lr'; allowed: kind, device, batch_size"),
        (["global_config", "input", "observer", "bin"], 1, "$.global_config.input.observer: unknown key 'bin'"),
        # wrong types
        (["global_config", "weight", "dtype"], 8, "$.global_config.weight.dtype: 8 is not allowed; allowed: int4"),
        (["global_config", "weight", "symmetric"], "true", "$.global_config.weight.symmetric: expected a boolean"),
        (
            ["global_config", "weight", "per_channel_axis"],
            0.5,
            "$.global_config.weight.per_channel_axis: expected an integer or a string or null, got float 0.5",
        ),
        (
            ["global_config", "weight"],
            [],
            "$.global_config.weight: expected an object (QuantSpec) or null, got list []",
        ),
        (["calibration", "batch_size"], True, "$.calibration.batch_size: expected an integer, got bool True"),
        (["algorithms", 0, "learning_rate"], "fast", "$.algorithms[0].learning_rate: expected a number, got str"),
        (["exclude"], "Softmax", "$.exclude: expected a list, got str 'Softmax'"),
        (["exclude"], ["Softmax", 1], "$.exclude[1]: expected a string, got int 1"),
        (["name_overrides"], [], "$.name_overrides: expected an object, got list"),
        (["name"], 5, "$.name: expected a string or null, got int 5"),
        # bad enum values
        (
            ["global_config", "weight", "dtype"],
            "int7",
            "$.global_config.weight.dtype: 'int7' is not allowed; allowed: int4",
        ),
        (
            ["global_config", "input", "rounding"],
            "up",
            "$.global_config.input.rounding: 'up' is not allowed; allowed: half_even",
        ),
        (["global_config", "input", "scale_type"], "pow2", "$.global_config.input.scale_type: 'pow2' is not allowed"),
        # tagged unions
        (
            ["global_config", "input", "observer"],
            {"method": "kl"},
            "$.global_config.input.observer.method: 'kl' is not allowed; allowed: minmax, moving_average",
        ),
        (
            ["global_config", "input", "observer"],
            {"bins": 64},
            "$.global_config.input.observer: missing key 'method'; allowed methods: minmax",
        ),
        (
            ["global_config", "input", "observer"],
            "minmax",
            "$.global_config.input.observer: expected an object with a 'method' key",
        ),
        (["algorithms", 0, "kind"], "ada", "$.algorithms[0].kind: 'ada' is not allowed; allowed: cle, bias_correction"),
        # the classes' own validation, prefixed with the path
        (
            ["algorithms", 0, "learning_rate"],
            -1,
            "$.algorithms[0].learning_rate: -1.0 is out of range; allowed: a finite number > 0",
        ),
        (
            ["global_config", "input", "observer", "percentile"],
            101,
            "$.global_config.input.observer.percentile: 101.0 is out of range",
        ),
        (
            ["global_config", "input", "narrow_range"],
            True,
            "$.global_config.input.narrow_range: true needs symmetric: true",
        ),
        (
            ["global_config", "weight", "observer"],
            {"method": "percentile"},
            "$.global_config.weight.observer.method: 'percentile' keeps a per-tensor histogram",
        ),
        (["calibration", "num_samples"], 0, "$.calibration.num_samples: 0 is out of range"),
        # missing required
        (["global_config", "weight"], {"symmetric": True}, "$.global_config.weight: missing required key 'dtype'"),
    ],
)
def test_errors_name_the_path(path: list[Any], value: Any, expected: str) -> None:
    message = _error(_set(_base(), path, value))
    assert message.startswith(expected), message


def test_error_path_inside_overrides_and_lists() -> None:
    data = _base()
    data["name_overrides"] = {"head/*": {"input": {"dtype": "uint9"}}}
    assert _error(data).startswith("$.name_overrides['head/*'].input.dtype: 'uint9' is not allowed")
    data = _base()
    data["algorithms"].append({"kind": "cle", "steps": -2})
    assert _error(data).startswith("$.algorithms[1].steps: -2 is out of range")
    data = _base()
    data["algorithms"].append({"kind": "adaround"})
    assert _error(data).startswith("$.algorithms: adaround listed twice")


def test_missing_global_config() -> None:
    assert _error({"schema_version": 2}).startswith("$: missing required key 'global_config'")


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        (None, "$: missing key 'schema_version'; add \"schema_version\": 2"),
        (3, "$.schema_version: 3 is not supported; allowed: 1, 2"),
        ("1", "$.schema_version: '1' is not supported; allowed: 1, 2"),
        (True, "$.schema_version: True is not supported"),
        (1.5, "$.schema_version: 1.5 is not supported"),
    ],
)
def test_schema_version_checked(version: Any, expected: str) -> None:
    data = _base()
    if version is None:
        del data["schema_version"]
    else:
        data["schema_version"] = version
    assert _error(data).startswith(expected)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("{", "$: invalid JSON"),
        ("[]", "$: expected an object, got list"),
        (
            '{"schema_version": 1, "global_config": {"input": {"dtype": "int8", "observer": {"method": "moving_average", "momentum": NaN}}}}',
            "NaN is not allowed",
        ),
    ],
)
def test_bad_json_text(text: str, expected: str) -> None:
    with pytest.raises(ValueError) as info:
        config_from_json(text)
    assert expected in str(info.value)


def test_explicit_tag_must_match_the_class() -> None:
    with pytest.raises(ValueError, match=r"^\$.kind: 'adaround' is not allowed here; allowed: 'cle'"):
        from_data(CLEConfig, {"kind": "adaround"})


# ---------------------------------------------------------------------- files


def test_save_and_load(tmp_path: Path) -> None:
    path = tmp_path / "cfg.json"
    save_config(get_preset("xint8"), path)
    save_config(get_preset("a8w8"), path)  # overwrite
    assert load_config(path) == get_preset("a8w8")
    assert load_config(str(path)) == get_preset("a8w8")
    assert os.listdir(tmp_path) == ["cfg.json"]
    assert path.read_text(encoding="utf-8") == config_to_json(get_preset("a8w8"))


def test_failed_save_keeps_the_old_file_and_no_temp_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "cfg.json"
    save_config(get_preset("xint8"), path)

    def boom(*_: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        save_config(get_preset("a8w8"), path)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["cfg.json"]
    assert load_config(path) == get_preset("xint8")


def test_load_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"schema_version": 1, "global_config": {"output": {"dtype": "int8", "x": 1}}}', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.json: \$\.global_config\.output: unknown key 'x'"):
        load_config(path)


def test_a_missing_config_file_is_a_config_error(tmp_path: Path) -> None:
    from quant_core.presets import resolve_config

    missing = tmp_path / "nosuch.json"
    for load in (load_config, resolve_config):
        with pytest.raises(ConfigError, match=f"^config: file '{re.escape(str(missing))}' not found$"):
            load(missing)
    with pytest.raises(ConfigError, match=r"^config: file 'nosuch\.json' not found$"):
        resolve_config("nosuch.json")


def test_version_1_weight_axes_mean_output_channels() -> None:
    """Version 1 files said "per channel" with an integer axis that backends replaced by each
    op's output-channel axis; they keep that meaning, while version 2 takes axes as written."""
    weight = {"dtype": "int8", "per_channel_axis": 0}
    old = {
        "schema_version": 1,
        "global_config": {"weight": weight, "input": {"dtype": "uint8", "per_channel_axis": None}},
        "op_type_overrides": {"MatMul": {"weight": {"dtype": "int8", "per_channel_axis": 1}}},
        "name_overrides": {"fc*": {"weight": {"dtype": "int8"}}},
    }
    config = config_from_json(json.dumps(old))
    assert config.global_config.weight.per_channel_axis == "output"  # type: ignore[union-attr]
    assert config.op_type_overrides["MatMul"].weight.per_channel_axis == "output"  # type: ignore[union-attr]
    assert config.name_overrides["fc*"].weight.per_channel_axis is None  # type: ignore[union-attr]
    assert config.global_config.input.per_channel_axis is None  # type: ignore[union-attr]
    new = config_from_json(json.dumps({**old, "schema_version": 2}))
    assert new.global_config.weight.per_channel_axis == 0  # type: ignore[union-attr]
    assert new.op_type_overrides["MatMul"].weight.per_channel_axis == 1  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "text",
    [
        '{"schema_version": 2, "global_config": {"input": {"dtype": "int8", "dtype": "uint16"}}}',
        '{"schema_version": 2.0, "global_config": {}}',
        '{"schema_version": 1, "global_config": {"weight": {"dtype": "int8", "per_channel_axis": true}}}',
    ],
)
def test_a_config_file_with_a_repeated_key_a_float_version_or_a_boolean_axis_is_refused(text: str) -> None:
    with pytest.raises(ConfigError):
        config_from_json(text)


def test_a_report_with_non_finite_numbers_is_strict_json() -> None:
    import numpy as np

    from quant_core.serialization import report_json

    text = report_json({"score": float("inf"), "gain": np.float64("nan"), "rows": [(1, -np.inf)], "n": np.int64(3)})
    assert json.loads(text, parse_constant=lambda c: pytest.fail(c)) == {
        "score": "inf",
        "gain": "nan",
        "rows": [[1, "-inf"]],
        "n": 3,
    }


_MOMENTUM = '{{"schema_version": 2, "global_config": {{"input": {{"dtype": "int8", "observer": {{"method": "moving_average", "momentum": {}}}}}}}}}'


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # An integer beyond float's range in a float field: math.isfinite/float() overflow.
        (_MOMENTUM.format("1" + "0" * 400), r"^\$\.global_config\.input\.observer\.momentum: 10+ is not allowed; "),
        # More digits than Python converts: json.loads raises a plain ValueError.
        (_MOMENTUM.format("1" * 5000), r"^\$: invalid JSON: Exceeds the limit"),
        # Nesting deeper than the parser recurses: a RecursionError.
        ("[" * 100_000 + "]" * 100_000, r"^\$: invalid JSON: maximum recursion depth"),
        ('{"a": ' * 100_000 + "1" + "}" * 100_000, r"^\$: invalid JSON: maximum recursion depth"),
    ],
)
def test_json_beyond_what_python_reads_is_a_config_error(text: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        config_from_json(text)


def test_a_config_path_that_cannot_be_read_is_a_config_error(tmp_path: Path) -> None:
    from quant_core.presets import resolve_config

    for load in (load_config, resolve_config):
        with pytest.raises(ConfigError, match=f"^config: file '{re.escape(str(tmp_path))}' cannot be read"):
            load(tmp_path)
