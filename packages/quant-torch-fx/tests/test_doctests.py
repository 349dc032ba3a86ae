"""Every docstring example in quant_torch_fx runs and gives the output it shows."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import quant_torch_fx


def _module_names() -> list[str]:
    names = ["quant_torch_fx"]
    names += [m.name for m in pkgutil.walk_packages(quant_torch_fx.__path__, prefix="quant_torch_fx.")]
    return sorted(names)


@pytest.mark.parametrize("name", _module_names())
def test_doctests(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} doctest(s) failed in {name}"
