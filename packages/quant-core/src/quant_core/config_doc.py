"""The config reference (``docs/config-reference.md``), generated from the attrs classes
themselves: every field of every class a config file can hold, its type, its default and
the description from the class docstring, so the reference cannot drift from the code.

Run ``python -m quant_core.config_doc docs/config-reference.md`` to rewrite the file (or
with no argument to print it); a test fails when the file is out of date.

Example:
    >>> text = config_reference()
    >>> "## QuantConfig" in text and "| `per_channel_axis` |" in text
    True
"""

from __future__ import annotations

import enum
import inspect
import json
import re
import sys
import typing
from pathlib import Path
from typing import Any

import attrs

from quant_core.algorithm_config import ALGORITHM_CONFIGS
from quant_core.config import CalibrationConfig, OperatorConfig, QuantConfig
from quant_core.observer_config import OBSERVER_CONFIGS
from quant_core.serialization import SCHEMA_VERSION, to_data
from quant_core.spec import QuantSpec

CLASSES: tuple[type, ...] = (
    QuantConfig,
    OperatorConfig,
    QuantSpec,
    CalibrationConfig,
    *OBSERVER_CONFIGS.values(),
    *ALGORITHM_CONFIGS.values(),
)
"""The classes a config file is made of, in reference order."""

_ARG = re.compile(r"^\s{4,8}(\w+(?:, \w+)*): (.*)$")


def field_descriptions(cls: type) -> dict[str, str]:
    """Field name -> description from the ``Args:`` (or ``Attributes:``) block of ``cls``'s
    docstring (continuation lines joined).

    Example:
        >>> field_descriptions(QuantSpec)["narrow_range"]
        'drop the lowest code (int8: [-127, 127]); symmetric specs only.'
    """
    doc = inspect.getdoc(cls) or ""
    out: dict[str, str] = {}
    current: list[str] | None = None
    in_block = False
    for line in doc.splitlines():
        if line.strip() in ("Args:", "Attributes:"):
            in_block = True
            continue
        if not in_block:
            continue
        if not line.strip() or line.strip() == "Example:":
            in_block = line.strip() != "Example:" and in_block
            current = None
            continue
        match = _ARG.match("    " + line)
        if match and line.startswith("    ") and not line.startswith("        "):
            names, text = match.groups()
            current = [text.strip()]
            for name in names.split(", "):
                out[name] = ""
            for name in names.split(", "):
                out[name] = " ".join(current)
            last = names.split(", ")
            continue
        if current is not None:
            current.append(line.strip())
            for name in last:
                out[name] = " ".join(current)
    return out


_MODULE_PREFIX = re.compile(
    r"\b(?:typing|collections\.abc|quant_core(?:\.\w+)*|config|spec|algorithm_config|observer_config)\."
)


def _type_name(annotation: Any) -> str:
    text = annotation.__name__ if isinstance(annotation, type) else str(annotation)
    return _MODULE_PREFIX.sub("", text).replace(" | ", " or ")


def _markdown(text: str) -> str:
    """Docstring markup as Markdown: ``code`` and :role:`name` become `code`; no table breaks."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text).replace("``", "`")
    return text.replace("|", "\\|")


def _default(field: attrs.Attribute) -> str:  # type: ignore[type-arg]
    default: Any = field.default
    if default is attrs.NOTHING:
        return "required"
    factory = getattr(default, "factory", None)
    if factory is not None:  # attrs.Factory
        default = factory()
    if isinstance(default, enum.Enum):
        return f"`{default.value}`"
    try:
        return f"`{json.dumps(to_data(default))}`"
    except TypeError:
        return f"`{default!r}`"


def class_section(cls: type) -> str:
    """One class: its summary line, its JSON tag, and a table of its fields.

    Example:
        >>> class_section(CalibrationConfig).splitlines()[0]
        '## CalibrationConfig'
    """
    doc = _markdown((inspect.getdoc(cls) or "").split("\n\n")[0].replace("\n", " "))
    hints = typing.get_type_hints(cls)
    described = field_descriptions(cls)
    lines = [f"## {cls.__name__}", "", doc, ""]
    for tag in ("method", "kind"):
        value = getattr(cls, tag, None)
        if isinstance(value, str) and tag not in {f.name for f in attrs.fields(cls)}:
            lines += [f'In JSON: `"{tag}": "{value}"`.', ""]
    lines += ["| field | type | default | meaning |", "|---|---|---|---|"]
    for field in attrs.fields(cls):
        if not field.init:
            continue
        meaning = _markdown(described.get(field.name, ""))
        lines.append(f"| `{field.name}` | {_type_name(hints[field.name])} | {_default(field)} | {meaning} |")
    return "\n".join(lines) + "\n"


def config_reference() -> str:
    """The whole reference (the body of ``docs/config-reference.md``)."""
    head = [
        "# Config reference",
        "",
        "Generated from the attrs classes by `python -m quant_core.config_doc docs/config-reference.md`;",
        "a test fails when this file is out of date. A config file is the JSON form of a",
        f'`QuantConfig` (`quant_core.save_config` / `load_config`) with `"schema_version": {SCHEMA_VERSION}`;',
        "unknown keys are errors, left-out fields take their defaults, and every value is",
        "checked where it is read (the error names the JSON path and the allowed values).",
        "",
    ]
    return "\n".join(head) + "\n" + "\n".join(class_section(cls) for cls in CLASSES)


def main(argv: list[str] | None = None) -> int:
    """Rewrite the given markdown file (or print the reference with no argument)."""
    args = sys.argv[1:] if argv is None else argv
    text = config_reference()
    if not args:
        sys.stdout.write(text)
        return 0
    Path(args[0]).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
