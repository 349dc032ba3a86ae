"""``QuantModel``: the module :attr:`torch_quantizer.quant_model` hands out. It checks every
call's inputs against the example inputs (any batch size), counts the batches it saw
(calibration refuses to finish on none) and can record them (``fast_finetune`` collects
its data from the user's own loop that way). The quantized graph is ``.inner``.

Example:
    >>> import torch
    >>> m = QuantModel(torch.nn.ReLU(), (torch.zeros(1, 3),))
    >>> m(torch.tensor([[-1.0, 0.0, 2.0]])).tolist(), m.batches_seen
    ([[0.0, 0.0, 2.0]], 1)
    >>> m(torch.zeros(2, 4))
    Traceback (most recent call last):
    ...
    quant_core.errors.DataError: data: batch 1, input 0 has shape [2, 4]; expected [N, 3] (the example input's shape, any batch size N)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from quant_torch_fx import InputSignature


class QuantModel(nn.Module):
    """A quantized model that checks its inputs.

    Args:
        inner: the quantized graph module (``quant_torch_fx``'s).
        example_inputs: the example inputs (their shapes apart from the batch axis are the only allowed ones).

    Example:
        >>> QuantModel(torch.nn.Identity(), (torch.zeros(1, 2),)).signature.describe(0)
        '[N, 2]'
    """

    def __init__(self, inner: nn.Module, example_inputs: tuple[Any, ...]) -> None:
        super().__init__()
        self.inner = inner
        self.signature = InputSignature.of(example_inputs)
        self.batches_seen = 0
        self.recorded: list[tuple[Any, ...]] | None = None

    def forward(self, *args: Any) -> Any:
        inputs = self.signature.inputs(args, self.batches_seen)
        self.batches_seen += 1
        if self.recorded is not None:
            self.recorded.append(tuple(t.detach().cpu() if isinstance(t, torch.Tensor) else t for t in inputs))
        return self.inner(*args)
