"""``quant-onnx``: quantize, inspect and compare ONNX models from the command line.

Invalid input (a file that is not ONNX, a model failing the checker, calibration data
that does not fit, an output path equal to the input) prints one line naming what is
wrong to stderr and exits with status 2, writing nothing.

Example:
    >>> main(["quantize", "missing.onnx", "out.onnx", "--calib-data", "x.npy", "--quiet"])
    2
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

EXIT_OK = 0
EXIT_BAD_INPUT = 2


class _Parser(argparse.ArgumentParser):
    """Usage errors exit 2 with one line, like every other bad input."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_BAD_INPUT, f"quant-onnx: error: {message}\n")


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--preset", help="named config (default: a8w8)")
    group.add_argument("--config", help="config JSON file (quant_core.serialization format)")


def _add_image_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--resize", nargs=2, type=int, metavar=("H", "W"), help="image folders: resize to H x W")
    parser.add_argument("--mean", nargs="+", type=float, help="image folders: per-channel mean (0-1 scale)")
    parser.add_argument("--std", nargs="+", type=float, help="image folders: per-channel std (0-1 scale)")
    parser.add_argument("--layout", choices=("nchw", "nhwc"), default=None, help="image folders: tensor layout")


def _add_algorithm_options(parser: argparse.ArgumentParser) -> None:
    """Accuracy recovery; each replaces the preset's own setting of the same algorithm."""
    group = parser.add_argument_group("accuracy recovery (defaults: quant_core.algorithm_config)")
    group.add_argument("--cle", action="store_true", help="cross-layer equalization (Clip(0,6) -> Relu)")
    group.add_argument("--bias-correction", action="store_true", help="empirical bias correction")
    group.add_argument("--smoothquant", type=float, metavar="ALPHA", help="SmoothQuant with migration strength ALPHA")
    group.add_argument("--adaround", action="store_true", help="AdaRound (needs quant-onnx[torch])")
    group.add_argument("--adaquant", action="store_true", help="AdaQuant (needs quant-onnx[torch])")
    group.add_argument("--iterations", type=int, help="AdaRound/AdaQuant iterations per layer")
    group.add_argument(
        "--mixed-precision",
        nargs="+",
        choices=("a16w8", "a8w16", "a16w16"),
        metavar="TYPE",
        help="raise the most sensitive layers to TYPE (a16w8, a8w16, a16w16)",
    )
    group.add_argument("--mp-target-sqnr", type=float, metavar="DB", help="mixed precision: output SQNR to reach")
    group.add_argument("--mp-size-budget", type=float, metavar="RATIO", help="mixed precision: size vs all-int8")
    group.add_argument("--mp-max-layers", type=int, metavar="N", help="mixed precision: raise at most N layers")


def _algorithms(args: argparse.Namespace) -> list[Any]:
    from quant_core.algorithm_config import (
        AdaQuantConfig,
        AdaRoundConfig,
        BiasCorrectionConfig,
        CLEConfig,
        MixedPrecisionConfig,
        SmoothQuantConfig,
    )

    iterations = {} if args.iterations is None else {"num_iterations": args.iterations}
    chosen: list[Any] = []
    if args.cle:
        chosen.append(CLEConfig())
    if args.smoothquant is not None:
        chosen.append(SmoothQuantConfig(alpha=args.smoothquant))
    if args.mixed_precision:
        chosen.append(
            MixedPrecisionConfig(
                target_types=args.mixed_precision,
                accuracy_target=args.mp_target_sqnr,
                size_budget=args.mp_size_budget,
                max_layers=args.mp_max_layers,
            )
        )
    if args.adaround:
        chosen.append(AdaRoundConfig(**iterations))
    if args.adaquant:
        chosen.append(AdaQuantConfig(**iterations))
    if args.bias_correction:
        chosen.append(BiasCorrectionConfig())
    return chosen


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="quant-onnx", description="Post-training quantization of ONNX models to QDQ.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    q = sub.add_parser("quantize", help="quantize MODEL.onnx to OUT.onnx")
    q.add_argument("model")
    q.add_argument("output")
    q.add_argument(
        "--calib-data", help=".npy (one input, first axis = samples), .npz (keys = input names) or image folder"
    )
    _add_config_options(q)
    gran = q.add_mutually_exclusive_group()
    gran.add_argument("--per-channel", dest="per_channel", action="store_const", const=True, default=None)
    gran.add_argument("--per-tensor", dest="per_channel", action="store_const", const=False)
    q.add_argument("--calib-method", choices=("minmax", "percentile", "entropy", "mse"))
    q.add_argument("--num-calib", type=int, help="use at most N calibration samples")
    q.add_argument("--batch-size", type=int, help="calibration batch size")
    q.add_argument("--exclude", nargs="+", default=[], metavar="PATTERN", help="node-name globs or op types left float")
    q.add_argument("--report", help="write a JSON report here")
    q.add_argument("--quiet", action="store_true", help="no progress bars")
    q.add_argument("--dynamic", action="store_true", help="dynamic quantization (no calibration data)")
    _add_algorithm_options(q)
    _add_image_options(q)

    i = sub.add_parser("inspect", help="ops, what would be quantized, what would stay float")
    i.add_argument("model")
    _add_config_options(i)
    i.add_argument("--json", action="store_true", help="print JSON instead of a table")

    c = sub.add_parser("compare", help="top-1 agreement, output SQNR and per-layer SQNR of two models")
    c.add_argument("float_model")
    c.add_argument("quant_model")
    c.add_argument("--data", required=True, help=".npy, .npz or image folder")
    c.add_argument("--num-samples", type=int)
    c.add_argument("--batch-size", type=int, default=32)
    c.add_argument("--json", help="also write the comparison as JSON here")
    c.add_argument("--quiet", action="store_true")
    _add_image_options(c)
    return parser


def _config(args: argparse.Namespace) -> Any:
    from quant_onnx.api import resolve_config

    if args.config:
        from quant_core.serialization import load_config

        if not Path(args.config).is_file():
            raise ValueError(f"--config: file '{args.config}' not found")
        return load_config(args.config)
    return resolve_config(args.preset)


def _image_options(args: argparse.Namespace) -> Any:
    """Image-folder options from the command line (``None`` when none was given)."""
    given = {key: getattr(args, key) for key in ("resize", "mean", "std", "layout") if getattr(args, key) is not None}
    if not given:
        return None
    from quant_onnx.io.data import ImageOptions

    for key in ("resize", "mean", "std"):
        if key in given:
            given[key] = tuple(given[key])
    return ImageOptions(**given)


def _quantize(args: argparse.Namespace) -> int:
    from quant_onnx.io.config_overrides import override_config

    if not Path(args.model).is_file():
        raise ValueError(f"model '{args.model}': file not found")

    config = override_config(
        _config(args),
        per_channel=args.per_channel,
        calib_method=args.calib_method,
        exclude=args.exclude,
        algorithms=_algorithms(args),
    )
    if args.dynamic:
        from quant_onnx.pipeline.dynamic import quantize_dynamic

        quantize_dynamic(args.model, args.output, config)
        return EXIT_OK
    if not args.calib_data:
        raise ValueError("--calib-data: required for static quantization (or use --dynamic)")
    for name in ("num_calib", "batch_size"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')}: {value} is out of range; allowed: an integer > 0")
    from quant_onnx.api import ModelQuantizer

    quantizer = ModelQuantizer(config, quiet=args.quiet)
    quantizer.quantize(
        args.model,
        args.output,
        args.calib_data,
        num_samples=args.num_calib,
        batch_size=args.batch_size,
        report_path=args.report,
        image_options=_image_options(args),
    )
    return EXIT_OK


def inspect_model(model: Any, config: Any) -> dict[str, Any]:
    """What :command:`quant-onnx inspect` prints, as data."""
    from quant_onnx.api import ModelQuantizer

    prepared = ModelQuantizer(config, quiet=True).prepare(model)
    ann = prepared.plan
    ops = collections.Counter(node.op_type for node in prepared.model.graph.node)
    quantized = collections.Counter(op for _name, op in ann.quantized_nodes)
    return {
        "ops": dict(sorted(ops.items())),
        "quantized": dict(sorted(quantized.items())),
        "float_nodes": [{"name": f.name, "op_type": f.op_type, "reason": f.reason} for f in ann.float_nodes],
        "fused_activations": [f.node for f in ann.fused],
        "activation_groups": len(ann.groups),
        "weights": len(ann.weights),
        "preprocess_changes": dict(prepared.preprocess_changes),
        "notes": list(ann.notes),
    }


def _inspect(args: argparse.Namespace) -> int:
    info = inspect_model(args.model, _config(args))
    if args.json:
        print(json.dumps(info, indent=2))
        return EXIT_OK
    print(f"{'op type':<24}{'count':>7}{'quantized':>11}")
    for op, count in info["ops"].items():
        print(f"{op:<24}{count:>7}{info['quantized'].get(op, 0):>11}")
    print(
        f"\nweights quantized: {info['weights']}, activation groups: {info['activation_groups']}, "
        f"fused activations: {len(info['fused_activations'])}"
    )
    if info["float_nodes"]:
        print("\nstays float:")
        for node in info["float_nodes"]:
            print(f"  {node['name']} ({node['op_type']}): {node['reason']}")
    for note in info["notes"]:
        print(f"note: {note}")
    return EXIT_OK


def _compare(args: argparse.Namespace) -> int:
    from quant_onnx.io.compare import compare_models
    from quant_onnx.io.data import calibration_batches
    from quant_onnx.model_io import load_model

    float_model = load_model(args.float_model)
    quant_model = load_model(args.quant_model)
    batches = calibration_batches(
        float_model, args.data, args.batch_size, args.num_samples, image_options=_image_options(args)
    )
    result = compare_models(float_model, quant_model, batches, quiet=args.quiet)
    if result.top1_agreement is not None:
        print(f"top-1 agreement: {result.top1_agreement:.4f} over {result.samples} samples")
    for name, value in result.output_sqnr_db.items():
        print(f"output {name}: SQNR {value:.2f} dB")
    if result.layers:
        print(f"\n{'tensor':<48}{'SQNR dB':>10}")
        for layer in result.layers:
            print(f"{layer.tensor:<48}{layer.sqnr_db:>10.2f}")
    if args.json:
        from quant_onnx.io.report import write_report

        write_report(result.to_data(), args.json)
    return EXIT_OK


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 2 bad input)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    commands = {"quantize": _quantize, "inspect": _inspect, "compare": _compare}
    try:
        return commands[args.command](args)
    except (ValueError, OSError, ImportError) as exc:  # ImportError: a missing optional extra
        print(f"quant-onnx: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except RuntimeError as exc:  # onnxruntime rejects what the checks could not see
        print(f"quant-onnx: error: onnxruntime: {_one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
