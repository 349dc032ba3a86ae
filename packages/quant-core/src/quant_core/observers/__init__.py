"""Streaming, mergeable observers: min-max (per tensor or per channel), moving-average
min-max and a histogram with percentile, entropy, MSE and power-of-two MinMSE range
selection. Memory never depends on the number of batches.

Example:
    >>> import numpy as np
    >>> from quant_core.observer_config import PowerOfTwoMSE
    >>> from quant_core.spec import QuantSpec
    >>> spec = QuantSpec(dtype="int8", scale_type="power_of_two", observer=PowerOfTwoMSE())
    >>> a, b = make_observer(spec), make_observer(spec)
    >>> a.update(np.random.default_rng(0).normal(size=1000).astype(np.float32))
    >>> b.update(np.random.default_rng(1).normal(size=1000).astype(np.float32))
    >>> a.merge(b)
    >>> int(a.qparams().fix_pos)
    5
"""

from quant_core.observers.base import Observer, StateDict
from quant_core.observers.derived import derivable, derive_observer, statistics_observer
from quant_core.observers.factory import make_observer
from quant_core.observers.grid import HistogramGrid
from quant_core.observers.histogram import HistogramObserver
from quant_core.observers.minmax import FixedRangeObserver, MinMaxObserver, MovingAverageMinMaxObserver
from quant_core.observers.snapshot import Histogram

__all__ = [
    "FixedRangeObserver",
    "Histogram",
    "HistogramGrid",
    "HistogramObserver",
    "MinMaxObserver",
    "MovingAverageMinMaxObserver",
    "Observer",
    "StateDict",
    "derivable",
    "derive_observer",
    "make_observer",
    "statistics_observer",
]
