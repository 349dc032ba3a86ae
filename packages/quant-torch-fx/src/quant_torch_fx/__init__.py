"""quant-torch-fx: graph-mode quantization of ``torch.export`` programs.

This release holds the torch side of the shared arithmetic (``fake_quantize`` bit-exact
with ``quant_core.qparams``); the PT2E-style quantizer, QAT and ONNX export land with
their own issue.
"""

from quant_torch_fx.fake_quantize import fake_quantize, qparams_to_tensors

__all__ = ["fake_quantize", "qparams_to_tensors"]
__version__ = "0.1.0"
