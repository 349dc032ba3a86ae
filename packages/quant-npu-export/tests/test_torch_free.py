"""The ONNX-only install stays torch-free: importing quant_npu (and its CLI) never imports
torch or the torch backend; only quant_npu.vitis (the [torch] extra) does."""

from __future__ import annotations

import subprocess
import sys


def test_importing_quant_npu_does_not_import_torch() -> None:
    code = (
        "import sys, quant_npu, quant_npu.cli; "
        "bad = sorted(m for m in ('torch', 'quant_torch_fx', 'quant_npu.vitis') if m in sys.modules); "
        "sys.exit(f'imported: {bad}' if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
