"""From a quantized torch model to the files a deployment reads: the QDQ ONNX model
(``quant_torch_fx``'s export) legalised for the target profile (``<Model>_int.onnx``), what
legalisation changed and what still breaks a rule (``legalize_report.json``), and Vitis AI's
``quant_info.json`` of the legalised model. A model that still breaks a rule is written
anyway, with a warning naming the rules (the report lists every violation).

Example:
    >>> import torch
    >>> from quant_torch_fx import ModelQuantizer
    >>> import tempfile, pathlib
    >>> from quant_npu.vitis.options import resolve_target
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU())
    >>> q = ModelQuantizer("xint8", quiet=True)
    >>> x = torch.randn(1, 1, 8, 8)
    >>> qmodel = q.quantize_model(net, x, [torch.randn(4, 1, 8, 8)])
    >>> out = pathlib.Path(tempfile.mkdtemp())
    >>> result = deploy(q, qmodel, (x,), out, resolve_target("xint8"), "Net")
    >>> result.remaining.ok, sorted(p.name for p in out.iterdir())
    (True, ['Net_int.onnx', 'legalize_report.json', 'quant_info.json'])
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any

from torch import nn

from quant_core.atomic_io import atomic_write
from quant_core.serialization import report_json
from quant_npu.legalize import LegalizeResult, legalize_model
from quant_npu.profile import NPUProfile
from quant_npu.quant_info import dumps, export_quant_info
from quant_torch_fx import DEFAULT_OPSET, ModelQuantizer

QUANT_INFO_FILE = "quant_info.json"
REPORT_FILE = "legalize_report.json"


def onnx_name(name: str) -> str:
    """The deployable model's file name, as Vitis AI names it."""
    return f"{name}_int.onnx"


def legalized(
    quantizer: ModelQuantizer,
    model: nn.Module,
    inputs: tuple[Any, ...],
    profile: NPUProfile,
    opset: int | None = None,
) -> LegalizeResult:
    """``model`` exported to QDQ ONNX by ``quantizer`` (``opset``: its default) and legalised for ``profile``."""
    with tempfile.TemporaryDirectory(prefix="quant_npu_vitis_") as tmp:
        path = quantizer.export_onnx(model, inputs, Path(tmp) / "qdq.onnx", opset=opset or DEFAULT_OPSET)
        return legalize_model(path, profile)


def write_quant_info(result: LegalizeResult, output_dir: Path, *, fast_finetuned: bool = False) -> Path:
    """``quant_info.json`` of the legalised model into ``output_dir`` (atomically)."""
    data = export_quant_info(result.model)
    data["fast_finetuned"] = fast_finetuned
    path = output_dir / QUANT_INFO_FILE
    atomic_write(path, dumps(data))
    return path


def deploy(
    quantizer: ModelQuantizer,
    model: nn.Module,
    inputs: tuple[Any, ...],
    output_dir: Path,
    profile: NPUProfile,
    name: str,
    *,
    fast_finetuned: bool = False,
    opset: int | None = None,
) -> LegalizeResult:
    """Write ``<name>_int.onnx``, ``legalize_report.json`` and ``quant_info.json`` into ``output_dir``."""
    from quant_core.onnx_qdq.model_io import save_model

    result = legalized(quantizer, model, inputs, profile, opset)
    output_dir.mkdir(parents=True, exist_ok=True)
    save_model(result.model, output_dir / onnx_name(name))
    atomic_write(output_dir / REPORT_FILE, report_json(result.to_dict()))
    write_quant_info(result, output_dir, fast_finetuned=fast_finetuned)
    if not result.remaining.ok:
        counts = ", ".join(f"{rule} {n}" for rule, n in sorted(result.remaining.counts().items()))
        warnings.warn(
            f"{onnx_name(name)}: still breaks target '{profile.name}' after legalisation ({counts}); "
            f"see {output_dir / REPORT_FILE}",
            stacklevel=3,
        )
    return result
