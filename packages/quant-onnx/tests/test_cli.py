"""The quant-onnx command line: success paths and exit code 2 on bad input."""

from __future__ import annotations

import json

import attrs
import numpy as np
import onnx
import pytest
from model_builders import float_island_net, random_inputs, small_cnn

from quant_onnx.cli.main import main


@pytest.fixture
def files(tmp_path):
    model = tmp_path / "float.onnx"
    onnx.save(small_cnn(), model)
    data = tmp_path / "calib.npy"
    np.save(data, random_inputs(small_cnn(), 12))
    return model, data


def _error_line(capsys) -> str:
    return _error_line_of(capsys.readouterr().err)


def _error_line_of(stderr: str) -> str:
    err = stderr.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("quant-onnx: error: ")
    return err[0]


def test_quantize_with_report(files, tmp_path, capsys) -> None:
    model, data = files
    out, report = tmp_path / "q.onnx", tmp_path / "r.json"
    args = ["quantize", str(model), str(out), "--calib-data", str(data), "--num-calib", "8", "--batch-size", "4"]
    assert main([*args, "--per-tensor", "--calib-method", "percentile", "--report", str(report), "--quiet"]) == 0
    onnx.checker.check_model(onnx.load(out))
    content = json.loads(report.read_text())
    weights = content["weights"]
    assert weights and all(w["axis"] is None for w in weights)
    assert content["activations"][0]["spec"]["observer"]["method"] == "percentile"


def test_quantize_with_npz_exclude_and_preset(files, tmp_path) -> None:
    model, _data = files
    npz = tmp_path / "calib.npz"
    np.savez(npz, x=random_inputs(small_cnn(), 6))
    out = tmp_path / "q.onnx"
    assert (
        main(
            [
                "quantize",
                str(model),
                str(out),
                "--calib-data",
                str(npz),
                "--preset",
                "xint8",
                "--exclude",
                "Gemm",
                "--quiet",
            ]
        )
        == 0
    )
    quantized = onnx.load(out)
    gemm = next(n for n in quantized.graph.node if n.op_type == "Gemm")
    floats = {t.name for t in quantized.graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
    assert gemm.input[1] in floats  # excluded: its weight stays float
    assert "Conv" in {n.op_type for n in quantized.graph.node}


def test_an_exclusion_that_matches_no_node_exits_2_writing_nothing(files, tmp_path, capsys) -> None:
    model, data = files
    out = tmp_path / "q.onnx"
    args = ["quantize", str(model), str(out), "--calib-data", str(data), "--exclude", "NoSuchNode", "--quiet"]
    assert main(args) == 2
    line = _error_line(capsys)
    assert "exclude: 'NoSuchNode' matches no node name or op type of the model" in line
    assert "such as conv3, relu4, " in line  # names to choose from
    assert not out.exists()


def test_a_fixed_batch_model_calibrates_and_library_notes_reach_stderr_unless_quiet(tmp_path, capsys) -> None:
    model = small_cnn()
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 4  # a fixed batch of 4
    path, data, out = tmp_path / "fixed.onnx", tmp_path / "calib.npy", tmp_path / "q.onnx"
    onnx.save(model, path)
    np.save(data, random_inputs(small_cnn(), 6))  # 6 samples: 2 are dropped
    args = ["quantize", str(path), str(out), "--calib-data", str(data)]
    assert main([*args, "--quiet"]) == 0
    assert capsys.readouterr().err == ""
    assert main(args) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "note:" in line]
    assert notes == ["quant-onnx: note: dropping 2 calibration sample(s): the model fixes the batch size to 4"]
    import logging

    assert logging.getLogger("quant_onnx").handlers == []  # put back as it was


def test_all_zero_calibration_data_is_a_note_and_in_the_report(files, tmp_path, capsys) -> None:
    model, _data = files
    zeros, out, report = tmp_path / "zeros.npy", tmp_path / "q.onnx", tmp_path / "r.json"
    np.save(zeros, np.zeros_like(random_inputs(small_cnn(), 8)))
    assert main(["quantize", str(model), str(out), "--calib-data", str(zeros), "--report", str(report)]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "note:" in line]
    assert notes == ["quant-onnx: note: input 'x': every calibration value was 0; the qparams fit that value only "
                     "(check the calibration data)"]  # fmt: skip
    assert any(
        note.startswith("input 'x': every calibration value was 0") for note in json.loads(report.read_text())["notes"]
    )


def test_data_of_the_wrong_shape_fails_before_a_bar_is_drawn(files, tmp_path, capsys) -> None:
    model, _data = files
    wrong = tmp_path / "wrong.npy"
    np.save(wrong, np.zeros((4, 3, 8, 8), np.float32))
    assert main(["quantize", str(model), str(tmp_path / "q.onnx"), "--calib-data", str(wrong)]) == 2
    err = capsys.readouterr().err
    assert "calibrating" not in err and "expected shape [N,3,16,16] got [N,3,8,8]" in _error_line_of(err)


def test_dynamic_needs_no_calibration_data(files, tmp_path) -> None:
    model, _data = files
    out = tmp_path / "d.onnx"
    assert main(["quantize", str(model), str(out), "--dynamic"]) == 0
    assert "ConvInteger" in {n.op_type for n in onnx.load(out).graph.node}
    # The report's ranges and per-layer SQNR come from calibration: asked for, it is refused.
    report = tmp_path / "r.json"
    assert main(["quantize", str(model), str(tmp_path / "e.onnx"), "--dynamic", "--report", str(report)]) == 2
    assert not report.exists() and not (tmp_path / "e.onnx").exists()


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--batch-size", "8", "--cle", "--gptq", "--resize", "3", "3"], "--batch-size, --cle, --gptq, --resize"),
        (["--bias-correction"], "--bias-correction"),
        (["--iterations", "3"], "--iterations"),
        (["--mixed-precision", "a16w8"], "--mixed-precision"),
        (["--layout", "nhwc"], "--layout"),
    ],
)
def test_dynamic_refuses_flags_it_would_ignore(files, tmp_path, capsys, flags, named) -> None:
    model, _data = files
    out = tmp_path / "d.onnx"
    assert main(["quantize", str(model), str(out), "--dynamic", *flags]) == 2
    assert _error_line(capsys).startswith(f"quant-onnx: error: {named}: not used with --dynamic")
    assert not out.exists()


def test_dynamic_checks_exclude_globs_as_static_mode_does(files, tmp_path, capsys) -> None:
    model, _data = files
    out = tmp_path / "d.onnx"
    assert main(["quantize", str(model), str(out), "--dynamic", "--exclude", "nosuchnode"]) == 2
    assert "exclude: 'nosuchnode' matches no node" in _error_line(capsys)
    assert not out.exists()
    assert main(["quantize", str(model), str(out), "--dynamic", "--exclude", "conv3", "--quiet"]) == 0


def test_dynamic_refuses_a_config_it_can_quantize_nothing_with(files, tmp_path, capsys) -> None:
    model, _data = files
    out = tmp_path / "d.onnx"
    assert main(["quantize", str(model), str(out), "--dynamic", "--preset", "w4a8"]) == 2
    line = _error_line(capsys)
    assert "weight: int4 symmetric (config 'w4a8') cannot be quantized dynamically" in line, line
    assert "allowed: int8 or uint8 symmetric weights" in line
    assert not out.exists()


def test_dynamic_summary_names_the_nodes_kept_float_and_why(files, tmp_path, capsys) -> None:
    from quant_core.presets import get_preset
    from quant_core.serialization import save_config

    model, _data = files
    config = tmp_path / "mixed.json"
    int4 = get_preset("w4a8").global_config
    save_config(get_preset("a8w8").evolve(name_overrides={"conv3": int4}), config)
    assert main(["quantize", str(model), str(tmp_path / "d.onnx"), "--dynamic", "--config", str(config)]) == 0
    captured = capsys.readouterr()
    assert "quant-onnx: note: node 'conv3': dynamic mode needs an 8-bit symmetric weight spec; kept float" in (
        captured.err
    )
    assert "Stayed float: 1 nodes (Conv 1); dynamic mode runs only" in captured.out, captured.out


def test_an_infinite_std_is_refused_before_calibration(files, tmp_path, capsys) -> None:
    model, data = files
    out = tmp_path / "q.onnx"
    assert main(["quantize", str(model), str(out), "--calib-data", str(data), "--std", "inf"]) == 2
    assert _error_line(capsys).startswith("quant-onnx: error: std: (inf,) is out of range; allowed: ")
    assert not out.exists()


def test_inspect_lists_quantized_and_float_ops(tmp_path, capsys) -> None:
    path = tmp_path / "island.onnx"
    onnx.save(float_island_net(), path)
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "HardSwish" in text and "would stay float" in text and "Sin" in text
    assert main(["inspect", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["float_nodes"][0]["op_type"] == "Sin" and info["quantized"]["Conv"] == 2


def test_compare_prints_agreement_and_layers(files, tmp_path, capsys) -> None:
    model, data = files
    out = tmp_path / "q.onnx"
    assert main(["quantize", str(model), str(out), "--calib-data", str(data), "--quiet"]) == 0
    capsys.readouterr()
    assert (
        main(["compare", str(model), str(out), "--data", str(data), "--quiet", "--json", str(tmp_path / "c.json")]) == 0
    )
    text = capsys.readouterr().out
    assert "top-1 agreement" in text and "SQNR" in text
    assert json.loads((tmp_path / "c.json").read_text())["layers"]


def _dense(outputs: int) -> onnx.ModelProto:
    from model_builders import GraphBuilder

    b = GraphBuilder()
    return b.model([b.gemm(b.input("x", ["N", 8]), 8, outputs)])


def test_compare_refuses_models_that_are_not_one_model_twice(files, tmp_path, capsys) -> None:
    model, data = files
    out = tmp_path / "q.onnx"
    assert main(["quantize", str(model), str(out), "--calib-data", str(data), "--quiet"]) == 0
    renamed = onnx.load(out)
    for node in renamed.graph.node:
        node.input[:] = ["image" if name == "x" else name for name in node.input]
    renamed.graph.input[0].name = "image"
    onnx.save(renamed, tmp_path / "renamed.onnx")
    capsys.readouterr()
    assert main(["compare", str(model), str(tmp_path / "renamed.onnx"), "--data", str(data), "--quiet"]) == 2
    assert "quant_model: its inputs ['image'] are not the float model's ['x']" in _error_line(capsys)

    dense4, dense5 = tmp_path / "d4.onnx", tmp_path / "d5.onnx"
    onnx.save(_dense(4), dense4)
    onnx.save(_dense(5), dense5)
    x = tmp_path / "x.npy"
    np.save(x, np.random.default_rng(0).normal(size=(8, 8)).astype(np.float32))
    assert main(["quantize", str(dense5), str(tmp_path / "q5.onnx"), "--calib-data", str(x), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["compare", str(dense4), str(tmp_path / "q5.onnx"), "--data", str(x), "--quiet"]) == 2
    assert "shape [8, 4] in the float model, [8, 5] in the quantized model" in _error_line(capsys)
    assert main(["compare", str(dense4), str(dense4), "--data", str(x), "--num-samples", "0"]) == 2
    assert "--num-samples: 0 is out of range; allowed: an integer > 0" in _error_line(capsys)


def _bad_inputs(tmp_path, model, data):
    not_onnx = tmp_path / "junk.onnx"
    not_onnx.write_bytes(b"this is not a protobuf at all \x00\xff")
    broken = small_cnn()
    broken.graph.node[0].input[1] = "missing_weight"
    broken_path = tmp_path / "broken.onnx"
    onnx.save(broken, broken_path)
    wrong_name = tmp_path / "wrong.npz"
    np.savez(wrong_name, y=random_inputs(small_cnn(), 2))
    wrong_shape = tmp_path / "shape.npy"
    np.save(wrong_shape, np.zeros((2, 3, 5, 5), np.float32))
    nan = tmp_path / "nan.npy"
    np.save(nan, np.full((2, 3, 16, 16), np.inf, np.float32))
    empty = tmp_path / "empty.npy"
    np.save(empty, np.zeros((0, 3, 16, 16), np.float32))
    return {
        "not onnx": ([str(not_onnx), "OUT", "--calib-data", str(data)], "junk.onnx"),
        "checker": ([str(broken_path), "OUT", "--calib-data", str(data)], "broken.onnx"),
        "missing model": ([str(tmp_path / "none.onnx"), "OUT", "--calib-data", str(data)], "none.onnx"),
        "input name": ([str(model), "OUT", "--calib-data", str(wrong_name)], "'y'"),
        "shape": ([str(model), "OUT", "--calib-data", str(wrong_shape)], "x"),
        "nan": ([str(model), "OUT", "--calib-data", str(nan)], "x"),
        "no samples": ([str(model), "OUT", "--calib-data", str(empty)], "sample"),
        "same path": ([str(model), str(model), "--calib-data", str(data)], "input model"),
        "no data": ([str(model), "OUT"], "--calib-data"),
        "bad preset": ([str(model), "OUT", "--calib-data", str(data), "--preset", "nope"], "preset"),
        "bad count": ([str(model), "OUT", "--calib-data", str(data), "--num-calib", "0"], "--num-calib"),
    }


def test_bad_input_exits_2_with_one_line_and_writes_nothing(files, tmp_path, capsys) -> None:
    model, data = files
    before = model.read_bytes()
    for label, (args, needle) in _bad_inputs(tmp_path, model, data).items():
        out = tmp_path / f"out_{label.replace(' ', '_')}.onnx"
        argv = ["quantize", *[str(out) if a == "OUT" else a for a in args], "--quiet"]
        assert main(argv) == 2, label
        line = _error_line(capsys)
        assert needle in line, (label, line)
        assert not out.exists(), label
    assert model.read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp files left


def test_usage_errors_exit_2(capsys) -> None:
    assert main(["quantize"]) == 2
    assert main(["frobnicate"]) == 2
    assert main(["quantize", "a.onnx", "b.onnx", "--per-channel", "--per-tensor"]) == 2


def test_algorithm_flags_run_and_land_in_the_report(files, tmp_path) -> None:
    model, data = files
    out, report = tmp_path / "q.onnx", tmp_path / "r.json"
    args = ["quantize", str(model), str(out), "--calib-data", str(data), "--preset", "xint8", "--quiet"]
    flags = ["--cle", "--smoothquant", "0.5", "--bias-correction", "--mixed-precision", "a16w8", "--mp-max-layers", "1"]
    assert main([*args, *flags, "--report", str(report)]) == 0
    algorithms = json.loads(report.read_text())["algorithms"]
    assert set(algorithms) == {"cle", "smoothquant", "bias_correction", "mixed_precision"}
    assert len(algorithms["mixed_precision"]["raised"]) == 1
    onnx.checker.check_model(onnx.load(out))


def test_algorithm_flags_keep_a_presets_own_settings_and_iterations_reach_them() -> None:
    from quant_core.algorithm_config import AdaRoundConfig, CLEConfig
    from quant_core.presets import get_preset
    from quant_onnx.cli.main import _algorithms, build_parser

    def flags(*given: str) -> object:
        return build_parser().parse_args(["quantize", "m.onnx", "o.onnx", *given])

    tuned, plain = get_preset("xint8_adaround"), get_preset("xint8")
    own = tuned.algorithm("adaround")
    assert own is not None and own != AdaRoundConfig()
    # --adaround on a preset that already runs it keeps its tuned rate and minibatch
    assert _algorithms(flags("--cle", "--adaround"), tuned) == [CLEConfig(), own]
    assert _algorithms(flags("--iterations", "50"), tuned) == [attrs.evolve(own, num_iterations=50)]
    assert _algorithms(flags("--adaround", "--iterations", "50"), plain) == [AdaRoundConfig(num_iterations=50)]
    with pytest.raises(ValueError, match=r"--iterations: 50 .* neither runs"):
        _algorithms(flags("--iterations", "50"), plain)
    # --bias-correction alone on a preset without it is the empirical walk; a method may follow it
    from quant_core.algorithm_config import BiasCorrectionConfig

    assert _algorithms(flags("--bias-correction"), plain) == [BiasCorrectionConfig()]
    assert _algorithms(flags("--bias-correction", "analytic"), plain) == [BiasCorrectionConfig(method="analytic")]
    from quant_core.algorithm_config import GPTQConfig

    assert _algorithms(flags("--gptq", "--bias-correction"), plain) == [GPTQConfig(), BiasCorrectionConfig()]
    from quant_core.algorithm_config import ActivationEqualizationConfig

    assert _algorithms(flags("--activation-equalization", "--bias-correction", "analytic"), plain) == [
        ActivationEqualizationConfig(),
        BiasCorrectionConfig(method="analytic"),
    ]
    # a8w8 runs analytic bias correction: the bare flag keeps it, a method changes only the method
    tuned_bc = attrs.evolve(get_preset("a8w8").algorithm("bias_correction"), num_samples=7)
    with_bc = get_preset("a8w8").evolve(algorithms=(tuned_bc,))
    assert tuned_bc.method == "analytic"
    assert _algorithms(flags("--bias-correction"), with_bc) == [tuned_bc]
    assert _algorithms(flags("--bias-correction", "empirical"), with_bc) == [
        BiasCorrectionConfig(num_samples=7, method="empirical")
    ]


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--iterations", "5"], "--iterations"),  # no AdaRound/AdaQuant to take them
        (["--mixed-precision", "a16w8"], "accuracy_target"),  # no stopping rule
    ],
)
def test_algorithm_flags_that_cannot_run_are_usage_errors(files, tmp_path, capsys, flags, named) -> None:
    model, data = files
    out = tmp_path / "q.onnx"
    args = ["quantize", str(model), str(out), "--calib-data", str(data), *flags, "--quiet"]
    assert main(args) == 2
    assert named in _error_line(capsys)
    assert not out.exists()


def _float16_conv(path) -> None:
    weight = onnx.numpy_helper.from_array(np.ones((4, 3, 3, 3), np.float16), "w")
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Conv", ["x", "w"], ["c"], name="conv"), onnx.helper.make_node("Relu", ["c"], ["y"])],
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT16, ["N", 3, 8, 8])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT16, ["N", 4, 6, 6])],
        [weight],
    )
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8), path)


def test_a_float16_model_is_refused_by_quantize_and_inspect_alike(tmp_path, capsys) -> None:
    # It used to be "quantized" into the same float16 model, with a summary saying nothing matched
    # while inspect said the Conv would be quantized.
    path, data, out = tmp_path / "fp16.onnx", tmp_path / "calib.npy", tmp_path / "q.onnx"
    _float16_conv(path)
    np.save(data, np.ones((4, 3, 8, 8), np.float16))
    assert main(["quantize", str(path), str(out), "--calib-data", str(data), "--quiet"]) == 2
    quantize_error = _error_line(capsys)
    assert main(["inspect", str(path)]) == 2
    assert _error_line(capsys) == quantize_error
    assert (
        f"model '{path}': input 'x' is float16" in quantize_error and "convert the model to float32" in quantize_error
    )
    assert not out.exists()


def test_a_float16_initializer_is_named() -> None:
    from quant_core.errors import ModelError
    from quant_onnx import ModelQuantizer

    model = small_cnn()
    weight = model.graph.initializer[0]
    weight.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(weight).astype(np.float16), weight.name))
    with pytest.raises(ModelError, match=f"initializer '{weight.name}' is float16"):
        ModelQuantizer("a8w8", quiet=True).prepare(model)


def test_output_into_a_closed_pipe_ends_quietly(tmp_path) -> None:
    """``quant-onnx inspect m.onnx | head -1``: the reader is gone before all is written."""
    import os
    import subprocess
    import sys

    path = tmp_path / "m.onnx"
    onnx.save(small_cnn(), path)
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "quant_onnx.cli", "inspect", str(path)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert (result.returncode, result.stderr) == (141, "")
