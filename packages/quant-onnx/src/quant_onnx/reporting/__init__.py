"""What a quantization run reports: the JSON report (:mod:`~quant_onnx.reporting.report`)
and the comparison of a quantized model with its float model on the same data
(:mod:`~quant_onnx.reporting.compare`).

Example:
    >>> from quant_onnx.reporting.compare import compare_models
    >>> callable(compare_models)
    True
"""
