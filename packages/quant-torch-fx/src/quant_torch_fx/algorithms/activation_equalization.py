"""Activation equalization of a normalised float graph module (before planning and
calibration): the torch side of :mod:`quant_algos.drivers.activation_equalization`.

The driver decides on the planner's view of the graph
(:func:`~quant_torch_fx.graph_plan.build_plan_graph`, as for CLE) from each site's
per-channel max ``|x|`` over the held samples; this module writes the rescaled Convs into
the graph's tensors and inserts each compensating scale as ``aten.mul`` by a buffer. Only
``get_attr`` weights are rewritten, so with QAT's unfolded ``ConvBn`` nothing is, and the
report says so.

Example:
    >>> import torch
    >>> from quant_core.algorithm_config import ActivationEqualizationConfig
    >>> from quant_core.presets import get_preset
    >>> from quant_torch_fx.capture import capture
    >>> from quant_torch_fx.prepare import normalize
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.Conv2d(4, 4, 3, groups=4))
    >>> with torch.no_grad():
    ...     _ = net[0].weight.mul_(torch.tensor([1.0, 100.0, 0.01, 1.0]).view(4, 1, 1, 1))
    >>> gm = capture(net, (torch.randn(1, 3, 8, 8),))
    >>> normalize(gm, fold_batch_norms=True)
    >>> x = torch.randn(2, 3, 8, 8)
    >>> before = gm(x)
    >>> report = apply_activation_equalization(gm, ActivationEqualizationConfig(), get_preset("a8w8"), [(x,)])
    >>> [(e.side, e.compensated) for e in report.equalized], bool(torch.allclose(gm(x), before, rtol=1e-4, atol=1e-5))
    ([('input', 'into:0/conv2d')], True)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch.fx import GraphModule

from quant_algos.drivers.activation_equalization import (
    ActivationEqualizationReport,
    ScaleInsertion,
    merged_ranges,
    plan_activation_equalization,
)
from quant_core.algorithm_config import ActivationEqualizationConfig, samples_to_use
from quant_core.config import QuantConfig
from quant_core.errors import DataError
from quant_torch_fx.algorithms.edit import new_buffer, write_layers
from quant_torch_fx.algorithms.probe import Batch, GraphTensors, take_samples
from quant_torch_fx.graph_plan import GraphView, build_plan_graph

aten = torch.ops.aten


def apply_activation_equalization(
    gm: GraphModule,
    algorithm: ActivationEqualizationConfig,
    config: QuantConfig,
    batches: Sequence[Batch],
) -> ActivationEqualizationReport:
    """Equalize ``gm``'s activations in place (a normalised float graph, batch norm
    folded) under ``config``'s formats, measured over the first
    ``algorithm.num_samples`` samples of ``batches``."""
    view = build_plan_graph(gm)
    getters = {n.name for n in gm.graph.nodes if n.op == "get_attr"}
    source = GraphTensors(gm, take_samples(batches, samples_to_use(algorithm)))

    def measure(tensors: Sequence[str]) -> Mapping[str, tuple[np.ndarray, np.ndarray]]:
        nodes = [view.tensors[t].name for t in tensors]
        # As the observers do: an empty batch adds nothing (a reduction over it has no value).
        ranges = merged_ranges(
            {
                tensor: _channel_range(values[node])
                for tensor, node in zip(tensors, nodes, strict=True)
                if values[node].size
            }
            for values in source.tensors(nodes)
        )
        for tensor in tensors:
            if tensor not in ranges:  # the error calibration would give for it
                raise DataError(f"calibration: tensor {tensor!r} was never observed (empty in every batch)")
        return ranges

    plan = plan_activation_equalization(view.graph, config, measure, writable=getters.__contains__)
    write_layers(gm, view, plan.layers, plan.refs)
    for insertion in plan.insertions:
        _insert_mul(gm, view, insertion)
    gm.recompile()
    return plan.report


def _channel_range(value: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel (min, max) of ``value`` (channels on axis 1)."""
    rows = np.moveaxis(value, 1, 0).reshape(value.shape[1], -1)
    return rows.min(axis=1), rows.max(axis=1)


def _insert_mul(gm: GraphModule, view: GraphView, insertion: ScaleInsertion) -> None:
    """``aten.mul(x, buffer)`` (the multiplier on axis 1) read by every former reader of ``x``."""
    node = view.tensors[insertion.tensor]
    value = torch.tensor(insertion.multiplier, dtype=torch.float32).reshape((-1,) + (1,) * (insertion.rank - 2))
    getter = new_buffer(gm, node, "equalize_scale", value, after=True)
    with gm.graph.inserting_after(getter):
        mul = gm.graph.call_function(aten.mul.Tensor, (node, getter))
    if isinstance(meta := node.meta.get("val"), torch.Tensor):
        mul.meta["val"] = meta
    node.replace_all_uses_with(mul, delete_user_cb=lambda user: user is not mul)
