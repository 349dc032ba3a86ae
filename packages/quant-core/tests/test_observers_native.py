"""The native histogram count (quant_core.observers.native): the numpy path's counts bit
for bit, the exact range in the same pass, a refusal of values outside the grid, and a
build that falls back to numpy instead of failing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import counting_path
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from quant_core.observer_config import MSE, PowerOfTwoMSE
from quant_core.observers import HistogramGrid, HistogramObserver, native
from quant_core.observers.binning import bin_counts, numpy_bin_counts
from quant_core.spec import QuantSpec


@pytest.fixture(scope="module")
def counter() -> Iterator[native.NativeCounter]:
    with counting_path("native"):
        loaded = native.native_counter()
        assert loaded is not None
        yield loaded


finite32 = st.floats(allow_nan=False, allow_infinity=False, width=32)
# Runs of zeros and of -0.0 (a ReLU's output), values near bin edges, subnormals, huge ones.
values32 = st.one_of(
    st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5, 1e-45, -1e-45, 3e38]),
    st.floats(-8.0, 8.0, width=32),
    finite32,
)
values64 = st.one_of(st.sampled_from([0.0, -0.0, 1e-310, -1e-310]), st.floats(-1e30, 1e30), st.floats(-1e-300, 1e-300))
arrays = st.one_of(
    hnp.arrays(np.float32, st.integers(1, 3000), elements=values32),
    hnp.arrays(np.float64, st.integers(1, 3000), elements=values64),
)


@given(x=arrays, bins=st.sampled_from([2, 7, 64, 2048]), finest=st.integers(-149, 40))
@settings(max_examples=300)
def test_counts_equal_the_numpy_path_on_every_grid(
    counter: native.NativeCounter, x: np.ndarray, bins: int, finest: int
) -> None:
    """Any grid that holds the values (exponents from subnormal widths to widths above 1,
    where a tiny negative value underflows to -0.0 and belongs below 0): the same counts."""
    grid = HistogramGrid.covering(float(x.min()), float(x.max()), bins, min_exponent=finest)
    counts, lo, hi = counter.count(x, grid)
    assert counts is not None
    np.testing.assert_array_equal(counts, numpy_bin_counts(x, grid))
    assert (lo, hi) == (float(x.min()), float(x.max()))
    np.testing.assert_array_equal(bin_counts(x, grid), counts)


@given(x=arrays, shift=st.integers(1, 5))
@settings(max_examples=100)
def test_a_grid_that_misses_a_value_gives_no_counts_but_the_range(
    counter: native.NativeCounter, x: np.ndarray, shift: int
) -> None:
    grid = HistogramGrid.covering(float(x.min()), float(x.max()), 16)
    above = HistogramGrid(exponent=grid.exponent, offset=grid.offset + shift, bins=16)
    below = HistogramGrid(exponent=grid.exponent, offset=grid.offset - shift, bins=16)
    for other in (above, below):
        misses = not other.contains(float(x.min()), float(x.max()))
        counts, lo, hi = counter.count(x, other)
        assert (counts is None) == misses
        assert (lo, hi) == (float(x.min()), float(x.max()))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_extremes_anywhere_in_a_block_and_in_its_tail(counter: native.NativeCounter, dtype: type) -> None:
    """Lengths around the vector width, the 16 values the four accumulators take per step
    and the 2,048-value block, with the minimum, the maximum or a NaN at the first, a middle
    and the last position, and at positions that reach every accumulator's every lane."""
    grid = HistogramGrid(exponent=0, offset=-4, bins=16)
    for n in (1, 2, 3, 5, 7, 15, 16, 17, 33, 2047, 2048, 2049, 2051, 4099):
        for at in sorted({0, n // 2, n - 1, *range(1, min(n, 40), 3)}):
            x = np.zeros(n, dtype)
            x[at], x[(at + 1) % n] = 5.0, -3.0 if n > 1 else 5.0
            counts, lo, hi = counter.count(x, grid)
            assert (lo, hi) == (float(x.min()), float(x.max())), (n, at)
            assert counts is not None and counts.tolist() == numpy_bin_counts(x, grid).tolist()
            x[at] = np.nan
            counts, lo, hi = counter.count(x, grid)
            assert counts is None and np.isnan(lo) and np.isnan(hi), (n, at)


def test_non_finite_values_and_the_range_alone(counter: native.NativeCounter) -> None:
    grid = HistogramGrid(exponent=0, offset=-4, bins=8)
    counts, lo, hi = counter.count(np.float32([0.0, np.nan, 1.0]), grid)
    assert counts is None and np.isnan(lo) and np.isnan(hi)
    counts, lo, hi = counter.count(np.float64([-np.inf, 1.0]), grid)
    assert counts is None and (lo, hi) == (-np.inf, 1.0)
    counts, lo, hi = counter.count(np.float32([2.0, -3.0]), None)
    assert counts is None and (lo, hi) == (-3.0, 2.0)
    with pytest.raises(ValueError, match="contiguous"):
        counter.count(np.zeros((2, 2), np.float32), grid)
    for bins, offset in ((1 << 30, 1 << 24), (-(1 << 32) + 16, 0), (0, 0)):  # a bins that would wrap in int32
        with pytest.raises(ValueError, match="needs 1 <= bins"):
            counter.count(np.zeros(2, np.float32), HistogramGrid(exponent=0, offset=offset, bins=bins))
    for dtype in (np.float32, np.float64):  # no values: nothing to count, no range
        counts, lo, hi = counter.count(np.zeros(0, dtype), grid)
        assert counts is not None and not counts.any() and np.isnan(lo) and np.isnan(hi)
        counts, lo, hi = counter.count(np.zeros(0, dtype), None)
        assert counts is None and np.isnan(lo) and np.isnan(hi)


def test_counts_past_the_copies_limit_stay_exact(counter: native.NativeCounter) -> None:
    """Millions of values in one bin (the zeros after a ReLU): the 16-bit copies of the
    counts are added into the totals before any could overflow."""
    x = np.zeros(3_000_001, np.float32)
    x[::3] = 1.5
    grid = HistogramGrid(exponent=0, offset=0, bins=4)
    counts, _, _ = counter.count(x, grid)
    assert counts is not None and counts.tolist() == [2_000_000, 1_000_001, 0, 0]


SPECS = [
    QuantSpec(dtype="int8", observer=MSE(bins=256)),
    QuantSpec(dtype="int8", scale_type="power_of_two", observer=PowerOfTwoMSE(bins=2048)),
]


def _observed(spec: QuantSpec, batches: list[np.ndarray], path: str) -> HistogramObserver:
    with counting_path(path):
        obs = HistogramObserver(spec)
        for batch in batches:
            obs.update(batch)
    return obs


@pytest.mark.parametrize("spec", SPECS)
def test_an_observer_holds_the_same_state_either_way(spec: QuantSpec) -> None:
    """The one-pass update (counts on the current grid, kept when the batch falls inside it)
    against numpy's range-then-count: same grid, counts, range and qparams, through grid
    growth, batches inside the grid, a batch of -0.0 and one of float64."""
    rng = np.random.default_rng(3)
    batches = [np.maximum(rng.standard_normal(20_000), 0).astype(np.float32) * s for s in (1.0, 0.5, 3.0, 0.1)]
    batches += [np.full(100, -0.0, np.float32), (rng.standard_normal(5000) * 2).astype(np.float64)]
    batches += [rng.standard_normal((4, 3, 17)).astype(np.float32)[:, ::2]]  # not contiguous
    fast, reference = _observed(spec, batches, "native"), _observed(spec, batches, "numpy")
    assert fast.grid == reference.grid
    np.testing.assert_array_equal(fast.counts, reference.counts)
    assert (fast.min_val, fast.max_val) == (reference.min_val, reference.max_val)
    assert fast.qparams() == reference.qparams()


def test_a_refused_batch_changes_nothing_on_the_native_path() -> None:
    with counting_path("native"):
        obs = HistogramObserver(SPECS[0])
        obs.update(np.float32([0.0, 1.0]))
        before = obs.state_dict()
        for bad, message in ((np.nan, "NaN"), (np.inf, "infinite")):
            with pytest.raises(ValueError, match=message):
                obs.update(np.float32([0.5, bad]))
        after = obs.state_dict()
        assert np.array_equal(before["counts"], after["counts"]) and before["min_val"] == after["min_val"]


# ------------------------------------------------------------------------- building and loading
@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """An empty cache, nothing decided yet; the decision is forgotten afterwards."""
    monkeypatch.setenv(native.CACHE_DIR, str(tmp_path))
    monkeypatch.delenv(native.SWITCH, raising=False)
    native.reset()
    yield tmp_path
    native.reset()


def test_the_library_is_built_once_into_the_cache_and_reused(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if native.native_counter() is None:
        pytest.skip(native.status())
    built = sorted((fresh / "native").iterdir())
    assert [p.suffix for p in built] == [".so"] and not built[0].name.startswith(".")  # no partial file left
    assert str(built[0]) in native.status()
    native.reset()

    def no_compiling(*args: object, **kwargs: object) -> None:
        raise AssertionError("compiled again although the library was in the cache")

    monkeypatch.setattr(subprocess, "run", no_compiling)
    assert native.native_counter() is not None and str(built[0]) in native.status()


@pytest.mark.parametrize("compiler", ["true", "gcc -E", "gcc -c"])
def test_a_compiler_that_writes_no_library_leaves_nothing_in_the_cache(
    fresh: Path, monkeypatch: pytest.MonkeyPatch, compiler: str
) -> None:
    """It exits with 0 but its output does not load: numpy counts, and nothing sits under
    the library's name for later processes to load."""
    if compiler != "true" and shutil.which("gcc") is None:
        pytest.skip("no gcc")
    monkeypatch.setenv("CC", compiler)
    assert native.native_counter() is None and "native build failed" in native.status()
    assert list((fresh / "native").iterdir()) == []


def test_a_damaged_library_in_the_cache_is_built_again(fresh: Path) -> None:
    if native.native_counter() is None:
        pytest.skip(native.status())
    (library,) = (fresh / "native").iterdir()
    assert library.stat().st_mode & 0o755 == 0o755  # other users of a shared cache can load it
    # Damaged by replacing the file: writing into it in place would truncate the pages this
    # process has mapped, and it would die of SIGBUS when the library's finalizers run at exit.
    damaged = library.with_name(".damaged")
    damaged.write_bytes(b"not a library")
    os.replace(damaged, library)
    native.reset()
    assert native.native_counter() is not None and library.stat().st_size > 100


def test_a_command_that_does_not_parse_or_no_home_falls_back(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", 'gcc "')  # unbalanced quote: the next candidate is tried
    assert native.native_counter() is not None or "no C compiler" in native.status()
    native.reset()
    monkeypatch.delenv(native.CACHE_DIR)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(native.Path, "home", staticmethod(no_home))
    assert native.native_counter() is None and "home directory" in native.status()
    obs = HistogramObserver(SPECS[0])
    obs.update(np.float32([0.0, 1.0]))  # numpy counts
    assert int(obs.counts.sum()) == 2


def test_switched_off_or_without_a_working_compiler_numpy_counts(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.SWITCH, "0")
    assert native.native_counter() is None and f"{native.SWITCH}=0" in native.status()
    monkeypatch.delenv(native.SWITCH)
    native.reset()
    monkeypatch.setenv("CC", "false")  # exists on PATH, exits with 1
    assert native.native_counter() is None
    assert "native build failed" in native.status() and "false exited with 1" in native.status()
    assert not any(p.name.startswith(".counting-") for p in (fresh / "native").iterdir())  # temp file removed
    native.reset()
    monkeypatch.setenv("CC", "no-such-compiler-here")
    monkeypatch.setattr(sysconfig, "get_config_var", lambda name: None)
    monkeypatch.setenv("PATH", os.devnull)
    assert native.native_counter() is None and "no C compiler" in native.status()
    x = np.float32([0.0, 0.25, 0.75])
    grid = HistogramGrid(exponent=-1, offset=0, bins=2)
    assert bin_counts(x, grid).tolist() == [2, 1]  # numpy's passes
