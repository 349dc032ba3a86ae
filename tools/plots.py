"""The PNG plots in docs/img/, made from measurements taken when this script runs.

    python -m tools.plots [--out docs/img] [--qat-epochs 4] [--steps-per-epoch 100]

- ``layer_sqnr_cle_adaround.png``: per-layer SQNR of the Fashion-MNIST MobileNetV2-shape
  model at ``xint8`` (power-of-two, per-tensor), plain, with CLE, and with CLE + AdaRound
  (quant-onnx). Each quantized model is compared with the float graph it was written from
  (after CLE, which rescales channels), so the curve is the quantization noise alone.
- ``qat_agreement_by_epoch.png``: QAT (TQT, ``xint8``, distilled from the float model, no
  labels) on the same model with quant-torch-fx: top-1 accuracy on the 10k test images
  and agreement with the float model after each (short) epoch, PTQ as epoch 0.

Needs matplotlib (a developer tool, not a package dependency): ``pip install matplotlib``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.reference_models.data import load_fashion_mnist  # noqa: E402

MODEL = "fmnist_mobilenetv2"


def layer_sqnr(calib: np.ndarray, evaluation: np.ndarray) -> dict[str, list[tuple[str, float]]]:
    """Row name -> [(tensor, SQNR dB)] in graph order."""
    import quant_core as qc
    from quant_onnx import ModelQuantizer
    from quant_onnx.reporting.compare import compare_models

    configs = {
        "xint8": qc.get_preset("xint8"),
        "xint8 + CLE": qc.get_preset("xint8").evolve(algorithms=(qc.CLEConfig(),)),
        "xint8 + CLE + AdaRound": qc.get_preset("xint8").evolve(algorithms=(qc.CLEConfig(), qc.AdaRoundConfig())),
    }
    float_path = ROOT / "tools" / "models" / f"{MODEL}.onnx"
    batches = [{"input": evaluation[i : i + 64]} for i in range(0, len(evaluation), 64)]
    rows = {}
    for name, config in configs.items():
        print(f"quantizing: {name}", flush=True)
        result = ModelQuantizer(config, quiet=True).quantize(float_path, None, calib, batch_size=32)
        assert result.calibrated is not None
        comparison = compare_models(result.calibrated.model, result.model, batches, max_layer_samples=None, quiet=True)
        rows[name] = [(layer.tensor, layer.sqnr_db) for layer in comparison.layers]
    return rows


def qat_by_epoch(calib: np.ndarray, train_x: np.ndarray, test: tuple[np.ndarray, np.ndarray], epochs: int, steps: int):
    """[(epoch, top-1, agreement with float)], epoch 0 = the calibrated starting point."""
    import torch

    from quant_torch_fx import ModelQuantizer, train_qat
    from tools.reference_models.torch_weights import load_reference_model

    torch.manual_seed(0)
    model = load_reference_model(MODEL)
    test_x, test_y = (torch.from_numpy(a) for a in test)
    with torch.no_grad():
        float_top1 = torch.cat([model(test_x[i : i + 500]).argmax(1) for i in range(0, len(test_x), 500)])

    def score(qat_model: torch.nn.Module) -> tuple[float, float]:
        qat_model.eval()
        with torch.no_grad():
            top1 = torch.cat([qat_model(test_x[i : i + 500]).argmax(1) for i in range(0, len(test_x), 500)])
        return float((top1 == test_y).float().mean()), float((top1 == float_top1).float().mean())

    example = (torch.from_numpy(calib[:1]),)
    quantizer = ModelQuantizer("xint8", quiet=True)
    qat = quantizer.prepare_qat(
        model, example, calib_loader=[torch.from_numpy(calib[i : i + 64]) for i in range(0, 256, 64)]
    )
    points = [(0, *score(qat))]
    rng = np.random.default_rng(0)
    for epoch in range(1, epochs + 1):
        order = rng.permutation(len(train_x))[: steps * 64]
        batches = [torch.from_numpy(train_x[order[i : i + 64]]) for i in range(0, len(order), 64)]
        train_qat(qat, batches, teacher=model, epochs=1, lr=1e-4, freeze_batch_norm=True, quiet=True)
        points.append((epoch, *score(qat)))
        print(f"QAT epoch {epoch}: top-1 {points[-1][1]:.4f}, agreement {points[-1][2]:.4f}", flush=True)
    return points


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    parser.add_argument("--qat-epochs", type=int, default=4)
    parser.add_argument("--steps-per-epoch", type=int, default=100, help="QAT batches of 64 per epoch")
    args = parser.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train_x, _ = load_fashion_mnist("train")
    test_x, test_y = load_fashion_mnist("test")
    calib = train_x[-256:]
    args.out.mkdir(parents=True, exist_ok=True)

    rows = layer_sqnr(calib, test_x[:512])
    fig, ax = plt.subplots(figsize=(9, 4))
    for name, values in rows.items():
        finite = [min(v, 80.0) for _t, v in values]
        ax.plot(range(len(finite)), finite, marker=".", label=f"{name} (median {np.median(finite):.1f} dB)")
    ax.set_xlabel("activation tensor, in graph order")
    ax.set_ylabel("SQNR vs float (dB)")
    ax.set_title(f"{MODEL} at xint8: per-layer SQNR (quant-onnx)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "layer_sqnr_cle_adaround.png", dpi=110)
    print(f"wrote {args.out / 'layer_sqnr_cle_adaround.png'}")

    points = qat_by_epoch(calib, train_x[:-256], (test_x, test_y), args.qat_epochs, args.steps_per_epoch)
    fig, ax = plt.subplots(figsize=(6, 4))
    epochs = [p[0] for p in points]
    ax.plot(epochs, [p[1] for p in points], marker="o", label="top-1 (10k test images)")
    ax.plot(epochs, [p[2] for p in points], marker="s", label="agreement with float")
    ax.set_xlabel(f"QAT epoch ({args.steps_per_epoch} batches of 64 each; 0 = PTQ start)")
    ax.set_ylabel("fraction")
    ax.set_title(f"{MODEL}: QAT xint8 (TQT, distilled) by epoch")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "qat_agreement_by_epoch.png", dpi=110)
    print(f"wrote {args.out / 'qat_agreement_by_epoch.png'}")
    for epoch, top1, agreement in points:
        print(f"| {epoch} | {top1:.4f} | {agreement:.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
