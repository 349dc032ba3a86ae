#!/usr/bin/env python3
"""ONNX export helpers for the reference models.

Library use (from ``tools/train_reference.py``)::

    from export_reference import export_onnx, graph_summary, verify_onnx

CLI (benchmark model, not committed -- ~45 MB)::

    python tools/export_reference.py --resnet18-224 /tmp/resnet18_224.onnx [--seed 0]

Exporter settings: TorchScript exporter (``dynamo=False``), opset 17, input
``"input"`` / output ``"logits"``, dynamic batch axis ``"batch"``,
``do_constant_folding=False``.  With the TorchScript exporter the Conv+BN fusion is
part of the constant-folding pass (``_jit_pass_onnx_eval_peephole`` only runs when
``do_constant_folding=True`` and ``training=EVAL``), so switching folding off keeps
every ``BatchNormalization`` node; ``export_onnx`` asserts this.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch

_TOOLS = Path(__file__).resolve().parent
if str(_TOOLS) not in sys.path:
    sys.path.insert(0, str(_TOOLS))

from reference_models.nets import resnet18_224  # noqa: E402

OPSET = 17
INPUT_NAME = "input"
OUTPUT_NAME = "logits"
BATCH_AXIS = "batch"


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def export_onnx(
    model: torch.nn.Module,
    path: str | os.PathLike,
    input_shape: tuple[int, ...],
    opset: int = OPSET,
    require_bn: bool = True,
    output_name: str = OUTPUT_NAME,
) -> dict:
    """Export ``model`` (switched to eval) with the TorchScript exporter, BN unfused.

    Returns :func:`graph_summary` of the written file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    model = model.eval().to(memory_format=torch.contiguous_format)
    dummy = torch.zeros(*input_shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # legacy exporter warning
        torch.onnx.export(
            model,
            (dummy,),
            str(path),
            dynamo=False,
            opset_version=opset,
            input_names=[INPUT_NAME],
            output_names=[output_name],
            dynamic_axes={INPUT_NAME: {0: BATCH_AXIS}, output_name: {0: BATCH_AXIS}},
            do_constant_folding=False,  # keeps BatchNormalization nodes (no Conv+BN fusion)
            export_params=True,
            keep_initializers_as_inputs=False,
        )
    m = onnx.load(str(path))
    onnx.checker.check_model(m, full_check=True)
    summary = graph_summary(path)
    n_bn_torch = sum(isinstance(x, torch.nn.modules.batchnorm._BatchNorm) for x in model.modules())
    summary["batchnorm_modules_in_torch_model"] = n_bn_torch
    summary["bn_fused"] = summary["op_counts"].get("BatchNormalization", 0) != n_bn_torch
    if require_bn and summary["bn_fused"]:
        raise RuntimeError(
            f"{path}: expected {n_bn_torch} BatchNormalization nodes, found "
            f"{summary['op_counts'].get('BatchNormalization', 0)}"
        )
    return summary


def graph_summary(path: str | os.PathLike) -> dict:
    """Node/initializer statistics of an ONNX file (how the weights are stored, etc.)."""
    m = onnx.load(str(path))
    g = m.graph
    ops = collections.Counter(n.op_type for n in g.node)
    init_names = {i.name for i in g.initializer}
    const_tensor_nodes = [n for n in g.node if n.op_type == "Constant"]
    big_consts = 0
    for n in const_tensor_nodes:
        for a in n.attribute:
            if a.name == "value" and int(np.prod(a.t.dims)) > 16:
                big_consts += 1
    # parameters feeding weight slots directly from initializers?
    weight_from_init = all(n.input[1] in init_names for n in g.node if n.op_type in ("Conv", "Gemm"))
    dim0 = g.input[0].type.tensor_type.shape.dim
    return {
        "file": Path(path).name,
        "size_bytes": os.path.getsize(path),
        "sha256": sha256_file(path),
        "ir_version": m.ir_version,
        "opset": [{"domain": o.domain or "ai.onnx", "version": o.version} for o in m.opset_import],
        "producer": f"{m.producer_name} {m.producer_version}",
        "inputs": [i.name for i in g.input],
        "outputs": [o.name for o in g.output],
        "input_shape": [d.dim_param or d.dim_value for d in dim0],
        "num_nodes": len(g.node),
        "op_counts": dict(sorted(ops.items())),
        "num_initializers": len(g.initializer),
        "initializer_params": int(sum(int(np.prod(i.dims)) for i in g.initializer)),
        "constant_nodes": len(const_tensor_nodes),
        "constant_nodes_with_large_tensors": big_consts,
        "identity_nodes": ops.get("Identity", 0),
        "conv_gemm_weights_are_initializers": weight_from_init,
    }


def ort_session(path: str | os.PathLike, optimize: bool = True, threads: int = 2):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def ort_predict(sess, x: np.ndarray, batch_size: int = 500) -> np.ndarray:
    outs = []
    for i in range(0, len(x), batch_size):
        outs.append(sess.run(None, {INPUT_NAME: x[i : i + batch_size]})[0])
    return np.concatenate(outs)


@torch.no_grad()
def torch_predict(model: torch.nn.Module, x: np.ndarray, batch_size: int = 500) -> np.ndarray:
    model.eval()
    outs = []
    for i in range(0, len(x), batch_size):
        outs.append(model(torch.from_numpy(x[i : i + batch_size])).numpy())
    return np.concatenate(outs)


def verify_onnx(
    path: str | os.PathLike,
    model: torch.nn.Module,
    x: np.ndarray,
    labels: np.ndarray | None = None,
    atol: float = 1e-4,
    strict: bool = True,
) -> dict:
    """Compare ORT (default graph optimisations and none) with torch on ``x``.

    Raises ``AssertionError`` if the max abs logit difference is ``>= atol`` (unless
    ``strict=False``; the result then has ``"passed": False``).
    """
    ref = torch_predict(model, x)
    res: dict = {"num_samples": len(x), "atol": atol, "max_abs_torch_logit": float(np.max(np.abs(ref)))}
    failed = []
    for tag, opt in (("ort_optimized", True), ("ort_unoptimized", False)):
        out = ort_predict(ort_session(path, optimize=opt), x)
        diff = float(np.max(np.abs(out - ref)))
        res[f"max_abs_diff_{tag}"] = diff
        if labels is not None:
            res[f"accuracy_{tag}"] = float(np.mean(out.argmax(1) == labels))
            res[f"argmax_agreement_{tag}"] = float(np.mean(out.argmax(1) == ref.argmax(1)))
        if diff >= atol:
            failed.append(f"{path}: {tag} max abs diff {diff:.3g} >= {atol}")
    if labels is not None:
        res["accuracy_torch"] = float(np.mean(ref.argmax(1) == labels))
    res["passed"] = not failed
    if failed and strict:
        raise AssertionError("; ".join(failed))
    # dynamic batch axis really works
    sess = ort_session(path)
    for bs in (1, 3):
        o = sess.run(None, {INPUT_NAME: x[:bs]})[0]
        assert o.shape[0] == bs, o.shape
    return res


def update_manifest(json_path: str | os.PathLike, name: str, entry: dict, common: dict | None = None) -> None:
    """Merge ``entry`` as ``models[name]`` (and the ``common`` top-level keys) into the JSON registry.

    The file is re-read right before writing, so separate training runs merge their entries, and
    replaced atomically.
    """
    json_path = Path(json_path)
    manifest = json.loads(json_path.read_text()) if json_path.exists() else {}
    manifest.update(common or {})
    manifest.setdefault("models", {})[name] = entry
    manifest["models"] = dict(sorted(manifest["models"].items()))
    tmp = json_path.with_suffix(f".json.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, json_path)


def exit_status(failures: list[str], no_check: bool) -> int:
    """1 (after one line on stderr) when a training script missed a target or a check, unless ``no_check``."""
    if failures and not no_check:
        print("CHECK FAILED: " + "; ".join(failures), file=sys.stderr)
        return 1
    return 0


def export_resnet18_224(out: str | os.PathLike, seed: int = 0, verify: bool = True) -> dict:
    torch.manual_seed(seed)
    model = resnet18_224().eval()
    # random weights but non-trivial BN statistics, so BN is not an identity
    g = torch.Generator().manual_seed(seed + 1)
    for mod in model.modules():
        if isinstance(mod, torch.nn.BatchNorm2d):
            mod.running_mean.copy_(torch.randn(mod.num_features, generator=g) * 0.1)
            mod.running_var.copy_(torch.rand(mod.num_features, generator=g) * 0.5 + 0.75)
            mod.weight.data.copy_(torch.rand(mod.num_features, generator=g) * 0.5 + 0.75)
            mod.bias.data.copy_(torch.randn(mod.num_features, generator=g) * 0.1)
    t0 = time.time()
    summary = export_onnx(model, out, (1, 3, 224, 224))
    summary["export_seconds"] = round(time.time() - t0, 2)
    if verify:
        x = np.random.default_rng(seed).standard_normal((4, 3, 224, 224), dtype=np.float32)
        summary["verification"] = verify_onnx(out, model, x, atol=1e-3)
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--resnet18-224",
        metavar="OUT.onnx",
        help="export the random-weight ImageNet ResNet-18 (1x3x224x224, dynamic batch)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-verify", action="store_true")
    p.add_argument("--summary", metavar="FILE.onnx", nargs="+", help="print graph summaries")
    args = p.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    if not args.resnet18_224 and not args.summary:
        p.error("nothing to do (use --resnet18-224 OUT.onnx or --summary FILE.onnx)")
    if args.resnet18_224:
        s = export_resnet18_224(args.resnet18_224, seed=args.seed, verify=not args.no_verify)
        print(json.dumps(s, indent=2))
    for f in args.summary or []:
        print(json.dumps(graph_summary(f), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
