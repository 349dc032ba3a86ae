"""Every ```python example in the user guides runs as written (from a scratch folder that
holds the repository's `tools/models`, so outputs never land in the repository)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDES = sorted(
    p for p in (ROOT / "docs").glob("*.md") if p.name.startswith(("getting-started", "coming-from", "concepts"))
)
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def examples(doc: Path) -> list[str]:
    return BLOCK.findall(doc.read_text(encoding="utf-8"))


def test_there_are_guides_with_examples() -> None:
    assert GUIDES and all(examples(doc) for doc in GUIDES)


@pytest.mark.parametrize("doc", GUIDES, ids=lambda p: p.name)
def test_guide_examples_run(doc: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "tools").mkdir()
    os.symlink(ROOT / "tools" / "models", tmp_path / "tools" / "models")
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": f"docs_{doc.stem}"}
    for number, code in enumerate(examples(doc), 1):
        try:
            exec(compile(code, f"{doc.name}[{number}]", "exec"), namespace)
        except Exception as exc:  # pragma: no cover - the message names the block
            raise AssertionError(f"{doc.name}: example {number} failed: {type(exc).__name__}: {exc}") from exc
