from __future__ import annotations

import pytest

import quant_torch_fx.shared_cores as shared_cores
from quant_torch_fx.shared_cores import spinning_hint


@pytest.mark.parametrize(
    "load, cores, threads, policy, hinted",
    [
        (9.0, 2, 2, None, True),  # busy, spinning threads: the case measured
        (3.0, 2, 2, None, False),  # our own two threads plus one other: not busy enough to tell
        (9.0, 2, 1, None, False),  # one intra-op thread: no region to wait in
        (9.0, 2, 2, "PASSIVE", False),  # the user chose a policy
        (9.0, 2, 2, "ACTIVE", False),
        (20.0, 16, 16, None, True),
    ],
)
def test_the_hint_fires_only_on_a_busy_machine_with_spinning_threads(load, cores, threads, policy, hinted):
    hint = spinning_hint(load, cores, threads, policy)
    assert (hint is not None) is hinted
    if hinted:
        assert "OMP_WAIT_POLICY=PASSIVE" in hint and f"on {cores} cores" in hint


def test_the_warning_comes_once_per_process(monkeypatch):
    monkeypatch.setattr(shared_cores, "_HINTED", False)
    monkeypatch.setattr(shared_cores.os, "getloadavg", lambda: (50.0, 50.0, 50.0))
    monkeypatch.setattr(shared_cores.torch, "get_num_threads", lambda: 2)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with pytest.warns(UserWarning, match="OMP_WAIT_POLICY=PASSIVE"):
        shared_cores.warn_if_openmp_spins()
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shared_cores.warn_if_openmp_spins()
    assert not caught
