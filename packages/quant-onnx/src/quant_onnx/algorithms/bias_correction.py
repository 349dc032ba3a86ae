"""Empirical bias correction of a QDQ model (post-pass).

Layer by layer in graph order, with every upstream layer already corrected, the
per-channel mean of ``quantized output - float output`` over the calibration batches
(``quant_algos.bias_correction.MeanErrorAccumulator``) is subtracted from the layer's
int32 bias codes; a quantized layer without a bias gets one (int32 behind a
DequantizeLinear with scale ``input_scale * weight_scale``). Outputs are the
pre-activation tensors of both models; layers are matched by node name.

The walk uses :class:`~quant_onnx.algorithms.capture.IncrementalRunner` on both
models: the whole pass costs about one forward pass of each model over the samples,
and its memory is the live activations of ``num_samples`` samples.

Example:
    See ``tests/test_algorithms_bias_correction.py``: after the pass every corrected
    layer's mean output error on its calibration batches is zero.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx
from tqdm.auto import tqdm

from quant_algos.bias_correction import MeanErrorAccumulator
from quant_core.algorithm_config import BiasCorrectionConfig
from quant_onnx.algorithms._graph import copy_model
from quant_onnx.algorithms.capture import Feeds, IncrementalRunner, prepare_batches
from quant_onnx.algorithms.qdq_layers import bias_codes, bias_scale, match_float_layers, write_bias
from quant_onnx.graph import GraphIndex

#: Samples used when the config leaves ``num_samples`` unset: the walk keeps the live
#: activations of every sample, so its memory grows with this number.
DEFAULT_NUM_SAMPLES = 256


def apply_bias_correction(
    float_model: onnx.ModelProto,
    qdq_model: onnx.ModelProto,
    batches: Iterable[Feeds],
    config: BiasCorrectionConfig,
    *,
    quiet: bool = False,
) -> onnx.ModelProto:
    """A copy of ``qdq_model`` with the bias of every quantized Conv/Gemm corrected.

    Args:
        float_model: the float model ``qdq_model`` was written from (same node names).
        qdq_model: standard QDQ model (int8 weight and int32 bias initializers behind
            DequantizeLinear).
        batches: calibration feeds ``{input name: array}``; the first
            ``config.num_samples`` samples are used (``DEFAULT_NUM_SAMPLES`` when unset).
        config: the pass's settings.
        quiet: no progress bar.
    """
    feeds = prepare_batches(batches, config.num_samples or DEFAULT_NUM_SAMPLES)
    pairs, _notes = match_float_layers(float_model, qdq_model)
    out = copy_model(qdq_model)
    quantized, reference = IncrementalRunner(feeds), IncrementalRunner(feeds)
    for pair in tqdm(pairs, desc="bias correction", unit="layer", disable=quiet):
        layer = pair.layer
        scale = bias_scale(layer)
        if layer.op_type == "MatMul" or scale is None:
            continue  # no bias input to correct (MatMul) or no int32 bias possible (float input)
        quantized.compute(out, [layer.input_tensor])  # upstream runs with its corrected biases
        q_out = quantized.compute(out, [layer.output_tensor], commit=False)
        f_out = reference.compute(float_model, [pair.float_output])
        acc = MeanErrorAccumulator(channel_axis=layer.channel_axis)
        for q, f in zip(q_out, f_out, strict=True):
            acc.update(f[pair.float_output], q[layer.output_tensor])
        del q_out
        current = layer.bias.values() if layer.bias is not None else None
        corrected = acc.corrected_bias(current)
        write_bias(out, layer, bias_codes(corrected, scale), GraphIndex(out.graph))
    return out
