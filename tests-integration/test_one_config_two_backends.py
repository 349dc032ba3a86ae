"""One config file drives both backends: the ONNX path (quant_onnx, onnxruntime
calibration) and the torch path (quant_core observers fed on torch tensors,
quant_torch_fx fake quantization) must give the same scales and the same
quantized weights for the same model, data and config."""

from __future__ import annotations

import io

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from quant_core.observers import make_observer
from quant_core.presets import get_preset
from quant_core.serialization import load_config, save_config

torch = pytest.importorskip("torch")
quant_onnx = pytest.importorskip("quant_onnx")
from quant_torch_fx import fake_quantize  # noqa: E402


class SmallNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.fc = torch.nn.Linear(16, 5)

    def forward(self, x):
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        return self.fc(x.mean(dim=(2, 3)))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    model = SmallNet().eval()
    buffer = io.BytesIO()
    torch.onnx.export(
        model, torch.zeros(1, 3, 16, 16), buffer, input_names=["x"], output_names=["y"], opset_version=17, dynamo=False
    )
    path = tmp_path_factory.mktemp("m") / "small.onnx"
    path.write_bytes(buffer.getvalue())
    return model, path


def _dequantized_weights(qdq: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Float weights of each Conv/Gemm as the QDQ model encodes them, keyed by op order."""
    inits = {t.name: numpy_helper.to_array(t) for t in qdq.graph.initializer}
    producers = {out: node for node in qdq.graph.node for out in node.output}
    result = {}
    for node in qdq.graph.node:
        if node.op_type not in ("Conv", "Gemm"):
            continue
        dq = producers[node.input[1]]
        codes, scale, zero_point = (inits[name] for name in dq.input[:3])
        axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)
        shape = [1] * codes.ndim
        shape[axis] = -1
        weight = (codes.astype(np.int64) - zero_point.reshape(shape)) * scale.reshape(shape)
        result[f"{node.op_type}{len(result)}"] = weight.astype(np.float32)
    return result


def test_config_file_gives_same_weights_in_both_backends(exported, tmp_path):
    model, path = exported
    config_path = tmp_path / "a8w8.json"
    save_config(get_preset("a8w8"), config_path)
    config = load_config(config_path)
    data = np.random.default_rng(1).normal(size=(32, 3, 16, 16)).astype(np.float32)

    qdq = quant_onnx.quantize(path, tmp_path / "q.onnx", config, data, quiet=True).model
    onnx_weights = list(_dequantized_weights(qdq).values())

    # torch's Conv2d and Linear keep output channels on axis 0 of their weights.
    weight_spec = config.global_config.weight.evolve(per_channel_axis=0)
    torch_weights = []
    for layer in (model.conv1, model.conv2, model.fc):
        observer = make_observer(weight_spec)
        weight = layer.weight.detach()
        lo, hi = torch.aminmax(weight.reshape(weight.shape[0], -1), dim=1)
        observer.update_range(lo.numpy(), hi.numpy())
        torch_weights.append(fake_quantize(weight, observer.qparams()).numpy())

    assert len(onnx_weights) == 3
    for onnx_w, torch_w in zip(onnx_weights[:2], torch_weights[:2], strict=False):
        np.testing.assert_array_equal(onnx_w, torch_w)
    # Gemm stores the Linear weight transposed when the exporter chose transB=0.
    fc_onnx = onnx_weights[2] if onnx_weights[2].shape == torch_weights[2].shape else onnx_weights[2].T
    np.testing.assert_array_equal(fc_onnx, torch_weights[2])


def test_input_activation_scale_matches_torch_side_observer(exported, tmp_path):
    _, path = exported
    config = get_preset("a8w8")
    data = np.random.default_rng(2).normal(size=(40, 3, 16, 16)).astype(np.float32)
    qdq = quant_onnx.quantize(path, tmp_path / "q.onnx", config, data, batch_size=7, quiet=True).model

    inits = {t.name: numpy_helper.to_array(t) for t in qdq.graph.initializer}
    quantize_input = next(n for n in qdq.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "x")
    onnx_scale = inits[quantize_input.input[1]]
    onnx_zero_point = inits[quantize_input.input[2]]

    observer = make_observer(config.global_config.input)
    for batch in torch.from_numpy(data).split(16):
        lo, hi = torch.aminmax(batch)
        observer.update_range(lo.numpy(), hi.numpy())
    qp = observer.qparams()
    assert onnx_scale == qp.scale
    assert int(onnx_zero_point) == int(qp.zero_point)
