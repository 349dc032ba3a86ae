"""Benchmark of ``quant_onnx.search``: how much a recipe search costs against running the
recipe it finds on its own (the peer: ``ModelQuantizer(winner.config).quantize``, the same
calibration set, in the same run, timed twice after the search: their mean is the
denominator, and load on the shared machine drifting shows as two different numbers), and whether the winner holds on held-out data. A second peer is the
recipe alone *and checked*: quantized, then the float and the quantized model run over
the evaluation set (what trying one recipe by hand costs); ``floor`` is that peer over the
first, the ratio a search cannot go under whatever it skips (it must score its winner).

Default: fmnist_mobilenetv2 with ``--target xint8`` (power-of-two int8 formats only), top-1
agreement with the float model >= 0.885 on 1,000 Fashion-MNIST test images (30% held out),
128 calibration images. Prints the search's table, the winner's selection and held-out
scores, its accuracy against the labels on the whole evaluation set, the search time, the
recipe-alone time and their ratio, and whether the searched model is byte-identical to
the recipe alone's (it should be). Timings on a shared machine are indicative; the ratio
is measured in one process, one thread.

With ``--quark`` (xint8 only), also Quark's ``auto_search`` (``quark_search_peer.py`` in
Quark's interpreter, a subprocess) over the space both can express, xint8 with min-max
or power-of-two MinMSE activations, each with and without CLE, on the same calibration
set and the same selection samples, against our search over that same space, in the same
run (issue 27: same or better metric, at most 0.3x its time).

    python -m tools.bench.search                     # the default above
    python -m tools.bench.search --models fmnist_resnet18 --target-agreement 0.99 --no-npu
    python -m tools.bench.search --quark             # and Quark's auto_search beside it
    python -m tools.bench.search --backend torch     # quant_torch_fx.search, the same default

With ``--backend torch``, the same search through ``quant_torch_fx.search`` on the torch
definition of the model (``tools/reference_models/torch_weights.py``), against the winning
recipe alone (``ModelQuantizer(config).quantize_model`` + ``freeze``), one torch thread
unless ``--threads`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a script: make `tools.*` importable
    sys.path.insert(0, str(REPO_ROOT))

from tools.bench import common  # noqa: E402
from tools.bench.models import MODELS, input_name, load_data  # noqa: E402


def shared_space():  # -> SearchSpace: what Quark's auto_search is given too (module docstring)
    from quant_core.algorithm_config import CLEConfig
    from quant_core.observer_config import MinMax, PowerOfTwoMSE
    from quant_onnx.recipe_search import SearchSpace

    return SearchSpace(
        formats=("xint8",), activation_observers=(MinMax(), PowerOfTwoMSE()), corrections=((CLEConfig(),),)
    )


def run_size(eval_x: np.ndarray, batch: int = 32) -> int:
    """Samples per onnxruntime run our search's runner takes from a batch of ``batch``
    (``quant_onnx.recipe_search.deployment.RUN_INPUT_BYTES``): the Quark peer's evaluator
    runs its models in runs of the same size."""
    from quant_onnx.pipeline.calibrate import even_step
    from quant_onnx.recipe_search.deployment import RUN_INPUT_BYTES

    most = max(1, RUN_INPUT_BYTES // max(1, eval_x[0].nbytes))
    return batch if batch <= most else even_step(batch, most)


def against_quark(name: str, path: Path, calib_path: Path, eval_x: np.ndarray, target: float) -> None:
    """Our search over :func:`shared_space` and Quark's ``auto_search`` over the same, one
    after the other; prints both metrics and times."""
    from quant_onnx.recipe_search import deployment_for, search, split_indices
    from tools.bench.quark_peer import quark_python

    python = quark_python()
    if python is None:
        print("quark: skipped (no Quark interpreter)")
        return
    calib = np.load(calib_path)
    started = time.perf_counter()
    ours = search(
        str(path),
        None,
        calib,
        eval_x,
        target=target,
        confidence=0.5,  # Quark's criterion: the score itself within 1 - target
        space=shared_space(),
        deployment=deployment_for("xint8"),
        quiet=True,
    )
    ours_seconds = time.perf_counter() - started
    select, _ = split_indices(len(eval_x), 0.3, seed=0)  # search's own split (its defaults)
    with tempfile.TemporaryDirectory() as work:
        selected = Path(work) / "select.npy"
        np.save(selected, eval_x[select])
        command = [python, str(Path(__file__).with_name("quark_search_peer.py")), "--model", str(path)]
        command += ["--calib", str(calib_path), "--select", str(selected), "--target", str(target)]
        command += ["--work", str(Path(work) / "quark"), "--batch", str(run_size(eval_x))]
        done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"quark: FAILED: {done.stderr[-1500:]}")
        return
    quark = json.loads(done.stdout.strip().splitlines()[-1])
    chosen = ours.chosen
    print(f"\n### {name}: the shared space (xint8 x {{min-max, MinMSE}} x {{-, CLE}}), agreement >= {target:g}")
    print(f"ours: {chosen.name if chosen else '-'} {'met' if ours.met else 'missed'} ", end="")
    print(
        f"{common.fmt(chosen.score if chosen else None, 4)} after {len(ours.candidates)} candidates, {ours_seconds:.1f} s"
    )
    scores = {
        quark["configs"][int(k)]["calibrate_method"]
        + ("+cle" if quark["configs"][int(k)]["include_cle"] else ""): round(v, 4)
        for k, v in quark["scores"].items()
    }
    print(
        f"quark auto_search: {'met' if quark['met'] else 'missed'}; {quark['candidates_run']} candidates {scores}; ",
        end="",
    )
    scoring = quark.get("evaluate_seconds", [])
    print(f"{quark['seconds']:.1f} s (of which scoring, the float model first: {[round(t, 1) for t in scoring]} s)")
    best = max(quark["scores"].values()) if quark["scores"] else None
    print(
        f"time ratio ours / quark {common.fmt(common.ratio(ours_seconds, quark['seconds']), 2)}x (target <= 0.3x); ",
        end="",
    )
    print(f"metric ours {common.fmt(chosen.score if chosen else None, 4)} vs quark's best {common.fmt(best, 4)}")


def summary(result, evaluated: int, accuracy, timings: tuple[float, float, float, float]) -> None:
    """The lines both backends' benches print after the table: the chosen recipe, its
    selection and held-out scores, what was reused, and the time ratios (``timings``: the
    search, the recipe alone after it and again, checking the recipe on the evaluation set)."""
    search_seconds, after_seconds, again_seconds, checking_seconds = timings
    alone_seconds = (after_seconds + again_seconds) / 2
    chosen = result.chosen
    print(f"\nchosen: {chosen.name} ({'met' if result.met else 'missed'}; stopped by {result.stopped_by})")
    lower = "" if result.select_lower_bound is None else f", lower bound {result.select_lower_bound:.4f}"
    confidence = "" if result.confidence is None else f" at confidence {result.confidence:g}{lower}"
    print(f"{result.metric}: selection {chosen.score:.4f} ({result.select_samples} samples{confidence}), ", end="")
    print(f"held out {common.fmt(result.holdout_score, 4)} ({result.holdout_samples} samples)")
    print(f"accuracy vs labels (all {evaluated} evaluation images): {common.fmt(accuracy, 4)}")
    print(f"statistics passes: {[(p.pre_passes, len(p.served), round(p.seconds, 2)) for p in result.statistics]}")
    print(f"reuse: {result.reuse}")
    candidates = sum(r.seconds for r in result.candidates)
    print(
        f"search {search_seconds:.2f} s (float reference {result.reference_seconds:.2f} s, candidates {candidates:.2f} s)"
    )
    print(f"recipe alone {after_seconds:.2f} s, again {again_seconds:.2f} s (mean {alone_seconds:.2f} s); ", end="")
    print(f"checking it on the evaluation set {checking_seconds:.2f} s")
    print(f"ratio {common.fmt(common.ratio(search_seconds, alone_seconds), 2)}x (target <= 1.5x); ", end="")
    checked = alone_seconds + checking_seconds
    print(f"against the recipe alone and checked {common.fmt(common.ratio(search_seconds, checked), 2)}x; ", end="")
    print(f"floor {common.fmt(common.ratio(checked, alone_seconds), 2)}x")


def bench(
    name: str,
    target: float,
    npu: str | None,
    num_calib: int,
    num_eval: int,
    budget_s: float | None,
    confidence: float,
    metric: str = "agreement",
) -> None:
    common.use_checkout_packages()
    from quant_onnx.api import ModelQuantizer
    from quant_onnx.recipe_search import deployment_for, format_table, onnxruntime_runner, search

    model = MODELS[name]
    path = model.ensure()
    data = load_data(model, num_calib=num_calib, num_eval=num_eval)
    calib = np.load(data.calib_path)

    from quant_onnx.recipe_search.evaluation import load_evaluation_data

    def recipe_alone(config):  # the peer: the same call a user makes with the winning config
        started = time.perf_counter()
        alone = ModelQuantizer(config, quiet=True).quantize(str(path), None, calib)
        return alone, time.perf_counter() - started

    started = time.perf_counter()
    result = search(
        str(path),
        None,
        calib,
        data.eval_x,
        target=target,
        deployment=deployment_for(npu),
        budget_s=budget_s,
        confidence=confidence,
        metric=metric,
        labels=data.eval_labels if metric == "accuracy" else None,
        quiet=True,
    )
    search_seconds = time.perf_counter() - started
    print(f"\n## {name}: {result.deployment}, {result.metric} >= {target:g}\n")
    print(format_table(result.candidates))
    if result.chosen is None or result.model is None:
        print("no candidate could be built")
        return
    chosen = result.chosen
    assert chosen.config is not None
    alone, after_seconds = recipe_alone(chosen.config)
    # The first timing of the peer ran after the search had warmed imports and caches
    # up; a second one measures the drift of the machine's load.
    alone, again_seconds = recipe_alone(chosen.config)

    started = time.perf_counter()
    float_model = onnx.load(str(path))
    evaluation = load_evaluation_data(float_model, data.eval_x)
    for runner in (onnxruntime_runner(float_model), onnxruntime_runner(alone.model)):
        for chunk in evaluation.chunks(np.arange(evaluation.count)):
            runner(evaluation.feeds(chunk))
    checking_seconds = time.perf_counter() - started

    logits = onnxruntime_runner(result.model)({input_name(path): data.eval_x})[0]
    accuracy = None if data.eval_labels is None else common.accuracy(common.top1(logits), data.eval_labels)
    same = alone.model.SerializeToString() == result.model.SerializeToString()
    timings = (search_seconds, after_seconds, again_seconds, checking_seconds)
    summary(result, len(data.eval_x), accuracy, timings)
    print(f"searched model byte-identical to the recipe alone's: {same}")


def bench_torch(
    name: str, target: float, npu: str | None, num_calib: int, num_eval: int, threads: int, confidence: float
) -> None:
    """``quant_torch_fx.search`` on the torch definition of ``name`` against the winning
    recipe alone (``ModelQuantizer(config).quantize_model`` + ``freeze``, the same
    calibration batches), timed twice after the search in the same process; and whether
    the searched model is the recipe alone's (same ``state_dict``)."""
    common.use_checkout_packages()
    import torch

    from quant_torch_fx import ModelQuantizer
    from quant_torch_fx import search as torch_search
    from quant_torch_fx.recipe_search import torch_runner
    from tools.bench.torch_fx import load_torch_model

    torch.set_num_threads(threads)
    model = load_torch_model(name)
    data = load_data(MODELS[name], num_calib=num_calib, num_eval=num_eval)
    calib = np.load(data.calib_path)
    example = torch.from_numpy(calib[:1])
    batches = [torch.from_numpy(np.ascontiguousarray(calib[i : i + 32])) for i in range(0, len(calib), 32)]

    def recipe_alone(config):  # the peer: the same calls a user makes with the winning config
        started = time.perf_counter()
        q = ModelQuantizer(config, quiet=True)
        frozen = q.freeze(q.quantize_model(model, example, batches))
        return frozen, time.perf_counter() - started

    # torch.export's first call in a process pays for imports and caches (seconds): made
    # before anything is timed, so neither side carries it.
    ModelQuantizer("xint8", quiet=True).prepare(model, example)
    started = time.perf_counter()
    result = torch_search(
        model,
        example,
        calib,
        data.eval_x,
        target=target,
        confidence=confidence,
        deployment=npu,
        batch_size=32,
        quiet=True,
    )
    search_seconds = time.perf_counter() - started
    from quant_algos.search import format_table

    print(f"\n## {name} (torch, {threads} thread(s)): {result.deployment}, {result.metric} >= {target:g}\n")
    print(format_table(result.candidates))
    if result.chosen is None or result.model is None:
        print("no candidate could be built")
        return
    chosen = result.chosen
    alone, after_seconds = recipe_alone(chosen.config)
    alone, again_seconds = recipe_alone(chosen.config)
    started = time.perf_counter()
    for run in (torch_runner(model, ["x"], None), torch_runner(alone, ["x"], None)):
        for i in range(0, len(data.eval_x), 32):
            run({"x": data.eval_x[i : i + 32]})
    checking_seconds = time.perf_counter() - started
    logits = torch_runner(result.model, ["x"], None)({"x": data.eval_x})[0]
    accuracy = None if data.eval_labels is None else common.accuracy(common.top1(logits), data.eval_labels)
    same = all(
        torch.equal(a, b)
        for a, b in zip(alone.state_dict().values(), result.model.state_dict().values(), strict=True)
        if isinstance(a, torch.Tensor)
    )
    timings = (search_seconds, after_seconds, again_seconds, checking_seconds)
    summary(result, len(data.eval_x), accuracy, timings)
    print(f"searched model the recipe alone's (same state_dict tensors): {same}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["fmnist_mobilenetv2"], choices=sorted(MODELS))
    parser.add_argument("--target-agreement", type=float, default=0.885, help="the target of --metric")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--target", default="xint8", choices=("xint8",))
    where.add_argument("--no-npu", action="store_true")
    parser.add_argument("--num-calib", type=int, default=128)
    parser.add_argument("--num-eval", type=int, default=1000)
    parser.add_argument("--budget-s", type=float)
    parser.add_argument("--confidence", type=float, default=0.9, help="the search's (0.5: the score itself)")
    parser.add_argument(
        "--metric", default="agreement", choices=("agreement", "accuracy"), help="accuracy: against the labels"
    )
    parser.add_argument("--quark", action="store_true", help="also Quark's auto_search over the shared space")
    parser.add_argument("--backend", default="onnx", choices=("onnx", "torch"), help="torch: quant_torch_fx.search")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (--backend torch)")
    args = parser.parse_args(argv)
    if args.backend == "torch":
        for name in args.models:
            npu = None if args.no_npu else args.target
            bench_torch(name, args.target_agreement, npu, args.num_calib, args.num_eval, args.threads, args.confidence)
        return 0
    if args.quark and args.no_npu:
        parser.error("--quark: the shared space is xint8's; drop --no-npu")
    for name in args.models:
        npu = None if args.no_npu else args.target
        bench(
            name, args.target_agreement, npu, args.num_calib, args.num_eval, args.budget_s, args.confidence, args.metric
        )
        if args.quark:
            model = MODELS[name]
            data = load_data(model, num_calib=args.num_calib, num_eval=args.num_eval)
            against_quark(name, model.ensure(), data.calib_path, data.eval_x, args.target_agreement)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
