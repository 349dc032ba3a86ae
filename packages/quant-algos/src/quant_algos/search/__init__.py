"""Accuracy-driven recipe search, backend-neutral: which config meets an accuracy target
at the least cost. ``quant_onnx.search`` and ``quant_torch_fx.search`` are this search
over their own "build and run a candidate" (:class:`~quant_algos.search.walk.Backend`).

Candidates (presets x observers x algorithms, mixed precision, 16-bit fallbacks:
:mod:`~quant_algos.search.space`) are built in order of expected cost and scored on
evaluation data (:mod:`~quant_algos.search.metrics`,
:mod:`~quant_algos.search.evaluation`); the first that meets the target (for a per-sample
metric: the lower bound of its mean at the search's confidence) wins and is
re-scored on a held-out part (:mod:`~quant_algos.search.walk`); every candidate is a row
of the Pareto table and the JSON report (:mod:`~quant_algos.search.results`).
:mod:`~quant_algos.search.targets` says what a hardware target (``xint8``) allows.

Nothing here imports onnx, onnxruntime or torch.

Modules, bottom to top: ``space``, ``metrics`` < ``evaluation`` < ``results``, ``targets``
< ``walk``.

Example:
    >>> from quant_algos.search import default_space, target_space
    >>> default_space().formats, target_space("xint8").formats
    (('a8w8',), ('xint8',))
"""

from quant_algos.search.evaluation import (
    DEFAULT_CONFIDENCE,
    Acceptance,
    EvaluationData,
    Runner,
    Scored,
    evaluation_data,
    lower_bound,
    split_indices,
)
from quant_algos.search.metrics import Metric, Samples, resolve_metric
from quant_algos.search.results import CandidateResult, SearchResult, StatisticsPass, format_table
from quant_algos.search.space import (
    Candidate,
    SearchSpace,
    default_space,
    make_candidate,
    observer_stage,
    power_of_two_space,
    refine,
    wide_stage,
)
from quant_algos.search.targets import TARGETS, check_target, power_of_two_reason, target_reason, target_space
from quant_algos.search.walk import Backend, Budget, Build, Goal, check_arguments, float_goal, search_with

__all__ = [
    "DEFAULT_CONFIDENCE",
    "TARGETS",
    "Acceptance",
    "Backend",
    "Budget",
    "Build",
    "Candidate",
    "CandidateResult",
    "EvaluationData",
    "Goal",
    "Metric",
    "Runner",
    "Samples",
    "Scored",
    "SearchResult",
    "SearchSpace",
    "StatisticsPass",
    "check_arguments",
    "check_target",
    "default_space",
    "evaluation_data",
    "float_goal",
    "format_table",
    "lower_bound",
    "make_candidate",
    "observer_stage",
    "power_of_two_reason",
    "power_of_two_space",
    "refine",
    "resolve_metric",
    "search_with",
    "split_indices",
    "target_reason",
    "target_space",
    "wide_stage",
]
