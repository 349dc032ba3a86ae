"""Test settings for quant_core.

Hypothesis runs derandomized (the same examples on every run and machine) with no
per-example deadline: timing never decides whether a unit test passes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import settings

settings.register_profile("quant_core", deadline=None, derandomize=True, database=None, print_blob=True)
# Exploratory runs: HYPOTHESIS_PROFILE=explore pytest ... (random, more examples).
settings.register_profile("explore", deadline=None, max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "quant_core"))


# --- counts of the hardening tests (fuzzing), shown whether or not output is captured -------------
_COUNTS = pytest.StashKey[list[str]]()


@pytest.fixture
def record_count(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """``record_count(line)``: a hardening test's count, printed in the terminal summary."""
    lines = request.config.stash.setdefault(_COUNTS, [])

    def record(line: str) -> None:
        lines.append(f"{request.node.name}: {line}")
        print(line)

    return record


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    lines = config.stash.get(_COUNTS, [])
    if lines:
        terminalreporter.section("hardening counts")
        for line in lines:
            terminalreporter.write_line(line)
