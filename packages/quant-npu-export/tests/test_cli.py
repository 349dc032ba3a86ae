"""quant-npu on the command line: exit statuses, one-line errors, atomic outputs."""

from __future__ import annotations

import json

import numpy as np
import pytest
from builders import conv_chain, ort_run, quantize, random_inputs

from quant_npu.cli import main


@pytest.fixture
def files(tmp_path):
    model = tmp_path / "model.onnx"
    model.write_bytes(quantize(conv_chain()).SerializeToString())
    data = tmp_path / "x.npy"
    np.save(data, random_inputs(conv_chain(), 20))
    return tmp_path, model, data


def test_check_legalize_check(files, capsys) -> None:
    tmp, model, _ = files
    assert main(["check", str(model)]) == 1
    assert "bias_format 7" in capsys.readouterr().out
    assert main(["check", str(model), "--target", "xint8_int32_bias"]) == 0
    capsys.readouterr()
    assert main(["check", str(model), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["counts"] == {"bias_format": 7}
    legal = tmp / "legal.onnx"
    assert main(["legalize", str(model), str(legal), "--report", str(tmp / "r.json")]) == 0
    assert "ok: the legalised model meets every rule" in capsys.readouterr().out
    assert main(["check", str(legal)]) == 0
    assert json.loads((tmp / "r.json").read_text())["ok"] is True


def test_a_float_model_gets_one_line_saying_to_quantize_it_first(tmp_path, capsys) -> None:
    model = tmp_path / "float.onnx"
    model.write_bytes(conv_chain().SerializeToString())
    assert main(["check", str(model)]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("the model is not quantized") and "quant-onnx quantize" in out[0]
    assert main(["check", str(model), "--json"]) == 1
    listed = json.loads(capsys.readouterr().out)
    assert listed["quantized"] is False and len(listed["violations"]) > 1


def test_simulate_writes_npy_and_npz(files, capsys) -> None:
    tmp, model, data = files
    legal = tmp / "legal.onnx"
    main(["legalize", str(model), str(legal)])
    assert main(["simulate", str(legal), "--data", str(data), "--out", str(tmp / "y.npy"), "--rounding", "onnx",
                 "--quiet", "--batch-size", "8"]) == 0  # fmt: skip
    import onnx

    expected = ort_run(onnx.load(str(legal)), np.load(data))[0]
    np.testing.assert_array_equal(np.load(tmp / "y.npy"), expected)
    np.savez(tmp / "x.npz", x=np.load(data))
    assert main(["simulate", str(legal), "--data", str(tmp / "x.npz"), "--out", str(tmp / "y.npz"), "--quiet",
                 "--integer"]) == 0  # fmt: skip
    with np.load(tmp / "y.npz") as out:
        assert out[out.files[0]].dtype == np.int8


def test_no_output_may_replace_the_data(files, capsys) -> None:
    tmp, model, data = files
    legal = tmp / "legal.onnx"
    main(["legalize", str(model), str(legal)])
    before = data.read_bytes()
    assert main(["simulate", str(legal), "--data", str(data), "--out", str(data), "--quiet"]) == 2
    assert main(["legalize", str(model), str(tmp / "l2.onnx"), "--data", str(data), "--report", str(data)]) == 2
    assert "is the data" in capsys.readouterr().err and data.read_bytes() == before


@pytest.mark.parametrize("command", ["legalize", "simulate", "export-info"])
def test_an_output_in_a_missing_folder_is_refused_before_any_work(files, capsys, command: str) -> None:
    tmp, model, data = files
    missing = tmp / "no_such_folder"
    argv = {
        "legalize": ["legalize", str(model), str(missing / "legal.onnx")],
        "simulate": ["simulate", str(model), "--data", str(data), "--out", str(missing / "y.npy"), "--quiet"],
        "export-info": ["export-info", str(model), str(missing / "quant_info.json")],
    }[command]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist (create it first)" in err[0], err
    assert not missing.exists()


def test_export_info_and_targets(files, capsys) -> None:
    tmp, model, _ = files
    legal = tmp / "legal.onnx"
    main(["legalize", str(model), str(legal)])
    capsys.readouterr()
    assert main(["export-info", str(legal), str(tmp / "quant_info.json")]) == 0
    assert "param" in json.loads((tmp / "quant_info.json").read_text())
    assert main(["targets"]) == 0
    assert "dpu" in capsys.readouterr().out
    assert main(["targets", "dpu"]) == 0
    assert json.loads(capsys.readouterr().out)["weight_qmin"] == -128


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["check", "{tmp}/missing.onnx"], "model '{tmp}/missing.onnx': file not found"),
        (["check", "{model}", "--target", "npu9"], "target: 'npu9' is not a known profile"),
        (["legalize", "{model}", "{model}"], "is the input model; choose another file"),
        (["simulate", "{model}", "--data", "{data}", "--out", "{tmp}/y.txt"], "--out: '{tmp}/y.txt' is not allowed"),
        (["simulate", "{model}", "--data", "{tmp}/none.npy", "--out", "{tmp}/y.npy"], "--data: file"),
        (["simulate", "{model}", "--data", "{data}", "--out", "{tmp}/y.npy", "--rounding", "up"], "rounding: 'up'"),
        (["simulate", "{model}", "--data", "{data}", "--out", "{tmp}/y.npy", "--batch-size", "0"], "batch_size: 0"),
        (["export-info", "{model}", "{tmp}/q.json", "--extra"], "unrecognized arguments: --extra"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (
            ["simulate", "{model}", "--data", "{tmp}/bad.npy", "--out", "{tmp}/y.npy"],
            "--data: cannot read '{tmp}/bad.npy'",
        ),
        (["simulate", "{model}", "--data", "{tmp}/zero.npz", "--out", "{tmp}/y.npy"], "--data: cannot read"),
        (["simulate", "{model}", "--data", "{tmp}/cut.npz", "--out", "{tmp}/y.npy"], "--data: cannot read"),
        (["simulate", "{model}", "--data", "{tmp}/wide.npy", "--out", "{tmp}/y.npy"], "expected shape [N,"),
        (
            ["simulate", "{model}", "--data", "{tmp}/text.npy", "--out", "{tmp}/y.npy"],
            "has dtype <U1; allowed: real numbers",
        ),
        (["simulate", "{model}", "--data", "{tmp}/empty.npy", "--out", "{tmp}/y.npy"], "input 'x' has no samples"),
        (["simulate", "{model}", "--data", "{tmp}/nan.npy", "--out", "{tmp}/y.npy"], "input 'x' contains NaN"),
        (["check", "{model}", "--target", "{tmp}/binary.json"], "target: '{tmp}/binary.json' is not UTF-8 text"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(files, capsys, argv: list[str], message: str) -> None:
    tmp, model, data = files
    if "simulate" in argv and "{model}" in argv:  # a model the simulator accepts, so the data/out errors show
        legal = tmp / "legal.onnx"
        main(["legalize", str(model), str(legal)])
        model = legal
    (tmp / "bad.npy").write_bytes(b"\x93NUMPY\x01\x00damaged")  # numpy raises ValueError, a bug were it not caught
    (tmp / "zero.npz").write_bytes(b"")  # an empty file: numpy raises EOFError
    np.savez(tmp / "whole.npz", x=np.load(data))
    (tmp / "cut.npz").write_bytes((tmp / "whole.npz").read_bytes()[:40])  # truncated: BadZipFile
    (tmp / "whole.npz").unlink()
    np.save(tmp / "wide.npy", np.concatenate([np.load(data)] * 2, axis=1))
    np.save(tmp / "text.npy", np.array(["a", "b"]))
    np.save(tmp / "empty.npy", np.load(data)[:0])
    np.save(tmp / "nan.npy", np.full_like(np.load(data), np.nan))
    (tmp / "binary.json").write_bytes(bytes(range(128, 256)))
    capsys.readouterr()
    before = sorted(p.name for p in tmp.iterdir())
    fill = {"tmp": str(tmp), "model": str(model), "data": str(data)}
    assert main([a.format(**fill) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("quant-npu: error: ")
    assert message.format(**fill) in err
    assert sorted(p.name for p in tmp.iterdir()) == before  # nothing written
