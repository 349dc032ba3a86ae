"""Bias correction on any backend.

Empirical (the walk): layer by layer in order, with every earlier layer already
corrected, the per-channel mean of ``quantized output - float output`` over the
calibration samples (:class:`~quant_algos.bias_correction.MeanErrorAccumulator`,
streaming) is subtracted from the layer's bias; a layer without one gets one. Outputs
are compared before the activation (the tensor the bias is added to).

Analytic: the float model alone runs, once, for every layer's mean input (the runner's
:meth:`~quant_algos.drivers.runner.LayerRunner.float_input_means`); what the layer's weight
rounding does to that mean (:func:`~quant_algos.bias_correction.weight_rounding_shift`) is
subtracted from the bias. No quantized model runs, so what a layer's quantized input adds
is left.

Example:
    See ``packages/quant-onnx/tests/test_algorithms_bias_correction.py`` and
    ``packages/quant-torch-fx/tests/test_algorithms.py``.
"""

from __future__ import annotations

import numpy as np

from quant_algos.bias_correction import MeanErrorAccumulator, shifted_bias, weight_rounding_shift
from quant_algos.drivers.runner import LayerRunner, QuantLayer, first_samples
from quant_algos.progress import progress_bar
from quant_core.algorithm_config import BiasCorrectionConfig, samples_to_use


def _mean_error(runner: LayerRunner, layer: QuantLayer, count: int) -> MeanErrorAccumulator:
    acc = MeanErrorAccumulator(channel_axis=layer.output_channel_axis)
    pairs = zip(runner.quantized_outputs(layer), runner.float_outputs(layer), strict=True)
    for quantized, reference in first_samples(pairs, count):
        acc.update(reference, quantized)
    return acc


def _analytic_bias(runner: LayerRunner, layer: QuantLayer, mean_input: np.ndarray) -> np.ndarray:
    shift = weight_rounding_shift(runner.quantized_weight(layer) - layer.float_weight, mean_input, layer.geometry)
    return shifted_bias(layer.bias, shift)


def correct_biases(runner: LayerRunner, config: BiasCorrectionConfig, *, quiet: bool = False) -> list[str]:
    """Correct every layer's bias through ``runner`` (``config.method``); returns notes on
    layers left alone."""
    count = min(runner.num_samples, samples_to_use(config))
    notes: list[str] = []
    # Left out: no bias input (a MatMul without an added one), or no integer bias possible (float input).
    layers = [layer for layer in runner.layers() if layer.bias_allowed]
    means = runner.float_input_means(layers, count) if config.analytic and layers else {}
    with progress_bar(total=len(layers), desc="bias correction", unit="layer", quiet=quiet) as bar:
        for layer in layers:
            bar.update(1)
            if config.analytic:
                corrected = _analytic_bias(runner, layer, means[layer.name])
            else:
                corrected = _mean_error(runner, layer, count).corrected_bias(layer.bias)
            note = runner.set_bias(layer, corrected)
            if note is not None:
                notes.append(f"{layer.name}: {note}")
    return notes
