"""Capture, ATen -> planner mapping, instrumentation, and train()/eval() of prepared graphs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from models import conv_bn_net, images
from torch import nn

from quant_torch_fx import ModelQuantizer
from quant_torch_fx.capture import capture
from quant_torch_fx.graph_plan import build_plan_graph
from quant_torch_fx.modules import ConvBn, GraphBatchNorm
from quant_torch_fx.prepare import activation_quantizers, graph_info, normalize, weight_quantizers


def _plan_nodes(model: nn.Module, example: torch.Tensor, *, fold: bool = True) -> list[tuple[str, str]]:
    gm = capture(model, (example,))
    normalize(gm, fold_batch_norms=fold)
    return [(n.op_type, n.name) for n in build_plan_graph(gm).graph.nodes]


class EveryOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.up = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.fc = nn.Linear(4, 3)
        self.w = nn.Parameter(torch.randn(4, 3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.up(torch.clamp(self.conv(x), 0.0, 3.0))
        y = F.hardtanh(y, -1.0, 1.0) + F.hardswish(y) * torch.sigmoid(y) - F.hardsigmoid(y)
        y = F.interpolate(F.avg_pool2d(y, 2), scale_factor=2.0, mode="nearest")
        y = F.pad(y, (1, 1, 1, 1))
        pooled = y.mean((2, 3))
        flat = torch.flatten(F.adaptive_avg_pool2d(y, 1), 1)
        return self.fc(flat), pooled @ self.w, y.permute(0, 2, 3, 1).reshape(y.shape[0], -1), torch.tanh(pooled)


def test_aten_ops_map_onto_onnx_op_types() -> None:
    ops = [op for op, _name in _plan_nodes(EveryOp().eval(), torch.randn(1, 3, 8, 8))]
    assert ops == [
        "Conv", "Clip", "ConvTranspose", "Clip", "HardSwish", "Sigmoid", "Mul", "Add", "HardSigmoid", "Sub",
        "AveragePool", "Resize", "Pad", "ReduceMean", "GlobalAveragePool", "Flatten", "Gemm", "MatMul",
        "Transpose", "Reshape", "Tanh",
    ]  # fmt: skip


def test_attributes_the_planner_reads() -> None:
    gm = capture(EveryOp().eval(), (torch.randn(1, 3, 8, 8),))
    normalize(gm, fold_batch_norms=True)
    nodes = {n.op_type: n for n in build_plan_graph(gm).graph.nodes}
    assert dict(nodes["Gemm"].attributes) == {"transB": 1}
    clips = [n for n in build_plan_graph(gm).graph.nodes if n.op_type == "Clip"]
    assert [dict(c.attributes) for c in clips] == [{"min": 0.0, "max": 3.0}, {"min": -1.0, "max": 1.0}]
    assert nodes["Resize"].attr("mode") == "nearest" and nodes["Pad"].attr("value") == 0.0


def test_silu_is_sigmoid_times_input_and_dropout_is_an_alias() -> None:
    names = _plan_nodes(conv_bn_net(), torch.randn(1, 3, 8, 8))
    ops = [op for op, _ in names]
    assert "Sigmoid" in ops and ops[ops.index("Sigmoid") + 1] == "Mul"
    assert not any("dropout" in name.lower() for _op, name in names)
    assert ops.count("Conv") == 2 and "BatchNormalization" not in ops  # BN folded into the convs


def test_node_names_carry_module_paths() -> None:
    names = [name for _op, name in _plan_nodes(conv_bn_net(), torch.randn(1, 3, 8, 8))]
    assert "conv1/conv2d" in names and "head.1/linear" in names


def test_plan_decisions_become_quantizers() -> None:
    gm = ModelQuantizer("a8w8", quiet=True).prepare(conv_bn_net(), torch.randn(1, 3, 8, 8))
    info = graph_info(gm)
    groups = {g.key: g for g in info.plan.groups}
    # conv1's output is fused with its ReLU6; the concat shares one scale with its inputs
    fused = {f.producer for f in info.plan.fused}
    assert "conv1/conv2d" in fused
    concat = next(g for g in groups.values() if any(m.startswith("cat") for m in g.members))
    assert len(concat.members) >= 3
    assert len(dict(activation_quantizers(gm))) == len(info.plan.groups)
    assert sorted(dict(weight_quantizers(gm))) == sorted(s.node for s in info.plan.weights)
    axes = {s.node: s.spec.per_channel_axis for s in info.plan.weights}
    assert axes == {"conv1/conv2d": 0, "conv2/conv2d_1": 0, "head.1/linear": 0}


def test_shape_reads_keep_the_float_tensor() -> None:
    class Viewer(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x).view(x.size(0), -1)

    gm = ModelQuantizer("a8w8", quiet=True).prepare(Viewer(), torch.randn(2, 3, 4))
    sizes = [n for n in gm.graph.nodes if n.op == "call_function" and "sym_size" in str(n.target)]
    assert sizes and all(n.args[0].op == "placeholder" for n in sizes)


def test_inplace_ops_become_out_of_place() -> None:
    class Inplace(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 2.0
            y.add_(1.0)
            return torch.relu_(y)

    ops = [op for op, _ in _plan_nodes(Inplace(), torch.randn(2, 3))]
    assert ops == ["Mul", "Add", "Relu"]
    gm = ModelQuantizer("a8w8", quiet=True).prepare(Inplace(), torch.randn(2, 3))
    assert not [n for n in gm.graph.nodes if str(n.target).endswith("_.Tensor") or str(n.target).endswith("_.default")]


def test_capture_takes_any_batch_size_after_a_batch_of_one() -> None:
    model = conv_bn_net()
    gm = capture(model, (torch.randn(1, 3, 8, 8),))
    for batch in (1, 2, 7):
        x = torch.randn(batch, 3, 8, 8)
        torch.testing.assert_close(gm(x), model(x))


def test_input_model_is_not_modified() -> None:
    model = conv_bn_net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    q = ModelQuantizer("xint8", quiet=True)
    qat = q.prepare_qat(model, torch.randn(1, 3, 8, 8))
    qat.train()
    qat(torch.randn(4, 3, 8, 8)).sum().backward()
    assert not model.training
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)


def _disable_quantization(model: nn.Module) -> None:
    from quant_torch_fx.quantizer import FakeQuantizer

    for module in model.modules():
        if isinstance(module, FakeQuantizer):
            module.quantizing = module.observing = False


def test_train_and_eval_switch_batch_norm_and_dropout() -> None:
    model = conv_bn_net()
    qat = ModelQuantizer("a8w8", qat_method="ste", quiet=True).prepare_qat(
        model, torch.randn(1, 3, 8, 8), calib_loader=images(2)
    )
    assert any(isinstance(m, ConvBn) for m in qat.modules())
    _disable_quantization(qat)
    x = images(1, batch=16, seed=5)[0]
    reference = conv_bn_net()
    qat.eval()
    torch.testing.assert_close(qat(x), reference.eval()(x), rtol=1e-4, atol=1e-5)
    assert torch.equal(qat(x), qat(x))  # eval: dropout off, running statistics
    qat.train()
    torch.manual_seed(3)
    got = qat(x)
    torch.manual_seed(3)
    expected = reference.train()(x)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)  # batch statistics, same dropout mask
    bn_stats = [m.bn.running_mean for m in qat.modules() if isinstance(m, ConvBn)]
    torch.testing.assert_close(bn_stats[0], reference.bn1.running_mean, rtol=1e-5, atol=1e-6)


def test_standalone_batch_norm_becomes_a_module() -> None:
    class BnOnly(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm2d(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(torch.relu(x))

    gm = ModelQuantizer("a8w8", quiet=True).prepare(BnOnly().eval(), torch.randn(1, 3, 4, 4))
    assert any(isinstance(m, GraphBatchNorm) for m in gm.modules())
    assert [f.op_type for f in graph_info(gm).plan.float_nodes] == ["BatchNormalization"]
