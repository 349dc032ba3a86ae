"""Tensors that a layer-by-layer walk still needs, for every calibration batch, within a
memory budget: what both backends' runners keep between layers so that a whole walk over
a network costs about one forward pass instead of one per layer.

Arrays stay in memory up to the budget; the rest wait as ``.npy`` files in a private
temporary folder (read back whole, one batch at a time, and deleted when released), so a
walk's memory does not grow with the calibration count (EfficientNet-Lite0 at 256 samples
has about 5 GB of live activations). Values that are not arrays (a shape, a list of
tensors a later node splits) are small and stay in memory.

Example:
    >>> import numpy as np
    >>> store = LiveStore(1, budget=0)
    >>> store.put(0, "y", np.ones(2, np.float32)); store.get(0, "y").tolist(), store.spilled
    ([1.0, 1.0], 1)
    >>> store.close()
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import numpy as np

#: Live tensors a walk keeps in memory before it spills the rest to disk.
LIVE_MEMORY_BYTES = 256 << 20


class LiveStore:
    """The live values of ``num_batches`` batches, by name: arrays in memory up to
    ``budget`` bytes, the rest on disk; any other value in memory.

    Example:
        >>> store = LiveStore(2)
        >>> store.put(1, "n", 3); store.names(1), len(store)
        ({'n'}, 2)
    """

    def __init__(self, num_batches: int, budget: int = LIVE_MEMORY_BYTES) -> None:
        self.budget = budget
        self.in_memory = 0
        self._memory: list[dict[str, Any]] = [{} for _ in range(num_batches)]
        self._files: list[dict[str, str]] = [{} for _ in range(num_batches)]
        self._directory: tempfile.TemporaryDirectory[str] | None = None
        self._written = 0

    def __len__(self) -> int:
        return len(self._memory)

    @property
    def spilled(self) -> int:
        """Arrays held on disk now."""
        return sum(len(files) for files in self._files)

    def names(self, batch: int = 0) -> set[str]:
        """What batch ``batch`` holds (every batch holds the same names during a walk)."""
        return set(self._memory[batch]) | set(self._files[batch]) if self._memory else set()

    def put(self, batch: int, name: str, value: Any) -> None:
        self.drop_one(batch, name)
        if not isinstance(value, np.ndarray) or self.in_memory + value.nbytes <= self.budget:
            self._memory[batch][name] = value
            self.in_memory += value.nbytes if isinstance(value, np.ndarray) else 0
            return
        if self._directory is None:
            self._directory = tempfile.TemporaryDirectory(prefix="quant-live-")
        self._written += 1
        path = os.path.join(self._directory.name, f"{self._written}.npy")
        np.save(path, value, allow_pickle=False)
        self._files[batch][name] = path

    def get(self, batch: int, name: str) -> Any:
        if name in self._memory[batch]:
            return self._memory[batch][name]
        return np.load(self._files[batch][name], allow_pickle=False)

    def drop_one(self, batch: int, name: str) -> None:
        value = self._memory[batch].pop(name, None)
        if isinstance(value, np.ndarray):
            self.in_memory -= value.nbytes
        path = self._files[batch].pop(name, None)
        if path is not None:
            os.remove(path)

    def drop(self, name: str) -> None:
        for batch in range(len(self)):
            self.drop_one(batch, name)

    def close(self) -> None:
        """Forget every value and delete the files."""
        if self._directory is not None:
            self._directory.cleanup()
            self._directory = None
        self._memory = [{} for _ in self._memory]
        self._files = [{} for _ in self._files]
        self.in_memory = 0
