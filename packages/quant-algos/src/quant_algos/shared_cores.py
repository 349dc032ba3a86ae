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

import math
import os
import time

#: Weight of a new sample of the runnable threads in their running mean: one sample is
#: noisy (this process's own waiting thread is runnable or not at that instant), and a
#: decision that flips from one call to the next cost more than either steady choice
#: (fmnist_mobilenetv2 min-max calibration beside two busy processes: 2.4x float flipping,
#: 1.2-1.5x with either thread count held).
SAMPLE_WEIGHT = 0.2

#: Seconds between two samples of the load; a call within it returns the last decision.
#: Calibration asks once per observed tensor and batch, every 60-200 us on a small model,
#: and a sample costs two system calls: 9 us a call measured inside fmnist_mobilenetv2's
#: calibration (its caches cold after each convolution), 4% of the pass. A neighbour that
#: starts is still seen within a few milliseconds.
SAMPLE_INTERVAL_S = 0.001


class _LoadState:
    """The running mean of the runnable threads, the last decision (hysteresis) and the
    machine's core count (read once: ``os.cpu_count`` costs microseconds per call, and
    calibration asks once per observed tensor per batch)."""

    runnable: float | None = None
    busy: bool = False
    cores: int | None = None
    sampled_at: float = -math.inf


_STATE = _LoadState()


def machine_is_busy(load: float | None = None, cores: int | None = None) -> bool:
    """Load above ``cores + 1`` (this process's own threads plus one more are normal).

    With ``load`` given, that test alone. Without, this machine's load now
    (:func:`current_load`), with hysteresis: once busy, it stays busy until the load falls
    to ``cores``, so a load hovering at the threshold does not flip the answer from one call
    to the next; sampled at most once per :data:`SAMPLE_INTERVAL_S`, the calls between
    returning the last decision. ``False`` where the platform reports no load."""
    if not cores:
        if _STATE.cores is None:
            _STATE.cores = os.cpu_count() or 1
        cores = _STATE.cores
    if load is not None:
        return load > cores + 1
    now = time.monotonic()
    if now - _STATE.sampled_at < SAMPLE_INTERVAL_S:
        return _STATE.busy
    _STATE.sampled_at = now
    measured = current_load()
    if measured is None:
        _STATE.busy = False
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


_LOADAVG = "/proc/loadavg"
_loadavg_fd: int | None = None


def runnable_now() -> int | None:
    """Threads runnable on the machine at this instant, the caller included (Linux:
    ``/proc/loadavg``'s fourth field); ``None`` where it cannot be read.

    The file stays open and is read from its start each time (``os.pread``: the kernel
    writes it afresh for every read at offset 0): 1 us a call where opening it each time
    took 10-12, once per observed tensor per batch."""
    global _loadavg_fd
    try:
        if _loadavg_fd is None:
            _loadavg_fd = os.open(_LOADAVG, os.O_RDONLY)
        return int(os.pread(_loadavg_fd, 256, 0).split()[3].split(b"/")[0])
    except (OSError, IndexError, ValueError, AttributeError):  # AttributeError: no os.pread
        return None
