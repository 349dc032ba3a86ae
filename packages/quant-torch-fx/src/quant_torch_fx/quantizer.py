"""``FakeQuantizer``: one set of quantization parameters (an activation group's, a weight's)
as a module: a ``quant_core`` observer fed on the tensor's device, the qparams it gives,
and, for QAT, a learnable scale (LSQ) or log2 threshold (TQT).

States, switched by the owner (:mod:`quant_torch_fx.prepare`):

- ``observing``: each call folds the tensor into the observer (calibration);
- ``quantizing``: each call returns the fake-quantized tensor, bit-exact with
  ``quant_core.qparams.fake_quantize`` for the current qparams;
- ``learning`` (``"lsq"``/``"tqt"``): the qparams are parameters, initialised by
  :meth:`FakeQuantizer.set_qparams` (calibration sets them).

The observer's state travels in the module's ``state_dict`` (``get_extra_state``), so a
checkpoint restores calibration as well as learned parameters.

Example:
    >>> import torch
    >>> from quant_core.spec import QuantSpec
    >>> fq = FakeQuantizer(QuantSpec(dtype="int8"), name="x")
    >>> fq.observing = True
    >>> _ = fq(torch.tensor([-1.0, 2.54]))
    >>> fq.set_qparams(fq.observer.qparams())
    >>> fq.observing, fq.quantizing = False, True
    >>> fq(torch.tensor([0.011, 5.0])).tolist()
    [0.019999999552965164, 2.5399999618530273]
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from quant_core.errors import ConfigError, DataError, ModelError
from quant_core.observers import Observer, make_observer
from quant_core.qparams import QParams, qparams_from_data, qparams_to_data, scale_from_fix_pos
from quant_core.spec import QuantSpec, ScaleType
from quant_torch_fx.fake_quantize import code_dtype, fake_quantize_tensors
from quant_torch_fx.observe import PendingRange, observe, observe_later
from quant_torch_fx.qat_ops import (
    compiled_power_of_two,
    lsq_fake_quantize,
    ste_fake_quantize,
    tqt_fake_quantize,
    tqt_scale,
)

LEARNING_METHODS = ("lsq", "tqt")


class FakeQuantizer(nn.Module):
    """Observer, qparams and fake quantization of one tensor (or one shared-scale group).

    Args:
        spec: the tensor's spec (per-channel axis already resolved for weights).
        name: what errors and reports call it (the group key or the weight's node).

    Example:
        >>> from quant_core.spec import QuantSpec
        >>> FakeQuantizer(QuantSpec(dtype="uint8", symmetric=False), name="relu_1").extra_repr()
        "name='relu_1', dtype=uint8, axis=None, learning=None"
    """

    scale: torch.Tensor
    zero_point: torch.Tensor

    def __init__(self, spec: QuantSpec, *, name: str) -> None:
        super().__init__()
        if not spec.is_quantized:
            raise ConfigError(f"{name}: dtype {spec.dtype.value} keeps the tensor in float; it needs no quantizer")
        self.spec = spec
        self.name = name
        self._observer: Observer = make_observer(spec)
        self._pending: PendingRange | None = None
        self.observing = False
        self.quantizing = False
        self.learning: str | None = None
        self.initialized = False
        self.track = False
        self.compiled = False
        self._levels = spec.qrange[1]
        self._zero_is_zero = False
        self.qparams: QParams | None = None
        self.register_buffer("scale", torch.ones(()))
        self.register_buffer("zero_point", torch.zeros((), dtype=code_dtype_of(spec)))
        self.learned: nn.Parameter | None = None

    # --- observer ---------------------------------------------------------------------------
    @property
    def observer(self) -> Observer:
        """The observer, holding every batch seen: statistics still kept on the tensors'
        device (:func:`quant_torch_fx.observe.observe_later`) are handed to it first."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            try:
                pending.flush_into(self._observer)
            except DataError as exc:  # a batch held NaN or an infinity
                raise self._calibration_error(exc) from None
        return self._observer

    @observer.setter
    def observer(self, observer: Observer) -> None:
        self._pending = None
        self._observer = observer

    # --- qparams ---------------------------------------------------------------------------
    @property
    def axis(self) -> int | None:
        return self.spec.channel_axis

    def set_qparams(self, qp: QParams) -> None:
        """Use ``qp`` from now on (and as the initial value of a learnable parameter)."""
        self._use_qparams(qp)
        device = self.scale.device
        self.scale = torch.as_tensor(np.asarray(qp.scale, np.float32), device=device).clone()
        self.zero_point = torch.as_tensor(np.asarray(qp.zero_point), dtype=code_dtype(qp), device=device).clone()
        if self.learning is not None and self.learned is not None:
            with torch.no_grad():
                value = self._learned_value_for(qp).to(self.learned.device)
                if self.learned.shape != value.shape:
                    self.learned.data = value.clone()
                else:
                    self.learned.copy_(value)
            self.initialized = True

    def _use_qparams(self, qp: QParams | None) -> None:
        """``qp`` and what the gradients derive from it (a restored checkpoint too)."""
        self.qparams = qp
        if qp is not None:
            self._levels = max(1, qp.qmax - int(np.max(qp.zero_point)))
            self._zero_is_zero = not np.any(qp.zero_point)

    def current_qparams(self) -> QParams:
        """The qparams in use: the learned ones for LSQ/TQT, else the set ones."""
        if self.qparams is None:
            raise ModelError(f"{self.name}: no qparams yet; calibrate the model first")
        if self.learning is None or self.learned is None:
            return self.qparams
        learned = self.learned.detach().to(torch.float64).cpu().numpy()
        if self.learning == "tqt":
            fix_pos = (self.spec.dtype.bits - 1) - np.ceil(learned).astype(np.int64)
            return self.qparams.evolve(scale=scale_from_fix_pos(fix_pos), fix_pos=fix_pos)
        tiny = np.float32(np.finfo(np.float32).tiny * 2.0**24)
        return self.qparams.evolve(scale=np.maximum(learned.astype(np.float32), tiny))

    # --- learning ----------------------------------------------------------------------------
    def enable_learning(self, method: str, shape: tuple[int, ...] = ()) -> None:
        """Make the qparams learnable with ``method`` (``"lsq"``: float scales; ``"tqt"``:
        power-of-two scales from a log2 threshold, symmetric specs). ``shape``: one value per
        channel for per-channel weights. The parameter exists from now on (so an optimizer or
        DDP created after this sees it) and is initialised from the qparams when they are set."""
        if method not in LEARNING_METHODS:
            raise ConfigError(f"qat method: {method!r} is not allowed; allowed: {', '.join(LEARNING_METHODS)}")
        pow2 = self.spec.scale_type is ScaleType.POWER_OF_TWO
        if method == "tqt" and not (pow2 and self.spec.symmetric):
            raise ConfigError(
                f"{self.name}: qat method 'tqt' learns power-of-two thresholds of symmetric specs; "
                "this spec has scale_type "
                f"{self.spec.scale_type.value}, symmetric {self.spec.symmetric}; allowed here: lsq"
            )
        if method == "lsq" and pow2:
            raise ConfigError(f"{self.name}: qat method 'lsq' learns float scales; power-of-two specs allow: tqt")
        self.learning = method
        self.learned = nn.Parameter(torch.zeros(shape, device=self.scale.device))
        if self.qparams is not None:
            self.set_qparams(self.qparams)

    def _learned_value_for(self, qp: QParams) -> torch.Tensor:
        scale = np.asarray(qp.scale, np.float64)
        if self.learning != "tqt":
            return torch.as_tensor(scale, dtype=torch.float32)
        # 2**ceil(t) / 2**(bits-1) == scale: start in the middle of that integer step so
        # that small updates do not flip the power of two back and forth.
        value = np.log2(scale) + (self.spec.dtype.bits - 1) - 0.5
        return torch.as_tensor(value, dtype=torch.float32)

    # --- forward --------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, observe_batch: bool = True, redundant: bool = False) -> torch.Tensor:
        """Observe (``observe_batch``) and fake-quantize ``x``. A ``redundant`` call, one the
        preparer proved changes nothing (its input already carries these qparams), is
        skipped in training mode to save time and kept in eval mode."""
        if redundant and self.training and not self.observing:
            return x
        if self.observing and observe_batch:
            self._observe(x)  # calibration: observers are merged across ranks at the end
        if self.track and self.quantizing and self.learning is None:
            # A weight during STE QAT: qparams follow the weight at every step.
            tracker = make_observer(self.spec)
            observe(tracker, x)
            self.set_qparams(tracker.qparams())
        if not self.quantizing:
            return x
        return self.fake_quantize(x)

    def _observe(self, x: torch.Tensor) -> None:
        try:  # a min-max observer's range stays on the tensor's device until it is read
            later = observe_later(self._observer, x, self._pending)
        except DataError as exc:  # a batch without the channel axis
            raise self._calibration_error(exc) from None
        if later is not None:
            self._pending = later
            return
        observer = self.observer  # what is pending goes first (its errors named there)
        try:
            observe(observer, x)
        except DataError as exc:  # NaN/Inf, or a batch without the channel axis
            raise self._calibration_error(exc) from None

    def _calibration_error(self, exc: DataError) -> DataError:
        return DataError(f"calibration: tensor {self.name!r}: {exc}")

    def _broadcast(self, value: torch.Tensor, ndim: int) -> torch.Tensor:
        axis = self.axis
        if axis is None or value.dim() == 0:
            return value
        shape = [1] * ndim
        shape[axis] = -1
        return value.reshape(shape)

    def fake_quantize(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` fake-quantized with the current qparams (differentiable for QAT)."""
        if self.learning is not None and not self.initialized:  # its 0 would quantize all to one value
            raise ModelError(
                f"{self.name}: its learnable qparams were never set: calibrate the model, or run "
                "quant_torch_fx.training.initialize_learnables(model, inputs) first (train_qat "
                "does); a copy.deepcopy taken before the first batch loses the first-batch hook"
            )
        qmin, qmax = self.spec.qrange
        rounding = self.spec.rounding
        zero_point = self._broadcast(self.zero_point, x.dim())
        if self.compiled and torch.is_grad_enabled() and x.requires_grad:
            out = self._compiled(x, zero_point, qmin, qmax)
            if out is not None:
                return out
        if self.learning is not None and self.learned is not None:
            learned = self._broadcast(self.learned, x.dim())
            zero = self._zero_is_zero
            if self.learning == "tqt":
                bits = self.spec.dtype.bits
                return tqt_fake_quantize(x, learned, zero_point, qmin, qmax, rounding, bits=bits, zero_is_zero=zero)
            per_scale = x.numel() // max(1, self.learned.numel())
            grad_scale = 1.0 / math.sqrt(max(1, per_scale) * self._levels)
            return lsq_fake_quantize(
                x, learned, zero_point, qmin, qmax, rounding, grad_scale=grad_scale, zero_is_zero=zero
            )
        scale = self._broadcast(self.scale, x.dim())
        if torch.is_grad_enabled() and x.requires_grad:
            pow2 = self.qparams is not None and self.qparams.fix_pos is not None
            return ste_fake_quantize(x, scale, zero_point, qmin, qmax, rounding, pow2, self._zero_is_zero)
        return fake_quantize_tensors(x, scale, zero_point, qmin, qmax, rounding)

    def _compiled(self, x: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor | None:
        """The compiled power-of-two path (TQT, or STE with power-of-two qparams), if it applies."""
        if self.learning == "tqt" and self.learned is not None:
            scale = tqt_scale(self.learned, self.spec.dtype.bits)
        elif self.learning is None and self.qparams is not None and self.qparams.fix_pos is not None:
            scale = self.scale.detach()
        else:
            return None
        return compiled_power_of_two(x, scale, zero_point, qmin, qmax, self.spec.rounding, self.axis)

    def learned_scale(self) -> torch.Tensor:
        """The scale in use as a tensor (learned or set), for QAT helpers and reports."""
        if self.learning == "tqt" and self.learned is not None:
            return tqt_scale(self.learned.detach(), self.spec.dtype.bits)
        if self.learning == "lsq" and self.learned is not None:
            return self.learned.detach()
        return self.scale

    # --- state ------------------------------------------------------------------------------------
    def get_extra_state(self) -> dict[str, Any]:
        return {
            "observer": self.observer.state_dict(),
            "qparams": None if self.qparams is None else qparams_to_data(self.qparams),
            "observing": self.observing,
            "quantizing": self.quantizing,
            "initialized": self.initialized,
        }

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.observer = Observer.from_state_dict(state["observer"])
        self.observing = bool(state["observing"])
        self.quantizing = bool(state["quantizing"])
        self._use_qparams(None if state["qparams"] is None else qparams_from_data(state["qparams"]))
        self.initialized = bool(state["initialized"])

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        # A per-channel checkpoint into a fresh quantizer: its scale and zero point (and a
        # learned scale) are 0-d until qparams are set, so take the checkpoint's shapes first.
        for name in ("scale", "zero_point", "learned"):
            held, saved = getattr(self, name), state_dict.get(prefix + name)
            if isinstance(held, torch.Tensor) and isinstance(saved, torch.Tensor) and held.shape != saved.shape:
                fresh = torch.empty(saved.shape, dtype=held.dtype, device=held.device)
                if isinstance(held, nn.Parameter):
                    held.data = fresh
                else:
                    setattr(self, name, fresh)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"name={self.name!r}, dtype={self.spec.dtype.value}, axis={self.axis}, learning={self.learning}"


def code_dtype_of(spec: QuantSpec) -> torch.dtype:
    """The float type of a spec's codes (float32 up to 16 bits, float64 above)."""
    return torch.float64 if spec.dtype.bits > 16 else torch.float32
