"""A model input that held one value in every calibration batch is noted."""

from __future__ import annotations

import numpy as np
import pytest

from quant_core.observer_config import Percentile
from quant_core.observers import make_observer
from quant_core.plan import constant_input_note
from quant_core.spec import QuantSpec

SPECS = [
    QuantSpec(dtype="uint8", symmetric=False),
    QuantSpec(dtype="int8", symmetric=True),
    QuantSpec(dtype="uint8", symmetric=False, observer=Percentile()),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.dtype.value}-{s.observer.method}")
def test_all_zero_data_is_noted_and_varied_data_is_not(spec: QuantSpec) -> None:
    zeros, varied = make_observer(spec), make_observer(spec)
    for _ in range(3):
        zeros.update(np.zeros((8, 3, 4, 4), np.float32))
        varied.update(np.random.default_rng(0).normal(size=(8, 3, 4, 4)).astype(np.float32))
    assert constant_input_note("images", zeros) == (
        "input 'images': every calibration value was 0; the qparams fit that value only (check the calibration data)"
    )
    assert constant_input_note("images", varied) is None


def test_an_unobserved_input_is_not_noted() -> None:
    assert constant_input_note("x", make_observer(SPECS[0])) is None
