"""The arguments Vitis AI's entry points take, checked once for :class:`torch_quantizer` and
:class:`QatProcessor`: each bad value fails with one line naming the argument and what is
allowed.

Example:
    >>> import torch
    >>> [tuple(t.shape) for t in input_tuple(torch.zeros(1, 3))]
    [(1, 3)]
    >>> check_bitwidth(4)
    Traceback (most recent call last):
    ...
    quant_core.errors.ConfigError: bitwidth: 4 is not allowed; allowed: 8 (the NPU's int8; other widths: a quant_config_file)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from quant_core.config import QuantConfig
from quant_core.errors import ConfigError, DataError, ModelError
from quant_core.presets import resolve_config
from quant_npu.profile import NPUProfile, load_profile

PRESET = "xint8"
"""The preset every flow starts from unless a ``quant_config_file`` says otherwise: int8
symmetric power-of-two per tensor, the NPU's format."""

Target = str | os.PathLike[str] | NPUProfile | None


def input_tuple(input_args: Any, name: str = "input_args") -> tuple[torch.Tensor, ...]:
    """The model's example inputs as a tuple of tensors (a tensor, or a tuple/list of them)."""
    values = (input_args,) if isinstance(input_args, torch.Tensor) else input_args
    if not isinstance(values, tuple | list) or not values or not all(isinstance(v, torch.Tensor) for v in values):
        got = type(input_args).__name__
        raise DataError(f"{name}: {got} is not allowed; allowed: a tensor, or a tuple of tensors (the model's inputs)")
    return tuple(values)


def check_bitwidth(bitwidth: Any) -> int:
    """``bitwidth`` (8: the only width of the NPU's preset)."""
    if bitwidth != 8 or isinstance(bitwidth, bool):
        raise ConfigError(
            f"bitwidth: {bitwidth!r} is not allowed; allowed: 8 (the NPU's int8; other widths: a quant_config_file)"
        )
    return 8


def resolve_device(device: Any) -> torch.device:
    """``device`` as a ``torch.device`` (default: the CPU)."""
    if device is None:
        return torch.device("cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(
            f"device: {device!r} is not allowed; allowed: a torch.device or a name such as 'cpu'"
        ) from None


def resolve_target(target: Target) -> NPUProfile:
    """The ``quant_npu`` profile ``target`` names (default ``xint8``)."""
    try:
        return load_profile(target)
    except ValueError as exc:
        raise ConfigError(f"target: {exc}") from None


def resolve_quant_config(quant_config_file: str | os.PathLike[str] | QuantConfig | None) -> QuantConfig:
    """The config: a ``quant_core`` config JSON file, a preset name, a config, or the ``xint8`` preset."""
    is_path = isinstance(quant_config_file, os.PathLike) or str(quant_config_file).endswith(".json")
    if is_path and not Path(str(quant_config_file)).is_file():
        raise ConfigError(f"quant_config_file: {str(quant_config_file)!r} does not exist; allowed: a config JSON file")
    try:
        return resolve_config(quant_config_file, PRESET)
    except ValueError as exc:
        raise ConfigError(f"quant_config_file: {exc}") from None


def load_state_dict_file(module: torch.nn.Module, state_dict_file: str | os.PathLike[str] | None) -> torch.nn.Module:
    """``module``, or a copy holding the float weights of ``state_dict_file`` (``module`` is not changed)."""
    if state_dict_file is None:
        return module
    import copy

    path = Path(state_dict_file)
    if not path.is_file():
        raise ConfigError(f"state_dict_file: {str(path)!r} does not exist; allowed: a file torch.save wrote")
    state = torch.load(path, map_location="cpu", weights_only=True)
    loaded = copy.deepcopy(module)
    try:
        loaded.load_state_dict(state)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0]
        raise ModelError(f"state_dict_file: {str(path)!r} does not fit {type(module).__name__}: {first}") from None
    return loaded


def check_runs(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], name: str = "input_args") -> None:
    """Run ``module`` once on ``inputs`` (eval mode, no grad; its mode is restored): inputs
    that do not fit fail here, naming the argument, rather than deep inside ``torch.export``."""
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            module(*inputs)
    except Exception as exc:  # any failure of the user's forward on these inputs
        shapes = [list(t.shape) for t in inputs]
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        raise DataError(f"{name}: the module does not run on inputs of shapes {shapes}: {first}") from None
    finally:
        module.train(was_training)


def model_name(module: torch.nn.Module) -> str:
    """The name files of ``module`` take, as Vitis AI names them (the class name)."""
    return type(module).__name__
