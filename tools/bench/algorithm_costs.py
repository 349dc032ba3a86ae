"""Measure the search's cost table (``quant_algos.search.space``: ``ALGORITHM_COST``) on one
model: what each algorithm adds to a recipe, in passes of the float model over the
calibration set (the table's unit, so the table does not depend on the machine's speed).

The peer (the unit): the search's statistics pass (the float model over the calibration
set, a histogram per tensor: what ``quant_algos.search.walk`` multiplies the costs by to
fit a budget), as a search over the plain min-max candidate alone measures it. Each algorithm is the
search's own candidate (``refine`` of the min-max candidate with that algorithm, its
configs as the default spaces hold them: AdaRound as ``xint8_adaround`` runs it), timed
as ``ModelQuantizer(config).quantize`` minus the plain recipe's ``quantize``, in the same
process, interleaved ``--repeats`` times (medians). Power-of-two (``xint8``) formats for
the algorithms the NPU space holds; mixed precision on ``a8w8`` (only the default space
holds it). Timings on a shared machine are indicative; the passes are ratios in one run.

    python -m tools.bench.algorithm_costs                       # fmnist_mobilenetv2, 128 samples
    python -m tools.bench.algorithm_costs --algorithms bias_correction cle --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a script: make `tools.*` importable
    sys.path.insert(0, str(REPO_ROOT))

from tools.bench import common  # noqa: E402
from tools.bench.models import MODELS, load_data  # noqa: E402

ALGORITHMS = (
    "cle",
    "smoothquant",
    "bias_correction",
    "bias_correction(analytic)",
    "mixed_precision",
    "gptq",
    "adaround",
    "adaquant",
)


def _candidates(names: list[str]):  # -> dict[str, tuple[Candidate, Candidate]]: (plain, with the algorithm)
    from quant_algos.search.space import (
        CORRECTIONS,
        LEARNED,
        default_space,
        observer_stage,
        power_of_two_space,
        refine,
    )
    from quant_core.algorithm_config import BiasCorrectionConfig, GPTQConfig
    from quant_core.config import CalibrationConfig

    calibration = CalibrationConfig()
    xint8 = observer_stage(power_of_two_space(), calibration)
    a8w8 = observer_stage(default_space(), calibration)
    base = {"xint8": next(c for c in xint8 if c.name == "xint8/minmax"), "a8w8": a8w8[0]}
    single = {group[0].kind: group[0] for group in CORRECTIONS if len(group) == 1}
    single.update({algorithm.kind: algorithm for algorithm in LEARNED})
    single["mixed_precision"] = default_space().mixed_precision[0]
    # Not in the default spaces' stages: measured for a space that holds them (a16w8 does).
    single["gptq"] = GPTQConfig()
    single["bias_correction(analytic)"] = BiasCorrectionConfig(method="analytic")
    chosen = {}
    for name in names:
        plain = base["a8w8" if name == "mixed_precision" else "xint8"]
        chosen[name] = (plain, refine(plain, [(single[name],)])[0])
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="fmnist_mobilenetv2", choices=sorted(MODELS))
    parser.add_argument("--num-calib", type=int, default=128)
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    common.use_checkout_packages()
    from quant_algos.search.space import ALGORITHM_COST
    from quant_onnx.api import ModelQuantizer
    from quant_onnx.recipe_search import search

    model = MODELS[args.model]
    path = str(model.ensure())
    data = load_data(model, num_calib=args.num_calib, num_eval=64)
    calib, evaluation = np.load(data.calib_path), data.eval_x
    chosen = _candidates(args.algorithms)

    def seconds(config) -> float:
        started = time.perf_counter()
        ModelQuantizer(config, quiet=True).quantize(path, None, calib)
        return time.perf_counter() - started

    def one_pass(candidate) -> float:  # the walk's unit: its statistics pass for the plain candidate
        result = search(path, None, calib, evaluation, target=2.0, space=[candidate], quiet=True)
        return result.statistics[0].seconds

    plain_xint8 = next(iter(chosen.values()))[0].config
    seconds(plain_xint8)  # warm imports and caches up
    rows = []
    for name, (plain, candidate) in chosen.items():
        extra, unit = [], []
        for _ in range(args.repeats):
            unit.append(one_pass(plain))
            extra.append(seconds(candidate.config) - seconds(plain.config))
        rows.append((name, statistics.median(extra), statistics.median(unit)))
    print(f"## {args.model}, {len(calib)} calibration samples, {args.repeats} run(s) each (medians)\n")
    headers = ["algorithm", "seconds added", "one pass s", "passes", "ALGORITHM_COST now"]
    table = [
        [name, f"{extra:.2f}", f"{unit:.3f}", f"{extra / unit:.1f}", ALGORITHM_COST.get(name)]
        for name, extra, unit in rows
    ]
    print(common.markdown_table(headers, table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
