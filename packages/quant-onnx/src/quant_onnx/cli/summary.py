"""The paragraph ``quant-onnx quantize`` prints after a successful run: what was quantized
and in which formats (read back from the written model), what stayed float, the file
size against the input's, the time taken and where the report is.

Example:
    >>> print(size_text(2_831_701))
    2.8 MB
"""

from __future__ import annotations

import collections
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import onnx

from quant_core.onnx_qdq.describe import describe_formats, describe_quantized
from quant_core.onnx_qdq.tensor_data import all_tensors, external_data_info, uses_external_data


def size_text(size: int) -> str:
    """Bytes as a short human-readable size (kB/MB/GB, powers of 1000)."""
    value = float(size)
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} GB"  # pragma: no cover


def file_size(path: str | os.PathLike[str]) -> int:
    """Size of an ONNX file on disk, its external data files included."""
    model_path = Path(path)
    total = model_path.stat().st_size
    model = onnx.load(str(model_path), load_external_data=False)
    files = {external_data_info(t).get("location", "") for t in all_tensors(model) if uses_external_data(t)}
    for location in sorted(files - {""}):
        data = model_path.parent / location
        if data.is_file():
            total += data.stat().st_size
    return total


def _counts(op_types: Iterable[str], limit: int = 6) -> str:
    counted = collections.Counter(op_types).most_common()
    text = ", ".join(f"{op} {n}" for op, n in counted[:limit])
    return text + (f" and {len(counted) - limit} more op types" if len(counted) > limit else "")


def quantize_summary(
    *,
    model: onnx.ModelProto,
    input_path: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    seconds: float,
    config_name: str | None = None,
    quantized_nodes: Iterable[tuple[str, str]] | None = None,
    float_nodes: Iterable[tuple[str, str]] = (),
    algorithms: Mapping[str, object] | None = None,
    report_path: str | os.PathLike[str] | None = None,
    float_reasons: str = "`quant-onnx inspect` gives the reasons",
) -> str:
    """One paragraph: ``quantized_nodes`` and ``float_nodes`` are ``(name, op_type)`` pairs
    from the plan (``None``: counted from the written model); formats are read from
    ``model``, the written one. ``float_reasons`` follows the count of float nodes."""
    info = describe_quantized(model)
    preset = f" with {config_name}" if config_name else ""
    parts = [f"Quantized '{input_path}' -> '{output_path}'{preset} in {seconds:.1f} s."]
    if info is None:
        parts.append("Nothing was quantized: no node matched the config.")
    else:
        if quantized_nodes is not None:
            ops = [op for _name, op in quantized_nodes]
        else:
            ops = [op for op, n in info.quantized_ops.items() for _ in range(n)]
        parts.append(f"{len(ops)} nodes run quantized ({_counts(ops)}) in {info.format} format:")
        kinds = (("weights", info.weights), ("activations", info.activations))
        parts.append("; ".join(f"{label} {describe_formats(found)}" for label, found in kinds if found) + ".")
    floats = [op for _name, op in float_nodes]
    if floats:
        parts.append(f"Stayed float: {len(floats)} nodes ({_counts(floats)}); {float_reasons}.")
    else:
        parts.append("No node stayed float.")
    if algorithms:
        parts.append(f"Accuracy recovery: {', '.join(algorithms)}.")
    before, after = file_size(input_path), file_size(output_path)
    parts.append(f"File {size_text(before)} -> {size_text(after)} ({after / max(before, 1):.2f}x).")
    if report_path is not None:
        parts.append(f"Report: '{report_path}'.")
    else:
        parts.append("No report written (--report FILE gives every scale, range and the per-layer SQNR).")
    return " ".join(parts)
