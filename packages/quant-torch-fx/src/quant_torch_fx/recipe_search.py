"""Accuracy-driven recipe search over the torch backend: :func:`search` tries recipes with
:class:`~quant_torch_fx.api.ModelQuantizer`'s prepare -> calibrate -> algorithms -> freeze
path until one meets an accuracy target.

The search is :mod:`quant_algos.search`, the one ``quant_onnx.search`` runs too: the same
candidate space and cost order, metrics, evaluation split, exact early stop, same-model
skip, budget rule, held-out check, Pareto table and report. What is torch's is how a
candidate is built and run (:class:`_TorchBackend`):

- **one capture**: the model is captured with ``torch.export`` and normalised (the exact
  rewrites, batch norm folded) once; each candidate plans and instruments its own copy;
- **one statistics pass per float model**: the float graph (after a candidate's CLE)
  runs once over the calibration batches in an FX interpreter that fills a histogram per
  observed tensor; every candidate on that float graph gets its activation observers
  derived from them (:class:`~quant_algos.search.statistics.StatisticsLedger`), the same
  observers, so the same qparams, as its own calibration gives. A candidate whose specs
  cannot be derived calibrates itself (its row says ``"calibrated"``); a weight's range
  is selected once per spec on each float graph, whichever candidates ask for it;
- **the candidate as deployed**: the frozen model (``ModelQuantizer.freeze``), run in
  torch on the evaluation batches; its digest is its ``state_dict``'s tensors (two
  observer choices selecting the same scales give the same digest: not run twice).

What this backend lacks: SmoothQuant and mixed precision (quant-onnx runs them;
``ModelQuantizer`` refuses them), so their candidates are rows marked ``skipped`` with the
reason; NPU legality (``quant_npu`` sits above
this package): ``deployment="xint8"`` restricts the space to power-of-two symmetric int8.

Example:
    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(8, 4)).eval()
    >>> x = torch.randn(40, 1, 8)
    >>> result = search(net, x[:1], x[:16], x, target=0.5, quiet=True)
    >>> result.met, result.chosen.name, result.deployment
    (True, 'a8w8/minmax', 'torch')
"""

from __future__ import annotations

import copy
import hashlib
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import torch
from torch import nn
from torch.fx import GraphModule, Interpreter, Node

from quant_algos.drivers.schedule import schedule
from quant_algos.search.evaluation import DEFAULT_CONFIDENCE, EvaluationData, Runner, Scored, evaluation_data
from quant_algos.search.metrics import Metric, MetricFunction, check_labels_read, resolve_metric
from quant_algos.search.results import SearchResult, StatisticsPass, check_report_path
from quant_algos.search.space import Candidate, SearchSpace
from quant_algos.search.statistics import StatisticsLedger, float_model_key, pre_label, wide_share
from quant_algos.search.targets import check_target, target_reason, target_space
from quant_algos.search.walk import (
    Budget,
    Build,
    check_arguments,
    float_goal,
    latency_runs,
    median_batch_ms,
    search_with,
    with_report,
)
from quant_core.config import CalibrationConfig
from quant_core.errors import ConfigError, DataError
from quant_core.observers.derived import statistics_observer
from quant_core.observers.histogram import HistogramObserver
from quant_torch_fx.algorithms.passes import SUPPORTED, pre_pass, run_post_passes
from quant_torch_fx.api import ModelQuantizer, check_model
from quant_torch_fx.calibrate import calibrate, finish_calibration, model_device
from quant_torch_fx.capture import as_args, capture, copy_captured
from quant_torch_fx.data import InputSignature, batches, check_finite
from quant_torch_fx.freeze import freeze_in_place
from quant_torch_fx.graph_passes import get_attr_value
from quant_torch_fx.observe import observe
from quant_torch_fx.prepare import graph_info, normalize, prepare_graph, quantizer
from quant_torch_fx.quantizer import FakeQuantizer


def _outputs(value: Any) -> list[np.ndarray]:
    """A model's outputs (a tensor, or a tuple/list/dict of them) as arrays, in order."""
    if isinstance(value, torch.Tensor):
        return [value.detach().float().cpu().numpy()]
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return [array for item in value for array in _outputs(item)]
    raise DataError(f"model output: {type(value).__name__}; allowed: tensors (or tuples, lists, dicts of them)")


def torch_runner(model: nn.Module, names: Sequence[str], device: torch.device | None) -> Runner:
    """``feeds -> outputs`` for ``model`` (eval mode, no grad): the feeds in ``names``'
    order as its positional inputs.

    Example:
        >>> run = torch_runner(torch.nn.ReLU(), ["input_0"], None)
        >>> run({"input_0": np.array([[-1.0, 2.0]], np.float32)})[0].tolist()
        [[0.0, 2.0]]
    """
    model.eval()

    def run(feeds: Mapping[str, np.ndarray]) -> Sequence[np.ndarray]:
        args = [torch.from_numpy(np.ascontiguousarray(feeds[name])) for name in names]
        if device is not None:
            args = [a.to(device) for a in args]
        with torch.no_grad():
            return _outputs(model(*args))

    return run


def _as_arrays(data: Any, field: str, signature: InputSignature) -> list[np.ndarray]:
    """Samples (first axis) per model input: a tensor or array, or a tuple of them, each
    in its example input's dtype (a float64 array feeds a float32 model)."""
    items = list(data) if isinstance(data, tuple) else [data]
    arrays = []
    for index, item in enumerate(items):
        if isinstance(item, torch.Tensor):
            item = item.detach().cpu().numpy()
        if not isinstance(item, np.ndarray) or item.ndim == 0:
            raise ConfigError(
                f"{field}: {type(item).__name__} is not allowed; allowed: a tensor or array of samples "
                "(first axis), or a tuple of them (one per model input)"
            )
        dtype = signature.dtypes[index] if index < len(signature.dtypes) else None
        if dtype is not None and dtype.is_floating_point and np.issubdtype(item.dtype, np.floating):
            item = item.astype(torch.empty((), dtype=dtype).numpy().dtype, copy=False)
        arrays.append(item)
    if len({len(a) for a in arrays}) > 1:
        raise DataError(f"{field}: the inputs hold different sample counts {[len(a) for a in arrays]}")
    return arrays


def calibration_batches(
    data: Any, signature: InputSignature, device: torch.device | None, batch_size: int, num_samples: int | None
) -> list[tuple[Any, ...]]:
    """The calibration batches every candidate reads: a tensor/array of samples (or a
    tuple, one per input) cut into ``batch_size`` batches, or a loader's batches as they
    come (tensors, or ``(inputs..., labels)``); ``num_samples`` caps the samples either way.

    Example:
        >>> sig = InputSignature.of((torch.zeros(1, 3),))
        >>> [b[0].shape[0] for b in calibration_batches(torch.zeros(10, 3), sig, None, 4, None)]
        [4, 4, 2]
    """
    if isinstance(data, torch.Tensor | np.ndarray | tuple):
        arrays = _as_arrays(data, "calibration_data", signature)
        count = len(arrays[0]) if num_samples is None else min(num_samples, len(arrays[0]))
        data = [
            tuple(torch.from_numpy(np.ascontiguousarray(a[i : i + batch_size])) for a in arrays)
            for i in range(0, count, batch_size)
        ]
        num_samples = None
    held: list[tuple[Any, ...]] = []
    for values in batches(data, signature, device, num_samples):
        check_finite(values, f"calibration_data: batch {len(held)}")
        held.append(values)
    if not held:
        raise DataError("calibration_data: no batches")
    return held


class _Statistics(Interpreter):
    """Runs an instrumented graph with fake quantization off (the float model) and feeds
    each wanted tensor, where a quantizer call observes it, into its histogram."""

    def __init__(self, gm: GraphModule, wanted: Mapping[str, HistogramObserver], paths: set[str]) -> None:
        super().__init__(gm)
        self.wanted = wanted
        self.paths = paths

    def run_node(self, n: Node) -> Any:
        value = super().run_node(n)
        if n.op == "call_module" and n.target in self.paths and n.kwargs.get("observe_batch", True):
            source = n.args[0]
            if isinstance(source, Node) and source.name in self.wanted:
                observe(self.wanted[source.name], self.env[source])
        return value


def collect_statistics(
    gm: GraphModule, tensors: Sequence[str], held: Sequence[tuple[Any, ...]], bins: int
) -> dict[str, HistogramObserver]:
    """Histograms of ``tensors`` (plan tensor names) over the calibration batches, fed the
    values a calibration of ``gm`` feeds its activation observers (constants once)."""
    wanted = {name: statistics_observer(bins) for name in tensors}
    info = graph_info(gm)
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.name in wanted:
            observe(wanted[node.name], get_attr_value(gm, node))
    paths = set(info.activation.values())
    for path in paths:
        fq = quantizer(gm, path)
        fq.observing, fq.quantizing = False, False
    interpreter = _Statistics(gm, wanted, paths)
    with torch.no_grad():
        for args in held:
            interpreter.run(*args)
    return wanted


def _digest(model: nn.Module) -> bytes:
    """Equal for two frozen models that compute the same: the same graph code, tensors (the
    qparams are buffers) and quantizer specs (rounding and integer range are not buffers)."""
    digest = hashlib.blake2b(digest_size=16)
    for path, module in sorted(model.named_modules(), key=lambda item: item[0]):
        if isinstance(module, FakeQuantizer):
            digest.update(f"{path}: {module.spec!r}".encode())
        elif isinstance(module, GraphModule):
            digest.update(f"{path}: {module.code}".encode())
    for name, value in sorted(model.state_dict().items()):
        if isinstance(value, torch.Tensor):
            tensor = value.detach().cpu().contiguous()
            digest.update(name.encode())
            digest.update(str(tensor.dtype).encode())
            digest.update(
                tensor.numpy().tobytes() if tensor.dtype != torch.bfloat16 else tensor.float().numpy().tobytes()
            )
    return digest.digest()


def _size_bytes(model: nn.Module) -> int:
    return sum(v.numel() * v.element_size() for v in model.state_dict().values() if isinstance(v, torch.Tensor))


@attrs.define
class _TorchBackend:
    """:class:`quant_algos.search.walk.Backend` over :class:`~quant_torch_fx.api.ModelQuantizer`."""

    normalized: GraphModule  # the capture, normalised for PTQ (batch norm folded) once
    held: list[tuple[Any, ...]]
    signature: InputSignature
    input_names: list[str]
    device: torch.device | None
    target: str | None
    ledger: StatisticsLedger = attrs.field(factory=StatisticsLedger)

    @property
    def name(self) -> str:
        return "torch" if self.target is None else f"torch:{self.target}"

    @property
    def requires_legal(self) -> bool:
        return False

    @property
    def pass_seconds(self) -> Sequence[float]:
        return self.ledger.pass_seconds

    def allows(self, config: Any) -> str | None:
        refused = [a.kind for a in config.algorithms if a.kind not in SUPPORTED]
        if refused:
            return f"{', '.join(refused)} runs in quant-onnx only; allowed here: {', '.join(SUPPORTED)}"
        return target_reason(self.target, config)

    def build(self, candidate: Candidate) -> Build:
        config = candidate.config
        ModelQuantizer(config, quiet=True)  # the config checks a recipe alone gets
        pre = schedule(config, SUPPORTED, backend="torch").before_calibration
        float_pass = pre_pass(config, self.held) if pre else None
        gm = prepare_graph(copy_captured(self.normalized), config, mode="ptq", float_pass=float_pass, normalized=True)
        plan = graph_info(gm).plan

        def collect(missing: list[str], bins: int) -> dict[str, HistogramObserver]:
            return collect_statistics(gm, missing, self.held, bins)

        float_key = float_model_key(config, pre)
        derived = self.ledger.observers(float_key, pre_label(pre), plan, candidate.name, collect)
        if derived is None:
            calibrate(gm, self.held, self.signature, quiet=True)
            source = "calibrated"
        else:
            observers, source = derived
            info = graph_info(gm)
            observing = []
            for key, path in info.activation.items():
                fq = quantizer(gm, path)
                fq.observer = observers.get(key, fq.observer)  # a derived group has none
                fq.observing, fq.quantizing = False, False
                observing.append(fq)
            finish_calibration(gm, observing, weight_cache=self.ledger.weight_cache(float_key, plan))
        if schedule(config, SUPPORTED, backend="torch").after_calibration:
            run_post_passes(gm, config, self.held, quiet=True)
        frozen = freeze_in_place(gm.eval())  # the instrumented copy is this candidate's alone
        return Build(frozen, _digest(frozen), _size_bytes(frozen), wide_share(plan), None, "", source)

    def runner(self, build: Build) -> Runner:
        return torch_runner(build.model, self.input_names, self.device)

    def latency_ms(self, build: Build, runner: Runner, feeds: Mapping[str, np.ndarray], scored: Scored) -> float:
        return median_batch_ms(runner, feeds, scored.batch_seconds, latency_runs(scored))

    def statistics(self) -> tuple[StatisticsPass, ...]:
        return tuple(self.ledger.passes.values())

    def reuse(self) -> dict[str, Any]:
        return self.ledger.reuse()


def search(
    model: nn.Module,
    example_inputs: Any,
    calibration_data: Any,
    eval_data: Any,
    *,
    target: float,
    metric: str | MetricFunction | Metric | None = None,
    labels: Any = None,
    space: SearchSpace | Sequence[Candidate] | None = None,
    deployment: str | None = None,
    budget_s: float | None = None,
    confidence: float = DEFAULT_CONFIDENCE,
    holdout: float = 0.3,
    seed: int = 0,
    num_samples: int | None = None,
    batch_size: int | None = None,
    eval_batch_size: int = 32,
    eval_samples: int | None = None,
    report_path: str | os.PathLike[str] | None = None,
    quiet: bool = False,
    clock: Callable[[], float] = time.perf_counter,
) -> SearchResult:
    """Search recipes for ``model`` until one reaches ``target`` on ``eval_data``: the
    arguments, the candidates, the result and the report are :func:`quant_onnx.search`'s.

    Args:
        model: the float ``nn.Module`` (never modified).
        example_inputs: one batch of inputs (a tensor or a tuple), as ``ModelQuantizer`` takes them.
        calibration_data: a tensor or array of samples (or a tuple, one per input), cut
            into ``batch_size`` batches; or a loader (or list) of batches, tensors or
            ``(inputs..., labels)``.
        eval_data: the evaluation samples: a tensor or array (or a tuple, one per input).
        target: the metric value to reach (top-1 agreement with the float model by default).
        metric: ``None`` (agreement), ``"accuracy"`` (needs ``labels``), ``"sqnr"``,
            ``"module:function"``, ``"file.py:function"`` or a function
            ``metric(outputs, reference, samples)`` (:mod:`quant_algos.search.metrics`).
        labels: one label per evaluation sample (array, tensor or ``.npy`` path).
        space: a :class:`~quant_algos.search.space.SearchSpace` or a list of candidates
            (default: the deployment's space).
        deployment: ``None`` (torch, every format) or ``"xint8"`` (power-of-two symmetric
            int8 only, as ``quant-onnx search --target xint8``).
        budget_s, confidence, holdout, seed, num_samples, batch_size, eval_batch_size,
        eval_samples, report_path, quiet, clock: as :func:`quant_onnx.search` takes them.

    Returns:
        :class:`~quant_algos.search.results.SearchResult`; ``model`` is the chosen frozen
        model (``ModelQuantizer(result.chosen.config)`` quantizes and freezes it alone).
    """
    check_model(model)
    check_report_path(report_path)  # before any work
    acceptance = check_arguments(target, budget_s, confidence, eval_batch_size, eval_samples, seed=seed)
    check_target(deployment, "deployment")
    if isinstance(labels, torch.Tensor):
        labels = labels.detach().cpu().numpy()
    started = clock()
    chosen_metric = resolve_metric(metric)
    check_labels_read(chosen_metric, labels)
    calibration = CalibrationConfig(num_samples=num_samples, batch_size=batch_size or CalibrationConfig().batch_size)
    args = as_args(example_inputs)
    float_model = copy.deepcopy(model).eval()
    device = model_device(float_model)
    signature = InputSignature.of(args, True)
    arrays = _as_arrays(eval_data, "eval_data", signature)
    if eval_samples is not None:
        arrays = [a[:eval_samples] for a in arrays]
    if len(arrays) != len(args):
        raise ConfigError(f"eval_data: {len(arrays)} input(s); allowed: one per model input ({len(args)})")
    # Checked before any candidate runs: torch's own errors would end each candidate as failed.
    check_finite(signature.inputs(tuple(torch.from_numpy(a) for a in arrays), 0, where="eval_data"), "eval_data")
    names = [f"input_{i}" for i in range(len(arrays))]
    evaluation: EvaluationData = evaluation_data(
        dict(zip(names, arrays, strict=True)), labels=labels, holdout=holdout, seed=seed, batch_size=eval_batch_size
    )
    run_float = torch_runner(float_model, names, device)
    goal, reference_seconds = float_goal(run_float, evaluation, chosen_metric, acceptance)
    held = calibration_batches(calibration_data, signature, device, calibration.batch_size, calibration.num_samples)
    normalized = capture(float_model, args, dynamic_batch=True)
    normalize(normalized, fold_batch_norms=True)  # what prepare_graph does first in PTQ, once
    backend = _TorchBackend(normalized, held, signature, names, device, deployment)
    result = search_with(
        backend,
        goal,
        space if space is not None else target_space(deployment),
        calibration,
        budget=Budget(budget_s, clock, started),
        reference_seconds=reference_seconds,
        quiet=quiet,
    )
    return with_report(result, report_path)
