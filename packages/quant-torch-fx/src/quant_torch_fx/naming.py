"""How a node of a captured graph is named for configs and reports: the module path it was
called in (``nn_module_stack``), which is what a config's ``exclude`` and
``name_overrides`` globs match. The graph passes that replace nodes keep these names, so
a QAT plan names a layer as its PTQ plan does.
"""

from __future__ import annotations

from collections.abc import Collection

from torch.fx import Node


def plan_name(node: Node) -> str:
    """The name a config's globs match: module path for a module call, else
    ``"<innermost module path>/<fx name>"`` (the FX name at top level).

    Example:
        >>> import torch
        >>> from torch.fx import Graph
        >>> g = Graph(); x = g.placeholder("x")
        >>> y = g.call_function(torch.relu, (x,)); y.meta["nn_module_stack"] = {"k": ("block.act", "ReLU")}
        >>> plan_name(y)
        'block.act/relu'
    """
    if "plan_name" in node.meta:  # a module call standing for a captured op keeps the op's name
        return str(node.meta["plan_name"])
    if node.op == "call_module":
        return str(node.target)
    path = module_paths(node)
    return f"{path[-1]}/{node.name}" if path else node.name


def module_paths(node: Node) -> list[str]:
    """Module paths the node was called in, outermost first (from ``nn_module_stack``;
    torch's placeholder entries for nodes it created itself are skipped)."""
    stack = node.meta.get("nn_module_stack") or {}
    return [path for path, _type in stack.values() if path and not path.startswith("_empty_nn_module_stack")]


def module_type_names(node: Node) -> list[str]:
    """Qualified type names of the modules the node was called in."""
    stack = node.meta.get("nn_module_stack") or {}
    names = []
    for _path, kind in stack.values():
        names.append(kind if isinstance(kind, str) else f"{kind.__module__}.{kind.__qualname__}")
    return names


def unique_name(base: str, taken: Collection[str]) -> str:
    """``base``, or ``base_1``, ``base_2``... : the first not in ``taken``.

    Example:
        >>> unique_name("conv", {"conv", "conv_1"})
        'conv_2'
    """
    name, index = base, 1
    while name in taken:
        name, index = f"{base}_{index}", index + 1
    return name
