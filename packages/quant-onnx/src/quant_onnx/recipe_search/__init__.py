"""Accuracy-driven recipe search: which config meets an accuracy target at the least cost.

Candidates (presets x observers x algorithms, mixed precision, 16-bit fallbacks:
:mod:`~quant_onnx.recipe_search.space`) are built in order of expected cost and scored on
evaluation data (:mod:`~quant_onnx.recipe_search.metrics`); the first that meets the
target wins and is re-scored on a held-out part. One pass over the calibration data per
float model serves every observer choice (:mod:`~quant_onnx.recipe_search.engine`).
:mod:`~quant_onnx.recipe_search.deployment` says where the model runs (onnxruntime here;
``quant_npu.recipe_search`` adds NPUs).

Modules, bottom to top: ``space``, ``metrics`` < ``evaluation`` < ``deployment``,
``results`` < ``engine``.

Example:
    >>> from quant_onnx.recipe_search import SearchSpace, default_space, search
    >>> default_space().formats
    ('a8w8',)
"""

from quant_onnx.recipe_search.deployment import (
    TARGETS,
    Deployment,
    Finished,
    OnnxRuntime,
    deployment_for,
    onnxruntime_runner,
)
from quant_onnx.recipe_search.engine import search
from quant_onnx.recipe_search.evaluation import EvaluationData, split_indices
from quant_onnx.recipe_search.metrics import Metric, Samples, resolve_metric
from quant_onnx.recipe_search.results import CandidateResult, SearchResult, StatisticsPass, format_table
from quant_onnx.recipe_search.space import (
    Candidate,
    SearchSpace,
    default_space,
    make_candidate,
    observer_stage,
    power_of_two_space,
    refine,
    wide_stage,
)

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
