"""Helpers for the command-line tests: the screen a terminal would show, subprocess runs
of the CLI, file snapshots, and a read-only folder that holds even for root."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import hashlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

TESTS = Path(__file__).resolve().parent
RUNNER = TESTS / "interrupt_runner.py"


_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def screen_lines(text: str) -> list[str]:
    """Non-blank lines a terminal shows for ``text``: a carriage return starts the line
    over (how progress bars redraw and erase themselves); escape sequences (the cursor
    moves of nested bars) are not shown."""
    shown = []
    for line in _ESCAPE.sub("", text).split("\n"):
        visible = ""
        for segment in line.split("\r"):
            visible = segment + visible[len(segment) :]
        if visible.strip():
            shown.append(visible.rstrip())
    return shown


def run_cli(*args: str, target: str = "-", k: int = 0, timeout: float = 120) -> subprocess.CompletedProcess:
    """The CLI in a fresh interpreter, with SIGINT at the ``k``-th call of ``target``
    (``k`` = 0: none, stderr ends with ``calls: N``; target ``-``: a plain run)."""
    result = subprocess.run(
        [sys.executable, str(RUNNER), target, str(k), *args],
        capture_output=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])},
    )
    # Decoded by hand: text mode would turn the bars' carriage returns into newlines.
    result.stdout, result.stderr = result.stdout.decode(), result.stderr.decode()
    return result


def calls_counted(result: subprocess.CompletedProcess) -> int:
    """The ``calls: N`` line a ``k = 0`` run prints."""
    line = [ln for ln in result.stderr.splitlines() if ln.startswith("calls: ")][-1]
    return int(line.split()[1])


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (hidden ones included) -> its SHA-256."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH = 1, 2


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


@contextlib.contextmanager
def read_only_folder(folder: Path) -> Iterator[bool]:
    """``folder`` made read-only (mode 0555) for this process; yields False when that
    cannot be enforced. Root ignores modes through CAP_DAC_OVERRIDE, so for root the
    capability is dropped from the effective set meanwhile and restored after."""
    folder.chmod(0o555)
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    header, saved = _CapHeader(0x20080522, 0), (_CapData * 2)()
    dropped = False
    try:
        if os.geteuid() == 0:
            if libc.capget(ctypes.byref(header), saved) != 0:
                yield False
                return
            reduced = (_CapData * 2)()
            ctypes.memmove(reduced, saved, ctypes.sizeof(saved))
            reduced[0].effective &= ~((1 << _CAP_DAC_OVERRIDE) | (1 << _CAP_DAC_READ_SEARCH))
            dropped = libc.capset(ctypes.byref(header), reduced) == 0
        yield os.geteuid() != 0 or dropped
    finally:
        if dropped:
            libc.capset(ctypes.byref(header), saved)
        folder.chmod(0o755)
