"""``QatProcessor``: Vitis AI's quantization-aware training flow. :meth:`~QatProcessor.trainable_model`
is ``quant_torch_fx``'s QAT model (power-of-two thresholds learned with TQT for the ``xint8``
preset; batch norm simulated folded) that you train with your own loop;
:meth:`~QatProcessor.to_deployable` freezes it and writes the deployable files.

Example:
    >>> import torch, tempfile
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(576, 2))
    >>> processor = QatProcessor(net, torch.randn(1, 1, 14, 14), quiet=True)
    >>> trainable = processor.trainable_model()
    >>> opt = torch.optim.SGD(trainable.parameters(), lr=0.01)
    >>> for _ in range(2):
    ...     opt.zero_grad()
    ...     trainable(torch.randn(8, 1, 14, 14)).square().mean().backward()
    ...     opt.step()
    >>> deployable = processor.to_deployable(trainable, tempfile.mkdtemp())
    >>> deployable(torch.randn(3, 1, 14, 14)).shape
    torch.Size([3, 2])
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quant_core.config import QuantConfig
from quant_core.errors import ModelError
from quant_core.serialization import save_config
from quant_npu.vitis.deploy import deploy
from quant_npu.vitis.options import (
    Target,
    check_bitwidth,
    check_runs,
    input_tuple,
    model_name,
    resolve_device,
    resolve_quant_config,
    resolve_target,
)
from quant_npu.vitis.state import CONFIG_FILE
from quant_torch_fx import ModelQuantizer, quantized_graphs


class QatProcessor:
    """Vitis AI's ``QatProcessor`` on the torch backend (see the module docstring).

    Args:
        model: the float model (never modified).
        inputs: example inputs: a tensor or a tuple of tensors.
        bitwidth: 8 (the NPU's int8).
        device: where the trainable model lives (default: the CPU).
        quant_config_file: a ``quant_core`` config JSON (default: the ``xint8`` preset).
        target: a ``quant_npu`` profile name or JSON file (default ``xint8``).
        qat_method: ``"auto"`` (TQT for power-of-two specs), ``"tqt"``, ``"lsq"`` or ``"ste"``.
        quiet: no progress bars.

    Example:
        >>> QatProcessor(torch.nn.ReLU(), [torch.zeros(1, 2)], bitwidth=16)
        Traceback (most recent call last):
        ...
        quant_core.errors.ConfigError: bitwidth: 16 is not allowed; allowed: 8 (the NPU's int8; other widths: a quant_config_file)
    """

    def __init__(
        self,
        model: nn.Module,
        inputs: torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor],
        bitwidth: int = 8,
        device: torch.device | str | None = None,
        *,
        quant_config_file: str | os.PathLike[str] | QuantConfig | None = None,
        target: Target = None,
        qat_method: str = "auto",
        quiet: bool = False,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ModelError(f"model: {type(model).__name__} is not allowed; allowed: a torch.nn.Module")
        self.model = model
        self.inputs = input_tuple(inputs, "inputs")
        check_runs(model, self.inputs, "inputs")
        check_bitwidth(bitwidth)
        self.device = resolve_device(device)
        self.profile = resolve_target(target)
        self.config = resolve_quant_config(quant_config_file)
        self._quantizer = ModelQuantizer(self.config, qat_method=qat_method, quiet=quiet)

    def trainable_model(self, calib_loader: Iterable[Any] | None = None, num_batches: int | None = None) -> nn.Module:
        """The QAT model (train mode) to train with your own loop. Learnable qparams start
        from a calibration over ``calib_loader`` when given, else from the first training batch."""
        qat = self._quantizer.prepare_qat(self.model, self.inputs, calib_loader=calib_loader, num_batches=num_batches)
        return qat.to(self.device)

    def to_deployable(self, trained_model: nn.Module, output_dir: str | os.PathLike[str] = "qat_result") -> nn.Module:
        """Freeze ``trained_model`` (qparams fixed, batch norm folded, int32 bias) and write
        ``<Model>_int.onnx`` (legalised for ``target``), ``legalize_report.json``,
        ``quant_info.json`` and ``quant_config.json`` into ``output_dir``. Returns the frozen
        model (eval mode), which computes what the exported model computes."""
        if not isinstance(trained_model, nn.Module) or not quantized_graphs(trained_model):
            raise ModelError(
                f"trained_model: {type(trained_model).__name__} holds no quantized graph; "
                "allowed: the module trainable_model() returned"
            )
        frozen = self._quantizer.freeze(trained_model)
        out = Path(output_dir)
        deploy(
            self._quantizer,
            frozen,
            tuple(t.to(self.device) for t in self.inputs),
            out,
            self.profile,
            model_name(self.model),
        )
        save_config(self.config, out / CONFIG_FILE)
        return frozen
