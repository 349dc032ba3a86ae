"""The one family of exceptions every distribution raises for bad input.

Every message is one line that names what is wrong (the config field, the model's node
and op, the data's input or batch, the output path) and what is allowed. All of them
derive from :class:`QuantError`, itself a ``ValueError``, so a caller that only knows
"bad input" catches one type, and a caller that wants to tell a bad model from bad data
catches the subclass. A missing optional dependency is an ``ImportError`` instead
(:class:`MissingDependencyError`): the fix is an install, not other input. A broken
internal invariant is a bug, not bad input: an ``AssertionError``. No other package raises
a bare ``ValueError`` or defines an error class of its own (a test scans the sources).

Example:
    >>> try:
    ...     raise DataError("calibration data: input 'x' contains NaN")
    ... except QuantError as exc:
    ...     print(type(exc).__name__, isinstance(exc, ValueError), exc)
    DataError True calibration data: input 'x' contains NaN
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterable
from typing import Any

MAX_MESSAGE_CHARS = 400
"""Where :func:`one_line` cuts a third-party message (onnx.checker, onnxruntime, torch)."""


def one_line(exc: BaseException | str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``exc``'s whole message (or the text ``exc``) on one line: the lines joined, runs of
    whitespace collapsed to one space (onnx.checker puts a node's name and op type on the
    lines after the first, so keeping only the first line lost them), cut with ``...`` past
    ``limit`` characters; an exception's type name when it has no message.

    Example:
        >>> one_line(ValueError("input 'x' of node: \\nname: add OpType: Add\\n is not output"))
        "input 'x' of node: name: add OpType: Add is not output"
        >>> one_line(ValueError("a  " * 10), limit=12)
        'a a a a a...'
    """
    text = " ".join(str(exc).split())
    if not text and isinstance(exc, BaseException):
        return type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


UNREADABLE_ARRAY_FILE: tuple[type[BaseException], ...] = (OSError, ValueError, EOFError, zipfile.BadZipFile)
"""What ``numpy.load`` raises for a ``.npy``/``.npz`` file it cannot read: a damaged or
pickled one (``ValueError``), an empty one (``EOFError``), a ``.npz`` that is no zip
archive; callers turn it into their one-line :class:`DataError`."""


class QuantError(ValueError):
    """Bad input to any part of the toolkit (the base class; one-line message).

    Example:
        >>> isinstance(ConfigError("bits: 3 is not allowed; allowed: 4, 8, 16"), QuantError)
        True
    """


class ConfigError(QuantError):
    """A config, spec, preset or option is invalid: the message names the field and the
    allowed values. Raised at construction.

    Example:
        >>> str(ConfigError("activation_encoding: 'x' is not allowed; allowed: x86_uint8, as_spec"))[:20]
        'activation_encoding:'
    """


class ModelError(QuantError):
    """A model cannot be read, validated or handled: the message names the file, node and op.

    Example:
        >>> str(ModelError("model 'a.onnx': file not found"))
        "model 'a.onnx': file not found"
    """


class CaptureError(ModelError):
    """``torch.export`` cannot capture a model: the message names the construct, where it
    is, and how to leave it out.

    Example:
        >>> isinstance(CaptureError("model: cannot capture"), ModelError)
        True
    """


class DataError(QuantError):
    """Calibration, training or evaluation data does not fit the model: the message names
    the input, the batch and the shapes.

    Example:
        >>> isinstance(DataError("calibration data: no samples"), ValueError)
        True
    """


class OutputError(QuantError):
    """An output path cannot be written (missing or read-only folder, the input model...);
    raised before any work is done.

    Example:
        >>> str(OutputError("output 'out/q.onnx': folder 'out' does not exist"))
        "output 'out/q.onnx': folder 'out' does not exist"
    """


class MissingDependencyError(ImportError):
    """An optional dependency (an extra) is needed for the requested feature; the message
    says what to install.

    Example:
        >>> str(MissingDependencyError("reading images needs Pillow: pip install 'quant-onnx[images]'"))[:22]
        'reading images needs P'
    """


def listed(value: Any, field: str, allowed: str, *, single: bool = True, any_iterable: bool = False) -> tuple[Any, ...]:
    """A config field's list as a tuple: a list or tuple as it is, a lone string as one item
    (``single``), any other iterable's items where a Python API takes them (``any_iterable``:
    a set of types, a generator of names); anything else is refused naming ``field`` and
    what it ``allowed`` (a ``tuple()`` of it would raise a bare ``TypeError``, or split a
    string into characters). A class is never a list, even one that iterates (an Enum).

    Example:
        >>> listed("Conv", "exclude", "a list of strings"), listed(["a", "b"], "exclude", "")
        (('Conv',), ('a', 'b'))
        >>> listed(None, "exclude", "a list of strings")
        Traceback (most recent call last):
        ...
        quant_core.errors.ConfigError: exclude: None is not allowed; allowed: a list of strings
        >>> listed({3}, "sizes", "a list", single=False, any_iterable=True)
        (3,)
    """
    if isinstance(value, str) and single:
        return (value,)
    if isinstance(value, list | tuple):
        return tuple(value)
    if any_iterable and not isinstance(value, str | bytes | type) and isinstance(value, Iterable):
        return tuple(value)
    raise ConfigError(f"{field}: {value!r} is not allowed; allowed: {allowed}")
