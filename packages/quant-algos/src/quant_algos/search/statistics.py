"""One statistics pass per float model, for every observer choice: the ledger both
backends keep.

The float model (after a candidate's CLE or SmoothQuant, which change it) runs once over
the calibration set, filling a histogram per tensor; every candidate on that float model
gets its observers derived from those histograms
(:func:`quant_core.plan.observers_from_statistics`): the same qparams, bit for bit, as
its own calibration would give, for every derivable spec (per-tensor min-max, percentile,
entropy, MSE, power-of-two MinMSE). A plan whose specs cannot be derived (or need
different bin counts) gets ``None`` and calibrates itself. How a backend fills histograms
(onnxruntime with the tensors as outputs, a torch interpreter) is its own; which tensors,
when, and what the report says about it is decided here.

Example:
    >>> from quant_core.plan import QuantPlan
    >>> ledger = StatisticsLedger()
    >>> ledger.observers(("none",), "none", QuantPlan((), (), (), (), (), ()), "a8w8/minmax", lambda t, b: {})
    ({}, 'statistics pass 1 (none)')
    >>> [p.served for p in ledger.passes.values()]
    [('a8w8/minmax',)]
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import attrs

from quant_algos.search.results import StatisticsPass
from quant_core.config import QuantConfig
from quant_core.observers import Observer
from quant_core.observers.derived import DEFAULT_STATISTICS_BINS, derivable, statistics_bins
from quant_core.observers.histogram import HistogramObserver
from quant_core.plan import (
    QuantPlan,
    WeightCache,
    observer_feeds,
    observer_specs,
    observers_from_statistics,
    planning_key,
)
from quant_core.plan.calibrated import DerivedCache
from quant_core.serialization import config_to_json

#: ``(tensor names, bins) -> tensor -> histogram``: a backend's pass over the calibration set.
Collect = Callable[[list[str], int], dict[str, HistogramObserver]]


@attrs.frozen
class FloatModelKey:
    """What decides the float model a candidate is planned and observed on, in both
    backends: the NPU conversions pre-processing applies, the pre-passes (CLE, activation
    equalization, SmoothQuant) and the backend's own part (quant-onnx: the opset).
    Activation equalization reads the formats too (it leaves per-tensor and power-of-two
    activations alone), so with it the key holds the planning config, as JSON text (a
    config holds dicts and has no hash). Candidates with equal keys share statistics and
    weight qparams; the key's ``pre_passes`` name the float model in the report.

    Example:
        >>> from quant_core.presets import get_preset
        >>> a8w8, xint8 = get_preset("a8w8"), get_preset("xint8")
        >>> float_model_key(a8w8, ()) == float_model_key(xint8, ())  # no pre-pass reads the formats
        True
        >>> pre = a8w8.algorithms[:1]
        >>> pre[0].kind, float_model_key(a8w8, pre) == float_model_key(xint8, pre)
        ('activation_equalization', False)
    """

    npu_conversions: tuple[str, ...]
    pre_passes: tuple[Any, ...]
    formats: str | None = None
    backend: Hashable = None


def float_model_key(config: QuantConfig, pre_passes: Sequence[Any], backend: Hashable = None) -> FloatModelKey:
    """The :class:`FloatModelKey` of ``config`` whose pre-passes are ``pre_passes``."""
    equalizes = any(a.kind == "activation_equalization" for a in pre_passes)
    formats = config_to_json(planning_key(config), indent=None) if equalizes else None
    return FloatModelKey(tuple(config.npu_conversions), tuple(pre_passes), formats, backend)


def pre_label(pre_passes: Sequence[Any]) -> str:
    """The report's name of a float model: its pre-passes (``none``, ``cle``...).

    Example:
        >>> from quant_core.algorithm_config import CLEConfig
        >>> pre_label(()), pre_label((CLEConfig(),))
        ('none', 'cle')
    """
    return "+".join(a.kind for a in pre_passes) or "none"


def statistics_bins_of(plan: QuantPlan) -> int | None:
    """The one histogram bin count the plan's specs derive from (default when all are
    min-max), or ``None`` when a spec cannot be derived or they need different counts.

    Example:
        >>> statistics_bins_of(QuantPlan((), (), (), (), (), ())) == DEFAULT_STATISTICS_BINS
        True
    """
    specs = list(observer_specs(plan).values())
    if not all(derivable(s) for s in specs):
        return None
    counts = {statistics_bins(s) for s in specs} - {None}
    if len(counts) > 1:
        return None
    return counts.pop() if counts else DEFAULT_STATISTICS_BINS


def wide_share(plan: QuantPlan) -> float:
    """Share of the plan's quantized activation tensors (groups and per-layer input
    requantizations) stored in 16 bits or more.

    Example:
        >>> wide_share(QuantPlan((), (), (), (), (), ()))
        0.0
    """
    specs = [g.spec for g in plan.groups] + [r.spec for r in plan.requants]
    return 0.0 if not specs else sum(s.dtype.bits >= 16 for s in specs) / len(specs)


@attrs.define
class StatisticsLedger:
    """The histograms of each float model (keyed by the backend: its pre-passes and
    whatever else makes a different float model), what each pass served, and each float
    model's weight qparams (:data:`quant_core.plan.WeightCache`: a weight's range is
    selected once per spec, whichever candidates ask for it)."""

    statistics: dict[tuple[Hashable, int], dict[str, HistogramObserver]] = attrs.field(factory=dict)
    derived: dict[tuple[Hashable, int], DerivedCache] = attrs.field(factory=dict)
    passes: dict[tuple[Hashable, int], StatisticsPass] = attrs.field(factory=dict)
    pass_seconds: list[float] = attrs.field(factory=list)
    weights: dict[Hashable, WeightCache] = attrs.field(factory=dict)
    weight_lookups: int = 0

    def observers(
        self, key: Hashable, label: str, plan: QuantPlan, candidate: str, collect: Collect
    ) -> tuple[dict[str, Observer], str] | None:
        """The observers a calibration of ``plan`` on float model ``key`` (reported as
        ``label``) would fill, and the row's ``statistics`` text; a pass of ``collect``
        runs only for tensors no earlier candidate on that model observed. ``None``: the
        plan's specs cannot be derived (the candidate calibrates itself)."""
        bins = statistics_bins_of(plan)
        if bins is None:
            return None
        entry = (key, bins)
        have = self.statistics.setdefault(entry, {})
        missing = [t for t in observer_feeds(plan) if t not in have]
        found = self.passes.get(entry) or StatisticsPass(label, bins, 0, 0.0, ())
        if missing:
            started = time.perf_counter()
            have.update(collect(missing, bins))
            seconds = time.perf_counter() - started
            self.pass_seconds.append(seconds)
            found = attrs.evolve(found, tensors=found.tensors + len(missing), seconds=found.seconds + seconds)
        self.passes[entry] = attrs.evolve(found, served=(*found.served, candidate))
        observers = observers_from_statistics(plan, have, self.derived.setdefault(entry, {}))
        return observers, f"statistics pass {list(self.passes).index(entry) + 1} ({label})"

    def weight_cache(self, key: Hashable, plan: QuantPlan) -> WeightCache:
        """The weight qparams selected so far on float model ``key``, for a derived
        candidate of ``plan`` to read and fill (counted for :meth:`reuse`)."""
        self.weight_lookups += len(plan.weights)
        return self.weights.setdefault(key, {})

    def reuse(self) -> dict[str, int]:
        """What the derived candidates shared, for the report.

        Example:
            >>> StatisticsLedger().reuse()
            {'statistics_passes': 0, 'weight_qparams_selected': 0, 'weight_qparams_reused': 0}
        """
        selected = sum(len(cache) for cache in self.weights.values())
        return {
            "statistics_passes": len(self.passes),
            "weight_qparams_selected": selected,
            "weight_qparams_reused": self.weight_lookups - selected,
        }
