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
    """One-minute load average above ``cores + 1`` (this process's own threads plus one
    more are normal): ``load`` and ``cores`` default to this machine's, now; ``False``
    where the platform has no load average."""
    if load is None:
        if not hasattr(os, "getloadavg"):
            return False
        load = os.getloadavg()[0]
    cores = cores or os.cpu_count() or 1
    return load > cores + 1
