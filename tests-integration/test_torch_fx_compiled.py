"""quant-torch-fx's compiled power-of-two fake quantization (``compile_fake_quant=True``):
the same values and gradients as the eager path (needs a C++ compiler for torch.compile)."""

from __future__ import annotations

import shutil

import pytest

torch = pytest.importorskip("torch")

from quant_core.spec import RoundMode  # noqa: E402
from quant_torch_fx.qat_ops import compiled_power_of_two, tqt_fake_quantize, tqt_scale  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler")


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
            y = compiled_power_of_two(xi, tqt_scale(t, 8), zero, -128, 127, RoundMode.HALF_EVEN)
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
