"""The writer's speed contract: after onnxruntime's graph optimisation (level ALL) no
float Conv/FusedConv/nchwc Conv/Gemm/MatMul is left (docs/onnxruntime.md)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import conv_bn_relu_model, depthwise_bn_model, identity_weight_model, same_pad_model
from model_builders import float_compute_nodes, mlp, optimized_op_types, small_cnn

from quant_onnx import ModelQuantizer

REFERENCE_MODELS = Path(__file__).resolve().parents[3] / "tools" / "models"


def _random_data(model: onnx.ModelProto, n: int) -> dict[str, np.ndarray]:
    data = {}
    rng = np.random.default_rng(0)
    initializers = {t.name for t in model.graph.initializer}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        dims = [d.dim_value if d.dim_value > 0 else 1 for d in value.type.tensor_type.shape.dim]
        data[value.name] = rng.normal(size=[n, *dims[1:]]).astype(np.float32)
    return data


def _quantized_ops(model: onnx.ModelProto, preset: str, tmp_path) -> list[str]:
    quantizer = ModelQuantizer(preset, quiet=True)
    prepared = quantizer.prepare(model)
    quantized = quantizer.write(quantizer.calibrate(prepared, _random_data(prepared.model, 8), batch_size=4)).model
    return optimized_op_types(quantized, tmp_path)


CASES = {
    "small_cnn": small_cnn,
    "mlp": mlp,
    "conv_bn_relu": conv_bn_relu_model,
    "identity_wrapped_weights": identity_weight_model,
    "same_pads": same_pad_model,
    "depthwise_bn": depthwise_bn_model,
}


@pytest.mark.parametrize("preset", ["a8w8", "xint8", "a8w8_per_tensor"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_no_float_compute_left(case: str, preset: str, tmp_path) -> None:
    ops = _quantized_ops(CASES[case](), preset, tmp_path)
    assert not float_compute_nodes(ops), ops
    assert any(op.split(":")[1].startswith(("QLinear", "QGemm", "MatMulInteger")) for op in ops), ops


@pytest.mark.parametrize("name", ["fmnist_resnet18.onnx", "fmnist_mobilenetv2.onnx"])
def test_reference_models_land_in_integer_kernels(name: str, tmp_path) -> None:
    path = REFERENCE_MODELS / name
    if not path.is_file():
        pytest.skip(f"{path} not built yet (tools/ trains it)")
    ops = _quantized_ops(onnx.load(path), "a8w8", tmp_path)
    assert not float_compute_nodes(ops), sorted(set(ops))
