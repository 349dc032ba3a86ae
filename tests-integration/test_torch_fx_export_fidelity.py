"""quant-torch-fx's QDQ export in onnxruntime, in the default session (integer kernels,
graph rewrites) and with graph optimisation disabled (the file node by node):

- every ATen op family the emitter translates computes what torch computes;
- on ResNet-, MobileNetV2-, MobileNetV3-, MixNet-, PoolFormer-, ViT- and Swin-like models, every quantized tensor of the file,
  computed from the frozen model's own codes of its inputs, is within one step of the
  frozen model's (and end to end with optimisation disabled), and the top-1 is the frozen
  model's;
- a layer the config keeps float inside a quantized model runs the same in both sessions
  (onnxruntime's WeightBiasQuantization would otherwise quantize its weight);
- linears over tokens, and the two matmuls of attention (scaled_dot_product_attention is
  written out before planning), reach onnxruntime's integer MatMul kernels.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

TESTS = Path(__file__).resolve().parents[1] / "packages" / "quant-torch-fx" / "tests"
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

import export_models  # noqa: E402
import onnx  # noqa: E402
from models import conv_bn_net, images  # noqa: E402
from onnx_cases import CASES, check_case  # noqa: E402

from quant_torch_fx import ModelQuantizer  # noqa: E402
from quant_torch_fx.export import onnx_model  # noqa: E402
from quant_torch_fx.export_fidelity import node_by_node  # noqa: E402

LEVELS = {
    "default": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    "node_by_node": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
}


def _runner(level: str, optimized: Path | None = None):
    def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        options = ort.SessionOptions()
        options.graph_optimization_level = LEVELS[level]
        options.intra_op_num_threads = 1
        options.log_severity_level = 3
        if optimized is not None:
            options.optimized_model_filepath = str(optimized)
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))

    return run


@pytest.mark.parametrize("level", sorted(LEVELS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_op_family_matches_torch_in_onnxruntime(name: str, level: str) -> None:
    run = _runner(level)
    check_case(name, lambda model, feeds: list(run(model, feeds).values()))


def _frozen(family: str, preset: str) -> torch.nn.Module:
    calibration = export_models.images(4)
    q = ModelQuantizer(preset, quiet=True)
    return q.freeze(q.quantize_model(export_models.build(family), calibration[0][:1], calibration))


@pytest.mark.parametrize("preset", ["a8w8", "xint8", "a16w8", "w4a8"])
@pytest.mark.parametrize("family", ["resnet", "mobilenetv2", "mobilenetv3", "mixnet", "poolformer", "vit", "swin"])
def test_model_families_run_in_onnxruntime_as_the_frozen_model(family: str, preset: str) -> None:
    frozen = _frozen(family, preset)
    proto = onnx_model(frozen, (export_models.images(1, batch=1)[0],))
    x = export_models.images(1, batch=6, seed=9)[0]
    with torch.no_grad():
        expected = frozen(x).numpy()
    for level in LEVELS:
        fidelity = node_by_node(proto, frozen, (x,), _runner(level))
        assert not fidelity.unmatched, level
        assert max(fidelity.isolated.values()) <= 1, (level, fidelity.isolated)
        assert np.array_equal(fidelity.output.argmax(-1), expected.argmax(-1)), level
        if level == "node_by_node" and preset != "a16w8":
            # 16-bit steps are 256 times finer: float rounding apart moves a few of them
            assert max(fidelity.chain.values()) <= 1, fidelity.chain


def test_linears_over_tokens_reach_the_integer_matmul_kernels(tmp_path: Path) -> None:
    frozen = _frozen("vit", "a8w8")
    proto = onnx_model(frozen, (export_models.images(1, batch=1)[0],))
    optimized = tmp_path / "optimized.onnx"
    _runner("default", optimized)(proto, {"input": export_models.images(1, batch=2)[0].numpy()})
    kernels = [n.op_type for n in onnx.load(str(optimized)).graph.node]
    assert kernels.count("MatMulIntegerToFloat") + kernels.count("QLinearMatMul") >= 8  # 2 blocks x 4 linears


@pytest.mark.parametrize("family", ["vit", "swin"])
def test_attention_matmuls_reach_the_integer_kernels_and_run_as_node_by_node(family: str, tmp_path: Path) -> None:
    """scaled_dot_product_attention is written out before planning: Q.K^T and attn.V read
    quantized inputs, and onnxruntime runs them as integer kernels (no float MatMul left),
    computing what the file computes node by node."""
    frozen = _frozen(family, "a8w8")
    proto = onnx_model(frozen, (export_models.images(1, batch=1)[0],))
    feeds = {"input": export_models.images(1, batch=6, seed=9)[0].numpy()}
    optimized = tmp_path / "optimized.onnx"
    default = _runner("default", optimized)(proto, feeds)["output"]
    reference = _runner("node_by_node")(proto, feeds)["output"]
    kernels = [n.op_type for n in onnx.load(str(optimized)).graph.node]
    assert "MatMul" not in kernels and "Softmax" in kernels
    # 2 blocks x (4 linears + Q.K^T + attn.V)
    assert kernels.count("MatMulIntegerToFloat") + kernels.count("QLinearMatMul") >= 12, kernels
    np.testing.assert_array_equal(default.argmax(-1), reference.argmax(-1))
    noise = np.sum((default - reference) ** 2)
    assert noise == 0 or 10 * np.log10(np.sum(reference**2) / noise) > 30, noise


@pytest.mark.parametrize("preset", ["a8w8", "a16w8"])
def test_an_excluded_layer_runs_the_same_in_both_sessions(preset: str, tmp_path: Path) -> None:
    calibration = export_models.images(3)
    q = ModelQuantizer(preset, exclude_modules=["project.0", "head.0"], quiet=True)
    frozen = q.freeze(q.quantize_model(export_models.build("mobilenetv3"), calibration[0][:1], calibration))
    proto = onnx_model(frozen, (calibration[0][:1],))
    x = export_models.images(1, batch=16, seed=11)[0]
    feeds = {"input": x.numpy()}
    default = _runner("default", tmp_path / "optimized.onnx")(proto, feeds)["output"]
    # The logits are float (the result tail): QGemm's float output and the float Gemm on
    # dequantized codes differ by float32 rounding only when every code before them agrees.
    np.testing.assert_allclose(default, _runner("node_by_node")(proto, feeds)["output"], rtol=1e-5, atol=1e-7)
    ran = [n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node]
    assert ran.count("QGemm") == (1 if preset == "a8w8" else 0)  # the last linear only


def test_a_float_bias_beside_a_quantized_weight_is_not_requantized_by_onnxruntime() -> None:
    import attrs

    from quant_core.presets import get_preset
    from quant_core.spec import QuantSpec

    config = get_preset("a16w8")
    config = config.evolve(global_config=attrs.evolve(config.global_config, bias=QuantSpec(dtype="fp32")))
    q = ModelQuantizer(config, quiet=True)
    frozen = q.freeze(q.quantize_model(conv_bn_net(), torch.randn(1, 3, 8, 8), images(3)))
    proto = onnx_model(frozen, (torch.randn(1, 3, 8, 8),))
    feeds = {"input": images(1, batch=16, seed=11)[0].numpy()}
    default = _runner("default")(proto, feeds)["output"]
    np.testing.assert_array_equal(default, _runner("node_by_node")(proto, feeds)["output"])
