"""Loading, validating, hashing and atomically saving ONNX models.

Example:
    >>> import onnx
    >>> from onnx import TensorProto, helper
    >>> from quant_core.onnx_qdq.model_io import load_model, opset_version
    >>> x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])
    >>> y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])
    >>> g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    >>> m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    >>> opset_version(load_model(m))
    13
"""

from __future__ import annotations

import hashlib
import itertools
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from quant_core.atomic_io import atomic_write, default_file_mode
from quant_core.errors import ModelError, OutputError, one_line
from quant_core.onnx_qdq.describe import is_quantized_op
from quant_core.onnx_qdq.graph import DEFAULT_DOMAINS
from quant_core.onnx_qdq.tensor_data import (
    all_tensors,
    bind_external_data,
    bound_folders,
    check_tensors,
    external_bytes,
    external_data_info,
    inline_external_data,
    uses_external_data,
    without_external_initializers,
)

#: Opsets of the default domain accepted for *input* models.
MIN_OPSET = 11
MAX_OPSET = 21
#: Protobuf cannot serialise a single message above 2 GiB; bigger models need external data.
_PROTOBUF_LIMIT = 2**31 - 1
#: External data from this size up stay in their files after loading, read tensor by
#: tensor (:mod:`quant_core.onnx_qdq.tensor_data`), so a model larger than memory allows twice
#: is never held twice; smaller external data are read into the model.
LAZY_EXTERNAL_BYTES = 1 << 30

PathLike = str | os.PathLike[str]


def opset_version(model: onnx.ModelProto) -> int:
    """Opset of the default ONNX domain ('' or 'ai.onnx'); ModelError if the model declares
    none, or several that differ (which one would each tool read?)."""
    versions = sorted({int(opset.version) for opset in model.opset_import if opset.domain in DEFAULT_DOMAINS})
    if not versions:
        raise ModelError("model declares no opset for the default ONNX domain")
    if len(versions) > 1:
        raise ModelError(f"model declares the default ONNX domain with several opsets {versions}; allowed: one")
    return versions[0]


def load_model(
    source: PathLike | bytes | onnx.ModelProto,
    *,
    check: bool = True,
    min_opset: int = MIN_OPSET,
    max_opset: int = MAX_OPSET,
) -> onnx.ModelProto:
    """Return a validated *copy* of an ONNX model given as a path, serialized bytes or a ModelProto.

    External weight files next to the model are loaded.  Errors are one-line ModelErrors for:
    missing file, file that is not ONNX, a tensor whose data does not match its dims,
    external data outside the model's folder or missing (:mod:`quant_core.onnx_qdq.tensor_data`,
    checked before onnx reads it), checker failure, default-domain opset outside
    [min_opset, max_opset].  The source is never modified.
    """
    label = "<in-memory model>"
    folder: Path | None = None
    if isinstance(source, onnx.ModelProto):
        model = onnx.ModelProto()
        model.CopyFrom(source)
    elif isinstance(source, bytes | bytearray):
        model = _parse_bytes(bytes(source), label)
    else:
        path = Path(source)
        label = str(path)
        if not path.is_file():
            raise ModelError(f"model '{label}': file not found")
        model = _parse_bytes(path.read_bytes(), label)
        folder = path.parent
    try:  # our own checks, before onnx reads a byte of external data
        external = check_tensors(model, folder, trust_bound=isinstance(source, onnx.ModelProto))
    except ModelError as exc:
        raise ModelError(f"model '{label}': {exc}") from None
    if external and folder is not None:
        if external_bytes(model) >= LAZY_EXTERNAL_BYTES:
            bind_external_data(model, folder)  # read tensor by tensor, when needed
        else:
            try:
                onnx.external_data_helper.load_external_data_for_model(model, str(folder))
            except (OSError, ValueError) as exc:
                raise ModelError(f"model '{label}': cannot load external data: {one_line(exc)}") from exc
    if not model.graph.node and not model.graph.output:
        raise ModelError(f"model '{label}': not an ONNX model (empty graph)")
    try:
        version = opset_version(model)
    except ModelError as exc:
        raise ModelError(f"model '{label}': {exc}") from None
    if not min_opset <= version <= max_opset:
        raise ModelError(f"model '{label}': opset {version} is not supported (allowed: {min_opset} to {max_opset})")
    if check:
        check_model(model, label)
    return model


def source_label(source: object) -> str:
    """How messages name a model: its path, or ``<in-memory model>`` for bytes and protos."""
    return str(Path(source)) if isinstance(source, str | os.PathLike) else "<in-memory model>"


_REDUCED_FLOATS: dict[int, str] = {onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.BFLOAT16: "bfloat16"}


def _reduced_float_tensor(model: onnx.ModelProto) -> tuple[str, str, str] | None:
    """(what, name, dtype) of the first graph input, initializer or output in float16 or
    bfloat16, else None (a float32 model that casts inside is left to run as it is)."""
    graph = model.graph
    typed = itertools.chain(
        (("input", v.name, v.type.tensor_type.elem_type) for v in graph.input),
        (("initializer", t.name, t.data_type) for t in graph.initializer),
        (("output", v.name, v.type.tensor_type.elem_type) for v in graph.output),
    )
    for what, name, elem_type in typed:
        if elem_type in _REDUCED_FLOATS:
            return what, name, _REDUCED_FLOATS[elem_type]
    return None


def check_float32(model: onnx.ModelProto, label: str = "<in-memory model>") -> None:
    """Refuse a float16/bfloat16 model: calibration, the planner and the writer work on
    float32 tensors, and such a model's ops would stay unquantized while the run reports
    success. Converting is not done here: widening the values is exact, but a float16 graph
    also casts and types its tensors in float16 and may depend on float16 arithmetic
    (overflow, rounding), which only the model's author can settle, by exporting float32.

    Example:
        >>> from onnx import helper, TensorProto
        >>> g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
        ...     [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2])],
        ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2])])
        >>> check_float32(helper.make_model(g))
        Traceback (most recent call last):
        ...
        quant_core.errors.ModelError: model '<in-memory model>': input 'x' is float16; ...
    """
    found = _reduced_float_tensor(model)
    if found is None:
        return
    what, name, dtype = found
    raise ModelError(
        f"model '{label}': {what} {name!r} is {dtype}; quantization takes float32 models: convert the model "
        f"to float32 first (e.g. export it again in float32) and quantize that"
    )


def check_not_quantized(model: onnx.ModelProto, label: str = "<in-memory model>") -> None:
    """Refuse a model that is already quantized (Q/DQ, QLinear*, integer kernels): its
    Q/DQ pairs would be observed and wrapped again, each tensor rounded twice on two
    grids, and the run would report success on a model that no longer computes what the
    input did. ``quant-onnx inspect`` says what such a model holds.

    Example:
        >>> from onnx import helper, TensorProto
        >>> g = helper.make_graph([helper.make_node("QuantizeLinear", ["x", "s"], ["q"], name="xq")], "g",
        ...     [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        ...     [helper.make_tensor_value_info("q", TensorProto.UINT8, [2])],
        ...     [helper.make_tensor("s", TensorProto.FLOAT, [], [0.1])])
        >>> check_not_quantized(helper.make_model(g))
        Traceback (most recent call last):
        ...
        quant_core.errors.ModelError: model '<in-memory model>': already quantized (node 'xq' is QuantizeLinear); ...
    """
    node = next((n for n in model.graph.node if is_quantized_op(n)), None)
    if node is None:
        return
    name = repr(node.name) if node.name else f"writing {node.output[0]!r}" if node.output else "without a name"
    raise ModelError(
        f"model '{label}': already quantized (node {name} is {node.op_type}); quantization takes float models: "
        "quantize the float model it was made from"
    )


def load_float_model(source: PathLike | bytes | onnx.ModelProto) -> onnx.ModelProto:
    """:func:`load_model` of a model quantization takes: float32 (:func:`check_float32`) and
    not quantized already (:func:`check_not_quantized`), refused naming ``source``
    otherwise. Static and dynamic quantization both start here."""
    loaded = load_model(source)
    check_float32(loaded, source_label(source))
    check_not_quantized(loaded, source_label(source))
    return loaded


def check_model(model: onnx.ModelProto, label: str = "<in-memory model>") -> None:
    """Run onnx.checker on models under 2 GiB; ModelError with the finding on one line.
    Tensors left in their files by :func:`load_model` are checked as typed inputs (their
    data were checked when loaded)."""
    if bound_folders(model):
        model = without_external_initializers(model)
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        raise ModelError(f"model '{label}': fails onnx.checker: {one_line(exc)}") from exc
    except ValueError as exc:
        if "too large" not in str(exc):  # the in-memory checker cannot take protos above 2 GiB
            raise ModelError(f"model '{label}': fails onnx.checker: {one_line(exc)}") from exc


def save_model(model: onnx.ModelProto, path: PathLike, *, input_path: PathLike | None = None) -> Path:
    """Write `model` to `path` atomically (temp file in the same folder, then os.replace).

    `input_path` is the file the model was read from: saving over it is refused, because the input
    file must never be modified.  Models above 2 GiB are written with their tensors in
    `<name>.<content hash>.data`: the data file gets a name no other file uses, then the model file
    is replaced (atomically, switching from the old data to the new), then the old output's data
    file is removed (also when the new model is small enough to be written whole); an
    interrupted save leaves the old output whole.
    """
    target = Path(path)
    overwritten = None if input_path is None else _input_file_at(target, Path(input_path))
    if overwritten is not None:
        raise ModelError(f"output path '{target}' is {overwritten}; choose another output file")
    if target.is_dir():
        raise ModelError(f"output path '{target}' is a directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    if bound_folders(model):  # weights still in the input's files: the output gets its own copy
        model = inline_external_data(model)
    old_data = _own_data_files(target)
    if model.ByteSize() < _PROTOBUF_LIMIT:
        atomic_write(target, model.SerializeToString(deterministic=True))
        _remove_files(target.parent, old_data)  # an earlier output above 2 GiB left its tensors beside it
        return target
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.") as scratch:
        to_save = onnx.ModelProto()
        to_save.CopyFrom(model)
        onnx.save_model(to_save, str(Path(scratch) / "model.onnx"), save_as_external_data=True, location="tensors")
        data_name = f"{target.name}.{_file_digest(Path(scratch) / 'tensors')}.data"
        for tensor in all_tensors(to_save):
            for entry in tensor.external_data:
                if entry.key == "location":
                    entry.value = data_name
        data_path = target.parent / data_name
        os.chmod(Path(scratch) / "tensors", default_file_mode())
        os.replace(Path(scratch) / "tensors", data_path)
        try:
            atomic_write(target, to_save.SerializeToString(deterministic=True))
        except BaseException:
            if data_name not in old_data:
                data_path.unlink(missing_ok=True)
            raise
    _remove_files(target.parent, old_data - {data_name})
    return target


def _remove_files(folder: Path, names: set[str]) -> None:
    for name in names:
        (folder / name).unlink(missing_ok=True)


def _file_digest(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=8)
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _own_data_files(target: Path) -> set[str]:
    """Data files an existing output at ``target`` names that :func:`save_model` wrote
    for it (``<name>.<hash>.data``), which a new save may remove."""
    pattern = re.escape(target.name) + r"\.[0-9a-f]{16}\.data"
    if not target.is_file() or not any(re.fullmatch(pattern, p.name) for p in target.parent.iterdir()):
        return set()  # none to remove: the old output (maybe near 2 GiB) need not be parsed
    names = _data_locations(target)
    return {n for n in names if re.fullmatch(pattern, n)}


def _data_locations(path: Path) -> set[str]:
    """The files (relative to its folder) that the model at ``path`` stores tensors in, read
    without the tensors; none when it is not a model we can read."""
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # not a model we can read: it names no files to protect or remove
        return set()
    return {external_data_info(t).get("location", "") for t in all_tensors(model) if uses_external_data(t)} - {""}


def check_output_path(
    path: PathLike,
    *,
    input_path: PathLike | None = None,
    what: str = "output",
    data: Mapping[str, object] | None = None,
) -> Path:
    """Refuse, before any work, an output path that cannot be written: the input model
    itself, a data file the run reads (``data``: what it is -> the user's data argument;
    arguments that are not paths, arrays or loaders, are skipped), a directory, a folder
    that does not exist (it is not created: a typo in a folder name should not scatter
    files) or is not writable. OutputError naming ``path``.
    """
    target = Path(path)
    overwritten = None if input_path is None else _input_file_at(target, Path(input_path))
    if overwritten is not None:
        raise OutputError(f"{what} '{target}' is {overwritten}; choose another file")
    for label, source in (data or {}).items():
        if isinstance(source, str | os.PathLike) and _same_file(target, Path(source)):
            raise OutputError(f"{what} '{target}' is {label}; choose another file")
    if target.is_dir():
        raise OutputError(f"{what} '{target}' is a directory; give a file name")
    folder = target.parent
    if not folder.is_dir():
        state = "is not a folder" if folder.exists() else "does not exist (create it first)"
        raise OutputError(f"{what} '{target}': folder '{folder}' {state}")
    try:  # permissions, read-only mounts, ACLs: only a real file creation tells
        fd, probe = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".probe", dir=folder)
    except OSError as exc:
        raise OutputError(f"{what} '{target}': folder '{folder}' is not writable ({exc.strerror})") from None
    os.close(fd)
    os.unlink(probe)
    return target


def check_output_paths(
    model_out: PathLike | None,
    report_out: PathLike | None = None,
    *,
    input_path: PathLike | None = None,
    data: Mapping[str, object] | None = None,
) -> None:
    """:func:`check_output_path` for a model output and a report output (which must differ)."""
    if model_out is not None:
        check_output_path(model_out, input_path=input_path, data=data)
    if report_out is not None:
        check_output_path(report_out, input_path=input_path, what="report", data=data)
        if model_out is not None and _same_file(Path(report_out), Path(model_out)):
            raise OutputError(f"report '{report_out}' is the output model; choose another file")


def model_hash(model: onnx.ModelProto) -> str:
    """SHA-256 hex digest of the deterministic serialization (equal models hash equal)."""
    return hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()


def model_size(model: onnx.ModelProto) -> int:
    """Serialized size of the model in bytes (including inline weights)."""
    return int(model.ByteSize())


def initializer_bytes(model: onnx.ModelProto) -> int:
    """Bytes taken by the main graph's initializers (the weight payload)."""
    return sum(int(t.ByteSize()) for t in model.graph.initializer)


def _parse_bytes(data: bytes, label: str) -> onnx.ModelProto:
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise ModelError(f"model '{label}': not an ONNX model ({one_line(exc)})") from exc
    if not model.HasField("graph"):
        raise ModelError(f"model '{label}': not an ONNX model (no graph)")
    return model


def _input_file_at(target: Path, input_path: Path) -> str | None:
    """What of the input model ``target`` would overwrite: ``"the input model"``, one of
    the files its tensors are stored in, or ``None``. Only an existing file beside (or
    below) the input can be one of its data files, so only then is the input read, without
    its tensors."""
    if _same_file(target, input_path):
        return "the input model"
    if not (target.is_file() and input_path.is_file()):
        return None
    folder = input_path.resolve().parent
    if folder not in target.resolve().parents:
        return None
    for location in sorted(_data_locations(input_path)):
        if _same_file(target, folder / location):
            return f"a data file of the input model ('{location}')"
    return None


def _same_file(a: Path, b: Path) -> bool:
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return a.resolve() == b.resolve()
