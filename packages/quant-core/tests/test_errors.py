"""One family of errors (quant_core.errors): no distribution raises a bare ``ValueError``
or defines an error class of its own, and representative bad input raises the member that
says what is wrong (config, model, data)."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from quant_core.errors import ConfigError, DataError, ModelError, QuantError
from quant_core.observers.minmax import MinMaxObserver
from quant_core.plan.graph import PlanGraph, PlanNode
from quant_core.presets import get_preset
from quant_core.serialization import config_from_json, load_config
from quant_core.spec import QuantSpec

PACKAGES = Path(__file__).resolve().parents[3] / "packages"
ERRORS_MODULE = Path("quant-core", "src", "quant_core", "errors.py")
FAMILY = {"QuantError", "ConfigError", "ModelError", "CaptureError", "DataError", "OutputError"}
BUILTIN_BASES = {"Exception", "BaseException", "ValueError", "TypeError", "RuntimeError", "ImportError", "KeyError"}


def _name(node: ast.AST | None) -> str | None:
    """``ValueError`` for ``ValueError``, ``ValueError(...)`` and ``builtins.ValueError``."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else None


def error_family_breaches(source: str, label: str) -> list[str]:
    """What in ``source`` steps outside the family: a raised or returned ``ValueError``, a
    class built on a builtin exception, a second class named like a family member."""
    found = []
    for node in ast.walk(ast.parse(source)):
        raised = node.exc if isinstance(node, ast.Raise) else node.value if isinstance(node, ast.Return) else None
        if _name(raised) == "ValueError":
            found.append(f"{label}:{node.lineno}: {type(node).__name__.lower()} ValueError")
        elif isinstance(node, ast.ClassDef):
            bases = {_name(base) for base in node.bases}
            if bases & BUILTIN_BASES or node.name in FAMILY:
                found.append(f"{label}:{node.lineno}: class {node.name}({', '.join(map(str, bases))})")
    return found


def test_the_scan_finds_what_it_looks_for() -> None:
    planted = (
        "class DataError(ValueError): pass\n"
        "def f(x):\n    if x:\n        raise ValueError('x')\n    return ValueError('y')\n"
        "def g():\n    raise ConfigError('fine')\n"
    )
    assert sorted(b.split(": ", 1)[1] for b in error_family_breaches(planted, "m.py")) == [
        "class DataError(ValueError)",
        "raise ValueError",
        "return ValueError",
    ]


def test_no_source_raises_a_bare_value_error_or_defines_its_own_error_class() -> None:
    if not (PACKAGES / ERRORS_MODULE).is_file():  # an installed wheel without the repository
        pytest.skip("packages/*/src not found next to the tests")
    breaches = []
    for path in sorted(PACKAGES.glob("*/src/**/*.py")):
        if path.relative_to(PACKAGES) != ERRORS_MODULE:
            breaches += error_family_breaches(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGES)))
    assert not breaches, "raise a member of quant_core.errors (ConfigError, ModelError, DataError, OutputError):\n" + (
        "\n".join(breaches)
    )


def test_a_bad_preset_name_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="preset: 'int7' is not a known preset; allowed: "):
        get_preset("int7")


def test_a_bad_field_in_a_config_file_is_a_config_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"\$\.global_config\.input\.dtype: 'int9' is not allowed"):
        config_from_json('{"schema_version": 2, "global_config": {"input": {"dtype": "int9"}}}')
    binary = tmp_path / "q.json"
    binary.write_bytes(bytes(range(128, 256)))
    with pytest.raises(ConfigError, match=r"q\.json: not UTF-8 text"):
        load_config(binary)


def test_bad_calibration_data_is_a_data_error() -> None:
    observer = MinMaxObserver(QuantSpec(dtype="int8"))
    with pytest.raises(DataError, match="contains NaN; calibration data must be finite"):
        observer.update(np.array([1.0, np.nan], np.float32))
    with pytest.raises(DataError, match="no data observed"):
        observer.range()


def test_a_malformed_model_graph_is_a_model_error() -> None:
    nodes = [PlanNode("n", "Relu", ("x",), ("y",)), PlanNode("n", "Relu", ("y",), ("z",))]
    with pytest.raises(ModelError, match="node 'n' \\(Relu\\): the name is used twice"):
        PlanGraph(nodes, inputs=("x",), outputs=("z",))


def test_every_member_is_a_value_error_for_callers_that_catch_that() -> None:
    for cls in (ConfigError, DataError, ModelError):
        assert issubclass(cls, QuantError) and issubclass(cls, ValueError)
