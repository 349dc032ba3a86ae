"""The ONNX QDQ layer: what a QDQ ONNX file is, written and read in one place.

Both backends finish their files through it and the NPU tools read and rewrite through
it; it needs ``onnx`` alone (``pip install 'quant-core[onnx]'``), never onnxruntime or
torch, and ``import quant_core`` does not import it.

- :mod:`~quant_core.onnx_qdq.graph`: a read-only index over a graph (producers,
  consumers, constants, shapes, fresh names) and node attribute helpers;
- :mod:`~quant_core.onnx_qdq.model_io`: loading, validating, hashing and atomically saving
  models (external data checked before onnx reads it: :mod:`~quant_core.onnx_qdq.tensor_data`);
- :mod:`~quant_core.onnx_qdq.tensor_types`: the one table between quant_core formats and
  ONNX element types;
- :mod:`~quant_core.onnx_qdq.build`: fresh names, integer initializers and Q/DQ nodes;
- :mod:`~quant_core.onnx_qdq.finish`: what makes a written file compute in onnxruntime's
  default session what it says and reach the integer kernels (MatMulNBits and
  WeightBiasQuantization guards, Shape reads, 16-bit domain/opset, unread initializers);
- :mod:`~quant_core.onnx_qdq.conversions`: the NPU conversions as ONNX graph edits (float
  graphs before calibration; QDQ graphs through hooks, in ``quant_npu.legalize``);
- :mod:`~quant_core.onnx_qdq.reader`: a QDQ model read back as an integer program
  (integer tensors, fix positions, which node reads and writes which);
- :mod:`~quant_core.onnx_qdq.describe`: what an already quantized model holds (QDQ,
  QOperator or dynamic), for reports.

Example:
    >>> from quant_core.onnx_qdq.finish import finish_for_onnxruntime
    >>> callable(finish_for_onnxruntime)
    True
"""

from __future__ import annotations

import importlib.util

from quant_core.errors import MissingDependencyError

if importlib.util.find_spec("onnx") is None:  # pragma: no cover - exercised in the core-only test session
    raise MissingDependencyError(
        "quant_core.onnx_qdq reads and writes ONNX files and needs onnx: pip install 'quant-core[onnx]'"
    )
