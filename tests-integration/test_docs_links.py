"""The docs point only at files inside the repository: every relative Markdown link and
every backticked repository path in README.md and docs/*.md names a file or folder that
exists, and none refers to the design notes that live outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("packages/*/README.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)#\s]+)(?:#[^)]*)?\)")
# Backticked paths that start at a top-level folder of the repository.
PATH = re.compile(r"`((?:packages|tools|docs|tests-integration)/[^`\s:*]+)`")
OUTSIDE = re.compile(r"\.\./shared|ONNXRUNTIME-INT8\.md|NPU-TARGET\.md|DESIGN\.md")


def _references(doc: Path) -> list[tuple[str, Path]]:
    text = doc.read_text(encoding="utf-8")
    found = []
    for target in LINK.findall(text):
        if not re.match(r"[a-z]+://", target) and not target.startswith("mailto:"):
            found.append((target, (doc.parent / target).resolve()))
    for target in PATH.findall(text):
        found.append((target, (ROOT / target.rstrip("/.,")).resolve()))
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_references_exist_inside_the_repository(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    assert not OUTSIDE.search(text), f"{doc.name} refers to notes outside the repository"
    missing = [target for target, path in _references(doc) if not path.exists() or ROOT not in path.parents]
    assert not missing, f"{doc.relative_to(ROOT)}: {missing}"
