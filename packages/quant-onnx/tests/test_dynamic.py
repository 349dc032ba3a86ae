"""Dynamic quantization against float outputs and onnxruntime.quantization.quantize_dynamic."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from model_builders import cpu_has_vnni, mlp, ort_run, random_inputs, small_cnn
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator

from quant_core.errors import ConfigError
from quant_core.qparams import sqnr_db
from quant_onnx.cli.config_overrides import override_config
from quant_onnx.pipeline.dynamic import quantize_dynamic, quantize_dynamic_model


@pytest.mark.parametrize("build", [small_cnn, mlp])
def test_dynamic_matches_float_and_onnxruntime(build, tmp_path) -> None:
    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization import quantize_dynamic as ort_quantize_dynamic

    model = build()
    x = random_inputs(model, 16)
    ours = quantize_dynamic_model(model)
    expected = ort_run(model, x)[0]
    onnx.save(model, tmp_path / "f.onnx")
    ort_quantize_dynamic(tmp_path / "f.onnx", tmp_path / "r.onnx", weight_type=QuantType.QInt8, per_channel=True)
    theirs = ort_run(onnx.load(tmp_path / "r.onnx"), x)[0]
    # The graph itself, run by onnx's reference evaluator: exact integer arithmetic.
    reference = ReferenceEvaluator(ours).run(None, {model.graph.input[0].name: x})[0]
    assert sqnr_db(expected, reference) > 35
    ours_sqnr = sqnr_db(expected, ort_run(ours, x)[0])
    assert ours_sqnr > sqnr_db(expected, theirs) - 4
    if cpu_has_vnni():  # elsewhere onnxruntime's u8 x s8 kernels saturate, ours and theirs alike
        assert ours_sqnr > 35


def test_dynamic_graph_uses_integer_ops_and_int8_weights() -> None:
    quantized = quantize_dynamic_model(small_cnn())
    ops = [n.op_type for n in quantized.graph.node]
    assert "Conv" not in ops and "Gemm" not in ops
    assert ops.count("ConvInteger") == 6 and ops.count("MatMulInteger") == 1
    assert ops.count("DynamicQuantizeLinear") == 6  # one per distinct input tensor (two convs share one)
    weights = [numpy_helper.to_array(t) for t in quantized.graph.initializer if t.name.endswith("_quantized")]
    assert weights and all(w.dtype == np.int8 for w in weights)
    assert not [t for t in quantized.graph.initializer if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 4]


def test_dynamic_respects_exclusions_and_per_tensor(tmp_path) -> None:
    from quant_core.presets import get_preset

    config = override_config(get_preset("a8w8"), per_channel=False, exclude=["Gemm"])
    model = small_cnn()
    quantized = quantize_dynamic_model(model, config)
    assert "Gemm" in [n.op_type for n in quantized.graph.node]
    x = random_inputs(model, 8)
    assert sqnr_db(ort_run(model, x)[0], ort_run(quantized, x)[0]) > 25
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    before = path.read_bytes()
    quantize_dynamic(path, tmp_path / "q.onnx")
    assert path.read_bytes() == before and (tmp_path / "q.onnx").is_file()


def test_dynamic_checks_selectors_and_refuses_weights_it_cannot_quantize() -> None:
    from quant_core.presets import get_preset

    a8w8 = get_preset("a8w8")
    with pytest.raises(ConfigError, match="name_overrides: 'nosuch' matches no node"):
        quantize_dynamic_model(small_cnn(), a8w8.evolve(name_overrides={"nosuch": a8w8.global_config}))
    with pytest.raises(ConfigError, match=r"weight: int4 symmetric .* allowed: int8 or uint8 symmetric"):
        quantize_dynamic_model(small_cnn(), "w4a8")
