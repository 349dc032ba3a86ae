"""The planner: every quantization decision that does not need data, made once for
every backend (``docs/architecture.md``: statistics where tensors live, decisions once here).

- :mod:`~quant_core.plan.graph`: :class:`PlanNode`, the :class:`GraphView` protocol a
  backend's graph is mapped onto (ONNX operator names), and :class:`PlanGraph`.
- :mod:`~quant_core.plan.ops`: the operator table (what each op's inputs are, how its
  output's qparams relate to its inputs').
- :mod:`~quant_core.plan.planner`: :func:`plan_quantization` -> :class:`QuantPlan`
  (shared-scale groups, fusions, weight and bias slots, float nodes and why).
- :mod:`~quant_core.plan.activation_chains`: the element-wise steps between two layers
  (scalar affine, decomposed HardSwish, SiLU) that are quantized at their end only.
- :mod:`~quant_core.plan.selectors`: every ``exclude`` entry and ``name_overrides`` glob
  of a config must select a node.
- :mod:`~quant_core.plan.calibrated`: :func:`calibrated_qparams`, every qparam of a plan
  from its observers (weights fitted to the int32 bias where needed).

Example:
    >>> import numpy as np
    >>> from quant_core.presets import get_preset
    >>> nodes = [PlanNode("fc", "Gemm", ("x", "w", "b"), ("y",), {"transB": 1})]
    >>> weights = {"w": np.ones((3, 4), np.float32), "b": np.zeros(3, np.float32)}
    >>> plan = plan_quantization(PlanGraph(nodes, inputs=("x",), outputs=("y",), constant=weights.get), get_preset("a8w8"))
    >>> plan.weights[0].spec.per_channel_axis, plan.biases[0].integer_kernel
    (0, True)
"""

from quant_core.plan.calibrated import (
    CalibratedQParams,
    InputQParams,
    WeightCache,
    calibrated_qparams,
    constant_input_note,
    derived_selection,
    fresh_observers,
    group_selection,
    needs_own_observer,
    observer_feeds,
    observer_specs,
    observers_from_statistics,
    plan_weight_qparams,
)
from quant_core.plan.graph import ConstantLookup, GraphView, PlanGraph, PlanNode, scalar_constant, sole_reader
from quant_core.plan.ops import (
    CHANNEL_WISE_POOLS,
    FUSABLE_PRODUCERS,
    HOMOGENEOUS_ACTIVATIONS,
    POLICIES,
    OpKind,
    OpPolicy,
    activation_kind,
    clip_bounds,
    crossed_by_channel_scales,
    pads_keep_channels,
    policy_for,
    saturation_interval,
    weight_channel_axis,
    weight_is_transposed,
)
from quant_core.plan.planner import (
    BiasSlot,
    DerivedRange,
    FloatNode,
    FusedActivation,
    InputRequant,
    QuantPlan,
    RangeBound,
    TensorGroup,
    WeightSlot,
    plan_quantization,
    planning_key,
    resolve_weight_spec,
)
from quant_core.plan.selectors import check_selectors, unmatched_selectors

__all__ = [
    "CHANNEL_WISE_POOLS",
    "FUSABLE_PRODUCERS",
    "HOMOGENEOUS_ACTIVATIONS",
    "POLICIES",
    "BiasSlot",
    "CalibratedQParams",
    "ConstantLookup",
    "DerivedRange",
    "FloatNode",
    "FusedActivation",
    "GraphView",
    "InputQParams",
    "InputRequant",
    "OpKind",
    "OpPolicy",
    "PlanGraph",
    "PlanNode",
    "QuantPlan",
    "RangeBound",
    "TensorGroup",
    "WeightCache",
    "WeightSlot",
    "activation_kind",
    "calibrated_qparams",
    "check_selectors",
    "clip_bounds",
    "constant_input_note",
    "crossed_by_channel_scales",
    "derived_selection",
    "fresh_observers",
    "group_selection",
    "needs_own_observer",
    "observer_feeds",
    "observer_specs",
    "observers_from_statistics",
    "pads_keep_channels",
    "plan_quantization",
    "plan_weight_qparams",
    "planning_key",
    "policy_for",
    "resolve_weight_spec",
    "saturation_interval",
    "scalar_constant",
    "sole_reader",
    "unmatched_selectors",
    "weight_channel_axis",
    "weight_is_transposed",
]
