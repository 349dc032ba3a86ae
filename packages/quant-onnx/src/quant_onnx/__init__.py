"""quant_onnx: post-training quantization of ONNX vision models to QDQ ONNX.

Example:
    >>> import quant_onnx
    >>> callable(quant_onnx.quantize) and quant_onnx.DEFAULT_PRESET
    'a8w8'
"""

from __future__ import annotations

from quant_core.errors import DataError, ModelError, OutputError
from quant_core.presets import DEFAULT_PRESET
from quant_onnx.api import ModelQuantizer, PreparedModel, QuantizationResult, quantize, resolve_config
from quant_onnx.pipeline.annotate import plan_model
from quant_onnx.pipeline.calibrate import CalibratedModel, calibrate
from quant_onnx.pipeline.dynamic import quantize_dynamic, quantize_dynamic_model
from quant_onnx.pipeline.qdq_writer import WriterOptions, write_qdq
from quant_onnx.recipe_search import SearchResult, SearchSpace, search
from quant_onnx.reporting.compare import Comparison, compare_models

__all__ = [
    "DEFAULT_PRESET",
    "CalibratedModel",
    "Comparison",
    "DataError",
    "ModelError",
    "ModelQuantizer",
    "OutputError",
    "PreparedModel",
    "QuantizationResult",
    "SearchResult",
    "SearchSpace",
    "WriterOptions",
    "calibrate",
    "compare_models",
    "plan_model",
    "quantize",
    "quantize_dynamic",
    "quantize_dynamic_model",
    "resolve_config",
    "search",
    "write_qdq",
]

__version__ = "0.1.0"
