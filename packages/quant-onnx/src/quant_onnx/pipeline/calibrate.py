"""Streaming calibration: run onnxruntime batch by batch, feed ``quant_core`` observers,
drop the tensors.

The model is copied with every tensor to observe added as a graph output; each batch's
arrays go straight into the observers and are released before the next batch, so peak
memory depends on the batch size, never on the number of samples. The session runs at
onnxruntime's full optimisation level (NCHWc convolutions, fusions): at the basic level
the float model runs 2-3x slower. A batch whose observed tensors would exceed
``CHUNK_BYTES`` runs in chunks of whole samples: freshly allocated multi-hundred-MB outputs
cost more than the convolutions (2x on EfficientNet-Lite0 at batch 32). Moving-average
observers, whose result depends on the batching, always see the user's batches. One observer per
:class:`~quant_core.plan.TensorGroup` sees every observed member, which gives a
shared-scale group (Concat inputs) the union of its members' ranges.

The result, :class:`CalibratedModel`, is the seam between phases: accuracy algorithms
(CLE before calibration; bias correction, AdaRound after) read and replace its float
model, activation qparams and weight qparams before :mod:`qdq_writer` writes it.

Example:
    >>> import numpy as np
    >>> from onnx import helper, TensorProto
    >>> from quant_core.presets import get_preset
    >>> from quant_onnx.pipeline.annotate import plan_model
    >>> g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="r")], "g",
    ...     [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 2])],
    ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 2])])
    >>> model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    >>> batches = [{"x": np.array([[-1.0, 2.0]], np.float32)}, {"x": np.array([[3.0, 0.0]], np.float32)}]
    >>> cal = calibrate(model, plan_model(model, get_preset("a8w8")), batches, quiet=True)
    >>> [round(float(v), 4) for v in cal.activation_ranges["x"]]  # only the Relu reads x: cut at 0, one step lower
    [-0.0118, 3.0]
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from quant_algos.bias_correction import InputMeanAccumulator
from quant_algos.progress import first_taken, progress_bar
from quant_core.errors import ConfigError, DataError, ModelError
from quant_core.observers.base import Observer
from quant_core.observers.derived import DEFAULT_STATISTICS_BINS, statistics_observer
from quant_core.observers.histogram import HistogramObserver
from quant_core.onnx_qdq.graph import GraphIndex, is_default_domain, node_attribute
from quant_core.plan import (
    ConstantLookup,
    QuantPlan,
    WeightCache,
    calibrated_qparams,
    constant_input_note,
    fresh_observers,
    needs_own_observer,
    observer_feeds,
    observer_specs,
)
from quant_core.qparams import QParams
from quant_onnx.data import model_inputs, num_rows
from quant_onnx.ort_session import CheckedSession, inference_session

_LOG = logging.getLogger(__name__)


@attrs.frozen(eq=False)
class InputMeans:
    """The float means of layer inputs over the first ``samples`` calibration samples,
    taken in the calibration pass for the analytic bias correction (which would otherwise
    run the float model once more). ``conv``: tensor -> whether a convolution reads it (its
    mean keeps the map, :class:`~quant_algos.bias_correction.InputMeanAccumulator`);
    ``values``: tensor -> mean, empty in a request.

    Example:
        >>> InputMeans(256, {"x": True}).values
        {}
    """

    samples: int
    conv: Mapping[str, bool]
    values: Mapping[str, np.ndarray] = attrs.field(factory=dict)

    def of(self, tensor: str, conv: bool, samples: int) -> np.ndarray | None:
        """The mean of ``tensor`` as a layer of kind ``conv`` reads it over ``samples``
        samples, or ``None`` where these means do not give it."""
        if samples != self.samples or self.conv.get(tensor) is not conv:
            return None
        return self.values.get(tensor)


_MEAN_KEY = "input mean of "  # no observer key starts so: they are tensor group keys


class FirstSamples:
    """Whether the batch being observed lies within the first ``limit`` input samples (as
    :func:`quant_onnx.algorithms.capture.prepare_batches` takes them for a pass of its
    own). :meth:`marked` cuts a batch that straddles the limit in two, so that every batch,
    and each run of it, lies wholly inside or outside; counting a tensor's rows instead would
    count wrong where its first axis is not the samples' (a Reshape of ``[N, k*C, ...]``
    into ``[N*k, C, ...]``). Windows chain: each cuts at its own limit.

    Example:
        >>> window = FirstSamples(3)
        >>> [(len(b["x"]), window.inside) for b in window.marked([{"x": np.zeros(2)}] * 3)]
        [(2, True), (1, True), (1, False), (2, False)]
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.left = limit
        self.inside = limit > 0

    @property
    def taken(self) -> int:
        """Input samples seen inside the window so far."""
        return self.limit - self.left

    def marked(self, batches: Iterable[Mapping[str, np.ndarray]]) -> Iterator[Mapping[str, np.ndarray]]:
        """``batches``, cut at the limit; ``inside`` describes the batch last yielded (a pass
        observes each batch before it asks for the next)."""
        for batch in batches:
            rows = num_rows(batch)
            if 0 < self.left < rows:
                head, self.left = self.left, 0
                self.inside = True
                yield {name: value[:head] for name, value in batch.items()}
                self.inside = False
                yield {name: value[head:] for name, value in batch.items()}
                continue
            self.inside = self.left > 0
            self.left = max(self.left - rows, 0)
            yield batch


class _FirstSamplesMean:
    """An observer-like mean of one tensor over the batches ``window`` marks as inside."""

    def __init__(self, conv: bool, window: FirstSamples) -> None:
        self.mean = InputMeanAccumulator(conv)
        self.window = window

    def update(self, value: np.ndarray) -> None:
        if self.window.inside:
            self.mean.update(np.asarray(value))


class MeansTaken:
    """What a pass feeds to answer an :class:`InputMeans` request (``None``: none): an
    accumulator per requested tensor, under keys no observer has, over the batches
    :meth:`marked` lets through as the first samples.

    Example:
        >>> taken = MeansTaken(InputMeans(1, {"x": False}))
        >>> for batch in taken.marked([{"x": np.array([[1.0, 3.0], [5.0, 5.0]])}]):  # cut after 1
        ...     taken.accumulators[taken.keys["x"]].update(batch["x"])
        >>> taken.result().values["x"].tolist()
        [1.0, 3.0]
    """

    def __init__(self, request: InputMeans | None) -> None:
        self.request = request
        self.window = FirstSamples(request.samples if request is not None else 0)
        requested = request.conv.items() if request is not None else ()
        self.keys = {tensor: _MEAN_KEY + tensor for tensor, _conv in requested}
        self.accumulators = {self.keys[tensor]: _FirstSamplesMean(conv, self.window) for tensor, conv in requested}

    def marked(self, batches: Iterable[Mapping[str, np.ndarray]]) -> Iterable[Mapping[str, np.ndarray]]:
        """``batches`` as the pass must feed them: cut at the request's first samples."""
        return batches if self.request is None else self.window.marked(batches)

    def result(self) -> InputMeans | None:
        """The request answered (every requested tensor came out of the same runs, so each
        saw the same samples), or ``None`` when nothing was requested."""
        if self.request is None:
            return None
        samples = self.window.taken
        values = {tensor: self.accumulators[key].mean.mean() for tensor, key in self.keys.items()} if samples else {}
        return InputMeans(samples, self.request.conv, values)


@attrs.frozen(eq=False)
class CalibratedModel:
    """A float model with every quantization decision made: the input of the writer.

    Args:
        model: the pre-processed float model to quantize (algorithms may replace it,
            e.g. with weights snapped to their quantization grid by AdaRound).
        plan: the planner's decisions (which tensor gets which spec).
        activation_qparams: tensor group key -> qparams in the spec's own encoding (the
            writer may re-encode int8 as uint8 for onnxruntime on x86).
        activation_ranges: tensor group key -> the ``(min, max)`` its qparams were chosen
            from (the observer's selection: symmetric about 0 for a symmetric spec).
        weight_qparams: weighted node name -> its weight's qparams.
        observers: tensor group key (and requant key, for a requant observing its
            own way) -> observer, kept so that a changed plan over the same graph (a layer
            raised to 16 bits) gets its qparams from the same statistics: :meth:`replan`.
        notes: what calibration decided that a report should say (weight scales
            raised so that a bias fits int32).
        requant_qparams: :attr:`~quant_core.plan.InputRequant.key` -> qparams.
        input_means: layer inputs' float means from the calibration pass, where requested.

    Example:
        >>> empty = QuantPlan(groups=(), weights=(), biases=(), fused=(), quantized_nodes=(), float_nodes=())
        >>> CalibratedModel(onnx.ModelProto(), empty, {}, {}, {}).qparams_of("x") is None
        True
    """

    model: onnx.ModelProto
    plan: QuantPlan
    activation_qparams: Mapping[str, QParams]
    activation_ranges: Mapping[str, tuple[np.ndarray, np.ndarray]]
    weight_qparams: Mapping[str, QParams]
    observers: Mapping[str, Observer] = attrs.field(factory=dict)
    notes: tuple[str, ...] = ()
    requant_qparams: Mapping[str, QParams] = attrs.field(factory=dict)
    input_means: InputMeans | None = None

    def qparams_of(self, tensor: str) -> QParams | None:
        """Qparams of an activation tensor (through its group), or ``None`` when it stays float."""
        group = self.plan.group_of(tensor)
        return None if group is None else self.activation_qparams[group.key]

    def input_qparams(self, node: str, tensor: str) -> QParams | None:
        """Qparams of ``tensor`` as layer ``node`` reads it (its own requantization, if the
        plan gives it one)."""
        requant = self.plan.requant_of(node, tensor)
        return self.requant_qparams[requant.key] if requant is not None else self.qparams_of(tensor)

    @classmethod
    def from_observers(
        cls,
        model: onnx.ModelProto,
        plan: QuantPlan,
        observers: Mapping[str, Observer],
        weight_cache: WeightCache | None = None,
    ) -> CalibratedModel:
        """Every qparam of ``plan`` from ``observers`` (``quant_core.plan.calibrated_qparams``;
        ``weight_cache``: weight qparams already selected on ``model``'s constants)."""
        q = calibrated_qparams(plan, observers, kernel_values(model), weight_cache)
        return cls(model, plan, q.activations, q.ranges, q.weights, observers, q.notes, q.requants)

    def replan(self, plan: QuantPlan) -> CalibratedModel:
        """The calibrated model for another plan of the same graph and groups (specs may
        differ: a layer raised to 16 bits), from the same observers, without calibrating
        again."""
        if [g.members for g in plan.groups] != [g.members for g in self.plan.groups]:
            raise ConfigError("plan: its tensor groups differ from the calibrated plan's; calibrate it instead")
        missing = [key for key in needs_own_observer(plan) if key not in self.observers]
        if missing:
            raise ConfigError(f"plan: requants {missing} observe differently than their groups; calibrate it instead")
        return self.from_observers(self.model, plan, self.observers).evolve(input_means=self.input_means)

    def evolve(self, **changes: Any) -> CalibratedModel:
        """A copy with fields replaced (how algorithms hand back their changes)."""
        result: CalibratedModel = attrs.evolve(self, **changes)
        return result


def kernel_values(model: onnx.ModelProto) -> ConstantLookup:
    """Constant lookup of ``model`` giving weights and biases as the kernels use them: Gemm's
    ``alpha`` and ``beta`` are folded into its weight and bias by the writer."""
    index = GraphIndex(model.graph)
    scaled: dict[str, float] = {}
    for node in model.graph.node:
        if node.op_type != "Gemm" or not is_default_domain(node):
            continue
        for position, name in ((1, "alpha"), (2, "beta")):
            factor = float(node_attribute(node, name, 1.0))
            if factor != 1.0 and len(node.input) > position and node.input[position]:
                scaled[node.input[position]] = factor

    def value(tensor: str) -> np.ndarray | None:
        found = index.constant(tensor)
        if found is None or tensor not in scaled:
            return found
        return (found * np.float32(scaled[tensor])).astype(np.float32)

    return value


def augmented_model(model: onnx.ModelProto, tensors: Iterable[str]) -> onnx.ModelProto:
    """A copy of ``model`` that also outputs ``tensors`` (already-existing outputs are kept)."""
    augmented = onnx.ModelProto()
    augmented.CopyFrom(model)
    index = GraphIndex(augmented.graph)
    existing = {o.name for o in augmented.graph.output}
    for name in tensors:
        if name not in existing:
            elem = index.elem_type(name) or TensorProto.FLOAT
            augmented.graph.output.append(helper.make_tensor_value_info(name, elem, None))
            existing.add(name)
    return augmented


#: Observed bytes per run above which a batch is split into chunks of whole samples.
CHUNK_BYTES = 32 << 20


def _batch_rows(feeds: Mapping[str, np.ndarray]) -> int | None:
    """Samples in a batch, or ``None`` when its inputs do not share a first axis (not splittable)."""
    sizes = {int(v.shape[0]) if v.ndim else -1 for v in feeds.values()}
    return sizes.pop() if len(sizes) == 1 and -1 not in sizes else None


def even_step(count: int, most: int) -> int:
    """Rows per run that split ``count`` rows into as few runs of at most ``most`` as
    possible, all of about one size (a short last run costs nearly a full one).

    Example:
        >>> even_step(15, 8), even_step(16, 8), even_step(9, 4)
        (8, 8, 3)
    """
    if count <= 0:
        return max(1, most)
    runs = -(-count // most)
    return -(-count // runs)


def _rows(feeds: Mapping[str, np.ndarray], start: int, stop: int) -> dict[str, np.ndarray]:
    return {name: value[start:stop] for name, value in feeds.items()}


def calibrate(
    model: onnx.ModelProto,
    plan: QuantPlan,
    batches: Iterable[Mapping[str, np.ndarray]],
    *,
    total_batches: int | None = None,
    quiet: bool = False,
    input_means: InputMeans | None = None,
) -> CalibratedModel:
    """Observe every annotated activation over ``batches`` (validated feeds: input name ->
    array) and return the :class:`CalibratedModel`. ``total_batches`` sizes the progress bar.
    ``input_means``: a request (tensors, samples) for float means taken in the same pass."""
    observers = fresh_observers(plan)
    feeds_of = {tensor: list(keys) for tensor, keys in observer_feeds(plan).items()}
    means = MeansTaken(input_means)
    for tensor, key in means.keys.items():
        feeds_of.setdefault(tensor, []).append(key)
    batching_free = all(spec.observer.method != "moving_average" for spec in observer_specs(plan).values())
    filled: dict[str, Any] = {**observers, **means.accumulators}
    observe_tensors(
        model, feeds_of, filled, means.marked(batches), total_batches=total_batches, quiet=quiet, chunk=batching_free
    )
    calibrated = from_filled_observers(model, plan, observers)
    return calibrated if input_means is None else calibrated.evolve(input_means=means.result())


def from_filled_observers(
    model: onnx.ModelProto,
    plan: QuantPlan,
    observers: Mapping[str, Observer],
    weight_cache: WeightCache | None = None,
) -> CalibratedModel:
    """The :class:`CalibratedModel` of ``plan`` from observers a calibration filled
    (``quant_core.plan.fresh_observers``' keys), with a note for each model input that held
    one value only. Raises DataError for an observer that saw nothing. ``weight_cache``: as
    :meth:`CalibratedModel.from_observers` takes it."""
    for key, observer in observers.items():
        if observer.empty:
            raise DataError(f"calibration: tensor {key!r} was never observed (empty in every batch)")
    calibrated = CalibratedModel.from_observers(model, plan, observers, weight_cache)
    index = GraphIndex(model.graph)
    feeds_of = observer_feeds(plan)
    inputs = [name for name in feeds_of if index.is_graph_input(name)]
    constant = [note for name in inputs if (note := constant_input_note(name, observers[feeds_of[name][0]]))]
    for note in constant:
        _LOG.warning(note)
    return attrs.evolve(calibrated, notes=(*constant, *calibrated.notes))


def collect_statistics(
    model: onnx.ModelProto,
    tensors: Iterable[str],
    batches: Iterable[Mapping[str, np.ndarray]],
    *,
    bins: int = DEFAULT_STATISTICS_BINS,
    total_batches: int | None = None,
    quiet: bool = False,
    input_means: MeansTaken | None = None,
    runs_as: Iterable[str] = (),
) -> dict[str, HistogramObserver]:
    """One pass over ``batches``: a histogram of each of ``tensors``
    (``quant_core.observers.derived.statistics_observer``), from which
    ``quant_core.plan.observers_from_statistics`` gives, bit for bit, the observers
    :func:`calibrate` would fill for any plan of ``model`` whose specs are derivable (min-max,
    percentile, entropy, MSE, power-of-two MinMSE with ``bins`` bins), without running the
    model again.

    ``input_means``: the analytic bias correction's input means (:class:`MeansTaken`),
    filled in the same pass as :func:`calibrate` fills them. Their float sums follow how
    each batch is cut into runs, which the observed outputs decide (:data:`CHUNK_BYTES`):
    ``runs_as``, the tensors a calibration observes (``observer_feeds(plan)``), are output
    too (observed only where they are among ``tensors``), so that every run is the one that
    calibration makes and the means are its own, bit for bit."""
    names = list(dict.fromkeys(tensors))
    statistics = {name: statistics_observer(bins) for name in names}
    feeds_of: dict[str, list[str]] = {tensor: [] for tensor in runs_as}
    for name in names:
        feeds_of.setdefault(name, []).append(name)
    filled: dict[str, Any] = dict(statistics)
    if input_means is not None:
        for tensor, key in input_means.keys.items():
            feeds_of.setdefault(tensor, []).append(key)
        filled.update(input_means.accumulators)
        batches = input_means.marked(batches)
    observe_tensors(model, feeds_of, filled, batches, total_batches=total_batches, quiet=quiet)
    return statistics


def observe_tensors(
    model: onnx.ModelProto,
    feeds_of: Mapping[str, Sequence[str]],
    observers: Mapping[str, Observer],
    batches: Iterable[Mapping[str, np.ndarray]],
    *,
    total_batches: int | None = None,
    quiet: bool = False,
    chunk: bool = True,
) -> int:
    """Stream ``batches`` through ``model`` once, feeding each tensor of ``feeds_of``
    (tensor -> observer keys) to its ``observers``; returns the batches seen. ``chunk``:
    whether a big batch may run in pieces (not for observers whose result depends on the
    batching)."""
    index = GraphIndex(model.graph)
    run_outputs = []

    def observe(key: str, tensor: str, value: np.ndarray) -> None:
        try:
            observers[key].update(value)
        except DataError as exc:  # NaN/Inf: the inputs were checked finite, so the model made them
            raise ModelError(f"calibration: tensor '{tensor}' {_detail(exc)} (the model computes it)") from None

    for name, keys in feeds_of.items():
        value = index.constant(name)
        if value is not None:
            for key in keys:
                observe(key, name, value)
        elif not index.is_graph_input(name):
            run_outputs.append(name)
    inputs_to_observe = [name for name in feeds_of if index.is_graph_input(name)]
    session: CheckedSession | None = inference_session(
        augmented_model(model, run_outputs), ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    )
    # A batch runs in smaller pieces only where no input fixes its first axis (a model
    # exported with a fixed batch of 4 refuses a run of 1).
    batch_is_free = all(spec.fixed_batch is None for spec in model_inputs(model))
    may_chunk = batch_is_free and chunk
    rows_per_run: int | None = None  # samples per run, sized from the first run's output bytes

    def observe_run(feeds: Mapping[str, np.ndarray]) -> float:
        """Run once, feed the observers, drop the arrays; returns observed bytes per sample."""
        assert session is not None
        values = session.run(run_outputs, dict(feeds))
        for name, value in zip(run_outputs, values, strict=True):
            for key in feeds_of[name]:
                observe(key, name, value)
        return sum(v.nbytes for v in values) / max(1, _batch_rows(feeds) or 1)

    seen = 0
    checked = first_taken(batches)  # a batch that does not fit fails before the bar is drawn
    with progress_bar(total=total_batches, desc="calibrating", unit="batch", quiet=quiet) as bar:
        for batch in checked:
            feeds = {name: np.asarray(value) for name, value in batch.items()}
            for name in inputs_to_observe:
                for key in feeds_of[name]:
                    observe(key, name, feeds[name])
            if run_outputs:
                rows = _batch_rows(feeds) if may_chunk else None
                if rows is None:
                    observe_run(feeds)
                else:
                    first = 0
                    if rows_per_run is None:  # one sample first, to size the chunks from its outputs
                        rows_per_run = max(1, int(CHUNK_BYTES // max(observe_run(_rows(feeds, 0, 1)), 1.0)))
                        first = 1
                    step = even_step(rows - first, rows_per_run)
                    for start in range(first, rows, step):
                        observe_run(_rows(feeds, start, start + step))
            seen += 1
            bar.update(1)
    session = None  # onnxruntime holds its own copy of the weights: free it before reading them
    if seen == 0:
        raise DataError("calibration data: no samples")
    return seen


def _detail(exc: DataError) -> str:
    """``'contains NaN'`` from an observer's ``'<what>: contains NaN; ...'``."""
    text = str(exc).split(";")[0]
    return text.split(": ", 1)[-1] if ": " in text else text
