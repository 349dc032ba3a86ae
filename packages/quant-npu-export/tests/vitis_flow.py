"""One mode of the Vitis AI-style flow in its own process (test_vitis.py runs it twice):

    python vitis_flow.py calib OUT   # calibrate with a user loop, export_quant_config, save outputs
    python vitis_flow.py test OUT    # test mode from OUT's files, save outputs, export_onnx_model

Model, calibration and evaluation data come from fixed seeds, so both processes build the
same float model, as a user's script loading the same checkpoint would.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.conv2(y)) + y
        return self.fc(torch.flatten(self.pool(y), 1))


def build() -> tuple[nn.Module, torch.Tensor, list[torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():  # non-trivial batch-norm statistics
        net.bn1.running_mean.uniform_(-0.2, 0.2)
        net.bn1.running_var.uniform_(0.5, 2.0)
    net.eval()
    generator = torch.Generator().manual_seed(1)
    calib = [torch.randn(8, 3, 12, 12, generator=generator) for _ in range(4)]
    evaluation = torch.randn(16, 3, 12, 12, generator=generator)
    return net, torch.randn(1, 3, 12, 12, generator=generator), calib, evaluation


def main(mode: str, out: Path) -> None:
    from quant_npu.vitis import torch_quantizer

    net, example, calib, evaluation = build()
    quantizer = torch_quantizer(mode, net, (example,), output_dir=out, quiet=True)
    quant_model = quantizer.quant_model
    with torch.no_grad():
        if mode == "calib":
            for batch in calib:  # the user's own evaluation loop
                quant_model(batch)
            quantizer.export_quant_config()
        outputs = quant_model(evaluation)
    np.save(out / f"{mode}_outputs.npy", outputs.numpy())
    np.save(out / "evaluation.npy", evaluation.numpy())
    if mode == "test":
        quantizer.export_onnx_model()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
