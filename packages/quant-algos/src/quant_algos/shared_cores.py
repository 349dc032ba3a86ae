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

#: Weight of a new sample of the runnable threads in their running mean: one sample is
#: noisy (this process's own waiting thread is runnable or not at that instant), and a
#: decision that flips from one call to the next cost more than either steady choice
#: (fmnist_mobilenetv2 min-max calibration beside two busy processes: 2.4x float flipping,
#: 1.2-1.5x with either thread count held).
SAMPLE_WEIGHT = 0.2


class _LoadState:
    """The running mean of the runnable threads and the last decision (hysteresis)."""

    runnable: float | None = None
    busy: bool = False


_STATE = _LoadState()


def machine_is_busy(load: float | None = None, cores: int | None = None) -> bool:
    """Load above ``cores + 1`` (this process's own threads plus one more are normal).

    With ``load`` given, that test alone. Without, this machine's load now
    (:func:`current_load`), with hysteresis: once busy, it stays busy until the load falls
    to ``cores``, so a load hovering at the threshold does not flip the answer from one call
    to the next. ``False`` where the platform reports no load."""
    cores = cores or os.cpu_count() or 1
    if load is not None:
        return load > cores + 1
    measured = current_load()
    if measured is None:
        return False
    _STATE.busy = measured > (cores if _STATE.busy else cores + 1)
    return _STATE.busy


def current_load() -> float | None:
    """The larger of the one-minute load average and the running mean of the threads
    runnable at each call (:func:`runnable_now`, :data:`SAMPLE_WEIGHT`): the average lags a
    neighbour that has just started by about a minute. ``None`` where the platform reports
    neither."""
    average = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    now = runnable_now()
    if average is None and now is None:
        return None
    smoothed = 0.0
    if now is not None:
        previous = _STATE.runnable
        smoothed = float(now) if previous is None else previous + SAMPLE_WEIGHT * (now - previous)
        _STATE.runnable = smoothed
    return max(average or 0.0, smoothed)


def runnable_now() -> int | None:
    """Threads runnable on the machine at this instant, the caller included (Linux:
    ``/proc/loadavg``'s fourth field); ``None`` where it cannot be read."""
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            return int(f.read().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return None
