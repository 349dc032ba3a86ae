from __future__ import annotations

import pytest

import quant_algos.shared_cores as shared_cores
from quant_algos.shared_cores import current_load, machine_is_busy, runnable_now


@pytest.mark.parametrize(
    "average, now, busy",
    [
        (0.3, 2, False),  # quiet: this process's two threads
        (0.3, 6, True),  # a neighbour that started seconds ago: the average has not caught up
        (6.0, 1, True),  # a steady neighbour between its bursts
        (None, 6, True),  # no load average on the platform
        (0.3, None, False),  # no /proc/loadavg
    ],
)
def test_busy_follows_the_larger_of_the_average_and_the_threads_runnable_now(monkeypatch, average, now, busy):
    if average is None:
        monkeypatch.delattr(shared_cores.os, "getloadavg")
    else:
        monkeypatch.setattr(shared_cores.os, "getloadavg", lambda: (average, average, average))
    monkeypatch.setattr(shared_cores, "runnable_now", lambda: now)
    monkeypatch.setattr(shared_cores.os, "cpu_count", lambda: 2)
    assert machine_is_busy() is busy
    assert current_load() == max(average or 0.0, now or 0)


def test_no_load_reported_is_not_busy(monkeypatch):
    monkeypatch.delattr(shared_cores.os, "getloadavg")
    monkeypatch.setattr(shared_cores, "runnable_now", lambda: None)
    assert current_load() is None and not machine_is_busy()


def test_runnable_now_counts_at_least_the_caller_where_linux_reports_it():
    now = runnable_now()
    assert now is None or now >= 1
