"""Vitis AI's ``quant_info.json``: the bit width and fix position of every quantized
tensor, the file ``pytorch_nndct``'s quantizer writes and reads back.

Layout (keys are ``<graph name>::<tensor name>``, each value a list with one
``[bit_width, fix_position]`` pair; ``null`` position: not quantized)::

    {"param":  {"net::conv1.weight_quantized": [[8, 7]], "net::conv1.bias_quantized": [[8, 6]]},
     "input":  {"net::input": [[8, 6]]},
     "output": {"net::/conv1/Conv_output_0": [[8, 4]]},
     "fast_finetuned": false, "bias_corrected": false, "version": "quant-npu-export 0.1.0"}

``param`` names the integer initializers of weights, biases and constant operands,
``input`` the graph inputs, ``output`` every other activation by the float tensor its
QuantizeLinear reads. Only the NPU's tensors are listed: those that only CPU partitions
read and write (:func:`~quant_npu.partitions.deployment_selection`, as ``check`` selects
them) are left out. :func:`import_quant_info` applies such a file to a QDQ model (fix
positions of activations; parameters requantized from their exact real values).

Example:
    >>> parse_key("ResNet::layer1.conv.weight")
    'layer1.conv.weight'
"""

from __future__ import annotations

import json
import numbers
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import onnx

from quant_core.errors import DataError, ModelError
from quant_core.onnx_qdq.reader import QDQGraph, QuantTensor
from quant_npu.partitions import CpuSelection, cpu_steps, deployment_selection
from quant_npu.plan import plan
from quant_npu.profile import NPUProfile, load_profile
from quant_npu.rewrite import ModelEditor, quantize_real
from quant_npu.violations import NOT_QUANTIZED, QUANTIZE_FIRST, is_quantized

ModelSource = str | os.PathLike[str] | onnx.ModelProto
SECTIONS = ("param", "input", "output")


def parse_key(key: str) -> str:
    """The tensor name of a ``quant_info.json`` key (the part after ``::``)."""
    return key.split("::", 1)[1] if "::" in key else key


def _position(tensor: QuantTensor) -> int:
    pos = tensor.fix_pos
    if pos is None:
        raise ModelError(
            f"tensor {tensor.key!r}: {tensor.describe()} is not a power of two; run quant-npu legalize first"
        )
    if np.unique(pos).size != 1:
        raise ModelError(f"tensor {tensor.key!r}: one position per channel; quant_info.json holds one per tensor")
    return int(pos.reshape(-1)[0])


def _cpu_only(qdq: QDQGraph, profile: NPUProfile, cpu: CpuSelection) -> set[str]:
    """Keys of the tensors that no NPU node reads or writes. The CPU runs them in float with
    whatever scales quantize gave them (a classifier's float Gemm keeps its int8 weights
    at a float scale), so they have no fix position and the device never loads them."""
    on_cpu = {id(node) for step in cpu_steps(qdq, plan(qdq, profile), cpu) for node in step.nodes}
    if not on_cpu:
        return set()
    found = set()
    for key, tensor in qdq.tensors.items():
        touching = qdq.readers(key)
        writer = qdq.producer(tensor.float_name) if tensor.float_name else None
        if writer is not None:
            touching.append(writer)
        if touching and all(id(node) in on_cpu for node in touching):
            found.add(key)
    return found


def export_quant_info(
    model: ModelSource,
    target: str | os.PathLike[str] | NPUProfile | None = None,
    *,
    cpu: CpuSelection | Iterable[str] | str | None = None,
) -> dict[str, Any]:
    """The ``quant_info.json`` data of the NPU partitions of a QDQ model with power-of-two
    scales. ``target`` and ``cpu`` select the CPU partitions as :func:`quant_npu.check.check`
    does; the tensors only they touch are left out.

    Example:
        >>> import numpy as np
        >>> from onnx import TensorProto, helper, numpy_helper
        >>> inits = [numpy_helper.from_array(np.array(0.125, np.float32), "s"),
        ...          numpy_helper.from_array(np.array(0, np.int8), "z")]
        >>> nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
        ...          helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["y"])]
        >>> g = helper.make_graph(nodes, "net", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])], inits)
        >>> export_quant_info(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]))["input"]
        {'net::x': [[8, 3]]}
    """
    from quant_core.onnx_qdq.model_io import load_model
    from quant_npu import __version__

    loaded = load_model(model)
    qdq = QDQGraph(loaded)
    if not is_quantized(qdq):  # an empty file would read as "nothing to quantize", not as a mistake
        raise ModelError(f"{NOT_QUANTIZED}: {QUANTIZE_FIRST}")
    cpu_only = _cpu_only(qdq, load_profile(target), deployment_selection(loaded, cpu))
    prefix = loaded.graph.name or "model"
    data: dict[str, Any] = {section: {} for section in SECTIONS}
    for key, tensor in qdq.tensors.items():
        if key in cpu_only:
            continue
        entry = [[tensor.bits, _position(tensor)]]
        if tensor.is_constant:
            data["param"].setdefault(f"{prefix}::{tensor.initializer}", entry)
        elif tensor.float_name is not None:
            section = "input" if qdq.index.is_graph_input(tensor.float_name) else "output"
            data[section].setdefault(f"{prefix}::{tensor.float_name}", entry)
    data.update({"fast_finetuned": False, "bias_corrected": False, "version": f"quant-npu-export {__version__}"})
    return data


def dumps(data: Mapping[str, Any]) -> str:
    """JSON text in Vitis AI's layout: one tensor entry per line.

    Example:
        >>> print(dumps({"param": {"m::w": [[8, 7]]}, "version": "x"}))
        {
          "param": {
            "m::w": [[8, 7]]
          },
          "version": "x"
        }
    """
    blocks = []
    for key, value in data.items():
        if isinstance(value, Mapping):
            lines = [f"    {json.dumps(k)}: {json.dumps(v)}" for k, v in value.items()]
            body = "{\n" + ",\n".join(lines) + "\n  }" if lines else "{}"
            blocks.append(f"  {json.dumps(key)}: {body}")
        else:
            blocks.append(f"  {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(blocks) + "\n}\n"


def write_quant_info(
    model: ModelSource,
    path: str | os.PathLike[str],
    target: str | os.PathLike[str] | NPUProfile | None = None,
    *,
    cpu: CpuSelection | Iterable[str] | str | None = None,
) -> dict[str, Any]:
    """:func:`export_quant_info` written to ``path`` (atomically); returns the data."""
    from quant_core.atomic_io import atomic_write

    data = export_quant_info(model, target, cpu=cpu)
    atomic_write(path, dumps(data))
    return data


@attrs.frozen(eq=False)
class ImportResult:
    """The model with the file's positions, and what did not match.

    Example:
        >>> ImportResult(onnx.ModelProto(), 3, ("net::gone",), ()).unmatched
        ('net::gone',)
    """

    model: onnx.ModelProto
    applied: int
    unmatched: tuple[str, ...]
    not_in_file: tuple[str, ...]


_FLOAT32 = np.finfo(np.float32)
POSITIONS = (1 - _FLOAT32.maxexp, _FLOAT32.nmant - _FLOAT32.minexp)
"""The fix positions whose scale ``2**-pos`` a float32 holds: beyond them it is infinite or
0, and a QuantizeLinear with scale 0 divides by zero (-127 and 149)."""


def _integer(value: Any) -> bool:
    # bool is an int to Python, but true as a bit width is a mistake, not 1
    return isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_)


def _entry(key: str, value: Any) -> tuple[int, int | None]:
    allowed = f"quant_info: entry {key!r} is {value!r}; allowed: [[bit_width, fix_position]] (integers)"
    pair = value[0] if isinstance(value, list | tuple) and len(value) == 1 else None
    if not isinstance(pair, list | tuple) or len(pair) != 2:
        raise DataError(allowed)
    bits, pos = pair
    if not _integer(bits) or not (pos is None or _integer(pos)):  # int() would truncate 8.7 to 8
        raise DataError(allowed)
    if pos is not None and not POSITIONS[0] <= pos <= POSITIONS[1]:
        raise DataError(
            f"quant_info: entry {key!r}: fix position {pos} is out of range; "
            f"allowed: {POSITIONS[0]} to {POSITIONS[1]} (2**-pos a finite non-zero float32)"
        )
    return int(bits), None if pos is None else int(pos)


def _entries(info: Mapping[str, Any]) -> dict[str, tuple[int, int | None]]:
    entries: dict[str, tuple[int, int | None]] = {}
    for section in SECTIONS:
        block = info.get(section, {})
        if not isinstance(block, Mapping):
            raise ModelError(f"quant_info: section {section!r} must be an object of tensor entries")
        for key, value in block.items():
            entries[parse_key(key)] = _entry(key, value)
    return entries


def load_quant_info(source: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    """The data of a ``quant_info.json`` file (or the mapping itself)."""
    if isinstance(source, Mapping):
        return dict(source)
    path = Path(source)
    if not path.is_file():
        raise ModelError(f"quant_info: file '{path}' not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ModelError(f"quant_info: '{path}' is not UTF-8 text (byte {exc.start}); allowed: a JSON file") from None
    except json.JSONDecodeError as exc:
        raise ModelError(f"quant_info: '{path}' is not valid JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(data, dict):
        raise ModelError(f"quant_info: '{path}' must hold a JSON object")
    return data


def _storage(bits: int, tensor: QuantTensor) -> tuple[int, int]:
    """An activation's stored type and zero point: unsigned ones stay unsigned (the x86
    encoding, zero point at mid-range); a constant is always stored signed
    (:func:`_signed`), since it is written with zero point 0."""
    unsigned = {8: onnx.TensorProto.UINT8, 16: onnx.TensorProto.UINT16}
    if not tensor.signed and not tensor.is_constant and bits in unsigned:
        return unsigned[bits], 2 ** (bits - 1)
    return _signed(bits, tensor), 0


def _signed(bits: int, tensor: QuantTensor) -> int:
    signed = {8: onnx.TensorProto.INT8, 16: onnx.TensorProto.INT16, 32: onnx.TensorProto.INT32}
    if bits not in signed:
        raise ModelError(f"quant_info: tensor {tensor.key!r}: bit width {bits}; allowed: 8, 16, 32")
    return signed[bits]


def import_quant_info(
    model: ModelSource,
    info: str | os.PathLike[str] | Mapping[str, Any],
    target: str | os.PathLike[str] | NPUProfile | None = None,
) -> ImportResult:
    """``model`` (never modified) with the positions and bit widths of ``info``: each
    activation's QuantizeLinear/DequantizeLinear get ``2**-pos`` (symmetric), each
    parameter is requantized from its exact real values with the profile's rounding.
    Tensors are matched by name (see the module docstring)."""
    from quant_core.onnx_qdq.model_io import check_model, load_model

    profile = load_profile(target)
    work = load_model(model)
    qdq = QDQGraph(work)
    entries = _entries(load_quant_info(info))
    editor = ModelEditor(work)
    matched: set[str] = set()
    missing: list[str] = []
    for key, tensor in qdq.tensors.items():
        name = tensor.initializer if tensor.is_constant else tensor.float_name
        if name is None or name not in entries:
            missing.append(name or key)
            continue
        matched.add(name)
        bits, pos = entries[name]
        if pos is None:
            continue
        elem_type, zero_point = _storage(bits, tensor)
        if tensor.is_constant:
            info_type = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
            limits = np.iinfo(info_type)
            # 8-bit parameters take the device's weight range ([-127, 127] on Quark's XINT8).
            low = profile.weight_qmin if bits == 8 else int(limits.min)
            rounding = profile.bias_rounding if bits > 8 else profile.weight_rounding
            codes, _clipped = quantize_real(tensor.real_values(), pos, low, int(limits.max), rounding)
            editor.set_constant(qdq, key, codes.astype(info_type), pos)
        else:
            editor.set_activation(qdq, key, pos, zero_point, elem_type)
    result = editor.finish()
    check_model(result, "<model with imported quant_info>")
    unmatched = tuple(sorted(set(entries) - matched))
    return ImportResult(result, len(matched), unmatched, tuple(missing))
