"""The config reference is generated from the attrs classes and kept in sync; every field
a config file can hold is described."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from quant_core.config_doc import CLASSES, config_reference, field_descriptions, main

DOC = Path(__file__).resolve().parents[3] / "docs" / "config-reference.md"


def test_docs_reference_is_up_to_date() -> None:
    if not DOC.exists():  # an installed wheel without the repository
        pytest.skip("docs/ not found next to the package")
    assert DOC.read_text(encoding="utf-8") == config_reference(), (
        "docs/config-reference.md is stale: run `python -m quant_core.config_doc docs/config-reference.md`"
    )


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_field_is_described(cls: type) -> None:
    described = field_descriptions(cls)
    missing = [f.name for f in attrs.fields(cls) if f.init and not described.get(f.name)]
    assert not missing, f"{cls.__name__}: describe {missing} in its docstring's Args"


def test_main_prints_or_writes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0 and "## QuantSpec" in capsys.readouterr().out
    target = tmp_path / "ref.md"
    assert main([str(target)]) == 0 and target.read_text(encoding="utf-8") == config_reference()
