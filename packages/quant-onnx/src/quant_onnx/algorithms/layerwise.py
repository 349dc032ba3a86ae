"""GPTQ, AdaRound, AdaQuant and bias correction on a QDQ model (post-passes): the drivers of
``quant_algos.drivers`` over :class:`~quant_onnx.algorithms.runner.OnnxLayerRunner`.

Each pass takes the calibrated plan the QDQ model was written from (weight qparams and
the bias rule come from there, never from the file), the QDQ model and the calibration
batches (the first ``num_samples``, ``quant_core.algorithm_config.DEFAULT_NUM_SAMPLES``
when unset), and returns a new QDQ model whose integer initializers were rewritten; the
graph structure the writer chose is kept (a layer without a bias may gain one).
AdaRound and AdaQuant need ``quant-onnx[torch]``; GPTQ is numpy; quant_onnx never imports
torch itself.

Example:
    See ``tests/test_algorithms_layerwise.py`` and ``tests-integration/test_onnx_adaround.py``.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx

from quant_algos._torch import check_torch
from quant_algos.drivers.bias_correction import correct_biases
from quant_algos.drivers.reconstruction import ReconstructionReport, reconstruct_layers
from quant_core.algorithm_config import (
    AdaQuantConfig,
    AdaRoundConfig,
    BiasCorrectionConfig,
    GPTQConfig,
    samples_to_use,
)
from quant_core.config import QuantConfig
from quant_onnx.algorithms.capture import Feeds, prepare_batches
from quant_onnx.algorithms.runner import WEIGHTED_OPS, OnnxLayerRunner
from quant_onnx.pipeline.calibrate import CalibratedModel, InputMeans

TORCH_EXTRA = "quant-onnx[torch]"


def _runner(
    calibrated: CalibratedModel,
    qdq_model: onnx.ModelProto,
    batches: Iterable[Feeds],
    config: object,
    learned_codes: bool = False,
) -> OnnxLayerRunner:
    feeds = prepare_batches(batches, samples_to_use(config))
    bias_only = isinstance(config, BiasCorrectionConfig)  # it walks only the layers a bias can be written to
    return OnnxLayerRunner(calibrated, qdq_model, feeds, learned_codes=learned_codes, bias_layers_only=bias_only)


def apply_reconstruction(
    calibrated: CalibratedModel,
    qdq_model: onnx.ModelProto,
    batches: Iterable[Feeds],
    config: AdaRoundConfig | AdaQuantConfig | GPTQConfig,
    *,
    learned_codes: bool = False,
    quiet: bool = False,
) -> tuple[onnx.ModelProto, ReconstructionReport]:
    """AdaRound (``AdaRoundConfig``), AdaQuant (``AdaQuantConfig``) or GPTQ (``GPTQConfig``)
    over every quantized Conv/Gemm/MatMul of ``qdq_model``: a new model and the per-layer
    report.

    Raises:
        ImportError: AdaRound or AdaQuant without PyTorch (names the ``quant-onnx[torch]``
            extra); GPTQ needs no torch.
    """
    if not isinstance(config, GPTQConfig):
        check_torch("AdaQuant" if isinstance(config, AdaQuantConfig) else "AdaRound", TORCH_EXTRA)
    runner = _runner(calibrated, qdq_model, batches, config, learned_codes)
    try:
        report = reconstruct_layers(runner, config, quiet=quiet)
    finally:
        runner.close()
    if runner.notes:
        report = ReconstructionReport(report.method, report.layers, (*runner.notes, *report.notes))
    return runner.model, report


def apply_bias_correction(
    calibrated: CalibratedModel,
    qdq_model: onnx.ModelProto,
    batches: Iterable[Feeds],
    config: BiasCorrectionConfig,
    *,
    learned_codes: bool = False,
    quiet: bool = False,
) -> tuple[onnx.ModelProto, list[str]]:
    """Empirical bias correction of every quantized Conv/Gemm of ``qdq_model`` (the mean
    output error on the calibration samples removed, layer by layer): a new model and
    notes on layers left alone. ``learned_codes``: AdaRound or AdaQuant wrote
    ``qdq_model``'s weight codes (:class:`~quant_onnx.algorithms.runner.OnnxLayerRunner`)."""
    runner = _runner(calibrated, qdq_model, batches, config, learned_codes)
    try:
        notes = correct_biases(runner, config, quiet=quiet)
    finally:
        runner.close()
    return runner.model, [*runner.notes, *notes]


def input_mean_request(model: onnx.ModelProto, config: QuantConfig) -> InputMeans | None:
    """What ``config``'s analytic bias correction reads, for the calibration pass to take:
    the float input of every Conv, Gemm and MatMul with a constant weight over the first
    samples it uses. ``None`` when ``config`` runs no analytic bias correction."""
    correction = config.algorithm(BiasCorrectionConfig.kind)
    if not isinstance(correction, BiasCorrectionConfig) or not correction.analytic:
        return None
    constants = {tensor.name for tensor in model.graph.initializer}
    conv: dict[str, bool] = {}
    mixed: set[str] = set()  # read by a convolution and a dense layer: left to the correction's own pass
    for node in model.graph.node:
        weighted = node.op_type in WEIGHTED_OPS and len(node.input) > 1 and node.input[1] in constants
        if not weighted or not node.input[0] or node.input[0] in constants:
            continue
        is_conv = node.op_type == "Conv"
        if conv.setdefault(node.input[0], is_conv) is not is_conv:
            mixed.add(node.input[0])
    return InputMeans(samples_to_use(correction), {t: c for t, c in conv.items() if t not in mixed})
