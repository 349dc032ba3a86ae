"""Calibration samples of several sizes (text lines of several widths, one width per
batch): the presets whose algorithms read per-sample maps or sample positions (`a8w8`'s
equalization and analytic bias correction, `a16w8`'s GPTQ) quantize them as they do one
size."""

from __future__ import annotations

import numpy as np
import pytest
from algorithms_models import run
from test_algorithms_activation_equalization import recogniser_block

from quant_core.qparams import sqnr_db
from quant_onnx import quantize

RNG = np.random.default_rng(11)


def _any_width(model):
    for value in (model.graph.input[0], model.graph.output[0]):
        value.type.tensor_type.shape.dim[3].dim_param = "W"
    return model


@pytest.mark.parametrize("preset", ["a8w8", "a16w8"])
def test_batches_of_several_widths_quantize(preset) -> None:
    model, _ = recogniser_block()
    model = _any_width(model)
    widths = [12, 20, 12, 16]
    batches = [{"x": RNG.normal(size=(8, 3, 12, w)).astype(np.float32)} for w in widths]
    result = quantize(model, None, preset, batches, quiet=True)
    for w in (12, 16, 24):  # a width it saw, and one it did not
        check = [{"x": RNG.normal(size=(8, 3, 12, w)).astype(np.float32)}]
        assert sqnr_db(run(model, check), run(result.model, check)) > 20.0, (preset, w)
    means = result.calibrated.input_means
    if preset == "a8w8":  # a Conv input's mean map became per-channel means at the first change
        assert means is not None and means.values
        assert all(v.ndim == 1 for v in means.values.values())
