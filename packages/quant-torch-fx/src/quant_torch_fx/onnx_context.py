"""What a rule of :mod:`quant_torch_fx.onnx_rules` or :mod:`quant_torch_fx.onnx_layout_rules`
may ask of the emitter that calls it: :class:`quant_torch_fx.onnx_emit.Emitter` is one. The
rules name this protocol rather than the emitter, which reads them through
:data:`quant_torch_fx.aten_map.ATEN_OPS`, so the modules import each other in one direction.

Example:
    >>> from quant_torch_fx.onnx_emit import Emitter
    >>> all(hasattr(Emitter, name) for name in ("add", "tensor", "bind", "error"))
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch.fx import Node

from quant_core.errors import ModelError
from quant_torch_fx.onnx_values import Dequantized


class RuleContext(Protocol):
    """The emitter's writing helpers and its view of the node being written (``current``)."""

    opset: int
    current: Node | None

    def add(self, op_type: str, inputs: Sequence[str], outputs: int = 1, **attributes: Any) -> Any: ...

    def tensor(self, arg: Any, dtype: torch.dtype | None = None) -> str: ...

    def const(self, value: Any, hint: str, dtype: torch.dtype = torch.float32) -> str: ...

    def ints(self, values: Sequence[Any], hint: str = "shape") -> str: ...

    def value(self, arg: Any) -> Any: ...

    def weight(self, value: Dequantized, transposed: bool = False) -> str: ...

    def attr(self, node: Node, elem_type: int | None = None, transposed: bool = False) -> str: ...

    def shape_source(self, arg: Node) -> str: ...

    def bind(self, node: Node) -> dict[str, Any]: ...

    def meta(self, arg: Any) -> Any: ...

    def dtype(self, arg: Any) -> torch.dtype: ...

    def rank(self, arg: Any) -> int: ...

    def shape(self, arg: Any) -> list[int | None]: ...

    def sizes(self, arg: Node) -> list[Any]: ...

    def out_dtype(self) -> torch.dtype: ...

    def error(self, what: str) -> ModelError: ...
