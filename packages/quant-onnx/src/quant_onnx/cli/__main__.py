"""``python -m quant_onnx.cli``: the ``quant-onnx`` command without its console script."""

import sys

from quant_onnx.cli.main import main

sys.exit(main())
