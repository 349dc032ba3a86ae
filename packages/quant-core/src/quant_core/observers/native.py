"""The native histogram count (``native_counting.c``), built on first use with the
machine's C compiler and loaded through ``ctypes``.

Counting a histogram in numpy or torch takes five passes over the values (range, scaling,
floor, conversion, count) at 0.05-0.3 ns a value each; the C loop does the range and the
count in one pass over cache-sized blocks, at about half the time a value
(docs/benchmarks.md, "A native count"). The counts are the numpy path's
(:func:`quant_core.observers.binning.bin_counts`), bit for bit: the same operations in the
same float type, checked against it by the tests.

Nothing is compiled at install time, so the distributions stay pure Python. The first
count in a process looks for the library in the cache (``QUANT_CORE_CACHE_DIR``, else
``$XDG_CACHE_HOME/quant_core``, else ``~/.cache/quant_core``), under a name that hashes the
source, the compiler command and the platform; when it is missing it runs the compiler
(``$CC``, else Python's own, else ``cc``) once, writing to a temporary file that is then
renamed, so processes building at the same time never load a partial file. Without a
compiler, on a platform other than Linux or macOS, or with ``QUANT_CORE_NATIVE=0``, the
numpy and torch paths count as before; :func:`status` says which is in use and why.

Example:
    >>> import numpy as np
    >>> from quant_core.observers.grid import HistogramGrid
    >>> counter = native_counter()  # None where no C compiler was found
    >>> grid = HistogramGrid(exponent=-1, offset=-2, bins=4)  # edges -1, -0.5, 0, 0.5, 1
    >>> if counter is not None:
    ...     counts, lo, hi = counter.count(np.float32([-1.0, -0.25, 0.0, 0.75]), grid)
    ...     assert (counts.tolist(), lo, hi) == ([1, 1, 1, 1], -1.0, 0.75)
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import ctypes

import numpy as np

from quant_core.errors import DataError
from quant_core.observers.grid import HistogramGrid, work_dtype

#: ``QUANT_CORE_NATIVE=0`` keeps the numpy and torch counting paths.
SWITCH = "QUANT_CORE_NATIVE"
#: Where the built library is kept (default: ``$XDG_CACHE_HOME/quant_core`` or ``~/.cache/quant_core``).
CACHE_DIR = "QUANT_CORE_CACHE_DIR"

SOURCE = Path(__file__).with_name("native_counting.c")
# No -march: the library may sit in a home directory that machines of several kinds share
# (and on the machine measured, SSE4.1 and AVX-512 code ran this loop 3x slower).
# -fno-trapping-math lets the compiler turn the binning's conditional conversions into
# vector selects; it changes no value, only which floating-point exception flags get raised.
FLAGS = ("-O3", "-std=c99", "-fno-trapping-math", "-fPIC", "-shared")
ABI_VERSION = 2
_BUILD_TIMEOUT_S = 120


class NativeCounter:
    """The loaded kernels: :meth:`count` over a contiguous float32 or float64 vector."""

    def __init__(self, library: ctypes.CDLL) -> None:
        import ctypes

        self._library = library
        by_type = {
            np.dtype(np.float32): (library.qc_count_f32, ctypes.c_float),
            np.dtype(np.float64): (library.qc_count_f64, ctypes.c_double),
        }
        for function, scalar in by_type.values():
            function.restype = ctypes.c_int
            function.argtypes = [
                ctypes.c_void_p,  # values
                ctypes.c_int64,  # how many
                scalar,  # scale: 2**-exponent
                ctypes.c_int32,  # offset
                ctypes.c_int32,  # bins (0: the range alone)
                ctypes.c_void_p,  # counts out
                ctypes.c_void_p,  # range out
            ]
        self._by_type = by_type

    def count(self, values: np.ndarray, grid: HistogramGrid | None) -> tuple[np.ndarray | None, float, float]:
        """``(counts, min, max)`` of the 1-d contiguous float32/float64 ``values``: int64
        counts on ``grid`` (None when a value lies outside it, is NaN or infinite, or when
        ``grid`` is None) and the exact minimum and maximum of every value (NaN when one is
        NaN; NaN too for no values, whose counts are all 0), in one pass. float32 values are
        binned in float32 only where that is exact
        (:func:`quant_core.observers.grid.work_dtype`), else in float64, as the numpy
        path does. The ``ctypes`` call releases the GIL."""
        if values.ndim != 1 or not values.flags.c_contiguous or values.dtype not in self._by_type:
            raise DataError("values: a 1-d contiguous float32 or float64 array is expected")
        if grid is not None and not (grid.bins >= 1 and abs(grid.offset) + grid.bins < 1 << 30):
            raise DataError(f"grid: {grid.bins} bins at offset {grid.offset}; the native count needs "
                            "1 <= bins and |offset| + bins < 2**30")  # fmt: skip
        if grid is not None and work_dtype(values.dtype, grid) != values.dtype:
            values = values.astype(np.float64)  # float32 arithmetic would not be exact on this grid
        function, scalar = self._by_type[values.dtype]
        bins = 0 if grid is None else grid.bins
        counts = np.zeros(max(bins, 1), np.int64)
        bounds = np.empty(2, np.float64)
        status = function(
            values.ctypes.data,
            values.size,
            scalar(0.0 if grid is None else grid.inv_width),
            0 if grid is None else grid.offset,
            bins,
            counts.ctypes.data,
            bounds.ctypes.data,
        )
        if status < 0:
            raise MemoryError("native histogram count: no memory for the scratch counts")
        lo, hi = float(bounds[0]), float(bounds[1])
        return (counts if status == 0 and grid is not None else None), lo, hi


_lock = threading.Lock()
_loaded: list[NativeCounter | None] = []  # empty until the first call decides
_status = "not tried yet"


def native_counter() -> NativeCounter | None:
    """The native kernels, built and loaded on the first call; None when they are switched
    off or cannot be built here (:func:`status` says why). Decided once per process."""
    if _loaded:
        return _loaded[0]
    with _lock:
        if not _loaded:
            _loaded.append(_load())
    return _loaded[0]


def status() -> str:
    """Which histogram count this process uses, and why (for reports and bug reports)."""
    return _status


def reset() -> None:
    """Forget the decision, so the next :func:`native_counter` decides again (tests)."""
    global _status
    with _lock:
        _loaded.clear()
        _status = "not tried yet"


@contextmanager
def switched(on: bool) -> Iterator[NativeCounter | None]:
    """Within the block, count natively (``on``, where the kernel can be built: the block
    gets the counter, or None when it cannot) or with the numpy and torch passes (gets
    None); afterwards :data:`SWITCH` and the decision are as before. For comparing the two
    paths, as the tests and benchmarks do.

    Example:
        >>> with switched(False) as counter:
        ...     counter is None
        True
    """
    before = os.environ.get(SWITCH)
    os.environ[SWITCH] = "1" if on else "0"
    reset()
    try:
        yield native_counter()
    finally:
        if before is None:
            os.environ.pop(SWITCH, None)
        else:
            os.environ[SWITCH] = before
        reset()


def _load() -> NativeCounter | None:
    global _status
    if os.environ.get(SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        _status = f"numpy/torch counting: {SWITCH}={os.environ[SWITCH]}"
        return None
    if sys.platform not in ("linux", "darwin"):
        _status = f"numpy/torch counting: no native build on {sys.platform}"
        return None
    compiler = _compiler()
    if compiler is None:
        _status = "numpy/torch counting: no C compiler found ($CC, Python's CC or cc)"
        return None
    try:
        library, counter = _built_and_loaded(compiler)
    except Exception as exc:  # whatever stops the build (no home directory, a full disk...): numpy counts
        reason = str(exc).splitlines()[0] if str(exc) else repr(exc)
        _status = f"numpy/torch counting: the native build failed ({reason})"
        return None
    _status = f"native counting: {library}"
    return counter


def _compiler() -> list[str] | None:
    """The compiler command: ``$CC``, else the one Python was built with, else ``cc``; the
    first whose program is on PATH (a command that does not parse is passed over)."""
    import shlex
    import shutil
    import sysconfig

    for candidate in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc"):
        try:
            words = shlex.split(str(candidate)) if candidate else []
        except ValueError:
            continue
        if words and shutil.which(words[0]):
            return words
    return None


def cache_dir() -> Path:
    """Where built libraries are kept (:data:`CACHE_DIR`, else the user's cache)."""
    chosen = os.environ.get(CACHE_DIR)
    if chosen:
        return Path(chosen)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "quant_core"


def _built_and_loaded(compiler: list[str]) -> tuple[Path, NativeCounter]:
    """The library for this source, compiler and platform, loaded: from the cache, else
    compiled into it. A cached file that does not load (or holds another ABI) is built
    again; a build is loaded from its temporary file before it is renamed into place, so
    nothing but a working library ever sits under the final name."""
    import hashlib
    import subprocess
    import tempfile

    source = SOURCE.read_bytes()
    identity = [source, " ".join(compiler).encode(), " ".join(FLAGS).encode(), sys.platform.encode()]
    key = hashlib.sha256(b"\0".join([*identity, os.uname().machine.encode()])).hexdigest()[:20]
    folder = cache_dir() / "native"
    target = folder / f"counting-{key}.so"
    if target.exists():
        try:
            return target, _loaded_from(target)
        except OSError:
            pass  # damaged or foreign: build it again over it
    folder.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=".counting-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        try:
            subprocess.run(
                [*compiler, *FLAGS, "-o", partial, str(SOURCE)],
                check=True,
                capture_output=True,
                timeout=_BUILD_TIMEOUT_S,
            )
        except subprocess.CalledProcessError as exc:
            message = exc.stderr.decode(errors="replace").strip()
            raise OSError(f"{' '.join(compiler)} exited with {exc.returncode}: {message}") from None
        counter = _loaded_from(Path(partial))
        os.chmod(partial, 0o755)  # readable by the other users of a shared cache (mkstemp gives 0600)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target, counter


def _loaded_from(library: Path) -> NativeCounter:
    """The kernels of ``library``; OSError when it does not load or has another ABI."""
    import ctypes

    try:
        loaded = ctypes.CDLL(str(library))
        version = loaded.qc_abi_version()
    except AttributeError:
        raise OSError(f"{library} is not this kernel's library") from None
    if version != ABI_VERSION:
        raise OSError(f"{library} has ABI version {version}, not {ABI_VERSION}")
    return NativeCounter(loaded)
