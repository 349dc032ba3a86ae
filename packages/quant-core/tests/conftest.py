"""Test settings for quant_core.

Hypothesis runs derandomized (the same examples on every run and machine) with no
per-example deadline: timing never decides whether a unit test passes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import settings

from quant_core.observers import native

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


@contextmanager
def counting_path(path: str) -> Iterator[None]:
    """Histograms counted by the native kernel (``"native"``; skipped where it cannot be
    built) or by numpy's passes (``"numpy"``), for the duration of the block."""
    with native.switched(path == "native") as counter:
        if path == "native" and counter is None:
            pytest.skip(f"no native count here: {native.status()}")
        yield


@pytest.fixture(scope="module", params=["native", "numpy"])
def each_counting_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Module-scoped (hypothesis tests take no function-scoped fixtures): every test of a
    module that uses it runs once per counting path."""
    with counting_path(request.param):
        yield request.param
