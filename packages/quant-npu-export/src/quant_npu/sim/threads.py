"""numpy's BLAS threads while the simulator runs: one while the machine is busy.

The simulator's integer products are BLAS products of integers whose partial sums stay
exactly representable (:mod:`quant_npu.sim.linear`), so they are exact in any order of the
additions and the thread count changes no output. It changes the time. OpenBLAS's threads
wait for each other in every product, and beside other work the thread a product waits for
is often parked. Measured on 2 cores (``tools/bench/contention.py --paths npu_simulator``,
fmnist_mobilenetv2, issue 28 in docs/benchmarks.md), slowdown of the simulator / slowdown
of float inference under the same load:
- beside two CPU-bound Python processes: 1.68 on OpenBLAS's 2 threads, 0.60 on one;
- beside a torch process: 0.95 on 2 threads, 0.61 on one.

Quiet, two threads are faster (5.8x float inference against 10.7x on one). So the simulator
runs on one BLAS thread only while the machine is busy, by the one test both backends use
(:func:`quant_algos.shared_cores.machine_is_busy`).

Example:
    >>> with blas_threads(busy=False):
    ...     pass
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from quant_algos.shared_cores import machine_is_busy


def blas_threads(busy: bool | None = None) -> AbstractContextManager[Any]:
    """A context that holds numpy's BLAS to one thread while the machine is busy (``busy``:
    that decision given, ``None``: :func:`~quant_algos.shared_cores.machine_is_busy`)."""
    if not (machine_is_busy() if busy is None else busy):
        return nullcontext()
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=1, user_api="blas")
