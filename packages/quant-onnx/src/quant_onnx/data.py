"""Calibration data: validated, re-batched {input_name: ndarray} dicts from arrays, files or image folders.

Accepted data (any of):
  * a path: ``.npy`` (single-input model, samples on axis 0, memory-mapped), ``.npz`` (keys = input
    names, each key read when first needed) or a folder of images (needs the ``images`` extra);
  * one ndarray (single-input model, samples on axis 0) or a dict {input_name: ndarray of samples};
  * any iterable of ndarrays (single-input model) or of {input_name: ndarray} dicts, each holding one
    sample (rank = model rank - 1) or a batch (rank = model rank).
Items are re-cut into batches of `batch_size` (the last one may be smaller) and checked against the
model's inputs; any mismatch is a one-line DataError naming the input.

Example:
    >>> import numpy as np
    >>> specs = [InputSpec("x", ("N", 3, 4, 4), np.dtype("float32"))]
    >>> data = np.zeros((10, 3, 4, 4), np.float32)
    >>> [b["x"].shape[0] for b in calibration_batches(specs, data, batch_size=4)]
    [4, 4, 2]
"""

from __future__ import annotations

import logging
import math
import numbers
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import onnx

from quant_core.algorithm_config import in_range
from quant_core.errors import UNREADABLE_ARRAY_FILE, ConfigError, DataError, MissingDependencyError
from quant_core.onnx_qdq.graph import data_fits_input

_LOG = logging.getLogger(__name__)
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".ppm", ".pgm", ".tif", ".tiff"})
Dim = int | str | None
Batch = dict[str, np.ndarray]


@attrs.frozen
class InputSpec:
    """Name, dims (int fixed, str symbolic, None unknown; None if rank unknown) and dtype of a model input.

    Example:
        >>> InputSpec("x", ("N", 3, 224, 224), np.dtype("float32")).describe_shape()
        '[N,3,224,224]'
    """

    name: str
    shape: tuple[Dim, ...] | None
    dtype: np.dtype

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)

    @property
    def fixed_batch(self) -> int | None:
        """The batch (first) dim when the model fixes it, else None."""
        if not self.shape or not isinstance(self.shape[0], int) or self.shape[0] <= 0:
            return None
        return self.shape[0]

    def describe_shape(self) -> str:
        if self.shape is None:
            return "[?]"
        return _format_dims(["N" if i == 0 and not isinstance(d, int) else d for i, d in enumerate(self.shape)])


def model_inputs(model: onnx.ModelProto) -> list[InputSpec]:
    """InputSpecs of the real graph inputs (initializers listed as inputs are not inputs)."""
    initializers = {t.name for t in model.graph.initializer}
    specs = []
    for vi in model.graph.input:
        if vi.name in initializers:
            continue
        tensor_type = vi.type.tensor_type
        shape: tuple[Dim, ...] | None = None
        if tensor_type.HasField("shape"):
            shape = tuple(
                int(d.dim_value) if d.HasField("dim_value") else (d.dim_param or None) for d in tensor_type.shape.dim
            )
        elem = tensor_type.elem_type or onnx.TensorProto.FLOAT
        specs.append(InputSpec(vi.name, shape, np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem))))
    return specs


def _positive_size(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool) and bool(value > 0)


def _finite_real(value: Any) -> bool:
    # numpy scalars too: per-channel statistics often come from an array.
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


_RESIZE_ALLOWED = "null or two integers > 0 (height, width)"
_MEAN_ALLOWED = "one or more finite numbers (one, or one per channel)"
_STD_ALLOWED = "one or more finite non-zero numbers (one, or one per channel)"


@attrs.frozen(kw_only=True)
class ImageOptions:
    """How image files become input tensors: resize to (height, width), scale to [0, 1], (x - mean) / std.

    `resize=None` uses the model's static height/width.  `mean`/`std` have one value or one per channel.

    Example:
        >>> ImageOptions(resize=(32, 32), mean=(0.5,), std=(0.25,), layout="nchw").layout
        'nchw'
    """

    resize: tuple[int, int] | None = attrs.field(
        default=None,
        validator=in_range(lambda v: v is None or (len(v) == 2 and all(map(_positive_size, v))), _RESIZE_ALLOWED),
    )
    # Checked here, not when the first image is read: a string fails late, an infinite or
    # zero std turns every sample into zeros or NaN, and calibration would run on that.
    mean: tuple[float, ...] = attrs.field(
        default=(0.0,), validator=in_range(lambda v: len(v) > 0 and all(map(_finite_real, v)), _MEAN_ALLOWED)
    )
    std: tuple[float, ...] = attrs.field(
        default=(1.0,),
        validator=in_range(lambda v: len(v) > 0 and all(_finite_real(x) and x != 0 for x in v), _STD_ALLOWED),
    )
    layout: str = "nchw"

    def __attrs_post_init__(self) -> None:
        if self.layout not in ("nchw", "nhwc"):
            raise ConfigError(f"layout: {self.layout!r} is not allowed; allowed: nchw, nhwc")


class CalibrationReader:
    """Iterable of validated calibration batches for a model (see the module docstring for data forms).

    A model with a fixed batch dim (e.g. 1) gets batches of exactly that size; a smaller remainder is dropped.
    Samples of another size than those before them (text lines of several widths, for a model
    whose input size is free) start a batch of their own, since one batch holds one size.
    Iterating twice re-reads the data: arrays, dicts, lists and paths allow that, a one-shot iterator
    or generator raises DataError on the second pass.

    Example:
        >>> specs = [InputSpec("x", ("N", 2), np.dtype("float32"))]
        >>> reader = CalibrationReader(specs, [np.ones(2, np.float32)] * 5, batch_size=2, num_samples=3)
        >>> [b["x"].shape for b in reader]
        [(2, 2), (1, 2)]
    """

    def __init__(
        self,
        model_or_inputs: onnx.ModelProto | Sequence[InputSpec],
        data: Any,
        *,
        batch_size: int = 1,
        num_samples: int | None = None,
        image_options: ImageOptions | None = None,
    ) -> None:
        self.inputs = (
            model_inputs(model_or_inputs) if isinstance(model_or_inputs, onnx.ModelProto) else list(model_or_inputs)
        )
        if not self.inputs:
            raise DataError("calibration data: the model has no inputs to feed")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size must be a positive int, got {batch_size!r}")
        if num_samples is not None and (not isinstance(num_samples, int) or num_samples < 1):
            raise ConfigError(f"num_samples must be a positive int or None, got {num_samples!r}")
        fixed = {s.fixed_batch for s in self.inputs if s.fixed_batch is not None}
        if len(fixed) > 1:
            given = {s.name: s.fixed_batch for s in self.inputs if s.fixed_batch is not None}
            raise DataError(
                f"calibration data: model inputs fix different first dimensions {given}; the first axis of "
                "every input is its samples, so an input without a batch axis (a shape or a side "
                "constant) is not supported: make it an initializer"
            )
        self.fixed_batch = fixed.pop() if fixed else None
        if self.fixed_batch is not None and self.fixed_batch != batch_size:
            _LOG.info("model fixes batch size %d; using it instead of batch_size=%d", self.fixed_batch, batch_size)
        self.batch_size = self.fixed_batch or batch_size
        self.num_samples = num_samples
        if image_options is not None and for_image_folder(data, image_options) is None:
            raise ConfigError(
                "image options (resize, mean, std, layout): they apply to an image folder only; "
                f"the data given is {_data_kind(data)}: drop them, or give the folder"
            )
        self.data = data
        self.image_options = image_options
        self._consumed = False

    def num_batches(self) -> int | None:
        """Batches one pass yields, when the data know their sample count (arrays, dicts
        of arrays, lists of them, ``.npy``/``.npz`` files, image folders); ``None`` for
        other iterables or data that will fail validation. Reads no sample."""
        try:
            samples = _known_samples(self.inputs, self.data)
        except Exception:  # counting is a courtesy for the progress bar; iterating reports errors
            return None
        if samples is None:
            return None
        if self.num_samples is not None:
            samples = min(samples, self.num_samples)
        if self.fixed_batch is not None:
            return samples // self.batch_size
        return -(-samples // self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        if isinstance(self.data, Iterator):
            if self._consumed:
                raise DataError(
                    "calibration data: the iterator was already consumed; pass a list, array or path to read it twice"
                )
            self._consumed = True
        chunks = _chunks(self.inputs, self.data, self.batch_size, self.image_options)
        yield from _rebatch(self.inputs, chunks, self.batch_size, self.num_samples, self.fixed_batch is not None)


def calibration_batches(
    model_or_inputs: onnx.ModelProto | Sequence[InputSpec],
    data: Any,
    batch_size: int = 1,
    num_samples: int | None = None,
    *,
    image_options: ImageOptions | None = None,
) -> Iterator[Batch]:
    """Generator form of CalibrationReader: validated {input_name: batch} dicts."""
    reader = CalibrationReader(
        model_or_inputs, data, batch_size=batch_size, num_samples=num_samples, image_options=image_options
    )
    yield from reader


# --- sample counts (progress-bar totals) -----------------------------------------------------------
def _known_samples(inputs: Sequence[InputSpec], data: Any) -> int | None:
    if isinstance(data, str | os.PathLike):
        return _file_samples(Path(data), inputs)
    if isinstance(data, np.ndarray | Mapping):
        return _item_samples(inputs, data)
    if isinstance(data, list | tuple):
        counts = [_item_samples(inputs, item) for item in data]
        return None if None in counts else sum(c for c in counts if c is not None)
    return None


def _item_samples(inputs: Sequence[InputSpec], item: Any) -> int | None:
    """Samples in one array or {input: array} item."""
    array = item.get(inputs[0].name) if isinstance(item, Mapping) else item
    return _samples_in_shape(inputs[0], array.shape) if isinstance(array, np.ndarray) else None


def _samples_in_shape(spec: InputSpec, shape: tuple[int, ...]) -> int | None:
    """Samples in an array of ``shape`` fed to ``spec`` (rank = model rank - 1: one sample)."""
    if spec.rank is None or not shape:
        return None
    return 1 if len(shape) == spec.rank - 1 else int(shape[0])


def _file_samples(path: Path, inputs: Sequence[InputSpec]) -> int | None:
    if path.is_dir():
        return sum(1 for p in path.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if path.suffix == ".npy":
        return _samples_in_shape(inputs[0], np.load(path, mmap_mode="r", allow_pickle=False).shape)
    if path.suffix == ".npz":  # the header of the first input's member; nothing decompressed
        with np.load(path, allow_pickle=False) as archive, archive.zip.open(f"{inputs[0].name}.npy") as member:
            version = np.lib.format.read_magic(member)
            reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            return _samples_in_shape(inputs[0], reader(member)[0])
    return None


def _float_max(dtype: np.dtype) -> float | None:
    """The largest finite value of a numpy float type (``None`` for others numpy cannot
    describe, such as ml_dtypes' float8 types)."""
    try:
        return float(np.finfo(dtype).max)
    except (ValueError, TypeError):
        return None


def num_rows(batch: Mapping[str, np.ndarray]) -> int:
    """Samples in a batch of feeds (their first axis)."""
    return int(np.shape(next(iter(batch.values())))[0]) if batch else 0


def for_image_folder(data: Any, options: ImageOptions | None) -> ImageOptions | None:
    """``options`` where ``data`` is an image folder, else ``None`` (a run reading two data
    sets applies the image options to the one that is a folder)."""
    return options if isinstance(data, str | os.PathLike) and Path(data).is_dir() else None


def _data_kind(data: Any) -> str:
    return f"'{data}'" if isinstance(data, str | os.PathLike) else f"a {type(data).__name__}"


# --- file loaders -----------------------------------------------------------------------------------
def load_calibration_data(
    path: str | os.PathLike[str], inputs: Sequence[InputSpec], image_options: ImageOptions | None = None
) -> Iterator[Batch]:
    """Chunks ({input: samples}) read lazily from a .npy/.npz file or an image folder."""
    p = Path(path)
    if p.is_dir():
        return iter_image_folder(p, _single_input(inputs, f"image folder '{p}'"), image_options or ImageOptions())
    if not p.is_file():
        raise DataError(f"calibration data: '{p}' is neither a file nor a folder")
    if p.suffix == ".npy":
        return iter_npy(p, _single_input(inputs, f"'{p.name}'").name)
    if p.suffix == ".npz":
        return iter_npz(p)
    raise DataError(f"calibration data: '{p}' has unsupported type '{p.suffix}' (allowed: .npy, .npz, image folder)")


def iter_npy(path: str | os.PathLike[str], input_name: str) -> Iterator[Batch]:
    """One chunk: the memory-mapped array (samples on axis 0) under `input_name`; nothing read until sliced."""
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except UNREADABLE_ARRAY_FILE as exc:
        raise DataError(f"calibration data: cannot read '{path}': {_first_line(exc)}") from exc
    yield {input_name: array}


def iter_npz(path: str | os.PathLike[str]) -> Iterator[Batch]:
    """One chunk whose values are read from the archive key by key, when first used."""
    try:
        archive = np.load(path, allow_pickle=False)
    except UNREADABLE_ARRAY_FILE as exc:
        raise DataError(f"calibration data: cannot read '{path}': {_first_line(exc)}") from exc
    with archive:
        yield _LazyArchive(archive, path)  # type: ignore[misc]


class _LazyArchive(dict):  # type: ignore[type-arg]
    """dict view of an NpzFile that decompresses a key on first access only."""

    def __init__(self, archive: Any, path: str | os.PathLike[str]) -> None:
        super().__init__({k: None for k in archive.files})
        self._archive = archive
        self._path = path

    def __getitem__(self, key: str) -> np.ndarray:
        value = super().__getitem__(key)
        if value is None:
            try:
                value = self._archive[key]
            except UNREADABLE_ARRAY_FILE as exc:  # an object array, a damaged member
                raise DataError(
                    f"calibration data: cannot read '{key}' of '{self._path}': {_first_line(exc)}"
                ) from None
            super().__setitem__(key, value)
        return value

    def items(self):  # type: ignore[no-untyped-def, override]
        return [(k, self[k]) for k in self]


def iter_image_folder(folder: str | os.PathLike[str], spec: InputSpec, options: ImageOptions) -> Iterator[Batch]:
    """One chunk per image (sorted path order, subfolders included), shaped like one sample of `spec`."""
    try:
        from PIL import Image
    except ImportError as exc:
        raise MissingDependencyError(
            "reading calibration images needs Pillow: pip install 'quant-onnx[images]'"
        ) from exc
    files = sorted(p for p in Path(folder).rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise DataError(f"calibration data: no image files in '{folder}' (looked for {sorted(IMAGE_SUFFIXES)})")
    if spec.dtype.kind != "f":
        raise DataError(
            f"calibration data: image folder '{folder}' feeds float inputs; input '{spec.name}' is {spec.dtype}: "
            "give the calibration data as arrays of that type"
        )
    channels, size = _image_geometry(spec, options)
    mean = np.asarray(options.mean, np.float32)
    std = np.asarray(options.std, np.float32)
    for stat, label in ((mean, "mean"), (std, "std")):
        if stat.size not in (1, channels):
            raise DataError(
                f"calibration data: image {label} has {stat.size} values, input '{spec.name}' has {channels} channels"
            )
    for file in files:
        try:
            with Image.open(file) as opened:
                pixels = _unit_pixels(opened, channels, size, file)
        except (OSError, Image.DecompressionBombError) as exc:  # the bomb check is no OSError
            raise DataError(f"calibration data: cannot read image '{file}': {_first_line(exc)}") from exc
        if pixels.ndim == 2:
            pixels = pixels[:, :, None]
        pixels = (pixels - mean) / std  # HWC, statistics broadcast over the channel axis
        sample = pixels.transpose(2, 0, 1) if options.layout == "nchw" else pixels
        yield {spec.name: sample[None].astype(spec.dtype if spec.dtype.kind == "f" else np.float32)}


#: Pillow modes of one 16-bit channel; ``convert`` would clamp them to 255, not rescale them.
SIXTEEN_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N")


def _unit_pixels(opened: Any, channels: int, size: tuple[int, int] | None, file: Path) -> np.ndarray:
    """The image as float32 in [0, 1], ``channels`` channels (HW or HWC), resized to
    ``size``: 8-bit images divided by 255, 16-bit grayscale by 65535."""
    from PIL import Image

    # Pillow opens a 16-bit PGM (maxval above 255) as mode "I", scaled to 0-65535.
    if opened.mode in SIXTEEN_BIT_MODES or (opened.mode == "I" and opened.format == "PPM"):
        img = (
            opened.convert("F")
            if size is None
            else opened.convert("F").resize((size[1], size[0]), Image.Resampling.BILINEAR)
        )
        gray = np.asarray(img, dtype=np.float32) / 65535.0
        return gray if channels == 1 else np.repeat(gray[:, :, None], 3, axis=2)
    if opened.mode in ("I", "F"):
        raise DataError(
            f"calibration data: image '{file}' has 32-bit pixels (mode {opened.mode}) of unknown scale; "
            "save it as 8- or 16-bit, or give the calibration data as arrays"
        )
    img = opened.convert("L" if channels == 1 else "RGB")
    if size is not None and img.size != (size[1], size[0]):
        img = img.resize((size[1], size[0]), Image.Resampling.BILINEAR)
    return np.asarray(img, dtype=np.float32) / 255.0


def _image_geometry(spec: InputSpec, options: ImageOptions) -> tuple[int, tuple[int, int] | None]:
    if spec.shape is not None and len(spec.shape) != 4:
        raise DataError(f"calibration data: input '{spec.name}' has shape {spec.describe_shape()}, images need rank 4")
    dims = spec.shape or (None, None, None, None)
    c, h, w = (dims[1], dims[2], dims[3]) if options.layout == "nchw" else (dims[3], dims[1], dims[2])
    channels = c if isinstance(c, int) else 3
    if channels not in (1, 3):
        raise DataError(
            f"calibration data: input '{spec.name}' has {channels} channels, images give 1 or 3 (check --layout)"
        )
    size = options.resize
    if size is None and isinstance(h, int) and isinstance(w, int):
        size = (h, w)
    return channels, size


# --- chunking, validation, batching --------------------------------------------------------------------
def _chunks(
    inputs: Sequence[InputSpec], data: Any, batch_size: int, image_options: ImageOptions | None
) -> Iterator[Batch]:
    """Yield {input: array with a leading sample axis}; big arrays are cut into batch-sized views."""
    if isinstance(data, str | os.PathLike):
        source: Iterable[Any] = load_calibration_data(data, inputs, image_options)
    elif isinstance(data, np.ndarray):
        source = [{_single_input(inputs, "an array").name: data}]
    elif isinstance(data, Mapping):
        source = [data]
    elif isinstance(data, Iterable) and not isinstance(data, bytes | str):
        source = data
    else:
        raise DataError(
            f"calibration data: unsupported type {type(data).__name__} (give a path, array, dict or iterable)"
        )
    specs = {s.name: s for s in inputs}
    for item in source:
        if isinstance(item, np.ndarray):
            item = {_single_input(inputs, "an array").name: item}
        if not isinstance(item, Mapping):
            raise DataError(
                f"calibration data: item of type {type(item).__name__}; expected an array or {{input name: array}}"
            )
        chunk = _as_batch(item, specs)
        count = _count(chunk)
        # Slice large chunks (e.g. a memory-mapped .npy) so only one batch is read at a time.
        for start in range(0, count, batch_size):
            yield {k: v[start : start + batch_size] for k, v in chunk.items()}


def _as_batch(item: Mapping[str, Any], specs: Mapping[str, InputSpec]) -> Batch:
    unknown = sorted(set(item) - set(specs))
    if unknown:
        allowed = ", ".join(f"'{n}'" for n in specs)
        raise DataError(f"calibration data: unknown input '{unknown[0]}' (model inputs: {allowed})")
    missing = [n for n in specs if n not in item]
    if missing:
        raise DataError(f"calibration data: input '{missing[0]}' is missing")
    chunk: Batch = {}
    for name, spec in specs.items():
        array = item[name]
        if not isinstance(array, np.ndarray):
            array = np.asarray(array)
        if spec.rank == 0 or array.ndim == 0:
            raise DataError(
                f"calibration data: input '{name}' is a scalar; calibration needs a batch axis "
                "(give the model a batch dimension on that input)"
            )
        if spec.rank is not None and array.ndim == spec.rank - 1:
            array = array[None]  # one sample
        elif spec.rank is not None and array.ndim != spec.rank:
            raise DataError(
                f"calibration data: input '{name}' expected shape {spec.describe_shape()} got {_format_dims(array.shape)}"
            )
        if spec.shape is not None:
            for expected, got in zip(spec.shape[1:], array.shape[1:], strict=True):
                if isinstance(expected, int) and expected != got:
                    got_dims = _format_dims(["N", *array.shape[1:]])
                    raise DataError(
                        f"calibration data: input '{name}' expected shape {spec.describe_shape()} got {got_dims}"
                    )
        if not data_fits_input(array.dtype, spec.dtype):  # integers into integers: range-checked below
            raise DataError(
                f"calibration data: input '{name}' expected dtype {spec.dtype} got {array.dtype} (convert the data first)"
            )
        target_max = _float_max(spec.dtype)
        source_max = _float_max(array.dtype) if array.dtype.kind == "f" else None
        if array.size and target_max is not None and source_max is not None and source_max > target_max:
            largest = float(np.nanmax(np.abs(np.where(np.isfinite(array), array, 0))))
            if largest > target_max:  # the cast would make them infinite
                raise DataError(
                    f"calibration data: input '{name}' has values outside {spec.dtype}'s range "
                    f"(max {target_max:g}; got {largest:g})"
                )
        if array.dtype.kind in "iu" and array.size and not np.can_cast(array.dtype, spec.dtype):
            limits = np.iinfo(spec.dtype)
            if array.min() < limits.min or array.max() > limits.max:  # the cast would wrap them
                raise DataError(
                    f"calibration data: input '{name}' has values outside {spec.dtype} "
                    f"[{limits.min}, {limits.max}] (got {array.dtype} from {array.min()} to {array.max()})"
                )
        chunk[name] = array
    counts = {n: a.shape[0] for n, a in chunk.items()}
    if len(set(counts.values())) > 1:
        raise DataError(
            f"calibration data: inputs have different sample counts {counts}; the first axis of every "
            "input is its samples (an input without a batch axis, such as a shape, is not supported: "
            "make it an initializer)"
        )
    return chunk


def _rebatch(
    inputs: Sequence[InputSpec], chunks: Iterator[Batch], batch_size: int, num_samples: int | None, exact: bool
) -> Iterator[Batch]:
    names = [s.name for s in inputs]
    dtypes = {s.name: s.dtype for s in inputs}
    pending: list[Batch] = []
    pending_count = 0
    emitted = 0
    limit = num_samples if num_samples is not None else float("inf")

    def flush(size: int) -> Batch:
        nonlocal pending, pending_count
        batch: Batch = {}
        rest: Batch = {}
        for name in names:
            parts = [p[name] for p in pending]
            shapes = {tuple(p.shape[1:]) for p in parts}
            if len(shapes) > 1:
                dims = sorted(_format_dims(["N", *s]) for s in shapes)
                raise DataError(
                    f"calibration data: input '{name}' samples have different shapes {' and '.join(dims[:2])}"
                )
            whole = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
            batch[name] = np.ascontiguousarray(whole[:size], dtype=dtypes[name])
            rest[name] = whole[size:]
        pending_count -= size
        pending = [rest] if pending_count else []
        _check_finite(batch)
        return batch

    def sizes(batch: Batch) -> list[tuple[int, ...]]:
        return [tuple(batch[name].shape[1:]) for name in names]

    for chunk in chunks:
        take = min(_count(chunk), limit - emitted - pending_count)
        if take <= 0:
            break
        part = {k: v[: int(take)] for k, v in chunk.items()}
        if pending and not exact and sizes(part) != sizes(pending[0]):
            # Samples of another size (text lines of another width) start a batch of their own.
            emitted += pending_count
            yield flush(pending_count)
        pending.append(part)
        pending_count += int(take)
        while pending_count >= batch_size:
            batch = flush(batch_size)
            emitted += batch_size
            yield batch
        if emitted + pending_count >= limit:  # read nothing past the limit (a next file may not even open)
            break
    dropped = 0
    if pending_count:
        if exact:
            dropped = pending_count
            _LOG.warning(
                "dropping %d calibration sample(s): the model fixes the batch size to %d", pending_count, batch_size
            )
        else:
            emitted += pending_count
            yield flush(pending_count)
    if emitted == 0 and dropped:
        raise DataError(
            f"calibration data: {dropped} sample(s), fewer than the batch of {batch_size} the model fixes; "
            f"give at least {batch_size}"
        )
    if emitted == 0:
        raise DataError(f"calibration data: no samples for input '{names[0]}'")


def _check_finite(batch: Batch) -> None:
    for name, array in batch.items():
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            kind = "NaN" if np.isnan(array).any() else "Inf"
            raise DataError(f"calibration data: input '{name}' contains {kind}")


def _count(chunk: Mapping[str, np.ndarray]) -> int:
    for array in chunk.values():
        return int(array.shape[0])
    return 0


def _single_input(inputs: Sequence[InputSpec], what: str) -> InputSpec:
    if len(inputs) != 1:
        names = ", ".join(f"'{s.name}'" for s in inputs)
        raise DataError(f"calibration data: {what} can feed only a single-input model; model inputs: {names}")
    return inputs[0]


def _format_dims(dims: Iterable[Any]) -> str:
    return "[" + ",".join("?" if d is None else str(d) for d in dims) + "]"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
