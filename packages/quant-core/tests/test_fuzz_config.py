"""Fuzzing the config loader: mutated JSON configs (from every preset and from random valid
configs) either load or fail with a one-line ValueError; a config that loads writes back
to JSON that loads to the same config.

Mutations: truncated text, flipped or inserted characters, and structural edits at a
random path of the parsed JSON (a value replaced by one of another type or out of range,
a key deleted, an unknown key added, deep nesting, a list where an object was).
"""

from __future__ import annotations

import collections
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from quant_core_strategies import quant_configs

from quant_core.presets import get_preset, list_presets
from quant_core.serialization import config_from_json, config_to_json

EXAMPLES = 1500
PRESET_TEXTS = [config_to_json(get_preset(name)) for name in list_presets()]
ODD_VALUES = (
    None, True, False, 0, -1, 1, 2**31, -(2**63), 2**200, 0.5, -0.0, 1e308, -1e-320, "", "int8", "uint4", "output",
    "power_of_two", "minmax", "x" * 1000, "\u00e9\u0000", [], [1, 2], {}, {"type": "minmax"}, [[[[[]]]]],
)  # fmt: skip
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=6,
)


def _paths(data: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside parsed JSON (keys and list indices)."""
    found = [prefix]
    if isinstance(data, dict):
        for key, value in data.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            found += _paths(value, (*prefix, i))
    return found


def _container(data: Any, path: tuple[Any, ...]) -> Any:
    for step in path[:-1]:
        data = data[step]
    return data


@st.composite
def mutated_json(draw: st.DrawFn) -> tuple[str, str]:
    """(mutation label, JSON text)."""
    text = draw(st.sampled_from(PRESET_TEXTS)) if draw(st.booleans()) else config_to_json(draw(quant_configs))
    kind = draw(st.sampled_from(("truncate", "flip", "insert", "replace", "delete", "add_key", "nest", "listify")))
    if kind == "truncate":
        return kind, text[: draw(st.integers(0, len(text) - 1))]
    if kind == "flip":
        chars = list(text)
        for _ in range(draw(st.integers(1, 4))):
            chars[draw(st.integers(0, len(chars) - 1))] = draw(st.sampled_from(list('{}[]":,0-9aeE. \\\u00ff')))
        return kind, "".join(chars)
    if kind == "insert":
        at = draw(st.integers(0, len(text)))
        inserted = draw(st.sampled_from(("NaN", "Infinity", "-", "1e999", "\\u0000", '"', "]")))
        return kind, text[:at] + inserted + text[at:]
    data = json.loads(text)
    path = draw(st.sampled_from(_paths(data)[1:]))
    parent = _container(data, path)
    if kind == "replace":
        parent[path[-1]] = draw(st.sampled_from(ODD_VALUES) | JSON_VALUES)
    elif kind == "delete":
        del parent[path[-1]]
    elif kind == "add_key":
        target = parent[path[-1]] if isinstance(parent[path[-1]], dict) else data
        target[draw(st.sampled_from(("x", "dtype", "schema_version", "", "__class__", "type")))] = draw(JSON_VALUES)
    elif kind == "nest":
        parent[path[-1]] = {"value": parent[path[-1]]}
    else:
        parent[path[-1]] = [parent[path[-1]]]
    return kind, json.dumps(data)


def test_fuzzed_configs_load_or_fail_with_one_line_errors(record_count) -> None:
    outcomes: collections.Counter[str] = collections.Counter()
    kinds: collections.Counter[str] = collections.Counter()

    @settings(max_examples=EXAMPLES, suppress_health_check=list(HealthCheck))
    @given(mutated_json())
    def fuzz(case: tuple[str, str]) -> None:
        kind, text = case
        kinds[kind] += 1
        try:
            config = config_from_json(text)
        except ValueError as exc:
            message = str(exc)
            assert message and "\n" not in message, (kind, text, message)
            outcomes["refused"] += 1
            return
        except Exception as exc:
            pytest.fail(f"{kind}: {type(exc).__name__} escaped config_from_json: {exc}\n{text}")
        assert config_from_json(config_to_json(config)) == config, (kind, text)
        outcomes["loaded"] += 1

    fuzz()
    total = sum(outcomes.values())
    record_count(
        f"fuzzed {total} config JSON texts ({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))}): "
        f"{outcomes['loaded']} loaded and round-tripped, {outcomes['refused']} refused in one line, 0 crashes"
    )
    assert total >= 1000, f"only {total} fuzz cases ran"
