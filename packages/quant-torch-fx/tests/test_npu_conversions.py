"""The NPU conversions on the FX graph before calibration: each rewrite computes its rule's
function (checked against torch), ConvTranspose's is exact, and a config with
``npu_conversions`` plans and calibrates the converted graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quant_core.presets import get_preset
from quant_torch_fx import ModelQuantizer
from quant_torch_fx.aten_map import op_name
from quant_torch_fx.capture import capture
from quant_torch_fx.graph_plan import build_plan_graph
from quant_torch_fx.npu_conversions import convert_for_npu
from quant_torch_fx.prepare import graph_info, normalize


class Activations(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.silu(self.conv(x))
        y = y + torch.sigmoid(y) + F.hardswish(y)
        return torch.tanh(y) + F.gelu(y)


def _hs(x: torch.Tensor) -> torch.Tensor:
    return F.hardsigmoid(x)


def _expected(model: Activations, x: torch.Tensor, rules: set[str]) -> torch.Tensor:
    c = model.conv(x)
    y = c * _hs(c) if "silu" in rules else F.silu(c)
    y = (
        y
        + (_hs(y) if "sigmoid" in rules else torch.sigmoid(y))
        + (y * _hs(y) if "hard_swish" in rules else F.hardswish(y))
    )
    t = torch.clamp(y * (2 / 3), -1, 1) if "tanh" in rules else torch.tanh(y)
    g = y * _hs(y * 1.702) if "gelu" in rules else F.gelu(y)
    return t + g


@pytest.mark.parametrize(
    "rules", [("silu",), ("sigmoid",), ("hard_swish",), ("tanh",), ("gelu",), ("silu", "sigmoid", "tanh", "gelu")]
)
def test_each_rule_computes_its_function(rules: tuple[str, ...]) -> None:
    model = Activations().eval()
    x = torch.randn(2, 3, 6, 6) * 3
    gm = capture(model, (x,))
    normalize(gm, fold_batch_norms=True)
    done = convert_for_npu(gm, rules)
    assert {c.rule for c in done} == set(rules)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), _expected(model, x, set(rules)), atol=1e-5, rtol=1e-5)
    ops = [n.op_type for n in build_plan_graph(gm).graph.nodes]
    assert ("Sigmoid" in ops) == (not {"silu", "sigmoid"} <= set(rules))


def test_sigmoid_tanh_computes_the_sigmoid_with_tanh() -> None:
    """``sigmoid_tanh`` rewrites every sigmoid (SiLU's too) as ``0.5 * tanh(0.5 x) + 0.5``:
    the same outputs, and no sigmoid left for the planner."""
    model = Activations().eval()
    x = torch.randn(2, 3, 6, 6) * 3
    gm = capture(model, (x,))
    normalize(gm, fold_batch_norms=True)
    done = convert_for_npu(gm, ("sigmoid_tanh",))
    assert [c.rule for c in done] == ["sigmoid_tanh", "sigmoid_tanh"]
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-5)
    ops = [n.op_type for n in build_plan_graph(gm).graph.nodes]
    assert "Sigmoid" not in ops and ops.count("Tanh") == 3  # the model's own tanh and two new ones


@pytest.mark.parametrize(
    "kwargs",
    [
        {"stride": 2},
        {"stride": 2, "padding": 1, "output_padding": 1},
        {"stride": 3, "padding": 2, "dilation": 2},
        {"stride": 2, "padding": 1, "groups": 2},
    ],
)
def test_conv_transpose_rewrite_is_exact(kwargs: dict) -> None:
    ops = _exact_rewrite(
        nn.Sequential(nn.ConvTranspose2d(4, 6, 3, **kwargs)), torch.randn(2, 4, 5, 7), "conv_transpose"
    )
    assert "ConvTranspose" not in ops and "Conv" in ops


def _exact_rewrite(model: nn.Module, x: torch.Tensor, rule: str) -> list[str]:
    """Apply ``rule`` to ``model``'s graph; the result computes what the model does. Returns the op types."""
    model = model.eval()
    gm = capture(model, (x,))
    normalize(gm, fold_batch_norms=True)
    assert {c.rule for c in convert_for_npu(gm, (rule,))} == {rule}
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-5)
    return [n.op_type for n in build_plan_graph(gm).graph.nodes]


def test_quantizer_plans_the_converted_graph() -> None:
    model = Activations().eval()
    x = torch.randn(4, 3, 6, 6)
    config = get_preset("xint8").evolve(npu_conversions=("silu", "sigmoid"))
    quantized = ModelQuantizer(config, quiet=True).quantize_model(model, (x,), [x])
    info = graph_info(quantized)
    assert {c["rule"] for c in info.algorithms["npu_conversions"]} == {"silu", "sigmoid"}
    assert not [n for n in quantized.graph.nodes if op_name(n) == "sigmoid"]
    assert [n for n in quantized.graph.nodes if op_name(n) == "hardsigmoid"]
    plain = ModelQuantizer("xint8", quiet=True).quantize_model(model, (x,), [x])
    assert "npu_conversions" not in graph_info(plain).algorithms


class Splits(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x.split([3, 5], 1)
        c, d = torch.chunk(x, 2, 1)
        return torch.cat([b, a], 1) + torch.cat([d, c], 1)


def test_split_becomes_slices() -> None:
    ops = _exact_rewrite(Splits(), torch.randn(2, 8, 4), "split")
    assert "Split" not in ops and ops.count("Slice") == 4


class SqueezeExcite(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.fc(x.mean((2, 3), keepdim=True)))


def test_spatial_mean_becomes_a_global_pool() -> None:
    ops = _exact_rewrite(SqueezeExcite(), torch.randn(2, 4, 5, 5), "reduce_mean")
    assert "ReduceMean" not in ops and "GlobalAveragePool" in ops
