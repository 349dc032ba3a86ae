"""Observers derived from statistics kept once: one calibration pass serves every
calibration method of the same tensor.

A :class:`~quant_core.observers.HistogramObserver`'s counts lie on a canonical grid
that depends only on the data's overall min and max and its bin count, and it keeps the
exact min and max besides. So a histogram of a tensor holds, bit for bit, what a
min-max observer of it would hold and what a percentile, entropy, MSE or power-of-two
MinMSE observer with the same bin count would hold, whatever the batching; and the
histograms of several tensors merge exactly into the one a shared-scale group's observer
would have filled. :func:`derive_observer` builds that observer, so a recipe search (or
anything comparing calibration methods) calibrates once with
:func:`statistics_observer` per tensor instead of once per method.

Not derivable (:func:`derivable` says so): per-channel activation specs, moving-average
min-max (it depends on the batching), dynamic specs, float formats.

Example:
    >>> import numpy as np
    >>> from quant_core.observer_config import Entropy, MinMax
    >>> from quant_core.observers import make_observer
    >>> from quant_core.spec import QuantSpec
    >>> data = np.random.default_rng(0).normal(size=(4, 1000)).astype(np.float32)
    >>> stat = statistics_observer()
    >>> for batch in data:
    ...     stat.update(batch)
    >>> for method in (MinMax(), Entropy()):
    ...     spec = QuantSpec(dtype="uint8", symmetric=False, observer=method)
    ...     direct = make_observer(spec)
    ...     for batch in data:
    ...         direct.update(batch)
    ...     print(method.method, derive_observer(spec, [stat]).qparams() == direct.qparams())
    minmax True
    entropy True
"""

from __future__ import annotations

from collections.abc import Sequence

from quant_core.dtypes import DType
from quant_core.errors import ConfigError
from quant_core.observer_config import HISTOGRAM_METHODS, MinMax, Percentile
from quant_core.observers.base import Observer
from quant_core.observers.factory import make_observer
from quant_core.observers.histogram import HistogramObserver
from quant_core.observers.minmax import MinMaxObserver
from quant_core.spec import QuantSpec

DEFAULT_STATISTICS_BINS = 2048
"""The bin count of every histogram method's default config."""


def statistics_observer(bins: int = DEFAULT_STATISTICS_BINS) -> HistogramObserver:
    """A histogram of ``bins`` bins that serves every derivable spec with that bin count
    (and every min-max spec): what a search calibrates each tensor with.

    Example:
        >>> statistics_observer(1024).bins
        1024
    """
    return HistogramObserver(QuantSpec(dtype=DType.INT8, observer=Percentile(bins=bins)))


def derivable(spec: QuantSpec) -> bool:
    """Whether :func:`derive_observer` can give ``spec``'s observer from histograms.

    Example:
        >>> from quant_core.observer_config import MovingAverageMinMax
        >>> derivable(QuantSpec(dtype="int8")), derivable(QuantSpec(dtype="int8", observer=MovingAverageMinMax()))
        (True, False)
    """
    if not spec.is_quantized or spec.dynamic or spec.per_channel_axis is not None:
        return False
    return isinstance(spec.observer, MinMax) or spec.observer.method in HISTOGRAM_METHODS


def statistics_bins(spec: QuantSpec) -> int | None:
    """The histogram bin count ``spec`` needs its statistics in (``None``: any, min-max).

    Example:
        >>> from quant_core.observer_config import MSE
        >>> statistics_bins(QuantSpec(dtype="int8", observer=MSE(bins=512))), statistics_bins(QuantSpec(dtype="int8"))
        (512, None)
    """
    bins = getattr(spec.observer, "bins", None)
    return None if bins is None else int(bins)


def derive_observer(spec: QuantSpec, statistics: Sequence[HistogramObserver]) -> Observer:
    """The observer ``make_observer(spec)`` would be after seeing every value the
    ``statistics`` (histograms of one tensor, or of each member of a shared-scale group)
    saw: the same state, hence the same qparams, bit for bit. Empty statistics give an
    empty observer (the caller's "never observed" check then applies).

    Raises ConfigError when ``spec`` is not :func:`derivable` or a statistic's bin count
    differs from the one ``spec`` needs.

    Example:
        >>> import numpy as np
        >>> a, b = statistics_observer(), statistics_observer()
        >>> a.update(np.array([-1.0, 0.5], np.float32)); b.update(np.array([3.0], np.float32))
        >>> [float(v) for v in derive_observer(QuantSpec(dtype="int8"), [a, b]).range()]
        [-1.0, 3.0]
    """
    if not derivable(spec):
        raise ConfigError(
            f"spec: {spec.observer.method} (per_channel_axis={spec.per_channel_axis!r}) cannot be derived from "
            "histograms; allowed: per-tensor minmax, percentile, entropy, mse, minmse_pow2"
        )
    observer = make_observer(spec)
    seen = [s for s in statistics if not s.empty]
    if not seen:
        return observer
    if isinstance(observer, MinMaxObserver):
        observer.update_range(min(s.min_val for s in seen), max(s.max_val for s in seen))  # type: ignore[type-var]
        return observer
    assert isinstance(observer, HistogramObserver)
    for stat in seen:
        if stat.bins != observer.bins:
            raise ConfigError(f"statistics: {stat.bins}-bin histograms cannot serve a {observer.bins}-bin spec")
        histogram = stat.histogram()
        observer.update_histogram(histogram.counts, histogram.grid, histogram.min_val, histogram.max_val)
    return observer
