"""preprocess() end to end: same outputs as the original, clean graph, deterministic, input untouched."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import (
    assert_same_outputs,
    clip6_model,
    constant_weight_model,
    conv_bn_relu_model,
    conv_transpose_bn_model,
    depthwise_bn_model,
    gemm_bn_model,
    identity_weight_model,
    op_types,
    opset11_model,
    pad_conv_model,
    run_ort,
    same_pad_model,
)

from quant_core.onnx_qdq.model_io import load_model, model_hash, opset_version
from quant_onnx.pipeline.preprocess import PreprocessOptions, preprocess, preprocess_with_report

REPO = Path(__file__).resolve().parents[3]
BUILDERS = {
    "conv_bn_relu": conv_bn_relu_model,
    "constant_weights": constant_weight_model,
    "identity_weights": identity_weight_model,
    "clip6": clip6_model,
    "pad_conv": pad_conv_model,
    "same_pad": same_pad_model,
    "depthwise_bn": depthwise_bn_model,
    "conv_transpose_bn": conv_transpose_bn_model,
    "gemm_bn": gemm_bn_model,
    "opset11": opset11_model,
}
UNWANTED = {"Identity", "BatchNormalization", "Constant", "Shape", "Gather", "Pad"}


def assert_clean(model: onnx.ModelProto) -> None:
    left = UNWANTED & set(op_types(model))
    assert not left, f"left in graph: {sorted(left)}"
    assert opset_version(model) >= 13
    onnx.checker.check_model(model, full_check=True)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_preprocess_keeps_outputs_and_cleans_graph(name):
    model = BUILDERS[name]()
    before = model_hash(model)
    out = preprocess(model)
    assert model_hash(model) == before
    assert_clean(out)
    assert_same_outputs(model, out, batch=2)
    # Deterministic: same input, byte-identical output.
    assert model_hash(preprocess(model)) == model_hash(out)


def test_preprocess_conv_bn_relu_structure():
    out = preprocess(conv_bn_relu_model())
    assert op_types(out) == ["Conv", "Relu"]
    names = sorted(t.name for t in out.graph.initializer)
    assert names == ["b_bn_folded", "w_bn_folded"]
    # value_info carries dtypes for intermediates after the final shape inference.
    assert all(vi.type.tensor_type.elem_type == onnx.TensorProto.FLOAT for vi in out.graph.value_info)


def test_report_counts_changes():
    result = preprocess_with_report(depthwise_bn_model())
    assert result.changes["fold_batchnorm"] == 1
    assert "relu6_to_relu" not in result.changes


def test_relu6_option_and_target_opset():
    model = depthwise_bn_model()
    assert "Clip" in op_types(preprocess(model))
    out = preprocess(model, PreprocessOptions(relu6_to_relu=True, target_opset=17))
    assert "Clip" not in op_types(out)
    assert opset_version(out) == 17


def test_disabled_passes_leave_nodes():
    out = preprocess(conv_bn_relu_model(), PreprocessOptions(fold_batchnorm=False))
    assert "BatchNormalization" in op_types(out)


def test_invalid_target_opset():
    with pytest.raises(ValueError, match="target_opset"):
        PreprocessOptions(target_opset=9)


def test_same_pad_model_runs_without_float_pad_after_ort_optimisation(tmp_path):
    import onnxruntime as ort

    out = preprocess(same_pad_model())
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(out.SerializeToString(), options, providers=["CPUExecutionProvider"])
    optimised = onnx.load(str(tmp_path / "opt.onnx"))
    assert not {"Pad", "Shape"} & set(op_types(optimised))


def _torch_export(module, example, **options) -> onnx.ModelProto:
    torch = pytest.importorskip("torch")
    buffer = io.BytesIO()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer and legacy-exporter deprecation chatter
        torch.onnx.export(
            module.eval(),
            (example,),
            buffer,
            input_names=["x"],
            output_names=["y"],
            dynamic_axes={"x": {0: "N"}, "y": {0: "N"}},
            dynamo=False,
            **{"opset_version": 13, **options},
        )
    return onnx.load_from_string(buffer.getvalue())


def test_torch_exported_resnet_block():
    torch = pytest.importorskip("torch")
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU6())
            self.body = nn.Sequential(
                nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False),
                nn.BatchNorm2d(16),
                nn.ReLU(),
                nn.Conv2d(16, 16, 1, bias=False),
                nn.BatchNorm2d(16),
            )
            self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            h = self.stem(x)
            h = torch.relu(h + self.body(h))
            h = nn.functional.pad(h, (1, 1, 1, 1))
            h = self.up(h)
            return self.fc(h.mean(dim=(2, 3)))

    torch.manual_seed(0)
    module = Block()
    for m in module.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
    model = _torch_export(module, torch.randn(1, 3, 8, 8))
    out = preprocess(model)
    assert not {"Identity", "BatchNormalization", "Constant"} & set(op_types(out))
    assert_same_outputs(model, out, batch=3)


@pytest.mark.parametrize("name", ["fmnist_resnet18.onnx", "fmnist_mobilenetv2.onnx"])
def test_reference_models_preprocess_cleanly(name):
    path = REPO / "tools" / "models" / name
    if not path.is_file():
        pytest.skip(f"{path} not built")
    model = load_model(path)
    out = preprocess(model)
    assert not {"Identity", "BatchNormalization", "Constant"} & set(op_types(out))
    assert_same_outputs(model, out, batch=2)


def test_preprocess_output_feeds_like_input():
    model = identity_weight_model()
    out = preprocess(model)
    x = np.random.default_rng(1).standard_normal((1, 3, 5, 5)).astype(np.float32)
    np.testing.assert_allclose(run_ort(model, {"x": x})[0], run_ort(out, {"x": x})[0], rtol=1e-5, atol=1e-5)
    assert [o.name for o in out.graph.output] == ["y"]


def test_torch_exported_tf_same_padding_is_folded_into_convs():
    torch = pytest.importorskip("torch")
    nn = torch.nn
    import math

    class SameConv(nn.Conv2d):
        """EfficientNet (TF port) conv: 'same' padding computed from the input size at run time."""

        def forward(self, x):
            ih, iw = x.shape[-2:]
            kh, kw = self.weight.shape[-2:]
            sh, sw = self.stride
            pad_h = max((math.ceil(ih / sh) - 1) * sh + kh - ih, 0)
            pad_w = max((math.ceil(iw / sw) - 1) * sw + kw - iw, 0)
            x = nn.functional.pad(x, [pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2])
            return nn.functional.conv2d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)

    torch.manual_seed(0)
    module = nn.Sequential(
        SameConv(3, 16, 3, stride=2, bias=False),
        nn.BatchNorm2d(16),
        nn.Hardswish(),
        SameConv(16, 16, 5, stride=2, groups=16, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU6(),
    )
    model = _torch_export(module, torch.randn(1, 3, 17, 17))
    assert {"Shape", "Pad"} <= set(op_types(model))
    out = preprocess(model)
    assert not {"Shape", "Gather", "Pad", "Identity", "BatchNormalization", "Constant"} & set(op_types(out))
    assert op_types(out).count("Conv") == 2
    assert_same_outputs(model, out, batch=3)


@pytest.mark.parametrize("opset", [11])
def test_torch_exported_mobilenetv2_unfused_bn_and_initializer_inputs(opset):
    pytest.importorskip("torch")
    import sys

    sys.path.insert(0, str(REPO))
    nets = pytest.importorskip("tools.reference_models.nets")
    import torch

    torch.manual_seed(0)
    module = nets.mobilenetv2_shape()
    model = _torch_export(
        module,
        torch.randn(1, 1, 32, 32),
        opset_version=opset,
        do_constant_folding=False,
        keep_initializers_as_inputs=True,
    )
    assert {"BatchNormalization", "Constant"} <= set(op_types(model)) and len(model.graph.input) > 1
    out = preprocess(model)
    assert not {"Identity", "BatchNormalization", "Constant"} & set(op_types(out))
    assert [i.name for i in out.graph.input] == ["x"]
    assert opset_version(out) == max(13, opset)
    assert_same_outputs(model, out, batch=2)
