"""The quantization pipeline, in the order it runs:

1. :mod:`~quant_onnx.pipeline.preprocess`: exact clean-ups of the float model (constants
   folded, BatchNorm folded into convs, zero Pads folded, opset raised where needed).
2. :mod:`~quant_onnx.pipeline.annotate`: the model mapped onto ``quant_core.plan``; the
   planner decides which tensor gets which spec.
3. :mod:`~quant_onnx.pipeline.calibrate`: onnxruntime runs the data batch by batch into
   ``quant_core`` observers -> a calibrated model.
4. :mod:`~quant_onnx.pipeline.qdq_writer`: the QDQ model, finished for onnxruntime by the
   QDQ layer (:mod:`quant_core.onnx_qdq`).

(:mod:`~quant_onnx.pipeline.dynamic` is the data-free alternative to 2-4.) Accuracy
algorithms run between these steps (:mod:`quant_onnx.algorithms`); calibration data
readers are :mod:`quant_onnx.data`, reports and comparisons :mod:`quant_onnx.reporting`,
the command line :mod:`quant_onnx.cli`.

Example:
    >>> from quant_onnx.pipeline import qdq_writer
    >>> qdq_writer.WriterOptions().activation_encoding
    'x86_uint8'
"""
