"""The NPU conversions as ONNX graph edits: each result computes the rule's function
(checked against numpy with onnxruntime), ConvTranspose's rewrite is exact, and a config
with ``npu_conversions`` calibrates the converted graph."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import make_model, op_types, random_feeds, run_ort, tensor, vi, weight
from onnx import helper

import quant_onnx
from quant_core.conversions import device_hard_sigmoid
from quant_core.presets import get_preset
from quant_onnx.pipeline.preprocess import PreprocessOptions, apply_npu_conversions, preprocess_with_report


def _unary(op: str, **attrs: object) -> onnx.ModelProto:
    node = helper.make_node(op, ["x"], ["y"], name="act", **attrs)
    return make_model(
        [node], [vi("x", ["N", 64])], [vi("y", ["N", 64])], opset={"Gelu": 20, "HardSwish": 14}.get(op, 13)
    )


def _silu() -> onnx.ModelProto:
    nodes = [
        helper.make_node("Sigmoid", ["x"], ["g"], name="sig"),
        helper.make_node("Mul", ["g", "x"], ["y"], name="m"),
    ]
    return make_model(nodes, [vi("x", ["N", 64])], [vi("y", ["N", 64])])


X = np.linspace(-8, 8, 64 * 3, dtype=np.float32).reshape(3, 64)
CASES = [
    ("silu", _silu, lambda x: x * device_hard_sigmoid(x)),
    ("sigmoid", lambda: _unary("Sigmoid"), device_hard_sigmoid),
    ("hard_sigmoid", lambda: _unary("HardSigmoid", alpha=1 / 6, beta=0.5), device_hard_sigmoid),
    ("hard_swish", lambda: _unary("HardSwish"), lambda x: x * device_hard_sigmoid(x)),
    ("tanh", lambda: _unary("Tanh"), lambda x: np.clip(x * np.float32(2 / 3), -1, 1)),
    ("gelu", lambda: _unary("Gelu"), lambda x: x * device_hard_sigmoid(x * np.float32(1.702))),
]


@pytest.mark.parametrize(("rule", "build", "function"), CASES, ids=[c[0] for c in CASES])
def test_each_rule_computes_its_function(rule, build, function) -> None:
    model = build()
    converted = apply_npu_conversions(model, (rule,))
    onnx.checker.check_model(converted)
    assert model.graph.SerializeToString() != converted.graph.SerializeToString()
    (got,) = run_ort(converted, {"x": X})
    np.testing.assert_allclose(got, function(X.astype(np.float64)), atol=2e-6)
    assert "Sigmoid" not in op_types(converted) and "Tanh" not in op_types(converted)


@pytest.mark.parametrize("build", [_silu, lambda: _unary("Sigmoid")], ids=["silu", "sigmoid"])
def test_sigmoid_tanh_computes_the_sigmoid(build) -> None:
    """``sigmoid_tanh``: every Sigmoid (SiLU's too) becomes ``0.5 * Tanh(0.5 x) + 0.5``, the
    same function as onnxruntime's own Sigmoid up to float32 rounding."""
    model = build()
    converted = apply_npu_conversions(model, ("sigmoid_tanh",))
    onnx.checker.check_model(converted)
    assert "Sigmoid" not in op_types(converted) and op_types(converted).count("Tanh") == 1
    (expected,), (got,) = run_ort(model, {"x": X}), run_ort(converted, {"x": X})
    np.testing.assert_allclose(got, expected, atol=1e-6)


def test_rules_not_asked_for_change_nothing() -> None:
    model = _silu()
    assert op_types(apply_npu_conversions(model, ("sigmoid", "tanh"))) == op_types(model)  # SiLU is not "sigmoid"
    assert op_types(apply_npu_conversions(_unary("HardSigmoid", alpha=0.2, beta=0.5), ("hard_sigmoid",))) == [
        "HardSigmoid"
    ]


def _conv_transpose(**attrs: object) -> onnx.ModelProto:
    group = int(attrs.get("group", 1))
    inits = [weight("w", [4, 6 // group, 3, 3]), weight("b", [6], seed=2)]
    node = helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], name="up", **attrs)
    return make_model([node], [vi("x", ["N", 4, 5, 7])], [vi("y", ["N", 6, "Ho", "Wo"])], inits)


@pytest.mark.parametrize(
    "attrs",
    [
        {"strides": [2, 2]},
        {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]},
        {"strides": [2, 3], "pads": [3, 0, 2, 3], "dilations": [1, 2]},
        {"strides": [2, 2], "group": 2, "pads": [0, 1, 1, 0]},
    ],
)
def test_conv_transpose_rewrite_is_exact(attrs: dict) -> None:
    model = _conv_transpose(**attrs)
    converted = apply_npu_conversions(model, ("conv_transpose",))
    assert "ConvTranspose" not in op_types(converted) and op_types(converted)[-1] == "Conv"
    feeds = random_feeds(model, batch=2)
    (expected,), (got,) = run_ort(model, feeds), run_ort(converted, feeds)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_conv_transpose_of_unknown_size_is_left_with_a_note(caplog: pytest.LogCaptureFixture) -> None:
    inits = [weight("w", [4, 6, 2, 2])]
    node = helper.make_node("ConvTranspose", ["x", "w"], ["y"], name="up", strides=[2, 2])
    model = make_model([node], [vi("x", ["N", 4, "H", "W"])], [vi("y", ["N", 6, "Ho", "Wo"])], inits)
    assert op_types(apply_npu_conversions(model, ("conv_transpose",))) == ["ConvTranspose"]
    assert "spatial size unknown" in caplog.text


def test_preprocess_reports_and_the_quantizer_calibrates_the_converted_graph() -> None:
    inits = [weight("w", [8, 3, 3, 3]), tensor("b", np.zeros(8, np.float32))]
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Sigmoid", ["c"], ["g"], name="sig"),
        helper.make_node("Mul", ["c", "g"], ["y"], name="silu"),
    ]
    model = make_model(nodes, [vi("x", ["N", 3, 8, 8])], [vi("y", ["N", 8, 8, 8])], inits)
    result = preprocess_with_report(model, PreprocessOptions(npu_conversions=("silu",)))
    assert result.changes["npu_conversions"] == 1
    with pytest.raises(ValueError, match="npu_conversions: 'swish' is not allowed"):
        PreprocessOptions(npu_conversions=("swish",))
    config = get_preset("xint8").evolve(npu_conversions=("silu",))
    data = np.random.default_rng(0).normal(size=(16, 3, 8, 8)).astype(np.float32)
    quantized = quant_onnx.quantize(model, None, config, data, quiet=True).model
    assert "HardSigmoid" in op_types(quantized) and "Sigmoid" not in op_types(quantized)
    plain = quant_onnx.quantize(model, None, "xint8", data, quiet=True).model
    assert "Sigmoid" in op_types(plain)


def _erf_gelu(halve_first: bool) -> onnx.ModelProto:
    inits = [tensor(n, np.array(v, np.float32)) for n, v in (("sqrt2", 2**0.5), ("one", 1.0), ("half", 0.5))]
    nodes = [
        helper.make_node("Div", ["x", "sqrt2"], ["d"], name="div"),
        helper.make_node("Erf", ["d"], ["e"], name="erf"),
        helper.make_node("Add", ["e", "one"], ["a"], name="add"),
    ]
    if halve_first:
        nodes += [helper.make_node("Mul", ["x", "half"], ["h"], name="half_x"),
                  helper.make_node("Mul", ["h", "a"], ["y"], name="gelu")]  # fmt: skip
    else:
        nodes += [helper.make_node("Mul", ["x", "a"], ["p"], name="xa"),
                  helper.make_node("Mul", ["p", "half"], ["y"], name="gelu")]  # fmt: skip
    return make_model(nodes, [vi("x", ["N", 64])], [vi("y", ["N", 64])], inits)


@pytest.mark.parametrize("halve_first", [False, True])
def test_gelu_in_its_erf_form(halve_first: bool) -> None:
    model = _erf_gelu(halve_first)
    (float_gelu,) = run_ort(model, {"x": X})
    converted = apply_npu_conversions(model, ("gelu",))
    assert op_types(converted) == ["Mul", "HardSigmoid", "Mul"]
    (got,) = run_ort(converted, {"x": X})
    np.testing.assert_allclose(got, X * device_hard_sigmoid(X.astype(np.float64) * np.float32(1.702)), atol=2e-6)
    assert np.abs(got - float_gelu).max() < 0.07  # the approximation's largest error


def test_split_becomes_slices() -> None:
    sizes = tensor("sizes", np.array([3, 5], np.int64))
    nodes = [
        helper.make_node("Split", ["x", "sizes"], ["a", "b"], name="split", axis=1),
        helper.make_node("Concat", ["b", "a"], ["y"], name="cat", axis=1),
    ]
    model = make_model(nodes, [vi("x", ["N", 8, 4])], [vi("y", ["N", 8, 4])], [sizes])
    converted = apply_npu_conversions(model, ("split",))
    assert op_types(converted) == ["Slice", "Slice", "Concat"]
    feeds = random_feeds(model)
    np.testing.assert_array_equal(run_ort(converted, feeds)[0], run_ort(model, feeds)[0])


@pytest.mark.parametrize("length", [8, 7, 5])
def test_split_by_num_outputs_becomes_slices(length: int) -> None:
    """Opset 18's ``num_outputs``: chunks of ``ceil(length / n)``, the last one smaller."""
    nodes = [
        helper.make_node("Split", ["x"], ["a", "b", "c"], name="split", axis=1, num_outputs=3),
        helper.make_node("Concat", ["c", "a", "b"], ["y"], name="cat", axis=1),
    ]
    model = make_model(nodes, [vi("x", ["N", length, 4])], [vi("y", ["N", length, 4])], opset=18)
    converted = apply_npu_conversions(model, ("split",))
    assert op_types(converted) == ["Slice", "Slice", "Slice", "Concat"]
    feeds = random_feeds(model)
    np.testing.assert_array_equal(run_ort(converted, feeds)[0], run_ort(model, feeds)[0])


@pytest.mark.parametrize("keepdims", [1, 0])
def test_spatial_mean_becomes_a_global_pool(keepdims: int) -> None:
    node = helper.make_node("ReduceMean", ["x"], ["y"], name="mean", axes=[2, 3], keepdims=keepdims)
    out = ["N", 4, 1, 1] if keepdims else ["N", 4]
    model = make_model([node], [vi("x", ["N", 4, 5, 5])], [vi("y", out)])
    converted = apply_npu_conversions(model, ("reduce_mean",))
    if not keepdims:  # the pool keeps the axes: not the same shape, left as it is
        assert op_types(converted) == ["ReduceMean"]
        return
    assert op_types(converted) == ["GlobalAveragePool"]
    feeds = random_feeds(model)
    np.testing.assert_allclose(run_ort(converted, feeds)[0], run_ort(model, feeds)[0], atol=1e-6)


def test_large_global_pool_becomes_two_stages() -> None:
    node = helper.make_node("GlobalAveragePool", ["x"], ["y"], name="gap")
    model = make_model([node], [vi("x", ["N", 4, 32, 24])], [vi("y", ["N", 4, 1, 1])])
    converted = apply_npu_conversions(model, ("global_pool",))
    assert op_types(converted) == ["AveragePool", "GlobalAveragePool"]  # 32x24 = 768 > 512: 4x4, then 8x6
    feeds = random_feeds(model)
    np.testing.assert_allclose(run_ort(converted, feeds)[0], run_ort(model, feeds)[0], atol=1e-6)
    small = make_model([node], [vi("x", ["N", 4, 16, 16])], [vi("y", ["N", 4, 1, 1])])
    assert op_types(apply_npu_conversions(small, ("global_pool",))) == ["GlobalAveragePool"]


def test_a_large_spatial_mean_becomes_two_stages_with_global_pool() -> None:
    """The pool ``reduce_mean`` makes is split by ``global_pool`` too (only where that rule is in force)."""
    node = helper.make_node("ReduceMean", ["x"], ["y"], name="mean", axes=[2, 3], keepdims=1)
    model = make_model([node], [vi("x", ["N", 4, 32, 24])], [vi("y", ["N", 4, 1, 1])])
    assert op_types(apply_npu_conversions(model, ("reduce_mean",))) == ["GlobalAveragePool"]
    converted = apply_npu_conversions(model, ("reduce_mean", "global_pool"))
    assert op_types(converted) == ["AveragePool", "GlobalAveragePool"]
    feeds = random_feeds(model)
    np.testing.assert_allclose(run_ort(converted, feeds)[0], run_ort(model, feeds)[0], atol=1e-6)
