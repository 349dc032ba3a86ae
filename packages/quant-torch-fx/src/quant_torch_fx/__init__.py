"""quant-torch-fx: graph-mode quantization of ``torch.export`` programs with ``quant_core``'s
planner and observers (PTQ, QAT with LSQ/TQT, freeze, QDQ ONNX export).

Example:
    >>> import torch
    >>> import quant_core as qc
    >>> from quant_torch_fx import ModelQuantizer
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU())
    >>> q = ModelQuantizer(qc.get_preset("xint8"), quiet=True)
    >>> qmodel = q.quantize_model(net, torch.randn(1, 3, 8, 8), [torch.randn(4, 3, 8, 8)])
    >>> frozen = q.freeze(qmodel)
    >>> frozen(torch.randn(2, 3, 8, 8)).shape
    torch.Size([2, 8, 6, 6])
"""

from quant_core.errors import CaptureError, DataError
from quant_torch_fx.api import ModelQuantizer
from quant_torch_fx.calibrate import finish_calibration, start_observing
from quant_torch_fx.data import InputSignature
from quant_torch_fx.export import DEFAULT_OPSET
from quant_torch_fx.fake_quantize import fake_quantize, qparams_to_tensors
from quant_torch_fx.prepare import named_quantizers, quantized_graphs
from quant_torch_fx.quantizer import FakeQuantizer
from quant_torch_fx.recipe_search import search
from quant_torch_fx.training import distillation_loss, train_qat

__all__ = [
    "DEFAULT_OPSET",
    "CaptureError",
    "DataError",
    "FakeQuantizer",
    "InputSignature",
    "ModelQuantizer",
    "distillation_loss",
    "fake_quantize",
    "finish_calibration",
    "named_quantizers",
    "qparams_to_tensors",
    "quantized_graphs",
    "search",
    "start_observing",
    "train_qat",
]
__version__ = "0.1.0"
