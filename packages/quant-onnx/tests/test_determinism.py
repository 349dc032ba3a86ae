"""Same model, data and config give bit-identical files: the quantized model and its
report, across repeated runs and across 1 vs 2 onnxruntime threads and OpenMP/BLAS
threads. Each run is a fresh interpreter (thread settings are read at start-up)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from model_builders import small_cnn

MODELS = Path(__file__).resolve().parents[3] / "tools" / "models"
# Runs quantize with onnxruntime sessions limited to THREADS intra-op threads.
RUN = """
import sys
import quant_onnx
from quant_onnx import ort_session
model, data, preset, threads, algorithms = sys.argv[1:6]
plain = ort_session.session_options
sessions = []
def limited(level):
    sessions.append(level)
    options = plain(level)
    options.intra_op_num_threads = int(threads)
    options.inter_op_num_threads = 1
    return options
ort_session.session_options = limited
config = quant_onnx.resolve_config(preset)
if algorithms == "cle+bc":
    import attrs
    from quant_core.algorithm_config import BiasCorrectionConfig, CLEConfig
    config = attrs.evolve(config, algorithms=(CLEConfig(), BiasCorrectionConfig()))
quant_onnx.quantize(model, "q.onnx", config, data, report_path="r.json", quiet=True)
print(f"sessions: {len(sessions)}")
"""
CASES = {
    "resnet18 a8w8": ("fmnist_resnet18.onnx", "a8w8", "-"),
    "resnet18 xint8 (power-of-two MSE)": ("fmnist_resnet18.onnx", "xint8", "-"),
    "mobilenetv2 percentile": ("fmnist_mobilenetv2.onnx", "a8w8_percentile", "-"),
    "mobilenetv2 xint8 + CLE + bias correction": ("fmnist_mobilenetv2.onnx", "xint8", "cle+bc"),
    # GPTQ's report lists each layer's reconstruction; it once carried each layer's seconds.
    "resnet18 a16w8 (GPTQ)": ("fmnist_resnet18.onnx", "a16w8", "-"),
}


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _run(folder: Path, model: Path, data: Path, preset: str, threads: int, algorithms: str) -> tuple[str, str]:
    folder.mkdir()
    env = {**os.environ, **{k: str(threads) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}}
    result = subprocess.run(
        [sys.executable, "-c", RUN, str(model), str(data), preset, str(threads), algorithms],
        cwd=folder,
        env={**env, "PYTHONPATH": os.pathsep.join(sys.path)},
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert int(result.stdout.split("sessions: ")[1]) >= 1  # the thread limit reached onnxruntime
    return _digest(folder / "q.onnx"), _digest(folder / "r.json")


@pytest.mark.parametrize("case", list(CASES))
def test_runs_are_bit_identical_across_repeats_and_thread_counts(case, tmp_path, record_count) -> None:
    name, preset, algorithms = CASES[case]
    model = MODELS / name
    if not model.is_file():
        pytest.skip(f"{model} not found")
    data = tmp_path / "calib.npy"
    np.save(data, np.random.default_rng(0).normal(size=(64, 1, 32, 32)).astype(np.float32))
    runs = {
        "1 thread": _run(tmp_path / "a", model, data, preset, 1, algorithms),
        "1 thread again": _run(tmp_path / "b", model, data, preset, 1, algorithms),
        "2 threads": _run(tmp_path / "c", model, data, preset, 2, algorithms),
    }
    assert len(set(runs.values())) == 1, runs
    record_count(f"3 runs (1, 1, 2 threads) gave one model hash {runs['1 thread'][0][:12]} and one report hash")


def test_in_process_runs_are_identical(tmp_path) -> None:
    """Two quantizations in one process (warm caches, reused sessions) write the same bytes."""
    import quant_onnx

    data = np.random.default_rng(1).normal(size=(16, 3, 16, 16)).astype(np.float32)
    model = tmp_path / "m.onnx"
    onnx.save(small_cnn(), model)
    digests = set()
    for i in range(2):
        out = tmp_path / f"q{i}.onnx"
        quant_onnx.quantize(model, out, "xint8", data, quiet=True)
        digests.add(_digest(out))
    assert len(digests) == 1
