"""How the command-line tools end: one line on stderr and an exit status for every refused
input (2) and for Ctrl-C (130), never a traceback. Shared by ``quant-onnx`` and
``quant-npu``.

Example:
    >>> import argparse
    >>> parser = argparse.ArgumentParser(prog="demo")
    >>> _ = parser.add_subparsers(dest="command").add_parser("fail")
    >>> from quant_core.errors import DataError
    >>> def fail(args):
    ...     raise DataError("calib-data: 'x.npy' does not exist\\nmore detail")
    >>> import contextlib, io
    >>> with contextlib.redirect_stderr(io.StringIO()) as err:
    ...     status = run_command("demo", parser, {"fail": fail}, ["fail"])
    >>> status, err.getvalue()
    (2, "demo: error: calib-data: 'x.npy' does not exist\\n")
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence

from quant_core.errors import QuantError

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a C tool writing into a closed pipe reports


def one_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none)."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def fail(prog: str, message: str, status: int) -> int:
    """Erase the progress bars a failed phase left, then ``prog: message`` on stderr."""
    if "quant_algos.progress" in sys.modules:  # a bar can only be open if a phase ran
        sys.modules["quant_algos.progress"].clear_open_bars()
    print(f"{prog}: {message}", file=sys.stderr)
    return status


class _NoteHandler(logging.Handler):
    """Writes each record above any progress bar on screen, not into its line."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        tqdm.write(self.format(record), file=sys.stderr)


@contextlib.contextmanager
def notes_on_stderr(prog: str, loggers: Sequence[str], quiet: bool) -> Iterator[None]:
    """While a command runs, what the libraries log at WARNING (a bias kept float, samples
    dropped...) reaches stderr as ``prog: note: ...``; with ``quiet`` only errors do (the
    notes are in the JSON report). The loggers are put back as they were afterwards."""
    handler = _NoteHandler()
    handler.setFormatter(logging.Formatter(f"{prog}: note: %(message)s"))
    saved = []
    for name in loggers:
        logger = logging.getLogger(name)
        saved.append((logger, logger.level, logger.propagate))
        logger.addHandler(handler)
        logger.setLevel(logging.ERROR if quiet else logging.WARNING)
        logger.propagate = False
    try:
        yield
    finally:
        for logger, level, propagate in saved:
            logger.removeHandler(handler)
            logger.setLevel(level)
            logger.propagate = propagate


def run_command(
    prog: str,
    parser: argparse.ArgumentParser,
    commands: Mapping[str, Callable[[argparse.Namespace], int]],
    argv: Sequence[str] | None,
    loggers: Sequence[str] = ("quant_onnx", "quant_algos"),
) -> int:
    """Parse ``argv``, run the chosen command, and turn what it raises into an exit status:
    130 on Ctrl-C (outputs are written atomically, so nothing partial is left), 2 with one
    line for bad input (:class:`~quant_core.errors.QuantError`, ``OSError``, a missing
    optional extra's ``ImportError``, onnxruntime's ``RuntimeError`` on what the checks
    could not see). Any other ``ValueError`` (numpy's, say) is a bug, not bad input: it
    keeps its traceback for the report. What ``loggers`` warn of is shown as notes, unless
    the command has ``--quiet``."""
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        with notes_on_stderr(prog, loggers, quiet=bool(getattr(args, "quiet", False))):
            status = commands[args.command](args)
            sys.stdout.flush()  # a closed pipe fails here, not in the interpreter's exit
            return status
    except KeyboardInterrupt:
        return fail(prog, "interrupted; no partial file was left", EXIT_INTERRUPTED)
    except BrokenPipeError:
        # stdout was piped into a reader that stopped (``| head``): end quietly, as the
        # shell's own tools do, and keep Python from complaining when it flushes at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except (QuantError, OSError, ImportError) as exc:
        return fail(prog, f"error: {one_line(exc)}", EXIT_BAD_INPUT)
    except RuntimeError as exc:
        return fail(prog, f"error: onnxruntime: {one_line(exc)}", EXIT_BAD_INPUT)
