"""Benchmark harnesses: ``onnx_ptq`` (quant-onnx vs onnxruntime.quantization) and ``algos``
(accuracy-recovery algorithms), sharing the measuring helpers of ``common``.

Run from the repository root, e.g. ``python -m tools.bench.onnx_ptq --quick``.
"""
