"""A small QAT training loop, with knowledge distillation from the float model.

Users often have unlabeled images only: with ``teacher=`` (the float model) the loss is
the distillation loss ``T^2 * KL(softmax(teacher / T) || softmax(student / T))`` for
classification logits (mean squared error for other outputs), and labels are not
needed; without a teacher the loss is ``loss_fn(output, labels)`` (cross entropy by
default) on ``(inputs, labels)`` batches. Any ``nn.Module`` works, a DDP-wrapped
prepared model included.

Example:
    >>> import torch
    >>> from quant_torch_fx import ModelQuantizer
    >>> float_net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).eval()
    >>> q = ModelQuantizer("a8w8", quiet=True)
    >>> qat = q.prepare_qat(float_net, torch.randn(1, 4))
    >>> data = [torch.randn(16, 4) for _ in range(4)]
    >>> history = train_qat(qat, data, teacher=float_net, epochs=2, lr=1e-3, quiet=True)
    >>> len(history), history[-1]["batches"]
    (2, 4.0)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import Node
from tqdm.auto import tqdm  # type: ignore[import-untyped]

from quant_core.algorithm_config import check_in_range
from quant_core.errors import ConfigError, DataError, ModelError
from quant_torch_fx.calibrate import evaluating, model_device
from quant_torch_fx.data import InputSignature, check_finite, labels_of, loader_length, signature_of
from quant_torch_fx.graph_passes import get_attr_value
from quant_torch_fx.modules import ConvBn, GraphBatchNorm
from quant_torch_fx.prepare import graph_info, quantized_graphs, quantizer
from quant_torch_fx.qat import first_batch_pending, restore_first_batch_hooks
from quant_torch_fx.quantizer import FakeQuantizer
from quant_torch_fx.shared_cores import warn_if_openmp_spins

EpochCallback = Callable[[int, nn.Module], dict[str, float] | None]


def distillation_loss(student: Any, teacher: Any, temperature: float = 1.0) -> torch.Tensor:
    """KL distillation for ``[N, classes]`` logits, mean squared error otherwise (pytrees
    of tensors are compared leaf by leaf).

    Example:
        >>> t = torch.tensor([[2.0, 0.0]])
        >>> abs(float(distillation_loss(t, t))) < 1e-6
        True
    """
    s_leaves, t_leaves = _leaves(student), _leaves(teacher)
    if len(s_leaves) != len(t_leaves):
        raise ModelError(f"distillation: the student returns {len(s_leaves)} tensors, the teacher {len(t_leaves)}")
    total = torch.zeros((), device=s_leaves[0].device)
    for s, t in zip(s_leaves, t_leaves, strict=True):
        t = t.detach()
        if s.dim() == 2 and s.is_floating_point():
            log_p = F.log_softmax(s / temperature, dim=1)
            target = F.softmax(t / temperature, dim=1)
            total = total + F.kl_div(log_p, target, reduction="batchmean") * temperature**2
        else:
            total = total + F.mse_loss(s, t)
    return total


def _leaves(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, list | tuple):
        return [leaf for v in value for leaf in _leaves(v)]
    return []


def learnable_quantizers(model: nn.Module) -> list[FakeQuantizer]:
    """The quantizers of ``model`` with learnable qparams (LSQ scales, TQT thresholds)."""
    return [m for m in model.modules() if isinstance(m, FakeQuantizer) and m.learned is not None]


def quantized_weights(model: nn.Module) -> list[tuple[nn.Parameter, float]]:
    """Each quantized weight parameter of ``model`` with the mean quantization step, in
    its own units, its quantizer applies now (for a ``ConvBn``, the folded weight's step
    divided by :meth:`~quant_torch_fx.modules.ConvBn.batch_norm_factor`). Quantizers must have qparams (calibrated or
    initialised)."""
    found: list[tuple[nn.Parameter, float]] = []
    for gm in quantized_graphs(model):
        paths = set(graph_info(gm).weights.values())
        for node in gm.graph.nodes:
            source = node.args[0] if node.op == "call_module" and node.args else None
            if str(node.target) in paths and isinstance(source, Node) and source.op == "get_attr":
                parameter = get_attr_value(gm, source)
                if isinstance(parameter, nn.Parameter):
                    scale = quantizer(gm, str(node.target)).current_qparams().scale
                    found.append((parameter, float(np.mean(scale))))
        for module in gm.modules():
            if isinstance(module, ConvBn) and module.weight_quantizer is not None:
                scale = np.asarray(module.weight_quantizer.current_qparams().scale, np.float64)
                factor = module.batch_norm_factor().detach().abs().to(torch.float64).cpu().numpy()
                found.append((module.weight, float(np.mean(scale / factor))))
    return found


def default_optimizer(
    model: nn.Module, lr: float, qparam_lr: float | None, weight_lr_per_step: float | None = None
) -> torch.optim.Optimizer:
    """Adam: weights at ``lr``; TQT log2 thresholds at ``qparam_lr`` (default ``10 * lr``, in
    log2 units); each LSQ scale at ``qparam_lr`` times its own magnitude (Adam's steps do not
    scale with the gradient, so a scale of 0.01 would otherwise move by whole multiples of
    itself). With ``weight_lr_per_step``, each quantized weight learns at that fraction of
    its own quantization step instead (:func:`quantized_weights`): per-tensor power-of-two
    steps differ by orders of magnitude between a depthwise and a pointwise layer, so one
    rate is too slow for one and too noisy for the other. Learnable qparams must be
    initialised first (see :func:`train_qat`)."""
    if weight_lr_per_step is not None and not weight_lr_per_step > 0:
        raise ConfigError(f"weight_lr_per_step: {weight_lr_per_step!r} is out of range; allowed: a number > 0")
    rate = qparam_lr if qparam_lr is not None else 10 * lr
    learners = learnable_quantizers(model)
    ids = {id(fq.learned) for fq in learners}
    groups: list[dict[str, Any]] = []
    if weight_lr_per_step is not None:
        for parameter, step in quantized_weights(model):
            if parameter.requires_grad and id(parameter) not in ids:
                ids.add(id(parameter))
                groups.append({"params": [parameter], "lr": weight_lr_per_step * step})
    weights = [p for p in model.parameters() if p.requires_grad and id(p) not in ids]
    groups.insert(0, {"params": weights, "lr": lr})
    thresholds = [fq.learned for fq in learners if fq.learning == "tqt"]
    if thresholds:
        groups.append({"params": thresholds, "lr": rate})
    for fq in learners:
        if fq.learning == "lsq" and fq.learned is not None:
            magnitude = float(fq.learned.detach().abs().mean())
            groups.append({"params": [fq.learned], "lr": rate * max(magnitude, 1e-12)})
    return torch.optim.Adam(groups)


def initialize_learnables(model: nn.Module, inputs: Sequence[Any]) -> None:
    """Run one batch in eval mode without gradients so that learnable qparams still waiting
    for data start from it (batch-norm statistics are not touched)."""
    if not first_batch_pending(model):
        return
    restore_first_batch_hooks(model)
    with evaluating(model):
        model(*inputs)


def set_batch_norm_stats_frozen(model: nn.Module, frozen: bool) -> None:
    """Batch norms use (and keep) their running statistics while the rest trains."""
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm | GraphBatchNorm):
            module.train(not frozen and model.training)


def train_qat(
    model: nn.Module,
    loader: Iterable[Any],
    *,
    epochs: int = 1,
    teacher: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    lr: float = 1e-4,
    qparam_lr: float | None = None,
    weight_lr_per_step: float | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    temperature: float = 1.0,
    freeze_batch_norm: bool = False,
    num_inputs: int = 1,
    on_epoch_end: EpochCallback | None = None,
    scheduler: Any = None,
    compile_model: bool = False,
    quiet: bool = False,
) -> list[dict[str, float]]:
    """Train ``model`` for ``epochs`` over ``loader`` (see the module docstring). Returns
    one record per epoch: mean loss, batch count, and what ``on_epoch_end(epoch, model)``
    returned. ``freeze_batch_norm`` keeps batch-norm statistics fixed (small data sets);
    ``scheduler`` (if given) steps once per batch; ``lr``, ``qparam_lr`` and
    ``weight_lr_per_step`` make the default optimizer (:func:`default_optimizer`).
    ``compile_model``: the training steps run the model through ``torch.compile`` (one
    graph; the first steps compile, minutes for a ResNet-50). On a GPU, where the eager
    step is bound by the host issuing the small fake-quantize ops, this is what makes QAT
    cheap: an H100's ResNet-50 step 1.19x the float step, against 2.9x eager. On CPU it
    depends on the model (Fashion-MNIST ResNet-18 1.23x against 1.82x eager; EfficientNet-Lite0
    at 224 px 2.88x against 1.77x). ``model`` itself stays the module to evaluate, save and
    freeze."""
    check_in_range("epochs", epochs, lambda v: isinstance(v, int) and v >= 1, "an integer >= 1")
    if optimizer is None:  # the default optimizer's rates (a given optimizer has its own)
        for field, rate in (("lr", lr), ("qparam_lr", qparam_lr)):
            if rate is not None:
                check_in_range(field, rate, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")
    check_in_range("temperature", temperature, lambda v: math.isfinite(v) and v > 0, "a finite number > 0")
    # A QAT step is hundreds of small parallel ops: beside another torch process,
    # EfficientNet-Lite0's took 27 s with spinning OpenMP threads, 4.2 s with passive ones.
    warn_if_openmp_spins()
    criterion = loss_fn or F.cross_entropy
    device = model_device(model)
    # A model prepared elsewhere has no signature: its batches are parsed, their shapes unchecked.
    signature = signature_of(model) or InputSignature((None,) * num_inputs, (None,) * num_inputs)
    if len(signature.shapes) != num_inputs:
        raise ConfigError(f"num_inputs: {num_inputs!r} is out of range; allowed: {len(signature.shapes)}, the model's")
    # Learnables start before the optimizer reads their sizes, before compiling (the compiled
    # graph then never meets the first-batch calibration) and before batch norms freeze.
    if first_batch_pending(model):
        items = iter(loader)
        first = next(items, None)
        if first is not None:
            initialize_learnables(model, _inputs(first, signature, 0, device))
            if items is loader:  # a one-shot iterator: the batch it gave up is trained on too
                loader = itertools.chain([first], items)
    if optimizer is None:
        optimizer = default_optimizer(model, lr, qparam_lr, weight_lr_per_step)
    step_model = torch.compile(model) if compile_model else model
    history: list[dict[str, float]] = []
    for epoch in range(epochs):
        model.train()
        set_batch_norm_stats_frozen(model, freeze_batch_norm)
        total, count = 0.0, 0
        progress = tqdm(loader, total=loader_length(loader), desc=f"QAT epoch {epoch + 1}/{epochs}", disable=quiet)
        for index, item in enumerate(progress):
            inputs = _inputs(item, signature, index, device)
            output = step_model(*inputs)
            if teacher is not None:
                # Eval mode only for the call: the teacher is the user's model, its modes theirs.
                with evaluating(teacher):
                    target = teacher(*inputs)
                loss = distillation_loss(output, target, temperature)
            else:
                labels = labels_of(item, num_inputs)
                if labels is None:
                    raise DataError(
                        f"data: batch {index} has no labels; pass (inputs, labels) batches or a teacher= model"
                    )
                if isinstance(labels, np.ndarray):
                    labels = torch.from_numpy(labels)
                if loss_fn is None:
                    _check_class_labels(labels, inputs, index)
                loss = criterion(output, labels.to(device) if isinstance(labels, torch.Tensor) else labels)
            value = float(loss.detach())
            if not np.isfinite(value):  # before the step: it would leave every parameter NaN
                raise DataError(
                    f"training: the loss at epoch {epoch + 1}, batch {index} is {value}; "
                    "the data, labels, lr or loss_fn give a non-finite loss"
                )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            total += value
            count += 1
            progress.set_postfix(loss=f"{total / count:.4f}")
        if count == 0:
            raise DataError("data: the training loader yielded no batches")
        record: dict[str, float] = {"epoch": float(epoch + 1), "loss": total / count, "batches": float(count)}
        if on_epoch_end is not None:
            record.update(on_epoch_end(epoch + 1, model) or {})
        history.append(record)
    return history


def _inputs(item: Any, signature: InputSignature, index: int, device: torch.device | None) -> Sequence[Any]:
    values = signature.inputs(item, index)
    check_finite(values, f"data: batch {index}")
    if device is None:
        return values
    return tuple(v.to(device) if isinstance(v, torch.Tensor) else v for v in values)


def _check_class_labels(labels: Any, inputs: Sequence[Any], index: int) -> None:
    """Cross entropy's class indices, one per sample (torch's own errors name neither the
    batch nor the labels)."""
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.is_complex():
        got = f"{labels.dtype} tensor" if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise DataError(
            f"data: batch {index} labels are a {got}; allowed with the default loss (cross entropy): integer "
            "class indices (pass loss_fn= for other targets)"
        )
    samples = next((v.shape[0] for v in inputs if isinstance(v, torch.Tensor) and v.dim() > 0), None)
    count = labels.shape[0] if labels.dim() > 0 else 1
    if samples is not None and count != samples:
        raise DataError(f"data: batch {index} has {count} labels for {samples} samples; expected one label per sample")
