"""Benchmark of quant_core's HistogramObserver.

1. Update throughput: ``HistogramObserver.update`` on 10M-element float32 arrays against
   ``numpy.histogram(x, bins=B, range=(lo, hi))`` on the same arrays in the same run
   (numpy is handed the range; the observer computes min/max, checks finiteness and
   grows its grid inside ``update``). Best of ``--repeat`` runs each.
2. Memory: feeding 1,000 batches of 100k elements (with a growing range, so the grid
   rebins) must keep memory flat: tracemalloc's live and peak traced memory and the
   process's peak RSS after 10 and after all batches, and the observer's state size.

Run from the repository root: ``python tools/bench/observers.py`` (``--quick`` for a
smoke run). quant_core is imported from packages/quant-core/src when not installed.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
for path in (REPO_ROOT / "packages" / "quant-core" / "src", REPO_ROOT):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from quant_core.observer_config import Percentile  # noqa: E402
from quant_core.observers import HistogramObserver  # noqa: E402
from quant_core.observers.grid import work_dtype  # noqa: E402
from quant_core.spec import QuantSpec  # noqa: E402
from tools.bench.common import markdown_table  # noqa: E402


def arrays(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Activation- and weight-like float32 arrays of ``n`` elements."""
    rng = np.random.default_rng(seed)
    normal = rng.standard_normal(n, dtype=np.float32)
    relu = np.maximum(normal * 3.0, 0.0)
    relu[:: n // 10] = 80.0  # a few large activations
    return {
        "normal(0, 1)": normal,
        "uniform(-1, 1)": rng.uniform(-1.0, 1.0, n).astype(np.float32),
        "relu(3 * normal) + outliers": relu,
        "lognormal(0, 2) (heavy tail)": rng.lognormal(0.0, 2.0, n).astype(np.float32),
        "normal * 1e4 (width > 1)": normal * np.float32(1e4),
    }


def best_time(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def throughput(n: int, bins: int, repeat: int) -> list[list[object]]:
    spec = QuantSpec(dtype="int8", observer=Percentile(bins=bins))
    rows: list[list[object]] = []
    for name, x in arrays(n).items():
        lo, hi = float(x.min()), float(x.max())
        t_numpy = best_time(lambda x=x, lo=lo, hi=hi: np.histogram(x, bins=bins, range=(lo, hi)), repeat)
        t_obs = best_time(lambda x=x: HistogramObserver(spec).update(x), repeat)
        obs = HistogramObserver(spec)
        obs.update(x)
        assert int(obs.counts.sum()) == x.size
        assert obs.grid is not None
        path = work_dtype(x.dtype, obs.grid).__name__
        path += " + underflow fix" if obs.grid.exponent > 0 else ""
        rows.append(
            [
                name,
                path,
                f"{t_numpy * 1e3:.1f}",
                f"{t_obs * 1e3:.1f}",
                f"{x.size / t_obs / 1e9:.2f}",
                f"{t_numpy / t_obs:.2f}x",
            ]
        )
    return rows


def peak_rss_mib() -> float:
    # ru_maxrss is KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def memory(batches: int, batch_size: int, bins: int) -> list[list[object]]:
    spec = QuantSpec(dtype="int8", observer=Percentile(bins=bins))
    rng = np.random.default_rng(1)
    obs = HistogramObserver(spec)
    rows: list[list[object]] = []
    checkpoints = {10, min(100, batches), batches}
    tracemalloc.start()
    for i in range(1, batches + 1):
        # The range keeps growing slowly, so the grid doubles and rebins along the way.
        x = rng.standard_normal(batch_size, dtype=np.float32) * np.float32(1.0 + i / 50.0)
        obs.update(x)
        del x
        if i in checkpoints:
            current, peak = tracemalloc.get_traced_memory()
            state = obs.state_dict()
            state_bytes = sum(v.nbytes for v in state.values() if isinstance(v, np.ndarray))
            rows.append(
                [
                    i,
                    f"{i * batch_size / 1e6:.0f}M",
                    f"{current / 1024:.1f}",
                    f"{peak / 1024:.1f}",
                    f"{peak_rss_mib():.1f}",
                    state_bytes,
                ]
            )
    tracemalloc.stop()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=10_000_000, help="elements per throughput array")
    parser.add_argument("--bins", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--batches", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=100_000)
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.repeat, args.batches, args.batch_size = 200_000, 2, 20, 10_000

    from quant_core.observers import native

    native.native_counter()  # decide (and build) before timing; QUANT_CORE_NATIVE=0 for numpy's passes
    print(f"numpy {np.__version__}, Python {sys.version.split()[0]}, {args.bins} bins; {native.status()}\n")
    print(f"Update throughput, {args.size / 1e6:g}M float32 elements per array (best of {args.repeat}):\n")
    headers = ["array", "binning", "numpy.histogram ms", "observer.update ms", "observer Gelem/s", "speed-up"]
    print(markdown_table(headers, throughput(args.size, args.bins, args.repeat)))
    print(f"\nMemory while feeding {args.batches} batches of {args.batch_size} float32 elements:\n")
    headers = ["batches", "elements", "traced now KiB", "traced peak KiB", "peak RSS MiB", "state bytes"]
    print(markdown_table(headers, memory(args.batches, args.batch_size, args.bins)))


if __name__ == "__main__":
    main()
