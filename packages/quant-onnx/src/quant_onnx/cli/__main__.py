"""``python -m quant_onnx.cli``: the ``quant-onnx`` command without its console script."""

import sys

from quant_onnx.cli.main import main

if __name__ == "__main__":  # importing the module (doctest collection) runs nothing
    sys.exit(main())
