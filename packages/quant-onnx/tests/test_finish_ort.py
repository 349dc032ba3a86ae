"""quant_core.onnx_qdq.finish against onnxruntime itself (the layer's own tests use onnx's
reference evaluator; onnxruntime is installed here): the WeightBiasQuantization guard
covers exactly the units onnxruntime's default session completes."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from model_builders import ort_run
from onnx import TensorProto, helper, numpy_helper

from quant_core.onnx_qdq.finish import finish_for_onnxruntime


def _gemm(*, quantized_weight: bool, requantized: bool) -> onnx.ModelProto:
    """x -> Q (uint16) -> DQ -> Gemm(float or int8 weight, float bias) [-> Q -> DQ] -> y: no
    integer kernel takes 16-bit activations, so the bias rule may keep a bias float there."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(np.float32(0.05), "s"),
        numpy_helper.from_array(np.uint16(32768), "z"),
        numpy_helper.from_array((rng.normal(size=8) * 0.37).astype(np.float32), "b"),
        numpy_helper.from_array(np.float32(0.07), "s_out"),
        numpy_helper.from_array(np.uint8(128), "z_out"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q"),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq"),
    ]
    if quantized_weight:
        inits += [
            numpy_helper.from_array(rng.integers(-127, 128, size=(8, 16)).astype(np.int8), "w_codes"),
            numpy_helper.from_array(np.float32(0.01), "w_scale"),
            numpy_helper.from_array(np.int8(0), "w_zero"),
        ]
        nodes.append(helper.make_node("DequantizeLinear", ["w_codes", "w_scale", "w_zero"], ["w"], name="w_dq"))
    else:
        inits.append(numpy_helper.from_array(rng.normal(size=(8, 16)).astype(np.float32), "w"))
    nodes.append(helper.make_node("Gemm", ["xd", "w", "b"], ["g" if requantized else "y"], name="gemm", transB=1))
    if requantized:
        nodes += [
            helper.make_node("QuantizeLinear", ["g", "s_out", "z_out"], ["gq"], name="g_q"),
            helper.make_node("DequantizeLinear", ["gq", "s_out", "z_out"], ["y"], name="g_dq"),
        ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _default_minus_written(model: onnx.ModelProto, x: np.ndarray) -> float:
    return float(np.abs(ort_run(model, x, "all")[0] - ort_run(model, x)[0]).max())


@pytest.mark.parametrize("quantized_weight", [False, True], ids=["float weight", "quantized weight"])
def test_a_requantized_layer_runs_as_written_only_after_finishing(quantized_weight: bool) -> None:
    model = _gemm(quantized_weight=quantized_weight, requantized=True)
    # Enough rows that a re-quantized bias (off by up to half a 5e-4 step) moves some output code.
    x = np.random.default_rng(1).normal(size=(1024, 16)).astype(np.float32)
    assert _default_minus_written(model, x) > 0  # onnxruntime re-quantizes the float bias (and weight)
    finished = finish_for_onnxruntime(model).model
    assert _default_minus_written(finished, x) == 0
    np.testing.assert_array_equal(ort_run(finished, x)[0], ort_run(model, x)[0])


@pytest.mark.parametrize("quantized_weight", [False, True], ids=["float weight", "quantized weight"])
def test_a_float_head_runs_as_written_and_keeps_its_float_bias(quantized_weight: bool) -> None:
    model = _gemm(quantized_weight=quantized_weight, requantized=False)
    x = np.random.default_rng(2).normal(size=(4, 16)).astype(np.float32)
    assert _default_minus_written(model, x) == 0  # no QuantizeLinear after it: not a unit onnxruntime completes
    finished = finish_for_onnxruntime(model).model
    gemm = next(n for n in finished.graph.node if n.op_type == "Gemm")
    assert gemm.input[2] == "b"
