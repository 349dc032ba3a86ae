from __future__ import annotations

import pytest

import quant_algos.shared_cores as shared_cores
from quant_algos.shared_cores import current_load, machine_is_busy, runnable_now


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    """Each test starts with no running mean and no earlier decision, and every call
    samples (the interval between samples has its own test)."""
    monkeypatch.setattr(shared_cores, "_STATE", shared_cores._LoadState())
    monkeypatch.setattr(shared_cores, "SAMPLE_INTERVAL_S", 0.0)
    monkeypatch.setattr(shared_cores.os, "cpu_count", lambda: 2)


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
    assert machine_is_busy() is busy
    assert current_load() == max(average or 0.0, now or 0)  # a constant sample: its mean


def test_no_load_reported_is_not_busy(monkeypatch):
    monkeypatch.delattr(shared_cores.os, "getloadavg")
    monkeypatch.setattr(shared_cores, "runnable_now", lambda: None)
    assert current_load() is None and not machine_is_busy()


def test_runnable_now_counts_at_least_the_caller_where_linux_reports_it():
    now = runnable_now()
    assert now is None or now >= 1


def _samples(monkeypatch, values):
    monkeypatch.setattr(shared_cores.os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    feed = iter(values)
    monkeypatch.setattr(shared_cores, "runnable_now", lambda: next(feed))


def test_a_sample_hovering_at_the_threshold_does_not_flip_the_answer(monkeypatch):
    """This process's waiting thread is runnable at one instant and not at the next: on 2
    cores beside two busy processes the samples alternate 3 and 4. Flipping between one and
    two threads per call was slower than either."""
    _samples(monkeypatch, [3, 4] * 20)
    answers = [machine_is_busy() for _ in range(40)]
    first_busy = answers.index(True)
    assert first_busy <= 3 and all(answers[first_busy:])


def test_busy_ends_once_the_load_falls_to_the_cores(monkeypatch):
    _samples(monkeypatch, [6] * 5 + [3] * 30 + [1] * 30)
    answers = [machine_is_busy() for _ in range(65)]
    assert all(answers[:35])  # 3 is not above 2 + 1, but the machine was busy: it stays so
    assert not answers[-1]  # back at one runnable thread: quiet again


def test_calls_within_the_sample_interval_return_the_last_decision(monkeypatch):
    """Calibration asks once per observed tensor: the load is read at most once per
    interval, and the next sample after it sees a neighbour that started meanwhile."""
    clock = iter([0.0, 0.0004, 0.0008, 0.0011, 0.0012])
    monkeypatch.setattr(shared_cores.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(shared_cores, "SAMPLE_INTERVAL_S", 0.001)
    _samples(monkeypatch, [1, 20])  # a third sample would exhaust the feed and fail
    assert [machine_is_busy() for _ in range(5)] == [False, False, False, True, True]
