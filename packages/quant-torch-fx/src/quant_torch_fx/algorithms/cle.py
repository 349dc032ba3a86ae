"""Cross-layer equalization of a normalised float graph module (before planning and
calibration): the torch side of :mod:`quant_algos.drivers.cle`.

The driver decides everything (chains, the ReLU6 rule, high-bias absorption, the new
weights) on the planner's view of the graph (:func:`~quant_torch_fx.graph_plan.build_plan_graph`,
the same protocol the ONNX backend maps its models onto), measuring the float graph over
the first ``CLEConfig.num_samples`` held samples; this module writes the rescaled
weights and biases into the graph's tensors and turns the chosen ReLU6 (``hardtanh``/
``clamp``) nodes into ``relu``. Only ``get_attr`` tensors are rewritten: a QAT
``ConvBn``'s weights are not, so CLE runs with PTQ (batch norm folded).

Example:
    >>> import torch
    >>> from quant_core.algorithm_config import CLEConfig
    >>> from quant_torch_fx.prepare import normalize
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
    >>> with torch.no_grad():
    ...     _ = net[0].weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 8.0]]))
    >>> from quant_torch_fx.capture import capture
    >>> gm = capture(net, (torch.randn(1, 2),))
    >>> normalize(gm, fold_batch_norms=True)
    >>> x = torch.randn(4, 2)
    >>> before = gm(x)
    >>> report = apply_cle(gm, CLEConfig(absorb_high_bias=False), None)
    >>> report.chains, bool(torch.allclose(gm(x), before, atol=1e-5)), gm.get_parameter("0.weight").abs().max().item() < 8
    ((('0/linear', '2/linear_1'),), True, True)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.fx import GraphModule

from quant_algos.drivers.cle import CLEReport, plan_equalization
from quant_core.algorithm_config import CLEConfig
from quant_torch_fx.algorithms.edit import write_layers
from quant_torch_fx.algorithms.probe import Batch, GraphTensors, take_samples
from quant_torch_fx.graph_plan import build_plan_graph

aten = torch.ops.aten


def apply_cle(gm: GraphModule, config: CLEConfig, batches: Sequence[Batch] | None) -> CLEReport:
    """Equalize ``gm`` in place (a normalised float graph, batch norm folded); ``batches``:
    held calibration batches for the ReLU6 check and high-bias absorption (``None``: the
    first is done blind, the second skipped, as the driver reports)."""
    view = build_plan_graph(gm)
    getters = {n.name for n in gm.graph.nodes if n.op == "get_attr"}
    source = None if batches is None else GraphTensors(gm, take_samples(batches, config.num_samples))
    equalization = plan_equalization(view.graph, config, source, writable=getters.__contains__)
    for name in equalization.report.replaced_relu6:
        node = view.nodes[name]
        node.target = aten.relu.default
        node.args, node.kwargs = (node.args[0],), {}
    write_layers(gm, view, equalization.layers, equalization.refs)
    gm.recompile()
    return equalization.report
