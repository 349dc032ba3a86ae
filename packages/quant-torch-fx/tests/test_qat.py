"""QAT: straight-through, LSQ and TQT gradients, conv+BN simulated then folded, training
with labels or with a teacher, checkpoints."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from models import conv_bn_net, images
from torch import nn

from quant_core.spec import RoundMode
from quant_torch_fx import DataError, ModelQuantizer, train_qat
from quant_torch_fx.modules import ConvBn
from quant_torch_fx.prepare import activation_quantizers, graph_info, quantized_graphs, weight_quantizers
from quant_torch_fx.qat_ops import lsq_fake_quantize, tqt_fake_quantize
from quant_torch_fx.quantizer import FakeQuantizer


def test_lsq_gradients_match_the_paper() -> None:
    torch.manual_seed(0)
    x = (torch.randn(500) * 3).requires_grad_()
    s = torch.tensor(0.05, requires_grad=True)
    qmin, qmax, g = -128, 127, 0.3
    y = lsq_fake_quantize(x, s, torch.tensor(0.0), qmin, qmax, RoundMode.HALF_EVEN, grad_scale=g)
    upstream = torch.randn(500)
    (y * upstream).sum().backward()
    v = x.detach() / 0.05
    inside = (torch.round(v) >= qmin) & (torch.round(v) <= qmax)
    ds = torch.where(inside, torch.round(v) - v, torch.clamp(torch.round(v), qmin, qmax))
    torch.testing.assert_close(s.grad, (upstream * ds).sum() * g, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(x.grad, upstream * inside)


def test_lsq_per_channel_scale_gradients_sum_over_each_channel() -> None:
    torch.manual_seed(1)
    x = (torch.randn(4, 300) * 3).requires_grad_()
    s = torch.tensor([[0.05], [0.02], [0.1], [0.01]], requires_grad=True)
    zero = torch.tensor([[0.0], [3.0], [-2.0], [0.0]])
    y = lsq_fake_quantize(x, s, zero, 0, 255, RoundMode.HALF_EVEN, grad_scale=0.5)
    upstream = torch.randn(4, 300)
    (y * upstream).sum().backward()
    v = x.detach() / s.detach()
    shifted = torch.round(v) + zero
    inside = (shifted >= 0) & (shifted <= 255)
    ds = torch.where(inside, torch.round(v) - v, torch.clamp(shifted, 0, 255) - zero)
    torch.testing.assert_close(s.grad, (upstream * ds).sum(dim=1, keepdim=True) * 0.5, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(x.grad, upstream * inside)


def test_tqt_scales_are_powers_of_two_and_the_threshold_gradient_is_ln2_scaled() -> None:
    torch.manual_seed(0)
    x = torch.randn(400) * 2
    t = torch.tensor(1.3, requires_grad=True)  # threshold 2**ceil(1.3) = 4 -> scale 4 / 128
    y = tqt_fake_quantize(x, t, torch.tensor(0.0), -128, 127, RoundMode.HALF_EVEN, bits=8)
    scale = 4 / 128
    codes = torch.clamp(torch.round(x / scale), -128, 127)
    torch.testing.assert_close(y, codes * scale)
    y.sum().backward()
    v = x / scale
    inside = (torch.round(v) >= -128) & (torch.round(v) <= 127)
    expected = (torch.where(inside, torch.round(v) - v, codes) * scale * math.log(2)).sum()
    torch.testing.assert_close(t.grad, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("zero", [True, False])
@pytest.mark.parametrize("method", ["tqt", "lsq", "ste"])
@pytest.mark.parametrize("axis", [None, 0])
def test_training_forward_is_bit_exact(method: str, axis: int | None, zero: bool) -> None:
    """The differentiable paths compute exactly quant_core's fake quantization (ties, a
    subnormal, saturation), per tensor and per channel."""
    from quant_core.qparams import QParams
    from quant_torch_fx.fake_quantize import fake_quantize
    from quant_torch_fx.qat_ops import ste_fake_quantize

    torch.manual_seed(0)
    step = 2.0**-5 if method != "lsq" else 0.0371
    x = torch.randn(6, 5, 4) * 3
    x[0, 0, :4] = torch.tensor([step * 0.5, step * 1.5, -step * 2.5, 1e-45])
    x.requires_grad_()
    channels = 1 if axis is None else 6
    shape = () if axis is None else (channels, 1, 1)
    qp = QParams(np.full(channels, step, np.float32).reshape(() if axis is None else (channels,)),
                 np.zeros(() if axis is None else channels, np.int64), QParams.per_tensor(1, 0, "int8").dtype, axis=axis)  # fmt: skip
    zeros = torch.zeros(shape)
    if method == "tqt":
        got = tqt_fake_quantize(
            x, torch.full(shape, 1.3), zeros, -128, 127, RoundMode.HALF_EVEN, bits=8, zero_is_zero=zero
        )
    elif method == "lsq":
        got = lsq_fake_quantize(
            x, torch.full(shape, step), zeros, -128, 127, RoundMode.HALF_EVEN, grad_scale=1.0, zero_is_zero=zero
        )
    else:
        got = ste_fake_quantize(x, torch.full(shape, step), zeros, -128, 127, RoundMode.HALF_EVEN, True, zero)
    assert torch.equal(got.detach(), fake_quantize(x.detach(), qp))


def test_qat_quantizes_every_weight_the_ptq_plan_quantizes() -> None:
    """Conv + BN becomes a ConvBn module in QAT; its folded weight is still a weight slot."""
    q = ModelQuantizer("xint8", quiet=True)
    ptq = q.prepare(conv_bn_net(), torch.randn(1, 3, 8, 8))
    qat = q.prepare_qat(conv_bn_net(), torch.randn(1, 3, 8, 8))
    assert sorted(dict(weight_quantizers(qat))) == sorted(
        dict(weight_quantizers(ptq))
    )  # same names, as configs see them
    assert len(dict(weight_quantizers(qat))) == 3
    conv_bns = [m for m in qat.modules() if isinstance(m, ConvBn)]
    assert len(conv_bns) == 2 and all(m.weight_quantizer is not None for m in conv_bns)
    depthwise = next(s for s in graph_info(qat).plan.weights if s.node.startswith("conv2"))
    assert depthwise.tensor.endswith(".weight") and depthwise.spec.per_channel_axis is None


def test_auto_method_learns_tqt_for_xint8_and_lsq_for_a8w8() -> None:
    for preset, method in (("xint8", "tqt"), ("a8w8", "lsq")):
        qat = ModelQuantizer(preset, quiet=True).prepare_qat(conv_bn_net(), torch.randn(1, 3, 8, 8))
        learners = [m.learning for m in qat.modules() if isinstance(m, FakeQuantizer)]
        assert learners and set(learners) == {method}
        learned = {id(p) for p in qat.parameters()}
        assert all(id(m.learned) in learned for m in qat.modules() if isinstance(m, FakeQuantizer))


@pytest.mark.parametrize("kind", ["activation", "weight"])
def test_freeze_refuses_an_lsq_scale_that_training_pushed_past_zero(kind: str) -> None:
    q = ModelQuantizer("a8w8", quiet=True)
    qat = q.prepare_qat(conv_bn_net(), torch.randn(1, 3, 8, 8), calib_loader=images(1))
    learners = dict(activation_quantizers(qat) if kind == "activation" else weight_quantizers(qat))
    fq = next(iter(learners.values()))
    with torch.no_grad():
        fq.learned.fill_(-0.01)
    with pytest.raises(
        ValueError, match=rf"learned LSQ scale of {fq.name!r} fell to -0.01.*lower qparam_lr.*default_optimizer"
    ):
        q.freeze(qat)


def _task(seed: int, n: int = 256) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 8, 8, generator=generator)
    x[:, 0] += torch.randn(n, 1, 1, generator=generator)  # the label: the sign of channel 0's offset
    labels = (x[:, 0].mean((1, 2)) > 0).long()
    return [(x[i : i + 32], labels[i : i + 32]) for i in range(0, n, 32)]


def _accuracy(model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    model.eval()
    with torch.no_grad():
        hits = sum(int((model(x).argmax(1) == y).sum()) for x, y in data)
    return hits / sum(len(y) for _, y in data)


@pytest.mark.parametrize("preset", ["xint8", "a8w8"])
def test_qat_learns_and_the_frozen_model_computes_what_eval_computed(preset: str) -> None:
    train, test = _task(0, 512), _task(1)
    q = ModelQuantizer(preset, quiet=True)
    qat = q.prepare_qat(conv_bn_net(), torch.randn(1, 3, 8, 8), calib_loader=[x for x, _ in train[:2]])
    before = _accuracy(qat, test)
    history = train_qat(qat, train, epochs=6, lr=3e-3, quiet=True)
    assert history[-1]["loss"] < history[0]["loss"]
    after = _accuracy(qat, test)
    assert after > max(before, 0.5)
    frozen = q.freeze(qat)
    assert not any(isinstance(m, ConvBn) for m in frozen.modules())
    assert not any(p.requires_grad for p in frozen.parameters())
    x = test[0][0]
    with torch.no_grad():
        evaluated, folded = qat.eval()(x), frozen(x)
    quantizers = dict(activation_quantizers(frozen))
    if "linear" in quantizers:  # power-of-two formats quantize the logits too
        bound = 2 * float(quantizers["linear"].current_qparams().scale)
    else:  # float logits (the result tail): two steps of the head's input through its weights
        head = next(t for t in frozen.state_dict().values() if tuple(t.shape) == (5, 16))
        step = float(quantizers["adaptive_avg_pool2d"].current_qparams().scale)
        bound = 2 * step * float(head.abs().sum(dim=1).max())
    assert torch.max(torch.abs(evaluated - folded)) <= bound  # fold and int32 bias move a tie or two
    from onnx import TensorProto

    from quant_torch_fx.export import onnx_model

    proto = onnx_model(frozen, (test[0][0][:1],))
    inits = {t.name: t for t in proto.graph.initializer}
    producers = {out: n for n in proto.graph.node for out in n.output}
    weighted = [n for n in proto.graph.node if n.op_type in ("Conv", "Gemm")]
    assert len(weighted) == 3
    for node in weighted:  # every weight of the trained model is an int8 initializer behind a DequantizeLinear
        assert inits[producers[node.input[1]].input[0]].data_type == TensorProto.INT8
    if preset == "xint8":
        for _node, fq in weight_quantizers(frozen):
            fix_pos = fq.current_qparams().fix_pos
            assert fix_pos is not None and np.all(fq.current_qparams().scale == 2.0 ** (-fix_pos.astype(float)))


def test_distillation_needs_no_labels_and_labels_are_needed_without_a_teacher() -> None:
    teacher = conv_bn_net()
    q = ModelQuantizer("xint8", quiet=True)
    qat = q.prepare_qat(teacher, torch.randn(1, 3, 8, 8))
    unlabeled = [x for x, _ in _task(2)]
    history = train_qat(qat, unlabeled, teacher=teacher, epochs=3, lr=1e-3, freeze_batch_norm=True, quiet=True)
    assert history[-1]["loss"] < history[0]["loss"]
    with pytest.raises(DataError, match="no labels; pass"):
        train_qat(qat, unlabeled, epochs=1, quiet=True)


def test_the_teacher_runs_in_eval_mode_and_each_of_its_modules_keeps_its_own_mode() -> None:
    teacher = conv_bn_net().train()
    teacher.bn2.eval()  # a mode of its own, as a user freezing one batch norm leaves it
    modes = [m.training for m in teacher.modules()]
    seen: list[bool] = []
    teacher.register_forward_pre_hook(lambda module, _args: seen.append(module.bn1.training))
    qat = ModelQuantizer("xint8", quiet=True).prepare_qat(conv_bn_net(), torch.randn(1, 3, 8, 8))
    train_qat(qat, images(2), teacher=teacher, epochs=1, quiet=True)
    assert seen == [False, False]
    assert [m.training for m in teacher.modules()] == modes


def _nan_images() -> torch.Tensor:
    batch = images(1)[0]
    batch[0, 0, 0, 0] = float("nan")
    return batch


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        (torch.randn(8, 1, 8, 8), r"batch 0, input 0 has shape \[8, 1, 8, 8\]; expected \[N, 3, 8, 8\]"),
        (
            torch.randn(8, 3, 8, 8, dtype=torch.float64),
            "batch 0, input 0 has dtype torch.float64; expected torch.float32",
        ),
        (_nan_images(), "batch 0, input 0 holds NaN or infinite values"),
    ],
)
def test_training_batches_are_checked_as_calibration_batches_are(batch: torch.Tensor, match: str) -> None:
    teacher = conv_bn_net()
    qat = ModelQuantizer("xint8", quiet=True).prepare_qat(teacher, torch.randn(1, 3, 8, 8), calib_loader=images(1))
    before = [p.detach().clone() for p in qat.parameters()]
    with pytest.raises(DataError, match=match):
        train_qat(qat, [batch], teacher=teacher, quiet=True)
    assert all(torch.equal(a, b) for a, b in zip(before, qat.parameters(), strict=True))


@pytest.mark.parametrize(
    ("labels", "match"),
    [
        (torch.zeros(5, dtype=torch.long), "batch 0 has 5 labels for 8 samples"),
        (torch.zeros(8), "batch 0 labels are a torch.float32 tensor; allowed with the default loss"),
    ],
)
def test_labels_for_the_default_loss_are_one_class_index_per_sample(labels: torch.Tensor, match: str) -> None:
    qat = ModelQuantizer("xint8", quiet=True).prepare_qat(
        conv_bn_net(), torch.randn(1, 3, 8, 8), calib_loader=images(1)
    )
    with pytest.raises(DataError, match=match):
        train_qat(qat, [(images(1)[0], labels)], quiet=True)


def test_a_non_finite_loss_stops_training_before_its_step() -> None:
    qat = ModelQuantizer("xint8", quiet=True).prepare_qat(
        conv_bn_net(), torch.randn(1, 3, 8, 8), calib_loader=images(1)
    )
    before = [p.detach().clone() for p in qat.parameters()]

    def loss_fn(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return output.sum() * float("inf")

    data = [(x, torch.zeros(8, dtype=torch.long)) for x in images(2)]
    with pytest.raises(DataError, match="the loss at epoch 1, batch 0 is"):
        train_qat(qat, data, loss_fn=loss_fn, quiet=True)
    assert all(torch.equal(a, b) for a, b in zip(before, qat.parameters(), strict=True))


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"epochs": 1.5}, "epochs: 1.5 is out of range; allowed: an integer >= 1"),
        ({"epochs": 0}, "epochs: 0 is out of range"),
        ({"lr": -1.0}, "lr: -1.0 is out of range; allowed: a finite number >= 0"),
        ({"lr": float("nan")}, "lr: nan is out of range"),
        ({"qparam_lr": -1e-3}, "qparam_lr: -0.001 is out of range"),
    ],
)
def test_training_arguments_are_checked_before_any_step(arguments: dict, message: str) -> None:
    """A review found epochs=1.5 ending in range()'s TypeError and lr=-1.0 accepted."""
    qat = ModelQuantizer("xint8", quiet=True).prepare_qat(
        conv_bn_net(), torch.randn(1, 3, 8, 8), calib_loader=images(1)
    )
    before = [p.detach().clone() for p in qat.parameters()]
    data = [(x, torch.zeros(8, dtype=torch.long)) for x in images(2)]
    with pytest.raises(ValueError, match=re.escape(message)):
        train_qat(qat, data, quiet=True, **arguments)
    assert all(torch.equal(a, b) for a, b in zip(before, qat.parameters(), strict=True))


@pytest.mark.parametrize("count", [1, 2])
def test_a_one_shot_iterator_trains_on_the_batch_that_started_the_qparams(count: int) -> None:
    """A review found a generator's first batch used only to start the learnable qparams:
    2 batches trained as 1, and 1 batch ended in 'the training loader yielded no batches'."""
    qat = ModelQuantizer("a8w8", quiet=True).prepare_qat(conv_bn_net(), torch.randn(1, 3, 8, 8))
    data = [(x, torch.zeros(8, dtype=torch.long)) for x in images(count)]
    history = train_qat(qat, iter(data), lr=1e-3, quiet=True)
    assert history[-1]["batches"] == count


def test_learnable_qparams_start_from_the_first_batch() -> None:
    qat = ModelQuantizer("a8w8", quiet=True).prepare_qat(conv_bn_net(), torch.randn(1, 3, 8, 8))
    quantizers = dict(activation_quantizers(qat))
    assert not any(fq.initialized for fq in quantizers.values())
    batch = images(1, batch=16)[0]
    qat(batch)
    assert all(fq.initialized for fq in quantizers.values())
    x_qp = quantizers["x"].current_qparams()
    lo, hi = float(batch.min()), float(batch.max())
    np.testing.assert_allclose(float(x_qp.scale), (hi - lo) / 255, rtol=1e-5)


def test_ste_qat_keeps_calibrated_activations_and_tracks_weights() -> None:
    q = ModelQuantizer("a8w8", qat_method="ste", quiet=True)
    qat = q.prepare_qat(conv_bn_net(), torch.randn(1, 3, 8, 8), calib_loader=images(2))
    before = {k: fq.current_qparams() for k, fq in activation_quantizers(qat)}
    w_before = {k: fq.current_qparams() for k, fq in weight_quantizers(qat)}
    train_qat(qat, _task(3), epochs=1, lr=1e-2, quiet=True)
    assert {k: fq.current_qparams() for k, fq in activation_quantizers(qat)} == before
    assert any(fq.current_qparams() != w_before[k] for k, fq in weight_quantizers(qat))
    with pytest.raises(ValueError, match="'ste' keeps calibrated qparams; pass calib_loader"):
        q.prepare_qat(conv_bn_net(), torch.randn(1, 3, 8, 8))


def test_checkpoint_round_trip_restores_observers_and_learned_values() -> None:
    q = ModelQuantizer("xint8", quiet=True)
    qat = q.prepare_qat(conv_bn_net(), torch.randn(1, 3, 8, 8), calib_loader=images(2))
    train_qat(qat, _task(4), epochs=1, lr=1e-2, quiet=True)
    state = qat.state_dict()
    fresh = q.prepare_qat(conv_bn_net(), torch.randn(1, 3, 8, 8))
    fresh.load_state_dict(state)
    x = images(1, seed=8)[0]
    with torch.no_grad():
        torch.testing.assert_close(fresh.eval()(x), qat.eval()(x))
    assert len(quantized_graphs(fresh)) == 1


def test_distillation_loss_is_kl_for_logits_and_mse_otherwise() -> None:
    from quant_torch_fx import distillation_loss

    s, t = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    expected = F.kl_div(F.log_softmax(s, 1), F.softmax(t, 1), reduction="batchmean")
    torch.testing.assert_close(distillation_loss(s, t), expected)
    a, b = torch.ones(2, 3, 4), torch.zeros(2, 3, 4)
    torch.testing.assert_close(distillation_loss((a,), (b,)), torch.tensor(1.0))


@pytest.mark.parametrize("fold", [False, True])
def test_weight_lr_per_step_gives_each_quantized_weight_a_rate_of_its_own_step(fold: bool) -> None:
    from quant_torch_fx.training import default_optimizer, quantized_weights

    net = conv_bn_net()
    q = ModelQuantizer("xint8", quiet=True)
    qat = q.prepare_qat(net, torch.zeros(1, 3, 8, 8), calib_loader=images(2), fold_batch_norm=fold)
    found = quantized_weights(qat)
    assert len(found) == 3  # conv1, conv2 (depthwise), the linear head
    for parameter, step in found:
        # the step in the parameter's own units: fake quantization moves no weight by more than half of it
        assert step > 0 and parameter.requires_grad
    if fold:  # plain weights: the quantizer's scale itself
        scales = sorted(float(np.mean(fq.current_qparams().scale)) for _n, fq in weight_quantizers(qat))
        assert sorted(step for _p, step in found) == pytest.approx(scales)
    optimizer = default_optimizer(qat, 1e-5, 1e-3, weight_lr_per_step=0.01)
    rates = {id(p): group["lr"] for group in optimizer.param_groups for p in group["params"]}
    for parameter, step in found:
        assert rates[id(parameter)] == pytest.approx(0.01 * step)
    biases = [p for name, p in qat.named_parameters() if name.endswith("bias")]
    assert biases and all(rates[id(p)] == 1e-5 for p in biases)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(qat.parameters()))
    with pytest.raises(ValueError, match="weight_lr_per_step: 0 is out of range"):
        default_optimizer(qat, 1e-5, 1e-3, weight_lr_per_step=0)


@pytest.mark.parametrize("preset", ["a8w8", "a8w8_per_tensor"])
def test_qparams_from_the_first_training_batch_are_cut_at_saturation_as_calibration_cuts_them(preset: str) -> None:
    """A Conv output only a HardSwish reads is quantized on its range cut near -3 (the plan's
    RangeBound). Learnable qparams started from the first training batch (no calibration
    loader) are selected from what they observed as calibration selects them: cut."""
    from quant_core.plan import group_selection

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Hardswish(), nn.Conv2d(8, 4, 1)).eval()
    with torch.no_grad():
        net[0].bias -= 4.0  # conv outputs reach far below -3, and above 0
    batch = 2 * torch.randn(8, 3, 8, 8)
    qat = ModelQuantizer(preset, quiet=True).prepare_qat(net, batch[:1])
    qat(batch)
    plan = graph_info(qat).plan
    bounded = [b.group for b in plan.bounds]
    assert bounded
    for key in bounded:
        fq = dict(activation_quantizers(qat))[key]
        got, (_range, expected) = fq.current_qparams(), group_selection(plan, key, fq.observer)
        np.testing.assert_array_equal(got.scale, expected.scale)
        np.testing.assert_array_equal(got.zero_point, expected.zero_point)
        uncut = fq.observer.qparams()
        assert not np.array_equal(uncut.scale, got.scale)  # the cut changed something: the test can fail
