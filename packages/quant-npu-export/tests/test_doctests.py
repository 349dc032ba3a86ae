"""Every docstring example in quant_npu runs and gives the output it shows."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import quant_npu


def _module_names() -> list[str]:
    names = ["quant_npu"]
    names += [m.name for m in pkgutil.walk_packages(quant_npu.__path__, prefix="quant_npu.")]
    return sorted(names)


@pytest.mark.parametrize("name", _module_names())
def test_doctests(name: str) -> None:
    if name.startswith("quant_npu.vitis"):
        pytest.importorskip("torch", reason="quant_npu.vitis needs the [torch] extra")
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} doctest(s) failed in {name}"
