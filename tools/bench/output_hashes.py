"""SHA-256 of quant-onnx's output files: the regression check for refactors that must not
change a single byte (quantize the reference models with fixed configs and data, print
one hash per file, compare with a saved run). ``--backend torch`` does the same through
quant-torch-fx (``ModelQuantizer.quantize_model``, then the QDQ ONNX export) for the models
with torch weights (``tools/reference_models/torch_weights.py``), plus one hash of every
activation observer's state (counts, grid, range) after calibration.

    python -m tools.bench.output_hashes                        # print, and save under .cache/bench/
    python -m tools.bench.output_hashes --compare OLD.json     # exit 1 when any hash differs
    python -m tools.bench.output_hashes --models fmnist_resnet18 --configs a8w8 xint8
    python -m tools.bench.output_hashes --backend torch --models fmnist_mobilenetv2 --configs xint8

Calibration: the first 128 samples of each model's benchmark calibration set
(``tools/bench/models.py``), batch 16. EfficientNet-Lite0 needs its export
(``tools/export_efficientnet.py``) and the photo crops (``tools/photo_crops.py``).

Example:
    >>> sorted(DEFAULT_CONFIGS)[:4]
    ['a16w8', 'a8w8', 'a8w8_per_tensor', 'a8w8_percentile']
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a script: make `tools.*` importable
    sys.path.insert(0, str(REPO_ROOT))

from tools.bench import common  # noqa: E402
from tools.bench.models import MODELS, input_name, load_data  # noqa: E402

DEFAULT_MODELS = ("fmnist_resnet18", "fmnist_mobilenetv2", "efficientnet_lite0")
NUM_CALIB = 128
BATCH_SIZE = 16
RESULTS = common.CACHE_DIR / "bench" / "output_hashes.json"


def _preset(name: str) -> Callable[[], Any]:
    def build() -> Any:
        from quant_core.presets import get_preset

        return get_preset(name)

    return build


def _xint8_cle() -> Any:
    from quant_core.algorithm_config import CLEConfig
    from quant_core.presets import get_preset

    return get_preset("xint8").evolve(algorithms=(CLEConfig(),))


PRESET_CONFIGS = (
    "a8w8",
    "a8w8_per_tensor",
    "a8w8_percentile",
    "a16w8",
    "w4a8",
    "xint8",
    "xint8_u8",
    "xint8_int8_bias",
    "int8_cnn_cle",
)
SLOW_CONFIGS = ("int8_cnn_accurate", "xint8_adaround")
"""AdaRound presets: minutes per model on 2 cores, so named explicitly (``--configs``)."""
CONFIGS: dict[str, Callable[[], Any]] = {
    **{name: _preset(name) for name in (*PRESET_CONFIGS, *SLOW_CONFIGS)},
    "xint8_cle": _xint8_cle,
}
DEFAULT_CONFIGS = tuple(name for name in CONFIGS if name not in SLOW_CONFIGS)


def file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run(models: list[str], configs: list[str]) -> dict[str, str]:
    """``{"model/config": sha256}`` of each quantized file."""
    common.use_checkout_packages()
    import quant_onnx

    hashes: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name in models:
            model = MODELS[name]
            path = model.ensure()
            data = load_data(model)
            calib = np.load(data.calib_path)[:NUM_CALIB]
            feeds = [{input_name(path): calib[i : i + BATCH_SIZE]} for i in range(0, len(calib), BATCH_SIZE)]
            for config in configs:
                out = Path(scratch) / f"{name}.{config}.onnx"
                quant_onnx.quantize(path, out, CONFIGS[config](), feeds, quiet=True)
                key = f"{name}/{config}"
                hashes[key] = file_hash(out)
                print(f"{hashes[key]}  {key}", flush=True)
    return hashes


def run_torch(models: list[str], configs: list[str]) -> dict[str, str]:
    """``{"model/config": sha256}`` of each QDQ file quant-torch-fx exports, and
    ``{"model/config/observers": sha256}`` of its activation observers' states."""
    common.use_checkout_packages()
    import torch

    from quant_torch_fx import ModelQuantizer
    from quant_torch_fx.prepare import activation_quantizers, quantized_graphs
    from tools.reference_models.torch_weights import load_reference_model

    torch.manual_seed(0)
    hashes: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name in models:
            data = load_data(MODELS[name])
            calib = torch.from_numpy(np.load(data.calib_path)[:NUM_CALIB])
            batches = [calib[i : i + BATCH_SIZE] for i in range(0, len(calib), BATCH_SIZE)]
            example = calib[:1]
            for config in configs:
                quantizer = ModelQuantizer(CONFIGS[config](), quiet=True)
                model = quantizer.quantize_model(load_reference_model(name), example, batches)
                digest = hashlib.sha256()
                for gm in quantized_graphs(model):
                    for key, fq in activation_quantizers(gm):
                        state = fq.observer.state_dict()
                        digest.update(repr((key, sorted((k, _plain(v)) for k, v in state.items()))).encode())
                hashes[f"{name}/{config}/observers"] = digest.hexdigest()
                out = quantizer.export_onnx(model, example, Path(scratch) / f"{name}.{config}.onnx")
                hashes[f"{name}/{config}"] = file_hash(out)
                for key in (f"{name}/{config}", f"{name}/{config}/observers"):
                    print(f"{hashes[key]}  {key}", flush=True)
    return hashes


def _plain(value: Any) -> Any:
    """A state value in a form whose ``repr`` is exact (arrays as their dtype and bytes; a
    numpy scalar as the 0-d array it equals: a min-max observer keeps one or the other
    depending on how many ranges it folded, the value being the same)."""
    if isinstance(value, np.generic):
        value = np.asarray(value)
    if isinstance(value, np.ndarray):
        return (str(value.dtype), value.shape, value.tobytes())
    if isinstance(value, dict):
        return sorted((k, _plain(v)) for k, v in value.items())
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=sorted(MODELS))
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), choices=sorted(CONFIGS))
    parser.add_argument("--backend", choices=("onnx", "torch"), default="onnx")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where to save this run's hashes")
    parser.add_argument("--compare", type=Path, help="a saved run: exit 1 when a hash differs")
    args = parser.parse_args(argv)
    hashes = (run_torch if args.backend == "torch" else run)(args.models, args.configs)
    common.write_json(args.results, hashes)
    if args.compare is None:
        return 0
    old = json.loads(args.compare.read_text())
    changed = sorted(k for k in hashes if k in old and old[k] != hashes[k])
    for key in changed:
        print(f"CHANGED {key}: {old[key][:12]} -> {hashes[key][:12]}")
    print(f"{len(hashes) - len(changed)} of {len(hashes)} identical to {args.compare}")
    return 1 if changed else 0


if __name__ == "__main__":
    raise SystemExit(main())
