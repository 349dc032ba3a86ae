"""Activation equalization on a float ONNX model (pre-pass, before calibration): the
driver (:mod:`quant_algos.drivers.activation_equalization`) decides on the planner's view
of the model; the per-channel min and max of every site are reduced inside onnxruntime in
one pass, and the rescaled Convs and inserted ``Mul`` nodes are written here. The float
function is unchanged (up to float rounding).

Example:
    See ``tests/test_algorithms_activation_equalization.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import onnx

from quant_algos.drivers.activation_equalization import (
    ActivationEqualization,
    ActivationEqualizationReport,
    Measure,
    merged_ranges,
    plan_activation_equalization,
)
from quant_core.algorithm_config import ActivationEqualizationConfig, samples_to_use
from quant_core.config import QuantConfig
from quant_core.onnx_qdq.graph import GraphIndex, plan_graph
from quant_onnx.algorithms.capture import Feeds, prepare_batches
from quant_onnx.algorithms.channel_scaling import insert_mul, write_layers
from quant_onnx.algorithms.reductions import Reduction, reduce_over
from quant_onnx.graph_edit import copy_model

__all__ = [
    "ActivationEqualizationReport",
    "apply_activation_equalization",
    "apply_activation_equalization_with_report",
    "write_equalization",
]


def _channel_ranges(model: onnx.ModelProto, feeds: list[dict]) -> Measure:
    def measure(tensors: Sequence[str]) -> Mapping[str, tuple[np.ndarray, np.ndarray]]:
        # [N, C, ...] -> [N, C, -1], reduced over the samples and positions.
        reductions = [Reduction(t, op, (0, 2), (0, 0, -1)) for t in tensors for op in ("ReduceMin", "ReduceMax")]
        return merged_ranges(
            {tensor: (low, high) for tensor, (low, _), (high, _) in zip(tensors, batch[::2], batch[1::2], strict=True)}
            for batch in reduce_over(model, reductions, feeds)
        )

    return measure


def apply_activation_equalization_with_report(
    model: onnx.ModelProto,
    batches: Iterable[Feeds],
    algorithm: ActivationEqualizationConfig,
    config: QuantConfig,
) -> tuple[onnx.ModelProto, ActivationEqualizationReport]:
    """A copy of ``model`` (pre-processed float model) with its activations equalized
    under ``config``'s formats, and the report."""
    index = GraphIndex(model.graph)
    feeds = prepare_batches(batches, samples_to_use(algorithm))
    plan = plan_activation_equalization(
        plan_graph(model, index),
        config,
        _channel_ranges(model, feeds),
        writable=lambda name: index.initializer_proto(name) is not None,
    )
    out, _sources = write_equalization(model, plan)
    return out, plan.report


TensorSource = tuple[str, np.ndarray]
"""An equalized model's tensor as the float model's ``(tensor, per-channel factor)``
(axis 1): its values are the float tensor's times the factor."""


def write_equalization(
    model: onnx.ModelProto, equalization: ActivationEqualization
) -> tuple[onnx.ModelProto, dict[str, TensorSource]]:
    """A copy of ``model`` with ``equalization`` written (rescaled Convs, inserted ``Mul``
    nodes), and the source of every tensor whose values it changed or that it added."""
    out = copy_model(model)
    write_layers(out, equalization.layers, equalization.refs)
    sources: dict[str, TensorSource] = {
        tensor: (tensor, 1.0 / divisor) for tensor, divisor in equalization.divided.items()
    }
    for insertion in equalization.insertions:
        mul = insert_mul(
            out, GraphIndex(out.graph), insertion.tensor, "conv", insertion.rank, insertion.multiplier, "equaliz"
        )
        written = mul.output[0]
        source, factor = sources.get(insertion.tensor, (insertion.tensor, np.ones_like(insertion.multiplier)))
        sources[written] = (source, factor * insertion.multiplier)
    return out, sources


def apply_activation_equalization(
    model: onnx.ModelProto,
    batches: Iterable[Feeds],
    algorithm: ActivationEqualizationConfig,
    config: QuantConfig,
) -> onnx.ModelProto:
    """:func:`apply_activation_equalization_with_report` without the report."""
    return apply_activation_equalization_with_report(model, batches, algorithm, config)[0]
