"""PTQ: activation qparams equal quant_core's numpy observers on the float model's tensors,
for every observer; weight qparams and biases follow the planner's rules."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from models import conv_bn_net, images
from torch import nn

from quant_core.bias import encode_bias
from quant_core.config import OperatorConfig, QuantConfig
from quant_core.observer_config import MSE, Entropy, MinMax, Percentile, PowerOfTwoMSE
from quant_core.observers import make_observer
from quant_core.presets import get_preset
from quant_core.qparams import fake_quantize as np_fake_quantize
from quant_core.spec import QuantSpec
from quant_core.weights import constant_qparams
from quant_torch_fx import ModelQuantizer
from quant_torch_fx.prepare import activation_quantizers, graph_info, weight_quantizers


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.fc = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(x))
        s = torch.sigmoid(y) + y
        return self.fc(s.mean((2, 3)))

    def tensors(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The float tensors the plan observes, computed independently of the backend."""
        y = torch.relu(self.conv(x))
        sig = torch.sigmoid(y)
        s = sig + y
        m = s.mean((2, 3))
        return {"x": x, "relu": y, "sigmoid": sig, "add": s, "mean": m, "linear": self.fc(m)}


OBSERVERS = {
    "minmax": (MinMax(), False),
    "percentile": (Percentile(99.9, bins=256), False),
    "entropy": (Entropy(bins=256, num_quantized_bins=128), False),
    "mse": (MSE(bins=256, num_candidates=40), False),
    "minmse_pow2": (PowerOfTwoMSE(bins=256), True),
}


def _config(observer: object, pow2: bool) -> QuantConfig:
    act = QuantSpec(dtype="int8" if pow2 else "uint8", symmetric=pow2, observer=observer,
                    scale_type="power_of_two" if pow2 else "float")  # fmt: skip
    weight = QuantSpec(dtype="int8", per_channel_axis="output", scale_type="power_of_two" if pow2 else "float")
    return QuantConfig(global_config=OperatorConfig(input=act, weight=weight, output=act))


@pytest.mark.parametrize("method", sorted(OBSERVERS))
def test_activation_qparams_equal_numpy_observers_on_float_tensors(method: str) -> None:
    torch.manual_seed(0)
    model = Tiny().eval()
    config = _config(*OBSERVERS[method])
    data = images(5, batch=6, seed=2)
    qmodel = ModelQuantizer(config, quiet=True).quantize_model(model, torch.randn(1, 3, 8, 8), data)
    reference = {}
    with torch.no_grad():
        for batch in data:
            for name, value in model.tensors(batch).items():
                reference.setdefault(name, make_observer(config.global_config.input)).update(value.numpy())
    got = {key: fq.current_qparams() for key, fq in activation_quantizers(qmodel)}
    renamed = {k.split("_")[0] if k.startswith("sigmoid") else k: v for k, v in got.items()}
    keys = {"x": "x", "conv2d": "relu", "sigmoid": "sigmoid", "add": "add", "mean": "mean", "linear": "linear"}
    if not OBSERVERS[method][1]:  # the logits are the result tail: float outside power-of-two formats
        del keys["linear"]
    assert set(renamed) == set(keys), renamed.keys()
    for key, name in keys.items():
        assert renamed[key] == reference[name].qparams(), (key, renamed[key], reference[name].qparams())


def test_weight_qparams_and_bias_follow_quant_core() -> None:
    torch.manual_seed(0)
    model = Tiny().eval()
    # Without the preset's bias correction, which rewrites the bias on purpose.
    q = ModelQuantizer(get_preset("a8w8").evolve(algorithms=()), quiet=True)
    qmodel = q.quantize_model(model, torch.randn(1, 3, 8, 8), images(3, seed=4))
    weights = dict(weight_quantizers(qmodel))
    spec = get_preset("a8w8").global_config.weight.evolve(per_channel_axis=0)
    assert weights["conv/conv2d"].current_qparams() == constant_qparams(model.conv.weight.detach().numpy(), spec)
    frozen = q.freeze(qmodel)
    info = graph_info(frozen)
    acts = dict(activation_quantizers(frozen))
    expected = encode_bias(
        model.conv.bias.detach().numpy(),
        acts["x"].current_qparams().scale,
        dict(weight_quantizers(frozen))["conv/conv2d"].current_qparams(),
        None,
        integer_kernel=True,
    )
    encoded = info.biases["conv/conv2d"]
    np.testing.assert_array_equal(encoded.codes, expected.codes)
    assert encoded.qparams == expected.qparams and encoded.rule.value == "product"


def test_frozen_model_computes_the_quantized_arithmetic() -> None:
    """Each layer of the frozen model equals quant_core's numpy fake quantization of its inputs."""
    torch.manual_seed(0)
    model = Tiny().eval()
    q = ModelQuantizer("xint8", quiet=True)
    frozen = q.freeze(q.quantize_model(model, torch.randn(1, 3, 8, 8), images(3, seed=4)))
    acts = dict(activation_quantizers(frozen))
    info = graph_info(frozen)
    x = images(1, batch=4, seed=9)[0]
    w_qp = dict(weight_quantizers(frozen))["conv/conv2d"].current_qparams()
    xq = np_fake_quantize(x.numpy(), acts["x"].current_qparams())
    wq = np_fake_quantize(model.conv.weight.detach().numpy(), w_qp)
    bias = info.biases["conv/conv2d"].values()
    conv = F.conv2d(torch.from_numpy(xq), torch.from_numpy(wq), torch.from_numpy(bias), padding=1)
    relu_q = np_fake_quantize(torch.relu(conv).numpy(), acts["conv2d"].current_qparams())
    captured = {}
    node = next(n for n in frozen.graph.nodes if n.op == "call_module" and n.target == info.activation["conv2d"])
    handle = frozen.get_submodule(str(node.target)).register_forward_hook(
        lambda _m, _i, out: captured.__setitem__("relu", out)  # the group's last call: after the ReLU
    )
    with torch.no_grad():
        frozen(x)
    handle.remove()
    np.testing.assert_allclose(captured["relu"].numpy(), relu_q, atol=float(acts["conv2d"].current_qparams().scale))
    assert np.mean(captured["relu"].numpy() == relu_q) > 0.99  # float accumulation order flips a few ties


def test_dynamic_batch_from_calibration_to_inference() -> None:
    q = ModelQuantizer("a8w8", quiet=True)
    qmodel = q.quantize_model(conv_bn_net(), torch.randn(1, 3, 8, 8), images(2, batch=5))
    assert qmodel(torch.randn(64, 3, 8, 8)).shape == (64, 5)
    assert q.freeze(qmodel)(torch.randn(1, 3, 8, 8)).shape == (1, 5)


class BoundedBatchNet(nn.Module):
    """Takes another kernel above a batch size, as eval-mode batch norm does on CUDA (cuDNN
    up to 65535): torch.export records a guard that a batch from 1 violates."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return y.relu() if x.shape[0] <= 1000 else y.sigmoid()


def test_a_bounded_batch_stays_dynamic() -> None:
    q = ModelQuantizer("a8w8", quiet=True)
    qmodel = q.quantize_model(BoundedBatchNet(), torch.randn(1, 3, 8, 8), images(2, batch=5))
    assert qmodel(torch.randn(1, 3, 8, 8)).shape == (1, 4, 6, 6)
    assert q.freeze(qmodel)(torch.randn(7, 3, 8, 8)).shape == (7, 4, 6, 6)


def test_loader_of_image_label_pairs_and_num_batches() -> None:
    q = ModelQuantizer("a8w8", quiet=True)
    data = [(x, torch.zeros(x.shape[0], dtype=torch.long)) for x in images(4)]
    calls = []

    class Counting(list):
        def __iter__(self):
            for item in super().__iter__():
                calls.append(1)
                yield item

    qmodel = q.quantize_model(conv_bn_net(), torch.randn(1, 3, 8, 8), Counting(data), num_batches=2)
    assert len(calls) == 2
    assert qmodel(images(1)[0]).shape == (8, 5)


@pytest.mark.parametrize("algorithms", [(), ("cle",)], ids=["calibration", "held-for-algorithms"])
def test_config_num_samples_caps_the_calibration_samples(algorithms: tuple[str, ...]) -> None:
    # The config's calibration.num_samples was ignored: quant-onnx reads the first N
    # samples, the torch backend every batch, so one config file gave two sets of scales.
    from quant_core.algorithm_config import CLEConfig
    from quant_core.config import CalibrationConfig

    torch.manual_seed(0)
    small, large = torch.randn(4, 3, 8, 8), 100 * torch.randn(4, 3, 8, 8)
    algos = tuple(CLEConfig() for _ in algorithms)
    base = get_preset("a8w8").evolve(algorithms=algos)

    def input_scale(config: QuantConfig, loader: list[torch.Tensor]) -> float:
        q = ModelQuantizer(config, quiet=True)
        model = q.quantize_model(conv_bn_net(), torch.randn(1, 3, 8, 8), loader)
        return float(dict(activation_quantizers(model))["x"].current_qparams().scale)

    capped = base.evolve(calibration=CalibrationConfig(num_samples=6))
    # Six samples: the first batch and half the second, the last batch cut.
    assert input_scale(capped, [small, large]) == input_scale(base, [small, large[:2]])
    assert input_scale(capped, [small, large]) != input_scale(base, [small, large])
    assert input_scale(base.evolve(calibration=CalibrationConfig(num_samples=4)), [small, large]) == input_scale(
        base, [small]
    )


def test_same_model_data_config_give_identical_models() -> None:
    q = ModelQuantizer("xint8", quiet=True)
    states = []
    for _ in range(2):
        frozen = q.freeze(q.quantize_model(conv_bn_net(), torch.randn(1, 3, 8, 8), images(2)))
        states.append({k: v for k, v in frozen.state_dict().items() if isinstance(v, torch.Tensor)})
    assert states[0].keys() == states[1].keys()
    for key in states[0]:
        assert torch.equal(states[0][key], states[1][key]), key


def test_a_float_bias_spec_an_integer_kernel_overrides_is_noted_as_in_quant_onnx() -> None:
    """Both backends decide 'this bias becomes int32 per channel' with one rule
    (quant_core.bias.bias_to_encode): a float bias spec on an 8-bit layer is stored as int32
    with the same note quant-onnx writes, not passed on in float."""
    base = get_preset("a8w8")
    config = base.evolve(global_config=attrs.evolve(base.global_config, bias=QuantSpec(dtype="fp32")))
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    q = ModelQuantizer(config, quiet=True)
    frozen = q.freeze(q.quantize_model(net, images(1), [images(8)]))
    (graph,) = q.report(frozen).values()
    assert any("the config keeps this bias fp32, but an integer kernel reads the layer" in n for n in graph["notes"])
    (gm,) = [m for m in frozen.modules() if hasattr(m, "graph")][:1]
    (encoded,) = graph_info(gm).biases.values()
    assert encoded.codes is not None and encoded.codes.dtype == np.int32


def test_power_of_two_positions_round_to_the_nearest_power_as_quant_core_rules() -> None:
    """The torch backend takes quant_core's power-of-two rule (the nearest power on a log2
    scale, Quark's): a weight whose min-max scale is 10% above 2**-7 gets 2**-7, not 2**-6,
    and an input with min-max activations whose largest value is 1.0 gets 2**-7."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    with torch.no_grad():
        net[0].weight.uniform_(-0.5, 0.5)
        net[0].weight[0, 0, 0, 0] = 1.1 * 127 * 2.0**-7
    base = get_preset("xint8")
    act = attrs.evolve(base.global_config.input, observer=MinMax())
    config = base.evolve(global_config=attrs.evolve(base.global_config, input=act, output=act))
    x = torch.rand(8, 3, 8, 8) * 2 - 1
    x[0, 0, 0, 0] = 1.0
    q = ModelQuantizer(config, quiet=True)
    frozen = q.freeze(q.quantize_model(net, x[:1], [x]))
    weight = dict(weight_quantizers(frozen))["0/conv2d"].current_qparams()
    assert int(weight.fix_pos) == 7  # type: ignore[arg-type]
    assert int(dict(activation_quantizers(frozen))["input_1"].current_qparams().fix_pos) == 7  # type: ignore[arg-type]
