"""Legal graphs a review found written wrong: a weight an If branch also reads, a stacked
MatMul weight, a 3-D convolution quantized dynamically, outputs over the data files, and
command-line flags that could not take effect."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import make_model, run_ort, tensor, vi, weight
from onnx import helper

from quant_core.errors import ConfigError, DataError, ModelError, OutputError
from quant_onnx import quantize
from quant_onnx.cli.main import main
from quant_onnx.pipeline.dynamic import quantize_dynamic_model


def _default_session(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _branch_reads_weight_model() -> onnx.ModelProto:
    def branch(name: str) -> onnx.GraphProto:
        conv = helper.make_node("Conv", ["x", "w"], [name], name=f"{name}_conv")
        return helper.make_graph([conv], name, [], [vi(name, ["N", 4, 4, 4])])

    nodes = [
        helper.make_node("Conv", ["x", "w"], ["y"], name="main_conv"),
        helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0, name="sum"),
        helper.make_node("Greater", ["s", "z"], ["cond"], name="greater"),
        helper.make_node("If", ["cond"], ["yi"], then_branch=branch("t"), else_branch=branch("e"), name="if"),
    ]
    zero = helper.make_tensor("z", onnx.TensorProto.FLOAT, [], [0.0])
    outputs = [vi("y", ["N", 4, 4, 4]), vi("yi", ["N", 4, 4, 4])]
    return make_model(nodes, [vi("x", ["N", 3, 6, 6])], outputs, [weight("w", [4, 3, 3, 3]), zero])


def test_a_weight_an_if_branch_also_reads_is_kept() -> None:
    model = _branch_reads_weight_model()
    x = np.random.default_rng(0).normal(size=(8, 3, 6, 6)).astype(np.float32)
    for written in (quantize(model, None, "a8w8", x, quiet=True).model, quantize_dynamic_model(model, "a8w8")):
        onnx.checker.check_model(written, full_check=True)  # before: 'w' was dropped
        _default_session(written, {"x": x[:2]})


@pytest.mark.parametrize("shape", [(1, 5, 4), (2, 5, 4)])
def test_a_stacked_matmul_weight_runs_in_the_default_session(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    batch = [] if shape[0] == 1 else [2]
    x = rng.normal(size=(8, *batch, 7, 5)).astype(np.float32)
    node = helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")
    model = make_model([node], [vi("x", ["N", *batch, 7, 5])], [vi("y", ["N", *batch, 7, 4])], [weight("W", shape)])
    written = quantize(model, None, "a8w8", x, quiet=True).model
    feeds = {"x": x[:2]}
    np.testing.assert_allclose(_default_session(written, feeds)[0], run_ort(written, feeds)[0], atol=1e-5)


@pytest.mark.parametrize("depth", [3, 4])  # 3: as many as the output channels
def test_dynamic_quantization_scales_a_3d_convolution_per_output_channel(depth: int) -> None:
    rng = np.random.default_rng(0)
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv")
    bias = helper.make_tensor("b", onnx.TensorProto.FLOAT, [3], [0.5, -1.0, 2.0])
    inputs, outputs = [vi("x", ["N", 2, depth, 5, 5])], [vi("y", ["N", 3, depth - 1, 4, 4])]
    model = make_model([node], inputs, outputs, [weight("w", [3, 2, 2, 2, 2]), bias])
    x = rng.normal(size=(2, 2, depth, 5, 5)).astype(np.float32)
    reference = run_ort(model, {"x": x})[0]
    written = quantize_dynamic_model(model, "a8w8")
    got = _default_session(written, {"x": x})[0]
    assert np.abs(got - reference).max() < 0.05 * np.abs(reference).max()


def test_no_output_may_replace_a_data_file(tmp_path) -> None:
    model = make_model([helper.make_node("Relu", ["x"], ["y"], name="r")], [vi("x", ["N", 2])], [vi("y", ["N", 2])])
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    data = tmp_path / "c.npy"
    np.save(data, np.ones((4, 2), np.float32))
    before = data.read_bytes()
    with pytest.raises(OutputError, match="calibration data"):
        quantize(path, data, "a8w8", data, quiet=True)
    with pytest.raises(OutputError, match="calibration data"):
        quantize(path, tmp_path / "q.onnx", "a8w8", str(data), quiet=True, report_path=data)
    assert main(["compare", str(path), str(path), "--data", str(data), "--json", str(data), "--quiet"]) == 2
    assert data.read_bytes() == before


def test_a_side_input_without_a_batch_axis_is_named_as_unsupported() -> None:
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["y"], name="reshape")]
    inputs = [vi("x", ["N", 4]), vi("shape", [2], onnx.TensorProto.INT64)]
    model = make_model(nodes, inputs, [vi("y", ["M", 2])])
    data = {"x": np.ones((8, 4), np.float32), "shape": np.array([-1, 2], np.int64)}
    with pytest.raises(DataError, match="without a batch axis"):
        quantize(model, None, "a8w8", data, quiet=True)


@pytest.mark.parametrize(
    "flags",
    [
        ["--mp-max-layers", "1"],  # without --mixed-precision
        ["--resize", "3", "3"],  # image options on an array file
        ["--dynamic", "--num-calib", "3"],
    ],
)
def test_quantize_flags_that_cannot_take_effect_are_refused(tmp_path, flags: list[str]) -> None:
    model = make_model([helper.make_node("Relu", ["x"], ["y"], name="r")], [vi("x", ["N", 2])], [vi("y", ["N", 2])])
    onnx.save(model, tmp_path / "m.onnx")
    np.save(tmp_path / "x.npy", np.ones((4, 2), np.float32))
    args = ["quantize", str(tmp_path / "m.onnx"), str(tmp_path / "q.onnx"), "--calib-data", str(tmp_path / "x.npy")]
    assert main([*args, *flags, "--quiet"]) == 2
    assert not (tmp_path / "q.onnx").exists()


def test_a_search_agreement_target_above_one_is_refused(tmp_path, capsys) -> None:
    model = make_model([helper.make_node("Relu", ["x"], ["y"], name="r")], [vi("x", ["N", 2])], [vi("y", ["N", 2])])
    onnx.save(model, tmp_path / "m.onnx")
    np.save(tmp_path / "x.npy", np.ones((4, 2), np.float32))
    data = str(tmp_path / "x.npy")
    args = ["search", str(tmp_path / "m.onnx"), str(tmp_path / "q.onnx"), "--calib-data", data, "--eval-data", data]
    assert main([*args, "--target-agreement", "95", "--budget-s", "5", "--quiet"]) == 2
    assert "--target-agreement" in capsys.readouterr().err


def test_image_options_are_refused_for_arrays() -> None:
    from quant_onnx.data import CalibrationReader, ImageOptions

    model = make_model([helper.make_node("Relu", ["x"], ["y"], name="r")], [vi("x", ["N", 2])], [vi("y", ["N", 2])])
    with pytest.raises(ConfigError, match="image folder"):
        CalibrationReader(model, np.ones((4, 2), np.float32), image_options=ImageOptions(resize=(3, 3)))


def _conv_relu_model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["y"], name="relu"),
    ]
    bias = helper.make_tensor("b", onnx.TensorProto.FLOAT, [4], rng.normal(size=4).tolist())
    return make_model(nodes, [vi("x", ["N", 2, 6, 6])], [vi("y", ["N", 4, 6, 6])], [weight("w", [4, 2, 3, 3]), bias])


def test_compare_counts_every_sample_when_no_top1_is_computed() -> None:
    from quant_onnx.data import CalibrationReader
    from quant_onnx.reporting.compare import compare_models

    model = _conv_relu_model()
    x = np.random.default_rng(1).normal(size=(200, 2, 6, 6)).astype(np.float32)
    quantized = quantize(model, None, "a8w8", x[:32], quiet=True).model
    result = compare_models(model, quantized, CalibrationReader(model, x, batch_size=10), quiet=True)
    assert result.top1_agreement is None and result.samples == 200  # before: 70 (the per-layer cap)


def test_the_report_says_what_was_used_and_how_it_is_stored(tmp_path) -> None:
    import json

    from quant_core.algorithm_config import BiasCorrectionConfig
    from quant_core.presets import get_preset

    model = _conv_relu_model()
    x = np.random.default_rng(1).normal(size=(32, 2, 6, 6)).astype(np.float32)
    config = get_preset("xint8").evolve(algorithms=(BiasCorrectionConfig(),))
    quantize(model, tmp_path / "q.onnx", config, x, quiet=True, report_path=tmp_path / "r.json")
    report = json.loads((tmp_path / "r.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert report["algorithms"]["bias_correction"]["num_samples"] == 32  # before: 256, the configured cap
    stored = report["activations"][0]["stored"]  # xint8's int8 activations stored as uint8 on x86
    assert report["activations"][0]["dtype"] == "int8" and stored == {"dtype": "uint8", "zero_point": 128}


def test_inspect_counts_int8_biases_as_biases() -> None:
    from quant_core.onnx_qdq.describe import describe_quantized

    model = _conv_relu_model()
    x = np.random.default_rng(1).normal(size=(16, 2, 6, 6)).astype(np.float32)
    info = describe_quantized(quantize(model, None, "xint8_int8_bias", x, quiet=True).model)
    assert info is not None
    assert sum(f.count for f in info.weights) == 1 and [f.dtype for f in info.biases] == ["int8"]


def test_a_training_mode_dropout_of_constants_is_not_folded():
    from quant_onnx.pipeline.preprocess.constant_folding import fold_constants

    ratio = helper.make_tensor("ratio", onnx.TensorProto.FLOAT, [], [0.5])
    train = helper.make_tensor("train", onnx.TensorProto.BOOL, [], [True])
    data = helper.make_tensor("c", onnx.TensorProto.FLOAT, [16], np.ones(16).tolist())
    nodes = [
        helper.make_node("Dropout", ["c", "ratio", "train"], ["d"], name="drop"),
        helper.make_node("Add", ["x", "d"], ["y"], name="add"),
    ]
    model = make_model(nodes, [vi("x", ["N", 16])], [vi("y", ["N", 16])], [ratio, train, data], opset=13)
    folded = fold_constants(model)
    assert "Dropout" in [n.op_type for n in folded.graph.node]  # before: one random mask became a constant


def _already_quantized_models() -> dict[str, onnx.ModelProto]:
    model = _conv_relu_model()
    x = np.random.default_rng(0).normal(size=(8, 2, 6, 6)).astype(np.float32)
    weight_only = make_model(
        [
            helper.make_node("DequantizeLinear", ["wq", "ws"], ["w"], name="w_dq", axis=0),
            helper.make_node("Conv", ["x", "w"], ["y"], name="conv"),
        ],
        [vi("x", ["N", 2, 6, 6])],
        [vi("y", ["N", 4, 4, 4])],
        [
            helper.make_tensor("wq", onnx.TensorProto.INT8, [4, 2, 3, 3], [1] * 72),
            helper.make_tensor("ws", onnx.TensorProto.FLOAT, [4], [0.1] * 4),
        ],
    )
    return {
        "qdq": quantize(model, None, "a8w8", x, quiet=True).model,
        "dynamic": quantize_dynamic_model(model, "a8w8"),
        "weight-only": weight_only,
    }


@pytest.mark.parametrize("kind", ["qdq", "dynamic", "weight-only"])
def test_an_already_quantized_model_is_refused(tmp_path, kind: str) -> None:
    model = _already_quantized_models()[kind]
    path = tmp_path / "q.onnx"
    onnx.save(model, path)
    x = np.random.default_rng(1).normal(size=(8, 2, 6, 6)).astype(np.float32)
    # before: its Q/DQ pairs were observed and wrapped again (every tensor rounded twice,
    # the output 2 steps off the input model's) or its integer ops left as they were
    with pytest.raises(ModelError, match=r"already quantized \(node '[^']+' is \w+\)"):
        quantize(model, None, "a8w8", x, quiet=True)
    with pytest.raises(ModelError, match="already quantized"):
        quantize_dynamic_model(path, "a8w8")
    np.save(tmp_path / "x.npy", x)
    args = ["quantize", str(path), str(tmp_path / "o.onnx"), "--quiet"]
    assert main([*args, "--calib-data", str(tmp_path / "x.npy")]) == 2
    assert main([*args, "--dynamic"]) == 2
    assert not (tmp_path / "o.onnx").exists()


def test_dynamic_quantization_refuses_a_float16_model() -> None:
    weight16 = helper.make_tensor("w", onnx.TensorProto.FLOAT16, [4, 4], np.ones(16, np.float16).tolist())
    half = onnx.TensorProto.FLOAT16
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
    model = make_model(nodes, [vi("x", ["N", 4], half)], [vi("y", ["N", 4], half)], [weight16])
    with pytest.raises(ModelError, match="input 'x' is float16"):  # before: returned unchanged, all float
        quantize_dynamic_model(model, "a8w8")


def _constant_output_models() -> dict[str, tuple[onnx.ModelProto, np.ndarray]]:
    rng = np.random.default_rng(0)
    spread = np.logspace(-1, 1, 4, dtype=np.float32).reshape(4, 1, 1, 1)  # channels CLE evens out
    convs = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv"),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("Conv", ["r", "w2"], ["y"], name="conv2"),
    ]
    conv_inits = [
        tensor("w", (rng.normal(size=(4, 3, 3, 3)) * spread).astype(np.float32)),
        tensor("b", rng.normal(size=4).astype(np.float32)),
        weight("w2", [4, 4, 1, 1], seed=2),
    ]
    x = rng.normal(size=(16, 3, 6, 6)).astype(np.float32)
    gain = tensor("g", np.linspace(0.5, 2.0, 8).astype(np.float32))
    wide = (rng.normal(size=(16, 8)) * np.logspace(-1, 1, 8)).astype(np.float32)
    models = {}
    for name, shape in (("w2", [4, 4, 1, 1]), ("b", [4])):
        outputs = [vi("y", ["N", 4, 4, 4]), vi(name, shape)]
        models[f"conv-{name}"] = (make_model(convs, [vi("x", ["N", 3, 6, 6])], outputs, conv_inits), x)
    for op, opset, extra in (("Mul", 13, []), ("LayerNormalization", 17, [tensor("be", np.zeros(8, np.float32))])):
        nodes = [
            helper.make_node(op, ["x", "g", *(["be"] if extra else [])], ["h"], name="scale"),
            helper.make_node("MatMul", ["h", "wm"], ["y"], name="mm"),
        ]
        outputs = [vi("y", ["N", 4]), vi("g", [8])]
        inits = [gain, *extra, weight("wm", [8, 4], seed=3)]
        models[op] = (make_model(nodes, [vi("x", ["N", 8])], outputs, inits, opset=opset), wide)
    return models


@pytest.mark.parametrize(
    ("case", "algorithm"),
    [(c, a) for c in ("conv-w2", "conv-b") for a in ("cle", "smoothquant")]
    + [("Mul", "smoothquant"), ("LayerNormalization", "smoothquant")],  # CLE has no chain there
)
def test_a_constant_that_is_a_graph_output_is_not_rescaled(case: str, algorithm: str) -> None:
    import attrs

    from quant_core.algorithm_config import CLEConfig, SmoothQuantConfig
    from quant_core.presets import get_preset
    from quant_onnx import ModelQuantizer

    model, x = _constant_output_models()[case]
    pass_config = CLEConfig() if algorithm == "cle" else SmoothQuantConfig()
    quantizer = ModelQuantizer(attrs.evolve(get_preset("a8w8"), algorithms=(pass_config,)), quiet=True)
    prepared, _reports = quantizer.run_pre_passes(quantizer.prepare(model), [{"x": x}])
    feeds = {"x": x[:4]}
    for before, after in zip(run_ort(model, feeds), run_ort(prepared.model, feeds), strict=True):
        # before: the weight, bias or gain was rescaled in place, and so was the output
        # that hands it to the user (CLE: 12 off on the conv weight)
        np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5)


def _extra_output_model(output: str) -> onnx.ModelProto:
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node("Relu", ["c"], ["y"], name="relu"),
        helper.make_node("Shape", ["x"], ["shape"], name="shape"),
        helper.make_node("ReduceSum", ["y"], ["total"], keepdims=0, name="sum"),
    ]
    shapes = {"w": ([4, 3, 3, 3], onnx.TensorProto.FLOAT), "shape": ([4], onnx.TensorProto.INT64)}
    shape, elem = shapes.get(output, ([], onnx.TensorProto.FLOAT))
    outputs = [vi("y", ["N", 4, 4, 4]), vi(output, shape, elem)]
    return make_model(nodes, [vi("x", ["N", 3, 6, 6])], outputs, [weight("w", [4, 3, 3, 3])])


@pytest.mark.parametrize("output", ["w", "shape", "total"])
def test_the_search_names_an_output_without_a_batch_axis(tmp_path, output: str) -> None:
    from quant_onnx import search

    x = np.random.default_rng(0).normal(size=(16, 3, 6, 6)).astype(np.float32)
    model = _extra_output_model(output)
    with pytest.raises(DataError, match=rf"output '{output}' has shape \[[0-9, ]*\] for a batch of 16 samples"):
        search(model, None, x, x, target=0.9, quiet=True)  # before: a raw IndexError
    onnx.save(model, tmp_path / "m.onnx")
    np.save(tmp_path / "x.npy", x)
    data = str(tmp_path / "x.npy")
    args = ["search", str(tmp_path / "m.onnx"), str(tmp_path / "q.onnx"), "--calib-data", data, "--eval-data", data]
    assert main([*args, "--target-agreement", "0.9", "--quiet"]) == 2
    assert not (tmp_path / "q.onnx").exists()


def test_mixed_precision_scores_a_model_with_a_scalar_output() -> None:
    import attrs

    from quant_core.algorithm_config import MixedPrecisionConfig
    from quant_core.presets import get_preset

    x = np.random.default_rng(0).normal(size=(16, 3, 6, 6)).astype(np.float32)
    config = attrs.evolve(get_preset("a8w8"), algorithms=(MixedPrecisionConfig(max_layers=1),))
    result = quantize(_extra_output_model("total"), None, config, x, quiet=True)  # before: ValueError (concatenate)
    assert [o.name for o in result.model.graph.output] == ["y", "total"]


@pytest.mark.parametrize("form", ["sparse_initializer", "sparse_value"])
def test_a_sparse_weight_is_quantized(form: str) -> None:
    rng = np.random.default_rng(0)
    dense = rng.normal(size=(8, 4)).astype(np.float32)
    dense[np.abs(dense) < 0.5] = 0.0
    positions = np.flatnonzero(dense)
    values = helper.make_tensor("w", onnx.TensorProto.FLOAT, [len(positions)], dense.ravel()[positions].tolist())
    sparse = helper.make_sparse_tensor(values, tensor("w_positions", positions.astype(np.int64)), [8, 4])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
    if form == "sparse_value":
        nodes.insert(0, helper.make_node("Constant", [], ["w"], sparse_value=sparse, name="w_const"))
    graph = helper.make_graph(nodes, "g", [vi("x", ["N", 8])], [vi("y", ["N", 4])])
    if form == "sparse_initializer":
        graph.sparse_initializer.append(sparse)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    onnx.checker.check_model(model)
    x = rng.normal(size=(16, 8)).astype(np.float32)
    reference = _default_session(model, {"x": x})[0]
    # before: static mode stopped at "tensor 'w' dtype object is not allowed", dynamic mode
    # left the MatMul float
    static = quantize(model, None, "a8w8", x, quiet=True).model
    dynamic = quantize_dynamic_model(model, "a8w8")
    assert "MatMulInteger" in [n.op_type for n in dynamic.graph.node]
    for written in (static, dynamic):
        assert np.abs(_default_session(written, {"x": x})[0] - reference).max() < 0.05 * np.abs(reference).max()
    assert np.array_equal(run_ort(model, {"x": x})[0], reference)  # the input model is untouched


def test_a_model_declaring_both_spellings_of_the_default_domain_is_raised_to_opset_13() -> None:
    from quant_core.onnx_qdq.model_io import opset_version

    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"), helper.make_node("Relu", ["c"], ["y"], name="r")]
    graph = helper.make_graph(
        nodes, "g", [vi("x", ["N", 3, 6, 6])], [vi("y", ["N", 4, 4, 4])], [weight("w", [4, 3, 3, 3])]
    )
    opsets = [helper.make_opsetid("", 11), helper.make_opsetid("ai.onnx", 11)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=8)
    onnx.checker.check_model(model)
    x = np.random.default_rng(0).normal(size=(8, 3, 6, 6)).astype(np.float32)
    # before: "model declares the default ONNX domain with several opsets [11, 13]" after the
    # opset was raised for per-channel Q/DQ
    written = quantize(model, None, "a8w8", x, quiet=True).model
    assert opset_version(written) == 13
    reference = _default_session(model, {"x": x})[0]
    assert np.abs(_default_session(written, {"x": x})[0] - reference).max() < 0.05 * np.abs(reference).max()
