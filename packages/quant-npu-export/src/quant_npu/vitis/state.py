"""What calibration leaves in ``output_dir`` for a test-mode process to start from: the
config (``quant_config.json``, ``quant_core``'s format) and every quantizer's qparams
(``qparams.json``), keyed by the quantizer ``quant_torch_fx`` gives the same model and
config, with what the calibration saw of the model (its class and input shapes) so that a
different model is refused rather than given the wrong qparams.

Example:
    >>> from quant_core.qparams import QParams, qparams_from_data, qparams_to_data
    >>> qp = QParams.per_tensor(0.25, 0, "int8")
    >>> qparams_from_data(qparams_to_data(qp)) == qp
    True
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from quant_core.atomic_io import atomic_write
from quant_core.config import QuantConfig
from quant_core.errors import ConfigError, DataError, ModelError
from quant_core.qparams import qparams_from_data, qparams_to_data
from quant_core.serialization import config_to_json, load_config, save_config
from quant_torch_fx import named_quantizers

CONFIG_FILE = "quant_config.json"
QPARAMS_FILE = "qparams.json"
FORMAT = "quant_npu.vitis qparams"
FORMAT_VERSION = 1


def describe_model(module: nn.Module, inputs: tuple[Any, ...]) -> dict[str, Any]:
    """What a qparams file records of the model it belongs to."""
    return {"class": type(module).__name__, "input_shapes": [list(t.shape) for t in inputs]}


def write_state(
    output_dir: Path, config: QuantConfig, prepared: nn.Module, model: dict[str, Any], *, fast_finetuned: bool
) -> None:
    """Write ``quant_config.json`` and ``qparams.json`` of a calibrated model (atomically)."""
    graphs = [
        {name: qparams_to_data(fq.current_qparams()) for name, fq in named.items()}
        for named in named_quantizers(prepared)
    ]
    data = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "model": model,
        "config": config.name,
        "fast_finetuned": fast_finetuned,
        "graphs": graphs,
    }
    output_dir.mkdir(parents=True, exist_ok=True)
    save_config(config, output_dir / CONFIG_FILE)
    atomic_write(output_dir / QPARAMS_FILE, json.dumps(data, indent=1) + "\n")


def _required(output_dir: Path, name: str) -> Path:
    path = output_dir / name
    if not path.is_file():
        raise ConfigError(
            f"output_dir: {str(path)!r} does not exist; quant_mode 'test' needs the files of a 'calib' run "
            f"({CONFIG_FILE}, {QPARAMS_FILE}: run quant_mode='calib' and export_quant_config() first)"
        )
    return path


def read_config(output_dir: Path, quant_config: QuantConfig | None) -> QuantConfig:
    """The config calibration used; ``quant_config`` (the test run's, if it named one) must match it."""
    saved = load_config(_required(output_dir, CONFIG_FILE))
    if quant_config is not None and config_to_json(quant_config) != config_to_json(saved):
        raise ConfigError(
            f"quant_config_file: differs from the config calibration used ({output_dir / CONFIG_FILE}); "
            "allowed: the same file as in quant_mode 'calib', or none"
        )
    return saved


def read_state(output_dir: Path, model: dict[str, Any]) -> dict[str, Any]:
    """The qparams file, checked to belong to ``model``."""
    path = _required(output_dir, QPARAMS_FILE)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        detail = exc.msg if isinstance(exc, json.JSONDecodeError) else f"not UTF-8 text at byte {exc.start}"
        raise ConfigError(f"output_dir: {str(path)!r} is not JSON ({detail}); run quant_mode='calib' again") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != FORMAT_VERSION:
        raise ConfigError(f"output_dir: {str(path)!r} is not a qparams file of version {FORMAT_VERSION} ({FORMAT})")
    saved = data["model"]
    if saved["class"] != model["class"]:
        raise ModelError(f"module: {model['class']} is not the model calibrated into {str(path)!r} ({saved['class']})")
    if saved["input_shapes"] != model["input_shapes"]:
        raise DataError(
            f"input_args: shapes {model['input_shapes']} differ from the calibration's {saved['input_shapes']} "
            f"({str(path)!r}); allowed: the same example input shapes"
        )
    return data


def apply_state(prepared: nn.Module, data: dict[str, Any], source: Path) -> None:
    """Give every quantizer of ``prepared`` its saved qparams and switch fake quantization on."""
    graphs = named_quantizers(prepared)
    saved = data["graphs"]
    if len(saved) != len(graphs):
        raise ModelError(f"output_dir: {str(source)!r} holds {len(saved)} graph(s); this model has {len(graphs)}")
    for named, entries in zip(graphs, saved, strict=True):
        missing, unexpected = sorted(set(named) - set(entries)), sorted(set(entries) - set(named))
        if missing or unexpected:
            raise ModelError(
                f"output_dir: {str(source)!r} does not fit this model's quantizers "
                f"(missing: {', '.join(missing) or 'none'}; unexpected: {', '.join(unexpected) or 'none'})"
            )
        for name, fq in named.items():
            fq.set_qparams(qparams_from_data(entries[name]))
            fq.observing, fq.quantizing = False, True
