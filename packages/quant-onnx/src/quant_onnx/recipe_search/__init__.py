"""Accuracy-driven recipe search on ONNX models: which config meets an accuracy target at
the least cost (``quant-onnx search``, :func:`quant_onnx.search`).

The search itself, the same for both backends, is :mod:`quant_algos.search`: the
candidate space and its cost order, the metrics, the evaluation split and the exact
early stop, the loop, the Pareto table and the report (its names are re-exported here).
What is ONNX's: :mod:`~quant_onnx.recipe_search.engine` builds each candidate as
:class:`~quant_onnx.api.ModelQuantizer` writes it (one statistics pass per float model
for every observer choice, shared pre-passes and weight qparams) and runs it;
:mod:`~quant_onnx.recipe_search.deployment` says where the model runs (onnxruntime here;
``quant_npu.recipe_search`` adds NPUs); :mod:`~quant_onnx.recipe_search.evaluation`
reads evaluation data in any form calibration data takes.

Modules, bottom to top: ``evaluation``, ``deployment`` < ``engine``.

Example:
    >>> from quant_onnx.recipe_search import SearchSpace, default_space, search
    >>> default_space().formats
    ('a8w8',)
"""

from quant_algos.search import (
    TARGETS,
    Candidate,
    CandidateResult,
    EvaluationData,
    Metric,
    Samples,
    SearchResult,
    SearchSpace,
    StatisticsPass,
    default_space,
    format_table,
    make_candidate,
    observer_stage,
    power_of_two_space,
    refine,
    resolve_metric,
    split_indices,
    wide_stage,
)
from quant_onnx.recipe_search.deployment import (
    Deployment,
    Finished,
    OnnxRuntime,
    deployment_for,
    onnxruntime_runner,
)
from quant_onnx.recipe_search.engine import search
from quant_onnx.recipe_search.evaluation import load_evaluation_data

__all__ = [
    "TARGETS",
    "Candidate",
    "CandidateResult",
    "Deployment",
    "EvaluationData",
    "Finished",
    "Metric",
    "OnnxRuntime",
    "Samples",
    "SearchResult",
    "SearchSpace",
    "StatisticsPass",
    "default_space",
    "deployment_for",
    "format_table",
    "load_evaluation_data",
    "make_candidate",
    "observer_stage",
    "onnxruntime_runner",
    "power_of_two_space",
    "refine",
    "resolve_metric",
    "search",
    "split_indices",
    "wide_stage",
]
