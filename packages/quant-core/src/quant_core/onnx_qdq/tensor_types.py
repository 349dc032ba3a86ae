"""The one table between ``quant_core`` storage formats and ONNX tensor element types.

Example:
    >>> from onnx import TensorProto
    >>> ONNX_DTYPES[DType.INT8] == TensorProto.INT8, DTYPE_OF_ONNX[TensorProto.UINT16].value
    (True, 'uint16')
"""

from __future__ import annotations

from onnx import TensorProto

from quant_core.dtypes import DType

ONNX_DTYPES: dict[DType, int] = {
    DType.INT4: TensorProto.INT4,
    DType.UINT4: TensorProto.UINT4,
    DType.INT8: TensorProto.INT8,
    DType.UINT8: TensorProto.UINT8,
    DType.INT16: TensorProto.INT16,
    DType.UINT16: TensorProto.UINT16,
    DType.INT32: TensorProto.INT32,
}
"""Integer formats -> ``TensorProto`` element types."""

DTYPE_OF_ONNX: dict[int, DType] = {onnx_type: dtype for dtype, onnx_type in ONNX_DTYPES.items()}
"""``TensorProto`` integer element types -> formats."""
