"""From a plan and its observers to every qparam: the one place both backends get them.

:func:`calibrated_qparams` turns what calibration observed into qparams: each tensor
group's from its observer with the group's spec; each input requantization's from the
group's observer (or its own, when its spec observes differently) with the requant's
spec; each weight's from its spec's observer over the weight
(:func:`quant_core.weights.constant_qparams`), then, for layers an integer kernel reads,
raised where the int32 bias would not fit at ``input_scale * weight_scale`` with room for
the layer's products in the int32 accumulator (:func:`quant_core.bias.fit_weight_to_bias`
with :func:`quant_core.bias.accumulation_headroom`). A changed plan over the same graph (mixed
precision raising layers to 16 bits) gets its qparams from the same observers, without
calibrating again.

Example:
    >>> import numpy as np
    >>> from quant_core.plan import BiasSlot, QuantPlan, WeightSlot
    >>> from quant_core.qparams import QParams
    >>> from quant_core.spec import QuantSpec
    >>> w = WeightSlot("fc", "Gemm", "w", 1, QuantSpec(dtype="int8", per_channel_axis=0))
    >>> b = BiasSlot("fc", "b", 2, "x", "w", None, True)
    >>> plan = QuantPlan(groups=(), weights=(w,), biases=(b,), fused=(), quantized_nodes=(), float_nodes=())
    >>> values = {"w": np.array([[1e-9], [1.0]], np.float32), "b": np.array([3.0, 0.5], np.float32)}
    >>> qps, notes = plan_weight_qparams(plan, values.get, lambda n, t: QParams.per_tensor(0.01, 128, "uint8"))
    >>> [f"{s:.2g}" for s in qps["fc"].scale], len(notes)
    (['1.4e-07', '0.0079'], 1)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping

import attrs
import numpy as np

from quant_core.bias import accumulation_headroom, fit_weight_to_bias, one_per_channel
from quant_core.dtypes import DType
from quant_core.errors import DataError, ModelError
from quant_core.observers.base import Observer
from quant_core.observers.derived import derive_observer
from quant_core.observers.factory import make_observer
from quant_core.observers.histogram import HistogramObserver
from quant_core.plan.graph import ConstantLookup
from quant_core.plan.planner import DerivedRange, QuantPlan
from quant_core.qparams import QParams, qparams_from_range
from quant_core.spec import QuantSpec
from quant_core.weights import constant_qparams

InputQParams = Callable[[str, str], "QParams | None"]
"""``(layer node, input tensor) -> qparams of the input that layer reads`` (``None``: float)."""

WeightCache = MutableMapping[tuple[str, QuantSpec], QParams]
"""``(weight tensor, spec) -> the observer's qparams of that weight``, before any bias fit:
kept by a caller that calibrates several plans of one float model (a recipe search), so
a weight's range is selected once per spec (power-of-two MinMSE over every weight costs
as much as a calibration pass on a small model). Valid for one constant lookup only."""


def plan_weight_qparams(
    plan: QuantPlan,
    value: ConstantLookup,
    input_qparams: InputQParams,
    given: Mapping[str, QParams] | None = None,
    cache: WeightCache | None = None,
) -> tuple[dict[str, QParams], list[str]]:
    """Weighted node name -> weight qparams for every weight slot of ``plan``, and notes.

    Args:
        plan: the plan.
        value: tensor name -> the value the kernel uses (a backend folds anything it
            folds when writing, e.g. ONNX Gemm's ``alpha`` into the weight, ``beta``
            into the bias).
        input_qparams: what each layer's input is quantized with.
        given: weighted node name -> qparams to start from instead of the observer's
            (scales learned by QAT); the bias fit still applies to them.
        cache: the observer's qparams of weights already selected for ``value``'s model
            (:data:`WeightCache`); read and filled.

    Example (a learned scale of 0.25 is kept; no bias needs a wider one):
        >>> from quant_core.plan import WeightSlot
        >>> from quant_core.spec import QuantSpec
        >>> slot = WeightSlot("fc", "Gemm", "w", 1, QuantSpec(dtype="int8"))
        >>> one = QuantPlan(groups=(), weights=(slot,), biases=(), fused=(), quantized_nodes=(), float_nodes=())
        >>> learned = {"fc": QParams.per_tensor(0.25, 0, "int8")}
        >>> w = {"w": np.ones((2, 2), np.float32)}
        >>> float(plan_weight_qparams(one, w.get, lambda n, t: None, learned)[0]["fc"].scale)
        0.25
    """
    result: dict[str, QParams] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for slot in plan.weights:
        weight = value(slot.tensor)
        if weight is None:
            raise ModelError(f"node {slot.node!r}: weight {slot.tensor!r} is not a constant")
        shapes[slot.node] = np.shape(weight)
        start = None if given is None else given.get(slot.node)
        result[slot.node] = _observed(weight, slot.tensor, slot.spec, cache) if start is None else start
    notes = []
    for bias_slot in plan.biases:
        int32_default = bias_slot.spec is None or bias_slot.spec.dtype is DType.INT32
        input_qp = input_qparams(bias_slot.node, bias_slot.input_tensor)
        bias = value(bias_slot.tensor) if bias_slot.tensor else None
        qp = result.get(bias_slot.node)
        if not (bias_slot.integer_kernel and int32_default) or input_qp is None or bias is None or qp is None:
            continue
        flat = np.asarray(bias).reshape(-1)
        if qp.scale.ndim and one_per_channel(bias, qp.scale.shape[0]) is None:
            continue  # not one bias per channel: the writer keeps it float
        # The kernel adds the layer's products to the bias in int32: leave them room.
        headroom = accumulation_headroom(shapes[bias_slot.node], flat.size, input_qp, qp)
        result[bias_slot.node], note = fit_weight_to_bias(flat, input_qp.scale, qp, headroom=headroom)
        if note is not None:
            notes.append(f"node {bias_slot.node!r}: {note}")
    return result, notes


def _observed(weight: np.ndarray, tensor: str, spec: QuantSpec, cache: WeightCache | None) -> QParams:
    if cache is None:
        return constant_qparams(weight, spec)
    key = (tensor, spec)
    if key not in cache:
        cache[key] = constant_qparams(weight, spec)
    return cache[key]


@attrs.frozen(eq=False)
class CalibratedQParams:
    """Every qparam of a calibrated plan.

    Attributes:
        activations: tensor group key -> qparams (in the spec's own encoding).
        ranges: tensor group key -> the range the observer selected.
        requants: :attr:`~quant_core.plan.InputRequant.key` -> qparams.
        weights: weighted node -> weight qparams.
        notes: what the weight/bias fitting decided.

    Example:
        >>> CalibratedQParams({}, {}, {}, {}, ()).activations
        {}
    """

    activations: Mapping[str, QParams]
    ranges: Mapping[str, tuple[np.ndarray, np.ndarray]]
    requants: Mapping[str, QParams]
    weights: Mapping[str, QParams]
    notes: tuple[str, ...]


def calibrated_qparams(
    plan: QuantPlan, observers: Mapping[str, Observer], value: ConstantLookup, weight_cache: WeightCache | None = None
) -> CalibratedQParams:
    """All qparams of ``plan`` from ``observers`` (group key -> observer; a requant whose
    spec observes differently than its group's has its own, under its key) and the
    constants ``value`` gives (see :func:`plan_weight_qparams`; ``weight_cache`` is its
    ``cache``).

    Example:
        >>> import numpy as np
        >>> from quant_core.observers import make_observer
        >>> from quant_core.plan import InputRequant, TensorGroup
        >>> from quant_core.spec import QuantSpec
        >>> spec = QuantSpec(dtype="uint8", symmetric=False)
        >>> group = TensorGroup("x", spec, ("x",), ("x",))
        >>> plan = QuantPlan((group,), (), (), (), (), (), requants=(InputRequant("fc", "x", spec.evolve(dtype="uint16")),))
        >>> obs = make_observer(spec); obs.update(np.array([0.0, 6.55], np.float32))
        >>> q = calibrated_qparams(plan, {"x": obs}, lambda name: None)
        >>> q.activations["x"].dtype.value, q.requants["fc:x"].dtype.value
        ('uint8', 'uint16')
    """
    activations: dict[str, QParams] = {}
    ranges: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for group in plan.groups:
        if plan.derived_of(group.key) is not None:
            continue
        ranges[group.key], activations[group.key] = group_selection(plan, group.key, observers[group.key])
    for derived in plan.derived:
        ranges[derived.group], activations[derived.group] = derived_selection(plan, derived, ranges.__getitem__)
    requants: dict[str, QParams] = {}
    for requant in plan.requants:
        owner = plan.group_of(requant.tensor)
        assert owner is not None
        requants[requant.key] = observers.get(requant.key, observers[owner.key]).qparams(requant.spec)

    def input_qparams(node: str, tensor: str) -> QParams | None:
        requant = plan.requant_of(node, tensor)
        if requant is not None:
            return requants[requant.key]
        group = plan.group_of(tensor)
        return None if group is None else activations[group.key]

    weights, notes = plan_weight_qparams(plan, value, input_qparams, cache=weight_cache)
    return CalibratedQParams(activations, ranges, requants, weights, tuple(notes))


def group_selection(plan: QuantPlan, key: str, observer: Observer) -> tuple[tuple[np.ndarray, np.ndarray], QParams]:
    """The range ``observer`` selects for the observed group ``key`` of ``plan`` and its
    qparams, cut at the group's saturation bound when it has one
    (:meth:`~quant_core.plan.planner.RangeBound.selection`). How both backends turn an
    observed group into qparams; a one-line error when the observer saw nothing.

    Example:
        >>> from quant_core.observers import make_observer
        >>> from quant_core.plan import RangeBound, TensorGroup
        >>> spec = QuantSpec(dtype="uint8", symmetric=False)
        >>> plan = QuantPlan((TensorGroup("c", spec, ("c",), ("c",)),), (), (), (), (), (),
        ...                  bounds=(RangeBound("c", -3.0, float("inf")),))
        >>> obs = make_observer(spec); obs.update(np.array([-21.0, 20.0], np.float32))
        >>> (lo, hi), qp = group_selection(plan, "c", obs)
        >>> round(float(lo), 2), int(qp.zero_point)
        (-3.09, 34)
    """
    if observer.empty:
        raise DataError(f"calibration: tensor {key!r} was never observed (empty in every batch)")
    group = plan.group_of(key)
    assert group is not None, key
    bound = plan.bound_of(key)
    return observer.selection(group.spec) if bound is None else bound.selection(observer, group.spec)


def derived_selection(
    plan: QuantPlan, derived: DerivedRange, selected: Callable[[str], tuple[np.ndarray, np.ndarray]]
) -> tuple[tuple[np.ndarray, np.ndarray], QParams]:
    """The range of a :class:`~quant_core.plan.planner.DerivedRange` group and its qparams,
    from ``selected``: group key -> the range its observer selected (the sources'). How
    both backends turn a group the plan derives into qparams.

    Example:
        >>> from quant_core.plan import DerivedRange, TensorGroup
        >>> from quant_core.spec import QuantSpec
        >>> spec = QuantSpec(dtype="int8", scale_type="power_of_two")
        >>> groups = (TensorGroup("s", spec, ("s",), ("s",)), TensorGroup("m", spec, ("m",), ()))
        >>> plan = QuantPlan(groups, (), (), (), (), (), derived=(DerivedRange("m", ("s",), 5.5, False),))
        >>> (lo, hi), qp = derived_selection(plan, plan.derived[0], {"s": (np.float64(-2.0), np.float64(3.0))}.get)
        >>> float(lo), float(hi), float(qp.scale)
        (-7.5, 3.0, 0.0625)
    """
    owner = next(g for g in plan.groups if g.key == derived.group)
    lo, hi = derived.range([selected(key) for key in derived.sources])
    # Covering: a power-of-two grid that stopped short of lo would let a masked score through.
    return (lo, hi), qparams_from_range(lo, hi, owner.spec, covering=True)


def constant_input_note(tensor: str, observer: Observer) -> str | None:
    """A note when calibration saw one value only in the model input ``tensor`` (data of
    zeros, a blank image folder, a broken pre-processing step): its scale then fits that
    value and nothing a real input holds. ``None`` when the input varied.

    Example:
        >>> from quant_core.observers import make_observer
        >>> from quant_core.spec import QuantSpec
        >>> obs = make_observer(QuantSpec(dtype="uint8", symmetric=False))
        >>> obs.update(np.zeros((4, 3), np.float32))
        >>> constant_input_note("x", obs)
        "input 'x': every calibration value was 0; the qparams fit that value only (check the calibration data)"
    """
    if observer.empty:
        return None
    lo, hi = (np.asarray(bound, np.float64) for bound in observer.range())
    if not np.array_equal(lo, hi):
        return None
    values = np.unique(lo)
    shown = f"{values[0]:g}" if values.size == 1 else f"one value per channel ({values.size} distinct)"
    return f"input {tensor!r}: every calibration value was {shown}; the qparams fit that value only (check the calibration data)"


def needs_own_observer(plan: QuantPlan) -> list[str]:
    """Keys of the requants whose spec cannot be served by their group's observer (another
    calibration method or granularity): calibration observes their tensor separately.

    Example:
        >>> needs_own_observer(QuantPlan((), (), (), (), (), ()))
        []
    """
    keys = []
    for requant in plan.requants:
        owner = plan.group_of(requant.tensor)
        if owner is not None and (
            requant.spec.observer != owner.spec.observer or requant.spec.per_channel_axis != owner.spec.per_channel_axis
        ):
            keys.append(requant.key)
    return keys


def observer_feeds(plan: QuantPlan) -> dict[str, list[str]]:
    """Tensor -> the keys of the observers calibration feeds it to: each group's observed
    members feed the group's observer; the tensor of a requant that observes its own way
    (:func:`needs_own_observer`) also feeds the requant's.

    Example:
        >>> from quant_core.plan import TensorGroup
        >>> from quant_core.spec import QuantSpec
        >>> group = TensorGroup("y", QuantSpec(dtype="int8"), ("y", "z"), ("y",))
        >>> observer_feeds(QuantPlan((group,), (), (), (), (), ()))
        {'y': ['y']}
    """
    feeds: dict[str, list[str]] = {}
    for group in plan.groups:
        for name in group.observed:
            feeds.setdefault(name, []).append(group.key)
    own = set(needs_own_observer(plan))
    for requant in plan.requants:
        if requant.key in own:
            feeds.setdefault(requant.tensor, []).append(requant.key)
    return feeds


def observer_specs(plan: QuantPlan) -> dict[str, QuantSpec]:
    """Observer key -> the spec its observer is made for (:func:`observer_feeds`' keys;
    a group whose range the plan derives has none).

    Example:
        >>> observer_specs(QuantPlan((), (), (), (), (), ()))
        {}
    """
    specs = {group.key: group.spec for group in plan.groups if plan.derived_of(group.key) is None}
    own = set(needs_own_observer(plan))
    specs.update({r.key: r.spec for r in plan.requants if r.key in own})
    return specs


def fresh_observers(plan: QuantPlan) -> dict[str, Observer]:
    """An empty observer per key of :func:`observer_specs`: what calibration fills.

    Example:
        >>> fresh_observers(QuantPlan((), (), (), (), (), ()))
        {}
    """
    return {key: make_observer(spec) for key, spec in observer_specs(plan).items()}


DerivedCache = dict[tuple[QuantSpec, tuple[str, ...]], Observer]
"""``(spec, tensors) -> observer`` derived once and shared by every plan that asks again."""


def observers_from_statistics(
    plan: QuantPlan, statistics: Mapping[str, HistogramObserver], cache: DerivedCache | None = None
) -> dict[str, Observer]:
    """The observers a calibration of ``plan`` would fill, derived from per-tensor
    statistics (tensor -> :func:`~quant_core.observers.derived.statistics_observer`
    fed with that tensor's values, the same values calibration would feed): bit for bit
    the same state, so the same qparams, without running the model again
    (:mod:`quant_core.observers.derived`). A tensor without statistics counts as never
    observed. ``cache`` (kept by the caller for one ``statistics``) hands plans that ask for
    the same spec over the same tensors the same observer, so its range is selected once
    (the observers are read, never updated, after calibration).

    Example:
        >>> import numpy as np
        >>> from quant_core.observers.derived import statistics_observer
        >>> from quant_core.plan import TensorGroup
        >>> from quant_core.spec import QuantSpec
        >>> stat = statistics_observer(); stat.update(np.array([0.0, 2.55], np.float32))
        >>> group = TensorGroup("y", QuantSpec(dtype="uint8", symmetric=False), ("y",), ("y",))
        >>> observers = observers_from_statistics(QuantPlan((group,), (), (), (), (), ()), {"y": stat})
        >>> round(float(observers["y"].qparams().scale), 6)
        0.01
    """
    sources: dict[str, list[str]] = {key: [] for key in observer_specs(plan)}
    for tensor, keys in observer_feeds(plan).items():
        if tensor in statistics:
            for key in keys:
                sources[key].append(tensor)
    specs = observer_specs(plan)
    cache = {} if cache is None else cache
    result: dict[str, Observer] = {}
    for key, tensors in sources.items():
        entry = (specs[key], tuple(tensors))
        if entry not in cache:
            cache[entry] = derive_observer(specs[key], [statistics[t] for t in tensors])
        result[key] = cache[entry]
    return result
