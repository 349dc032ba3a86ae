"""What a search scores each candidate with.

A metric is a function ``metric(outputs, reference, samples) -> score``, higher is better:

- ``outputs``: the candidate's outputs on the scored samples (one array for a model with
  one output, else ``{output name: array}``), first axis = samples;
- ``reference``: the float model's outputs on the same samples, in the same form;
- ``samples``: :class:`Samples`, which samples of the evaluation data these are
  (``indices``, for looking up ground truth the metric keeps itself: boxes for mAP,
  transcripts for CER) and their ``labels`` when the caller gave labels.

A metric whose function has ``per_sample = True`` returns one score in ``[0, 1]`` per
sample instead and its score is their mean; the search then stops scoring a candidate as
soon as even perfect remaining samples could not reach the target (a candidate far from
the target costs a few batches). A metric where lower is better (CER, a loss) returns its
negation or ``1 - value``.

Built in: ``agreement`` (top-1 agreement with the float model, the default), ``accuracy``
(top-1 against the labels), ``sqnr`` (output SQNR in dB). ``resolve_metric`` also takes
``"module:function"`` or ``"path/to/file.py:function"``.

Example:
    >>> import numpy as np
    >>> logits = np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]], np.float32)
    >>> quantized = np.array([[0.2, 0.8], [0.4, 0.6], [0.1, 0.9]], np.float32)
    >>> samples = Samples(np.arange(3), np.array([1, 0, 0]))
    >>> resolve_metric("agreement").score(quantized, logits, samples)
    0.6666666666666666
    >>> resolve_metric("accuracy").score(logits, logits, samples)
    0.6666666666666666
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from quant_core.errors import ConfigError, DataError
from quant_core.qparams import sqnr_db

Outputs = np.ndarray | Mapping[str, np.ndarray]
MetricFunction = Callable[[Outputs, Outputs, "Samples"], Any]


@attrs.frozen(eq=False)
class Samples:
    """Which samples of the evaluation data a score is over.

    Example:
        >>> Samples(np.array([3, 7]), None).indices.tolist()
        [3, 7]
    """

    indices: np.ndarray
    labels: np.ndarray | None


def _first(outputs: Outputs) -> np.ndarray:
    if isinstance(outputs, Mapping):
        return np.asarray(next(iter(outputs.values())))
    return np.asarray(outputs)


def _top1(outputs: Outputs) -> np.ndarray:
    values = _first(outputs)
    return values.reshape(len(values), -1).argmax(axis=1)


def agreement(outputs: Outputs, reference: Outputs, samples: Samples) -> np.ndarray:
    """Per sample: 1 where the candidate's top-1 class (first output) is the float model's.

    Example:
        >>> agreement(np.eye(2), np.eye(2)[::-1], Samples(np.arange(2), None)).tolist()
        [0.0, 0.0]
    """
    return (_top1(outputs) == _top1(reference)).astype(np.float64)


agreement.per_sample = True  # type: ignore[attr-defined]


def accuracy(outputs: Outputs, reference: Outputs, samples: Samples) -> np.ndarray:
    """Per sample: 1 where the candidate's top-1 class (first output) is the label.

    Example:
        >>> accuracy(np.eye(2), np.eye(2), Samples(np.arange(2), np.array([0, 0]))).tolist()
        [1.0, 0.0]
    """
    if samples.labels is None:
        raise DataError("metric 'accuracy': needs labels (--eval-labels, or labels= in Python)")
    return (_top1(outputs) == np.asarray(samples.labels).reshape(-1)).astype(np.float64)


accuracy.per_sample = True  # type: ignore[attr-defined]


def sqnr(outputs: Outputs, reference: Outputs, samples: Samples) -> float:
    """Output SQNR (dB) of the candidate against the float model, over every output.

    Example:
        >>> round(sqnr(np.array([1.0, 2.0]), np.array([1.0, 2.1]), Samples(np.arange(2), None)), 1)
        27.3
    """

    def flat(values: Outputs) -> np.ndarray:
        items = values.values() if isinstance(values, Mapping) else [values]
        return np.concatenate([np.asarray(v, np.float64).reshape(-1) for v in items])

    return float(sqnr_db(flat(reference), flat(outputs)))


BUILTIN: dict[str, MetricFunction] = {"agreement": agreement, "accuracy": accuracy, "sqnr": sqnr}


@attrs.frozen(eq=False)
class Metric:
    """A metric function and how the search may use it (module docstring).

    Example:
        >>> resolve_metric(None).name, resolve_metric(None).per_sample
        ('agreement', True)
    """

    name: str
    function: MetricFunction
    per_sample: bool

    def sample_scores(self, outputs: Outputs, reference: Outputs, samples: Samples) -> np.ndarray:
        """One score in ``[0, 1]`` per sample (per-sample metrics only)."""
        values = np.asarray(self.function(outputs, reference, samples), np.float64).reshape(-1)
        if values.shape != (len(samples.indices),):
            raise DataError(
                f"metric {self.name!r}: returned {values.size} per-sample scores for {len(samples.indices)} samples"
            )
        if not np.all((values >= 0.0) & (values <= 1.0)):
            raise DataError(f"metric {self.name!r}: per-sample scores must lie in [0, 1]")
        return values

    def score(self, outputs: Outputs, reference: Outputs, samples: Samples) -> float:
        """The metric's value over ``samples``."""
        if self.per_sample:
            return float(np.mean(self.sample_scores(outputs, reference, samples)))
        value = self.function(outputs, reference, samples)
        try:
            result = float(value)
        except (TypeError, ValueError):
            raise DataError(f"metric {self.name!r}: returned {type(value).__name__}; allowed: a number") from None
        if np.isnan(result):
            raise DataError(f"metric {self.name!r}: returned NaN")
        return result


def resolve_metric(metric: str | MetricFunction | Metric | None) -> Metric:
    """A :class:`Metric` from ``None`` (agreement), a built-in name, ``"module:function"``,
    ``"path/to/file.py:function"`` or a function.

    Example:
        >>> resolve_metric("sqnr").per_sample
        False
        >>> resolve_metric("top5")
        Traceback (most recent call last):
        ...
        quant_core.errors.ConfigError: metric: 'top5' is not allowed; allowed: agreement, accuracy, sqnr, module:function, file.py:function
    """
    if isinstance(metric, Metric):
        return metric
    if metric is None:
        metric = "agreement"
    if isinstance(metric, str):
        if metric in BUILTIN:
            function = BUILTIN[metric]
            return Metric(metric, function, bool(getattr(function, "per_sample", False)))
        if ":" not in metric:
            raise ConfigError(
                f"metric: {metric!r} is not allowed; allowed: {', '.join(BUILTIN)}, module:function, file.py:function"
            )
        loaded = _load(metric)
        return Metric(metric, loaded, bool(getattr(loaded, "per_sample", False)))
    if callable(metric):
        name = getattr(metric, "__name__", type(metric).__name__)
        return Metric(name, metric, bool(getattr(metric, "per_sample", False)))
    raise ConfigError(f"metric: {type(metric).__name__} is not allowed; allowed: a name, module:function, a function")


# The built-in metrics that compare with the float model's outputs and never read labels.
_READS_NO_LABELS = frozenset({"agreement", "sqnr"})


def check_labels_read(metric: Metric, labels: Any) -> None:
    """Refuse ``labels`` that ``metric`` would never read (agreement and SQNR compare with the
    float model's outputs): a user who passes labels means to be scored against them.

    Example:
        >>> check_labels_read(resolve_metric(None), [0, 1])
        Traceback (most recent call last):
        ...
        quant_core.errors.ConfigError: labels: read only by metric 'accuracy' or a user metric (module:function, file.py:function, a function); metric 'agreement' compares with the float model's outputs: drop the labels or choose one of those
    """
    if labels is not None and metric.function is BUILTIN.get(metric.name) and metric.name in _READS_NO_LABELS:
        raise ConfigError(
            "labels: read only by metric 'accuracy' or a user metric (module:function, file.py:function, a function); "
            f"metric {metric.name!r} compares with the float model's outputs: drop the labels or choose one of those"
        )


def _load(reference: str) -> MetricFunction:
    """The function ``module:function`` (or ``file.py:function``) names."""
    location, _, attribute = reference.rpartition(":")
    if not location or not attribute:
        raise ConfigError(f"metric: {reference!r} is not allowed; allowed: module:function or file.py:function")
    try:
        if location.endswith(".py"):
            path = Path(location)
            if not path.is_file():
                raise ConfigError(f"metric: file '{location}' not found")
            module_name = f"_quant_search_metric_{path.stem}"
            spec = importlib.util.spec_from_file_location(module_name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(location)
    except ConfigError:
        raise
    except ImportError as exc:
        raise ConfigError(f"metric: cannot import {location!r}: {exc}") from None
    except Exception as exc:  # the user's module failed while loading: say where, in one line
        raise ConfigError(f"metric: importing {location!r} raised {type(exc).__name__}: {exc}") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ConfigError(f"metric: {location!r} has no function {attribute!r}")
    return function  # type: ignore[no-any-return]
