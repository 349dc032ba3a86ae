"""quant_algos imports and runs everything but AdaRound/AdaQuant without torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from quant_algos.adaquant import adaquant_layer
from quant_algos.adaround import adaround_layer
from quant_core.qparams import QParams


def test_clear_error_when_torch_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` raise ImportError
    args = (np.ones((2, 3), np.float32), None, QParams.per_tensor(0.1, 0, "int8"), np.ones((4, 3), np.float32))
    with pytest.raises(ImportError, match=r"AdaRound needs PyTorch: pip install 'quant-algos\[torch\]'"):
        adaround_layer(*args)
    with pytest.raises(ImportError, match=r"AdaQuant needs PyTorch: pip install 'quant-algos\[torch\]'"):
        adaquant_layer(*args)


def test_package_works_without_torch():
    code = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None
        import numpy as np
        import quant_algos as qa
        from quant_core.algorithm_config import CLEConfig
        layers = {"a": qa.Layer(np.ones((2, 2))), "b": qa.Layer(np.ones((2, 2)))}
        qa.equalize_chains(layers, [("a", "b")], CLEConfig())
        assert "torch" not in {m.split(".")[0] for m in sys.modules if sys.modules[m] is not None}
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
