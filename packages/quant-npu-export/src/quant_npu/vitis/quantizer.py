"""``torch_quantizer``: Vitis AI's post-training flow, one process per mode.

``quant_mode="calib"``: :attr:`~torch_quantizer.quant_model` observes every tensor while
your own evaluation loop runs it over calibration data (it computes in float meanwhile);
:meth:`~torch_quantizer.export_quant_config` turns what it saw into qparams
(``quant_torch_fx``'s calibration with the ``xint8`` preset) and writes them into
``output_dir`` (``quant_config.json``, ``qparams.json``, and Vitis AI's ``quant_info.json``
of the model legalised for ``target``).

``quant_mode="test"``: the same model and example inputs, in a later process; ``quant_model``
computes with the qparams read from ``output_dir`` (bit for bit what the calibration
process's model computed), and :meth:`~torch_quantizer.export_onnx_model` writes the QDQ
ONNX model legalised and checked for ``target`` (``<Model>_int.onnx``).

Example:
    >>> import torch, tempfile
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(576, 2))
    >>> x, out = torch.randn(1, 1, 14, 14), tempfile.mkdtemp()
    >>> quantizer = torch_quantizer("calib", net, (x,), output_dir=out)
    >>> with torch.no_grad():
    ...     for _ in range(2):
    ...         _ = quantizer.quant_model(torch.randn(8, 1, 14, 14))
    >>> quantizer.export_quant_config().name == out.split("/")[-1]
    True
    >>> tester = torch_quantizer("test", net, (x,), output_dir=out)
    >>> tester.export_onnx_model().name
    'Sequential_int.onnx'
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quant_core.algorithm_config import AdaRoundConfig
from quant_core.atomic_io import atomic_write
from quant_core.config import QuantConfig
from quant_core.errors import ConfigError, DataError, ModelError
from quant_npu.vitis.deploy import deploy, legalized, onnx_name, write_quant_info
from quant_npu.vitis.options import (
    Target,
    check_bitwidth,
    check_runs,
    input_tuple,
    load_state_dict_file,
    model_name,
    resolve_device,
    resolve_quant_config,
    resolve_target,
)
from quant_npu.vitis.quant_model import QuantModel
from quant_npu.vitis.state import apply_state, describe_model, read_config, read_state, write_state
from quant_torch_fx import ModelQuantizer, finish_calibration, start_observing

QUANT_MODES = ("calib", "test")
FINETUNE_FILE = "fast_finetune.pth"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class torch_quantizer:  # the name Vitis AI users know (lower case)
    """Vitis AI's ``torch_quantizer`` on the torch backend (see the module docstring).

    Args:
        quant_mode: ``"calib"`` (observe, then :meth:`export_quant_config`) or ``"test"``
            (compute with the qparams in ``output_dir``, :meth:`export_onnx_model`).
        module: the float model (never modified).
        input_args: example inputs: a tensor or a tuple of tensors (any batch size later).
        state_dict_file: float weights to load into a copy of ``module`` first (``torch.save`` file).
        output_dir: where calibration writes its files and test mode reads them.
        bitwidth: 8 (the NPU's int8).
        device: where ``quant_model`` runs (default: the CPU).
        quant_config_file: a ``quant_core`` config JSON (default: the ``xint8`` preset).
        target: a ``quant_npu`` profile name or JSON file (default ``xint8``).
        quiet: no progress bars (``fast_finetune``).

    Example:
        >>> torch_quantizer("test", torch.nn.ReLU(), torch.zeros(1, 2), output_dir="/nonexistent")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        quant_core.errors.ConfigError: output_dir: '/nonexistent/quant_config.json' does not exist; quant_mode 'test' needs the files of a 'calib' run ...
    """

    def __init__(
        self,
        quant_mode: str,
        module: nn.Module,
        input_args: torch.Tensor | Sequence[torch.Tensor] | None = None,
        state_dict_file: str | os.PathLike[str] | None = None,
        output_dir: str | os.PathLike[str] = "quantize_result",
        bitwidth: int = 8,
        device: torch.device | str | None = None,
        quant_config_file: str | os.PathLike[str] | QuantConfig | None = None,
        target: Target = None,
        *,
        quiet: bool = False,
    ) -> None:
        if not isinstance(quant_mode, str) or quant_mode not in QUANT_MODES:
            raise ConfigError(f"quant_mode: {quant_mode!r} is not allowed; allowed: {', '.join(QUANT_MODES)}")
        if not isinstance(module, nn.Module):
            raise ModelError(f"module: {type(module).__name__} is not allowed; allowed: a torch.nn.Module")
        self.quant_mode = quant_mode
        self.inputs = input_tuple(input_args)
        check_bitwidth(bitwidth)
        self.device = resolve_device(device)
        self.profile = resolve_target(target)
        self.output_dir = Path(output_dir)
        self.module = load_state_dict_file(module, state_dict_file)
        self.name = model_name(module)
        self._model_facts = describe_model(module, self.inputs)
        if quant_mode == "test":
            chosen = None if quant_config_file is None else resolve_quant_config(quant_config_file)
            self.config = read_config(self.output_dir, chosen)
            self._state = read_state(self.output_dir, self._model_facts)
        else:
            self.config = resolve_quant_config(quant_config_file)
        self.quiet = quiet
        self._quantizer = ModelQuantizer(self.config, quiet=quiet)
        prepared = self._prepare(self._quantizer)
        self.fast_finetuned = False
        if quant_mode == "test":
            apply_state(prepared, self._state, self.output_dir)
            self.fast_finetuned = bool(self._state.get("fast_finetuned"))
            self._observing = None
        else:
            self._observing = start_observing(prepared)
        self.quant_model = QuantModel(prepared.eval(), self._device_inputs())
        """The model to run: observing in calib mode, quantized in test mode."""

    # ------------------------------------------------------------------------------ helpers
    def _device_inputs(self) -> tuple[torch.Tensor, ...]:
        return tuple(t.to(self.device) for t in self.inputs)

    def _prepare(self, quantizer: ModelQuantizer) -> nn.Module:
        check_runs(self.module, self.inputs)
        return quantizer.prepare(self.module, self.inputs).to(self.device)

    def _require(self, mode: str, what: str) -> None:
        if self.quant_mode != mode:
            other = "export_quant_config, fast_finetune" if mode == "calib" else "export_onnx_model, load_ft_param"
            raise ConfigError(f"{what}: not allowed with quant_mode {self.quant_mode!r}; allowed in {mode!r} ({other})")

    def _finish(self) -> None:
        if self._observing is None:
            return
        if self.quant_model.batches_seen == 0:
            raise DataError(
                "export_quant_config: quant_model has not run on any data; allowed: run your evaluation loop "
                "with quantizer.quant_model over calibration data first"
            )
        finish_calibration(self.quant_model.inner, self._observing)
        self._observing = None

    # ------------------------------------------------------------------------------- calib
    def export_quant_config(self) -> Path:
        """Calib mode: finish calibration and write ``quant_config.json``, ``qparams.json`` and
        ``quant_info.json`` (of the model legalised for ``target``) into ``output_dir``.
        Returns ``output_dir``. ``quant_model`` computes quantized from now on."""
        self._require("calib", "export_quant_config")
        self._finish()
        inner = self.quant_model.inner
        write_state(self.output_dir, self.config, inner, self._model_facts, fast_finetuned=self.fast_finetuned)
        result = legalized(self._quantizer, inner, self._device_inputs(), self.profile)
        write_quant_info(result, self.output_dir, fast_finetuned=self.fast_finetuned)
        return self.output_dir

    def fast_finetune(self, run_fn: Callable[..., Any], run_args: Sequence[Any]) -> None:
        """Calib mode: AdaRound over the batches ``run_fn(*run_args)`` feeds to ``quant_model``
        (Vitis AI: ``quantizer.fast_finetune(evaluate, (quant_model, loader, loss_fn))``).
        The config's ``AdaRoundConfig`` is used, else the default one; the model is calibrated
        on those batches, then ``quant_model`` computes quantized, and the finetuned state is
        written to ``output_dir/fast_finetune.pth`` for :meth:`load_ft_param`. Needs a torch
        backend that runs AdaRound; otherwise fails with one line saying so, before ``run_fn`` runs."""
        self._require("calib", "fast_finetune")
        config = self.config
        if config.algorithm("adaround") is None:
            config = config.evolve(algorithms=(*config.algorithms, AdaRoundConfig()))
        try:
            finetuner = ModelQuantizer(config, quiet=self.quiet)
        except ValueError as exc:
            raise RuntimeError(
                f"fast_finetune: AdaRound does not run on this torch backend ({_first_line(exc)}); "
                "quantize without fast_finetune, or use quant-onnx's AdaRound on the float ONNX model"
            ) from None
        self.quant_model.recorded = []
        try:
            run_fn(*run_args)
            batches = self.quant_model.recorded
        finally:
            self.quant_model.recorded = None
        if not batches:
            raise DataError(
                "fast_finetune: run_fn did not call quant_model; allowed: a function that runs it over data"
            )
        finetuned = finetuner.quantize_model(self.module, self.inputs, batches)
        self.quant_model.inner = finetuned.to(self.device).eval()
        self._quantizer, self.config = finetuner, config
        self._observing = None
        self.fast_finetuned = True
        self.output_dir.mkdir(parents=True, exist_ok=True)
        tensors = {k: v for k, v in finetuned.state_dict().items() if isinstance(v, torch.Tensor)}
        buffer = io.BytesIO()
        torch.save(tensors, buffer)
        atomic_write(self.output_dir / FINETUNE_FILE, buffer.getvalue())

    # -------------------------------------------------------------------------------- test
    def load_ft_param(self) -> None:
        """Test mode: load the state :meth:`fast_finetune` wrote (``output_dir/fast_finetune.pth``)."""
        self._require("test", "load_ft_param")
        path = self.output_dir / FINETUNE_FILE
        if not path.is_file():
            raise ConfigError(
                f"output_dir: {str(path)!r} does not exist; run fast_finetune in quant_mode 'calib' first"
            )
        inner = self.quant_model.inner
        result = inner.load_state_dict(torch.load(path, map_location=self.device, weights_only=True), strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing or result.unexpected_keys:
            raise ModelError(
                f"output_dir: {str(path)!r} does not fit this model "
                f"(missing: {', '.join(missing) or 'none'}; unexpected: {', '.join(result.unexpected_keys) or 'none'})"
            )
        apply_state(inner, self._state, self.output_dir)

    def export_onnx_model(
        self, output_dir: str | os.PathLike[str] | None = None, opset_version: int | None = None
    ) -> Path:
        """Test mode: write ``<Model>_int.onnx`` (QDQ, legalised for ``target``),
        ``legalize_report.json`` and ``quant_info.json`` into ``output_dir`` (default: the
        quantizer's). Warns, naming the rules, when the model still breaks one. Returns the model's path."""
        self._require("test", "export_onnx_model")
        out = self.output_dir if output_dir is None else Path(output_dir)
        inner, inputs = self.quant_model.inner, self._device_inputs()
        deploy(
            self._quantizer,
            inner,
            inputs,
            out,
            self.profile,
            self.name,
            fast_finetuned=self.fast_finetuned,
            opset=opset_version,
        )
        return out / onnx_name(self.name)
