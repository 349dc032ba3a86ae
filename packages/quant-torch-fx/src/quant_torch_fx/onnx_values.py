"""What an FX node stands for while :mod:`quant_torch_fx.onnx_emit` writes a graph: an ONNX
tensor name (a plain ``str``), or one of these, which become ONNX nodes or initializers only
where something reads them.

Example:
    >>> Size("batch_size").tensor
    'batch_size'
"""

from __future__ import annotations

import attrs
import torch
from torch.fx import Node

from quant_core.dtypes import DType


@attrs.frozen
class Quantized:
    """An activation after its ``QuantizeLinear``: read through a ``DequantizeLinear`` per
    reading node (shape readers take the codes themselves)."""

    codes: str
    scale: str
    zero_point: str
    source: str
    bits: int


@attrs.frozen
class Dequantized:
    """Integer codes held by the model (``get_attr`` nodes) behind a ``DequantizeLinear``
    with ``axis`` (``None``: per tensor), written where a node reads them."""

    codes: Node
    scale: Node
    zero_point: Node
    axis: int | None
    dtype: DType


@attrs.frozen
class Constant:
    """A tensor the model holds (a ``get_attr`` node): an initializer once something reads it."""

    node: Node


@attrs.frozen(eq=False)
class Folded:
    """A tensor computed from constants alone (masks, index tables, ``arange``...): torch
    computes it once and the file holds it as an initializer named after the FX node."""

    tensor: torch.Tensor
    name: str


@attrs.frozen
class Size:
    """A ``SymInt`` (an int64 ``[1]`` tensor): the dynamic batch and arithmetic on it."""

    tensor: str
