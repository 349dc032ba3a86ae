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

from collections.abc import Callable, Mapping

import attrs
import numpy as np

from quant_core.bias import accumulation_headroom, fit_weight_to_bias
from quant_core.dtypes import DType
from quant_core.observers.base import Observer
from quant_core.plan.graph import ConstantLookup
from quant_core.plan.planner import QuantPlan
from quant_core.qparams import QParams
from quant_core.weights import constant_qparams

InputQParams = Callable[[str, str], "QParams | None"]
"""``(layer node, input tensor) -> qparams of the input that layer reads`` (``None``: float)."""


def plan_weight_qparams(
    plan: QuantPlan,
    value: ConstantLookup,
    input_qparams: InputQParams,
    given: Mapping[str, QParams] | None = None,
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
            raise ValueError(f"node {slot.node!r}: weight {slot.tensor!r} is not a constant")
        shapes[slot.node] = np.shape(weight)
        start = None if given is None else given.get(slot.node)
        result[slot.node] = constant_qparams(weight, slot.spec) if start is None else start
    notes = []
    for bias_slot in plan.biases:
        int32_default = bias_slot.spec is None or bias_slot.spec.dtype is DType.INT32
        input_qp = input_qparams(bias_slot.node, bias_slot.input_tensor)
        bias = value(bias_slot.tensor) if bias_slot.tensor else None
        qp = result.get(bias_slot.node)
        if not (bias_slot.integer_kernel and int32_default) or input_qp is None or bias is None or qp is None:
            continue
        flat = np.asarray(bias).reshape(-1)
        if qp.scale.ndim and flat.size != qp.scale.shape[0]:
            continue  # not one bias per channel: the writer keeps it float
        # The kernel adds the layer's products to the bias in int32: leave them room.
        headroom = accumulation_headroom(shapes[bias_slot.node], flat.size, input_qp, qp)
        result[bias_slot.node], note = fit_weight_to_bias(flat, input_qp.scale, qp, headroom=headroom)
        if note is not None:
            notes.append(f"node {bias_slot.node!r}: {note}")
    return result, notes


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


def calibrated_qparams(plan: QuantPlan, observers: Mapping[str, Observer], value: ConstantLookup) -> CalibratedQParams:
    """All qparams of ``plan`` from ``observers`` (group key -> observer; a requant whose
    spec observes differently than its group's has its own, under its key) and the
    constants ``value`` gives (see :func:`plan_weight_qparams`).

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
        observer = observers[group.key]
        if observer.empty:
            raise ValueError(f"calibration: tensor {group.key!r} was never observed (empty in every batch)")
        activations[group.key] = observer.qparams(group.spec)
        ranges[group.key] = observer.range(group.spec)
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

    weights, notes = plan_weight_qparams(plan, value, input_qparams)
    return CalibratedQParams(activations, ranges, requants, weights, tuple(notes))


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
