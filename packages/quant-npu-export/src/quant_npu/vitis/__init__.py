"""A Vitis AI ``pytorch_nndct``-style flow on the torch backend (``quant-npu-export[torch]``).

:class:`torch_quantizer` (``quant_mode="calib"`` then ``"test"``, through the files in
``output_dir``) and :class:`QatProcessor` (``trainable_model`` / ``to_deployable``) take the
names and argument order Vitis AI users know; every quantization decision comes from
``quant_torch_fx`` with the ``xint8`` preset, and every exported model is legalised and
checked for a ``quant_npu`` target profile. ``docs/coming-from-vitis-ai.md`` maps the rest.

Example:
    >>> import torch
    >>> from quant_npu.vitis import torch_quantizer
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU())
    >>> torch_quantizer("calibrate", net, torch.randn(1, 1, 8, 8))
    Traceback (most recent call last):
    ...
    quant_core.errors.ConfigError: quant_mode: 'calibrate' is not allowed; allowed: calib, test
"""

try:
    import torch  # noqa: F401

    import quant_torch_fx  # noqa: F401
except ImportError as exc:  # pragma: no cover - only without the extra
    raise ImportError(
        f"quant_npu.vitis needs the torch backend ({exc.name} is not installed); "
        "install it with: pip install 'quant-npu-export[torch]'"
    ) from None

from quant_npu.vitis.qat import QatProcessor
from quant_npu.vitis.quantizer import torch_quantizer

__all__ = ["QatProcessor", "torch_quantizer"]
