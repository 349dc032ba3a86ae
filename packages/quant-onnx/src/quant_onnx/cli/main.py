"""``quant-onnx``: quantize, inspect, compare ONNX models and search recipes from the command line.

Invalid input (a file that is not ONNX, a model failing the checker or whose external
data lies outside its folder, calibration data that does not fit, an output path equal
to the input or in a missing or read-only folder) prints one line naming what is wrong
to stderr and exits with status 2, writing nothing. Ctrl-C prints one line and exits
with status 130, leaving no partial file (every output is written atomically). Output
piped into a reader that stops early (``| head``) ends quietly with status 141. What the
library warns of (samples dropped, a bias kept float) is printed as ``quant-onnx: note:``
lines, except under ``--quiet``.

Example:
    >>> main(["quantize", "missing.onnx", "out.onnx", "--calib-data", "x.npy", "--quiet"])
    2
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from quant_algos.cli_runner import EXIT_BAD_INPUT, EXIT_OK, run_command
from quant_core.algorithm_config import BIAS_CORRECTION_METHODS
from quant_core.errors import ConfigError, ModelError


class _Parser(argparse.ArgumentParser):
    """Usage errors exit 2 with one line, like every other bad input."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_BAD_INPUT, f"quant-onnx: error: {message}\n")


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    from quant_core.presets import list_presets

    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--preset", metavar="NAME", help=f"named config, one of: {', '.join(list_presets())} (default: a8w8)"
    )
    group.add_argument("--config", help="config JSON file (quant_core.serialization format)")


def _add_image_options(parser: argparse.ArgumentParser) -> tuple[str, ...]:
    """Adds the image-folder options; returns their destinations."""
    actions = (
        parser.add_argument("--resize", nargs=2, type=int, metavar=("H", "W"), help="image folders: resize to H x W"),
        parser.add_argument("--mean", nargs="+", type=float, help="image folders: per-channel mean (0-1 scale)"),
        parser.add_argument(
            "--std", nargs="+", type=float, help="image folders: per-channel std (0-1 scale; finite, non-zero)"
        ),
        parser.add_argument("--layout", choices=("nchw", "nhwc"), default=None, help="image folders: tensor layout"),
    )
    return tuple(action.dest for action in actions)


def _add_algorithm_options(parser: argparse.ArgumentParser) -> tuple[str, ...]:
    """Accuracy recovery; a flag for an algorithm the preset already runs keeps its settings.
    Returns the options' destinations."""
    group = parser.add_argument_group("accuracy recovery (defaults: quant_core.algorithm_config)")
    dests: list[str] = []

    def add(*flags: str, **options: Any) -> None:
        dests.append(group.add_argument(*flags, **options).dest)

    add("--cle", action="store_true", help="cross-layer equalization (Clip(0,6) -> Relu)")
    add(
        "--bias-correction",
        nargs="?",
        const=True,  # bare: not a method, so the preset's own bias correction keeps its method
        choices=BIAS_CORRECTION_METHODS,
        metavar="METHOD",
        help="bias correction: empirical (a layer-by-layer walk) or analytic (one float pass); bare: the "
        "preset's bias correction as it is, or empirical when the preset has none",
    )
    add(
        "--activation-equalization",
        action="store_true",
        help="even out activation channels where it is free (Conv outputs before activation chains, depthwise inputs)",
    )
    add("--smoothquant", type=float, metavar="ALPHA", help="SmoothQuant with migration strength ALPHA")
    add("--gptq", action="store_true", help="GPTQ weight rounding (closed form; no torch)")
    add("--adaround", action="store_true", help="AdaRound (needs quant-onnx[torch])")
    add("--adaquant", action="store_true", help="AdaQuant (needs quant-onnx[torch])")
    add("--iterations", type=int, help="AdaRound/AdaQuant iterations per layer (the flag's or the preset's)")
    add(
        "--mixed-precision",
        nargs="+",
        choices=("a16w8", "a8w16", "a16w16"),
        metavar="TYPE",
        help="raise the most sensitive layers to TYPE (a16w8, a8w16, a16w16)",
    )
    add("--mp-target-sqnr", type=float, metavar="DB", help="mixed precision: output SQNR to reach")
    add("--mp-size-budget", type=float, metavar="RATIO", help="mixed precision: size vs all-int8")
    add("--mp-max-layers", type=int, metavar="N", help="mixed precision: raise at most N layers")
    return tuple(dests)


def _algorithms(args: argparse.Namespace, base: Any) -> list[Any]:
    """The algorithms the flags ask for, given ``base`` (the preset or config file).

    A flag for an algorithm ``base`` already runs keeps ``base``'s settings (a tuned preset is
    not reset to the defaults); ``--iterations`` sets AdaRound's/AdaQuant's iterations,
    whether the flag or ``base`` brings them."""
    from quant_core.algorithm_config import (
        ActivationEqualizationConfig,
        AdaQuantConfig,
        AdaRoundConfig,
        BiasCorrectionConfig,
        CLEConfig,
        GPTQConfig,
        MixedPrecisionConfig,
        SmoothQuantConfig,
    )

    def own_or(default: Any) -> Any:
        return base.algorithm(type(default).kind) or default

    chosen: list[Any] = []
    if args.cle:
        chosen.append(own_or(CLEConfig()))
    if args.activation_equalization:
        chosen.append(own_or(ActivationEqualizationConfig()))
    if args.smoothquant is not None:
        chosen.append(SmoothQuantConfig(alpha=args.smoothquant))
    given_mp = _given(args, "mp_target_sqnr", "mp_size_budget", "mp_max_layers")
    if given_mp and not args.mixed_precision:
        raise ConfigError(f"{given_mp}: set mixed precision's stopping rules; allowed with --mixed-precision")
    if args.mixed_precision:
        chosen.append(
            MixedPrecisionConfig(
                target_types=args.mixed_precision,
                accuracy_target=args.mp_target_sqnr,
                size_budget=args.mp_size_budget,
                max_layers=args.mp_max_layers,
            )
        )
    if args.gptq:
        chosen.append(own_or(GPTQConfig()))
    if args.adaround:
        chosen.append(own_or(AdaRoundConfig()))
    if args.adaquant:
        chosen.append(own_or(AdaQuantConfig()))
    if args.bias_correction is not None:
        correction = own_or(BiasCorrectionConfig())
        if args.bias_correction is not True:
            correction = attrs.evolve(correction, method=args.bias_correction)
        chosen.append(correction)
    if args.iterations is not None:
        learned = [a for a in (*chosen, *base.algorithms) if isinstance(a, AdaRoundConfig | AdaQuantConfig)]
        if not learned:
            raise ConfigError(
                f"--iterations: {args.iterations} sets AdaRound/AdaQuant iterations, but neither runs; "
                "allowed with --adaround, --adaquant, or a preset or config that runs one"
            )
        by_kind = {type(a).kind: attrs.evolve(a, num_iterations=args.iterations) for a in learned}
        chosen = [by_kind.pop(type(a).kind, a) for a in chosen]
        chosen.extend(by_kind.values())
    return chosen


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="quant-onnx", description="Post-training quantization of ONNX models to QDQ.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    q = sub.add_parser(
        "quantize",
        help="quantize MODEL.onnx to OUT.onnx",
        description="Quantize MODEL to a QDQ model at OUTPUT and print a summary of what was done.",
        epilog="OUTPUT's folder must already exist and be writable: it is checked before any calibration "
        "work and never created (a mistyped folder fails at once instead of scattering files). "
        "An existing OUTPUT is replaced atomically; the input model is never modified.",
    )
    q.add_argument("model", metavar="MODEL", help="float ONNX model (external data must lie in its folder)")
    q.add_argument("output", metavar="OUTPUT", help="where to write the quantized model (its folder must exist)")
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
    q.add_argument("--report", help="write a JSON report here (every scale, range and the per-layer SQNR)")
    q.add_argument("--quiet", action="store_true", help="no progress bars and no summary")
    q.add_argument(
        "--dynamic",
        action="store_true",
        help="dynamic quantization: 8-bit symmetric weights of Conv, MatMul and Gemm, activations quantized at "
        "run time (no calibration data, accuracy recovery or image options)",
    )
    # What --dynamic cannot use: calibration, accuracy recovery and image reading.
    calibration = ("calib_data", "calib_method", "num_calib", "batch_size")
    q.set_defaults(static_only=(*calibration, *_add_algorithm_options(q), *_add_image_options(q)))

    i = sub.add_parser(
        "inspect",
        help="ops, what pre-processing folds, what would be quantized or stay float; "
        "for a quantized model, its formats",
    )
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
    _add_search_parser(sub)
    return parser


def _add_search_parser(sub: Any) -> None:
    from quant_algos.search import DEFAULT_CONFIDENCE
    from quant_onnx.recipe_search import TARGETS

    s = sub.add_parser(
        "search",
        help="find the cheapest recipe whose model meets an accuracy target",
        description="Try recipes (observers, CLE, bias correction, AdaRound...) in order of cost until one "
        "reaches the target on EVAL data; write its model to OUTPUT and print the table of what was tried. "
        "The winner is re-scored on a held-out part of the evaluation data the search never selected on.",
    )
    s.add_argument("model", metavar="MODEL", help="float ONNX model")
    s.add_argument("output", metavar="OUTPUT", help="where to write the chosen model (its folder must exist)")
    s.add_argument("--calib-data", required=True, help=".npy, .npz or image folder")
    s.add_argument("--eval-data", required=True, help="evaluation samples: .npy, .npz or image folder")
    s.add_argument(
        "--eval-labels", help=".npy of one label per evaluation sample (only with --metric accuracy or yours)"
    )
    goal = s.add_mutually_exclusive_group(required=True)
    goal.add_argument("--target-agreement", type=float, metavar="T", help="top-1 agreement with the float model")
    goal.add_argument("--target-score", type=float, metavar="T", help="the value of --metric to reach")
    s.add_argument("--metric", help="accuracy, sqnr, module:function or file.py:function (with --target-score)")
    where = s.add_mutually_exclusive_group()
    where.add_argument("--target", choices=TARGETS, help="only recipes this NPU format allows")
    where.add_argument("--no-npu", action="store_true", help="every format onnxruntime runs (the default)")
    s.add_argument("--budget-s", type=float, metavar="S", help="start no candidate after S seconds")
    s.add_argument(
        "--confidence",
        type=float,
        default=DEFAULT_CONFIDENCE,
        help="a per-sample metric meets the target when its lower bound at this confidence does "
        f"(default {DEFAULT_CONFIDENCE}; 0.5: the score itself)",
    )
    s.add_argument("--holdout", type=float, default=0.3, help="share of the evaluation data held out (default 0.3)")
    s.add_argument("--seed", type=int, default=0, help="seed of the held-out split")
    s.add_argument("--num-calib", type=int, help="use at most N calibration samples")
    s.add_argument("--batch-size", type=int, help="calibration batch size")
    s.add_argument("--num-eval", type=int, help="use at most N evaluation samples")
    s.add_argument("--report", help="write the JSON report here (every candidate, the statistics reused)")
    s.add_argument("--quiet", action="store_true", help="no progress bars and no table")
    _add_image_options(s)


def _config(args: argparse.Namespace) -> Any:
    from quant_onnx.api import resolve_config

    if args.config:
        from quant_core.serialization import load_config

        return load_config(args.config)
    return resolve_config(args.preset)


def _image_options(args: argparse.Namespace) -> Any:
    """Image-folder options from the command line (``None`` when none was given)."""
    given = {key: getattr(args, key) for key in ("resize", "mean", "std", "layout") if getattr(args, key) is not None}
    if not given:
        return None
    from quant_onnx.data import ImageOptions

    for key in ("resize", "mean", "std"):
        if key in given:
            given[key] = tuple(given[key])
    return ImageOptions(**given)


def _flag(name: str) -> str:
    """The command-line flag of an argparse destination (``num_calib`` -> ``--num-calib``)."""
    return "--" + name.replace("_", "-")


def _given(args: argparse.Namespace, *names: str) -> str:
    """The flags among ``names`` the command line set, as they are typed (empty: none)."""
    return ", ".join(_flag(name) for name in names if getattr(args, name) is not None)


def _check_counts(args: argparse.Namespace, *names: str) -> None:
    """Sample counts and batch sizes given on the command line are positive."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ConfigError(f"{_flag(name)}: {value} is out of range; allowed: an integer > 0")


def _quantize(args: argparse.Namespace) -> int:
    from quant_onnx.cli.config_overrides import override_config
    from quant_onnx.cli.summary import quantize_summary

    if not Path(args.model).is_file():
        raise ModelError(f"model '{args.model}': file not found")
    if args.dynamic:
        if args.report:  # its ranges and per-layer SQNR come from calibration, which this skips
            raise ConfigError("--report: not written with --dynamic (nothing is calibrated); drop one of them")
        unused = ", ".join(_flag(name) for name in args.static_only if getattr(args, name) not in (None, False))
        if unused:
            raise ConfigError(
                f"{unused}: not used with --dynamic (it calibrates nothing, runs no accuracy recovery and reads "
                "no images); drop them or --dynamic"
            )
    base = _config(args)
    config = override_config(
        base,
        per_channel=args.per_channel,
        calib_method=args.calib_method,
        exclude=args.exclude,
        algorithms=_algorithms(args, base),
    )
    started = time.perf_counter()
    if args.dynamic:
        from quant_onnx.pipeline.dynamic import float_nodes, quantize_dynamic

        model = quantize_dynamic(args.model, args.output, config)
        if not args.quiet:
            summary = quantize_summary(
                model=model,
                input_path=args.model,
                output_path=args.output,
                seconds=time.perf_counter() - started,
                config_name=f"{config.name} (dynamic)",
                float_nodes=float_nodes(model),
                float_reasons="dynamic mode runs only Conv, MatMul and Gemm nodes with a constant weight, "
                "not excluded, whose weight spec is 8-bit symmetric",
            )
            print(summary)
        return EXIT_OK
    if not args.calib_data:
        raise ConfigError("--calib-data: required for static quantization (or use --dynamic)")
    _check_counts(args, "num_calib", "batch_size")
    from quant_onnx.api import ModelQuantizer

    quantizer = ModelQuantizer(config, quiet=args.quiet)
    result = quantizer.quantize(
        args.model,
        args.output,
        args.calib_data,
        num_samples=args.num_calib,
        batch_size=args.batch_size,
        report_path=args.report,
        image_options=_image_options(args),
    )
    if not args.quiet:
        plan = result.calibrated.plan if result.calibrated is not None else None
        summary = quantize_summary(
            model=result.model,
            input_path=args.model,
            output_path=args.output,
            seconds=time.perf_counter() - started,
            config_name=config.name,
            quantized_nodes=None if plan is None else plan.quantized_nodes,
            float_nodes=() if plan is None else [(f.name, f.op_type) for f in plan.float_nodes],
            algorithms=result.algorithms,
            report_path=args.report,
        )
        print(summary)
    return EXIT_OK


def _inspect(args: argparse.Namespace) -> int:
    from quant_onnx.cli.inspection import inspect_lines, inspect_model

    info = inspect_model(args.model, _config(args))
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print("\n".join(inspect_lines(info)))
    return EXIT_OK


def _compare(args: argparse.Namespace) -> int:
    from quant_core.onnx_qdq.model_io import check_output_path, load_model
    from quant_onnx.data import CalibrationReader
    from quant_onnx.reporting.compare import compare_models

    _check_counts(args, "num_samples", "batch_size")
    if args.json:
        for model_path in (args.float_model, args.quant_model):
            check_output_path(args.json, input_path=model_path, what="--json", data={"the data": args.data})
    float_model = load_model(args.float_model)
    quant_model = load_model(args.quant_model)
    batches = CalibrationReader(
        float_model,
        args.data,
        batch_size=args.batch_size,
        num_samples=args.num_samples,
        image_options=_image_options(args),
    )
    result = compare_models(float_model, quant_model, batches, total_batches=batches.num_batches(), quiet=args.quiet)
    if result.top1_agreement is not None:
        print(f"top-1 agreement: {result.top1_agreement:.4f} over {result.samples} samples")
    for name, value in result.output_sqnr_db.items():
        print(f"output {name}: SQNR {value:.2f} dB")
    if result.layers:
        width = max(len("tensor"), *(len(layer.tensor) for layer in result.layers)) + 2
        print(f"\n{'tensor':<{width}}{'SQNR dB':>10}")
        for layer in result.layers:
            print(f"{layer.tensor:<{width}}{layer.sqnr_db:>10.2f}")
    if args.json:
        from quant_onnx.reporting.report import write_report

        write_report(result.to_data(), args.json)
    return EXIT_OK


def _search(args: argparse.Namespace) -> int:
    from quant_algos.search import check_arguments
    from quant_algos.search.metrics import BUILTIN, check_labels_read, resolve_metric
    from quant_onnx.recipe_search import deployment_for, format_table, search

    _check_counts(args, "num_calib", "batch_size", "num_eval")
    if args.target_agreement is not None and args.metric is not None:
        raise ConfigError("--metric: goes with --target-score; --target-agreement scores top-1 agreement")
    if args.metric is None or args.metric in BUILTIN:  # a user metric is loaded once, by the search
        try:
            check_labels_read(resolve_metric(args.metric), args.eval_labels)
        except ConfigError as exc:
            raise ConfigError(f"--eval-{exc}") from None
    if args.target_agreement is not None and not 0.0 <= args.target_agreement <= 1.0:
        raise ConfigError(f"--target-agreement: {args.target_agreement} is out of range; allowed: 0 to 1 (a fraction)")
    try:  # the ranges of --confidence and --seed, checked before the model is read
        check_arguments(0.0, None, args.confidence, seed=args.seed)
    except ConfigError as exc:
        raise ConfigError(f"--{exc}") from None
    if not Path(args.model).is_file():
        raise ModelError(f"model '{args.model}': file not found")
    result = search(
        args.model,
        args.output,
        args.calib_data,
        args.eval_data,
        target=args.target_agreement if args.target_agreement is not None else args.target_score,
        metric=args.metric,
        labels=args.eval_labels,
        deployment=deployment_for(args.target),
        budget_s=args.budget_s,
        confidence=args.confidence,
        holdout=args.holdout,
        seed=args.seed,
        num_samples=args.num_calib,
        batch_size=args.batch_size,
        eval_samples=args.num_eval,
        image_options=_image_options(args),
        report_path=args.report,
        quiet=args.quiet,
    )
    if not args.quiet:
        print(format_table(result.candidates))
        print(_search_outcome(result))
    return EXIT_OK if result.met else EXIT_TARGET_MISSED


def _lower_bound_note(result: Any) -> str:
    """What the acceptance compared with the target, when it was not the score itself."""
    lower = result.select_lower_bound
    if lower is None or result.chosen.score is None or lower == result.chosen.score:
        return ""
    return f" (at least {lower:.4f} at {100 * result.confidence:g}% confidence)"


#: ``quant-onnx search`` ran, but no candidate met the target (the best one is written).
EXIT_TARGET_MISSED = 1


def _search_outcome(result: Any) -> str:
    """The closing lines of ``quant-onnx search``: what was chosen, selection and held-out scores."""
    if result.chosen is None:
        return f"no candidate could be built (stopped by: {result.stopped_by})"
    verdict = "meets" if result.met else "misses"
    lines = [
        f"chosen: {result.chosen.name} ({verdict} {result.metric} >= {result.target:g}; stopped by: "
        f"{result.stopped_by}; {result.seconds:.1f} s)",
        f"{result.metric}: {result.chosen.score:.4f} on {result.select_samples} selection samples"
        + _lower_bound_note(result),
    ]
    if result.holdout_score is not None:
        held = "meets" if result.holdout_met else "misses"
        lines.append(f"held out: {result.holdout_score:.4f} on {result.holdout_samples} samples ({held} the target)")
    passes = ", ".join(f"{p.pre_passes}: {len(p.served)} candidates" for p in result.statistics)
    if passes:
        lines.append(f"statistics passes reused: {passes}")
    reuse = result.reuse
    if reuse.get("samples_if_scored_in_full"):
        skipped = [
            f"{len(reuse['stopped_early'])} stopped early",
            f"{len(reuse['same_model_as'])} the same model as an earlier one",
            f"{len(reuse['deferred'])} deferred",
        ]
        lines.append(
            f"scored {reuse['samples_scored']} of {reuse['samples_if_scored_in_full']} candidate samples "
            f"({', '.join(skipped)}); weight qparams reused {reuse['weight_qparams_reused']} times"
        )
    if result.output_path is not None:
        lines.append(f"wrote {result.output_path}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 1 search target missed, 2 bad input, 130 interrupted)."""
    commands = {"quantize": _quantize, "inspect": _inspect, "compare": _compare, "search": _search}
    return run_command("quant-onnx", build_parser(), commands, argv)
