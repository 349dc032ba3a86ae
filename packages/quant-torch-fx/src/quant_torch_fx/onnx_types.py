"""Element types of the ONNX file for torch dtypes (stored integer formats:
:data:`quant_core.onnx_qdq.tensor_types.ONNX_DTYPES`).

Example:
    >>> from onnx import TensorProto
    >>> onnx_type(torch.float32) == TensorProto.FLOAT
    True
"""

from __future__ import annotations

import torch
from onnx import TensorProto

from quant_core.errors import ModelError

_ONNX_OF_TORCH = {
    torch.float32: TensorProto.FLOAT,
    torch.float64: TensorProto.DOUBLE,
    torch.float16: TensorProto.FLOAT16,
    torch.bfloat16: TensorProto.BFLOAT16,
    torch.int64: TensorProto.INT64,
    torch.int32: TensorProto.INT32,
    torch.int16: TensorProto.INT16,
    torch.int8: TensorProto.INT8,
    torch.uint8: TensorProto.UINT8,
    torch.bool: TensorProto.BOOL,
}


def onnx_type(dtype: torch.dtype) -> int:
    """The ONNX element type of a torch dtype."""
    if dtype not in _ONNX_OF_TORCH:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in _ONNX_OF_TORCH)
        raise ModelError(f"export: tensors of {dtype} cannot be written; allowed: {allowed}")
    return _ONNX_OF_TORCH[dtype]
