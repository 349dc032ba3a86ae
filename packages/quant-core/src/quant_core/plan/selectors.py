"""Every node selector of a config must select something: an ``exclude`` entry or a
``name_overrides`` glob that matches no node is almost always a typo, and silently
quantizing what the user meant to keep float (or configure apart) costs accuracy that
nothing reports. Both backends check here, on the graph they plan.

An ``exclude`` entry that names an op type the planner quantizes (``"Softmax"``) may be
absent from a model: a config reused across models excludes it wherever it occurs.

Example:
    >>> from quant_core.presets import get_preset
    >>> nodes = [("conv1", "Conv"), ("relu1", "Relu")]
    >>> unmatched_selectors(get_preset("a8w8").evolve(exclude=("conv*", "Softmax", "con1")), nodes)
    ["exclude: 'con1' matches no node name or op type of the model"]
    >>> check_selectors(get_preset("a8w8").evolve(exclude=("con1",)), nodes)
    Traceback (most recent call last):
    ...
    quant_core.errors.ConfigError: exclude: 'con1' matches no node name or op type of the model; allowed: node-name globs or op types, such as conv1, relu1
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

from quant_core.config import QuantConfig
from quant_core.errors import ConfigError
from quant_core.plan.ops import POLICIES

_SHOWN = 8


def unmatched_selectors(config: QuantConfig, nodes: Iterable[tuple[str, str]]) -> list[str]:
    """One message per ``exclude`` entry and ``name_overrides`` glob of ``config`` that
    selects none of ``nodes`` (``(name, op_type)`` pairs)."""
    pairs = list(nodes)
    names = [name for name, _op in pairs]
    op_types = {op for _name, op in pairs}
    messages = [
        f"exclude: {pattern!r} matches no node name or op type of the model"
        for pattern in config.exclude
        if pattern not in op_types
        and pattern not in POLICIES
        and not any(fnmatch.fnmatchcase(name, pattern) for name in names)
    ]
    messages += [
        f"name_overrides: {pattern!r} matches no node name of the model"
        for pattern in config.name_overrides
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names)
    ]
    return messages


def check_selectors(config: QuantConfig, nodes: Iterable[tuple[str, str]]) -> None:
    """Raise ``ConfigError`` naming the first selector of ``config`` that selects none of
    ``nodes`` (``(name, op_type)`` pairs), with some node names to choose from."""
    pairs = list(nodes)
    messages = unmatched_selectors(config, pairs)
    if messages:
        names = [name for name, _op in pairs]
        shown = ", ".join(names[:_SHOWN]) + (", ..." if len(names) > _SHOWN else "")
        allowed = "node-name globs or op types" if messages[0].startswith("exclude") else "node-name globs"
        raise ConfigError(f"{messages[0]}; allowed: {allowed}, such as {shown}")
