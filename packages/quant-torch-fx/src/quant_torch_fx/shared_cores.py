"""Machines whose cores are shared: observers reduce on one thread while the machine is
busy, and a hint says how to stop torch's OpenMP threads spinning while they wait.

torch's CPU ops run their parallel regions on GNU OpenMP, whose idle threads spin for a
while before they sleep. When other processes keep the cores busy, the thread a region waits
for is often parked by the OS while its partner spins on the core it needs: calibrating
EfficientNet-Lite0 beside other work took 44-83 s per pass against 4.7-5.7 s with
``OMP_WAIT_POLICY=PASSIVE`` (float inference 15-17 s against 4.2 s; docs/benchmarks.md).
OpenMP reads the policy once, when torch loads it, so a library cannot change it for a
running process, and on a quiet machine the passive policy costs (calibration 1.4x, a small
model's 1.8x): the hint tells the user, only when the machine is busy, to start the process
with it. It is only a message; nothing computed depends on it.

What the library can change without the variable is how many threads its own reductions
use. An observer's reduction (min and max, histogram counts) is exact whatever the thread
count, so :func:`observer_threads` runs it on one thread while the machine is busy: no
parallel region, nothing to wait for. The model's float forward keeps torch's setting, since
its sums may round differently on another thread count. Measured beside other work
(EfficientNet-Lite0, 2 batches of 16, ``xint8``): calibration 41 s with the observers on two
threads, 11.5 s on one (float inference 6.2 s); docs/benchmarks.md.

Example:
    >>> spinning_hint(load=9.0, cores=2, threads=2, policy=None) is not None
    True
    >>> spinning_hint(load=9.0, cores=2, threads=2, policy="PASSIVE") is None
    True
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

from quant_algos.shared_cores import current_load, machine_is_busy

_HINTED = False

#: Observers' reductions on one thread: ``None`` decides per reduction from the load
#: (:func:`quant_algos.shared_cores.machine_is_busy`); ``True``/``False`` force it.
SERIAL_OBSERVERS: bool | None = None


def observer_threads() -> AbstractContextManager[None]:
    """A context that runs its block on one intra-op thread while the machine is busy (or
    as :data:`SERIAL_OBSERVERS` forces), on torch's setting otherwise; the setting is
    restored after. Only for exact reductions: their values do not depend on the thread
    count. Entered once per observed tensor and batch, so the quiet case costs one shared
    no-op context.

    Example:
        >>> import quant_torch_fx.shared_cores as shared_cores
        >>> shared_cores.SERIAL_OBSERVERS = True
        >>> with observer_threads():
        ...     torch.get_num_threads()
        1
        >>> shared_cores.SERIAL_OBSERVERS = None
    """
    threads = torch.get_num_threads()
    if threads < 2 or not (machine_is_busy() if SERIAL_OBSERVERS is None else SERIAL_OBSERVERS):
        return _UNCHANGED
    return _one_thread(threads)


_UNCHANGED = nullcontext()


@contextmanager
def _one_thread(restore: int) -> Iterator[None]:
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(restore)


def spinning_hint(load: float, cores: int, threads: int, policy: str | None) -> str | None:
    """The hint's text when the machine is busy (:func:`quant_algos.shared_cores.machine_is_busy`),
    torch runs more than one intra-op thread and no OpenMP wait policy was chosen; else ``None``."""
    if policy is not None or threads < 2 or not machine_is_busy(load, cores):
        return None
    return (
        f"the machine is busy (load {load:.1f} on {cores} cores) and torch's OpenMP threads "
        "spin while they wait: calibration, QAT training and inference can run several times slower than they need to. "
        "Start the process with OMP_WAIT_POLICY=PASSIVE (or call torch.set_num_threads(1)) "
        "on shared machines (docs/getting-started-torch.md)"
    )


def warn_if_openmp_spins() -> None:
    """Warn once per process with :func:`spinning_hint` for this machine, now."""
    global _HINTED
    if _HINTED:
        return
    _HINTED = True
    load = current_load()
    if load is None:
        return
    hint = spinning_hint(load, os.cpu_count() or 1, torch.get_num_threads(), os.environ.get("OMP_WAIT_POLICY"))
    if hint is not None:
        warnings.warn(hint, UserWarning, stacklevel=3)
