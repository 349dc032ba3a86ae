"""Switch a prepared model into QAT: which quantizers learn, and how.

``qat_method``:

- ``"auto"``: TQT (learnable log2 threshold, power-of-two scales) for symmetric
  power-of-two specs, LSQ (learnable float scale) for float-scale specs; an asymmetric
  power-of-two spec falls back to ``"ste"``;
- ``"lsq"`` / ``"tqt"``: that method everywhere (an incompatible spec is an error);
- ``"ste"``: no learnable qparams: activation qparams stay as calibrated, weight qparams
  follow the weights at every step; gradients pass straight through.

Learnable weight qparams start from the weight's observer at once (the weights are
known); learnable activation qparams start from a calibration pass, or, without one, from
a calibration on the first batch the model sees (all ranks' first batches together under
``torch.distributed``): the same observers, saturation bounds, derived ranges (masked
attention scores) and constants as any calibration, in one extra forward pass without
gradients, in eval mode. Derived ranges (masked scores and their mask) keep those qparams
through training, straight through, rather than learn them.

Example:
    >>> from quant_core.spec import QuantSpec
    >>> method_for(QuantSpec(dtype="int8", scale_type="power_of_two"), "auto"), method_for(QuantSpec(dtype="int8"), "auto")
    ('tqt', 'lsq')
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.fx import GraphModule

from quant_core.errors import ConfigError
from quant_core.observers import make_observer
from quant_core.spec import QuantSpec, ScaleType
from quant_torch_fx.calibrate import calibrating, evaluating, finish_calibration
from quant_torch_fx.observe import observe
from quant_torch_fx.prepare import (
    activation_quantizers,
    constant_lookup,
    graph_info,
    quantized_graphs,
    weight_quantizers,
)
from quant_torch_fx.quantizer import FakeQuantizer

QAT_METHODS = ("auto", "lsq", "tqt", "ste")


def method_for(spec: QuantSpec, method: str) -> str:
    """The method a quantizer with ``spec`` uses under ``method`` (see the module docstring)."""
    if method != "auto":
        return method
    if spec.scale_type is ScaleType.POWER_OF_TWO:
        return "tqt" if spec.symmetric else "ste"
    return "lsq"


def enable_qat(model: nn.Module, method: str, *, compiled: bool = False) -> None:
    """Make every prepared graph in ``model`` ready to train (in place); ``compiled``: the
    power-of-two paths through ``torch.compile``."""
    import torch

    if method not in QAT_METHODS:
        raise ConfigError(f"qat_method: {method!r} is not allowed; allowed: {', '.join(QAT_METHODS)}")
    for gm in quantized_graphs(model):
        info = graph_info(gm)
        for key, fq in activation_quantizers(gm):
            chosen = method_for(fq.spec, method)
            fq.compiled = compiled
            fq.observing = False
            # Masked scores and their mask take qparams derived from the scores' range, not
            # learned: a threshold's gradient over the mask's -inf fill is NaN.
            if chosen == "ste" or info.plan.derived_of(key) is not None:
                fq.quantizing = False  # until calibrated
                continue
            fq.enable_learning(chosen)
            fq.quantizing = True
        info.first_batch_seen = False
        _hook_first_batch(gm)
        values = constant_lookup(gm)
        for node, fq in weight_quantizers(gm):
            chosen = method_for(fq.spec, method)
            fq.compiled = compiled
            fq.quantizing = True
            if chosen == "ste":
                fq.track = True
                continue
            slot = info.plan.weight_of(node)
            assert slot is not None
            weight = values(slot.tensor)
            assert weight is not None
            axis = fq.spec.channel_axis
            fq.enable_learning(chosen, () if axis is None else (int(weight.shape[axis]),))
            observer = make_observer(fq.spec)
            observe(observer, torch.from_numpy(weight))
            fq.set_qparams(observer.qparams())


def _hook_first_batch(gm: GraphModule) -> None:
    if calibrate_on_first_batch not in gm._forward_pre_hooks.values():
        gm.register_forward_pre_hook(calibrate_on_first_batch, with_kwargs=True)


def waits_for_data(fq: FakeQuantizer) -> bool:
    """Whether an activation quantizer still needs the first-batch calibration: learnable
    qparams never set, or straight-through ones (``ste``, e.g. ``auto`` on asymmetric
    power-of-two activations) without qparams."""
    return not fq.initialized if fq.learning is not None else fq.qparams is None


def first_batch_pending(model: nn.Module) -> bool:
    """Whether any prepared graph of ``model`` has an activation quantizer that
    :func:`waits_for_data`."""
    return any(waits_for_data(fq) for gm in quantized_graphs(model) for _key, fq in activation_quantizers(gm))


def restore_first_batch_hooks(model: nn.Module) -> None:
    """Hook the first-batch calibration back onto every prepared graph of ``model`` whose
    activation qparams still wait for data: ``copy.deepcopy`` of a GraphModule keeps no
    forward hooks, so a copy taken before the first batch (an EMA or teacher copy, a
    snapshot) would train with scales never set."""
    for gm in quantized_graphs(model):
        if any(waits_for_data(fq) for _key, fq in activation_quantizers(gm)):
            graph_info(gm).first_batch_seen = False
            _hook_first_batch(gm)


def calibrate_on_first_batch(gm: GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A forward pre-hook: on the first call after :func:`enable_qat`, when learnable
    activation qparams are still unset (no calibration ran, no checkpoint restored them),
    calibrate on this batch first, as :meth:`ModelQuantizer.calibrate` would on a loader
    of one batch. Later calls cost one attribute check."""
    info = graph_info(gm)
    if info.first_batch_seen:
        return
    quantizers = [fq for _key, fq in activation_quantizers(gm)]
    if any(fq.observing for fq in quantizers):  # a calibration is running: it sets them
        return
    info.first_batch_seen = True
    if not any(waits_for_data(fq) for fq in quantizers):
        return
    try:
        with calibrating(gm) as observing:
            with evaluating(gm):  # no batch-norm statistics updated by this extra pass
                gm.forward(*args, **kwargs)  # not gm(...): that would call this hook again
            finish_calibration(gm, observing)
    except BaseException:
        info.first_batch_seen = False  # the next batch calibrates
        raise
