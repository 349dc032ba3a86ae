"""How the command-line tools end: bad input (the quant_core.errors family, OSError) is
one line and exit 2; any other ValueError is a bug and keeps its traceback."""

from __future__ import annotations

import argparse

import pytest

from quant_algos.cli_runner import EXIT_BAD_INPUT, run_command
from quant_core.errors import ConfigError, DataError, ModelError, OutputError


def _run(error: BaseException) -> int:
    parser = argparse.ArgumentParser(prog="demo")
    parser.add_subparsers(dest="command").add_parser("go")

    def go(args: argparse.Namespace) -> int:
        raise error

    return run_command("demo", parser, {"go": go}, ["go"])


@pytest.mark.parametrize(
    "error",
    [
        ConfigError("preset: 'int7' is not a known preset"),
        ModelError("node 'n' (Relu): the name is used twice"),
        DataError("calibration data: input 'x' contains NaN"),
        OutputError("output 'out/q.onnx': folder 'out' does not exist"),
        FileNotFoundError("no such file: 'x.npy'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, error: BaseException) -> None:
    assert _run(error) == EXIT_BAD_INPUT
    assert capsys.readouterr().err == f"demo: error: {error}\n"


def test_a_value_error_outside_the_family_is_a_bug_with_its_traceback() -> None:
    with pytest.raises(ValueError, match="operands could not be broadcast"):
        _run(ValueError("operands could not be broadcast together with shapes (3,) (4,)"))
