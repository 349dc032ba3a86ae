"""Placeholders for torchvision names timm imports but the zoo never uses."""

from __future__ import annotations

import functools
from typing import Any, NoReturn


def _refuse(name: str) -> NoReturn:
    raise NotImplementedError(
        f"torchvision.{name}: not available in the zoo's torchvision shim (tools/zoo_shims); "
        "it provides only what timm needs to import and build models"
    )


@functools.cache  # the same object on every import, as a real module's names are
def placeholder(module: str, name: str) -> Any:
    """A class named ``name`` that can be imported and subclassed but refuses to be built,
    or a function that refuses to run (lower-case names)."""
    qualified = f"{module}.{name}"
    if name[:1].isupper():

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            _refuse(qualified)

        return type(name, (), {"__init__": __init__, "__module__": f"torchvision.{module}"})

    def function(*args: Any, **kwargs: Any) -> NoReturn:
        _refuse(qualified)

    function.__name__ = name
    return function


def module_getattr(module: str):  # -> Callable[[str], Any]
    """A module ``__getattr__`` that hands out placeholders for public names."""

    def __getattr__(name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return placeholder(module, name)

    return __getattr__
