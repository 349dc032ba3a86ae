"""Activation equalization on ONNX graphs: the float function kept, the channels evened
out where the formats make it free, and the quantized model closer to float."""

from __future__ import annotations

import numpy as np
import onnx
from algorithms_models import make_model, run
from onnx import TensorProto, helper, numpy_helper

from quant_core import get_preset
from quant_core.algorithm_config import ActivationEqualizationConfig
from quant_core.qparams import sqnr_db
from quant_onnx import quantize
from quant_onnx.algorithms.activation_equalization import apply_activation_equalization_with_report
from quant_onnx.algorithms.capture import TensorCapture

RNG = np.random.default_rng(3)
# Output channel ranges thousands of times apart, as a BN-folded Conv writes them.
SPREAD = np.array([8.0, 0.01, 1.0, 0.003], np.float32)
AE = ActivationEqualizationConfig()


def _init(name: str, value: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, np.float32), name)


def _hardswish(x: str, out: str, tag: str) -> list[onnx.NodeProto]:
    """``x * Clip(x + 3, 0, 6) / 6`` as PaddleOCR's exporter writes it."""
    return [
        helper.make_node("Add", [x, "three"], [f"{tag}_p"], name=f"{tag}_add"),
        helper.make_node("Clip", [f"{tag}_p", "zero", "six"], [f"{tag}_c"], name=f"{tag}_clip"),
        helper.make_node("Mul", [x, f"{tag}_c"], [f"{tag}_m"], name=f"{tag}_mul"),
        helper.make_node("Div", [f"{tag}_m", "six"], [out], name=f"{tag}_div"),
    ]


def recogniser_block() -> tuple[onnx.ModelProto, list[dict]]:
    """Conv (disparate output channels) -> HardSwish -> depthwise Conv -> HardSwish ->
    1x1 Conv, and a stem Conv read by a depthwise Conv directly."""
    stem = RNG.normal(size=(4, 3, 3, 3)) * SPREAD[:, None, None, None]
    dw0 = RNG.normal(size=(4, 1, 3, 3))
    w1 = RNG.normal(size=(4, 4, 1, 1)) * SPREAD[:, None, None, None]
    dw1 = RNG.normal(size=(4, 1, 3, 3))
    w2 = RNG.normal(size=(5, 4, 1, 1))
    inits = [
        _init("stem", stem),
        _init("stem_b", RNG.normal(size=4) * SPREAD),
        _init("dw0", dw0),
        _init("dw0_b", np.zeros(4)),
        _init("w1", w1),
        _init("b1", RNG.normal(size=4) * SPREAD),
        _init("dw1", dw1),
        _init("dw1_b", RNG.normal(size=4)),
        _init("w2", w2),
        _init("b2", np.zeros(5)),
        _init("three", np.float32(3.0)),
        _init("zero", np.float32(0.0)),
        _init("six", np.float32(6.0)),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "stem", "stem_b"], ["s"], name="stem", pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["s", "dw0", "dw0_b"], ["d0"], name="dw0", group=4, pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["d0", "w1", "b1"], ["y1"], name="pw1"),
        *_hardswish("y1", "h1", "hs1"),
        helper.make_node("Conv", ["h1", "dw1", "dw1_b"], ["d1"], name="dw1", group=4, pads=[1, 1, 1, 1]),
        *_hardswish("d1", "h2", "hs2"),
        helper.make_node("Conv", ["h2", "w2", "b2"], ["y"], name="pw2"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 12, 12])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5, 12, 12])
    batches = [{"x": RNG.normal(size=(8, 3, 12, 12)).astype(np.float32)} for _ in range(4)]
    return make_model(nodes, [x], [y], inits), batches


def _channel_ranges(model: onnx.ModelProto, tensor: str, batches: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    values = TensorCapture(model, [tensor]).collect(batches)[tensor]
    return values.min(axis=(0, 2, 3)), values.max(axis=(0, 2, 3))


def test_float_function_kept_and_channels_evened_out() -> None:
    model, batches = recogniser_block()
    before = model.SerializeToString()
    out, report = apply_activation_equalization_with_report(model, batches, AE, get_preset("a8w8"))
    assert model.SerializeToString() == before  # the input model is not edited
    sites = {(e["side"], e["tensor"]): e for e in report.to_dict()["equalized"]}
    # The stem's output (read by a depthwise Conv) folds into the stem; the 1x1 Conv's and
    # the depthwise Conv's outputs start HardSwish chains; the chain end feeds a depthwise.
    assert set(sites) == {("input", "s"), ("output", "y1"), ("input", "h1"), ("output", "d1")}
    assert sites[("input", "s")]["compensated"] == "into:stem"
    assert sites[("input", "h1")]["compensated"] == "mul"
    assert sites[("output", "y1")]["spread"] > 100
    np.testing.assert_allclose(run(out, batches), run(model, batches), rtol=1e-4, atol=1e-4)
    # The quantized tensors are evened out: a depthwise input's channels all reach the
    # largest max |x|; a Conv output's each reach one end of the tensor's own range.
    for tensor in ("s", "h1_equalized"):
        low, high = _channel_ranges(out, tensor, batches)
        reach = np.maximum(np.abs(low), np.abs(high))
        np.testing.assert_allclose(reach, reach.max(), rtol=1e-4)
    for tensor in ("y1", "d1"):
        assert sites[("output", tensor)]["compensated"] == "mul"
        low, high = _channel_ranges(out, tensor, batches)
        assert np.all(np.isclose(high, high.max(), rtol=1e-4) | np.isclose(low, low.min(), rtol=1e-4))


def test_a8w8_closer_to_float_with_equalization(tmp_path) -> None:
    model, batches = recogniser_block()
    reference = run(model, batches)
    scores = {}
    for label, config in {
        "plain": get_preset("a8w8").evolve(algorithms=()),
        "equalized": get_preset("a8w8"),  # the preset runs it
    }.items():
        path = tmp_path / f"{label}.onnx"
        quantize(model, str(path), config, batches, quiet=True)
        scores[label] = sqnr_db(reference, run(onnx.load(str(path)), batches))
    # 19.1 -> 21.1 dB: the output mixes the small channels in at their own size, so only
    # part of what they gain shows here (PP-OCRv3: 2.1 -> 18.5 dB).
    assert scores["equalized"] > scores["plain"] + 1.5, scores


def test_formats_where_a_scale_costs_precision_are_left_alone() -> None:
    model, batches = recogniser_block()
    for preset in ("xint8", "a8w8_per_tensor"):
        out, report = apply_activation_equalization_with_report(model, batches, AE, get_preset(preset))
        assert report.equalized == ()
        assert any("left alone" in note for note in report.notes), report.notes
        assert out.graph.node == model.graph.node


def test_without_the_transformer_recipe_only_conv_producers_take_the_scale() -> None:
    # No activation chains are recognised: only the stem -> depthwise pair is free.
    model, batches = recogniser_block()
    config = get_preset("a8w8").evolve(transformer_recipe=False)
    _, report = apply_activation_equalization_with_report(model, batches, AE, config)
    assert [(e.side, e.tensor) for e in report.equalized] == [("input", "s")]


def test_same_inputs_give_identical_files(tmp_path) -> None:
    model, batches = recogniser_block()
    config = get_preset("a8w8")
    files = []
    for i in range(2):
        path = tmp_path / f"m{i}.onnx"
        quantize(model, str(path), config, batches, quiet=True)
        files.append(path.read_bytes())
    assert files[0] == files[1]


def test_one_dimensional_convolutions_keep_their_function() -> None:
    # The inserted scales take the activation's rank (here [N, C, L]).
    inits = [
        _init("w", RNG.normal(size=(4, 2, 3)) * SPREAD[:, None, None]),
        _init("dw", RNG.normal(size=(4, 1, 3))),
        _init("three", np.float32(3.0)),
        _init("zero", np.float32(0.0)),
        _init("six", np.float32(6.0)),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1]),
        *_hardswish("c", "h", "hs"),
        helper.make_node("Conv", ["h", "dw"], ["y"], name="dw", group=4, pads=[1, 1]),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 16])
    model = make_model(nodes, [x], [y], inits)
    batches = [{"x": RNG.normal(size=(8, 2, 16)).astype(np.float32)} for _ in range(2)]
    out, report = apply_activation_equalization_with_report(model, batches, AE, get_preset("a8w8"))
    assert {e.side for e in report.equalized} == {"input", "output"}
    np.testing.assert_allclose(run(out, batches), run(model, batches), rtol=1e-4, atol=1e-4)
