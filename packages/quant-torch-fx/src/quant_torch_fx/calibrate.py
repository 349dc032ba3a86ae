"""Calibration: run the float model over the data with every activation quantizer
observing, then turn the statistics into qparams (``quant_core``'s math) and switch fake
quantization on.

Observers see the float model (fake quantization off), as in the ONNX backend, so one
config and one data set give the same activation scales on both. Weight qparams come
from :func:`quant_core.plan.plan_weight_qparams` after the activations': a weight scale
is raised where the int32 bias would not fit at ``input_scale * weight_scale``. Under
``torch.distributed`` the observers are merged across ranks first
(:func:`~quant_torch_fx.distributed.merge_observers`). A group every reader of which
saturates (the input of the Relu below: nothing under 0 reaches its output) is quantized
on its range cut there (:func:`quant_core.plan.group_selection`).

Example:
    >>> import torch
    >>> from quant_core.presets import get_preset
    >>> from quant_torch_fx.capture import capture
    >>> from quant_torch_fx.data import InputSignature
    >>> from quant_torch_fx.prepare import prepare_graph, activation_quantizers
    >>> gm = prepare_graph(capture(torch.nn.ReLU(), (torch.randn(1, 4),)), get_preset("a8w8"), mode="ptq")
    >>> sig = InputSignature.of((torch.randn(1, 4),))
    >>> calibrate(gm, [torch.tensor([[-1.0, 0.0, 1.0, 2.55]])], sig, quiet=True)
    >>> {key: float(q.current_qparams().scale) for key, q in activation_quantizers(gm)}
    {'input_1': 0.01003921590745449, 'relu': 0.009999999776482582}
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.fx import GraphModule
from tqdm.auto import tqdm  # type: ignore[import-untyped]

from quant_algos.progress import first_taken
from quant_core.errors import ConfigError, DataError
from quant_core.observers import make_observer
from quant_core.plan import (
    WeightCache,
    constant_input_note,
    derived_selection,
    group_selection,
    plan_weight_qparams,
)
from quant_torch_fx.data import InputSignature, batches, loader_length
from quant_torch_fx.distributed import merge_observers
from quant_torch_fx.prepare import (
    activation_qparams_lookup,
    activation_quantizers,
    constant_lookup,
    graph_info,
    observe_constants,
    quantized_graphs,
    quantizer,
    weight_quantizers,
)
from quant_torch_fx.quantizer import FakeQuantizer
from quant_torch_fx.shared_cores import warn_if_openmp_spins


def model_device(model: nn.Module) -> torch.device | None:
    """The device of the model's first parameter or buffer (``None``: it has neither)."""
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return None


def start_observing(model: nn.Module) -> list[FakeQuantizer]:
    """Fresh observers on every activation quantizer, fake quantization off everywhere;
    constants observed once. Returns the activation quantizers (all graphs, plan order)."""
    observing: list[FakeQuantizer] = []
    for gm in quantized_graphs(model):
        for _key, fq in activation_quantizers(gm):
            fq.observer = make_observer(fq.spec)
            fq.observing, fq.quantizing = True, False
            observing.append(fq)
        for _node, fq in weight_quantizers(gm):
            fq.observing, fq.quantizing = False, False
        observe_constants(gm)
    return observing


@contextmanager
def calibrating(model: nn.Module) -> Iterator[list[FakeQuantizer]]:
    """:func:`start_observing` for a pass that ends in :func:`finish_calibration` (inside
    the block). A pass that fails (a batch with NaN, a forward that raises) puts every
    quantizer's ``observing`` and ``quantizing`` back as they were: left observing, every
    later forward would run unquantized and go on observing, and a QAT first-batch
    calibration, seeing a calibration still running, would never start, so training would
    run without quantization until ``freeze`` refused the model."""
    quantizers = [
        fq
        for gm in quantized_graphs(model)
        for fq in (*(q for _key, q in activation_quantizers(gm)), *(q for _node, q in weight_quantizers(gm)))
    ]
    switches = [(fq.observing, fq.quantizing) for fq in quantizers]
    observing = start_observing(model)
    try:
        yield observing
    except BaseException:
        for fq, (was_observing, was_quantizing) in zip(quantizers, switches, strict=True):
            fq.observing, fq.quantizing = was_observing, was_quantizing
        raise


@contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode (batch norm on its running statistics, none updated) without
    gradients; each submodule's mode is restored after (``model.train(True)`` would also
    wake batch norms the caller froze). How every pass that only observes runs."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, training in modes:
            module.training = training


def check_num_batches(num_batches: Any) -> None:
    """``num_batches`` is ``None`` (all) or an integer >= 1 (0 or -1 calibrated on one
    batch, or, with algorithms, on none)."""
    if num_batches is not None and (
        isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 1
    ):
        raise ConfigError(f"num_batches: {num_batches!r} is out of range; allowed: null or an integer >= 1")


def run_batches(
    model: nn.Module,
    loader: Iterable[Any],
    signature: InputSignature,
    *,
    num_batches: int | None = None,
    num_samples: int | None = None,
    desc: str = "calibrating",
    quiet: bool = False,
) -> int:
    """Run ``model`` (eval mode, no grad) over the loader's checked batches (its first
    ``num_samples`` samples, when given); returns how many ran."""
    check_num_batches(num_batches)
    warn_if_openmp_spins()
    total = loader_length(loader)
    if num_batches is not None:
        total = num_batches if total is None else min(total, num_batches)
    device = model_device(model)
    seen = 0
    with evaluating(model):
        checked = first_taken(batches(loader, signature, device, num_samples))  # a bad first batch fails first
        for inputs in tqdm(checked, total=total, desc=desc, unit="batch", disable=quiet):
            model(*inputs)
            seen += 1
            if num_batches is not None and seen >= num_batches:
                break
    if seen == 0:
        raise DataError(f"{desc}: the data loader yielded no batches")
    return seen


def finish_calibration(
    model: nn.Module, observing: list[FakeQuantizer], *, weight_cache: WeightCache | None = None
) -> None:
    """Merge across ranks, set activation and weight qparams, switch fake quantization on.
    ``weight_cache``: weight qparams already selected on this float model
    (:data:`quant_core.plan.WeightCache`, one graph; a recipe search keeps it)."""
    merge_observers(observing)
    for gm in quantized_graphs(model):
        info = graph_info(gm)
        ranges: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for key, path in info.activation.items():
            fq = quantizer(gm, path)
            fq.observing = False
            if info.plan.derived_of(key) is None:
                ranges[key], selected = group_selection(info.plan, key, fq.observer)
                fq.set_qparams(selected)
            fq.quantizing = True
        for derived in info.plan.derived:  # masked attention scores: from their sources' ranges
            _, selected = derived_selection(info.plan, derived, ranges.__getitem__)
            quantizer(gm, info.activation[derived.group]).set_qparams(selected)
        _note_constant_inputs(gm)
        learned = {node: fq.current_qparams() for node, fq in weight_quantizers(gm) if fq.learning is not None}
        qparams, notes = plan_weight_qparams(
            info.plan, constant_lookup(gm), activation_qparams_lookup(gm), learned, weight_cache
        )
        info.notes.extend(note for note in notes if note not in info.notes)
        for node, fq in weight_quantizers(gm):
            if fq.learning is None:
                fq.set_qparams(qparams[node])
            fq.quantizing = True


def _note_constant_inputs(gm: GraphModule) -> None:
    """Warn (and note) of a graph input that held one value in every calibration batch."""
    info = graph_info(gm)
    inputs = {node.name for node in gm.graph.nodes if node.op == "placeholder"}
    for group in info.plan.groups:
        for member in inputs.intersection(group.members):
            note = constant_input_note(member, quantizer(gm, info.activation[group.key]).observer)
            if note is not None and note not in info.notes:
                info.notes.append(note)
                warnings.warn(note, UserWarning, stacklevel=5)  # at the quantize_model call


def calibrate(
    model: nn.Module,
    loader: Iterable[Any],
    signature: InputSignature,
    *,
    num_batches: int | None = None,
    num_samples: int | None = None,
    quiet: bool = False,
) -> None:
    """Calibrate every prepared graph in ``model`` (in place; see the module docstring) on
    the loader's first ``num_samples`` samples (``None``: all)."""
    with calibrating(model) as observing:
        run_batches(model, loader, signature, num_batches=num_batches, num_samples=num_samples, quiet=quiet)
        finish_calibration(model, observing)
