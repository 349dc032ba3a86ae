"""The empirical bias-correction walk, on any backend.

Layer by layer in order, with every earlier layer already corrected, the per-channel
mean of ``quantized output - float output`` over the calibration samples
(:class:`~quant_algos.bias_correction.MeanErrorAccumulator`, streaming) is subtracted
from the layer's bias; a layer without one gets one. Outputs are compared before the
activation (the tensor the bias is added to).

Example:
    See ``packages/quant-algos/tests/test_drivers.py``.
"""

from __future__ import annotations

from quant_algos.bias_correction import MeanErrorAccumulator
from quant_algos.drivers.runner import LayerRunner
from quant_algos.progress import progress_bar
from quant_core.algorithm_config import BiasCorrectionConfig, samples_to_use


def correct_biases(runner: LayerRunner, config: BiasCorrectionConfig, *, quiet: bool = False) -> list[str]:
    """Correct every layer's bias through ``runner``; returns notes on layers left alone."""
    count = min(runner.num_samples, samples_to_use(config))
    notes: list[str] = []
    layers = runner.layers()
    with progress_bar(total=len(layers), desc="bias correction", unit="layer", quiet=quiet) as bar:
        for layer in layers:
            bar.update(1)
            if not layer.bias_allowed:
                continue  # no bias input (MatMul) or no integer bias possible (float input)
            acc = MeanErrorAccumulator(channel_axis=layer.output_channel_axis)
            seen = 0
            for quantized, reference in zip(runner.quantized_outputs(layer), runner.float_outputs(layer), strict=True):
                take = min(len(quantized), count - seen)
                if take > 0:
                    acc.update(reference[:take], quantized[:take])
                    seen += take
            note = runner.set_bias(layer, acc.corrected_bias(layer.bias))
            if note is not None:
                notes.append(f"{layer.name}: {note}")
    return notes
