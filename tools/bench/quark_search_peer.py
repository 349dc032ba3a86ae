"""AMD Quark's ``auto_search`` (v1, grid) as the peer of ``quant_onnx.search``: the same
float model, calibration set, selection samples and target, over the space both share.

Runs **inside the Quark virtual environment** (see ``quark_peer.py``); ``search.py
--quark`` calls it as a subprocess with the selection part of the evaluation set our
search selects on. The space is Quark's ``XINT8`` config (power-of-two int8) with
``calibrate_method`` in {NonOverflow (min-max), MinMSE} and ``include_cle`` in {False,
True}, in Quark's grid order; the evaluator scores top-1 agreement with the float model on
the given samples, and the search stops at the first candidate within the tolerance
``1 - target`` (``find_n_candidates: 1``), as ours stops at the first meeting the target.
Prints one JSON line: wall seconds of ``search_model`` (the float model's scoring
included, as ours includes it) and of each scoring in it, candidates run, the first
candidate meeting the target and its agreement. ``--batch``: samples per onnxruntime run
of the evaluator (``search.py`` gives the run size our search's runner uses, so both run
the models equally fast).

    /work/quark-venv/bin/python tools/bench/quark_search_peer.py --model M.onnx \\
        --calib C.npy --select S.npy --target 0.885 --work /tmp/quark_search
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a file: make `tools.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench.quark_peer import _SampleReader


def agreement_evaluator(data: np.ndarray, name: str, batch: int = 32) -> Any:
    """``evaluator(model_path) -> agreement`` with the first model it scores (the float
    model: Quark scores it first, as its baseline, so the baseline is 1.0)."""
    import onnxruntime as ort

    reference: list[np.ndarray] = []

    def top1(path: str) -> np.ndarray:
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        parts = [session.run(None, {name: data[i : i + batch]})[0] for i in range(0, len(data), batch)]
        logits = np.concatenate(parts)
        return logits.reshape(len(logits), -1).argmax(axis=1)

    def evaluate(path: str) -> float:
        started = time.perf_counter()
        predicted = top1(path)
        evaluate.seconds.append(time.perf_counter() - started)  # type: ignore[attr-defined]
        if not reference:
            reference.append(predicted)
        return float(np.mean(predicted == reference[0]))

    evaluate.seconds = []  # type: ignore[attr-defined]
    return evaluate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--calib", type=Path, required=True, help=".npy calibration set")
    parser.add_argument("--select", type=Path, required=True, help=".npy samples the search selects on")
    parser.add_argument("--target", type=float, required=True, help="top-1 agreement to reach")
    parser.add_argument("--work", type=Path, required=True, help="folder for Quark's candidates and logs")
    parser.add_argument("--batch", type=int, default=32, help="samples per onnxruntime run of the evaluator")
    args = parser.parse_args(argv)

    import onnx
    from quark.onnx import PowerOfTwoMethod, QConfig
    from quark.onnx.quantization.auto_search import AutoSearch
    from quark.onnx.quantization.auto_search.auto_search_v1 import AutoSearchConfig

    logging.disable(logging.WARNING)
    model = onnx.load(str(args.model))
    initializers = {t.name for t in model.graph.initializer}
    name = next(i.name for i in model.graph.input if i.name not in initializers)
    calib = np.load(args.calib).astype(np.float32)
    select = np.load(args.select).astype(np.float32)
    args.work.mkdir(parents=True, exist_ok=True)

    config = QConfig.get_default_config("XINT8")
    config.global_quant_config.print_summary = False
    search_config = AutoSearchConfig()
    search_config.search_space = {
        "calibrate_method": [PowerOfTwoMethod.NonOverflow, PowerOfTwoMethod.MinMSE],
        "include_cle": [False, True],
    }
    evaluator = agreement_evaluator(select, name, args.batch)
    search_config.search_evaluator = evaluator
    search_config.search_metric_tolerance = 1.0 - args.target
    # Every key: Quark 0.13 reads each without a default.
    search_config.search_stop_condition = {
        "find_n_candidates": 1,
        "find_best_candidate": -1,
        "iteration_limit": 1e5,
        "time_limit": 30 * 24 * 3600,
    }
    for field in ("search_cache_dir", "search_output_dir"):
        setattr(search_config, field, str(args.work))
    search_config.search_log_path = str(args.work / "auto_search.log")

    started = time.perf_counter()
    searcher = AutoSearch(str(args.model), config, search_config, calibration_data_reader=_SampleReader(name, calib))
    searcher.search_model()
    seconds = time.perf_counter() - started
    found = searcher.candidates[0] if searcher.candidates else None
    result = {
        "seconds": seconds,
        "evaluate_seconds": evaluator.seconds,  # each scoring: the float model first, then each candidate
        "candidates_run": searcher.iterations,
        "scores": {str(k): 1.0 - v for k, v in searcher.searched_space.items()},
        "met": found is not None,
        "winner_index": None if found is None else found["config_index"],
        "winner_agreement": None if found is None else 1.0 - found["difference"],
        "configs": [json.loads(json.dumps(c, default=str)) for c in searcher.all_configs],
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
