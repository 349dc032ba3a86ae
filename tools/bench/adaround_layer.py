"""Time AdaRound on two typical EfficientNet-Lite0 layers (CPU, default config).

    PYTHONPATH=packages/quant-core/src:packages/quant-algos/src python tools/bench/adaround_layer.py

Layers: the 3x3 depthwise conv at 112x112x32 and the 1x1 conv 24->144 at 56x56,
with ``--samples`` random ReLU-like inputs (default 64) and batch size 32 at the
default 1000 iterations. Prints wall and CPU seconds per layer and the loss vs nearest rounding.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from quant_algos.adaround import adaround_layer
from quant_algos.reconstruction_data import ConvGeometry
from quant_core.algorithm_config import AdaRoundConfig
from quant_core.qparams import qparams_from_range
from quant_core.spec import QuantSpec

LAYERS = {
    "dw3x3_112x112x32": ((32, 1, 3, 3), (32, 112, 112), ConvGeometry(pads=(1, 1, 1, 1), groups=32)),
    "pw1x1_56x56_24to144": ((144, 24, 1, 1), (24, 56, 56), ConvGeometry()),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=AdaRoundConfig().num_iterations)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    spec = QuantSpec(dtype="int8", scale_type="power_of_two")
    print(f"torch threads: {torch.get_num_threads()}")
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # one-off lazy imports, not part of a layer's time
    for name, (wshape, xshape, geo) in LAYERS.items():
        w = (rng.normal(size=wshape) * 0.3).astype(np.float32)
        xf = np.maximum(rng.normal(size=(args.samples, *xshape)), 0).astype(np.float32)
        xq = np.round(xf / 0.0625) * 0.0625
        t_float = torch.nn.functional.conv2d(
            torch.from_numpy(xf), torch.from_numpy(w), padding=geo.pads[0], groups=geo.groups
        ).numpy()
        qp = qparams_from_range(float(w.min()), float(w.max()), spec)
        cfg = AdaRoundConfig(num_iterations=args.iterations, early_stop=False)
        start, cpu_start = time.perf_counter(), time.process_time()
        r = adaround_layer(w, None, qp, xq, t_float, cfg, geometry=geo, name=name, quiet=True)
        took, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        # CPU time is reported too: wall time is meaningless on a machine shared with other jobs.
        print(
            f"{name}: wall {took:.2f} s, cpu {cpu:.2f} s, {r.iterations} it, "
            f"loss {r.loss:.4g} vs nearest {r.loss_nearest:.4g}"
        )


if __name__ == "__main__":
    main()
