"""What a data loader may yield, and the check that its batches fit the model.

A batch is a tensor, or a tuple/list whose first elements are the model's inputs (a
``(images, labels)`` pair from a ``DataLoader``: the labels are ignored where only inputs
are needed); numpy arrays are accepted. Every tensor input must have the example
input's shape apart from the batch axis: a wrong batch fails at once, naming the
expected shape, before anything runs.

Example:
    >>> import torch
    >>> sig = InputSignature.of((torch.zeros(1, 3, 8, 8),))
    >>> [t.shape for t in sig.inputs((torch.zeros(4, 3, 8, 8), torch.tensor([1, 2, 3, 4])), 0)]
    [torch.Size([4, 3, 8, 8])]
    >>> sig.inputs(torch.zeros(4, 8, 8), 0)
    Traceback (most recent call last):
    ...
    quant_core.errors.DataError: data: batch 0, input 0 has shape [4, 8, 8]; expected [N, 3, 8, 8] (the example input's shape, any batch size N)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import attrs
import numpy as np
import torch
from torch import nn
from torch.fx import GraphModule

from quant_core.errors import DataError

_SIGNATURE_KEY = "quant_torch_fx_input_signature"


def _shape(value: Any) -> tuple[int, ...] | None:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


@attrs.frozen
class InputSignature:
    """The model's positional inputs: per input the example's shape (``None`` for a
    non-tensor argument) and dtype, and whether axis 0 is a free batch axis.

    Example:
        >>> InputSignature.of((torch.zeros(2, 5),)).describe(0)
        '[N, 5]'
    """

    shapes: tuple[tuple[int, ...] | None, ...]
    dtypes: tuple[torch.dtype | None, ...]
    dynamic_batch: bool = True

    @staticmethod
    def of(example_args: tuple[Any, ...], dynamic_batch: bool = True) -> InputSignature:
        return InputSignature(
            tuple(_shape(a) for a in example_args),
            tuple(a.dtype if isinstance(a, torch.Tensor) else None for a in example_args),
            dynamic_batch,
        )

    def describe(self, index: int) -> str:
        shape = self.shapes[index]
        if shape is None:
            return "a non-tensor argument"
        dims = [str(d) for d in shape]
        if self.dynamic_batch and dims:
            dims[0] = "N"
        return f"[{', '.join(dims)}]"

    def inputs(self, item: Any, index: int, *, where: str | None = None) -> tuple[Any, ...]:
        """The model inputs of batch ``index`` (checked; see the module docstring). ``where``
        names the data in errors instead of ``data: batch <index>`` (samples, not batches)."""
        where = where or f"data: batch {index}"
        count = len(self.shapes)
        if isinstance(item, np.ndarray):
            item = torch.from_numpy(item)
        if isinstance(item, torch.Tensor):
            values: tuple[Any, ...] = (item,)
        elif isinstance(item, list | tuple):
            values = tuple(torch.from_numpy(v) if isinstance(v, np.ndarray) else v for v in item[:count])
        else:
            raise DataError(
                f"{where} is a {type(item).__name__}; allowed: a tensor, or a tuple whose first "
                f"{count} element(s) are the model inputs (e.g. (images, labels))"
            )
        if len(values) < count:
            raise DataError(f"{where} has {len(values)} input(s); the model takes {count}")
        for position, (value, shape, dtype) in enumerate(zip(values, self.shapes, self.dtypes, strict=True)):
            if shape is None:
                continue
            ok = isinstance(value, torch.Tensor) and value.dim() == len(shape)
            if ok:
                start = 1 if self.dynamic_batch else 0
                ok = tuple(value.shape[start:]) == shape[start:]
            if not ok:
                got = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                batch = "any batch size N" if self.dynamic_batch else "the batch size fixed: dynamic_batch=False"
                raise DataError(
                    f"{where}, input {position} has shape {got}; expected {self.describe(position)} "
                    f"(the example input's shape, {batch})"
                )
            # A float64 batch for a float32 model would fail deep inside the first layer.
            if dtype is not None and (
                value.is_floating_point() != dtype.is_floating_point
                or (dtype.is_floating_point and value.dtype != dtype)
            ):
                raise DataError(
                    f"{where}, input {position} has dtype {value.dtype}; expected {dtype} like the example input"
                )
        return values


def batches(
    loader: Iterable[Any], signature: InputSignature, device: torch.device | None, num_samples: int | None = None
) -> Iterator[tuple[Any, ...]]:
    """The loader's batches as checked input tuples on ``device``; with ``num_samples``, its
    first that many samples (a config's ``calibration.num_samples``, which the ONNX backend
    reads the same way): the last batch is cut, unless the batch size is fixed
    (``dynamic_batch=False``), where it is taken whole.

    Example:
        >>> sig = InputSignature.of((torch.zeros(1, 3),))
        >>> [b[0].shape[0] for b in batches([torch.zeros(4, 3)] * 3, sig, None, num_samples=6)]
        [4, 2]
    """
    seen = 0
    for index, item in enumerate(loader):
        if num_samples is not None and seen >= num_samples:
            return
        values = signature.inputs(item, index)
        if num_samples is not None:
            if signature.dynamic_batch:
                values = tuple(v[: num_samples - seen] if isinstance(v, torch.Tensor) else v for v in values)
            seen += len(values[0]) if isinstance(values[0], torch.Tensor) and values[0].dim() else 1
        if device is not None:
            values = tuple(v.to(device) if isinstance(v, torch.Tensor) else v for v in values)
        yield values


def keep_signature(model: nn.Module, signature: InputSignature) -> None:
    """Remember on a prepared model what its batches look like, for the passes that get
    the model without its example inputs (:func:`quant_torch_fx.training.train_qat`)."""
    if isinstance(model, GraphModule):
        model.meta[_SIGNATURE_KEY] = signature  # a graph module's deepcopy keeps meta only
    else:
        setattr(model, _SIGNATURE_KEY, signature)


def signature_of(model: nn.Module) -> InputSignature | None:
    """The signature :func:`keep_signature` left on ``model`` (or on the prepared model a
    wrapper such as DDP holds), else ``None``."""
    for module in model.modules():
        found = module.meta.get(_SIGNATURE_KEY) if isinstance(module, GraphModule) else None
        found = found or getattr(module, _SIGNATURE_KEY, None)
        if isinstance(found, InputSignature):
            return found
    return None


def check_finite(values: tuple[Any, ...], where: str) -> None:
    """Floating-point inputs hold no NaN or infinity: calibration refuses them at the input's
    observer, and a step on one turns every trained parameter NaN."""
    for position, value in enumerate(values):
        if isinstance(value, torch.Tensor) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise DataError(f"{where}, input {position} holds NaN or infinite values; data must be finite")


def labels_of(item: Any, count: int) -> Any:
    """The labels of a ``(inputs..., labels)`` batch, or ``None`` when it has none."""
    if isinstance(item, list | tuple) and len(item) > count:
        return item[count]
    return None


def loader_length(loader: Any) -> int | None:
    """``len(loader)`` when it has one (a progress bar's total)."""
    try:
        return len(loader)
    except TypeError:
        return None
