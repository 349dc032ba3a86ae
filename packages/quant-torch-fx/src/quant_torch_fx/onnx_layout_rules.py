"""How ATen ops that move data or make tensors are written in ONNX: reshapes (the dynamic
batch as ``-1`` where one size is unknown, else ``Shape``/``Concat`` arithmetic), permutes,
squeezes, slicing with negative and open ends, select/index/gather, split/chunk/unbind,
concatenation and stacking, expand/repeat, roll, flip, pad (constant, reflect, replicate,
circular) and tensor creation. See :mod:`quant_torch_fx.onnx_rules` for the rule signature.

Example:
    >>> import torch
    >>> from quant_torch_fx.onnx_emit import emit_onnx
    >>> class Net(torch.nn.Module):
    ...     def forward(self, x):
    ...         return torch.roll(x, 1, 1)[:, -3:]
    >>> gm = torch.export.export(Net(), (torch.randn(2, 5),)).module()
    >>> [n.op_type for n in emit_onnx(gm, opset=17, input_names=["x"], output_names=None).graph.node]
    ['Slice', 'Slice', 'Concat', 'Slice']
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from onnx import helper, numpy_helper
from torch.fx import Node

from quant_torch_fx.onnx_context import RuleContext
from quant_torch_fx.onnx_rules import schema_name
from quant_torch_fx.onnx_types import onnx_type
from quant_torch_fx.onnx_values import Size

_INT64_MAX = 2**63 - 1


def _static(values: Sequence[Any]) -> bool:
    return all(isinstance(v, int) for v in values)


def _target_shape(ctx: RuleContext, sizes: Sequence[Any]) -> str:
    """A Reshape target: constant with ``-1`` for the one size known only at run time (the
    batch), else computed from the symbolic sizes."""
    values = [ctx.value(s) if isinstance(s, Node) else s if isinstance(s, Size) else int(s) for s in sizes]
    unknown = [i for i, v in enumerate(values) if not isinstance(v, int) or v == -1]
    if len(unknown) <= 1:
        return ctx.ints([v if isinstance(v, int) else -1 for v in values])
    return ctx.ints(list(sizes))


def reshape(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``view``/``reshape``/``_unsafe_view``/``unflatten``/``view_as``/``reshape_as``."""
    a = ctx.bind(node)
    x = a["self"]
    if "other" in a:  # view_as, reshape_as
        return ctx.add("Reshape", [ctx.tensor(x), ctx.add("Shape", [ctx.shape_source(a["other"])])])
    if "sizes" in a:  # unflatten
        current = ctx.sizes(x)
        dim = int(a["dim"]) % len(current)
        target = [*current[:dim], *a["sizes"], *current[dim + 1 :]]
        return ctx.add("Reshape", [ctx.tensor(x), _target_shape(ctx, target)])
    return ctx.add("Reshape", [ctx.tensor(x), _target_shape(ctx, list(a["size"] if "size" in a else a["shape"]))])


def flatten(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``flatten(x, start, end)``: Flatten for ``start=1`` to the last axis (its 2-D result),
    a Reshape otherwise."""
    a = ctx.bind(node)
    x = a["self"]
    rank = ctx.rank(x)
    if rank == 0:
        return ctx.add("Reshape", [ctx.tensor(x), ctx.ints([1])])
    start, end = int(a["start_dim"]) % rank, int(a["end_dim"]) % rank
    if start == 1 and end == rank - 1:
        return ctx.add("Flatten", [ctx.tensor(x)], axis=1)
    sizes = ctx.shape(x)
    merged = sizes[start : end + 1]
    middle: list[int | None] = [int(np.prod(merged))] if all(s is not None for s in merged) else [None]  # type: ignore[arg-type]
    target = [-1 if s is None else s for s in (*sizes[:start], *middle, *sizes[end + 1 :])]
    if target.count(-1) > 1:  # more than one unknown size: computed
        symbolic = ctx.sizes(x)
        return ctx.add("Reshape", [ctx.tensor(x), ctx.ints([*symbolic[:start], -1, *symbolic[end + 1 :]])])
    return ctx.add("Reshape", [ctx.tensor(x), ctx.ints(target)])


def permute(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``permute``/``transpose``/``t``/``movedim``: Transpose."""
    a = ctx.bind(node)
    x = a["self"]
    rank = ctx.rank(x)
    perm = list(range(rank))
    if "dims" in a:  # permute
        perm = [int(d) % rank for d in a["dims"]]
    elif "source" in a:  # movedim
        source, destination = int(a["source"]) % rank, int(a["destination"]) % rank
        perm.remove(source)
        perm.insert(destination, source)
    elif rank >= 2:  # transpose, t
        first, second = (int(a["dim0"]) % rank, int(a["dim1"]) % rank) if "dim0" in a else (0, 1)
        perm[first], perm[second] = perm[second], perm[first]
    return ctx.add("Transpose", [ctx.tensor(x)], perm=perm)


def squeeze(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``squeeze`` (all, one or several dims): only axes of size 1 go, as in torch."""
    a = ctx.bind(node)
    x = a["self"]
    shape = ctx.shape(x)
    dims = a.get("dim", list(range(len(shape))))
    dims = [dims] if isinstance(dims, int) else list(dims)
    axes = [int(d) % len(shape) for d in dims if shape[int(d) % len(shape)] == 1] if shape else []
    if not axes:
        return ctx.value(x)
    return ctx.add("Squeeze", [ctx.tensor(x), ctx.ints(axes, "axes")])


def unsqueeze(ctx: RuleContext, node: Node, op_type: str) -> Any:
    a = ctx.bind(node)
    return ctx.add("Unsqueeze", [ctx.tensor(a["self"]), ctx.ints([int(a["dim"]) % (ctx.rank(a["self"]) + 1)], "axes")])


def _slice(ctx: RuleContext, x: str, axis: int, start: Any, end: Any, step: int = 1) -> str:
    start = 0 if start is None else start
    end = _INT64_MAX if end is None else end
    if isinstance(end, int):
        end = min(end, _INT64_MAX)
    return ctx.add(
        "Slice",
        [x, ctx.ints([start], "starts"), ctx.ints([end], "ends"), ctx.ints([axis], "axes"), ctx.ints([step], "steps")],
    )


def slice_(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``slice(x, dim, start, end, step)`` with negative and open ends (ONNX clamps as torch),
    ``narrow(x, dim, start, length)``."""
    a = ctx.bind(node)
    x = a["self"]
    rank = ctx.rank(x)
    dim = int(a["dim"] or 0) % rank
    if "length" in a:  # narrow
        start, length = ctx.value(a["start"]), ctx.value(a["length"])
        if not (isinstance(start, int) and isinstance(length, int)):
            raise ctx.error("narrow with a dynamic start or length has no ONNX translation here")
        if start < 0:
            size = ctx.shape(x)[dim]
            if size is None:
                raise ctx.error("narrow from a negative start on a dynamic axis has no ONNX translation here")
            start += size
        return _slice(ctx, ctx.tensor(x), dim, start, start + length)
    start, end, step = a.get("start"), a.get("end"), int(a.get("step") or 1)
    if start in (None, 0) and (end is None or (isinstance(end, int) and end >= _INT64_MAX)) and step == 1:
        return ctx.value(x)
    return _slice(ctx, ctx.tensor(x), dim, start, end, step)


def select(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``select(x, dim, index)``: Gather of a scalar index (the axis goes; negative indices
    count from the end in both)."""
    a = ctx.bind(node)
    index = ctx.value(a["index"])
    if not isinstance(index, int):
        raise ctx.error("select with a dynamic index has no ONNX translation here")
    axis = int(a["dim"]) % ctx.rank(a["self"])
    return ctx.add("Gather", [ctx.tensor(a["self"]), ctx.const(np.int64(index), "index", torch.int64)], axis=axis)


def index_select(ctx: RuleContext, node: Node, op_type: str) -> Any:
    a = ctx.bind(node)
    axis = int(a["dim"]) % ctx.rank(a["self"])
    return ctx.add("Gather", [ctx.tensor(a["self"]), ctx.tensor(a["index"], torch.int64)], axis=axis)


def index(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``x[..., idx]`` (``index.Tensor`` with one integer index tensor, ``None`` before it):
    Gather on that axis. Boolean masks and several index tensors are refused."""
    a = ctx.bind(node)
    indices = list(a["indices"])
    used = [i for i, t in enumerate(indices) if t is not None]
    if len(used) != 1:
        raise ctx.error("indexing with several index tensors has no ONNX translation here; allowed: one")
    tensor = indices[used[0]]
    if ctx.dtype(tensor) == torch.bool:
        raise ctx.error("indexing with a boolean mask has no ONNX translation here (its size depends on the values)")
    return ctx.add("Gather", [ctx.tensor(a["self"]), ctx.tensor(tensor, torch.int64)], axis=used[0])


def gather(ctx: RuleContext, node: Node, op_type: str) -> Any:
    a = ctx.bind(node)
    axis = int(a["dim"]) % ctx.rank(a["self"])
    return ctx.add("GatherElements", [ctx.tensor(a["self"]), ctx.tensor(a["index"], torch.int64)], axis=axis)


def split(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``split``/``split_with_sizes``/``chunk``/``unbind``: Split with the sizes torch gives
    each piece (``unbind`` then squeezes the axis)."""
    a = ctx.bind(node)
    x = a["self"]
    dim = int(a["dim"]) % ctx.rank(x)
    pieces_meta = node.meta.get("val")
    unbind = "split_size" not in a and "split_sizes" not in a and "chunks" not in a
    if "split_sizes" in a:
        sizes = [int(s) for s in a["split_sizes"]]
    elif unbind and isinstance(pieces_meta, list | tuple):
        sizes = [1] * len(pieces_meta)
    elif isinstance(pieces_meta, list | tuple) and all(isinstance(m.shape[dim], int) for m in pieces_meta):
        sizes = [int(m.shape[dim]) for m in pieces_meta]  # torch's own division of the axis
    else:
        raise ctx.error("splitting a dynamic axis has no ONNX translation here")
    source = ctx.tensor(x)
    pieces = [source] if len(sizes) == 1 else ctx.add("Split", [source, ctx.ints(sizes, "split")], len(sizes), axis=dim)
    if unbind:
        axes = ctx.ints([dim], "axes")
        return [ctx.add("Squeeze", [p, axes]) for p in pieces]
    return list(pieces)


def concat(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``cat`` (torch's legacy empty 1-D operands skipped) and ``stack`` (Unsqueeze, Concat)."""
    a = ctx.bind(node)
    tensors = [t for t in a["tensors"] if not (ctx.rank(t) == 1 and ctx.shape(t)[0] == 0)]
    dtype = ctx.out_dtype()
    rank = ctx.rank(ctx.current)
    axis = int(a["dim"]) % rank
    parts = [ctx.tensor(t, dtype) for t in tensors]
    if ctx.rank(tensors[0]) < rank:  # stack
        axes = ctx.ints([axis], "axes")
        parts = [ctx.add("Unsqueeze", [p, axes]) for p in parts]
    return ctx.add("Concat", parts, axis=axis)


def expand(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``expand``/``expand_as``: Expand (torch's ``-1`` keeps a size: 1 broadcasts to it)."""
    a = ctx.bind(node)
    if "other" in a:
        return ctx.add("Expand", [ctx.tensor(a["self"]), ctx.add("Shape", [ctx.shape_source(a["other"])])])
    sizes = [1 if isinstance(s, int) and s == -1 else s for s in a["size"]]
    return ctx.add("Expand", [ctx.tensor(a["self"]), ctx.ints(sizes)])


def repeat(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``repeat``: Tile (leading axes added first where ``repeats`` is longer than the rank)."""
    a = ctx.bind(node)
    repeats = list(a["repeats"])
    source = ctx.tensor(a["self"])
    extra = len(repeats) - ctx.rank(a["self"])
    if extra > 0:
        source = ctx.add("Unsqueeze", [source, ctx.ints(list(range(extra)), "axes")])
    return ctx.add("Tile", [source, ctx.ints(repeats, "repeats")])


def roll(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``roll(x, shifts, dims)``: per axis, the last ``shift`` elements moved to the front
    (Slice, Slice, Concat)."""
    a = ctx.bind(node)
    x, shifts, dims = a["self"], list(a["shifts"]), list(a["dims"] or [])
    if not dims:
        raise ctx.error("roll without dims (over the flattened tensor) has no ONNX translation here")
    shape = ctx.shape(x)
    result = ctx.tensor(x)
    for shift, dim in zip(shifts, dims, strict=True):
        axis = int(dim) % len(shape)
        size = shape[axis]
        if size is None:
            raise ctx.error("roll along a dynamic axis has no ONNX translation here")
        cut = (-int(shift)) % size
        if cut:
            tail, head = _slice(ctx, result, axis, cut, _INT64_MAX), _slice(ctx, result, axis, 0, cut)
            result = ctx.add("Concat", [tail, head], axis=axis)
    return result


def flip(ctx: RuleContext, node: Node, op_type: str) -> Any:
    a = ctx.bind(node)
    axes = [int(d) % ctx.rank(a["self"]) for d in a["dims"]]
    n = len(axes)
    starts, ends, steps = ctx.ints([-1] * n, "starts"), ctx.ints([-_INT64_MAX] * n, "ends"), ctx.ints([-1] * n, "steps")
    return ctx.add("Slice", [ctx.tensor(a["self"]), starts, ends, ctx.ints(axes, "axes"), steps])


def pixel_unshuffle(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``pixel_unshuffle``: channel ``c * r * r + i * r + j`` takes pixel ``(i, j)`` of each
    ``r x r`` block (torch's order; SpaceToDepth puts the block offset first)."""
    a = ctx.bind(node)
    x, r = a["self"], int(a["downscale_factor"])
    _batch, channels, height, width = ctx.shape(x)
    if channels is None or height is None or width is None:
        raise ctx.error("pixel_unshuffle of dynamic sizes has no ONNX translation here")
    blocks = ctx.add("Reshape", [ctx.tensor(x), ctx.ints([0, channels, height // r, r, width // r, r])])
    moved = ctx.add("Transpose", [blocks], perm=[0, 1, 3, 5, 2, 4])
    return ctx.add("Reshape", [moved, ctx.ints([0, channels * r * r, height // r, width // r])])


_PAD_MODES = {"constant": "constant", "reflect": "reflect", "replicate": "edge", "circular": "wrap"}


def pad(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``pad``/``constant_pad_nd``/``reflection_pad*``/``replication_pad*``: torch lists
    ``(begin, end)`` pairs from the last axis backwards, ONNX all begins then all ends.
    Circular padding before opset 19 is written as Slice and Concat."""
    bound = ctx.bind(node)
    name = schema_name(node)
    x = bound["self"]
    widths = [int(p) for p in (bound.get("pad") or bound.get("padding") or [])]
    mode = bound.get("mode") or "constant"
    if name.startswith("reflection_pad"):
        mode = "reflect"
    elif name.startswith("replication_pad"):
        mode = "replicate"
    rank = ctx.rank(x)
    begins, ends = [0] * rank, [0] * rank
    for i in range(len(widths) // 2):
        begins[rank - 1 - i], ends[rank - 1 - i] = widths[2 * i], widths[2 * i + 1]
    if mode == "circular" and ctx.opset < 19:
        return _circular(ctx, ctx.tensor(x), begins, ends)
    inputs = [ctx.tensor(x), ctx.ints(begins + ends, "pads")]
    value = bound.get("value")
    if mode == "constant" and value not in (None, 0, 0.0):
        inputs.append(ctx.const(value, "value", ctx.dtype(x)))
    return ctx.add("Pad", inputs, mode=_PAD_MODES[mode])


def _circular(ctx: RuleContext, x: str, begins: list[int], ends: list[int]) -> str:
    for axis, (begin, end) in enumerate(zip(begins, ends, strict=True)):
        parts = []
        if begin:
            parts.append(_slice(ctx, x, axis, -begin, _INT64_MAX))
        parts.append(x)
        if end:
            parts.append(_slice(ctx, x, axis, 0, end))
        if len(parts) > 1:
            x = ctx.add("Concat", parts, axis=axis)
    return x


# --- tensor creation --------------------------------------------------------------------------------------
def _fill(ctx: RuleContext, sizes: Sequence[Any], value: Any) -> Any:
    dtype = ctx.out_dtype()
    static = [ctx.value(s) if isinstance(s, Node) else s for s in sizes]
    if _static(static):
        return ctx.const(np.full(static, value), "value", dtype)
    element = np.asarray([value], dtype=helper.tensor_dtype_to_np_dtype(onnx_type(dtype)))
    return ctx.add("ConstantOfShape", [ctx.ints(list(sizes))], value=numpy_helper.from_array(element))


def full(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``zeros``/``ones``/``full`` and their ``new_``/``_like`` forms: a constant when the
    size is static, ConstantOfShape otherwise."""
    bound = ctx.bind(node)
    name = schema_name(node)
    base = name.removeprefix("new_").removesuffix("_like")
    value = {"zeros": 0, "ones": 1}.get(base, bound.get("fill_value"))
    if name.endswith("_like"):
        return _fill(ctx, ctx.sizes(bound["self"]), value)
    return _fill(ctx, list(bound["size"]), value)


def arange(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``arange``: a constant for static bounds, Range otherwise."""
    bound = ctx.bind(node)
    start, end, step = bound.get("start", 0) or 0, bound["end"], bound.get("step", 1) or 1
    dtype = ctx.out_dtype()
    values = [ctx.value(v) if isinstance(v, Node) else v for v in (start, end, step)]
    if all(isinstance(v, int | float) for v in values):
        return ctx.const(np.arange(*values), "range", dtype)
    scalars = [
        ctx.add("Squeeze", [ctx.tensor(v, dtype)]) if isinstance(v, Node) else ctx.const(v, "bound", dtype)
        for v in (start, end, step)
    ]
    return ctx.add("Range", scalars)


def scalar_tensor(ctx: RuleContext, node: Node, op_type: str) -> Any:
    return ctx.const(ctx.bind(node)["s"], "value", ctx.out_dtype())


def meshgrid(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``meshgrid``: each 1-D input reshaped onto its own axis, then Expand to the grid
    (``indexing="xy"`` swaps the first two axes, as numpy does)."""
    a = ctx.bind(node)
    tensors = list(a["tensors"])
    sizes = [ctx.shape(t)[0] for t in tensors]
    axes = list(range(len(tensors)))
    if a.get("indexing", "ij") == "xy" and len(tensors) > 1:
        axes[0], axes[1] = 1, 0
    known: list[int | None] = [None] * len(tensors)
    for axis, size in zip(axes, sizes, strict=True):
        known[axis] = size
    grid = [s for s in known if isinstance(s, int)]
    if len(grid) != len(known):
        raise ctx.error("meshgrid of inputs whose length is only known at run time is not written")
    dtype = ctx.out_dtype()
    results = []
    for axis, tensor in zip(axes, tensors, strict=True):
        shape = [1] * len(tensors)
        shape[axis] = grid[axis]
        placed = ctx.add("Reshape", [ctx.tensor(tensor, dtype), ctx.ints(shape)])
        results.append(ctx.add("Expand", [placed, ctx.ints(grid)]))
    return results


def cumsum(ctx: RuleContext, node: Node, op_type: str) -> Any:
    """``cumsum``: CumSum over ``dim`` (a bool or narrower input cast to the output type first)."""
    a = ctx.bind(node)
    dtype = ctx.out_dtype()
    source = ctx.tensor(a["self"])
    if ctx.dtype(a["self"]) != dtype:
        source = ctx.add("Cast", [source], to=onnx_type(dtype))
    axis = ctx.const(np.array(int(a["dim"]), dtype=np.int64), "axis", torch.int64)
    return ctx.add("CumSum", [source, axis])
