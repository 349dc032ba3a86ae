"""Torch fake quantization, bit-exact with ``quant_core.qparams`` (the arithmetic lives in
``quant_algos.torch_quant``, shared with AdaRound and AdaQuant).

Example:
    >>> import torch
    >>> from quant_core.qparams import QParams
    >>> fake_quantize(torch.tensor([0.26, 0.74, 100.0]), QParams.per_tensor(0.5, 0, "int8")).tolist()
    [0.5, 0.5, 63.5]
"""

from __future__ import annotations

from quant_algos.torch_quant import (
    code_dtype,
    codes_from_tensors,
    fake_quantize,
    fake_quantize_tensors,
    qparams_to_tensors,
    quantize_codes,
    round_tensor,
)

__all__ = [
    "code_dtype",
    "codes_from_tensors",
    "fake_quantize",
    "fake_quantize_tensors",
    "qparams_to_tensors",
    "quantize_codes",
    "round_tensor",
]
