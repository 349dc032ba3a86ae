"""Inline the ``torch.autocast(..., enabled=False)`` regions ``torch.export`` wraps.

``torch.export`` records a ``with torch.autocast(device, enabled=False):`` block (timm's
EfficientViT runs its attention in one) as a ``wrap_with_autocast`` call on a submodule.
A disabled autocast computes exactly what the plain graph does, so the body is copied
into the caller and the planner reads one flat ATen graph. An enabled region would
change the dtype the body computes in; it is refused by name.

Example:
    >>> import torch
    >>> class Net(torch.nn.Module):
    ...     def forward(self, x):
    ...         with torch.autocast("cpu", enabled=False):
    ...             return x.float() * 2
    >>> gm = torch.export.export(Net(), (torch.ones(2),), strict=False).module()
    >>> inline_disabled_autocast(gm)
    1
    >>> gm(torch.ones(2)).tolist()
    [2.0, 2.0]
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import GraphModule, Node

from quant_core.errors import CaptureError


def _autocast_op() -> Any:
    return getattr(torch.ops.higher_order, "wrap_with_autocast", None)


def inline_disabled_autocast(gm: GraphModule) -> int:
    """Copy the body of every disabled autocast region of ``gm`` into its graph (in
    place; nested regions too). Returns how many regions were inlined."""
    op = _autocast_op()
    if op is None:
        return 0
    inlined = 0
    while True:
        calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is op]
        if not calls:
            break
        for call in calls:
            _inline(gm, call)
            inlined += 1
    if inlined:
        gm.graph.lint()
        gm.recompile()
    return inlined


def _inline(gm: GraphModule, call: Node) -> None:
    device, dtype, enabled, _cache, body_node, *args = call.args
    if enabled:
        raise CaptureError(
            f"node {call.name!r}: an enabled torch.autocast({device!r}, {dtype}) region is not supported "
            "(it computes in another dtype); run the model in float32 or leave the region out with regions=[...]"
        )
    assert isinstance(body_node, Node) and isinstance(body_node.target, str)
    body = getattr(gm, body_node.target)
    env: dict[Node, Any] = {}
    feeds = iter(args)
    results: Any = ()
    with gm.graph.inserting_before(call):
        for inner in body.graph.nodes:
            if inner.op == "placeholder":
                env[inner] = next(feeds)
            elif inner.op == "output":
                results = inner.args[0]
            elif inner.op == "get_attr":
                name = f"{body_node.target}_{inner.target}".replace(".", "_")
                setattr(gm, name, operator.attrgetter(str(inner.target))(body))
                env[inner] = gm.graph.get_attr(name)
                env[inner].meta = dict(inner.meta)
            else:
                env[inner] = gm.graph.node_copy(inner, lambda n: env[n])
    outputs = results if isinstance(results, tuple | list) else (results,)
    for user in list(call.users):
        if user.op == "call_function" and user.target is operator.getitem:
            index = user.args[1]
            assert isinstance(index, int)  # getitem of a region's results tuple
            result = env.get(outputs[index], outputs[index])
            assert isinstance(result, Node)
            user.replace_all_uses_with(result)
            gm.graph.erase_node(user)
    if call.users:
        raise CaptureError(f"node {call.name!r}: an autocast region's result is used whole; expected item reads")
    gm.graph.erase_node(call)
    if not body_node.users:
        gm.graph.erase_node(body_node)
        delattr(gm, body_node.target)
