"""Every docstring example in quant_core runs and gives the output it shows."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import pkgutil

import pytest

import quant_core

HAS_ONNX = importlib.util.find_spec("onnx") is not None


def _module_names() -> list[str]:
    """Every module; the ONNX QDQ layer only where its extra (onnx) is installed."""
    names = ["quant_core"]
    for info in pkgutil.iter_modules(quant_core.__path__, prefix="quant_core."):
        if info.name == "quant_core.onnx_qdq" and not HAS_ONNX:
            continue
        names.append(info.name)
        if info.ispkg:
            package = importlib.import_module(info.name)
            names += [m.name for m in pkgutil.walk_packages(package.__path__, prefix=f"{info.name}.")]
    return sorted(names)


@pytest.mark.parametrize("name", _module_names())
def test_doctests(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} doctest(s) failed in {name}"
