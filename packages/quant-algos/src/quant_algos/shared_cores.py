"""Whether other work shares this machine's cores now: the one test both backends use to
pick how their thread pools wait (onnxruntime) or to tell the user how to (torch's OpenMP).

A waiting thread that spins keeps its core; on a quiet machine that saves the wake-up, on a
busy one it takes the core from the thread it waits for. Measured on 2 cores
(docs/benchmarks.md, issue 28): quiet, spinning is faster (EfficientNet-Lite0 calibration in
onnxruntime 0.33 against 0.43 s; torch calibration 0.91 against 1.24 s with OpenMP's passive
policy); beside other work, it is slower (onnxruntime 2.2 against 1.1 s; torch 44-83 against
4.7-5.7 s). Only the waiting changes, never a computed value, so the choice may follow the
load.

Example:
    >>> machine_is_busy(load=9.0, cores=2), machine_is_busy(load=2.5, cores=2)
    (True, False)
"""

from __future__ import annotations

import os


def machine_is_busy(load: float | None = None, cores: int | None = None) -> bool:
    """Load above ``cores + 1`` (this process's own threads plus one more are normal).
    ``load`` and ``cores`` default to this machine's, now (:func:`current_load`); ``False``
    where the platform reports no load."""
    if load is None:
        load = current_load()
        if load is None:
            return False
    cores = cores or os.cpu_count() or 1
    return load > cores + 1


def current_load() -> float | None:
    """The larger of the one-minute load average and the threads runnable at this instant
    (:func:`runnable_now`): the average lags a neighbour that has just started by about a
    minute. ``None`` where the platform reports neither."""
    average = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    now = runnable_now()
    if average is None and now is None:
        return None
    return max(average or 0.0, float(now or 0))


def runnable_now() -> int | None:
    """Threads runnable on the machine at this instant, the caller included (Linux:
    ``/proc/loadavg``'s fourth field); ``None`` where it cannot be read."""
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            return int(f.read().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return None
