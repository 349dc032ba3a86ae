"""QAT and checkpoint state that a review found wrong: each test fails on the code before
its fix (batch norms with a zero gamma, shared convolutions, copies, resumes, frozen batch
norms, straight-through activations without a calibration loader)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import conv_bn_net, images
from torch import nn

from quant_core.config import OperatorConfig, QuantConfig
from quant_core.errors import ConfigError, DataError, ModelError
from quant_core.spec import QuantSpec
from quant_torch_fx import ModelQuantizer, train_qat
from quant_torch_fx.capture import copy_captured
from quant_torch_fx.modules import ConvBn
from quant_torch_fx.prepare import activation_quantizers


class _ConvBn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x))


class _Siamese(nn.Module):
    """One convolution called twice, each call with its own batch norm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn_a, self.bn_b = nn.BatchNorm2d(4), nn.BatchNorm2d(4)
        self.fc = nn.Linear(8, 3)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ya = F.relu(self.bn_a(self.conv(a))).mean((2, 3))
        yb = F.relu(self.bn_b(self.conv(b))).mean((2, 3))
        return self.fc(torch.cat([ya, yb], 1))


def _siamese() -> _Siamese:
    torch.manual_seed(0)
    net = _Siamese().eval()
    with torch.no_grad():
        net.bn_a.running_mean.uniform_(-1, 1)
        net.bn_b.running_var.uniform_(0.2, 4.0)
        net.bn_b.weight.uniform_(-2, 2)
    return net


def _pair(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, 8, 8), torch.randn(n, 3, 8, 8)


def test_a_zero_gamma_channel_writes_beta_in_qat_eval_as_frozen() -> None:
    torch.manual_seed(0)
    net = _ConvBn().eval()
    with torch.no_grad():
        net.bn.weight[1] = 0.0  # torchvision's zero_init_residual
        net.bn.running_mean.copy_(torch.tensor([0.1, 0.5, -0.2, 0.3]))
        net.bn.bias.copy_(torch.tensor([0.0, 0.25, 0.0, 0.0]))
    x = torch.randn(4, 3, 8, 8)
    q = ModelQuantizer("a8w8", quiet=True)
    qat = q.prepare_qat(net, x[:1], calib_loader=[x]).eval()
    with torch.no_grad():
        evaluated, frozen = qat(x), q.freeze(qat)(x)
    # Before: the eval branch scaled by 1 where gamma was 0, writing conv bias - mean + beta.
    assert float((evaluated[:, 1] - 0.25).abs().max()) < 0.05
    assert float((evaluated - frozen).abs().max()) < 0.05


def test_a_convolution_called_twice_folds_each_batch_norm_into_its_own_weight() -> None:
    net = _siamese()
    x = _pair(4)
    q = ModelQuantizer("a8w8", quiet=True)
    quantized = q.quantize_model(net, _pair(1), [_pair(8)])
    folded = [name for name, _ in quantized.named_parameters() if "folded" in name and not name.endswith("bias")]
    assert len(folded) == 2  # before: the second fold replaced the first
    with torch.no_grad():
        ref, out = net(*x), quantized(*x)
    assert float((out - ref).abs().max()) < 0.1 * float(ref.abs().max())


def test_qat_keeps_a_shared_convolution_weight_tied() -> None:
    net = _siamese()
    q = ModelQuantizer("a8w8", quiet=True)
    qat = q.prepare_qat(net, _pair(1), calib_loader=[_pair(8)])
    assert not [m for m in qat.modules() if isinstance(m, ConvBn)]
    trainable = sum(p.numel() for name, p in qat.named_parameters() if "learned" not in name)
    assert trainable == sum(p.numel() for p in net.parameters())  # before: a copy per call
    train_qat(qat, [(*_pair(8), torch.randint(0, 3, (8,))) for _ in range(2)], lr=1e-2, num_inputs=2, quiet=True)
    x = _pair(4)
    with torch.no_grad():
        assert float((q.freeze(qat)(*x) - qat.eval()(*x)).abs().max()) < 1e-4


def test_a_copy_taken_before_the_first_batch_calibrates_in_train_qat_and_refuses_otherwise() -> None:
    q = ModelQuantizer("a8w8", quiet=True)
    qat = q.prepare_qat(conv_bn_net(), torch.randn(1, 3, 8, 8))
    duplicate = copy_captured(qat)  # a deepcopy: it keeps no forward hooks
    with pytest.raises(ModelError, match="never set"):
        duplicate.train()(images(1)[0])
    data = [(x, torch.randint(0, 5, (8,))) for x in images(2)]
    train_qat(duplicate, data, lr=0.0, qparam_lr=0.0, quiet=True)
    learned = [fq for _key, fq in activation_quantizers(duplicate) if fq.learning is not None]
    assert learned and all(fq.initialized and float(fq.learned.detach().abs().min()) > 0 for fq in learned)


def test_frozen_batch_norms_stay_frozen_through_the_first_batch_calibration() -> None:
    data = [(x * 3 + 1, torch.randint(0, 5, (8,))) for x in images(3, seed=5)]
    q = ModelQuantizer("a8w8", quiet=True)
    qat = q.prepare_qat(conv_bn_net(), torch.randn(1, 3, 8, 8))
    stats = [m.running_mean.clone() for m in qat.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    optimizer = torch.optim.SGD(qat.parameters(), lr=0.0)  # the user's own: no early initialisation
    train_qat(qat, data, optimizer=optimizer, freeze_batch_norm=True, quiet=True)
    after = [m.running_mean for m in qat.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert all(torch.equal(a, b) for a, b in zip(stats, after, strict=True))


def test_straight_through_activations_calibrate_on_the_first_batch() -> None:
    # qat_method "auto" on asymmetric power-of-two activations means STE; without a
    # calib_loader they were never calibrated and trained unquantized.
    act = QuantSpec(dtype="uint8", symmetric=False, scale_type="power_of_two")
    weight = QuantSpec(dtype="int8", scale_type="power_of_two", narrow_range=True)
    config = QuantConfig(global_config=OperatorConfig(input=act, weight=weight, output=act))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).eval()
    q = ModelQuantizer(config, quiet=True)
    qat = q.prepare_qat(net, torch.randn(1, 8))
    train_qat(qat, [(torch.randn(16, 8), torch.randint(0, 3, (16,)))], lr=1e-3, quiet=True)
    quantizers = [fq for _key, fq in activation_quantizers(qat)]
    assert quantizers and all(fq.quantizing and fq.qparams is not None for fq in quantizers)
    q.freeze(qat)


@pytest.mark.parametrize("preset", ["a8w8", "xint8"])
def test_a_calibrated_checkpoint_loads_into_a_fresh_prepared_model(preset: str) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 2)).eval()
    example = torch.randn(1, 3, 8, 8)
    q = ModelQuantizer(preset, quiet=True)
    calibrated = q.quantize_model(net, example, [torch.randn(8, 3, 8, 8)])
    fresh = q.prepare(net, example)
    fresh.load_state_dict(calibrated.state_dict())  # a8w8's per-channel scales: size mismatch
    x = torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        assert torch.equal(fresh.eval()(x), calibrated(x))


def test_a_resumed_lsq_quantizer_has_the_gradient_it_had() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).eval()
    q = ModelQuantizer("a8w8", quiet=True, qat_method="lsq")
    data = [torch.randn(16, 8) * 2 + 1]
    trained = q.prepare_qat(net, torch.randn(1, 8), calib_loader=data)
    resumed = q.prepare_qat(net, torch.randn(1, 8))  # its qparams come from the checkpoint only
    resumed.load_state_dict(trained.state_dict())
    x = torch.randn(16, 8) * 2 + 1
    grads = []
    for model in (trained, resumed):
        model.train()
        model.zero_grad()
        model(x).square().sum().backward()
        grads.append([fq.learned.grad.clone() for _key, fq in activation_quantizers(model)])
    for before, after in zip(*grads, strict=True):
        assert torch.equal(before, after)


def test_a_batch_norm_with_a_cumulative_average_keeps_updating_in_qat() -> None:
    torch.manual_seed(0)
    net = _ConvBn()
    net.bn.momentum = None
    net.train()
    for _ in range(5):
        net(torch.randn(8, 3, 8, 8) + 1)
    net.eval()
    q = ModelQuantizer("a8w8", quiet=True)
    qat = q.prepare_qat(net, torch.randn(1, 3, 8, 8), calib_loader=[torch.randn(8, 3, 8, 8)])
    bn = next(m for m in qat.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm))
    assert bn.momentum is None and int(bn.num_batches_tracked) == 5


def test_a_distillation_temperature_must_be_positive() -> None:
    q = ModelQuantizer("a8w8", quiet=True)
    qat = q.prepare_qat(conv_bn_net(), torch.randn(1, 3, 8, 8))
    with pytest.raises(ConfigError, match="temperature"):
        train_qat(qat, [(x, torch.randint(0, 5, (8,))) for x in images(1)], temperature=0.0, quiet=True)


class _MaskedAttention(nn.Module):
    def __init__(self, **kwargs: int) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(16, 2, batch_first=True, **kwargs)
        self.register_buffer("causal", torch.triu(torch.ones(6, 6, dtype=torch.bool), 1))

    def forward(self, x: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        mask = None if padding is not None else self.causal
        return self.attention(x, x, x, attn_mask=mask, key_padding_mask=padding, need_weights=False)[0]


@pytest.mark.parametrize("padding", [False, True])
def test_multihead_attention_with_a_boolean_mask_quantizes(padding: bool) -> None:
    # The module makes a boolean mask additive with zeros_like(...).masked_fill_(mask, -inf):
    # before, that tensor was quantized and its -inf stopped calibration.
    torch.manual_seed(0)
    net = _MaskedAttention().eval()
    pad = torch.zeros(4, 6, dtype=torch.bool)
    pad[:, -2:] = True

    def inputs(n: int) -> tuple[torch.Tensor, ...]:
        x = torch.randn(n, 6, 16)
        return (x, pad[:n]) if padding else (x,)

    quantized = ModelQuantizer("a8w8", quiet=True).quantize_model(net, inputs(1), [inputs(4) for _ in range(2)])
    test = inputs(4)
    with torch.no_grad():
        error = float((quantized(*test) - net(*test)).abs().max())
    assert error < 0.1


def test_multihead_attention_with_other_key_sizes_quantizes_with_algorithms() -> None:
    # Its three projections slice one bias: the bias correction leaves those layers alone.
    torch.manual_seed(0)

    class Cross(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = nn.MultiheadAttention(16, 2, batch_first=True, kdim=12, vdim=10)

        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self.attention(q, k, v, need_weights=False)[0]

    def inputs(n: int) -> tuple[torch.Tensor, ...]:
        return torch.randn(n, 6, 16), torch.randn(n, 5, 12), torch.randn(n, 5, 10)

    ModelQuantizer("a8w8", quiet=True).quantize_model(Cross().eval(), inputs(1), [inputs(4)])


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_model_not_in_float32_is_refused_naming_a_parameter(dtype: torch.dtype) -> None:
    net = nn.Sequential(nn.Linear(4, 3)).to(dtype)
    with pytest.raises(ModelError, match=r"0\.weight.*model\.float\(\)"):
        ModelQuantizer("a8w8", quiet=True).prepare(net, torch.randn(1, 4, dtype=dtype))


def test_a_sum_of_a_boolean_tensor_exports_a_valid_model(tmp_path) -> None:
    import onnx

    class Count(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (self.linear(x) > 0).sum(-1)

    torch.manual_seed(0)
    q = ModelQuantizer("a8w8", quiet=True)
    quantized = q.quantize_model(Count().eval(), torch.randn(1, 4), [torch.randn(8, 4)])
    path = tmp_path / "count.onnx"
    q.export_onnx(quantized, torch.randn(1, 4), path)
    onnx.checker.check_model(onnx.load(path), full_check=True)  # before: ReduceSum over bool


def test_a_batch_norm_without_running_statistics_is_named_at_export(tmp_path) -> None:
    net = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4, track_running_stats=False)).eval()
    q = ModelQuantizer("a8w8", quiet=True)
    quantized = q.quantize_model(net, torch.randn(1, 3, 4, 4), [torch.randn(4, 3, 4, 4)])
    with pytest.raises(ModelError, match="track_running_stats=False"):
        q.export_onnx(quantized, torch.randn(1, 3, 4, 4), tmp_path / "bn.onnx")


def test_reconstruction_leaves_a_weight_two_calls_share_alone_and_says_why() -> None:
    # Before: the second call's learned codes overwrote the first's in the one shared weight.
    from quant_core.algorithm_config import AdaRoundConfig
    from quant_core.presets import get_preset
    from quant_torch_fx.prepare import graph_info

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)
            self.up = nn.ConvTranspose2d(4, 4, 2, stride=2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.up(self.conv(torch.relu(self.conv(x))))

    torch.manual_seed(0)
    config = get_preset("xint8").evolve(algorithms=(AdaRoundConfig(num_iterations=20),))
    q = ModelQuantizer(config, quiet=True)
    quantized = q.quantize_model(Twice().eval(), torch.zeros(1, 4, 6, 6), [torch.randn(4, 4, 6, 6)])
    report = graph_info(quantized).algorithms["adaround"]
    assert report["layers"] == []
    notes = " ".join(report["notes"])
    assert "weight shared with conv/conv2d_1" in notes and "ConvTranspose layers are not reconstructed" in notes


@pytest.mark.parametrize("preset", ["a8w8", "xint8"])
@pytest.mark.parametrize("num_batches", [0, -1, "2"])
def test_num_batches_below_one_is_refused_naming_it(preset: str, num_batches: object) -> None:
    # Before: 0 and -1 calibrated on one batch (xint8) or failed with a KeyError (a8w8).
    q = ModelQuantizer(preset, quiet=True)
    with pytest.raises(ConfigError, match="num_batches"):
        q.quantize_model(conv_bn_net(), torch.randn(1, 3, 8, 8), images(2), num_batches=num_batches)


def test_an_empty_loader_with_algorithms_is_one_data_error() -> None:
    from quant_core.errors import DataError

    with pytest.raises(DataError, match="no batches"):
        ModelQuantizer("a8w8", quiet=True).quantize_model(conv_bn_net(), torch.randn(1, 3, 8, 8), [])


@pytest.mark.parametrize(
    "kwargs", [{"exclude_module_types": ["Linear"]}, {"exclude_module_types": [None]}, {"exclude_modules": None}]
)
def test_exclusions_of_the_wrong_kind_are_refused_at_construction(kwargs: dict) -> None:
    with pytest.raises(ConfigError, match=next(iter(kwargs))):
        ModelQuantizer("xint8", quiet=True, **kwargs)


def test_an_excluded_type_covers_its_subclasses() -> None:
    class MyConv(nn.Conv2d):
        pass

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = MyConv(3, 4, 3, padding=1)
            self.b = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(x)))

    q = ModelQuantizer("xint8", quiet=True, exclude_module_types=[nn.Conv2d])
    quantized = q.quantize_model(Net().eval(), torch.randn(1, 3, 8, 8), [torch.randn(4, 3, 8, 8)])
    from quant_torch_fx.prepare import graph_info

    assert not graph_info(quantized).plan.weights  # before: MyConv's weight was quantized


def test_export_with_example_inputs_that_do_not_fit_is_one_line(tmp_path) -> None:
    q = ModelQuantizer("a8w8", quiet=True)
    quantized = q.quantize_model(conv_bn_net(), torch.randn(1, 3, 8, 8), images(1))
    with pytest.raises(ModelError) as caught:  # before: torch's nine-line RuntimeError
        q.export_onnx(quantized, torch.randn(1, 5, 8, 8), tmp_path / "m.onnx")
    message = str(caught.value)
    assert "example_inputs ([1, 5, 8, 8])" in message and "\n" not in message
    assert not (tmp_path / "m.onnx").exists()


class _FrozenBody(nn.Module):
    """conv + batch norm, a batch norm on its own, a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.alone = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.alone(F.relu(self.bn(self.conv(x))))
        return self.head(y.mean((2, 3)))


@pytest.mark.parametrize("preset", ["a8w8", "xint8"])
@pytest.mark.parametrize("fold", [False, True])
def test_parameters_the_user_froze_stay_frozen_through_qat(preset: str, fold: bool) -> None:
    torch.manual_seed(0)
    net = _FrozenBody().eval()
    for name, parameter in net.named_parameters():
        parameter.requires_grad_(name.startswith("head"))
    data = [(x, torch.randint(0, 3, (8,))) for x in images(3)]
    q = ModelQuantizer(preset, quiet=True)
    example = torch.randn(1, 3, 8, 8)
    qat = q.prepare_qat(net, example, calib_loader=[x for x, _ in data], fold_batch_norm=fold)
    weights = {name: p for name, p in qat.named_parameters() if "learned" not in name}
    assert any(isinstance(m, ConvBn) for m in qat.modules()) != fold
    # Before: the conv bias and every batch norm's gamma and beta were trainable copies.
    assert sorted(name for name, p in weights.items() if p.requires_grad) == ["head.bias", "head.weight"]
    before = {name: p.detach().clone() for name, p in weights.items()}
    train_qat(qat, data, epochs=2, lr=1e-2, freeze_batch_norm=True, quiet=True)
    changed = sorted(name for name, p in weights.items() if not torch.equal(p, before[name]))
    assert changed == ["head.bias", "head.weight"]
    # A trainable model keeps every copy trainable.
    trainable = q.prepare_qat(_FrozenBody().eval(), example, fold_batch_norm=fold)
    assert all(p.requires_grad for p in trainable.parameters())
    # Weights frozen, biases and batch norms trained (BitFit): the folded bias trains too.
    bitfit = _FrozenBody().eval()
    for name, parameter in bitfit.named_parameters():
        parameter.requires_grad_(not name.endswith("weight"))
    biases = q.prepare_qat(bitfit, example, fold_batch_norm=fold)
    flags = {
        name.rpartition(".")[2]: p.requires_grad
        for name, p in biases.named_parameters()
        if "conv" in name and "learned" not in name
    }
    assert flags == ({"weight_folded": False, "weight_folded_bias": True} if fold else {"weight": False, "bias": True})


@pytest.mark.parametrize("preset", ["a8w8", "xint8"])
def test_a_failed_calibration_leaves_no_quantizer_observing(preset: str) -> None:
    net = conv_bn_net()
    data = [(x, torch.randint(0, 5, (8,))) for x in images(2)]
    bad = images(1)[0].clone()
    bad[0, 0, 0, 0] = float("nan")
    q = ModelQuantizer(preset, quiet=True)
    qat = q.prepare_qat(net, torch.randn(1, 3, 8, 8))
    with pytest.raises(DataError, match="calibration"):
        qat(bad)  # the first batch the model sees calibrates it, and this one holds NaN
    # Before: the quantizers stayed observing with fake quantization off, the first-batch
    # calibration took that for a calibration under way, and QAT trained the float model.
    train_qat(qat, data, lr=1e-3, quiet=True)
    quantizers = [fq for _key, fq in activation_quantizers(qat)]
    assert all(fq.quantizing and not fq.observing and fq.initialized for fq in quantizers)
    q.freeze(qat)
    with pytest.raises(DataError, match="calibration"):
        q.calibrate(qat, [bad], torch.randn(1, 3, 8, 8))
    assert all(fq.quantizing and not fq.observing for fq in quantizers)
