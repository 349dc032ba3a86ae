"""Weight qparams of a calibrated plan: the one place both backends get them from.

Each weight slot's qparams come from its spec's observer over the weight
(:func:`quant_core.weights.constant_qparams`); then, for layers an integer kernel reads,
the bias rule may raise a channel's scale so that the int32 bias fits at
``input_scale * weight_scale`` (:func:`quant_core.bias.fit_weight_to_bias`). That needs
the calibrated input scale, so it runs after calibration.

Example:
    >>> import numpy as np
    >>> from quant_core.plan import BiasSlot, QuantPlan, WeightSlot
    >>> from quant_core.qparams import QParams
    >>> from quant_core.spec import QuantSpec
    >>> w = WeightSlot("fc", "Gemm", "w", 1, QuantSpec(dtype="int8", per_channel_axis=0))
    >>> b = BiasSlot("fc", "b", 2, "x", "w", None, True)
    >>> plan = QuantPlan(groups=(), weights=(w,), biases=(b,), fused=(), quantized_nodes=(), float_nodes=())
    >>> values = {"w": np.array([[1e-9], [1.0]], np.float32), "b": np.array([3.0, 0.5], np.float32)}
    >>> qps, notes = plan_weight_qparams(plan, values.get, lambda t: QParams.per_tensor(0.01, 128, "uint8"))
    >>> [f"{s:.2g}" for s in qps["fc"].scale], len(notes)
    (['1.4e-07', '0.0079'], 1)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from quant_core.bias import fit_weight_to_bias
from quant_core.dtypes import DType
from quant_core.plan.graph import ConstantLookup
from quant_core.plan.planner import QuantPlan
from quant_core.qparams import QParams
from quant_core.weights import constant_qparams


def plan_weight_qparams(
    plan: QuantPlan,
    value: ConstantLookup,
    activation_qparams: Callable[[str], QParams | None],
    given: Mapping[str, QParams] | None = None,
) -> tuple[dict[str, QParams], list[str]]:
    """Weighted node name -> weight qparams for every weight slot of ``plan``, and notes.

    Args:
        plan: the plan.
        value: tensor name -> the value the kernel uses (a backend folds anything it
            folds when writing, e.g. ONNX Gemm's ``alpha`` into the weight, ``beta``
            into the bias).
        activation_qparams: tensor name -> its calibrated qparams (``None``: float).
        given: weighted node name -> qparams to start from instead of the observer's
            (scales learned by QAT); the bias fit still applies to them.

    Example (a learned scale of 0.25 is kept; no bias needs a wider one):
        >>> from quant_core.plan import WeightSlot
        >>> from quant_core.spec import QuantSpec
        >>> slot = WeightSlot("fc", "Gemm", "w", 1, QuantSpec(dtype="int8"))
        >>> one = QuantPlan(groups=(), weights=(slot,), biases=(), fused=(), quantized_nodes=(), float_nodes=())
        >>> learned = {"fc": QParams.per_tensor(0.25, 0, "int8")}
        >>> w = {"w": np.ones((2, 2), np.float32)}
        >>> float(plan_weight_qparams(one, w.get, lambda t: None, learned)[0]["fc"].scale)
        0.25
    """
    result: dict[str, QParams] = {}
    for slot in plan.weights:
        weight = value(slot.tensor)
        if weight is None:
            raise ValueError(f"node {slot.node!r}: weight {slot.tensor!r} is not a constant")
        start = None if given is None else given.get(slot.node)
        result[slot.node] = constant_qparams(weight, slot.spec) if start is None else start
    notes = []
    for bias_slot in plan.biases:
        int32_default = bias_slot.spec is None or bias_slot.spec.dtype is DType.INT32
        input_qp = activation_qparams(bias_slot.input_tensor)
        bias = value(bias_slot.tensor)
        qp = result.get(bias_slot.node)
        if not (bias_slot.integer_kernel and int32_default) or input_qp is None or bias is None or qp is None:
            continue
        flat = np.asarray(bias).reshape(-1)
        if qp.scale.ndim and flat.size != qp.scale.shape[0]:
            continue  # not one bias per channel: the writer keeps it float
        result[bias_slot.node], note = fit_weight_to_bias(flat, input_qp.scale, qp)
        if note is not None:
            notes.append(f"node {bias_slot.node!r}: {note}")
    return result, notes
