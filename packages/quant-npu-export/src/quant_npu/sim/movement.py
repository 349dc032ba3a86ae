"""Ops that move integer codes without arithmetic (ONNX semantics): Reshape, Flatten,
Transpose, Squeeze, Unsqueeze, Identity, Slice, Pad, DepthToSpace, SpaceToDepth, nearest
Resize; and the index arithmetic of every Resize (:func:`resize_axes`). Their shape
arguments come from constants or from shape computations evaluated on the host.

Example:
    >>> x = np.arange(6, dtype=np.int8).reshape(1, 2, 3)
    >>> reshape(x, {}, [np.array([0, -1])]).shape
    (1, 6)
    >>> slice_(x, {}, [np.array([1]), np.array([3]), np.array([2])]).tolist()
    [[[1, 2], [4, 5]]]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from quant_core.errors import ModelError

Params = Sequence[np.ndarray | None]
Attributes = Mapping[str, Any]
MoveFunction = Callable[[np.ndarray, Attributes, Params], np.ndarray]


def _param(params: Params, index: int) -> np.ndarray | None:
    return params[index] if len(params) > index else None


def _axes(attributes: Attributes, params: Params, index: int) -> list[int] | None:
    value = _param(params, index)
    if value is not None:
        return [int(a) for a in np.asarray(value).reshape(-1)]
    axes = attributes.get("axes")
    return None if axes is None else [int(a) for a in axes]


def reshape(x: np.ndarray, attributes: Attributes, params: Params) -> np.ndarray:
    shape = [int(d) for d in np.asarray(_param(params, 0)).reshape(-1)]
    if not attributes.get("allowzero", 0):
        shape = [x.shape[i] if d == 0 else d for i, d in enumerate(shape)]
    return x.reshape(shape)


def flatten(x: np.ndarray, attributes: Attributes, params: Params) -> np.ndarray:
    axis = int(attributes.get("axis", 1)) % (x.ndim or 1)
    return x.reshape(int(np.prod(x.shape[:axis], dtype=np.int64)), -1)


def transpose(x: np.ndarray, attributes: Attributes, params: Params) -> np.ndarray:
    perm = attributes.get("perm")
    return np.transpose(x, None if perm is None else [int(p) for p in perm])


def squeeze(x: np.ndarray, attributes: Attributes, params: Params) -> np.ndarray:
    axes = _axes(attributes, params, 0)
    return np.squeeze(x) if axes is None else np.squeeze(x, axis=tuple(a % x.ndim for a in axes))


def unsqueeze(x: np.ndarray, attributes: Attributes, params: Params) -> np.ndarray:
    axes = _axes(attributes, params, 0) or []
    rank = x.ndim + len(axes)
    return np.expand_dims(x, axis=tuple(sorted(a % rank for a in axes)))


def identity(x: np.ndarray, attributes: Attributes, params: Params) -> np.ndarray:
    return x


def slice_(x: np.ndarray, attributes: Attributes, params: Params) -> np.ndarray:
    starts: Any = _param(params, 0)
    ends: Any
    if starts is None:  # opset < 10: attributes
        starts, ends = attributes["starts"], attributes["ends"]
        axes_value, steps = attributes.get("axes"), None
    else:
        ends, axes_value, steps = _param(params, 1), _param(params, 2), _param(params, 3)
    starts_l = [int(v) for v in np.asarray(starts).reshape(-1)]
    ends_l = [int(v) for v in np.asarray(ends).reshape(-1)]
    axes = list(range(len(starts_l))) if axes_value is None else [int(a) for a in np.asarray(axes_value).reshape(-1)]
    steps_l = [1] * len(starts_l) if steps is None else [int(s) for s in np.asarray(steps).reshape(-1)]
    index: list[slice] = [slice(None)] * x.ndim
    for start, end, axis, step in zip(starts_l, ends_l, axes, steps_l, strict=True):
        size = x.shape[axis % x.ndim]
        # ONNX clamps starts/ends like Python slicing does, INT64 extremes included
        start = max(min(start, size), -size - 1)
        end = max(min(end, size), -size - 1)
        index[axis % x.ndim] = slice(start, None if step < 0 and end < -size else end, step)
    return x[tuple(index)]


def pad(x: np.ndarray, attributes: Attributes, params: Params, fill: int = 0) -> np.ndarray:
    pads_value = _param(params, 0)
    pads = [int(p) for p in (np.asarray(pads_value).reshape(-1) if pads_value is not None else attributes["pads"])]
    axes = _axes({}, params, 2) or list(range(x.ndim))
    widths = [(0, 0)] * x.ndim
    half = len(pads) // 2
    for i, axis in enumerate(axes):
        widths[axis % x.ndim] = (pads[i], pads[i + half])
    if any(b < 0 or e < 0 for b, e in widths):
        raise ModelError("Pad: negative pads are not simulated; allowed: pads >= 0")
    mode = attributes.get("mode", b"constant")
    mode = mode.decode() if isinstance(mode, bytes) else str(mode)
    if mode == "constant":
        return np.pad(x, widths, constant_values=fill)
    if mode == "reflect":
        return np.pad(x, widths, mode="reflect")
    if mode == "edge":
        return np.pad(x, widths, mode="edge")
    raise ModelError(f"Pad mode {mode!r} is not simulated; allowed: constant, reflect, edge")


_COORDINATES: dict[str, Callable[[np.ndarray, float, int, int], np.ndarray]] = {
    "half_pixel": lambda o, s, i, n: (o + 0.5) / s - 0.5,
    "pytorch_half_pixel": lambda o, s, i, n: (o + 0.5) / s - 0.5 if n > 1 else np.zeros_like(o),
    "asymmetric": lambda o, s, i, n: o / s,
    "align_corners": lambda o, s, i, n: o * (i - 1) / (n - 1) if n > 1 else np.zeros_like(o),
    "tf_half_pixel_for_nn": lambda o, s, i, n: (o + 0.5) / s,
}
_NEAREST: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "round_prefer_floor": lambda c: np.where(c - np.floor(c) == 0.5, np.floor(c), np.round(c)),
    "round_prefer_ceil": lambda c: np.where(c - np.floor(c) == 0.5, np.ceil(c), np.round(c)),
    "floor": np.floor,
    "ceil": np.ceil,
}


def _text(attributes: Attributes, name: str, default: str) -> str:
    value = attributes.get(name, default)
    return value.decode() if isinstance(value, bytes) else str(value)


def per_axis(values: np.ndarray, axes: Sequence[int] | None, rank: int, fill: float) -> np.ndarray:
    """A Resize's ``scales`` or ``sizes`` for every axis of a rank-``rank`` input: as given,
    or, with opset 18's ``axes`` attribute, placed on those axes and ``fill`` elsewhere.

    Example:
        >>> per_axis(np.array([2.0, 3.0]), [2, -1], 4, 1.0).tolist()
        [1.0, 1.0, 2.0, 3.0]
    """
    flat = np.asarray(values).reshape(-1)
    if not axes:
        return flat
    full = np.full(rank, fill, dtype=flat.dtype)
    for axis, value in zip(axes, flat, strict=True):
        full[int(axis) % rank] = value
    return full


def resize_axes(shape: Sequence[int], attributes: Attributes, params: Params) -> list[tuple[int, np.ndarray]]:
    """``(axis, input coordinate of every output index)`` for each axis a Resize changes
    (ONNX's coordinate transforms, in float on shapes only)."""
    for name in ("antialias", "exclude_outside"):
        if attributes.get(name, 0):
            raise ModelError(f"Resize: {name} is not simulated")
    scales, sizes = _param(params, 1), _param(params, 2)
    if len(params) == 1:  # opset 10: (X, scales)
        scales, sizes = _param(params, 0), None
    transform = _COORDINATES.get(_text(attributes, "coordinate_transformation_mode", "half_pixel"))
    if transform is None:
        raise ModelError("Resize: coordinate_transformation_mode is not simulated")
    axes = attributes.get("axes")
    if sizes is not None and np.asarray(sizes).size:
        sizes = per_axis(np.asarray(sizes), axes, len(shape), 0)
        sizes = np.where(sizes == 0, np.asarray(shape), sizes) if axes else sizes
    elif scales is not None:
        scales = per_axis(np.asarray(scales), axes, len(shape), 1.0)
    found = []
    for axis, size_in in enumerate(shape):
        if sizes is not None and np.asarray(sizes).size:
            size_out = int(np.asarray(sizes).reshape(-1)[axis])
            scale = size_out / size_in
        else:
            scale = float(np.asarray(scales).reshape(-1)[axis])
            size_out = math.floor(size_in * scale)
        if size_out == size_in and scale == 1.0:
            continue
        found.append((axis, transform(np.arange(size_out, dtype=np.float64), scale, size_in, size_out)))
    return found


def resize_nearest(x: np.ndarray, attributes: Attributes, params: Params) -> np.ndarray:
    """Nearest-neighbour Resize: the output gathers input codes."""
    mode = _text(attributes, "mode", "nearest")
    if mode != "nearest":
        if mode != "linear":
            raise ModelError(f"Resize: mode {mode!r} is not simulated; allowed: nearest, linear")
        raise ModelError("Resize: a linear Resize computes; see quant_npu.sim.resize")
    nearest = _NEAREST.get(_text(attributes, "nearest_mode", "round_prefer_floor"))
    if nearest is None:
        raise ModelError("Resize: nearest_mode is not simulated")
    out = x
    for axis, coordinates in resize_axes(x.shape, attributes, params):
        index = np.clip(nearest(coordinates), 0, x.shape[axis] - 1).astype(np.int64)
        out = np.take(out, index, axis=axis)
    return out


def depth_to_space(x: np.ndarray, attributes: Attributes, params: Params) -> np.ndarray:
    """ONNX DepthToSpace (``DCR`` or ``CRD``) on ``[N, C, H, W]``.

    Example:
        >>> depth_to_space(np.arange(4).reshape(1, 4, 1, 1), {"blocksize": 2}, []).tolist()
        [[[[0, 1], [2, 3]]]]
    """
    b = int(attributes["blocksize"])
    n, c, h, w = x.shape
    if _text(attributes, "mode", "DCR") == "DCR":
        moved = x.reshape(n, b, b, c // (b * b), h, w).transpose(0, 3, 4, 1, 5, 2)
    else:
        moved = x.reshape(n, c // (b * b), b, b, h, w).transpose(0, 1, 4, 2, 5, 3)
    return moved.reshape(n, c // (b * b), h * b, w * b)


def space_to_depth(x: np.ndarray, attributes: Attributes, params: Params) -> np.ndarray:
    """ONNX SpaceToDepth on ``[N, C, H, W]``.

    Example:
        >>> space_to_depth(np.arange(4).reshape(1, 1, 2, 2), {"blocksize": 2}, []).ravel().tolist()
        [0, 1, 2, 3]
    """
    b = int(attributes["blocksize"])
    n, c, h, w = x.shape
    moved = x.reshape(n, c, h // b, b, w // b, b).transpose(0, 3, 5, 1, 2, 4)
    return moved.reshape(n, c * b * b, h // b, w // b)


MOVES: dict[str, MoveFunction] = {
    "Reshape": reshape,
    "Flatten": flatten,
    "Transpose": transpose,
    "Squeeze": squeeze,
    "Unsqueeze": unsqueeze,
    "Identity": identity,
    "Slice": slice_,
    "Resize": resize_nearest,
    "DepthToSpace": depth_to_space,
    "SpaceToDepth": space_to_depth,
}
"""Op type -> function of (codes, attributes, parameter inputs after the data input)."""
