"""What users touch around the pipeline: the ``quant-onnx`` command line
(:mod:`~quant_onnx.io.cli`), calibration data readers (:mod:`~quant_onnx.io.data`),
reports (:mod:`~quant_onnx.io.report`), model comparison (:mod:`~quant_onnx.io.compare`)
and command-line style config edits (:mod:`~quant_onnx.io.config_overrides`).

Example:
    >>> from quant_onnx.io.cli import main
    >>> main(["inspect", "does-not-exist.onnx"])
    2
"""
