"""Exceptions raised by quant_onnx for invalid user input.

The first three derive from ValueError so callers that only know "bad input" can catch one type.

Example:
    >>> from quant_onnx.errors import DataError
    >>> try:
    ...     raise DataError("calibration data: input 'x' contains NaN")
    ... except ValueError as exc:
    ...     print(exc)
    calibration data: input 'x' contains NaN
"""

from __future__ import annotations

MAX_MESSAGE_CHARS = 400
"""Where :func:`one_line` cuts a third-party message (onnx.checker, onnxruntime)."""


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


class ModelError(ValueError):
    """The ONNX model cannot be read, validated or handled (one-line message naming file/node/op).

    Example:
        >>> str(ModelError("model 'a.onnx': file not found"))
        "model 'a.onnx': file not found"
    """


class DataError(ValueError):
    """Calibration data does not fit the model (one-line message naming the input).

    Example:
        >>> isinstance(DataError("calibration data: no samples"), ValueError)
        True
    """


class OutputError(ValueError):
    """An output path cannot be written (missing or read-only folder, the input model...);
    raised before any work is done.

    Example:
        >>> str(OutputError("output 'out/q.onnx': folder 'out' does not exist"))
        "output 'out/q.onnx': folder 'out' does not exist"
    """


class MissingDependencyError(ImportError):
    """An optional dependency (extra) is needed for the requested feature.

    Example:
        >>> str(MissingDependencyError("reading images needs Pillow: pip install 'quant-onnx[images]'"))[:22]
        'reading images needs P'
    """
