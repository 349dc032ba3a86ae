"""Measuring helpers shared by the benchmark scripts (numpy + stdlib at import; onnx/onnxruntime lazily).

* :func:`measure_in_subprocess` runs a job in a fresh interpreter and reports its wall time and
  peak-memory increase over a baseline taken after imports, model and data loading.
* :func:`make_session`, :func:`predict`, :func:`latency_ms` run onnxruntime at ``ORT_ENABLE_ALL``.
* :func:`accuracy`, :func:`agreement`: top-1 scores.
* :func:`float_compute_nodes` lists the Conv/Gemm/MatMul nodes still in float after onnxruntime's
  graph optimisation (the ones that did not land in an integer kernel).
* :func:`clean_float_model`: the float model cleaned the way the quantizer cleans it (constant
  folding, Pad folding), the fair latency baseline.
* :func:`markdown_table`, :func:`write_json`, :func:`atomic_path`: reporting and atomic output.

Example:
    >>> print(markdown_table(["model", "x"], [["a", 1.5]]))
    | model | x |
    |---|---|
    | a | 1.5 |
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE_DIR = REPO_ROOT / ".cache"
DEFAULT_THREADS = 2
LATENCY_BATCH = 32

# (domain, op_type) of float compute nodes in onnxruntime's optimised graph. Integer kernels
# show up as QLinearConv, QGemm, MatMulInteger, ConvInteger, ... and are not in this set.
FLOAT_COMPUTE_OPS = frozenset(
    {
        ("", "Conv"),
        ("", "Gemm"),
        ("", "MatMul"),
        ("com.microsoft", "FusedConv"),
        ("com.microsoft", "FusedGemm"),
        ("com.microsoft", "FusedMatMul"),
        ("com.microsoft.nchwc", "Conv"),
    }
)
COMPUTE_OPS = frozenset(
    {
        "Conv",
        "Gemm",
        "MatMul",
        "FusedConv",
        "FusedGemm",
        "FusedMatMul",
        "QLinearConv",
        "QGemm",
        "QLinearMatMul",
        "MatMulInteger",
        "ConvInteger",
        "DynamicQuantizeMatMul",
        "MatMulIntegerToFloat",
        "NhwcQLinearConv",
    }
)


# ------------------------------------------------------------------------------ output


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], suffix: str = "") -> Iterator[Path]:
    """Yield a temp path next to ``path``; on success it replaces ``path`` (readable 0644), else it is removed.

    Example:
        >>> import tempfile, pathlib
        >>> target = pathlib.Path(tempfile.mkdtemp()) / "x.txt"
        >>> with atomic_path(target) as tmp:
        ...     _ = tmp.write_text("hi")
        >>> target.read_text()
        'hi'
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=suffix or path.suffix, prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; caches are shared between users of the checkout
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_json(path: str | os.PathLike[str], data: Any) -> None:
    """Write ``data`` as indented JSON atomically (non-finite floats become null)."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(_json_safe(data), indent=2, sort_keys=False) + "\n")


def load_results(path: Path, resume: bool) -> dict[str, Any]:
    """The results dict a bench fills in: what ``path`` holds when resuming, else an empty one."""
    if resume and path.exists():
        return json.loads(path.read_text())
    return {"models": {}}


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    return value


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; ``None`` cells print as an em dash, floats as given by :func:`fmt`."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row {row!r}: has {len(row)} cells; allowed: {len(headers)} (one per header)")
        lines.append("| " + " | ".join(fmt(cell) for cell in row) + " |")
    return "\n".join(lines)


def fmt(value: Any, digits: int = 3) -> str:
    """Cell text: None -> '—', floats to ``digits`` significant digits, others via str()."""
    if value is None:
        return "—"
    if isinstance(value, float | np.floating):
        if not math.isfinite(value):
            return "—"
        return f"{value:.{digits}g}" if abs(value) < 10**digits else f"{value:.0f}"
    return str(value)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return float(numerator) / float(denominator)


# ------------------------------------------------------------------- subprocess jobs


def _proc_status_kib(pid: int | str = "self") -> dict[str, int]:
    values: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0])
    return values


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


#: glibc's ``mallopt`` parameters (``malloc.h``).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory(limit: int = 1 << 30) -> bool:
    """Make glibc keep freed memory for reuse (no heap trimming, no ``mmap`` per large block
    below ``limit``), as ``MALLOC_TRIM_THRESHOLD_`` and ``MALLOC_MMAP_THRESHOLD_`` would at
    process start. With the defaults, an eager torch forward frees its large activations,
    glibc hands the top of the heap back to the kernel and the next pass page-faults it in
    again: 20-30 K faults a pass and 40% of the float forward of the 32-pixel reference
    model (docs/benchmarks.md). Returns False where the C library has no ``mallopt``."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, limit)) and bool(mallopt(_M_MMAP_THRESHOLD, limit))


def load_torch_runtime() -> None:
    """Import torch and what its optimizers load on first use (``torch._dynamo``, sympy:
    about 80 MB). A job whose work trains with torch calls this in its setup, so that the
    imports count in its memory baseline, as Quark's ``import quark.onnx`` loads torch
    before its work starts."""
    import torch
    import torch._dynamo  # noqa: F401  (torch.optim.Adam imports it when first built)


def _run_job(spec_path: str) -> None:
    """Child side of :func:`measure_in_subprocess` (``python -m tools.bench.common --job SPEC``)."""
    spec = json.loads(Path(spec_path).read_text())
    module_name, _, func_name = spec["target"].partition(":")
    result: dict[str, Any] = {}
    try:
        setup = getattr(importlib.import_module(module_name), func_name)
        work = setup(**spec["kwargs"])  # imports, model and data loading: part of the baseline
        import gc

        gc.collect()
        # Without a resettable high-water mark, the peak so far is the baseline (a lower bound on the increase).
        baseline = _proc_status_kib()["VmRSS" if _reset_peak_rss() else "VmHWM"]
        start = time.perf_counter()
        extras = work()
        wall = time.perf_counter() - start
        peak = _proc_status_kib()["VmHWM"]
        result = {
            "ok": True,
            "wall_s": wall,
            "baseline_mb": baseline / 1024,
            "peak_mb": peak / 1024,
            "peak_increase_mb": max(0, peak - baseline) / 1024,
            "extras": extras or {},
        }
    except BaseException as exc:  # report any failure to the parent instead of a traceback only
        import traceback

        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    Path(spec["result"]).write_text(json.dumps(_json_safe(result)))


def measure_in_subprocess(
    target: str,
    kwargs: Mapping[str, Any] | None = None,
    *,
    timeout_s: float | None = None,
    mem_limit_mb: float | None = None,
    threads: int | None = None,
    quiet: bool = True,
) -> dict[str, Any]:
    """Run ``target`` (``"package.module:function"``) in a fresh Python and measure it.

    ``function(**kwargs)`` does the setup (imports, loading the model and data: all part of the
    memory baseline) and returns a zero-argument callable, the work that is timed and whose peak
    resident memory above the baseline is reported (VmHWM after a reset of the high-water mark).
    The work may return a dict of JSON-able extras. A watchdog kills the child when its resident
    memory exceeds ``mem_limit_mb`` or the time exceeds ``timeout_s``; the result then says so and
    carries lower bounds (``wall_s``/``peak_mb`` at the kill).

    Returns a dict with ``ok``, ``wall_s``, ``peak_increase_mb``, ``baseline_mb``, ``peak_mb``,
    ``extras`` or, on failure, ``error`` (and ``killed`` = "memory"/"timeout" for watchdog kills).

    Example:
        >>> r = measure_in_subprocess("tools.bench.common:_demo_job", {"mb": 64})  # doctest: +SKIP
        >>> r["ok"], r["peak_increase_mb"] > 60  # doctest: +SKIP
        (True, True)
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *_package_src_paths(), env.get("PYTHONPATH", "")])
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    with tempfile.TemporaryDirectory(prefix="bench-job-") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(
            json.dumps({"target": target, "kwargs": _json_safe(dict(kwargs or {})), "result": str(result_path)})
        )
        start = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "tools.bench.common", "--job", str(spec_path)],
            cwd=REPO_ROOT,
            env=env,
            stdout=None if not quiet else subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        stderr_chunks: list[str] = []
        reader = threading.Thread(target=lambda: stderr_chunks.append(proc.stderr.read()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        killed, max_rss_mb = None, 0.0
        while proc.poll() is None:
            time.sleep(0.05)
            with contextlib.suppress(OSError, KeyError):
                max_rss_mb = max(max_rss_mb, _proc_status_kib(proc.pid)["VmRSS"] / 1024)
            elapsed = time.perf_counter() - start
            if mem_limit_mb is not None and max_rss_mb > mem_limit_mb:
                killed = "memory"
            elif timeout_s is not None and elapsed > timeout_s:
                killed = "timeout"
            if killed:
                proc.kill()
                proc.wait()
                break
        reader.join(timeout=5)
        elapsed = time.perf_counter() - start
        if killed:
            return {
                "ok": False,
                "killed": killed,
                "error": f"killed by the watchdog ({killed})",
                "wall_s_at_kill": elapsed,
                "rss_mb_at_kill": max_rss_mb,
            }
        if not result_path.exists():
            return {
                "ok": False,
                "error": f"child exited with code {proc.returncode}",
                "stderr": "".join(stderr_chunks)[-4000:],
            }
        result = json.loads(result_path.read_text())
        if not result.get("ok") and not quiet:
            print(result.get("traceback", ""), file=sys.stderr)
        return result


def _package_src_paths() -> list[str]:
    # Benchmarks run against the checkout's sources, like `PYTHONPATH=packages/*/src`.
    return [str(p) for p in sorted((REPO_ROOT / "packages").glob("*/src")) if p.is_dir()]


def use_checkout_packages() -> None:
    """Import quant_core/quant_onnx/... from this checkout's ``packages/*/src`` (as the job subprocesses do)."""
    for path in reversed(_package_src_paths()):
        if path not in sys.path:
            sys.path.insert(0, path)


def _demo_job(mb: int = 64) -> Callable[[], dict[str, int]]:
    """A job allocating ``mb`` MiB, for tests of :func:`measure_in_subprocess`."""

    def work() -> dict[str, int]:
        block = np.ones(mb * 1024 * 1024 // 8)
        return {"size": int(block.size)}

    return work


def interleaved_medians(
    first: Callable[[], Any], second: Callable[[], Any], repeats: int, sync: Callable[[], Any] | None = None
) -> tuple[float, float]:
    """Median wall times of ``first`` and ``second`` run alternately ``repeats`` times (the
    machine is shared: interleaving makes a drifting load touch both sides alike). ``sync``
    runs before each clock reading (a GPU's ``torch.cuda.synchronize``)."""
    a: list[float] = []
    b: list[float] = []
    for _ in range(repeats):
        for fn, out in ((first, a), (second, b)):
            out.append(synced_seconds(fn, sync))
    return statistics.median(a), statistics.median(b)


def synced_seconds(fn: Callable[[], Any], sync: Callable[[], Any] | None = None) -> float:
    """Wall seconds of one ``fn()``, with ``sync`` (a GPU's ``torch.cuda.synchronize``) run
    before each clock reading."""
    if sync is not None:
        sync()
    t = time.perf_counter()
    fn()
    if sync is not None:
        sync()
    return time.perf_counter() - t


def time_call(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``(fn(), seconds)``."""
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


# --------------------------------------------------------------------------- onnxruntime


def make_session(
    path: str | os.PathLike[str] | bytes,
    threads: int = DEFAULT_THREADS,
    *,
    level: str = "all",
    optimized_path: str | os.PathLike[str] | None = None,
    spin: bool = True,
):  # -> ort.InferenceSession
    """A CPU session (model path or serialized bytes) at optimisation ``level`` with ``threads`` intra-op threads.

    ``level`` is one of "disable", "basic", "extended", "all". ``spin=False`` stops the intra-op
    threads from busy-waiting after a run: needed when several sessions live side by side, or
    each one's idle spinning threads steal the cores the running one needs.
    """
    import onnxruntime as ort

    levels = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }
    if level not in levels:
        raise ValueError(f"level: {level!r} is not known; allowed: {', '.join(levels)}")
    options = ort.SessionOptions()
    options.graph_optimization_level = levels[level]
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    if not spin:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if optimized_path is not None:
        options.optimized_model_filepath = str(optimized_path)
    source = path if isinstance(path, bytes) else str(path)
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def predict(
    session_or_path: Any,
    x: np.ndarray,
    batch_size: int = 64,
    threads: int = DEFAULT_THREADS,
    *,
    level: str = "all",
) -> np.ndarray:
    """First output of a single-input model over ``x``, batch by batch (ragged last batch fine).

    ``level`` is the optimisation level of the session made when a path is given (see :func:`make_session`).
    """
    is_model = isinstance(session_or_path, str | Path | bytes)
    session = make_session(session_or_path, threads, level=level) if is_model else session_or_path
    name = session.get_inputs()[0].name
    outputs = [session.run(None, {name: x[i : i + batch_size]})[0] for i in range(0, len(x), batch_size)]
    return np.concatenate(outputs)


def top1(logits: np.ndarray) -> np.ndarray:
    return np.asarray(logits).reshape(len(logits), -1).argmax(axis=1)


def accuracy(predictions: np.ndarray, labels: np.ndarray) -> float:
    """Fraction of ``predictions`` (class ids) equal to ``labels``."""
    predictions, labels = np.asarray(predictions), np.asarray(labels)
    if predictions.shape != labels.shape or predictions.size == 0:
        raise ValueError(f"predictions {predictions.shape} and labels {labels.shape}: need equal, non-empty shapes")
    return float(np.mean(predictions == labels))


def agreement(predictions: np.ndarray, reference: np.ndarray) -> float:
    """Top-1 agreement with a reference model's predictions (same as :func:`accuracy`)."""
    return accuracy(predictions, reference)


def latency_ms(
    paths: Mapping[str, str | os.PathLike[str]],
    x: np.ndarray,
    *,
    threads: int = DEFAULT_THREADS,
    repeats: int = 15,
    warmup: int = 3,
) -> dict[str, float]:
    """Median wall time in ms of one ``run`` on batch ``x`` for each model, rounds interleaved.

    Interleaving the models in every round spreads slow phases of a shared machine evenly.
    """
    sessions = {key: make_session(path, threads, spin=False) for key, path in paths.items()}
    feeds = {key: {s.get_inputs()[0].name: x} for key, s in sessions.items()}
    for _ in range(warmup):
        for key, s in sessions.items():
            s.run(None, feeds[key])
    times: dict[str, list[float]] = {key: [] for key in sessions}
    for _ in range(repeats):
        for key, s in sessions.items():
            start = time.perf_counter()
            s.run(None, feeds[key])
            times[key].append((time.perf_counter() - start) * 1e3)
    return {key: statistics.median(values) for key, values in times.items()}


def optimized_graph_ops(path: str | os.PathLike[str], threads: int = DEFAULT_THREADS):  # -> onnx.ModelProto
    """onnxruntime's ``ORT_ENABLE_ALL`` optimised graph of ``path`` (as written by optimized_model_filepath)."""
    import onnx

    with tempfile.TemporaryDirectory(prefix="ort-opt-") as tmp:
        out = Path(tmp) / "optimized.onnx"
        make_session(path, threads, optimized_path=out)
        return onnx.load(str(out), load_external_data=False)


def float_compute_nodes(path: str | os.PathLike[str], threads: int = DEFAULT_THREADS) -> dict[str, Any]:
    """Count compute nodes left in float in onnxruntime's optimised graph.

    Returns ``{"float": n, "total": m, "float_nodes": [names], "op_types": {"domain:op": count}}``
    where ``total`` counts every compute node (float or integer kernel).
    """
    model = optimized_graph_ops(path, threads)
    float_nodes = [n.name or n.output[0] for n in model.graph.node if (n.domain, n.op_type) in FLOAT_COMPUTE_OPS]
    ops = Counter(f"{n.domain}:{n.op_type}" if n.domain else n.op_type for n in model.graph.node)
    total = sum(1 for n in model.graph.node if n.op_type in COMPUTE_OPS)
    return {"float": len(float_nodes), "total": total, "float_nodes": float_nodes, "op_types": dict(ops)}


def file_size_mb(path: str | os.PathLike[str]) -> float:
    return os.path.getsize(path) / 2**20


def clean_float_model(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> str:
    """Write the float model cleaned like the quantizer cleans it; returns how it was cleaned.

    Uses ``quant_onnx.pipeline.preprocess.preprocess`` (constant folding, Pad folding, ...) when it exists,
    else onnxruntime's basic-level optimisation (constant folding and Pad fusion into Conv) saved
    to disk; both keep the graph portable (no layout-specific ops).
    """
    import onnx

    try:
        from quant_onnx.pipeline.preprocess import PreprocessOptions, preprocess
    except ImportError:
        preprocess = None
    with atomic_path(dst, ".onnx") as tmp:
        if preprocess is not None:
            cleaned = preprocess(onnx.load(str(src)), PreprocessOptions())
            onnx.save(cleaned, str(tmp))
            return "quant_onnx.pipeline.preprocess"
        make_session(src, level="basic", optimized_path=tmp)
        return "onnxruntime basic optimisation"


def quant_onnx_quantize(
    model_in: str | os.PathLike[str],
    model_out: str | os.PathLike[str],
    config: Any,
    calibration_data: Any,
    **kwargs: Any,
) -> Any:
    """``quant_onnx.quantize`` with its progress bars off where the API offers a switch."""
    import inspect

    import quant_onnx

    parameters = inspect.signature(quant_onnx.quantize).parameters
    if "quiet" in parameters:
        kwargs.setdefault("quiet", True)
    elif "progress" in parameters:
        kwargs.setdefault("progress", False)
    return quant_onnx.quantize(str(model_in), str(model_out), config, calibration_data, **kwargs)


@contextlib.contextmanager
def captured_warnings() -> Iterator[list[str]]:
    """Collect ``warnings.warn`` messages and WARNING+ log records (e.g. "algorithms not run") into a list.

    Example:
        >>> import logging
        >>> with captured_warnings() as seen:
        ...     logging.getLogger("x").warning("careful")
        >>> seen
        ['careful']
    """
    import logging
    import warnings

    seen: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = _Collect(level=logging.WARNING)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield seen
        seen.extend(str(w.message) for w in caught)
    finally:
        root.removeHandler(handler)


def api_available(module: str, attribute: str | None = None) -> bool:
    """Whether ``module`` (and ``module.attribute``) can be imported: the APIs land while the harness is used.

    Example:
        >>> api_available("json", "dumps"), api_available("json", "no_such_name")
        (True, False)
    """
    try:
        imported = importlib.import_module(module)
    except ImportError:
        return False
    return attribute is None or hasattr(imported, attribute)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--job":
        _run_job(sys.argv[2])
    else:
        sys.exit("usage: python -m tools.bench.common --job SPEC.json (internal)")
