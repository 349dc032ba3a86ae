"""Activation equalization on the torch backend: the same sites as quant-onnx's, the float
function kept, the quantized model closer to float, and the export faithful to it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from models import images
from torch import nn

from quant_core.algorithm_config import ActivationEqualizationConfig
from quant_core.errors import DataError
from quant_core.presets import get_preset
from quant_torch_fx import ModelQuantizer
from quant_torch_fx.algorithms.probe import float_mode, probe, run_probe
from quant_torch_fx.export import onnx_model
from quant_torch_fx.export_fidelity import node_by_node, reference_runner
from quant_torch_fx.prepare import graph_info

EXAMPLE = torch.zeros(1, 3, 8, 8)


class HardSwishBlockNet(nn.Module):
    """A MobileNetV3-like chain: conv + BN + HardSwish, depthwise conv + BN + HardSwish, 1x1
    conv, pooling, linear; BN scales spread the channels as a trained stem's do."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.dw, self.bn2 = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), nn.BatchNorm2d(8)
        self.pw = nn.Conv2d(8, 8, 1)
        self.fc = nn.Linear(8, 5)
        with torch.no_grad():
            self.bn1.weight.copy_(torch.logspace(-2.5, 0.5, 8)[torch.randperm(8)])
            self.bn2.weight.copy_(torch.logspace(-2, 0.5, 8)[torch.randperm(8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.hardswish(self.bn1(self.conv1(x)))
        y = F.hardswish(self.bn2(self.dw(y)))
        return self.fc(F.adaptive_avg_pool2d(self.pw(y), 1).flatten(1))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return HardSwishBlockNet().eval()


def test_the_sites_the_float_function_and_the_gain() -> None:
    net, calibration, test = _net(), images(4, batch=16), torch.cat(images(2, batch=16, seed=9))
    with torch.no_grad():
        reference = net(test)
    # The preset's equalization alone (its bias correction moves the float function on purpose).
    equalized = get_preset("a8w8").evolve(algorithms=(ActivationEqualizationConfig(),))
    qmodel = ModelQuantizer(equalized, quiet=True).quantize_model(net, EXAMPLE, calibration)
    report = graph_info(qmodel).algorithms["activation_equalization"]
    sites = sorted((e["side"], e["compensated"]) for e in report["equalized"])
    # conv1's and dw's outputs before their HardSwish; dw's input after conv1's HardSwish.
    assert sites == [("input", "mul"), ("output", "mul"), ("output", "mul")], report
    with float_mode(qmodel), torch.no_grad():
        np.testing.assert_allclose(qmodel(test).numpy(), reference.numpy(), rtol=1e-4, atol=1e-4)
    # Every channel of the block's output (after the depthwise Conv's HardSwish) comes
    # through the 8-bit grids far closer to float: 0-29 dB per channel before, 30-35 after.
    plain = ModelQuantizer(get_preset("a8w8").evolve(algorithms=()), quiet=True).quantize_model(
        net, EXAMPLE, calibration
    )
    worst = {label: _channel_sqnr(m, "hardswish_1", test).min() for label, m in (("plain", plain), ("ae", qmodel))}
    assert worst["ae"] > worst["plain"] + 20.0, worst


def _channel_sqnr(model: torch.fx.GraphModule, node: str, x: torch.Tensor) -> np.ndarray:
    """Per-channel SQNR (dB) of the fake-quantized model's tensor ``node`` against float."""
    cut = probe(model, [node])
    (quantized,) = next(run_probe(cut, [(x,)]))
    with float_mode(model):
        (exact,) = next(run_probe(probe(model, [node]), [(x,)]))
    error = (quantized - exact).pow(2).mean(dim=(0, 2, 3))
    return (10 * torch.log10(exact.pow(2).mean(dim=(0, 2, 3)) / error)).numpy()


def test_the_export_matches_the_frozen_model_node_by_node() -> None:
    net = _net()
    q = ModelQuantizer("a8w8", quiet=True)
    frozen = q.freeze(q.quantize_model(net, EXAMPLE, images(4, batch=16)))
    proto = onnx_model(frozen, EXAMPLE, opset=19)
    assert sum(n.op_type == "Mul" for n in proto.graph.node) >= 3  # the compensating scales
    x = torch.cat(images(1, batch=8, seed=5))
    fidelity = node_by_node(proto, frozen, (x,), reference_runner)
    assert fidelity.chain and not fidelity.unmatched
    assert max(fidelity.chain.values()) <= 1 and max(fidelity.isolated.values()) <= 1


def test_qat_without_folded_batch_norm_leaves_it_out_and_says_so() -> None:
    qat = ModelQuantizer("a8w8", quiet=True).prepare_qat(_net(), EXAMPLE)
    for kind in ("activation_equalization", "bias_correction"):  # the preset's two corrections
        notes = graph_info(qat).algorithms[kind]["notes"]
        assert notes and "left out" in notes[0], kind


def test_an_empty_batch_adds_nothing_and_only_empty_batches_are_never_observed_as_in_calibration() -> None:
    empty = torch.zeros(0, 3, 8, 8)
    for preset in ("a8w8", "xint8"):  # a8w8 equalizes activations first, xint8 does not
        with pytest.raises(DataError, match=r"calibration: tensor '\w+' was never observed \(empty in every batch\)"):
            ModelQuantizer(preset, quiet=True).quantize_model(HardSwishBlockNet().eval(), EXAMPLE, [empty])
    torch.manual_seed(0)
    net = HardSwishBlockNet().eval()
    q = ModelQuantizer("a8w8", quiet=True)
    with_empty = q.quantize_model(net, EXAMPLE, [empty, *images(2)])
    without = q.quantize_model(net, EXAMPLE, images(2))
    x = images(1, seed=7)[0]
    with torch.no_grad():
        assert torch.equal(with_empty(x), without(x))
