"""SmoothQuant on a float ONNX model (pre-pass, before calibration).

For every activation ``X`` read only by MatMul/Gemm layers (or only by 1x1 group-1 and
depthwise Convs) with initializer weights, the per-input-channel max |X| is measured on the
calibration batches (reduced inside onnxruntime, one pass for all of them:
:mod:`~quant_onnx.algorithms.reductions`), the
scales ``s`` come from ``quant_algos.smoothquant.smooth_layers`` and the layers'
weights are multiplied by ``s`` along their input axis. ``1 / s`` is folded, exactly,
into what produces ``X``:

- a Conv/Gemm/MatMul, possibly through single-consumer Relu/LeakyRelu/PRelu/MaxPool/
  AveragePool (they commute with a positive per-channel scale): its output channels;
- a Mul by a constant, a LayerNormalization (scale and bias), a BatchNormalization;
- otherwise a new ``Mul`` by the constant ``1 / s`` is inserted before the layers.

The float function is unchanged (up to float rounding). It targets activations with
outlier channels feeding dense layers, and a depthwise convolution's input, whose channels
one per-tensor 8-bit grid serves while their ranges differ tens of times (PP-OCRv4's
recogniser: a BN-folded stem's output channels span 0.23 to 15.5). An inserted ``Mul``
joins the activation chain before it (:mod:`quant_core.plan.activation_chains`), so the
planner quantizes only the smoothed tensor.

Example:
    See ``tests/test_algorithms_smoothquant.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs
import numpy as np
import onnx

from quant_algos.smoothquant import smooth_layers
from quant_core.algorithm_config import SmoothQuantConfig, samples_to_use
from quant_core.onnx_qdq.graph import GraphIndex, is_default_domain, node_attribute
from quant_onnx.algorithms.capture import Feeds, prepare_batches
from quant_onnx.algorithms.channel_scaling import fold_into_producer, insert_mul, owned_constant
from quant_onnx.algorithms.reductions import Reduction, reduce_over
from quant_onnx.graph_edit import copy_model, set_initializer


@attrs.frozen
class SmoothedActivation:
    """One smoothed activation: the tensor, the layers reading it, and where ``1/s`` went
    (``"into:<node>"`` or ``"mul:<new node>"``)."""

    tensor: str
    layers: tuple[str, ...]
    folded: str


@attrs.frozen
class SmoothQuantReport:
    """What :func:`apply_smoothquant` did.

    Example:
        >>> SmoothQuantReport((SmoothedActivation("x", ("fc",), "mul:x_smooth"),), ()).to_dict()["smoothed"][0]["layers"]
        ['fc']
    """

    smoothed: tuple[SmoothedActivation, ...]
    notes: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        smoothed = [attrs.asdict(s) | {"layers": list(s.layers)} for s in self.smoothed]
        return {"smoothed": smoothed, "notes": list(self.notes)}


@attrs.frozen(eq=False)
class _Consumer:
    node: onnx.NodeProto
    weight_name: str
    weight: np.ndarray
    in_axis: int
    family: str


def _consumer(node: onnx.NodeProto, tensor: str, index: GraphIndex) -> _Consumer | None:
    if not is_default_domain(node) or len(node.input) < 2 or node.input[0] != tensor or tensor in node.input[1:]:
        return None
    weight = index.constant(node.input[1])
    owned = owned_constant(index, node.input[1]) is not None
    if weight is None or not owned or weight.dtype != np.float32:
        return None
    if node.op_type == "MatMul" and weight.ndim == 2:
        return _Consumer(node, node.input[1], weight, 0, "dense")
    if node.op_type == "Gemm" and weight.ndim == 2 and not node_attribute(node, "transA", 0):
        return _Consumer(node, node.input[1], weight, 1 if node_attribute(node, "transB", 0) else 0, "dense")
    if node.op_type != "Conv" or weight.ndim < 3:
        return None
    group = node_attribute(node, "group", 1)
    if group == 1 and all(k == 1 for k in weight.shape[2:]):
        return _Consumer(node, node.input[1], weight, 1, "conv")
    if group == weight.shape[0] and weight.shape[1] == 1:
        # Depthwise: input channel c meets only filter c, so its scale lands on that filter's
        # own per-channel weight grid (exact with the zero padding a Conv pads with).
        return _Consumer(node, node.input[1], weight, 0, "conv")
    return None


def _candidates(model: onnx.ModelProto) -> tuple[dict[str, list[_Consumer]], list[str]]:
    """Activation tensor -> the layers reading it, for activations every reader of
    which can absorb a per-input-channel scale."""
    index = GraphIndex(model.graph)
    groups: dict[str, list[_Consumer]] = {}
    notes: list[str] = []
    for node in index.topological_order():
        if node.op_type not in ("MatMul", "Gemm", "Conv") or not node.input or node.input[0] in groups:
            continue
        tensor = node.input[0]
        if index.constant(tensor) is not None:
            continue
        readers = [_consumer(c, tensor, index) for c in index.consumers(tensor)]
        ok = [r for r in readers if r is not None]
        if len(ok) != len(readers) or index.is_graph_output(tensor) or len({r.family for r in ok}) != 1:
            notes.append(f"{tensor}: read by a node that cannot absorb the scale; left alone")
            continue
        groups[tensor] = ok
    return groups, notes


def _absmax_reductions(groups: dict[str, list[_Consumer]]) -> list[Reduction]:
    """Each candidate's per-channel max |x|. ``C`` is the readers' input width: ``x`` is
    reshaped to ``[N, C, -1]`` (Conv, channel axis 1) or ``[-1, C]`` (dense, channel last)
    and reduced over every other axis."""
    reductions = []
    for tensor, readers in groups.items():
        first = readers[0]
        channels = int(first.weight.shape[first.in_axis])
        conv = first.family == "conv"
        shape, axes = ((0, channels, -1), (0, 2)) if conv else ((-1, channels), (0,))
        reductions.append(Reduction(tensor, "ReduceMax", axes, shape, absolute=True))
    return reductions


def _measure(
    model: onnx.ModelProto, groups: dict[str, list[_Consumer]], feeds: list[dict]
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Per-channel max |x| and the rank of every candidate activation, in one pass
    (reduced inside onnxruntime)."""
    absmax: dict[str, np.ndarray] = {}
    ranks: dict[str, int] = {}
    for batch in reduce_over(model, _absmax_reductions(groups), feeds):
        for tensor, (reduced, shape) in zip(groups, batch, strict=True):
            value = reduced.astype(np.float64)
            absmax[tensor] = value if tensor not in absmax else np.maximum(absmax[tensor], value)
            ranks[tensor] = int(shape.size)
    return absmax, ranks


def apply_smoothquant_with_report(
    model: onnx.ModelProto, batches: Iterable[Feeds], config: SmoothQuantConfig
) -> tuple[onnx.ModelProto, SmoothQuantReport]:
    """:func:`apply_smoothquant` that also returns a :class:`SmoothQuantReport`."""
    groups, notes = _candidates(model)
    out = copy_model(model)
    if not groups:
        return out, SmoothQuantReport((), (*notes, "no MatMul/Gemm/1x1-Conv/depthwise-Conv inputs to smooth"))
    absmax, ranks = _measure(model, groups, prepare_batches(batches, samples_to_use(config)))
    smoothed = []
    for tensor, readers in groups.items():
        index = GraphIndex(out.graph)  # weights as earlier smoothing left them
        weights = [np.asarray(index.constant(r.weight_name)) for r in readers]
        result = smooth_layers(absmax[tensor], [(w, r.in_axis) for w, r in zip(weights, readers, strict=True)], config)
        if np.allclose(result.scales, 1.0):
            continue
        rank = ranks[tensor]
        family = readers[0].family
        folded = fold_into_producer(out, index, tensor, family, rank, result.input_multiplier)
        where = (
            f"into:{folded}"
            if folded
            else f"mul:{insert_mul(out, index, tensor, family, rank, result.input_multiplier).name}"
        )
        for reader, weight in zip(readers, result.weights, strict=True):
            set_initializer(out.graph, reader.weight_name, weight)
        smoothed.append(SmoothedActivation(tensor, tuple(r.node.name for r in readers), where))
    return out, SmoothQuantReport(tuple(smoothed), tuple(notes))


def apply_smoothquant(model: onnx.ModelProto, batches: Iterable[Feeds], config: SmoothQuantConfig) -> onnx.ModelProto:
    """A copy of ``model`` (pre-processed float model) with SmoothQuant applied; the
    float function is unchanged. ``batches``: calibration feeds, first
    ``config.num_samples`` samples (``quant_core.algorithm_config.DEFAULT_NUM_SAMPLES``
    when unset)."""
    return apply_smoothquant_with_report(model, batches, config)[0]
