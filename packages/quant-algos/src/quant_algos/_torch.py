"""Lazy PyTorch import: only AdaRound and AdaQuant need it (the ``[torch]`` extra)."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from collections.abc import Iterator
from types import ModuleType

from quant_core.errors import ConfigError


def require_torch(feature: str, extra: str = "quant-algos[torch]") -> ModuleType:
    """``torch``, or an ImportError that names the extra to install."""
    try:
        return importlib.import_module("torch")
    except ImportError as exc:
        raise ImportError(f"{feature} needs PyTorch: pip install '{extra}'") from exc


def check_torch(feature: str, extra: str = "quant-algos[torch]") -> None:
    """The same ImportError as :func:`require_torch` when torch is missing, checked without
    importing it (a backend calls this before any work)."""
    if importlib.util.find_spec("torch") is None:
        raise ImportError(f"{feature} needs PyTorch: pip install '{extra}'")


def torch_device(torch: ModuleType, device: str) -> object:
    # A config error like any other field's: the CLI reports a RuntimeError as onnxruntime's.
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device: {device!r} was requested but CUDA is not available; allowed here: cpu")
    return torch.device(device)


@contextlib.contextmanager
def torch_threads(torch: ModuleType, num_threads: int | None) -> Iterator[None]:
    """Run with ``num_threads`` intra-op threads (None: leave torch's setting).

    A reconstruction step works on tensors of a few MB; with more than one thread the
    synchronisation costs more than the work (measured: 10x the CPU time with 2
    threads on a busy 2-core machine), so the loops default to 1.
    """
    if num_threads is None:
        yield
        return
    if not isinstance(num_threads, int) or num_threads < 1:
        raise ConfigError(f"num_threads: {num_threads!r} is not allowed; allowed: None or an integer >= 1")
    old = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(old)
