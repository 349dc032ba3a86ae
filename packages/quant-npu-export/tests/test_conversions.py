"""legalize's conversions on calibrated QDQ models: what the target cannot run is
converted with quant_core's rules, the cost is measured when data is given, nodes kept on
the CPU make named partitions instead, and the simulator agrees with onnxruntime."""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
import pytest
from builders import GraphBuilder, QDQWriter, ort_run, quantize, random_inputs

from quant_core.presets import get_preset
from quant_npu import check, legalize_model
from quant_npu.cli import main
from quant_npu.conversions import convert_for_target
from quant_npu.profile import NPUProfile
from quant_npu.sim import simulate


def detector(seed: int = 0) -> onnx.ModelProto:
    """A YOLO-style SiLU body, a MobileNetV3 squeeze-excite gate, a ConvTranspose + linear
    Resize decoder and a Sigmoid head: ``x`` [N, 3, 16, 16] -> [N, 2, 32, 32]."""
    b = GraphBuilder(seed)
    x = b.input("x", ["N", 3, 16, 16])
    c = b.conv(x, 3, 8)
    s = b.node("Mul", [c, b.node("Sigmoid", [c])], name="silu1")
    c2 = b.conv(s, 8, 8, strides=[2, 2])
    s2 = b.node("Mul", [b.node("Sigmoid", [c2]), c2], name="silu2")
    squeeze = b.node("Relu", [b.conv(b.node("GlobalAveragePool", [s2]), 8, 4, k=1)])
    gate = b.node("HardSigmoid", [b.conv(squeeze, 4, 8, k=1)], alpha=1 / 6, beta=0.5)
    se = b.node("Mul", [s2, gate])
    w = b.const((b.rng.normal(size=(8, 4, 2, 2)) * 0.3).astype(np.float32), "w")
    up = b.node("Relu", [b.node("ConvTranspose", [se, w], strides=[2, 2], kernel_shape=[2, 2])])
    scales = b.const(np.array([1, 1, 2, 2], np.float32), "scales")
    r = b.node("Resize", [b.conv(up, 4, 2, k=1), "", scales], mode="linear")
    return b.model([b.node("Sigmoid", [r], name="head")], rank=4)


@pytest.fixture(scope="module")
def quantized() -> onnx.ModelProto:
    return quantize(detector(), "xint8", n=64)


def test_check_says_what_legalize_converts(quantized: onnx.ModelProto) -> None:
    result = check(quantized)
    sigmoids = [v for v in result.violations if v.op_type == "Sigmoid"]
    assert len(sigmoids) == 3 and all(v.fixable and "legalize converts it" in v.message for v in sigmoids)
    assert {"silu", "sigmoid"} == {v.message.split("(")[1].split(":")[0] for v in sigmoids}


def test_legalize_converts_and_the_simulator_agrees(quantized: onnx.ModelProto) -> None:
    result = legalize_model(quantized)
    assert result.remaining.ok, result.remaining.format_text()
    converted = [c for c in result.changes if c.kind == "conversion"]
    assert sorted(c.before for c in converted) == ["HardSigmoid", "Sigmoid", "Sigmoid", "Sigmoid"]
    ops = [n.op_type for n in result.model.graph.node]
    assert "Sigmoid" not in ops and ops.count("HardSigmoid") == 4
    x = random_inputs(detector(), 48, seed=7)
    (expected,) = ort_run(result.model, x)
    (got,) = simulate(result.model, x, rounding="onnx", quiet=True).values()
    np.testing.assert_array_equal(got, expected)  # device constants in the QDQ model: the same integers
    (device,) = simulate(result.model, x, quiet=True).values()
    assert np.mean(np.abs(device - expected) <= 2.0**-7 + 1e-9) > 0.9  # half-up ties, one step each


def test_costs_are_measured_with_data(quantized: onnx.ModelProto) -> None:
    x = random_inputs(detector(), 32, seed=8)
    result = legalize_model(quantized, data=x)
    assert set(result.costs) == {"silu", "sigmoid", "hard_sigmoid", "all"}
    assert all(np.isfinite(v) for v in result.costs.values())
    assert result.costs["hard_sigmoid"] > 30  # the device's 1/6 moves a few codes only
    assert "cost: conversion silu: output SQNR" in result.format_text()
    assert json.dumps(result.to_dict())  # finite numbers, plain JSON


def test_costs_without_onnxruntime_name_the_extra(quantized: onnx.ModelProto, monkeypatch) -> None:
    """quant-npu-export does not install onnxruntime: converting works without it, measuring
    costs says what to install."""
    import sys

    from quant_core.errors import MissingDependencyError

    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime -> ImportError
    assert legalize_model(quantized).changes
    with pytest.raises(MissingDependencyError, match=r"quant-npu-export\[costs\]"):
        legalize_model(quantized, data=random_inputs(detector(), 2, seed=8))


def test_cpu_flag_keeps_the_float_op_and_names_the_partitions(quantized: onnx.ModelProto) -> None:
    result = legalize_model(quantized, cpu="Sigmoid")
    assert result.remaining.ok
    assert not [c for c in result.changes if c.before == "Sigmoid"]
    assert [n.op_type for n in result.model.graph.node].count("Sigmoid") == 3
    partitions = result.remaining.partitions
    assert sorted(len(p.nodes) for p in partitions) == [1, 1, 1]
    head = next(p for p in partitions if p.nodes == ("head",))
    assert head.inputs and head.outputs and "CPU partition: head (Sigmoid)" in head.line
    assert "3 CPU partition(s)" in result.format_text()
    assert not check(result.model).ok and check(result.model, cpu="Sigmoid").ok
    x = random_inputs(detector(), 16, seed=9)
    (expected,) = ort_run(result.model, x)
    (got,) = simulate(result.model, x, rounding="onnx", quiet=True, cpu="Sigmoid").values()
    assert np.mean(np.abs(got - expected) <= 2.0**-7 + 1e-9) > 0.99


def test_cpu_output_selector_keeps_only_the_head(quantized: onnx.ModelProto) -> None:
    result = legalize_model(quantized, cpu="Sigmoid@output")
    assert result.remaining.ok
    assert [p.nodes for p in result.remaining.partitions] == [("head",)]
    assert sorted(c.target for c in result.changes if c.before == "Sigmoid") == ["sigmoid4", "sigmoid8"]


def test_conv_transpose_beyond_the_engine_becomes_a_conv(quantized: onnx.ModelProto) -> None:
    narrow = NPUProfile(name="narrow", conv_transpose_stride_range=(1, 1))
    assert any("transposed conv stride [2, 2]" in v.message and v.fixable for v in check(quantized, narrow).violations)
    converted = convert_for_target(quantized, narrow, rules=("conv_transpose",))
    ops = [n.op_type for n in converted.model.graph.node]
    assert "ConvTranspose" not in ops and {"Unsqueeze", "Pad", "Reshape"} <= set(ops)
    x = random_inputs(detector(), 16, seed=10)
    (before,), (after,) = ort_run(quantized, x), ort_run(converted.model, x)
    assert np.mean(before == after) > 0.999  # exact integers; float accumulation order aside
    result = legalize_model(quantized, narrow)
    assert result.remaining.ok, result.remaining.format_text()


@pytest.mark.parametrize(
    ("rule", "op", "opset"), [("tanh", "Tanh", 13), ("gelu", "Gelu", 20), ("hard_swish", "HardSwish", 14)]
)
def test_approximations_for_targets_without_the_op(rule: str, op: str, opset: int) -> None:
    b = GraphBuilder(1, opset=opset)
    x = b.input("x", ["N", 4, 6, 6])
    model = b.model([b.conv(b.node(op, [b.conv(x, 4, 4)]), 4, 4)], rank=4)
    target = NPUProfile(name="no_" + op.lower(), ops=NPUProfile().ops - {op}, conversions=(rule,))
    quantized_model = quantize(model, "xint8")
    result = legalize_model(quantized_model, target, data=random_inputs(model, 16))
    assert result.remaining.ok, result.remaining.format_text()
    assert op not in [n.op_type for n in result.model.graph.node]
    assert result.costs[rule] > 10
    x = random_inputs(model, 16, seed=3)
    (expected,) = ort_run(result.model, x)
    (got,) = simulate(result.model, x, target, rounding="onnx", quiet=True).values()
    assert np.mean(got == expected) > 0.95


def test_cli_cpu_and_data(tmp_path, quantized: onnx.ModelProto, capsys: pytest.CaptureFixture[str]) -> None:
    source, out, data = tmp_path / "q.onnx", tmp_path / "l.onnx", tmp_path / "x.npy"
    source.write_bytes(quantized.SerializeToString())
    np.save(data, random_inputs(detector(), 8))
    assert main(["legalize", str(source), str(out), "--data", str(data)]) == 0
    assert "cost: conversion silu" in capsys.readouterr().out
    assert main(["legalize", str(source), str(out), "--cpu", "Sigmoid", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["partitions"]) == 3 and report["ok"]
    assert main(["check", str(out), "--cpu", "Sigmoid"]) == 0
    assert "CPU partition: head (Sigmoid)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (
            lambda x: np.concatenate([x, x], axis=1),
            r"data: input 'x' expected shape \[N,3,16,16\] got \[8, 6, 16, 16\]",
        ),
        (lambda x: x[:0], "data: input 'x' has no samples"),
        (lambda x: np.full_like(x, np.nan), "data: input 'x' contains NaN"),
    ],
)
def test_cli_data_is_checked_before_any_conversion_runs(
    tmp_path, quantized: onnx.ModelProto, capsys: pytest.CaptureFixture[str], bad, message: str
) -> None:
    """onnxruntime measures the costs: its error was a traceback (exit 1), and NaN passed it."""
    source, out, data = tmp_path / "q.onnx", tmp_path / "l.onnx", tmp_path / "x.npy"
    source.write_bytes(quantized.SerializeToString())
    np.save(data, bad(random_inputs(detector(), 8)))
    assert main(["legalize", str(source), str(out), "--data", str(data)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(f"^quant-npu: error: {message}$", err.strip())
    assert not out.exists()


def test_split_and_erf_gelu_in_a_qdq_model() -> None:
    """A C2f-style Split and an exporter's erf GELU (as in the YOLO and OCR models)."""
    b = GraphBuilder(2)
    x = b.input("x", ["N", 4, 6, 6])
    c = b.conv(x, 4, 8)
    sizes = b.const(np.array([4, 4], np.int64), "sizes")
    b.nodes.append(onnx.helper.make_node("Split", [c, sizes], ["s0", "s1"], name="split", axis=1))
    sqrt2, one, half = (b.const(np.array(v, np.float32)) for v in (2**0.5, 1.0, 0.5))
    e = b.node("Erf", [b.node("Div", ["s1", sqrt2])])
    gelu = b.node("Mul", [b.node("Mul", ["s1", b.node("Add", [e, one])]), half])
    model = b.model([b.conv(b.node("Concat", ["s0", gelu], axis=1), 8, 4)], rank=4)
    quantized_model = quantize(model, "xint8")
    before = check(quantized_model)
    assert {v.op_type for v in before.violations if v.rule == "unsupported_op"} == {"Split", "Erf"}
    target = NPUProfile(name="with_gelu", conversions=(*NPUProfile().conversions, "gelu"))
    result = legalize_model(quantized_model, target, data=random_inputs(model, 16))
    assert result.remaining.ok, result.remaining.format_text()
    ops = [n.op_type for n in result.model.graph.node]
    assert {"Split", "Erf", "Div"}.isdisjoint(ops) and ops.count("Slice") == 2
    assert result.costs["split"] == np.inf and np.isfinite(result.costs["gelu"])
    xs = random_inputs(model, 16, seed=5)
    (expected,) = ort_run(result.model, xs)
    (got,) = simulate(result.model, xs, target, rounding="onnx", quiet=True).values()
    np.testing.assert_array_equal(got, expected)


def test_sigmoid_tanh_after_calibration_and_before_it(quantized: onnx.ModelProto) -> None:
    """A profile listing ``sigmoid_tanh`` before ``silu``/``sigmoid`` writes every Sigmoid
    as ``0.5 * Tanh(0.5 x) + 0.5``: the halvings are one position finer (exact), the Tanh
    output at position 7; check passes and the simulator's codes equal onnxruntime's. A model
    converted before calibration has nothing left to convert."""
    target = NPUProfile(name="with_tanh", conversions=("sigmoid_tanh", "hard_sigmoid"))
    result = legalize_model(quantized, target)
    assert result.remaining.ok, result.remaining.format_text()
    assert sorted(c.after for c in result.changes if c.kind == "conversion").count("Mul + Tanh + Mul + Add") == 3
    ops = [n.op_type for n in result.model.graph.node]
    assert "Sigmoid" not in ops and ops.count("Tanh") == 3
    x = random_inputs(detector(), 48, seed=7)
    (expected,) = ort_run(result.model, x)
    (got,) = simulate(result.model, x, target, rounding="onnx", quiet=True).values()
    np.testing.assert_array_equal(got, expected)
    before = quantize(detector(), get_preset("xint8").evolve(npu_conversions=("sigmoid_tanh", "hard_sigmoid")), n=64)
    assert "Sigmoid" not in [n.op_type for n in before.graph.node]
    legal = legalize_model(before)
    assert legal.remaining.ok, legal.remaining.format_text()
    assert not [c for c in legal.changes if c.kind == "conversion"]
    (expected,) = ort_run(legal.model, x)
    (got,) = simulate(legal.model, x, rounding="onnx", quiet=True).values()
    np.testing.assert_array_equal(got, expected)


def _boxes_and_scores(transpose: bool) -> onnx.ModelProto:
    """``concat([boxes, sigmoid(scores)])`` (a YOLOv8 head), written out or (``transpose``)
    read by a Transpose as a head that lays its results out does."""
    b = GraphBuilder(4)
    x = b.input("x", ["N", 4, 6, 6])
    h = b.conv(x, 4, 8)
    boxes = b.node("Mul", [b.conv(h, 8, 4, k=1), b.const(np.array(40.0, np.float32))])  # pixels: tens
    scores = b.node("Sigmoid", [b.conv(h, 8, 3, k=1)])
    joined = b.node("Concat", [boxes, scores], axis=1)
    return b.model([b.node("Transpose", [joined], perm=[0, 2, 3, 1]) if transpose else joined], rank=4)


def test_a_hard_sigmoid_concatenated_with_boxes_keeps_its_own_position() -> None:
    """The Concat shares one position, the HardSigmoid needs 2**-7 or finer; a Relu
    requantizes between them."""
    model = _boxes_and_scores(transpose=True)
    quantized_model = quantize(model, "xint8")
    result = legalize_model(quantized_model)
    assert result.remaining.ok, result.remaining.format_text()
    assert [c.kind for c in result.changes].count("requantize") == 1
    xs = random_inputs(model, 32, seed=6)
    (before,), (after,) = ort_run(quantized_model, xs), ort_run(result.model, xs)
    from quant_core.qparams import sqnr_db

    assert sqnr_db(before[..., :4], after[..., :4]) > 30  # boxes keep their position (0.05 dB before the Relu)
    (got,) = simulate(result.model, xs, rounding="onnx", quiet=True).values()
    np.testing.assert_array_equal(got, after)


def test_a_concat_that_only_writes_the_results_runs_on_the_cpu_at_the_end() -> None:
    """The planner leaves a Concat that only writes graph outputs in float (each input keeps
    its own scale): nothing shares a position, so legalize adds no Relu, and the Concat is
    the last CPU partition (named in the notes) without being asked for."""
    quantized_model = quantize(_boxes_and_scores(transpose=False), "xint8")
    result = legalize_model(quantized_model)
    assert [c.kind for c in result.changes].count("requantize") == 0
    assert result.remaining.ok, result.remaining.format_text()
    assert [p.op_types for p in result.remaining.partitions] == [("Concat",)]
    assert any("finish the model's results in float" in note for note in result.notes)
    from quant_core.qparams import sqnr_db

    xs = random_inputs(_boxes_and_scores(transpose=False), 32, seed=6)
    (before,), (after,) = ort_run(quantized_model, xs), ort_run(result.model, xs)
    assert sqnr_db(before[:, :4], after[:, :4]) > 30  # the boxes keep their own position
    asked = legalize_model(quantized_model, cpu="Concat@output")
    assert [p.op_types for p in asked.remaining.partitions] == [("Concat",)]
    # check and the simulator read the legalised model through the same selection: it
    # passes check as saved, and the simulator joins the results in float on the CPU.
    checked = check(result.model)
    assert checked.ok, checked.format_text()
    assert [p.op_types for p in checked.partitions] == [("Concat",)]
    (got,) = simulate(result.model, xs, rounding="onnx", quiet=True).values()
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, after)


def test_an_a8w8_result_tail_runs_on_the_cpu_after_the_npu() -> None:
    """Under a8w8 the planner leaves the whole decoding after the last Conv float (the box
    scaling, the score sigmoid, the Concat and the Transpose: quant_core.plan.tail). An
    a8w8 file legalised for the NPU keeps them as one CPU partition after the NPU, which
    check accepts and the simulator runs in float on the Conv outputs it dequantizes."""
    model = _boxes_and_scores(transpose=True)
    result = legalize_model(quantize(model, "a8w8"))
    assert result.remaining.ok, result.remaining.format_text()
    # The second Mul is a8w8's activation equalization of the score Conv's output channels
    # (its scale starts the float Sigmoid chain).
    assert [sorted(p.op_types) for p in result.remaining.partitions] == [
        ["Concat", "Mul", "Mul", "Sigmoid", "Transpose"]
    ]
    assert any("finish the model's results in float" in note for note in result.notes)
    xs = random_inputs(model, 32, seed=6)
    (after,) = ort_run(result.model, xs)
    (got,) = simulate(result.model, xs, rounding="onnx", quiet=True).values()
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, after, rtol=1e-6, atol=1e-6)  # float on the CPU: the same up to float32 ulps


def test_a_split_feeding_a_layer_and_the_float_results_runs_on_the_cpu() -> None:
    """A YOLOv8 head splits one Conv output: one branch goes on to a layer, the other is
    decoded in float (a8w8's result tail). The Split joins the CPU partition, which hands
    the layer's branch back to the NPU quantized: the simulator computes what onnxruntime
    does on the legalised file (the layer's output exactly, the float results within
    float32 ulps)."""
    b = GraphBuilder(7, opset=13)
    x = b.input("x", ["N", 3, 6, 6])
    h = b.node("Relu", [b.conv(x, 3, 8)])
    b.nodes.append(onnx.helper.make_node("Split", [h], ["s0", "s1"], name="split", axis=1))
    layer = b.conv("s0", 4, 4, k=1)
    scores = b.node("Sigmoid", ["s1"], name="scores")
    model = b.model([layer, scores], rank=4)
    result = legalize_model(quantize(model, "a8w8"))
    assert result.remaining.ok, result.remaining.format_text()
    [partition] = result.remaining.partitions
    assert sorted(partition.op_types) == ["Sigmoid", "Split"] and len(partition.outputs) >= 1
    xs = random_inputs(model, 16, seed=2)
    expected = ort_run(result.model, xs)
    got = list(simulate(result.model, xs, rounding="onnx", quiet=True).values())
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_allclose(got[1], expected[1], rtol=1e-6, atol=1e-6)


def test_a_float_tensor_the_npu_reads_is_not_result_tail() -> None:
    """A float node whose result a quantized node reads is inside the graph, not after it:
    check names it (not_quantized) instead of putting it on the CPU."""
    w = QDQWriter()
    x = w.quantize("x", 4)
    y = w.op("Sigmoid", [x], "sig")
    out = w.op("Mul", [x, y], "swish")
    model = w.model([("x", [1, 4])], [w.quantize(out, 4)])
    assert set(check(model).counts()) >= {"not_quantized"}
    assert check(model).partitions == ()


@pytest.mark.parametrize("mean", ["GlobalAveragePool", "ReduceMean"])
def test_large_global_pool_in_two_stages_matches_onnxruntime(mean: str) -> None:
    """A squeeze-excite over 32x32: the device pools in two stages (Quark's
    SplitLargeKernelPool); written as two pools, onnxruntime computes the same codes. timm
    writes the mean as a ReduceMean: made a GlobalAveragePool, it is split too."""
    b = GraphBuilder(5)
    x = b.input("x", ["N", 3, 32, 32])
    c = b.node("Relu", [b.conv(x, 3, 8)])
    pooled = b.node(mean, [c], **({"axes": [2, 3], "keepdims": 1} if mean == "ReduceMean" else {}))
    gate = b.node("HardSigmoid", [b.conv(pooled, 8, 8, k=1)], alpha=1 / 6, beta=0.5)
    model = b.model([b.node("Mul", [c, gate])], rank=4)
    result = legalize_model(quantize(model, "xint8"))
    assert result.remaining.ok, result.remaining.format_text()
    assert [n.op_type for n in result.model.graph.node].count("AveragePool") == 1
    xs = random_inputs(model, 16, seed=7)
    (expected,) = ort_run(result.model, xs)
    (got,) = simulate(result.model, xs, rounding="onnx", quiet=True).values()
    np.testing.assert_array_equal(got, expected)
    if mean == "ReduceMean":  # its cost includes the split's rounded first stage
        costs = legalize_model(quantize(model, "xint8"), data=xs).costs
        assert set(costs) == {"reduce_mean", "hard_sigmoid", "all"} and np.isfinite(costs["reduce_mean"])


@pytest.mark.parametrize("axes", [[2, 3], [-2, -1], [-1, -2]])
def test_a_spatial_mean_counted_from_the_end_becomes_a_global_pool(axes: list[int]) -> None:
    """PyTorch's exporter writes a squeeze-excite's ``x.mean((-2, -1), keepdim=True)`` with
    axes ``[-2, -1]``: on a 4-D input those are axes 2 and 3, converted like ``[2, 3]``
    (the conversion used to leave it, an unsupported ReduceMean); on a 3-D input they are
    not a global pool and stay."""
    b = GraphBuilder(5)
    c = b.node("Relu", [b.conv(b.input("x", ["N", 3, 8, 8]), 3, 8)])
    gate = b.node("Relu", [b.conv(b.node("ReduceMean", [c], axes=axes, keepdims=1), 8, 8, k=1)])
    model = b.model([b.node("Mul", [c, gate])], rank=4)
    result = legalize_model(quantize(model, "xint8"))
    assert result.remaining.ok, result.remaining.format_text()
    assert "ReduceMean" not in [n.op_type for n in result.model.graph.node]
    xs = random_inputs(model, 16, seed=7)
    (got,) = simulate(result.model, xs, rounding="onnx", quiet=True).values()
    np.testing.assert_array_equal(got, ort_run(result.model, xs)[0])
    b = GraphBuilder(5)
    rows = b.node("ReduceMean", [b.input("x", ["N", 4, 8])], axes=axes if min(axes) < 0 else [1, 2], keepdims=1)
    flat = quantize(b.model([rows], rank=3), "xint8")
    assert check(flat).counts() == {"unsupported_op": 1} and not check(flat).violations[0].fixable
