"""The node-by-node walk the layer-wise algorithms read a graph through: each node runs once,
values equal a fresh cut of the graph run from the input, rewritten weights reach what runs
after, and spilling live values to disk changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from models import images, mobile_block_net

from quant_torch_fx import ModelQuantizer
from quant_torch_fx.algorithms.incremental import IncrementalGraphRunner
from quant_torch_fx.algorithms.probe import float_mode, probe, run_probe
from quant_torch_fx.algorithms.runner import TorchLayerRunner
from quant_torch_fx.prepare import weight_quantizers

EXAMPLE = torch.zeros(1, 3, 8, 8)


@pytest.fixture(scope="module")
def calibrated() -> tuple[torch.fx.GraphModule, list[tuple[torch.Tensor, ...]]]:
    batches = images(3, batch=4)
    gm = ModelQuantizer("xint8", quiet=True).quantize_model(mobile_block_net(), EXAMPLE, batches)
    return gm, [(b,) for b in batches]


def _layer_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and "conv2d" in str(n.target)]


def _cut(gm: torch.fx.GraphModule, name: str, batches: list) -> list[torch.Tensor]:
    return [values[0] for values in run_probe(probe(gm, [name]), batches)]


def _computing_nodes(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op in ("call_function", "call_module"))


@pytest.mark.parametrize("budget", [1 << 30, 0])
def test_walk_equals_running_the_cut_graph_and_runs_each_node_once(calibrated, budget: int) -> None:
    gm, batches = calibrated
    walk = IncrementalGraphRunner(gm, batches, memory_budget=budget)
    for node in _layer_nodes(gm):
        source = node.args[0]
        assert isinstance(source, torch.fx.Node)
        for got, expected in zip(
            (v[0] for v in walk.compute([source.name])), _cut(gm, source.name, batches), strict=True
        ):
            assert torch.equal(got, expected)
    output = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    last = output[0] if isinstance(output, tuple | list) else output
    assert all(
        torch.equal(a[0], b) for a, b in zip(walk.compute([last.name]), _cut(gm, last.name, batches), strict=True)
    )
    assert walk.nodes_run == _computing_nodes(gm)
    walk.close()
    assert walk.spilled == 0


def test_spilled_values_live_in_a_private_folder_removed_on_close(calibrated) -> None:
    gm, batches = calibrated
    walk = IncrementalGraphRunner(gm, batches, memory_budget=0)
    first = _layer_nodes(gm)[1]
    list(walk.compute([first.args[0].name]))
    assert walk.spilled > 0
    folder = Path(walk._live._directory.name)
    assert folder.exists()
    walk.close()
    assert not folder.exists()


def test_rewritten_weights_reach_what_runs_after_and_released_nodes_refuse(calibrated) -> None:
    gm, batches = calibrated
    runner = TorchLayerRunner(gm, batches)
    layer = runner.layers()[0]
    before = [v.copy() for v in runner.quantized_inputs(runner.layers()[1])]  # layer 0 ran: committed
    fresh = TorchLayerRunner(gm, batches)
    codes = torch.zeros(layer.float_weight.shape, dtype=torch.int8).numpy()
    fresh.set_weight_codes(fresh.layers()[0], codes)
    after = list(fresh.quantized_inputs(fresh.layers()[1]))
    assert any(not (a == b).all() for a, b in zip(after, before, strict=True))
    with pytest.raises(ValueError, match="already released"):
        list(fresh._quantized.compute([_layer_nodes(gm)[0].args[0].name]))


def test_float_walk_runs_with_every_quantizer_passing_through(calibrated) -> None:
    gm, batches = calibrated
    runner = TorchLayerRunner(gm, batches)
    layer = runner.layers()[-1]
    node = runner._fx(layer)
    with float_mode(runner.float_gm):
        expected = [v.detach().numpy() for v in _cut(runner.float_gm, node.name, batches)]
    quantized = [v.copy() for v in runner.quantized_outputs(layer)]
    for got, want, q in zip(runner.float_outputs(layer), expected, quantized, strict=True):
        assert (got == want).all()
        assert not (q == want).all()  # the quantized walk does quantize
    assert all(fq.quantizing for _k, fq in weight_quantizers(runner.float_gm))  # float_mode restored
