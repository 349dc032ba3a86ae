"""One saturation rule for both backends: a Conv output read only by a HardSwish is
quantized on its range cut at -3 (what the HardSwish can still tell apart) in the file
quant-torch-fx writes and in the one quant-onnx writes from torch's own export, with the
same scale and zero point."""

from __future__ import annotations

import io

import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
pytest.importorskip("quant_onnx")
pytest.importorskip("quant_torch_fx")
from onnx import numpy_helper  # noqa: E402

from quant_torch_fx import ModelQuantizer  # noqa: E402


class HardSwishNet(torch.nn.Module):
    """Conv -> HardSwish -> Conv, and a squeeze-excite gate through HardSigmoid."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.gate = torch.nn.Conv2d(8, 8, 1)
        with torch.no_grad():
            self.conv1.weight.mul_(8.0)  # outputs down to about -20: far below the HardSwish's -3

    def forward(self, x):  # type: ignore[no-untyped-def]
        F = torch.nn.functional
        y = self.conv2(F.hardswish(self.conv1(x)))
        return y * F.hardsigmoid(self.gate(y.mean(dim=(2, 3), keepdim=True)))


def _hardswish_input_qparams(proto) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    """Scale and zero point of the QuantizeLinear whose DequantizeLinear feeds the HardSwish."""
    producers = {o: n for n in proto.graph.node for o in n.output}
    values = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    for node in proto.graph.node:
        if node.op_type == "Constant":
            values[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    hardswish = next(n for n in proto.graph.node if n.op_type == "HardSwish")
    dq = producers[hardswish.input[0]]
    assert dq.op_type == "DequantizeLinear"
    return float(values[dq.input[1]]), int(values[dq.input[2]])


def test_both_backends_cut_the_hardswish_input_at_minus_three(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import quant_onnx

    model, images = HardSwishNet().eval(), torch.randn(16, 3, 8, 8)
    with torch.no_grad():
        low = float(model.conv1(images).min())
    assert low < -10.0, low  # the test needs a range the cut can shorten
    q = ModelQuantizer("a8w8", quiet=True)
    fx_path = q.export_onnx(q.quantize_model(model, images[:1], [images]), images[:1], tmp_path / "fx.onnx")
    buffer = io.BytesIO()
    torch.onnx.export(model, (images[:1],), buffer, dynamo=False, opset_version=17)
    onnx_file = quant_onnx.quantize(buffer.getvalue(), None, "a8w8", images.numpy(), quiet=True).model
    fx = _hardswish_input_qparams(onnx.load(str(fx_path)))
    ours = _hardswish_input_qparams(onnx_file)
    assert fx[1] == ours[1] and fx[0] == pytest.approx(ours[0], rel=1e-6)
    scale, zero_point = ours
    lowest = (0 - zero_point) * scale  # uint8: code 0
    assert -3.0 - 2 * scale <= lowest <= -3.0  # cut at -3, one step wider; not at the observed ~low
    assert lowest > low / 2
