"""A hint for machines whose cores are shared: torch's OpenMP threads spin while they wait.

torch's CPU ops run their parallel regions on GNU OpenMP, whose idle threads spin for a
while before they sleep. When other processes keep the cores busy, the thread a region waits
for is often parked by the OS while its partner spins on the core it needs: calibrating
EfficientNet-Lite0 beside other work took 44-83 s per pass against 4.7-5.7 s with
``OMP_WAIT_POLICY=PASSIVE`` (float inference 15-17 s against 4.2 s; docs/benchmarks.md).
OpenMP reads the policy once, when torch loads it, so a library cannot change it for a
running process, and on a quiet machine the passive policy costs (calibration 1.4x, a small
model's 1.8x): the hint tells the user, only when the machine is busy, to start the process
with it. It is only a message; nothing computed depends on it.

Example:
    >>> spinning_hint(load=9.0, cores=2, threads=2, policy=None) is not None
    True
    >>> spinning_hint(load=9.0, cores=2, threads=2, policy="PASSIVE") is None
    True
"""

from __future__ import annotations

import os
import warnings

import torch

from quant_algos.shared_cores import machine_is_busy

_HINTED = False


def spinning_hint(load: float, cores: int, threads: int, policy: str | None) -> str | None:
    """The hint's text when the machine is busy (:func:`quant_algos.shared_cores.machine_is_busy`),
    torch runs more than one intra-op thread and no OpenMP wait policy was chosen; else ``None``."""
    if policy is not None or threads < 2 or not machine_is_busy(load, cores):
        return None
    return (
        f"the machine is busy (load average {load:.1f} on {cores} cores) and torch's OpenMP threads "
        "spin while they wait: calibration and inference can run several times slower than they need to. "
        "Start the process with OMP_WAIT_POLICY=PASSIVE (or call torch.set_num_threads(1)) "
        "on shared machines (docs/getting-started-torch.md)"
    )


def warn_if_openmp_spins() -> None:
    """Warn once per process with :func:`spinning_hint` for this machine, now."""
    global _HINTED
    if _HINTED or not hasattr(os, "getloadavg"):
        return
    _HINTED = True
    hint = spinning_hint(
        os.getloadavg()[0], os.cpu_count() or 1, torch.get_num_threads(), os.environ.get("OMP_WAIT_POLICY")
    )
    if hint is not None:
        warnings.warn(hint, UserWarning, stacklevel=3)
