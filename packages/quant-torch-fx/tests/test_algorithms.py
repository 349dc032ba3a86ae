"""A config's algorithms on the torch backend: CLE before planning, AdaRound, AdaQuant and
bias correction after calibration, through quant_algos' drivers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from models import conv_bn_net, images, mobile_block_net

from quant_core.algorithm_config import (
    AdaQuantConfig,
    AdaRoundConfig,
    BiasCorrectionConfig,
    CLEConfig,
    GPTQConfig,
    MixedPrecisionConfig,
)
from quant_core.presets import get_preset
from quant_torch_fx import ModelQuantizer
from quant_torch_fx.algorithms import TorchLayerRunner
from quant_torch_fx.algorithms.probe import float_mode
from quant_torch_fx.prepare import graph_info, weight_quantizers

EXAMPLE = torch.zeros(1, 3, 8, 8)


@pytest.fixture(scope="module")
def data() -> tuple[torch.nn.Module, list[torch.Tensor], torch.Tensor, torch.Tensor]:
    net = mobile_block_net()
    test = torch.cat(images(4, batch=16, seed=7))
    with torch.no_grad():
        reference = net(test)
    return net, images(4, batch=16), test, reference


@pytest.fixture(scope="module")
def plain_output(data) -> torch.Tensor:
    """The frozen plain xint8 model's output on the test images."""
    net, calibration, test, _reference = data
    with torch.no_grad():
        return _quantize(net, calibration)(test)


def _quantize(net: torch.nn.Module, calibration: list[torch.Tensor], *algorithms: object) -> torch.nn.Module:
    q = ModelQuantizer(get_preset("xint8").evolve(algorithms=algorithms), quiet=True)
    return q.freeze(q.quantize_model(net, EXAMPLE, calibration))


def _sqnr(y: torch.Tensor, reference: torch.Tensor) -> float:
    return float(10 * torch.log10(reference.pow(2).mean() / (y - reference).pow(2).mean()))


def test_cle_keeps_the_float_function_and_evens_the_channel_ranges(data) -> None:
    net, calibration, test, reference = data
    q = ModelQuantizer(get_preset("xint8").evolve(algorithms=(CLEConfig(),)), quiet=True)
    qmodel = q.quantize_model(net, EXAMPLE, calibration)
    report = graph_info(qmodel).algorithms["cle"]
    assert report["chains"], report
    with float_mode(qmodel), torch.no_grad():
        np.testing.assert_allclose(qmodel(test).numpy(), reference.numpy(), rtol=1e-4, atol=1e-4)
    plain = ModelQuantizer("xint8", quiet=True).quantize_model(net, EXAMPLE, calibration)
    first = report["chains"][0][0]

    def spread(model: torch.nn.Module) -> float:
        layer = next(layer for layer in TorchLayerRunner(model, []).layers() if layer.name == first)
        ranges = np.abs(layer.float_weight).reshape(layer.out_channels, -1).max(axis=1)
        return float(ranges.max() / ranges.min())

    assert spread(qmodel) < spread(plain) / 2


def test_adaround_raises_the_output_sqnr(data, plain_output) -> None:
    net, calibration, test, reference = data
    adaround = _quantize(net, calibration, AdaRoundConfig(num_iterations=300, num_samples=64))
    with torch.no_grad():
        gain = _sqnr(adaround(test), reference) - _sqnr(plain_output, reference)
    assert gain > 1.0


def test_adaround_codes_survive_freezing(data) -> None:
    net, calibration, _test, _reference = data
    q = ModelQuantizer(get_preset("xint8").evolve(algorithms=(AdaRoundConfig(num_iterations=50, num_samples=16),)))
    q.quiet = True
    qmodel = q.quantize_model(net, EXAMPLE, calibration)
    before = {node: fq.current_qparams() for node, fq in weight_quantizers(qmodel)}
    assert set(graph_info(qmodel).fixed_weights) == set(before)
    frozen = q.freeze(qmodel)
    for node, fq in weight_quantizers(frozen):
        np.testing.assert_array_equal(fq.current_qparams().scale, before[node].scale)


def test_bias_correction_lowers_the_mean_output_error(data, plain_output) -> None:
    net, calibration, test, reference = data
    corrected = _quantize(net, calibration, BiasCorrectionConfig(num_samples=64))
    with torch.no_grad():
        before = (plain_output - reference).mean(0).abs().mean()
        after = (corrected(test) - reference).mean(0).abs().mean()
    assert after < before / 2


def test_analytic_bias_correction_moves_each_bias_by_torchs_mean_response_to_the_weight_error(data) -> None:
    # The reference: torch's own conv2d/linear of (W_q - W) over each layer's input in the
    # float nn.Module (stride, padding and groups as the layer has them), averaged per channel.
    net, calibration, _test, _reference = data
    config = get_preset("xint8")
    q = ModelQuantizer(config, quiet=True)
    plain = q.quantize_model(net, EXAMPLE, calibration)
    runner = TorchLayerRunner(plain, [(x,) for x in calibration])
    analytic = ModelQuantizer(config.evolve(algorithms=(BiasCorrectionConfig(method="analytic"),)), quiet=True)
    corrected = TorchLayerRunner(analytic.quantize_model(net, EXAMPLE, calibration), [(x,) for x in calibration])
    inputs: list[torch.Tensor] = []  # each Conv2d/Linear's input, in the order they run
    hooks = [
        m.register_forward_hook(lambda _m, args, _out: inputs.append(args[0].double()))
        for m in net.modules()
        if isinstance(m, torch.nn.Conv2d | torch.nn.Linear)
    ]
    with torch.no_grad():
        runs = [net(x) for x in calibration]
    for hook in hooks:
        hook.remove()
    per_layer = [torch.cat(inputs[i :: len(hooks)]) for i in range(len(hooks))]
    assert len(runs) == len(calibration) and len(per_layer) == len(runner.layers())
    largest = 0.0
    for layer, after, x in zip(runner.layers(), corrected.layers(), per_layer, strict=True):
        delta = torch.from_numpy(runner.quantized_weight(layer) - layer.float_weight).double()
        if layer.geometry is None:
            response = x @ delta.T
        else:
            g = layer.geometry
            response = torch.nn.functional.conv2d(
                x, delta, stride=g.strides, padding=g.pads[:2], dilation=g.dilations, groups=g.groups
            )
        shift = response.transpose(0, 1).reshape(layer.out_channels, -1).mean(1).numpy()
        # What is left is the bias encoding's rounding (about 1e-4 here).
        np.testing.assert_allclose(layer.bias - after.bias, shift, atol=2e-4, err_msg=layer.name)
        largest = max(largest, float(np.abs(shift).max()))
    assert largest > 1e-2  # corrections this test would see left out (the depthwise one: padding)


def test_gptq_raises_the_output_sqnr_and_its_codes_survive_freezing(data, plain_output) -> None:
    net, calibration, test, reference = data
    q = ModelQuantizer(get_preset("xint8").evolve(algorithms=(GPTQConfig(num_samples=64),)), quiet=True)
    qmodel = q.quantize_model(net, EXAMPLE, calibration)
    layers = graph_info(qmodel).algorithms["gptq"]["layers"]
    assert len(layers) == 4 and all(layer["loss"] <= layer["loss_nearest"] for layer in layers)
    frozen = q.freeze(qmodel)
    with torch.no_grad():
        assert _sqnr(frozen(test), reference) > _sqnr(plain_output, reference) + 0.5


def test_a_pass_after_a_learned_one_still_compares_with_the_float_weights(data) -> None:
    # GPTQ writes its rounded weights into the graph; the bias correction after it must
    # still see them against the float weights (it once saw W_q - W = 0 and did nothing).
    net, calibration, _test, _reference = data
    batches = [(x,) for x in calibration]

    def biases(*algorithms: object) -> list[np.ndarray]:
        q = ModelQuantizer(get_preset("xint8").evolve(algorithms=algorithms), quiet=True)
        return [layer.bias for layer in TorchLayerRunner(q.quantize_model(net, EXAMPLE, calibration), batches).layers()]

    gptq = GPTQConfig(num_samples=64)
    moved = [
        float(np.abs(a - b).max())
        for a, b in zip(biases(gptq), biases(gptq, BiasCorrectionConfig(method="analytic")), strict=True)
    ]
    assert max(moved) > 1e-3, moved


def test_adaquant_raises_the_output_sqnr(data, plain_output) -> None:
    net, calibration, test, reference = data
    adaquant = _quantize(net, calibration, AdaQuantConfig(num_iterations=100, num_samples=64))
    with torch.no_grad():
        assert _sqnr(adaquant(test), reference) > _sqnr(plain_output, reference) + 1.0


def test_bias_correction_gives_a_bias_free_layer_a_bias_that_freezes_to_int32() -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 4, bias=False)).eval()
    calibration = [torch.randn(16, 3, 2, 2) + 0.5 for _ in range(2)]
    q = ModelQuantizer(get_preset("xint8").evolve(algorithms=(BiasCorrectionConfig(num_samples=32),)), quiet=True)
    qmodel = q.quantize_model(net, torch.zeros(1, 3, 2, 2), calibration)
    slot = graph_info(qmodel).plan.biases[0]
    assert slot.tensor, graph_info(qmodel).algorithms
    frozen = q.freeze(qmodel)
    encoded = graph_info(frozen).biases[slot.node]
    assert encoded.codes is not None and encoded.codes.dtype == np.int32 and np.any(encoded.codes)


def test_the_runner_describes_layers_as_the_plan_does(data) -> None:
    net, calibration, _test, _reference = data
    qmodel = ModelQuantizer("xint8", quiet=True).quantize_model(net, EXAMPLE, calibration)
    runner = TorchLayerRunner(qmodel, [(x,) for x in calibration])
    layers = runner.layers()
    assert [(layer.op_type, layer.activation) for layer in layers] == [
        ("Conv", "relu6"),
        ("Conv", "relu6"),
        ("Conv", "relu"),
        ("Gemm", None),
    ]
    assert layers[1].geometry is not None and layers[1].geometry.groups == 8 and layers[1].geometry.pads == (1, 1, 1, 1)
    assert runner.num_samples == 64 and all(layer.bias_allowed for layer in layers)
    first = next(iter(runner.quantized_inputs(layers[0])))
    assert first.shape == (16, 3, 8, 8)


@pytest.mark.parametrize(
    ("kwargs", "algorithms", "message"),
    [
        ({}, (MixedPrecisionConfig(max_layers=1),), "mixed_precision is not run by the torch backend"),
        ({"regions": ["conv1"]}, (CLEConfig(),), "regions: the config's algorithms"),
    ],
)
def test_what_the_backend_does_not_run_is_refused(kwargs, algorithms, message) -> None:
    with pytest.raises(ValueError, match=message):
        ModelQuantizer(get_preset("xint8").evolve(algorithms=algorithms), **kwargs)


def test_qat_with_algorithms_needs_folded_batch_norm_and_data() -> None:
    q = ModelQuantizer(get_preset("xint8").evolve(algorithms=(CLEConfig(),)), quiet=True)
    with pytest.raises(ValueError, match=r"cle run with quantize_model.*fold_batch_norm=True"):
        q.prepare_qat(conv_bn_net(), EXAMPLE)
    q = ModelQuantizer(get_preset("xint8").evolve(algorithms=(CLEConfig(), AdaRoundConfig())), quiet=True)
    with pytest.raises(ValueError, match=r"config\.algorithms: cle, adaround run with quantize_model"):
        q.prepare_qat(conv_bn_net(), EXAMPLE)
    with pytest.raises(ValueError, match=r"calib_loader: config\.algorithms adaround run on calibration data"):
        q.prepare_qat(conv_bn_net(), EXAMPLE, fold_batch_norm=True)


def test_qat_starts_from_the_adaround_ptq_model_and_learns_its_own_weight_qparams(data) -> None:
    net, calibration, test, _reference = data
    config = get_preset("xint8").evolve(algorithms=(CLEConfig(), AdaRoundConfig(num_iterations=50, num_samples=32)))
    q = ModelQuantizer(config, quiet=True)
    ptq = q.quantize_model(net, EXAMPLE, calibration)
    qat = q.prepare_qat(net, EXAMPLE, calib_loader=calibration, fold_batch_norm=True)
    assert qat.training
    learned = [[(r["name"], r["loss"]) for r in graph_info(m).algorithms["adaround"]["layers"]] for m in (qat, ptq)]
    assert learned[0] == learned[1] and len(learned[0]) == 4
    assert graph_info(ptq).fixed_weights and not graph_info(qat).fixed_weights
    with torch.no_grad():
        torch.testing.assert_close(qat.eval()(test), ptq(test))
        torch.testing.assert_close(q.freeze(qat)(test), q.freeze(ptq)(test))
    # the weights stay trainable parameters
    assert any(p.requires_grad and p.ndim == 4 for p in qat.parameters())


def test_qat_on_folded_batch_norm_starts_from_the_cle_ptq_model(data) -> None:
    net, calibration, test, _reference = data
    q = ModelQuantizer(get_preset("xint8").evolve(algorithms=(CLEConfig(),)), quiet=True)
    ptq = q.quantize_model(net, EXAMPLE, calibration)
    qat = q.prepare_qat(net, EXAMPLE, calib_loader=calibration, fold_batch_norm=True)
    assert graph_info(qat).algorithms["cle"] == graph_info(ptq).algorithms["cle"]
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in qat.modules())
    with torch.no_grad():
        torch.testing.assert_close(qat.eval()(test), ptq(test))
    frozen = q.freeze(qat)
    with torch.no_grad():
        torch.testing.assert_close(frozen(test), q.freeze(ptq)(test))


def test_bias_correction_on_a_linear_over_tokens_corrects_its_output_channels() -> None:
    # aten.linear on [batch, tokens, features]: the channels are the last axis, not axis 1.
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()
    calibration = [torch.randn(32, 4, 16) + 0.3 for _ in range(2)]
    test = torch.randn(64, 4, 16) + 0.3
    example = torch.zeros(1, 4, 16)

    def mean_error(*algorithms: object) -> float:
        q = ModelQuantizer(get_preset("xint8").evolve(algorithms=algorithms), quiet=True)
        frozen = q.freeze(q.quantize_model(net, example, calibration))
        with torch.no_grad():
            return float((frozen(test) - net(test)).mean((0, 1)).abs().mean())

    assert mean_error(BiasCorrectionConfig(num_samples=64)) < 0.7 * mean_error()


@pytest.mark.parametrize(
    ("pad", "value", "chained"),
    [((1, 1, 1, 1), 0.0, True), ((0, 0, 0, 0, 1, -1), 0.0, False), ((1, 1, 1, 1), 2.0, False)],
)
def test_cle_crosses_a_pad_only_where_channels_keep_their_order(pad, value, chained) -> None:
    """Spatial zero padding commutes with a per-channel scale; a pad that shifts the
    channels (or fills with anything but 0) would carry a scale to the wrong place."""
    from torch import nn

    class Padded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Conv2d(3, 6, 3), nn.Conv2d(6, 4, 3)
            with torch.no_grad():
                self.a.weight[:3] *= 20.0  # uneven channel ranges: CLE has something to do

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(nn.functional.pad(torch.relu(self.a(x)), pad, value=value))

    net, calibration = Padded().eval(), images(2, batch=8)
    q = ModelQuantizer(get_preset("xint8").evolve(algorithms=(CLEConfig(),)), quiet=True)
    qmodel = q.quantize_model(net, EXAMPLE, calibration)
    assert bool(graph_info(qmodel).algorithms["cle"]["chains"]) is chained
    test = torch.cat(images(1, batch=8, seed=5))
    with float_mode(qmodel), torch.no_grad():
        np.testing.assert_allclose(qmodel(test).numpy(), net(test).numpy(), rtol=1e-4, atol=1e-4)


class _SelfAttention(torch.nn.Module):
    """nn.MultiheadAttention over ``[batch, tokens, features]``: its output projection reads
    ``[tokens * batch, features]``, and sequence-first its input projection reads
    ``[tokens, batch, features]`` (the batch is not their axis 0)."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=batch_first)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.attn.batch_first:
            return self.attn(x, x, x, need_weights=False)[0]
        x = x.transpose(0, 1)
        return self.attn(x, x, x, need_weights=False)[0].transpose(0, 1)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("algorithm", [GPTQConfig(), AdaRoundConfig(num_iterations=20)], ids=["gptq", "adaround"])
def test_layers_whose_input_is_not_batch_first_are_reconstructed(batch_first: bool, algorithm: object) -> None:
    # Each layer's samples were counted on its input's axis 0: 12 tokens of 2 batches for a
    # pool sized for 16 samples, and a DataError from a valid model (a16w8 carries GPTQ).
    net = _SelfAttention(batch_first).eval()
    generator = torch.Generator().manual_seed(1)
    calibration = [torch.randn(8, 6, 16, generator=generator) for _ in range(2)]
    q = ModelQuantizer(get_preset("a8w8").evolve(algorithms=(algorithm,)), quiet=True)
    qmodel = q.quantize_model(net, calibration[0][:1], calibration)
    layers = graph_info(qmodel).algorithms[algorithm.kind]["layers"]  # type: ignore[attr-defined]
    assert len(layers) == 2 and all(layer["loss"] <= layer["loss_nearest"] for layer in layers)
