"""Reading standard QDQ layers: codes, qparams, layouts, matching with the float model."""

from __future__ import annotations

import numpy as np
import pytest
from algorithms_models import batches_for, gemm_mlp, mobilenet_block, write_qdq

from quant_core.dtypes import DType
from quant_core.qparams import dequantize
from quant_onnx.algorithms.qdq_layers import find_qdq_layers, match_float_layers


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("power_of_two", [True, False])
def test_layers_and_qparams_are_read_back(per_channel, power_of_two):
    model = mobilenet_block()
    qdq = write_qdq(model, batches_for(model, count=2), per_channel=per_channel, power_of_two=power_of_two)
    layers = find_qdq_layers(qdq)
    assert [layer.name for layer in layers] == ["conv1", "dw", "conv3", "fc"]
    for layer in layers:
        qp = layer.weight.qparams
        assert qp.dtype is DType.INT8 and qp.narrow_range
        assert (qp.axis == 0) if per_channel else (qp.axis is None)
        assert qp.is_power_of_two == power_of_two
        assert layer.bias is not None and layer.bias.qparams.dtype is DType.INT32
        assert layer.input_scale is not None
    pairs, notes = match_float_layers(model, qdq)
    assert notes == [] and [p.activation for p in pairs] == ["relu6", "relu6", "relu", None]
    for pair in pairs:  # the float weight quantizes back to the stored codes
        err = np.abs(dequantize(pair.layer.weight_oi(), pair.layer.weight_qparams_oi()) - pair.float_weight)
        scale = np.broadcast_to(
            pair.layer.weight_qparams_oi().scale.reshape(pair.layer.weight_qparams_oi().broadcast_shape(err.ndim)),
            err.shape,
        )
        assert np.all(err <= scale / 2 + 1e-7)


def test_gemm_layouts_and_axes():
    model = gemm_mlp()
    qdq = write_qdq(model, batches_for(model, count=2))
    fc1, fc2 = find_qdq_layers(qdq)
    assert fc1.transposed and fc1.weight.qparams.axis == 1 and fc1.weight_qparams_oi().axis == 0
    assert not fc2.transposed and fc2.weight_qparams_oi().axis == 0
    assert fc1.weight_oi().shape == (16, 12) and fc1.out_channels == 16


def test_int4_weights_are_read():
    model = gemm_mlp()
    qdq = write_qdq(model, batches_for(model, count=2), weight_bits=4)
    layer = find_qdq_layers(qdq)[0]
    assert layer.weight.qparams.dtype is DType.INT4 and int(layer.weight.codes.max()) <= 7
