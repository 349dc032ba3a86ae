"""quant-torch-fx's compiled power-of-two fake quantization (``compile_fake_quant=True``):
the same values and gradients as the eager path (needs a C++ compiler for torch.compile)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from quant_core.spec import RoundMode  # noqa: E402
from quant_torch_fx.qat_ops import compiled_power_of_two, tqt_fake_quantize, tqt_scale  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler")


def _conv_bn_net() -> torch.nn.Module:
    """Two conv+BN+ReLU layers (per-channel weights, simulated batch norm in QAT) and a head."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, stride=2),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 7 * 7, 5),
    ).eval()


@pytest.mark.parametrize("per_channel", [False, True])
def test_compiled_tqt_equals_eager_in_values_and_gradients(per_channel: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 6, 5, 5) * 3
    x[0, 0, 0, :3] = torch.tensor([2.0**-5 * 0.5, 2.0**-5 * 1.5, -(2.0**-5) * 2.5])  # ties
    shape = (1, 6, 1, 1) if per_channel else ()
    results = []
    for compiled in (False, True):
        xi = x.clone().requires_grad_()
        t = torch.full(shape, 1.3, requires_grad=True)
        zero = torch.zeros(shape)
        if compiled:
            axis = 1 if per_channel else None
            y = compiled_power_of_two(xi, tqt_scale(t, 8), zero, -128, 127, RoundMode.HALF_EVEN, axis)
            assert y is not None
        else:
            y = tqt_fake_quantize(xi, t, zero, -128, 127, RoundMode.HALF_EVEN, bits=8, zero_is_zero=True)
        upstream = torch.linspace(-1, 1, y.numel()).reshape(y.shape)
        (y * upstream).sum().backward()
        results.append((y.detach(), xi.grad, t.grad))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
    torch.testing.assert_close(results[0][2], results[1][2], rtol=1e-5, atol=1e-5)  # summation order differs


def test_non_power_of_two_cases_stay_eager() -> None:
    x = torch.randn(3, requires_grad=True)
    assert compiled_power_of_two(x, torch.tensor(0.1), torch.tensor(1.0), 0, 255, RoundMode.HALF_EVEN) is None
    assert compiled_power_of_two(x, torch.tensor(0.125), torch.tensor(0.0), -128, 127, RoundMode.HALF_UP) is None
    on_meta = torch.randn(3, device="meta", requires_grad=True)  # not a CPU tensor: eager (see the docstring)
    assert (
        compiled_power_of_two(on_meta, torch.tensor(0.125), torch.tensor(0.0), -128, 127, RoundMode.HALF_EVEN) is None
    )


def test_an_xint8_qat_step_compiled_equals_eager() -> None:
    """A whole QAT step (weights per channel and activations per tensor, TQT): the same
    outputs and input gradients, threshold gradients equal up to summation order."""
    from torch._dynamo.utils import counters

    from quant_torch_fx import ModelQuantizer

    model = _conv_bn_net()
    x = torch.randn(6, 3, 16, 16)
    runs = []
    for compiled in (False, True):
        counters.clear()
        qat = ModelQuantizer("xint8", compile_fake_quant=compiled, quiet=True).prepare_qat(
            model, x[:1], calib_loader=[x]
        )
        xi = x.clone().requires_grad_()
        out = qat.train()(xi)
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        grads = {name: p.grad for name, p in qat.named_parameters() if p.grad is not None}
        runs.append((out.detach(), xi.grad, grads))
        assert (counters["stats"]["unique_graphs"] > 0) == compiled  # the compiled path ran
    assert torch.equal(runs[0][0], runs[1][0])
    assert torch.equal(runs[0][1], runs[1][1])
    assert runs[0][2].keys() == runs[1][2].keys() and any("learned" in k for k in runs[0][2])
    for name, grad in runs[0][2].items():
        torch.testing.assert_close(runs[1][2][name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_one_input_form_keeps_the_compiled_graphs_few() -> None:
    """Weights (Parameters of rank 2 and 4, per channel), activations of ranks 2-4 (per
    tensor), sizes on both sides of the compiler's size thresholds and 8- and 16-bit ranges
    reach the compiled function in one form: a few graphs, far from the recompile limit past
    which torch runs the function eagerly."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    zero = torch.zeros(())
    cases = [
        (torch.nn.Parameter(torch.randn(16, 8, 3, 3)), torch.full((16,), 2.0**-5), 0, (-128, 127)),
        (torch.nn.Parameter(torch.randn(10, 64)), torch.full((10,), 2.0**-6), 0, (-128, 127)),
        (torch.nn.Parameter(torch.randn(8, 4, 2, 2)), torch.full((4,), 2.0**-5), 1, (-128, 127)),
        (torch.randn(2, 8, 40, 40, requires_grad=True), torch.tensor(2.0**-4), None, (-128, 127)),
        (torch.randn(2, 8, 3, 3, requires_grad=True), torch.tensor(2.0**-4), None, (0, 255)),
        (torch.randn(3, 50, 16, requires_grad=True), torch.tensor(2.0**-3), None, (-128, 127)),
        (torch.randn(4, 10, requires_grad=True), torch.tensor(2.0**-9), None, (-32768, 32767)),
    ]
    for x, scale, axis, (qmin, qmax) in cases:
        y = compiled_power_of_two(x, scale.requires_grad_(), zero, qmin, qmax, RoundMode.HALF_EVEN, axis)
        assert y is not None and y.shape == x.shape
        y.sum().backward()
        shape = [1] * x.dim()
        if axis is not None:
            shape[axis] = -1
        expected = tqt_fake_quantize(
            x.detach(), scale.detach().log2().add(7).reshape(shape), zero, qmin, qmax, RoundMode.HALF_EVEN, bits=8
        )
        assert torch.equal(y.detach(), expected)
    assert counters["stats"]["unique_graphs"] <= 4, dict(counters["stats"])


def test_train_qat_compiles_the_whole_prepared_model_as_one_graph() -> None:
    """``train_qat(compile_model=True)``: the prepared model (simulated conv+BN, fake
    quantizers, TQT) compiles without a graph break, trains as the eager loop does, and the
    module itself freezes afterwards."""
    import copy

    from torch._dynamo.utils import counters

    from quant_torch_fx import ModelQuantizer, train_qat

    model = _conv_bn_net()
    x = torch.randn(8, 3, 16, 16)
    data = [(x[i : i + 4], torch.tensor([0, 1, 2, 3])) for i in (0, 4)]
    q = ModelQuantizer("xint8", quiet=True)
    eager = q.prepare_qat(model, x[:1], calib_loader=[x])
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    counters.clear()
    losses = [
        [r["loss"] for r in train_qat(m, data, epochs=2, lr=1e-3, compile_model=flag, quiet=True)]
        for m, flag in ((eager, False), (compiled, True))
    ]
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-3)
    with torch.no_grad():
        frozen = q.freeze(compiled.eval())
        expected = compiled(x)  # the fake-quantized module in eval mode; the frozen fold differs by rare ties
        torch.testing.assert_close(frozen(x), expected, rtol=0, atol=0.02 * float(expected.abs().max()))
