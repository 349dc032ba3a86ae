"""Strict, attrs-driven conversion between config objects and JSON-ready data.

:func:`to_data` turns any attrs object of ``quant_core`` (``QuantSpec``,
``QuantConfig``...) into dicts, lists and scalars: enums become their values,
tuples lists, mappings objects, and observer/algorithm configs carry their
``method``/``kind`` tag. :func:`from_data` reverses it driven by the field
annotations, and rejects anything it does not understand with a ``ConfigError``
whose message starts with the JSON path of the offending field. Fields left out
take their defaults, so hand-written files can be short.

:func:`config_to_json` / :func:`config_from_json` add a ``schema_version`` so that
files written today can be recognised after the format changes;
:func:`save_config` writes atomically.

Example:
    >>> from quant_core.spec import QuantSpec
    >>> to_data(QuantSpec(dtype="int8", per_channel_axis=0))["observer"]
    {'method': 'minmax'}
    >>> from_data(QuantSpec, {"dtype": "uint8", "symmetric": False}).dtype.value
    'uint8'
    >>> from_data(QuantSpec, {"dtype": "int8", "observer": {"method": "percentile", "bins": 3}})
    Traceback (most recent call last):
    ...
    quant_core.errors.ConfigError: $.observer.bins: 3 is out of range; allowed: an even integer from 16 to 65536
"""

from __future__ import annotations

import collections.abc
import enum
import functools
import json
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar, overload

import attrs
import numpy as np

from quant_core.atomic_io import atomic_write
from quant_core.errors import ConfigError, one_line
from quant_core.observer_config import is_finite_number

if typing.TYPE_CHECKING:
    from quant_core.config import QuantConfig

T = TypeVar("T")

SCHEMA_VERSION = 2
"""Version of the JSON config format written by :func:`config_to_json`.

2: a weight's integer ``per_channel_axis`` is that axis, taken as written (refused where
it is not the op's output-channel axis); ``"output"`` asks for the output channels. In
version 1 every weight axis meant "the output channels" (backends replaced it), so
version-1 files are read with their integer weight axes as ``"output"``."""

SUPPORTED_SCHEMA_VERSIONS = (1, 2)

# Class attributes that name a class inside a tagged union ("method" for observer
# configs, "kind" for algorithm configs), in the order they are looked for.
_TAG_NAMES = ("method", "kind")

# An error message that starts with a field name ("bins: ...", "observer.method: ...")
# is made absolute by prefixing the object's path with a dot.
_FIELD_PREFIX = re.compile(r"^[A-Za-z_]\w*(?=[.:\[])")


# --------------------------------------------------------------------------- to_data


def to_data(obj: Any) -> Any:
    """``obj`` as JSON-ready data (dicts, lists, str, int, float, bool, None).

    Example:
        >>> from quant_core.algorithm_config import CLEConfig
        >>> to_data(CLEConfig(steps=2))["kind"], to_data(CLEConfig(steps=2))["steps"]
        ('cle', 2)
        >>> to_data((1, "a", None))
        [1, 'a', None]
    """
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        if not math.isfinite(obj):
            raise ConfigError(f"{obj!r} cannot be written as JSON; allowed: finite numbers")
        return obj
    if isinstance(obj, enum.Enum):
        return obj.value
    if attrs.has(type(obj)):
        data: dict[str, Any] = {}
        tag = tag_name(type(obj))
        if tag is not None:
            data[tag] = getattr(type(obj), tag)
        for field in attrs.fields(type(obj)):
            data[field.name] = to_data(getattr(obj, field.name))
        return data
    if isinstance(obj, collections.abc.Mapping):
        # Insertion order is kept: name overrides are matched first-to-last.
        return {_key(k): to_data(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_data(v) for v in obj]
    raise TypeError(f"to_data: {type(obj).__name__} is not serialisable")


def _key(key: Any) -> str:
    if not isinstance(key, str):
        raise TypeError(f"to_data: mapping key {key!r} is not a string")
    return key


def tag_name(cls: type) -> str | None:
    """The class attribute naming ``cls`` inside a tagged union, if it has one.

    Example:
        >>> from quant_core.observer_config import MinMax
        >>> tag_name(MinMax)
        'method'
    """
    field_names = {f.name for f in attrs.fields(cls)} if attrs.has(cls) else set()
    for name in _TAG_NAMES:
        if name not in field_names and isinstance(getattr(cls, name, None), str):
            return name
    return None


# ------------------------------------------------------------------------- from_data


@overload
def from_data(cls: type[T], data: Any, path: str = "$") -> T: ...


@overload
def from_data(cls: Any, data: Any, path: str = "$") -> Any: ...


def from_data(cls: Any, data: Any, path: str = "$") -> Any:
    """Build a ``cls`` (an attrs class, enum, scalar type, or a union/tuple/mapping
    of them) from JSON-ready ``data``, strictly.

    Errors are ``ConfigError`` messages starting with the path of the offending field
    below ``path``: unknown keys, wrong types, missing required fields, values the
    class's own validation refuses.

    Example:
        >>> from quant_core.spec import QuantSpec
        >>> from_data(QuantSpec, {"dtype": "int8", "scale": 1})
        Traceback (most recent call last):
        ...
        quant_core.errors.ConfigError: $: unknown key 'scale'; allowed: dtype, symmetric, per_channel_axis, scale_type, rounding, observer, narrow_range, dynamic
        >>> from_data(QuantSpec, {"dtype": "int8", "symmetric": "yes"})
        Traceback (most recent call last):
        ...
        quant_core.errors.ConfigError: $.symmetric: expected a boolean (true/false), got str 'yes'
    """
    return _from_data(cls, data, path)


def _from_data(cls: Any, data: Any, path: str, nullable: bool = False) -> Any:
    # ``nullable``: the field also accepts null, which type errors should mention.
    origin = typing.get_origin(cls)
    if cls is Any:
        return data
    if cls is type(None):
        if data is not None:
            _wrong_type(path, "null", data)
        return None
    if origin is typing.Union or origin is types.UnionType:
        return _from_union(typing.get_args(cls), data, path)
    if origin is not None:
        return _from_generic(origin, typing.get_args(cls), data, path, nullable)
    if isinstance(cls, type) and issubclass(cls, enum.Enum):
        return _from_enum(cls, data, path)
    if isinstance(cls, type) and attrs.has(cls):
        return _from_attrs(cls, data, path, nullable)
    if cls is bool:
        if not isinstance(data, bool):
            _wrong_type(path, "a boolean (true/false)", data, nullable)
        return data
    if cls is int:
        if isinstance(data, bool) or not isinstance(data, int):
            _wrong_type(path, "an integer", data, nullable)
        return data
    if cls is float:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            _wrong_type(path, "a number", data, nullable)
        if not is_finite_number(data):  # an infinity, or an integer beyond float's range
            raise ConfigError(f"{path}: {data!r} is not allowed; allowed: finite numbers within float's range")
        return float(data)
    if cls is str:
        if not isinstance(data, str):
            _wrong_type(path, "a string", data, nullable)
        return data
    raise TypeError(f"{path}: from_data does not support type {cls!r}")


def _wrong_type(path: str, expected: str, data: Any, nullable: bool = False) -> typing.NoReturn:
    shown = "null" if data is None else f"{type(data).__name__} {data!r}"
    raise ConfigError(f"{path}: expected {expected}{' or null' if nullable else ''}, got {shown}")


def _from_enum(cls: type[enum.Enum], data: Any, path: str) -> enum.Enum:
    allowed = ", ".join(str(m.value) for m in cls)
    try:
        return cls(data)
    except (ValueError, TypeError):
        raise ConfigError(f"{path}: {data!r} is not allowed; allowed: {allowed}") from None


def _from_union(args: tuple[Any, ...], data: Any, path: str) -> Any:
    members = [a for a in args if a is not type(None)]
    if data is None:
        if len(members) < len(args):
            return None
        _wrong_type(path, _describe_union(members), data)
    if len(members) == 1:
        return _from_data(members[0], data, path, nullable=len(members) < len(args))
    if all(isinstance(m, type) and attrs.has(m) for m in members):
        return _from_tagged(tuple(members), data, path, nullable=len(members) < len(args))
    # Untagged unions of scalars: the first type that accepts the value wins.
    for member in members:
        try:
            return from_data(member, data, path)
        except ValueError:
            continue
    _wrong_type(path, _describe_union(members), data, nullable=len(members) < len(args))


_SCALAR_NAMES = {int: "an integer", str: "a string", float: "a number", bool: "a boolean (true/false)"}


def _describe_union(members: list[Any]) -> str:
    return " or ".join(_SCALAR_NAMES.get(m, getattr(m, "__name__", str(m))) for m in members)


@functools.cache
def _tagged_members(members: tuple[type, ...]) -> tuple[str, dict[str, type]]:
    tags = {tag_name(m) for m in members}
    if len(tags) != 1 or None in tags:
        raise TypeError(f"union of {members} is not a tagged union (no common method/kind tag)")
    tag = tags.pop()
    assert tag is not None
    return tag, {getattr(m, tag): m for m in members}


def _from_tagged(members: tuple[type, ...], data: Any, path: str, nullable: bool = False) -> Any:
    tag, by_tag = _tagged_members(members)
    allowed = ", ".join(by_tag)
    if not isinstance(data, collections.abc.Mapping):
        _wrong_type(path, f"an object with a {tag!r} key", data, nullable)
    if tag not in data:
        raise ConfigError(f"{path}: missing key {tag!r}; allowed {tag}s: {allowed}")
    value = data[tag]
    if not isinstance(value, str) or value not in by_tag:
        raise ConfigError(f"{path}.{tag}: {value!r} is not allowed; allowed: {allowed}")
    return _from_attrs(by_tag[value], data, path)


def _from_generic(origin: Any, args: tuple[Any, ...], data: Any, path: str, nullable: bool = False) -> Any:
    if origin is typing.ClassVar:
        raise TypeError(f"{path}: ClassVar is not a field")
    if origin in (tuple, list, collections.abc.Sequence):
        if not isinstance(data, (list, tuple)):
            _wrong_type(path, "a list", data, nullable)
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(data) != len(args):
                raise ConfigError(f"{path}: expected a list of {len(args)} items, got {len(data)}")
            items = [from_data(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, data, strict=True))]
        else:
            item_type = args[0] if args else Any
            items = [from_data(item_type, v, f"{path}[{i}]") for i, v in enumerate(data)]
        return items if origin is list else tuple(items)
    if origin in (dict, collections.abc.Mapping):
        if not isinstance(data, collections.abc.Mapping):
            _wrong_type(path, "an object", data, nullable)
        key_type, value_type = args if args else (str, Any)
        result = {}
        for key, value in data.items():
            key_path = f"{path}[{key!r}]"
            result[from_data(key_type, key, key_path)] = from_data(value_type, value, key_path)
        return result
    raise TypeError(f"{path}: from_data does not support {origin!r}")


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    # Modules use ``from __future__ import annotations``: resolve the strings once.
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in attrs.fields(cls)}


def _from_attrs(cls: type, data: Any, path: str, nullable: bool = False) -> Any:
    if not isinstance(data, collections.abc.Mapping):
        _wrong_type(path, f"an object ({cls.__name__})", data, nullable)
    types_ = _field_types(cls)
    tag = tag_name(cls)
    allowed_keys = ([tag] if tag else []) + list(types_)
    for key in data:
        if key not in allowed_keys:
            raise ConfigError(f"{path}: unknown key {key!r}; allowed: {', '.join(allowed_keys)}")
    if tag is not None and tag in data and data[tag] != getattr(cls, tag):
        raise ConfigError(f"{path}.{tag}: {data[tag]!r} is not allowed here; allowed: {getattr(cls, tag)!r}")
    kwargs: dict[str, Any] = {}
    for field in attrs.fields(cls):
        if not field.init:
            continue
        if field.name in data:
            kwargs[field.alias] = from_data(types_[field.name], data[field.name], f"{path}.{field.name}")
        elif field.default is attrs.NOTHING:
            raise ConfigError(f"{path}: missing required key {field.name!r}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        raise ConfigError(_prefixed(path, str(exc))) from exc


def _prefixed(path: str, message: str) -> str:
    if message.startswith("$"):
        return message
    return f"{path}.{message}" if _FIELD_PREFIX.match(message) else f"{path}: {message}"


# ------------------------------------------------------------------------------ JSON


def config_to_json(config: QuantConfig, indent: int | None = 2) -> str:
    """``config`` as JSON text with ``"schema_version"`` first; the same config always
    gives the same text (fields in declaration order, name overrides in match order).

    Example:
        >>> from quant_core.presets import get_preset
        >>> text = config_to_json(get_preset("xint8"))
        >>> text.splitlines()[1]
        '  "schema_version": 2,'
        >>> config_from_json(text) == get_preset("xint8")
        True
    """
    data = {"schema_version": SCHEMA_VERSION, **to_data(config)}
    return json.dumps(data, indent=indent, allow_nan=False) + "\n"


def report_json(data: Any, indent: int | None = 2) -> str:
    """``data`` (a report: dicts, lists, numbers, numpy scalars) as strict JSON text: a
    non-finite number is written as the string ``"inf"``, ``"-inf"`` or ``"nan"`` (a float
    ``Infinity`` or ``NaN`` is not JSON, and strict parsers refuse the file).

    Example:
        >>> print(report_json({"sqnr_db": float("inf"), "scores": [1.5, float("nan")]}, indent=None), end="")
        {"sqnr_db": "inf", "scores": [1.5, "nan"]}
    """
    return json.dumps(_finite(data), indent=indent, sort_keys=False, allow_nan=False) + "\n"


def _finite(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _reject_constant(name: str) -> Any:
    raise ConfigError(f"{name} is not allowed in a config; allowed: finite numbers")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's members, refusing a key given twice (``json.loads`` keeps the last one
    silently, so a config file would hold a value its reader never sees)."""
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise ConfigError(f"{key!r}: given twice in one object; allowed: each key once")
        data[key] = value
    return data


def config_from_json(text: str) -> QuantConfig:
    """Parse a config written by :func:`config_to_json` (or by hand).

    Example:
        >>> config_from_json('{"schema_version": 2, "global_config": {"weight": {"dtype": "int8"}}}').global_config.input
        >>> config_from_json('{"global_config": {}}')
        Traceback (most recent call last):
        ...
        quant_core.errors.ConfigError: $: missing key 'schema_version'; add "schema_version": 2 (supported: 1, 2)
        >>> old = '{"schema_version": 1, "global_config": {"weight": {"dtype": "int8", "per_channel_axis": 0}}}'
        >>> config_from_json(old).global_config.weight.per_channel_axis
        'output'
    """
    from quant_core.config import QuantConfig

    try:
        data = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
    except ConfigError:
        raise
    except (ValueError, RecursionError) as exc:
        # Besides a syntax error (JSONDecodeError): an integer of more digits than Python
        # converts (ValueError) and nesting deeper than the parser recurses.
        raise ConfigError(f"$: invalid JSON: {one_line(exc)}") from None
    if not isinstance(data, dict):
        _wrong_type("$", "an object", data)
    supported = ", ".join(map(str, SUPPORTED_SCHEMA_VERSIONS))
    if "schema_version" not in data:
        raise ConfigError(
            f"$: missing key 'schema_version'; add \"schema_version\": {SCHEMA_VERSION} (supported: {supported})"
        )
    version = data.pop("schema_version")
    if not isinstance(version, int) or isinstance(version, bool) or version not in SUPPORTED_SCHEMA_VERSIONS:
        raise ConfigError(f"$.schema_version: {version!r} is not supported; allowed: {supported}")
    if version == 1:
        _weight_axes_to_output_channels(data)
    return from_data(QuantConfig, data, "$")


def _weight_axes_to_output_channels(data: dict[str, Any]) -> None:
    """Version 1 -> 2: integer weight axes meant "the output channels" (module docstring)."""
    from quant_core.spec import OUTPUT_CHANNELS

    operators = [data.get("global_config")]
    for key in ("op_type_overrides", "name_overrides"):
        overrides = data.get(key)
        if isinstance(overrides, dict):
            operators.extend(overrides.values())
    for operator in operators:
        weight = operator.get("weight") if isinstance(operator, dict) else None
        axis = weight.get("per_channel_axis") if isinstance(weight, dict) else None
        if isinstance(weight, dict) and isinstance(axis, int) and not isinstance(axis, bool):
            weight["per_channel_axis"] = OUTPUT_CHANNELS


def save_config(config: QuantConfig, path: str | os.PathLike[str]) -> None:
    """Write ``config`` as JSON to ``path`` atomically: readers see the old file or the
    new one, never a partial write.

    Example:
        >>> import tempfile, pathlib
        >>> from quant_core.presets import get_preset
        >>> with tempfile.TemporaryDirectory() as d:
        ...     p = pathlib.Path(d) / "q.json"
        ...     save_config(get_preset("a8w8"), p)
        ...     load_config(p).name
        'a8w8'
    """
    atomic_write(path, config_to_json(config))


def load_config(path: str | os.PathLike[str]) -> QuantConfig:
    """Read a config saved by :func:`save_config`; errors name the file and the field.

    Example:
        >>> import tempfile, pathlib
        >>> with tempfile.TemporaryDirectory() as d:
        ...     p = pathlib.Path(d) / "q.json"
        ...     _ = p.write_text('{"schema_version": 2, "global_config": {"input": {"dtype": "int9"}}}')
        ...     load_config(p)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        quant_core.errors.ConfigError: .../q.json: $.global_config.input.dtype: 'int9' is not allowed; allowed: int4, ...
        >>> load_config("nosuch.json")
        Traceback (most recent call last):
        ...
        quant_core.errors.ConfigError: config: file 'nosuch.json' not found
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config: file '{os.fspath(path)}' not found") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{os.fspath(path)}: not UTF-8 text (byte {exc.start}); allowed: a JSON config file"
        ) from None
    except OSError as exc:  # a folder, a file without read permission
        raise ConfigError(
            f"config: file '{os.fspath(path)}' cannot be read ({exc.strerror or exc}); allowed: a JSON config file"
        ) from None
    try:
        return config_from_json(text)
    except ValueError as exc:
        raise ConfigError(f"{os.fspath(path)}: {exc}") from exc
