"""Each op the profiles gained, on a single-op model: quantized by quant_onnx (xint8),
legalised, then simulated and compared with onnxruntime on the same QDQ model. With onnx
rounding (half-to-even, as onnxruntime's QuantizeLinear) the integer kernels give the
same codes; with the device's half-up rounding they stay within one output step, except
where the device approximates (HardSwish's int8 hardsigmoid)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from builders import GraphBuilder, ort_run, quantize, random_inputs

from quant_npu.legalize import legalize_model
from quant_npu.sim import simulate


def _build(op: str, shape: list[int], opset: int = 13, **attrs: object):
    def build() -> onnx.ModelProto:
        b = GraphBuilder(3, opset=opset)
        x = b.input("x", ["N", *shape])
        if op == "ConvTranspose":
            group = int(attrs.get("group", 1))
            w = b.const((b.rng.normal(size=(shape[0], 6 // group, 3, 3)) * 0.3).astype(np.float32), "w")
            bias = b.const((b.rng.normal(size=6) * 0.1).astype(np.float32), "b")
            y = b.node("ConvTranspose", [x, w, bias], kernel_shape=[3, 3], **attrs)
        elif op == "PRelu":
            slope = b.const((b.rng.uniform(0.05, 0.4, size=(shape[0], 1, 1))).astype(np.float32), "slope")
            y = b.node("PRelu", [x, slope])
        elif op == "Resize":
            scales = b.const(np.array([1, 1, 2, 2], np.float32), "scales")
            y = b.node("Resize", [x, "", scales], **attrs)
        else:
            y = b.node(op, [x], **attrs)
        return b.model([y], rank=len(shape) + 1)

    return build


SINGLE_OPS = {
    "HardSigmoid": _build("HardSigmoid", [4, 6, 6], alpha=1 / 6, beta=0.5),
    "Sigmoid": _build("Sigmoid", [4, 6, 6]),
    "Tanh": _build("Tanh", [4, 6, 6]),
    "ConvTranspose s2": _build("ConvTranspose", [4, 5, 5], strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 1]),
    "ConvTranspose s2 group": _build("ConvTranspose", [4, 5, 5], strides=[2, 2], pads=[1, 1, 1, 1], group=2),
    "ConvTranspose s1": _build("ConvTranspose", [4, 5, 5], pads=[1, 1, 1, 1]),
    "Resize nearest": _build("Resize", [4, 5, 5], mode="nearest"),
    "Resize linear half_pixel": _build("Resize", [4, 5, 5], mode="linear"),
    "Resize linear align_corners": _build(
        "Resize", [4, 5, 5], mode="linear", coordinate_transformation_mode="align_corners"
    ),
    "Resize linear asymmetric": _build("Resize", [4, 5, 5], mode="linear", coordinate_transformation_mode="asymmetric"),
    "DepthToSpace DCR": _build("DepthToSpace", [8, 3, 3], blocksize=2),
    "DepthToSpace CRD": _build("DepthToSpace", [8, 3, 3], blocksize=2, mode="CRD"),
    "SpaceToDepth": _build("SpaceToDepth", [2, 4, 4], blocksize=2),
    "PRelu": _build("PRelu", [4, 5, 5]),
}
APPROXIMATED = {"Resize linear align_corners"}
"""5 -> 10 rows at align_corners: weights k/9, which the device holds on a 2**-8 grid."""


def _legal(name: str) -> tuple[onnx.ModelProto, str]:
    target = "dpu" if name == "PRelu" else "xint8"
    model = quantize(SINGLE_OPS[name](), "xint8", n=128)
    result = legalize_model(model, target)
    assert result.remaining.ok, result.remaining.format_text()
    return result.model, target


def _steps(model: onnx.ModelProto, got: np.ndarray, expected: np.ndarray) -> np.ndarray:
    dq = next(n for n in model.graph.node if n.output[0] == model.graph.output[0].name)
    scale = float(onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == dq.input[1])))
    return np.abs(got.astype(np.float64) - expected) / scale


@pytest.mark.parametrize("name", list(SINGLE_OPS))
def test_single_op_matches_onnxruntime(name: str) -> None:
    model, target = _legal(name)
    x = random_inputs(SINGLE_OPS[name](), 32, seed=4) * 2.0
    (expected,) = ort_run(model, x)
    (got,) = simulate(model, x, target, rounding="onnx", quiet=True).values()
    assert got.shape == expected.shape
    steps = _steps(model, got, expected)
    if name in ("Sigmoid", "Tanh"):  # a table of the float function: onnxruntime's float32 may tie-break apart
        assert np.mean(steps == 0) > 0.999 and steps.max() <= 1
    elif name in APPROXIMATED:
        assert np.mean(steps == 0) > 0.8 and steps.max() <= 1
    else:
        np.testing.assert_array_equal(got, expected)
    (device,) = simulate(model, x, target, rounding="device", quiet=True).values()
    assert _steps(model, device, expected).max() <= 1


def test_hard_swish_in_the_device_form_is_exact() -> None:
    """The device rounds the inner hardsigmoid to int8 at 2**-7 (Vitis AI's hardswish);
    onnxruntime's HardSwish does not: within one step as it is, the same codes once
    ``legalize`` writes it as ``x * HardSigmoid(x)`` with that rounding (``hard_swish``)."""
    from quant_npu.profile import NPUProfile

    build = _build("HardSwish", [4, 6, 6], opset=14)
    quantized_model = quantize(build(), "xint8", n=128)
    x = random_inputs(build(), 32, seed=4) * 2.0
    as_is = NPUProfile(name="as_is", conversions=("hard_sigmoid",))
    for target, exact in ((as_is, False), (NPUProfile(), True)):
        model = legalize_model(quantized_model, target).model
        assert ("HardSwish" in [n.op_type for n in model.graph.node]) != exact
        (expected,) = ort_run(model, x)
        (got,) = simulate(model, x, target, rounding="onnx", quiet=True).values()
        steps = _steps(model, got, expected)
        assert steps.max() <= (0 if exact else 1) and np.mean(steps == 0) > 0.8


def test_hard_sigmoid_legalised_to_the_device_constants_is_exact() -> None:
    model, _ = _legal("HardSigmoid")
    node = next(n for n in model.graph.node if n.op_type == "HardSigmoid")
    attrs = {a.name: a.f for a in node.attribute}
    assert attrs == {"alpha": pytest.approx(2731 / 16384, abs=0), "beta": pytest.approx(8193 / 16384, abs=0)}


def test_prelu_slope_is_quantized_for_the_dpu() -> None:
    result = legalize_model(quantize(SINGLE_OPS["PRelu"](), "xint8"), "dpu")
    assert any(c.reason == "PRelu slope format" for c in result.changes)
    node = next(n for n in result.model.graph.node if n.op_type == "PRelu")
    producer = next(n for n in result.model.graph.node if node.input[1] in n.output)
    assert producer.op_type == "DequantizeLinear"
    assert not legalize_model(quantize(SINGLE_OPS["PRelu"](), "xint8")).remaining.ok  # xint8: no PRelu


def test_prelu_slope_codes_stay_in_the_profiles_weight_range() -> None:
    """A slope is checked as a weight: on a profile with Quark's [-127, 127] weights, the
    covering position's -128 for the most negative slope saturates to -127 (and says so)."""
    import attrs

    from quant_npu.check import check
    from quant_npu.profile import get_profile

    profile = attrs.evolve(get_profile("xint8"), ops=get_profile("xint8").ops | {"PRelu"})
    b = GraphBuilder(3)
    x = b.input("x", ["N", 2, 5, 5])
    y = b.node("PRelu", [x, b.const(np.array([-0.5, 0.3], np.float32).reshape(2, 1, 1), "slope")])
    result = legalize_model(quantize(b.model([y], rank=4), "xint8"), profile)
    (change,) = [c for c in result.changes if c.reason.startswith("PRelu slope format")]
    assert (change.after, change.reason) == ("int8@8", "PRelu slope format; 1 code(s) saturated")
    assert check(result.model, profile).ok
