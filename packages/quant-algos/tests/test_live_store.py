"""The live-value store of the layer-wise walks: the memory budget holds, spilled arrays
come back equal, released values leave no file, non-arrays never touch the disk."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from quant_algos.drivers.live_store import LiveStore


def test_budget_spills_the_rest_and_reads_it_back_equal() -> None:
    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=(4, 8)).astype(np.float32) for _ in range(3)]
    store = LiveStore(3, budget=arrays[0].nbytes)
    for i, a in enumerate(arrays):
        store.put(i, "x", a)
    assert store.in_memory == arrays[0].nbytes and store.spilled == 2
    for i, a in enumerate(arrays):
        np.testing.assert_array_equal(store.get(i, "x"), a)
    folder = Path(store._directory.name)
    store.drop("x")
    assert store.spilled == 0 and store.in_memory == 0 and list(folder.iterdir()) == []
    store.close()
    assert not folder.exists()


def test_replacing_a_value_frees_its_budget_and_non_arrays_stay_in_memory() -> None:
    store = LiveStore(1, budget=64)
    store.put(0, "a", np.zeros(16, np.float32))
    store.put(0, "a", np.zeros(8, np.float32))
    assert store.in_memory == 32
    store.put(0, "shape", (3, 224, 224))
    store.put(0, "big", np.zeros(1000, np.float32))
    assert store.spilled == 1 and store.get(0, "shape") == (3, 224, 224) and store.names() == {"a", "shape", "big"}
    store.close()
    assert store.names() == set() and store.in_memory == 0
