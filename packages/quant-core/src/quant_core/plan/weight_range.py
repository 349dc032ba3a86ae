"""A per-tensor power-of-two weight whose min-max grid cannot hold it: its range by MSE.

Under the power-of-two presets (``xint8``: the formats of an integer-only NPU, int8
per-tensor weights) one element far outside the rest sets the min-max position of the
whole tensor. Random-weight timm Swin-Tiny (``tools/bench/zoo.py``) has two such weights:
timm's ``trunc_normal_(std=0.02, a=-2, b=2)`` draws an element at exactly ``2.0`` (100
standard deviations; its inverse-CDF sampling clamps an infinity to the bound), the
min-max step becomes ``2**-5`` (1.6 standard deviations of the rest), the weight keeps
6.9 dB of SQNR and more than half its elements round to zero (positions rounded up, as
they were then; the nearest power of two, now the rule, gives 2**-6 and about 13 dB). With those
two matrices rounded to almost nothing the model keeps 7.2 dB of output SQNR, against
26.5 dB with its weights float and its activations at ``xint8`` (``docs/transformers.md``).

Widening such a weight is no escape (the NPU's weights are int8), so the planner keeps it
at 8 bits and lets the squared error choose the position: :func:`held_weight_spec` gives
a weight that keeps under :data:`HELD_SQNR_DB` of SQNR on its min-max grid a
:class:`~quant_core.observer_config.PowerOfTwoMSE` that searches every finer position
(clipping the outlier). A weight the min-max grid holds keeps the preset's observer, so
its codes do not change: a Gaussian weight keeps 31-37 dB on an 8-bit power-of-two
min-max grid (the random zoo's other weights: 37 dB), a heavy-tailed one with its
largest element at 15 standard deviations about 23 dB.

Example:
    >>> import numpy as np
    >>> from quant_core.spec import QuantSpec
    >>> spec = QuantSpec(dtype="int8", scale_type="power_of_two")
    >>> w = np.random.default_rng(0).normal(0, 0.02, (256, 256)).astype(np.float32)
    >>> held_weight_spec(w, spec)[0] == spec
    True
    >>> w[3, 5] = 2.0
    >>> new, note = held_weight_spec(w, spec)
    >>> new.observer, note
    (PowerOfTwoMSE(bins=2048, search_below=0, search_above=16), 'its min-max grid (step 0.015625) keeps 13.6 dB of SQNR (largest |w| 93x its std); its position by squared error')
"""

from __future__ import annotations

import attrs
import numpy as np
import numpy.typing as npt

from quant_core.observer_config import MinMax, PowerOfTwoMSE
from quant_core.qparams import fake_quantize, sqnr_db
from quant_core.spec import QuantSpec, ScaleType
from quant_core.weights import constant_qparams

HELD_SQNR_DB = 20.0
"""A weight is held by its min-max grid when it keeps at least this SQNR on it (the
rounding error under 1% of the weight's power)."""
SEARCH_ALL_FINER = PowerOfTwoMSE(search_below=0, search_above=16)


def held_weight_spec(value: npt.ArrayLike, spec: QuantSpec) -> tuple[QuantSpec, str | None]:
    """``spec`` for the constant weight ``value``, and a note when it changed: a per-tensor
    power-of-two spec whose min-max grid does not hold ``value`` (it keeps under
    :data:`HELD_SQNR_DB` of SQNR there; module docstring) gets a
    power-of-two MSE observer over every finer position; any other spec is unchanged."""
    if not spec.is_quantized or spec.scale_type is not ScaleType.POWER_OF_TWO or spec.per_channel_axis is not None:
        return spec, None
    weight = np.asarray(value, np.float32)
    if not np.any(weight):
        return spec, None
    grid = constant_qparams(weight, spec.evolve(observer=MinMax()))
    kept = sqnr_db(weight, fake_quantize(weight, grid))
    if kept >= HELD_SQNR_DB:
        return spec, None
    observer = spec.observer
    searched = (
        attrs.evolve(observer, search_above=SEARCH_ALL_FINER.search_above)
        if isinstance(observer, PowerOfTwoMSE)
        else SEARCH_ALL_FINER
    )
    spread = float(np.max(np.abs(weight)) / np.std(weight))
    note = (
        f"its min-max grid (step {float(np.max(grid.scale)):g}) keeps {kept:.1f} dB of SQNR "
        f"(largest |w| {spread:.0f}x its std); its position by squared error"
    )
    return spec.evolve(observer=searched), note
