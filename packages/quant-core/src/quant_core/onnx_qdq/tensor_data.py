"""Tensor payloads checked before onnx reads them: sizes that match the dims, and external
data that stays inside the model's folder.

A model file is untrusted input. onnx refuses an external-data location that escapes the
model's folder only deep inside its loader (a long traceback), and a tensor whose dims
promise more elements than its data holds fails later, in numpy or onnxruntime. These
checks run first and raise one-line :class:`~quant_core.errors.ModelError` naming the
tensor: an absolute location, a ``..`` or a symlink leading out of the folder, a missing
file, an offset/length outside the file, a payload whose size does not match its dims.

Example:
    >>> import numpy as np
    >>> from onnx import numpy_helper
    >>> t = numpy_helper.from_array(np.zeros((2, 3), np.float32), "w")
    >>> t.dims[0] = 1 << 40
    >>> check_payload(t)
    Traceback (most recent call last):
    ...
    quant_core.errors.ModelError: tensor 'w': data holds 24 bytes, dims [1099511627776,3] of FLOAT need 13194139533312
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from quant_core.errors import ModelError

#: Element types stored below one byte per element (packed).
_SUB_BYTE_BITS = {
    getattr(TensorProto, name): bits
    for name, bits in (("INT4", 4), ("UINT4", 4), ("FLOAT4E2M1", 4), ("INT2", 2), ("UINT2", 2))
    if hasattr(TensorProto, name)
}
_COMPLEX = (TensorProto.COMPLEX64, TensorProto.COMPLEX128)
_WINDOWS_DRIVE = re.compile(r"^[A-Za-z]:")


def all_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every tensor of the model: initializers and attribute tensors, subgraphs included."""
    yield from onnx.external_data_helper._get_all_tensors(model)


def uses_external_data(tensor: onnx.TensorProto) -> bool:
    """Whether the tensor's bytes live in another file."""
    return tensor.data_location == TensorProto.EXTERNAL


def element_count(tensor: onnx.TensorProto) -> int:
    """Elements the tensor's dims promise; ModelError for a negative dim."""
    if any(d < 0 for d in tensor.dims):
        raise ModelError(f"tensor '{tensor.name}': negative dimension in dims {_dims(tensor)}")
    return math.prod(tensor.dims)


def payload_bytes(tensor: onnx.TensorProto) -> int | None:
    """Bytes the dims and element type need (``None`` for strings); ModelError for an
    unknown element type."""
    if tensor.data_type == TensorProto.STRING:
        return None
    count = element_count(tensor)
    bits = _SUB_BYTE_BITS.get(tensor.data_type)
    if bits is not None:
        return -(-count * bits // 8)
    return count * _itemsize(tensor)


def check_payload(tensor: onnx.TensorProto) -> None:
    """An inline tensor holds exactly what its dims and type need (raw bytes or typed values)."""
    needed = payload_bytes(tensor)
    if needed is None or uses_external_data(tensor):
        return
    if tensor.HasField("raw_data"):
        held = len(tensor.raw_data)
        if held != needed:
            raise ModelError(
                f"tensor '{tensor.name}': data holds {held} bytes, dims {_dims(tensor)} of "
                f"{_type_name(tensor)} need {needed}"
            )
        return
    field = helper.tensor_dtype_to_field(tensor.data_type)
    held = len(getattr(tensor, field))
    count = element_count(tensor)
    allowed = {count * 2} if tensor.data_type in _COMPLEX else {count}
    if tensor.data_type in _SUB_BYTE_BITS:  # packed, several elements per stored value
        allowed.add(-(-count * _SUB_BYTE_BITS[tensor.data_type] // 8))
    if held not in allowed:
        raise ModelError(
            f"tensor '{tensor.name}': holds {held} values, dims {_dims(tensor)} of {_type_name(tensor)} need {count}"
        )


def external_data_info(tensor: onnx.TensorProto) -> dict[str, str]:
    """The tensor's ``external_data`` entries as a dict (location, offset, length...)."""
    return {entry.key: entry.value for entry in tensor.external_data}


def check_external_data(tensor: onnx.TensorProto, folder: Path) -> tuple[Path, int, int]:
    """Where an external tensor's bytes are: ``(file, offset, length)``, checked to lie
    inside ``folder`` (the model's folder, symlinks resolved) and inside the file, with
    the length its dims need. ModelError otherwise."""
    name = tensor.name
    info = external_data_info(tensor)
    location = info.get("location", "")
    if not location:
        raise ModelError(f"tensor '{name}': external data without a location")
    what = f"tensor '{name}': external data '{location}'"
    if os.path.isabs(location) or location.startswith(("/", "\\")) or _WINDOWS_DRIVE.match(location):
        raise ModelError(f"{what} is an absolute path; allowed: a file inside the model's folder")
    if ".." in re.split(r"[/\\]", location):
        raise ModelError(f"{what} points outside the model's folder; allowed: a file inside it")
    root = folder.resolve()
    resolved = (root / location).resolve()
    if root not in resolved.parents:
        raise ModelError(f"{what} leads outside the model's folder (symlink to '{resolved}')")
    if not resolved.is_file():
        raise ModelError(f"{what}: file not found in '{folder}'")
    offset = _non_negative(info.get("offset", "0"), what, "offset")
    size = resolved.stat().st_size
    length = _non_negative(info["length"], what, "length") if "length" in info else size - offset
    if offset + length > size or length < 0:
        raise ModelError(f"{what}: bytes {offset} to {offset + max(length, 0)} are past the end of the file ({size})")
    needed = payload_bytes(tensor)
    if needed is not None and length != needed:
        raise ModelError(f"{what} holds {length} bytes, dims {_dims(tensor)} of {_type_name(tensor)} need {needed}")
    return resolved, offset, length


# --- external data read on demand (models too large to hold twice) -------------------------------------
#: external_data key naming the folder a tensor's location is relative to; set by
#: :func:`bind_external_data` after the checks, stripped before onnxruntime or a file sees it.
BASEPATH = "basepath"


def external_bytes(model: onnx.ModelProto) -> int:
    """Bytes the model keeps in external files (by the dims of its external tensors)."""
    return sum(payload_bytes(t) or 0 for t in all_tensors(model) if uses_external_data(t))


def bind_external_data(model: onnx.ModelProto, folder: Path) -> None:
    """Leave the external tensors in their files, each told the (resolved) folder its
    location is relative to: :func:`to_array` reads one when it is needed."""
    root = str(folder.resolve())
    for tensor in all_tensors(model):
        if uses_external_data(tensor):
            kept = [(e.key, e.value) for e in tensor.external_data if e.key != BASEPATH]
            del tensor.external_data[:]
            for key, value in [*kept, (BASEPATH, root)]:
                tensor.external_data.add(key=key, value=value)


def bound_folders(model: onnx.ModelProto) -> set[Path]:
    """Folders of the external tensors :func:`bind_external_data` left in their files."""
    return {
        Path(external_data_info(t)[BASEPATH])
        for t in all_tensors(model)
        if uses_external_data(t) and BASEPATH in external_data_info(t)
    }


def to_array(tensor: onnx.TensorProto) -> np.ndarray:
    """The tensor's value, read from its file when it is external (the tensor is not
    modified): a copy-on-write memory map for plain numeric types, whose pages are read
    as they are used and can be dropped again. ModelError if an external tensor was not
    bound to a folder."""
    if not uses_external_data(tensor):
        return _convert(tensor)
    info = external_data_info(tensor)
    if BASEPATH not in info:
        raise ModelError(f"tensor '{tensor.name}': external data with no known folder; load the model from its path")
    path, offset, length = check_external_data(tensor, Path(info[BASEPATH]))
    dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
    if tensor.data_type not in _SUB_BYTE_BITS and dtype.kind in "biuf" and dtype.isnative and length:
        return np.memmap(path, dtype=dtype, mode="c", offset=offset, shape=tuple(tensor.dims))
    with open(path, "rb") as handle:
        handle.seek(offset)
        inline = onnx.TensorProto()
        inline.CopyFrom(tensor)
        del inline.external_data[:]
        inline.data_location = TensorProto.DEFAULT
        inline.raw_data = handle.read(length)
    return _convert(inline)


def _convert(tensor: onnx.TensorProto) -> np.ndarray:
    """numpy_helper.to_array, whose errors on data that fit no array of the tensor's type
    differ between onnx releases, as one ModelError."""
    try:
        return numpy_helper.to_array(tensor)
    except Exception as exc:  # ValueError, IndexError, KeyError...: each onnx release its own
        text = str(exc).strip().splitlines()
        raise ModelError(
            f"tensor '{tensor.name}': data do not read as {_type_name(tensor)} {_dims(tensor)} "
            f"({text[0] if text else type(exc).__name__})"
        ) from None


def inline_external_data(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` with every bound external tensor's data read into it (what a
    file written on its own needs)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for tensor in all_tensors(out):
        if uses_external_data(tensor) and BASEPATH in external_data_info(tensor):
            value = to_array(tensor)
            del tensor.external_data[:]
            tensor.data_location = TensorProto.DEFAULT
            tensor.raw_data = numpy_helper.from_array(value).raw_data
    return out


def without_basepath(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose external tensors name their location only (onnxruntime
    rejects any other key); the data stay in their files."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for tensor in all_tensors(out):
        if uses_external_data(tensor):
            kept = [(e.key, e.value) for e in tensor.external_data if e.key != BASEPATH]
            del tensor.external_data[:]
            for key, value in kept:
                tensor.external_data.add(key=key, value=value)
    return out


def without_external_initializers(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy for onnx.checker, whose in-memory check looks for external files in the
    current directory: external initializers of the main graph become typed graph inputs
    (their payloads were checked by :func:`check_external_data`)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    inputs = {i.name for i in graph.input}
    kept = []
    for tensor in graph.initializer:
        if uses_external_data(tensor):
            if tensor.name not in inputs:
                graph.input.append(helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
        else:
            kept.append(tensor)
    del graph.initializer[:]
    graph.initializer.extend(kept)
    return out


def check_tensors(model: onnx.ModelProto, folder: Path | None, *, trust_bound: bool = False) -> bool:
    """Check every tensor's payload; returns whether any uses external data. ``folder``:
    the model file's folder, ``None`` for a model given as bytes or a ModelProto (which
    then may not use external data: there is nowhere to look for it), except, with
    ``trust_bound``, tensors an earlier load bound to their folder (a ModelProto the
    toolkit loaded; never a file's own ``basepath``). Graph inputs, outputs and
    value_info are checked for known element types too."""
    check_value_types(model)
    external = False
    for tensor in all_tensors(model):
        if uses_external_data(tensor):
            bound = external_data_info(tensor).get(BASEPATH) if trust_bound else None
            if bound is not None:  # bound by an earlier load_model: checked against that folder
                check_external_data(tensor, Path(bound))
                external = True
                continue
            if folder is None:
                location = external_data_info(tensor).get("location", "")
                raise ModelError(
                    f"tensor '{tensor.name}': its data is in external file '{location}'; "
                    "give the model's path so the file can be found"
                )
            check_external_data(tensor, folder)
            external = True
        else:
            check_payload(tensor)
    return external


def check_value_types(model: onnx.ModelProto) -> None:
    """Every typed graph input, output and value_info names a known element type."""
    known = set(TensorProto.DataType.values())
    graph = model.graph
    for kind, values in (("input", graph.input), ("output", graph.output), ("value_info", graph.value_info)):
        for value in values:
            if value.type.HasField("tensor_type") and value.type.tensor_type.elem_type not in known:
                raise ModelError(
                    f"graph {kind} '{value.name}': element type {value.type.tensor_type.elem_type} is not an ONNX type"
                )


def _itemsize(tensor: onnx.TensorProto) -> int:
    try:
        return int(helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize)
    except (KeyError, ValueError, TypeError):
        raise ModelError(f"tensor '{tensor.name}': element type {tensor.data_type} is not an ONNX type") from None


def _non_negative(text: str, what: str, key: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ModelError(f"{what}: {key} '{text}' is not a non-negative integer")
    return value


def _type_name(tensor: onnx.TensorProto) -> str:
    return str(TensorProto.DataType.Name(tensor.data_type))


def _dims(tensor: onnx.TensorProto) -> str:
    return "[" + ",".join(str(d) for d in tensor.dims) + "]"
