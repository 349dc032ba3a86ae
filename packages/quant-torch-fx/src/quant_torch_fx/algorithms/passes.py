"""Run what a config's ``algorithms`` list asks for on the torch backend, in the ONNX
backend's order (``quant_onnx.algorithms.passes``): CLE and activation equalization on the
normalised float graph before planning and calibration; AdaRound, AdaQuant, then bias correction (it removes
the mean error the others leave) on the calibrated graph. Mixed precision and
SmoothQuant are not run here; :func:`check_algorithms` refuses them.

Example:
    >>> from quant_core.presets import get_preset
    >>> check_algorithms(get_preset("xint8"))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch.fx import GraphModule

from quant_algos.drivers.bias_correction import correct_biases
from quant_algos.drivers.reconstruction import ReconstructionReport, reconstruct_layers
from quant_algos.drivers.schedule import schedule
from quant_core.algorithm_config import (
    ActivationEqualizationConfig,
    AdaQuantConfig,
    AdaRoundConfig,
    BiasCorrectionConfig,
    CLEConfig,
    GPTQConfig,
    samples_to_use,
)
from quant_core.config import QuantConfig
from quant_core.errors import ConfigError
from quant_torch_fx.algorithms.activation_equalization import apply_activation_equalization
from quant_torch_fx.algorithms.cle import apply_cle
from quant_torch_fx.algorithms.probe import Batch, take_samples
from quant_torch_fx.algorithms.runner import TorchLayerRunner
from quant_torch_fx.capture import copy_captured
from quant_torch_fx.prepare import graph_info

SUPPORTED = (
    CLEConfig.kind,
    ActivationEqualizationConfig.kind,
    GPTQConfig.kind,
    AdaRoundConfig.kind,
    AdaQuantConfig.kind,
    BiasCorrectionConfig.kind,
)
"""The kinds this backend runs (:mod:`quant_algos.drivers.schedule` orders them)."""


def check_algorithms(config: QuantConfig) -> None:
    """Refuse, naming it, an algorithm this backend does not run."""
    schedule(config, SUPPORTED, backend="torch", elsewhere="quant-onnx")


def require_data(kinds: Sequence[str], data: object | None) -> None:
    """Refuse, naming them, algorithm ``kinds`` that run on calibration data when ``data``
    is ``None``."""
    if kinds and data is None:
        raise ConfigError(f"calib_loader: config.algorithms {', '.join(kinds)} run on calibration data; pass one")


def pre_pass(config: QuantConfig, batches: Sequence[Batch] | None) -> Callable[[GraphModule], dict[str, Any]] | None:
    """The float-graph passes (CLE, activation equalization) ``prepare_graph`` runs before
    planning, or ``None``."""
    scheduled = schedule(config, SUPPORTED, backend="torch", elsewhere="quant-onnx").before_calibration
    if not scheduled:
        return None
    require_data([a.kind for a in scheduled if a.kind != CLEConfig.kind], batches)

    def run(gm: GraphModule) -> dict[str, Any]:
        reports: dict[str, Any] = {}
        for algorithm in scheduled:
            if isinstance(algorithm, ActivationEqualizationConfig):
                assert batches is not None
                reports[algorithm.kind] = apply_activation_equalization(gm, algorithm, config, batches).to_dict()
                continue
            assert isinstance(algorithm, CLEConfig)  # the rest of SUPPORTED before calibration
            reports["cle"] = apply_cle(gm, algorithm, batches).to_dict()
        return reports

    return run


def run_post_passes(gm: GraphModule, config: QuantConfig, batches: Sequence[Batch], *, quiet: bool = False) -> None:
    """GPTQ, AdaRound, AdaQuant and bias correction as configured, on the calibrated graph
    ``gm`` (PTQ, or QAT with batch norm folded; in place, in eval mode); their reports go
    to the graph's ``algorithms``."""
    info = graph_info(gm)
    scheduled = schedule(config, SUPPORTED, backend="torch", elsewhere="quant-onnx").after_calibration
    # One float reference for every pass: each pass writes its weights and biases into
    # ``gm``, and a later pass must still compare with the float model, not with them.
    float_gm = copy_captured(gm) if scheduled else None
    for algorithm in scheduled:
        runner = TorchLayerRunner(gm, take_samples(batches, samples_to_use(algorithm)), float_gm=float_gm)
        try:
            if isinstance(algorithm, BiasCorrectionConfig):
                notes = correct_biases(runner, algorithm, quiet=quiet)
                info.algorithms[algorithm.kind] = {
                    "num_samples": min(samples_to_use(algorithm), runner.num_samples),  # what it read
                    "notes": [*runner.notes, *notes],
                }
                continue
            assert isinstance(algorithm, (AdaRoundConfig, AdaQuantConfig, GPTQConfig))  # the rest of SUPPORTED
            report = reconstruct_layers(runner, algorithm, quiet=quiet)
        finally:
            runner.close()  # the live values a walk spilled to disk
        if runner.notes:
            report = ReconstructionReport(report.method, report.layers, (*runner.notes, *report.notes))
        info.algorithms[algorithm.kind] = report.to_dict()
