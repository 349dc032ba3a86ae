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
    monkeypatch.setattr(shared_cores, "current_load", lambda: 50.0)
    monkeypatch.setattr(shared_cores.torch, "get_num_threads", lambda: 2)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with pytest.warns(UserWarning, match="OMP_WAIT_POLICY=PASSIVE"):
        shared_cores.warn_if_openmp_spins()
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shared_cores.warn_if_openmp_spins()
    assert not caught


@pytest.fixture
def two_threads():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("busy", [False, True])
def test_observers_reduce_on_one_thread_only_while_the_machine_is_busy(monkeypatch, two_threads, busy):
    import numpy as np
    import torch

    import quant_torch_fx.observe as observe_module
    from quant_core.observer_config import Percentile
    from quant_core.observers import make_observer, native
    from quant_core.spec import QuantSpec

    seen_threads = []
    counts = observe_module.histogram_counts

    def recording(x, grid):
        seen_threads.append(torch.get_num_threads())
        return counts(x, grid)

    monkeypatch.setattr(observe_module, "histogram_counts", recording)
    x = torch.randn(1 << 17, generator=torch.Generator().manual_seed(0))  # above the parallel threshold
    spec = QuantSpec(dtype="int8", observer=Percentile(99.9, bins=512))
    monkeypatch.setattr(shared_cores, "machine_is_busy", lambda: busy)
    with native.switched(False):  # torch's counting (the native count runs on one thread anyway)
        observed = make_observer(spec)
        observe_module.observe(observed, x)
        monkeypatch.setattr(shared_cores, "SERIAL_OBSERVERS", not busy)  # the other way, forced
        other = make_observer(spec)
        observe_module.observe(other, x)

    assert seen_threads == ([1, 2] if busy else [2, 1])
    assert torch.get_num_threads() == 2
    np.testing.assert_array_equal(observed.counts, other.counts)  # the thread count changes no count
    assert observed.qparams() == other.qparams()


def test_the_thread_count_is_restored_when_an_observer_refuses_its_batch(monkeypatch, two_threads):
    import torch

    from quant_core.errors import DataError
    from quant_core.observers import make_observer
    from quant_core.spec import QuantSpec
    from quant_torch_fx.observe import observe

    monkeypatch.setattr(shared_cores, "SERIAL_OBSERVERS", True)
    with pytest.raises(DataError):
        observe(make_observer(QuantSpec(dtype="int8")), torch.tensor([0.0, float("nan")]))
    assert torch.get_num_threads() == 2


def test_qat_training_warns_on_a_busy_machine_with_spinning_threads(monkeypatch):
    """Beside another torch process a QAT step with spinning OpenMP threads took 6.5x its
    passive-policy time (EfficientNet-Lite0): train_qat says so, as calibration does."""
    import torch

    from quant_torch_fx.training import train_qat

    monkeypatch.setattr(shared_cores, "_HINTED", False)
    monkeypatch.setattr(shared_cores, "current_load", lambda: 50.0)
    monkeypatch.setattr(shared_cores.torch, "get_num_threads", lambda: 2)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    model = torch.nn.Linear(3, 2)
    data = [(torch.randn(4, 3), torch.tensor([0, 1, 0, 1]))]
    with pytest.warns(UserWarning, match="QAT training") as caught:
        train_qat(model, data, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), quiet=True)
    assert caught[0].filename == __file__  # at the caller's line
