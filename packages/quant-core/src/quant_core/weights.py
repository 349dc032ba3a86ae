"""Qparams of constant tensors (weights, constant operands, biases with their own spec).

A constant is observed like an activation, by the observer its spec asks for, fed once
with the whole tensor, so every backend gets the same qparams for the same weight and
a weight's codes are exactly ``quant_core.qparams.quantize(w, constant_qparams(w, spec))``.

Example:
    >>> import numpy as np
    >>> from quant_core.qparams import quantize
    >>> from quant_core.spec import QuantSpec
    >>> w = np.array([[1.0, -2.0], [0.5, 0.25]], np.float32)
    >>> qp = constant_qparams(w, QuantSpec(dtype="int8", per_channel_axis=0))
    >>> quantize(w, qp).tolist()
    [[64, -127], [127, 64]]
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from quant_core.observers import make_observer
from quant_core.qparams import QParams
from quant_core.spec import QuantSpec


def constant_qparams(value: npt.ArrayLike, spec: QuantSpec) -> QParams:
    """Qparams of a constant tensor under ``spec`` (per channel along its resolved axis)."""
    observer = make_observer(spec)
    observer.update(np.asarray(value, np.float32))
    return observer.qparams()
