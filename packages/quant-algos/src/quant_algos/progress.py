"""Progress bars that leave no stale line behind when the work fails.

A tqdm bar left on screen above an error message (``calibrating: 0batch``) reads as if
the run were still going, or as if the error came from somewhere else. Inside
:func:`progress_bar` an exception (a bad batch, Ctrl-C) erases the bar before the error
is printed; a run that finishes keeps its final line, with the total and elapsed time.
:func:`clear_open_bars` erases bars opened elsewhere before the CLI prints an error.

Example:
    >>> with progress_bar(total=3, desc="calibrating", unit="batch", quiet=True) as bar:
    ...     for _ in range(3):
    ...         bar.update(1)
    >>> bar.total, bar.disable
    (3, True)
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from tqdm.auto import tqdm

_Item = TypeVar("_Item")


def first_taken(items: Iterable[_Item]) -> Iterator[_Item]:
    """``items`` with its first element already taken, so that a bad first batch (a wrong
    shape or dtype, checked as it is read) fails before any progress bar is drawn.

    Example:
        >>> list(first_taken(x * 2 for x in range(3))), list(first_taken([]))
        ([0, 2, 4], [])
    """
    iterator = iter(items)
    for first in iterator:
        return itertools.chain((first,), iterator)
    return iter(())


@contextmanager
def progress_bar(*, total: int | None, desc: str, unit: str, quiet: bool) -> Iterator[tqdm]:
    """A tqdm bar (off when ``quiet``) with ``total`` steps (``None``: unknown, no ETA),
    erased if the block raises."""
    bar = tqdm(total=total, desc=desc, unit=unit, disable=quiet, dynamic_ncols=True)
    try:
        yield bar
    except BaseException:
        bar.leave = False  # the error message follows: no bar above it
        raise
    finally:
        bar.close()


def clear_open_bars() -> None:
    """Erase every progress bar still open (one left by code that iterates ``tqdm(...)``
    directly when an error or Ctrl-C cut its loop short), so that the error message that
    follows stands alone."""
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.leave = False
        bar.clear()  # close() alone leaves a bar cut off while tqdm was still drawing it
        bar.close()
