"""``quant-npu``: check a QDQ model against an NPU profile, legalise it, simulate it with
integer arithmetic, and write Vitis AI's ``quant_info.json``.

Exit status: 0 ok; 1 ``check`` found violations (``legalize``: some remain after it);
2 bad input (one line on stderr naming what is wrong; nothing written).

Example:
    >>> main(["check", "missing.onnx"])
    2
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from quant_algos.cli_runner import EXIT_BAD_INPUT, EXIT_OK, run_command
from quant_core.errors import UNREADABLE_ARRAY_FILE, DataError, OutputError, one_line

EXIT_VIOLATIONS = 1
_LOG = logging.getLogger(__name__)


class _Parser(argparse.ArgumentParser):
    """Usage errors exit 2 with one line, like every other bad input."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_BAD_INPUT, f"quant-npu: error: {message}\n")


def _target(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="profile: a built-in name (xint8, xint8_int32_bias, dpu) or a .json file")
    parser.add_argument(
        "--cpu",
        default="",
        help="op types or node-name globs to keep on the CPU in float, comma-separated (e.g. Sigmoid,head/*; "
        "Sigmoid@output: only those writing a graph output): never converted, no rule applies, the partitions "
        "they make are listed",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="quant-npu", description="NPU deployment checks for QDQ ONNX models.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    c = sub.add_parser("check", help="list every rule of the target the model breaks")
    c.add_argument("model")
    _target(c)
    c.add_argument("--json", action="store_true", help="print JSON")

    g = sub.add_parser("legalize", help="fix what can be fixed; report what cannot")
    g.add_argument("model")
    g.add_argument("output")
    _target(g)
    g.add_argument("--report", help="also write the changes and what remains as JSON here")
    g.add_argument(
        "--data", help="model inputs (.npy or .npz, first axis = samples): measure each conversion's output SQNR"
    )
    g.add_argument("--json", action="store_true", help="print JSON")

    s = sub.add_parser("simulate", help="run the model with the NPU's integer arithmetic")
    s.add_argument("model")
    s.add_argument("--data", required=True, help=".npy (one input; first axis = samples) or .npz (keys = input names)")
    s.add_argument("--out", required=True, help=".npy (one output) or .npz (every output)")
    s.add_argument("--rounding", default="device", help="device (the target's, default) or onnx (half-to-even)")
    _target(s)
    s.add_argument("--batch-size", type=int, help="samples per batch (default: from the model's largest tensor)")
    s.add_argument("--integer", action="store_true", help="write the integer codes instead of dequantized values")
    s.add_argument("--quiet", action="store_true", help="no progress bar")

    e = sub.add_parser("export-info", help="write Vitis AI's quant_info.json for the model")
    e.add_argument("model")
    e.add_argument("output")
    _target(e)

    t = sub.add_parser("targets", help="list the built-in profiles, or print one as JSON")
    t.add_argument("name", nargs="?", help="a profile to print (name or .json file)")
    return parser


def _check(args: argparse.Namespace) -> int:
    from quant_npu.check import check

    result = check(args.model, args.target, cpu=args.cpu)
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.format_text())
    return EXIT_OK if result.ok else EXIT_VIOLATIONS


def _legalize(args: argparse.Namespace) -> int:
    from quant_core.onnx_qdq.model_io import check_output_paths
    from quant_npu.legalize import legalize

    check_output_paths(args.output, args.report, input_path=args.model, data={"the data": args.data})
    data = _load_data(args.data) if args.data else None
    result = legalize(args.model, args.output, args.target, report_path=args.report, cpu=args.cpu, data=data)
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.format_text())
    return EXIT_OK if result.remaining.ok else EXIT_VIOLATIONS


def _load_data(path: str) -> np.ndarray | dict[str, np.ndarray]:
    source = Path(path)
    if not source.is_file():
        raise DataError(f"--data: file '{source}' not found")
    try:
        if source.suffix == ".npy":
            return np.load(source, allow_pickle=False)
        if source.suffix == ".npz":
            with np.load(source, allow_pickle=False) as archive:
                return {name: archive[name] for name in archive.files}
    except UNREADABLE_ARRAY_FILE as exc:  # a damaged, pickled, empty or truncated file
        raise DataError(f"--data: cannot read '{source}': {one_line(exc)}") from None
    raise DataError(f"--data: '{source}' is not allowed; allowed: a .npy or .npz file")


def _simulate(args: argparse.Namespace) -> int:
    import io

    from quant_core.atomic_io import atomic_write
    from quant_core.onnx_qdq.model_io import check_output_path
    from quant_npu.sim import NPUSimulator

    out = Path(args.out)
    if out.suffix not in (".npy", ".npz"):
        raise OutputError(f"--out: '{out}' is not allowed; allowed: a .npy or .npz file")
    check_output_path(out, input_path=args.model, what="--out", data={"the data": args.data})
    data = _load_data(args.data)
    simulator = NPUSimulator(args.model, args.target, args.rounding, cpu=args.cpu)
    if out.suffix == ".npy" and len(simulator.program.outputs) != 1:
        raise OutputError(f"--out: the model has {len(simulator.program.outputs)} outputs; allowed: a .npz file")
    outputs = simulator.run(data, batch_size=args.batch_size, quiet=args.quiet, integer=args.integer)
    for note in simulator.notes:
        _LOG.warning(note)  # shown as "quant-npu: note: ..." unless --quiet
    buffer = io.BytesIO()
    if out.suffix == ".npy":
        np.save(buffer, next(iter(outputs.values())))
    else:
        np.savez(buffer, **outputs)  # type: ignore[arg-type]
    atomic_write(out, buffer.getvalue())
    return EXIT_OK


def _export_info(args: argparse.Namespace) -> int:
    from quant_core.onnx_qdq.model_io import check_output_path
    from quant_npu.quant_info import write_quant_info

    check_output_path(args.output, input_path=args.model)
    data = write_quant_info(args.model, args.output, args.target, cpu=args.cpu)
    counts = ", ".join(f"{len(data[s])} {s}" for s in ("param", "input", "output"))
    print(f"wrote {args.output}: {counts}")
    return EXIT_OK


def _targets(args: argparse.Namespace) -> int:
    from quant_npu.profile import get_profile, list_profiles, load_profile

    if args.name:
        print(load_profile(args.name).to_json(), end="")
        return EXIT_OK
    for name in list_profiles():
        print(f"{name:<20}{get_profile(name).description}")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 1 rule violations, 2 bad input, 130 interrupted)."""
    commands = {
        "check": _check,
        "legalize": _legalize,
        "simulate": _simulate,
        "export-info": _export_info,
        "targets": _targets,
    }
    return run_command("quant-npu", build_parser(), commands, argv, loggers=("quant_onnx", "quant_algos", "quant_npu"))


if __name__ == "__main__":
    sys.exit(main())
