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

from quant_torch_fx.api import ModelQuantizer
from quant_torch_fx.errors import CaptureError, DataError
from quant_torch_fx.fake_quantize import fake_quantize, qparams_to_tensors
from quant_torch_fx.training import distillation_loss, train_qat

__all__ = [
    "CaptureError",
    "DataError",
    "ModelQuantizer",
    "distillation_loss",
    "fake_quantize",
    "qparams_to_tensors",
    "train_qat",
]
__version__ = "0.1.0"
