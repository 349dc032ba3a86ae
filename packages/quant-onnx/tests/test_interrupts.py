"""Ctrl-C at random points of a run (calibration, writing the model, writing the report):
exit 130 with one line, no partial file, an older output kept as it was, the input model
untouched. SIGINT is sent by the process to itself at the k-th call of a function (k
drawn at random within a real run's call count) and, for a few runs, by this test after
a random delay once calibration has started. AdaRound is interrupted the same way in
tests-integration/test_interrupt_adaround.py (it needs torch)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from cli_helpers import RUNNER, TESTS, calls_counted, run_cli, screen_lines, snapshot
from model_builders import random_inputs, small_cnn

INTERRUPTED = ["quant-onnx: interrupted; no partial file was left"]
REFERENCE = Path(__file__).resolve().parents[3] / "tools" / "models" / "fmnist_resnet18.onnx"


@pytest.fixture
def workdir(tmp_path) -> dict[str, Path]:
    model, data = tmp_path / "float.onnx", tmp_path / "calib.npy"
    onnx.save(small_cnn(), model)
    np.save(data, random_inputs(small_cnn(), 48))
    return {"dir": tmp_path, "model": model, "data": data, "out": tmp_path / "q.onnx", "report": tmp_path / "r.json"}


def _argv(w: dict[str, Path]) -> list[str]:
    return ["quantize", str(w["model"]), str(w["out"]), "--calib-data", str(w["data"]), "--batch-size", "4",
            "--report", str(w["report"])]  # fmt: skip


def _whole(path: Path) -> bool:
    """A complete output: a model onnx can load and check, or a report that parses."""
    if path.suffix == ".onnx":
        onnx.checker.check_model(onnx.load(str(path)))
    else:
        assert "weights" in json.loads(path.read_text())
    return True


def _assert_interrupted(
    result: subprocess.CompletedProcess, before: dict[str, str], folder: Path, outputs: list[Path], label: str
) -> None:
    """Exit 130 and one line (under the bars of phases that had finished); the same files
    as before (no temp file left), the input untouched, and each output either as it was
    or a whole new file."""
    assert result.returncode == 130, (label, result.returncode, result.stderr[-2000:])
    lines = screen_lines(result.stderr)
    assert lines[-1:] == INTERRUPTED, (label, result.stderr[-2000:])
    assert all("100%|" in line for line in lines[:-1]), (label, lines)  # only finished bars above it
    after = snapshot(folder)
    outputs_named = {str(p.relative_to(folder)) for p in outputs}
    assert set(before) <= set(after), (label, sorted(set(before) - set(after)))
    # The only new files allowed are outputs renamed into place before the signal came
    # (Ctrl-C while the summary was printed): whole files, checked below.
    assert set(after) - set(before) <= outputs_named, (label, sorted(set(after) - set(before)))
    for name, digest in after.items():
        if name not in outputs_named:
            assert before[name] == digest, (label, name)  # the input model and the data
        elif before.get(name) != digest:
            assert _whole(folder / name), (label, name)


def test_sigint_at_random_points_leaves_no_partial_file(workdir, record_count) -> None:
    rng = random.Random(20261123)
    targets = {
        "calibration": "onnxruntime:InferenceSession.run",
        "temp file creation": "tempfile:mkstemp",
        "writing": "os:fsync",
        "renaming into place": "os:replace",
    }
    outputs = [workdir["out"], workdir["report"]]

    def older_outputs() -> dict[str, str]:
        workdir["out"].write_bytes(b"an older output that must survive or be replaced whole")
        workdir["report"].write_text("{}")
        return snapshot(workdir["dir"])

    runs = 0
    for label, target in targets.items():
        counted = run_cli(*_argv(workdir), "--quiet", target=target, k=0)
        assert counted.returncode == 0, counted.stderr
        calls = calls_counted(counted)
        assert calls >= 1, label
        for k in sorted({1, calls, *rng.sample(range(1, calls + 1), min(2, calls))}):
            before = older_outputs()
            result = run_cli(*_argv(workdir), target=target, k=k)
            _assert_interrupted(result, before, workdir["dir"], outputs, f"{label}, call {k} of {calls}")
            runs += 1
    record_count(
        f"{runs} runs interrupted by SIGINT at random calls (calibration, temp file, write, rename): "
        "0 partial files, input untouched"
    )


def test_sigint_after_the_outputs_are_in_place(workdir) -> None:
    """Ctrl-C while the summary is printed: both outputs were renamed into place already, so
    they stay, whole; the run still ends with 130 and the one line."""
    before = snapshot(workdir["dir"])
    result = run_cli(*_argv(workdir), target="quant_onnx.cli.summary:quantize_summary", k=1)
    _assert_interrupted(result, before, workdir["dir"], [workdir["out"], workdir["report"]], "summary")
    assert workdir["out"].is_file() and workdir["report"].is_file()


def test_sigint_after_a_random_delay(tmp_path, record_count) -> None:
    model = REFERENCE if REFERENCE.is_file() else None
    if model is None:
        pytest.skip("tools/models/fmnist_resnet18.onnx not found")
    data = tmp_path / "calib.npy"
    np.save(data, np.random.default_rng(0).normal(size=(2048, 1, 32, 32)).astype(np.float32))
    out = tmp_path / "q.onnx"
    before = snapshot(tmp_path)
    rng = random.Random(7)
    outcomes = {"interrupted": 0, "finished": 0}
    argv = ["quantize", str(model), str(out), "--calib-data", str(data), "--batch-size", "8"]
    # The first run signals soon after the bar is drawn (not while tqdm draws it), so at
    # least one lands in calibration on any machine.
    for delay in [0.05, *(rng.uniform(0.0, 1.5) for _ in range(3))]:
        process = subprocess.Popen(
            [sys.executable, str(RUNNER), "-", "0", *argv],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])},
        )
        seen = b""
        assert process.stderr is not None
        while b"calibrating" not in seen:  # the bar is drawn when calibration starts
            chunk = process.stderr.read1(4096)
            if not chunk:
                break
            seen += chunk
        time.sleep(delay)
        process.send_signal(signal.SIGINT)
        rest = process.stderr.read()
        code = process.wait(timeout=120)
        stderr = (seen + rest).decode()
        if code in (0, -signal.SIGINT):
            # Finished before the signal, or the signal came while the interpreter shut down
            # (Python's handler is gone by then): the output is whole and valid.
            onnx.checker.check_model(onnx.load(str(out)))
            out.unlink()
            outcomes["finished"] += 1
        else:
            result = subprocess.CompletedProcess(process.args, code, "", stderr)
            _assert_interrupted(result, before, tmp_path, [out], "delayed SIGINT")
            out.unlink(missing_ok=True)  # whole if there: the signal came after its rename
            outcomes["interrupted"] += 1
        assert snapshot(tmp_path) == before
    record_count(f"4 runs sent SIGINT 0-1.5 s into calibration: {outcomes['interrupted']} interrupted cleanly, "
                 f"{outcomes['finished']} had finished with a whole output")  # fmt: skip
    assert outcomes["interrupted"] >= 1
