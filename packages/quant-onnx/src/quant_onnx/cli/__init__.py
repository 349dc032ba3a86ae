"""The ``quant-onnx`` command line (:mod:`~quant_onnx.cli.main`), above the Python API:
``inspect`` (:mod:`~quant_onnx.cli.inspection`), the printed summary
(:mod:`~quant_onnx.cli.summary`) and command-line style config edits
(:mod:`~quant_onnx.cli.config_overrides`).

Example:
    >>> from quant_onnx.cli import main
    >>> main(["inspect", "does-not-exist.onnx"])
    2
"""

from quant_onnx.cli.main import main

__all__ = ["main"]
