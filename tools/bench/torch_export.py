"""quant-torch-fx's QDQ export (issues 24 and 25), against the exporter of a named git
revision (``--peer``, default ``b3865f2``: the TorchScript exporter it replaced), on timm
models with random weights (batch-norm statistics randomised), ``a8w8`` PTQ on 32
Fashion-MNIST images upsampled to the model's size, scored on 32 others.

Parts (``--parts``):

* ``time``: export time of ResNet-18 and ViT-Tiny at 96 and 224 px, ours and the peer's on
  the same frozen model, interleaved, median of ``--repeats``; the ratio ours / peer.
* ``fidelity``: for each of ``--models``, in onnxruntime's default session and with graph
  optimisation disabled: the fraction of the file's quantized tensors within one step of
  the frozen model's end to end (``chain``) and when each is computed from the frozen
  model's own inputs (``isolated``, :mod:`quant_torch_fx.export_fidelity`), the output's
  SQNR and top-1 agreement with the frozen model, and how many MatMul/Gemm weights the file
  reads straight from a DequantizeLinear of an initializer; the same for the peer's file.
  ``floor``: the frozen model against itself computed by torch with another convolution
  kernel (oneDNN off): how far float rounding alone moves this model's output.

timm imports torchvision, which does not import next to torch 2.13 here: put a stand-in on
``PYTHONPATH`` (timm needs only a few of its names).

Example:
    $ PYTHONPATH=$PYTHONPATH:<torchvision stand-in> python -m tools.bench.torch_export --parts time
    $ python -m tools.bench.torch_export --parts fidelity --models resnet18 vit_tiny_patch16_224
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tools.bench import common

SIZES = {"inception_v3": 299}
MODEL_ARGS: dict[str, dict[str, Any]] = {
    "vit_tiny_patch16_224": {"img_size": 96},
    "deit_tiny_patch16_224": {"img_size": 96},
    "swin_tiny_patch4_window7_224": {"img_size": 96, "window_size": 3},
    "levit_128s": {"img_size": 96},
}


def build(name: str, size: int | None = None, seed: int = 0) -> Any:
    import timm
    import torch

    torch.manual_seed(seed)
    args = dict(MODEL_ARGS.get(name, {}))
    if size is not None and "img_size" in args:
        args["img_size"] = size
    model = timm.create_model(name, pretrained=False, **args).eval()
    generator = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d) and module.running_mean is not None:
            n = module.num_features
            module.running_mean.copy_(torch.rand(n, generator=generator) * 0.4 - 0.2)
            module.running_var.copy_(torch.rand(n, generator=generator) + 0.5)
    return model


def images(count: int, size: int, seed: int) -> Any:
    import torch
    import torch.nn.functional as F

    from tools.reference_models.data import load_fashion_mnist_raw

    raw, _labels = load_fashion_mnist_raw("test")
    chosen = np.random.default_rng(seed).choice(len(raw), count, replace=False)
    x = torch.from_numpy(raw[chosen].astype(np.float32) / 255.0)[:, None]
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    return ((x - 0.45) / 0.25).repeat(1, 3, 1, 1).contiguous()


def peer_exporter(revision: str) -> Callable[..., Any]:
    """``onnx_model`` of quant_torch_fx/export.py as it was at ``revision``."""
    source = subprocess.run(
        ["git", "show", f"{revision}:packages/quant-torch-fx/src/quant_torch_fx/export.py"],
        cwd=common.REPO_ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / f"peer_export_{revision}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.onnx_model  # type: ignore[no-any-return]


def frozen_model(name: str, size: int) -> Any:
    from quant_torch_fx import ModelQuantizer

    calibration = list(images(32, size, seed=1).split(8))
    q = ModelQuantizer("a8w8", quiet=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return q.freeze(q.quantize_model(build(name, size), calibration[0][:1], calibration)), calibration[0][:1]


def export_time(exporter: Callable[..., Any], frozen: Any, example: Any) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        exporter(frozen, (example,))
        return time.perf_counter() - start


def time_part(peer: Callable[..., Any], repeats: int) -> list[list[Any]]:
    from quant_torch_fx.export import onnx_model

    rows = []
    for name in ("resnet18", "vit_tiny_patch16_224"):
        for size in (96, 224):
            frozen, example = frozen_model(name, size)
            ours, theirs = [], []
            for _ in range(repeats):  # interleaved: both see the same machine load
                ours.append(export_time(onnx_model, frozen, example))
                theirs.append(export_time(peer, frozen, example))
            mine, peer_s = statistics.median(ours), statistics.median(theirs)
            rows.append([name, size, common.fmt(mine, 2), common.fmt(peer_s, 2), common.fmt(mine / peer_s, 2)])
            print(rows[-1], flush=True)
    return rows


def _session_runner(level: Any) -> Callable[..., dict[str, np.ndarray]]:
    import onnxruntime as ort

    def run(model: Any, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        options = ort.SessionOptions()
        options.graph_optimization_level = level
        options.log_severity_level = 3
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))

    return run


def weight_reads(model: Any) -> tuple[int, int]:
    """(MatMul/Gemm weights read straight from a DequantizeLinear of an initializer, all
    MatMul/Gemm weights that come from an initializer)."""
    inits = {t.name for t in model.graph.initializer}
    producers = {out: n for n in model.graph.node for out in n.output}
    direct = total = 0
    for node in model.graph.node:
        if node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2:
            continue
        chain, source = [], producers.get(node.input[1])
        while source is not None and source.op_type in ("Transpose", "DequantizeLinear", "Identity", "Reshape"):
            chain.append(source.op_type)
            if source.input[0] in inits:
                break
            source = producers.get(source.input[0])
        if source is None or not chain or source.input[0] not in inits:
            continue
        total += 1
        direct += chain == ["DequantizeLinear"]
    return direct, total


def fidelity_row(name: str, exporter: Callable[..., Any], label: str) -> list[Any]:
    import onnxruntime as ort
    import torch

    from quant_core.qparams import sqnr_db
    from quant_torch_fx.export_fidelity import node_by_node

    size = SIZES.get(name, 96)
    frozen, example = frozen_model(name, size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = exporter(frozen, (example,))
    x = images(32, size, seed=2)
    with torch.no_grad():
        expected = frozen(x).numpy()
    row: list[Any] = [name, label, "{}/{}".format(*weight_reads(model))]
    for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
        result = node_by_node(model, frozen, (x,), _session_runner(level))
        top1 = float(np.mean(result.output.argmax(-1) == expected.argmax(-1)))
        row += [
            common.fmt(result.within_one_step("chain"), 3),
            common.fmt(result.within_one_step("isolated"), 3),
            common.fmt(sqnr_db(expected, result.output), 1),
            common.fmt(top1, 3),
        ]
    print(row, flush=True)
    return row


def floor_row(name: str) -> list[Any]:
    import torch

    from quant_core.qparams import sqnr_db

    size = SIZES.get(name, 96)
    frozen, _example = frozen_model(name, size)
    x = images(32, size, seed=2)
    with torch.no_grad():
        expected = frozen(x).numpy()
        with torch.backends.mkldnn.flags(enabled=False):
            other = frozen(x).numpy()
    return [
        name,
        common.fmt(sqnr_db(expected, other), 1),
        common.fmt(float(np.mean(other.argmax(-1) == expected.argmax(-1))), 3),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", default=["time", "fidelity"], choices=["time", "fidelity", "floor"])
    parser.add_argument("--peer", default="b3865f2", help="git revision whose export.py is the peer")
    parser.add_argument("--models", nargs="+", default=["resnet18", "vit_tiny_patch16_224", "mobilenetv3_large_100"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(2)
    from quant_torch_fx.export import onnx_model

    peer = peer_exporter(args.peer)
    if "time" in args.parts:
        rows = time_part(peer, args.repeats)
        print(common.markdown_table(["model", "px", "ours s", f"peer {args.peer} s", "ours / peer"], rows))
    if "fidelity" in args.parts:
        rows = []
        for name in args.models:
            rows.append(fidelity_row(name, onnx_model, "ours"))
            rows.append(fidelity_row(name, peer, f"peer {args.peer}"))
        levels = ["chain", "isolated", "SQNR dB", "top-1"]
        headers = ["model", "exporter", "weights read from DQ"]
        headers += [f"{what} (no opt)" for what in levels] + [f"{what} (default)" for what in levels]
        print(common.markdown_table(headers, rows))
    if "floor" in args.parts:
        rows = [floor_row(name) for name in args.models]
        print(common.markdown_table(["model", "torch vs torch SQNR dB", "top-1"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
