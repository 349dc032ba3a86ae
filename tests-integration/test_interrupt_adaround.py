"""Ctrl-C during AdaRound (needs torch, hence here): ``quant-onnx quantize --adaround``
sends itself SIGINT at a random optimiser step; it must exit 130 with one line, leave no
partial file and keep an older output and the input model as they were."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "quant-onnx" / "tests"))

from cli_helpers import calls_counted, run_cli, screen_lines, snapshot
from model_builders import random_inputs, small_cnn


def test_sigint_during_adaround_leaves_no_partial_file(tmp_path) -> None:
    model, data, out = tmp_path / "float.onnx", tmp_path / "calib.npy", tmp_path / "q.onnx"
    onnx.save(small_cnn(), model)
    np.save(data, random_inputs(small_cnn(), 16))
    argv = ["quantize", str(model), str(out), "--calib-data", str(data), "--preset", "xint8", "--adaround",
            "--iterations", "10", "--batch-size", "8"]  # fmt: skip
    counted = run_cli(*argv, "--quiet", target="torch.optim:Adam.step", k=0, timeout=300)
    assert counted.returncode == 0, counted.stderr
    steps = calls_counted(counted)
    assert steps >= 10
    out.write_bytes(b"an older output")
    before = snapshot(tmp_path)
    chosen = sorted({1, steps, random.Random(3).randint(2, steps - 1)})
    for k in chosen:
        result = run_cli(*argv, target="torch.optim:Adam.step", k=k, timeout=300)
        assert result.returncode == 130, (k, result.stderr[-2000:])
        lines = screen_lines(result.stderr)
        # Bars are erased as the interrupt unwinds (quant_algos.progress); the last line is the CLI's.
        assert lines[-1:] == ["quant-onnx: interrupted; no partial file was left"], (k, lines)
        assert "Traceback" not in result.stderr, k
        assert snapshot(tmp_path) == before, k
    print(f"{len(chosen)} runs interrupted at AdaRound steps {chosen} of {steps}: 0 partial files, input untouched")
