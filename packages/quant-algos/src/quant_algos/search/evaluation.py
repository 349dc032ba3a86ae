"""The evaluation data of a search: held in memory, split once (seeded) into the part the
search selects on and a held-out part it never sees, and run batch by batch through a
candidate with early stopping, the samples the float model is least sure of first
(:func:`hardest_first`).

Example:
    >>> select, holdout = split_indices(10, 0.3, seed=0)
    >>> len(select), len(holdout), sorted([*select, *holdout]) == list(range(10))
    (7, 3, True)
    >>> split_indices(10, 0.3, seed=0)[1].tolist() == holdout.tolist()  # the same split every time
    True
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from statistics import NormalDist
from typing import Any, TypeVar

import attrs
import numpy as np

from quant_algos.search.metrics import Metric, Outputs, Samples
from quant_core.errors import UNREADABLE_ARRAY_FILE, ConfigError, DataError, QuantError, one_line

_T = TypeVar("_T")

Runner = Callable[[Mapping[str, np.ndarray]], Sequence[np.ndarray]]
"""``feeds -> outputs``: a candidate as the deployment runs it, outputs in the model's order."""


#: The default confidence that a winner's score holds beyond the samples it was selected on.
DEFAULT_CONFIDENCE = 0.9


def lower_bound(mean: float, count: int, confidence: float) -> float:
    """The one-sided lower confidence bound of a mean of ``count`` scores in ``[0, 1]``
    (Wilson's score interval; a score in ``[0, 1]`` varies at most as a 0/1 score with the
    same mean does, so the bound holds for any per-sample metric). ``confidence`` 0.5
    gives the mean itself.

    Example:
        >>> round(lower_bound(0.99, 700, 0.9), 4), lower_bound(0.99, 700, 0.5)
        (0.9839, 0.99)
        >>> round(lower_bound(1.0, 300, 0.9), 4)  # 300 of 300: not 1
        0.9946
    """
    z = NormalDist().inv_cdf(confidence)
    if count <= 0 or z <= 0.0:
        return mean
    spread = z * z / count
    centre = mean + spread / 2
    half = z * math.sqrt(max(mean * (1.0 - mean), 0.0) / count + spread / (4 * count))
    return (centre - half) / (1.0 + spread)


@attrs.frozen
class Acceptance:
    """When a candidate's score meets the search's target.

    A per-sample metric (agreement, accuracy...) meets it when the lower bound of its mean
    at ``confidence`` (:func:`lower_bound`) over the selection samples does: the first
    candidate that meets a target by zero margin on a few hundred samples holds on others
    by chance (a held-out part of 300 said so). A whole-set metric (SQNR, mAP) has no
    per-sample spread to bound: its score itself must reach the target.

    Example:
        >>> accept = Acceptance(0.98)
        >>> accept.meets(0.9829, 700, per_sample=True), accept.meets(0.99, 700, per_sample=True)
        (False, True)
        >>> Acceptance(0.98, confidence=0.5).meets(0.9829, 700, per_sample=True)
        True
        >>> Acceptance(0.98, confidence=1.0)
        Traceback (most recent call last):
        ...
        quant_core.errors.ConfigError: confidence: 1.0 is out of range; allowed: 0.5 <= confidence < 1
    """

    target: float
    confidence: float = attrs.field(default=DEFAULT_CONFIDENCE)

    @confidence.validator
    def _check(self, _: Any, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0.5 <= value < 1.0:
            raise ConfigError(f"confidence: {value!r} is out of range; allowed: 0.5 <= confidence < 1")

    def meets(self, score: float, count: int, *, per_sample: bool) -> bool:
        """Whether ``score`` over ``count`` samples meets the target."""
        value = lower_bound(score, count, self.confidence) if per_sample else score
        return value >= self.target

    def reachable(self, best_mean: float, total: int) -> bool:
        """Whether a per-sample mean that can still reach ``best_mean`` over ``total``
        samples could meet the target (what the exact early stop asks)."""
        return self.meets(best_mean, total, per_sample=True)


def split_indices(count: int, holdout: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(select, holdout)`` sample indices, each sorted: a seeded random ``holdout``
    fraction of ``count`` samples (at least one each when ``0 < holdout < 1``).

    Example:
        >>> split_indices(4, 0.0, seed=1)[1].tolist()
        []
    """
    if not 0.0 <= holdout < 1.0:
        raise ConfigError(f"holdout: {holdout!r} is out of range; allowed: 0 <= holdout < 1")
    held = 0 if holdout == 0.0 else min(count - 1, max(1, round(count * holdout)))
    order = np.random.default_rng(seed).permutation(count)
    return np.sort(order[held:]), np.sort(order[:held])


#: Values per sample above which :func:`hardest_first` keeps the index order: a margin over
#: a whole map (segmentation, detection heads) says little and would copy the outputs.
MARGIN_MAX_VALUES = 1 << 16


def hardest_first(reference: Sequence[np.ndarray], indices: np.ndarray) -> np.ndarray | None:
    """``indices`` in scoring order: by the float model's top-1 margin on its first output
    (its largest value less its second largest), smallest first, ties in index order;
    ``None`` when there is no margin to order by (one value, or more than
    :data:`MARGIN_MAX_VALUES`, per sample).

    The margin is over the whole output of a sample, as the built-in metrics read it, except
    for an output of three axes, ``(samples, positions, classes)`` (a recogniser's or a
    token classifier's logits): there it is the smallest margin over the positions, the
    position most likely to change.

    A candidate changes the top-1 class mostly where the float model hesitates, so its
    misses come first and the exact early stop (:func:`score_outputs`) ends a candidate
    that cannot meet the target after fewer samples. The order changes when a candidate
    stops, never whether it meets the target: a complete score is the same sum. And a
    stopped candidate's bound (its score with every remaining sample perfect) is close to
    what it would score in full, since the samples left are the ones it is least likely
    to miss.

    Example:
        >>> logits = np.array([[5.0, 0.0], [0.1, 0.0], [2.0, 1.0], [0.1, 0.0]], np.float32)
        >>> hardest_first([logits], np.arange(4)).tolist()
        [1, 3, 2, 0]
        >>> hardest_first([logits[:, :1]], np.arange(4)) is None
        True
        >>> lines = np.array([[[3.0, 0.0], [0.5, 0.0]], [[1.0, 0.0], [2.0, 0.0]]])  # 2 lines, 2 positions
        >>> hardest_first([lines], np.arange(2)).tolist()  # line 0 has the least certain position
        [0, 1]
    """
    first = np.asarray(reference[0]) if len(reference) else np.empty((0, 0))
    if first.ndim < 2 or not len(indices) or not 2 <= first[0].size <= MARGIN_MAX_VALUES:
        return None
    values = first[indices]
    values = values if values.ndim == 3 else values.reshape(len(indices), 1, -1)
    if values.shape[-1] < 2:
        return None
    top = np.partition(values.astype(np.float64, copy=False), -2, axis=-1)[..., -2:]
    margin = (top[..., 1] - top[..., 0]).min(axis=1)
    margin[np.isnan(margin)] = np.inf  # a sample the float model gives no class: last
    return np.asarray(indices)[np.argsort(margin, kind="stable")]


@attrs.frozen(eq=False)
class EvaluationData:
    """Every evaluation sample (``inputs``: input name -> array, first axis = samples),
    the labels if any, and the seeded split.

    Example:
        >>> data = EvaluationData({"x": np.zeros((4, 2), np.float32)}, None, np.arange(3), np.array([3]), 2, None)
        >>> [b.tolist() for b in data.chunks(data.select)]
        [[0, 1], [2]]
    """

    inputs: Mapping[str, np.ndarray]
    labels: np.ndarray | None
    select: np.ndarray
    holdout: np.ndarray
    batch_size: int
    fixed_batch: int | None

    @property
    def count(self) -> int:
        return len(next(iter(self.inputs.values())))

    def chunks(self, indices: np.ndarray) -> list[np.ndarray]:
        """``indices`` in runs of the batch size (of the model's fixed batch, if it has one)."""
        size = self.fixed_batch or self.batch_size
        return [indices[i : i + size] for i in range(0, len(indices), size)]

    def feeds(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """The inputs of ``indices``; a model with a fixed batch gets it, the last sample repeated."""
        if self.fixed_batch is not None and len(indices) < self.fixed_batch:
            indices = np.concatenate([indices, np.full(self.fixed_batch - len(indices), indices[-1])])
        return {name: np.ascontiguousarray(values[indices]) for name, values in self.inputs.items()}

    def samples(self, indices: np.ndarray) -> Samples:
        return Samples(indices, None if self.labels is None else self.labels[indices])


def evaluation_data(
    inputs: Mapping[str, np.ndarray],
    *,
    labels: Any = None,
    holdout: float = 0.3,
    seed: int = 0,
    batch_size: int = 32,
    fixed_batch: int | None = None,
) -> EvaluationData:
    """Evaluation samples already in memory (``inputs``: input name -> array, first axis =
    samples, as a backend read them), their labels (an array or ``.npy`` path, one per
    sample) and the seeded split (:func:`split_indices`).

    Example:
        >>> data = evaluation_data({"x": np.zeros((10, 2), np.float32)}, holdout=0.3)
        >>> len(data.select), len(data.holdout)
        (7, 3)
    """
    if not inputs:
        raise DataError("evaluation data: no samples")
    count = len(next(iter(inputs.values())))
    if count == 0:
        raise DataError("evaluation data: no samples")
    if count < 2 and holdout > 0:
        raise DataError(f"evaluation data: {count} sample; a held-out part needs at least 2")
    label_array = None if labels is None else _labels(labels, count)
    select, held = split_indices(count, holdout, seed)
    return EvaluationData(dict(inputs), label_array, select, held, batch_size, fixed_batch)


def _labels(labels: Any, count: int) -> np.ndarray:
    if isinstance(labels, str) or hasattr(labels, "__fspath__"):
        try:
            labels = np.load(labels, allow_pickle=False)
        except UNREADABLE_ARRAY_FILE as exc:
            raise DataError(f"labels: cannot read '{labels}': {exc}") from None
    array = np.asarray(labels)
    if len(array) < count:
        raise DataError(f"labels: {len(array)} labels for {count} evaluation samples; allowed: one per sample")
    return array[:count]


def as_outputs(names: Sequence[str], values: Sequence[np.ndarray]) -> Outputs:
    """What a metric receives: the one array of a single-output model, else name -> array."""
    return np.asarray(values[0]) if len(names) == 1 else dict(zip(names, values, strict=True))


def check_metric(metric: Metric, names: Sequence[str], reference: Sequence[np.ndarray], data: EvaluationData) -> None:
    """Score the float model against itself on the first selection batch, so a metric that
    cannot work (labels missing, wrong return shape, an exception of its own) fails once,
    before any candidate is built, instead of failing every candidate.

    Example:
        >>> from quant_algos.search.metrics import resolve_metric
        >>> data = EvaluationData({"x": np.zeros((2, 3), np.float32)}, None, np.arange(2), np.array([], int), 2, None)
        >>> check_metric(resolve_metric("accuracy"), ["y"], [np.eye(2, 3)], data)
        Traceback (most recent call last):
        ...
        quant_core.errors.DataError: metric 'accuracy': needs labels (--eval-labels, or labels= in Python)
    """
    chunk = data.chunks(data.select)[0]
    expected = as_outputs(names, [r[chunk] for r in reference])
    _call_metric(metric, "the float model's outputs", metric.score, expected, expected, data.samples(chunk))


def _call_metric(metric: Metric, where: str, call: Callable[..., _T], *args: Any) -> _T:
    """``call(*args)`` of the user's metric, any exception of its own as one DataError naming
    the metric (the walk then marks the candidate failed and goes on; a KeyError or an
    IndexError from a user's lookup would have ended the whole search)."""
    try:
        return call(*args)
    except QuantError:
        raise
    except Exception as exc:  # the user's function failed: say which, in one line
        detail = one_line(f"{type(exc).__name__}: {exc}")
        raise DataError(f"metric {metric.name!r}: raised {detail} on {where}") from None


def collect(
    runner: Runner, data: EvaluationData, indices: np.ndarray, names: Sequence[str] | None = None
) -> list[np.ndarray]:
    """``runner``'s outputs over ``indices``, concatenated (the float reference). Every
    output must have the batch as its first axis (``names``: what the message calls them,
    default ``output_0``...): candidates are scored sample by sample, so a shape, a
    constant or a scalar output cannot be, and is refused naming it.

    Example:
        >>> data = EvaluationData({"x": np.zeros((4, 3), np.float32)}, None, np.arange(4), np.array([], int), 4, None)
        >>> collect(lambda feeds: [feeds["x"], np.float32(feeds["x"].sum())], data, np.arange(4))
        Traceback (most recent call last):
        ...
        quant_core.errors.DataError: evaluation data: output 'output_1' has shape [] for a batch of 4 samples; ...
    """
    parts: list[list[np.ndarray]] = []
    for chunk in data.chunks(indices):
        values = [np.asarray(v) for v in runner(data.feeds(chunk))]
        for i, value in enumerate(values):
            if value.ndim == 0 or value.shape[0] < len(chunk):  # a fixed-batch model's padding makes it longer
                name = names[i] if names is not None else f"output_{i}"
                raise DataError(
                    f"evaluation data: output {name!r} has shape {list(value.shape)} for a batch of {len(chunk)} "
                    "samples; the search scores every output sample by sample: allowed: outputs whose first axis "
                    "is the batch (remove the others from the model's outputs)"
                )
        parts.append([v[: len(chunk)] for v in values])
    return [np.concatenate(column) for column in zip(*parts, strict=True)]


@attrs.frozen
class Scored:
    """A candidate's score over a part of the evaluation data.

    Attributes:
        score: the metric (``None`` when scoring stopped early).
        bound: the most the metric could still have reached when scoring stopped (the
            score itself when complete).
        samples: samples run.
        complete: whether every sample was scored.
        batch_seconds: wall time of each full-size batch the runner ran.
        sample_scores: a per-sample metric's score of each sample run, in scoring order
            (``None`` for a metric over the whole set): how a stage ranks candidates that
            stopped early, on the samples they have in common.

    Example:
        >>> Scored(None, 0.8, 64, False, ()).complete
        False
        >>> Scored(None, 0.8, 2, False, (), np.array([1.0, 0.0])).running
        0.5
    """

    score: float | None
    bound: float
    samples: int
    complete: bool
    batch_seconds: tuple[float, ...]
    sample_scores: np.ndarray | None = attrs.field(default=None, eq=False)

    @property
    def running(self) -> float | None:
        """The metric over the samples run so far (``score`` for a whole-set metric)."""
        if self.sample_scores is None or not len(self.sample_scores):
            return self.score
        return float(np.mean(self.sample_scores))


def prefix_better(challenger: np.ndarray, incumbent: np.ndarray) -> bool:
    """Whether per-sample scores ``challenger`` beat ``incumbent`` on the samples both ran
    (a common prefix: every candidate scores the selection part in the same order,
    :func:`hardest_first`); a tie keeps the incumbent.

    Example:
        >>> prefix_better(np.array([1.0, 1.0, 0.0]), np.array([1.0, 0.0, 0.0, 1.0]))  # 2 to 1 on three samples
        True
        >>> prefix_better(np.array([1.0]), np.array([1.0, 0.0]))
        False
    """
    common = min(len(challenger), len(incumbent))
    return bool(common) and float(np.sum(challenger[:common])) > float(np.sum(incumbent[:common]))


def score_outputs(
    runner: Runner,
    output_names: Sequence[str],
    reference: Sequence[np.ndarray],
    metric: Metric,
    data: EvaluationData,
    indices: np.ndarray,
    *,
    acceptance: Acceptance | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Scored:
    """Score ``runner`` on ``indices`` (``reference``: the float outputs of every evaluation
    sample). A per-sample metric with an ``acceptance`` stops as soon as the target is out
    of reach: even if every remaining sample scored 1 the mean would not meet it. The stop
    is exact, not a guess: a candidate stopped here fails the acceptance on the full
    ``indices`` whatever its remaining samples give."""
    total = len(indices)
    if total == 0:
        raise DataError("evaluation data: no samples to score")
    chunk_size = data.fixed_batch or data.batch_size
    seconds: list[float] = []
    parts: list[list[np.ndarray]] = []
    per_sample: list[np.ndarray] = []
    reached = 0.0
    seen = 0
    for chunk in data.chunks(indices):
        feeds = data.feeds(chunk)
        started = clock()
        values = runner(feeds)
        if len(chunk) == chunk_size:
            seconds.append(clock() - started)
        values = [np.asarray(v)[: len(chunk)] for v in values]
        seen += len(chunk)
        if metric.per_sample:
            outputs = as_outputs(output_names, values)
            expected = as_outputs(output_names, [r[chunk] for r in reference])
            samples = data.samples(chunk)
            per_sample.append(
                _call_metric(metric, "a candidate's outputs", metric.sample_scores, outputs, expected, samples)
            )
            reached += float(per_sample[-1].sum())
            bound = (reached + total - seen) / total
            if acceptance is not None and seen < total and not acceptance.reachable(bound, total):
                return Scored(None, bound, seen, False, tuple(seconds), np.concatenate(per_sample))
        else:
            parts.append(values)
    if metric.per_sample:
        value = reached / total
        return Scored(value, value, seen, True, tuple(seconds), np.concatenate(per_sample))
    outputs = as_outputs(output_names, [np.concatenate(c) for c in zip(*parts, strict=True)])
    expected = as_outputs(output_names, [r[indices] for r in reference])
    value = _call_metric(
        metric, "a candidate's outputs", lambda: metric.score(outputs, expected, data.samples(indices))
    )
    return Scored(value, value, seen, True, tuple(seconds))
