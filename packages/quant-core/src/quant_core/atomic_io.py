"""Atomic file output: every file the toolkit writes (configs, models, reports)
appears whole or not at all, so an interrupted run never leaves a truncated file.

Example:
    >>> import tempfile, pathlib
    >>> with tempfile.TemporaryDirectory() as d:
    ...     target = atomic_write(pathlib.Path(d) / "out.txt", "hello")
    ...     target.read_text()
    'hello'
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def default_file_mode() -> int:
    """The mode a new file gets under this process's umask (``0o666 & ~umask``)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _naming(exc: OSError, target: Path) -> OSError:
    """The same error, naming the file the caller asked for instead of the temp file."""
    return OSError(exc.errno, f"cannot write '{target}': {exc.strerror or exc}")


def atomic_write(path: str | os.PathLike[str], data: bytes | str) -> Path:
    """Write ``data`` to ``path`` through a temp file in the same folder, then rename.

    The file gets the ordinary mode for this process's umask (``mkstemp`` alone would
    leave it 0600); on any error the temp file is removed and ``path`` is untouched. An
    OSError names ``path``, never the hidden temp file.
    """
    target = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise _naming(exc, target) from None
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, default_file_mode())
        os.replace(tmp, target)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise _naming(exc, target) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
