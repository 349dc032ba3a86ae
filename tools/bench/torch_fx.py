"""quant-torch-fx benchmarks (issue 9), one run, every figure against its peer measured here.

Parts (``--parts``, default all):

* ``ptq``: Fashion-MNIST top-1 of the reference models (trained weights loaded into their
  torch definitions, ``tools/reference_models/torch_weights.py``) after PTQ on 512 training
  images: ours (``a8w8`` min-max, ``a8w8`` with MSE activations, ``xint8``) against torchao's
  PT2E flow (``prepare_pt2e``/``convert_pt2e`` with ``X86InductorQuantizer``'s default config:
  uint8 histogram activations, int8 per-channel weights), same images, same batches.
* ``backends``: one config, two backends: quant-torch-fx then ``export_onnx`` against the
  torch-exported float ONNX then quant-onnx, same config and calibration data; layers whose
  activation (and weight) scales are equal, and each QDQ model's metric through onnxruntime
  (Fashion-MNIST top-1 / EfficientNet-Lite0 top-1 agreement with float on held-out crops).
* ``qat_fmnist``: ``xint8`` QAT (TQT, power-of-two per-tensor), one epoch over the 60k
  training images from the float weights, against float and PTQ.
* ``qat_effnet``: EfficientNet-Lite0 ``xint8`` QAT with TQT and distillation from the float
  model on the 512 calibration crops alone (no labels; batch-norm statistics frozen),
  top-1 agreement on the 520 held-out crops after every epoch, within a time budget.
* ``speed``: QAT step time against the float training step, and PTQ calibration throughput
  against float inference (ours with MinMax and with histogram observers, and torchao PT2E's
  prepared model with its HistogramObserver), same batch, interleaved, medians.
* ``adaround_walk``: the tuned AdaRound recipe (MinMSE weights, CLE, AdaRound batch 4)
  through quant-onnx and through quant-torch-fx on the same calibration samples: time of
  each (the torch backend's layer walk against onnxruntime's) and each QDQ model's metric.

Example:
    $ nice -n 10 python -m tools.bench.torch_fx                      # everything (about an hour on 2 cores)
    $ python -m tools.bench.torch_fx --parts ptq speed --quick
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a file: make `tools.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench import common
from tools.bench.models import MODELS, load_data

WORK_DIR = common.CACHE_DIR / "bench" / "torch_fx"
DEFAULT_RESULTS = WORK_DIR / "results.json"
PARTS = ("ptq", "backends", "qat_fmnist", "qat_effnet", "speed", "adaround_walk")
FMNIST = ("fmnist_resnet18", "fmnist_mobilenetv2")
CALIB_BATCH = 32


# ------------------------------------------------------------------------------------- models and data
def load_torch_model(name: str):  # -> torch.nn.Module
    if name == "efficientnet_lite0":
        from tools.export_efficientnet import build_efficientnet_lite0

        return build_efficientnet_lite0()
    from tools.reference_models.torch_weights import load_reference_model

    return load_reference_model(name)


def calibration_set(name: str, num: int) -> np.ndarray:
    return np.load(load_data(MODELS[name], num_calib=num).calib_path)


def batches(x: np.ndarray, size: int) -> list[Any]:
    import torch

    return [torch.from_numpy(np.ascontiguousarray(x[i : i + size])) for i in range(0, len(x), size)]


def predict(model: Any, x: np.ndarray, batch: int = 250, *, set_eval: bool = True) -> np.ndarray:
    """Top-1 class of a torch model over ``x`` (``set_eval``: call ``model.eval()`` first;
    PT2E graphs refuse it and are put in eval mode by torchao's own helper)."""
    import torch

    if set_eval:
        model.eval()
    with torch.no_grad():
        return np.concatenate([model(b).argmax(1).numpy() for b in batches(x, batch)])


def ort_predict(path: Path, x: np.ndarray, level: str = "all") -> np.ndarray:
    return common.predict(str(path), x, batch_size=100, level=level).argmax(1)


def metric(name: str, predictions: np.ndarray, reference: np.ndarray) -> float:
    """Top-1 accuracy (labels) or agreement (float predictions): the same count."""
    return common.accuracy(predictions, reference)


def eval_set(name: str, quick: bool) -> tuple[np.ndarray, np.ndarray | None]:
    data = load_data(MODELS[name], num_calib=512, num_eval=(200 if quick else None))
    return data.eval_x, data.eval_labels


def example(name: str):  # -> torch.Tensor
    import torch

    return torch.zeros(1, 3, 224, 224) if name == "efficientnet_lite0" else torch.zeros(1, 1, 32, 32)


# ------------------------------------------------------------------------------------------------- PTQ
def pt2e_prepared(model: Any, batch: Any) -> Any:
    """``model`` captured with a dynamic batch (from a full ``batch``: a batch of 1 would
    specialise) and prepared by torchao's PT2E with the X86 Inductor quantizer's default
    config (``HistogramObserver`` on activations)."""
    import torch
    import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq
    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e

    exported = torch.export.export(
        copy.deepcopy(model).eval(), (batch,), dynamic_shapes=({0: torch.export.Dim("batch", min=1)},)
    ).module()
    quantizer = xiq.X86InductorQuantizer()
    quantizer.set_global(xiq.get_default_x86_inductor_quantization_config())
    return prepare_pt2e(exported, quantizer)


def pt2e_quantize(model: Any, calib: list[Any]) -> tuple[Any, float]:
    """torchao's PT2E flow with the X86 Inductor quantizer's default config; (model, seconds)."""
    import torch
    from torchao.quantization.pt2e import move_exported_model_to_eval
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

    start = time.perf_counter()
    prepared = pt2e_prepared(model, calib[0])
    with torch.no_grad():
        for batch in calib:
            prepared(batch)
    converted = convert_pt2e(prepared)
    move_exported_model_to_eval(converted)
    return converted, time.perf_counter() - start


def ours_quantize(model: Any, config: Any, calib: list[Any], ex: Any) -> tuple[Any, Any, float]:
    from quant_torch_fx import ModelQuantizer

    start = time.perf_counter()
    q = ModelQuantizer(config, quiet=True)
    frozen = q.freeze(q.quantize_model(model, ex, calib))
    return q, frozen, time.perf_counter() - start


def mse_activations(preset: str):  # -> QuantConfig
    """``preset`` with activations calibrated by MSE (the range search PT2E's HistogramObserver does)."""
    import attrs

    from quant_core.observer_config import MSE
    from quant_core.presets import get_preset

    config = get_preset(preset)
    glob = config.global_config
    act = glob.input.evolve(observer=MSE())
    return config.evolve(global_config=attrs.evolve(glob, input=act, output=act), name=f"{preset}+mse")


def ptq_rows() -> list[tuple[str, Any]]:
    """PTQ rows: label and config; ``xint8+cle+adaround`` is quant-onnx's row of
    ``tools.bench.algos`` (same config), run here through the torch backend's drivers."""
    from tools.bench.algos import ROWS

    return [
        ("a8w8", "a8w8"),
        ("a8w8+mse", mse_activations("a8w8")),
        ("xint8", "xint8"),
        ("xint8+cle+adaround", ROWS["xint8_cle_adaround"].build()),  # type: ignore[misc]
    ]


def part_ptq(args: argparse.Namespace, results: dict[str, Any]) -> None:
    rows = results.setdefault("ptq", {})
    for name in FMNIST:
        model = load_torch_model(name)
        x_eval, labels = eval_set(name, args.quick)
        calib = batches(calibration_set(name, args.num_calib), CALIB_BATCH)
        row: dict[str, Any] = {"float": metric(name, predict(model, x_eval), labels)}
        converted, seconds = pt2e_quantize(model, calib)
        row["pt2e_x86"] = {"top1": metric(name, predict(converted, x_eval, set_eval=False), labels), "seconds": seconds}
        for label, config in ptq_rows():
            q, frozen, seconds = ours_quantize(model, config, calib, example(name))
            path = WORK_DIR / f"{name}_{label}.onnx"
            q.export_onnx(frozen, example(name), path)
            row[label] = {
                "top1": metric(name, predict(frozen, x_eval), labels),
                "top1_ort_kernels": metric(name, ort_predict(path, x_eval), labels),
                "seconds": seconds,
            }
        rows[name] = row
        print(name, row, flush=True)


# -------------------------------------------------------------------------------------------- backends
def layer_scales(model: Any) -> list[tuple[str, float | None, list[float] | None, float | None]]:
    """Per Conv/Gemm/Add/pool in graph order: (op, input scale, weight scales, output scale)."""
    from onnx import numpy_helper

    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    producers = {out: n for n in model.graph.node for out in n.output}
    consumers: dict[str, list[Any]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    def dq_scale(tensor: str) -> np.ndarray | None:
        node = producers.get(tensor)
        return inits[node.input[1]] if node is not None and node.op_type == "DequantizeLinear" else None

    rows = []
    for node in model.graph.node:
        if node.op_type not in ("Conv", "Gemm", "Add", "Mul", "GlobalAveragePool"):
            continue
        quantize = [c for c in consumers.get(node.output[0], []) if c.op_type == "QuantizeLinear"]
        out = float(inits[quantize[0].input[1]]) if quantize else None
        x = dq_scale(node.input[0])
        w = dq_scale(node.input[1]) if node.op_type in ("Conv", "Gemm") else None
        rows.append((node.op_type, None if x is None else float(x), None if w is None else w.reshape(-1).tolist(), out))
    return rows


def compare_scales(a: list[Any], b: list[Any], rtol: float) -> dict[str, Any]:
    """How many layers carry equal scales (``rtol``: float scales; 0 for powers of two)."""
    if [r[0] for r in a] != [r[0] for r in b]:
        return {"layers": [len(a), len(b)], "same_ops": False}
    equal_act, equal_w, total_w, worst = 0, 0, 0, 0.0
    for (_op, x1, w1, y1), (_op2, x2, w2, y2) in zip(a, b, strict=True):
        pairs = [(x1, x2), (y1, y2)]
        ok = all((u is None) == (v is None) for u, v in pairs)
        for u, v in pairs:
            if u is not None and v is not None:
                rel = abs(u - v) / abs(u)
                worst = max(worst, rel)
                ok &= rel <= rtol
        equal_act += ok
        if w1 is not None and w2 is not None:
            total_w += 1
            equal_w += bool(np.allclose(w1, w2, rtol=rtol, atol=0))
    return {"layers": len(a), "equal_activation_scales": equal_act, "weights": total_w, "equal_weight_scales": equal_w,
            "worst_relative_difference": worst, "same_ops": True}  # fmt: skip


def float_onnx(name: str, model: Any) -> Any:
    """The float ONNX a user hands quant-onnx: the committed reference model, or the cached
    EfficientNet-Lite0 export (both by torch's TorchScript exporter from these weights)."""
    import onnx

    return onnx.load(str(MODELS[name].ensure()))


def part_backends(args: argparse.Namespace, results: dict[str, Any]) -> None:
    import quant_onnx
    from quant_core.presets import get_preset
    from quant_torch_fx.export import onnx_model

    rows = results.setdefault("backends", {})
    for name in (*FMNIST, "efficientnet_lite0"):
        model = load_torch_model(name)
        x_eval, labels = eval_set(name, args.quick)
        calib_x = calibration_set(name, args.num_calib)
        reference = labels if labels is not None else predict(model, x_eval, batch=50)
        float_model = float_onnx(name, model)
        for preset in ("a8w8", "xint8"):
            config = get_preset(preset)
            start = time.perf_counter()
            onnx_side = quant_onnx.quantize(float_model, None, config, calib_x, batch_size=CALIB_BATCH, quiet=True)
            onnx_seconds = time.perf_counter() - start
            onnx_path = WORK_DIR / f"{name}_{preset}_quant_onnx.onnx"
            with common.atomic_path(onnx_path, ".onnx") as tmp:
                tmp.write_bytes(onnx_side.model.SerializeToString())
            q, frozen, seconds = ours_quantize(model, config, batches(calib_x, CALIB_BATCH), example(name))
            ours_path = WORK_DIR / f"{name}_{preset}_torch_fx.onnx"
            q.export_onnx(frozen, example(name), ours_path)
            ours_pred, onnx_pred = ort_predict(ours_path, x_eval), ort_predict(onnx_path, x_eval)
            row = {
                "scales": compare_scales(
                    layer_scales(onnx_side.model),
                    layer_scales(onnx_model(frozen, (example(name),))),
                    0.0 if preset == "xint8" else 1e-5,
                ),
                "torch_fx": metric(name, ours_pred, reference),
                "quant_onnx": metric(name, onnx_pred, reference),
                "between_backends": common.agreement(ours_pred, onnx_pred),
                "torch_fx_seconds": seconds,
                "quant_onnx_seconds": onnx_seconds,
                "float_convs_torch_fx": common.float_compute_nodes(ours_path)["float"],
            }
            rows[f"{name}/{preset}"] = row
            print(name, preset, row, flush=True)


def part_adaround_walk(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """The tuned AdaRound recipe (the ``xint8_adaround`` preset) through both
    backends on the same calibration samples: quant-onnx on the float ONNX export, then
    quant-torch-fx on the module; time (wall and this process's CPU) and each QDQ model's
    metric in onnxruntime."""
    import quant_onnx
    from quant_core.presets import get_preset
    from tools.bench.quark_peer import process_cpu_seconds

    rows = results.setdefault("adaround_walk", {})
    config = get_preset("xint8_adaround")
    for name in ("efficientnet_lite0", *FMNIST):
        model = load_torch_model(name)
        x_eval, labels = eval_set(name, args.quick)
        calib_x = calibration_set(name, args.walk_calib)
        reference = labels if labels is not None else predict(model, x_eval, batch=50)
        float_model = float_onnx(name, model)
        cpu, start = process_cpu_seconds(), time.perf_counter()
        onnx_side = quant_onnx.quantize(float_model, None, config, calib_x, batch_size=CALIB_BATCH, quiet=True)
        onnx_wall, onnx_cpu = time.perf_counter() - start, process_cpu_seconds() - cpu
        onnx_path = WORK_DIR / f"{name}_tuned_quant_onnx.onnx"
        with common.atomic_path(onnx_path, ".onnx") as tmp:
            tmp.write_bytes(onnx_side.model.SerializeToString())
        cpu = process_cpu_seconds()
        q, frozen, torch_wall = ours_quantize(model, config, batches(calib_x, CALIB_BATCH), example(name))
        torch_cpu = process_cpu_seconds() - cpu
        torch_path = WORK_DIR / f"{name}_tuned_torch_fx.onnx"
        q.export_onnx(frozen, example(name), torch_path)
        row = {
            "calibration_samples": len(calib_x),
            "quant_onnx_seconds": onnx_wall,
            "quant_onnx_cpu_seconds": onnx_cpu,
            "torch_fx_seconds": torch_wall,
            "torch_fx_cpu_seconds": torch_cpu,
            "quant_onnx_metric": metric(name, ort_predict(onnx_path, x_eval), reference),
            "torch_fx_metric": metric(name, ort_predict(torch_path, x_eval), reference),
        }
        rows[name] = row
        print(name, row, flush=True)


# -------------------------------------------------------------------------------------------------- QAT
class Shuffled:
    """Batches of ``(x, y)`` arrays in a fresh seeded order every epoch (a re-iterable loader)."""

    def __init__(self, x: np.ndarray, y: np.ndarray, size: int, seed: int = 0, limit: int | None = None) -> None:
        self.x, self.y, self.size, self.limit = x, y, size, limit
        self.rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        n = -(-len(self.x) // self.size)
        return n if self.limit is None else min(n, self.limit)

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        import torch

        order = self.rng.permutation(len(self.x))
        for k, i in enumerate(range(0, len(order), self.size)):
            if self.limit is not None and k >= self.limit:
                return
            idx = np.sort(order[i : i + self.size])
            yield torch.from_numpy(self.x[idx]), torch.from_numpy(self.y[idx])


class AugmentedCrops:
    """``steps`` batches of ``size`` crops drawn from ``x``, each randomly mirrored, zoomed (a random
    square of 55-100% of the side resized back) and mixed with another crop of its batch (0-40%):
    inputs only, for distillation from a teacher that sees the same augmented batch."""

    def __init__(self, x: np.ndarray, size: int, steps: int, seed: int = 0) -> None:
        import torch

        self.x, self.size, self.steps = torch.from_numpy(x), size, steps
        self.gen = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[Any]:
        import torch
        import torch.nn.functional as F

        side = self.x.shape[-1]
        for _ in range(self.steps):
            batch = self.x[torch.randint(0, len(self.x), (self.size,), generator=self.gen)].clone()
            flip = torch.rand(self.size, generator=self.gen) < 0.5
            batch[flip] = batch[flip].flip(-1)
            zoomed = []
            for crop in batch:
                n = int(side * float(torch.empty(1).uniform_(0.55, 1.0, generator=self.gen)))
                top, left = (int(torch.randint(0, side - n + 1, (1,), generator=self.gen)) for _ in range(2))
                window = crop[None, :, top : top + n, left : left + n]
                zoomed.append(F.interpolate(window, size=side, mode="bilinear", align_corners=False))
            batch = torch.cat(zoomed)
            mix = torch.empty(self.size, 1, 1, 1).uniform_(0.0, 0.4, generator=self.gen)
            yield (1 - mix) * batch + mix * batch[torch.randperm(self.size, generator=self.gen)]


def qat_quantizer(cle: bool, adaround: bool = False) -> Any:
    """``xint8``, with CLE first when ``cle`` (QAT then folds batch norm: CLE needs it folded);
    ``adaround``: the ``xint8_adaround`` preset (MinMSE weights, CLE, AdaRound at batch 4)
    instead, so that training starts from its PTQ model."""
    from quant_core.algorithm_config import CLEConfig
    from quant_core.presets import get_preset
    from quant_torch_fx import ModelQuantizer

    if adaround:
        return ModelQuantizer(get_preset("xint8_adaround"), quiet=True)
    config = get_preset("xint8")
    return ModelQuantizer(config.evolve(algorithms=(CLEConfig(),)) if cle else config, quiet=True)


def part_qat_fmnist(args: argparse.Namespace, results: dict[str, Any]) -> None:
    from quant_torch_fx import train_qat
    from tools.reference_models.data import load_fashion_mnist

    rows = results.setdefault("qat_fmnist", {})
    train_x, train_y = load_fashion_mnist("train")
    for name in FMNIST:
        model = load_torch_model(name)
        x_eval, labels = eval_set(name, args.quick)
        calib = batches(calibration_set(name, args.num_calib), CALIB_BATCH)
        q = qat_quantizer(args.fmnist_cle)
        ptq = q.freeze(q.quantize_model(model, example(name), calib))
        qat = q.prepare_qat(model, example(name), calib_loader=calib, fold_batch_norm=args.fmnist_cle)
        loader = Shuffled(train_x, train_y, args.qat_batch, limit=20 if args.quick else None)
        start = time.perf_counter()
        history = train_qat(qat, loader, epochs=1, lr=args.fmnist_lr, quiet=args.quiet)
        seconds = time.perf_counter() - start
        frozen = q.freeze(qat)
        path = WORK_DIR / f"{name}_xint8_qat.onnx"
        q.export_onnx(frozen, example(name), path)
        row = {
            "float": metric(name, predict(model, x_eval), labels),
            "ptq_xint8": metric(name, predict(ptq, x_eval), labels),
            "qat_xint8": metric(name, predict(frozen, x_eval), labels),
            "qat_xint8_ort_kernels": metric(name, ort_predict(path, x_eval), labels),
            "float_convs": common.float_compute_nodes(path)["float"],
            "train_seconds": seconds,
            "loss": history[-1]["loss"],
            "steps": history[-1]["batches"],
            "cle_folded_batch_norm": args.fmnist_cle,
        }
        rows[name] = row
        print(name, row, flush=True)


def part_qat_effnet(args: argparse.Namespace, results: dict[str, Any]) -> None:
    import torch

    from quant_torch_fx import distillation_loss, train_qat

    name = "efficientnet_lite0"
    model = load_torch_model(name)
    x_eval, _ = eval_set(name, args.quick)
    calib_x = calibration_set(name, 64 if args.quick else args.num_calib)
    float_eval = predict(model, x_eval, batch=50)
    with torch.no_grad():  # the teacher never changes: its logits once, then distil from them
        teacher = np.concatenate([model(b).numpy() for b in batches(calib_x, 50)])
    # Batch norm is frozen while training on 512 crops, so folding it first changes nothing but
    # the cost of a step, and lets CLE even out the depthwise weight ranges before training.
    q = qat_quantizer(args.effnet_cle, args.effnet_adaround)
    calib = batches(calib_x, CALIB_BATCH)
    start = time.perf_counter()
    fold = args.effnet_cle or args.effnet_adaround
    qat = q.prepare_qat(model, example(name), calib_loader=calib, fold_batch_norm=fold)
    ptq_agreement = metric(name, predict(qat, x_eval, batch=50), float_eval)
    curve = [{"epoch": 0, "agreement": ptq_agreement, "seconds": time.perf_counter() - start}]
    print("epoch 0 (PTQ start)", curve[-1], flush=True)
    loader: Any = Shuffled(calib_x, teacher, args.effnet_batch)
    temperature = args.temperature
    if args.effnet_augment:  # the teacher runs on each augmented batch (train_qat's teacher=)
        loader = AugmentedCrops(calib_x, args.effnet_batch, steps=len(loader))

    def loss(output: Any, target: Any) -> Any:
        return distillation_loss(output, target, temperature)

    def on_epoch_end(epoch: int, trained: Any) -> dict[str, float]:
        row = {"epoch": epoch, "agreement": metric(name, predict(trained, x_eval, batch=50), float_eval),
               "seconds": time.perf_counter() - start}  # fmt: skip
        curve.append(row)
        print(row, flush=True)
        return row

    optimizer = None
    for epoch in range(1, args.effnet_epochs + 1):
        if time.perf_counter() - start > args.effnet_budget:
            break
        if optimizer is None:
            from quant_torch_fx.training import default_optimizer

            optimizer = default_optimizer(qat, args.effnet_lr, args.effnet_qparam_lr, args.effnet_weight_lr_per_step)
        train_qat(qat, loader, epochs=1, optimizer=optimizer, loss_fn=loss, freeze_batch_norm=True,
                  teacher=model if args.effnet_augment else None, temperature=temperature,
                  on_epoch_end=lambda _e, m, epoch=epoch: on_epoch_end(epoch, m), quiet=args.quiet)  # fmt: skip
        if curve[-1]["agreement"] >= args.effnet_stop:
            break
    frozen = q.freeze(qat)
    path = WORK_DIR / f"{name}_xint8_qat.onnx"
    q.export_onnx(frozen, example(name), path)
    results["qat_effnet"] = {
        "curve": curve,
        "frozen_agreement": metric(name, predict(frozen, x_eval, batch=50), float_eval),
        "ort_kernels_agreement": metric(name, ort_predict(path, x_eval), float_eval),
        "seconds": time.perf_counter() - start,
        "train_samples": len(calib_x),
        "eval_samples": len(x_eval),
        "lr": args.effnet_lr,
        "qparam_lr": args.effnet_qparam_lr,
        "weight_lr_per_step": args.effnet_weight_lr_per_step,
        "batch": args.effnet_batch,
        "cle_folded_batch_norm": fold,
        "adaround_start": args.effnet_adaround,
        "augmented": args.effnet_augment,
    }
    print(results["qat_effnet"], flush=True)


# ------------------------------------------------------------------------------------------------ speed
def sgd_step(model: Any) -> Callable[[Any, Any], None]:
    """One SGD step of ``model`` on a batch ``(x, y)`` with cross-entropy (a learning rate too
    small to change the timing's model), its optimizer made once."""
    import torch
    import torch.nn.functional as F

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-9)

    def step(x: Any, y: Any) -> None:
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return step


def train_step(model: Any, x: Any, y: Any) -> Callable[[], None]:
    """:func:`sgd_step` on the fixed ``(x, y)``: the float and QAT sides of a step-time ratio."""
    step = sgd_step(model)
    return lambda: step(x, y)


# Calibration runs over a loader: time several batches per call so that the per-call costs
# (eval/train switching, the loader check) weigh as they do in a real calibration.
TIMED_BATCHES = 4


def _inference(model: Any, x: Any) -> Callable[[], None]:
    import torch

    def infer() -> None:
        with torch.no_grad():
            for _ in range(TIMED_BATCHES):
                model(x)

    return infer


def _calibration(name: str, model: Any, preset: Any, x: Any) -> Callable[[], None]:
    from quant_torch_fx import ModelQuantizer
    from quant_torch_fx.calibrate import run_batches, start_observing

    q = ModelQuantizer(preset, quiet=True)
    prepared = q.prepare(model, example(name))
    signature = q.signature(example(name))
    start_observing(prepared)
    return lambda: run_batches(prepared, [x] * TIMED_BATCHES, signature, quiet=True)


def _pt2e_calibration(model: Any, x: Any) -> Callable[[], None]:
    """torchao PT2E's prepared model observing (:func:`pt2e_prepared`)."""
    import torch

    prepared = pt2e_prepared(model, x)

    def observe() -> None:
        with torch.no_grad():
            for _ in range(TIMED_BATCHES):
                prepared(x)

    return observe


def speed_row(name: str, repeats: int, whole_compile: bool = False) -> dict[str, Any]:
    import torch

    from quant_torch_fx import ModelQuantizer

    model = load_torch_model(name)
    batch = 128 if name in FMNIST else 16
    x = torch.from_numpy(np.ascontiguousarray(calibration_set(name, max(batch, 64))[:batch]))
    y = torch.randint(0, 10 if name in FMNIST else 1000, (batch,), generator=torch.Generator().manual_seed(0))
    float_step = train_step(copy.deepcopy(model).train(), x, y)
    row: dict[str, Any] = {"batch": batch}
    ways = [("qat", False, False), ("qat_compiled", True, False)]
    if whole_compile:  # train_qat(compile_model=True): minutes of compiling per model
        ways.append(("qat_whole_compiled", False, True))
    for label, compiled, whole in ways:
        q = ModelQuantizer("xint8", compile_fake_quant=compiled, quiet=True)
        qat = q.prepare_qat(model, example(name), calib_loader=[x]).train()
        qat_step = train_step(torch.compile(qat) if whole else qat, x, y)
        for _ in range(3):  # warm-up (and torch.compile's first compilations)
            float_step()
            qat_step()
        float_s, qat_s = common.interleaved_medians(float_step, qat_step, repeats)
        row.update(
            {f"{label}_float_train_step_s": float_s, f"{label}_step_s": qat_s, f"{label}_ratio": qat_s / float_s}
        )
    model.eval()
    infer = _inference(model, x)
    calibrations = {
        "a8w8": lambda: _calibration(name, model, "a8w8", x),
        "a8w8_mse": lambda: _calibration(name, model, mse_activations("a8w8"), x),
        "xint8": lambda: _calibration(name, model, "xint8", x),
        "pt2e_x86": lambda: _pt2e_calibration(model, x),
    }
    for preset, make in calibrations.items():
        observe = make()
        infer()
        observe()
        infer_s, calib_s = common.interleaved_medians(infer, observe, repeats)
        row[f"{preset}_infer_s"] = infer_s
        row[f"{preset}_calib_s"] = calib_s
        row[f"{preset}_throughput_ratio"] = infer_s / calib_s
    return row


def part_speed(args: argparse.Namespace, results: dict[str, Any]) -> None:
    rows = results.setdefault("speed", {})
    for name in (*FMNIST, "efficientnet_lite0"):
        rows[name] = speed_row(name, args.repeats, args.whole_compile)
        print(name, rows[name], flush=True)


# ----------------------------------------------------------------------------------------------- report
def tables(results: dict[str, Any]) -> str:
    out = []
    if "ptq" in results:
        rows = []
        for name, r in results["ptq"].items():
            ours = [r[k]["top1"] for k in ("a8w8", "a8w8+mse", "xint8")]
            rows.append([name, r["float"], r["pt2e_x86"]["top1"], *ours, r["a8w8+mse"]["top1_ort_kernels"],
                         max(ours[:2]) - r["pt2e_x86"]["top1"], r["pt2e_x86"]["seconds"], r["a8w8"]["seconds"]])  # fmt: skip
        out.append(common.markdown_table(
            ["model", "float", "PT2E X86", "ours a8w8", "ours a8w8+MSE", "ours xint8", "ours a8w8+MSE (ORT kernels)",
             "best ours (a8w8) − PT2E", "PT2E s", "ours s"], rows))  # fmt: skip
    if "backends" in results:
        rows = []
        for key, r in results["backends"].items():
            s = r["scales"]
            rows.append([key, f"{s.get('equal_activation_scales')}/{s['layers']}",
                         f"{s.get('equal_weight_scales')}/{s.get('weights')}", s.get("worst_relative_difference"),
                         r["torch_fx"], r["quant_onnx"], r["torch_fx"] - r["quant_onnx"], r["between_backends"],
                         r["float_convs_torch_fx"]])  # fmt: skip
        out.append(common.markdown_table(
            ["model / config", "equal activation scales", "equal weight scales", "worst rel. diff", "torch-fx → ORT",
             "quant-onnx → ORT", "difference", "backends agree", "float convs (torch-fx)"], rows))  # fmt: skip
    if "qat_fmnist" in results:
        rows = [[n, r["float"], r["ptq_xint8"], r["qat_xint8"], r["qat_xint8_ort_kernels"], r["float"] - r["qat_xint8"],
                 r["steps"], r["train_seconds"]] for n, r in results["qat_fmnist"].items()]  # fmt: skip
        out.append(common.markdown_table(
            ["model", "float", "PTQ xint8", "QAT xint8 (1 epoch)", "QAT (ORT kernels)", "float − QAT", "steps", "train s"],
            rows))  # fmt: skip
    if "qat_effnet" in results:
        r = results["qat_effnet"]
        rows = [[c["epoch"], c["agreement"], c["seconds"] / 60] for c in r["curve"]]
        out.append(common.markdown_table(["epoch", "agreement with float (held-out crops)", "minutes"], rows))
        out.append(
            f"frozen: {common.fmt(r['frozen_agreement'])}; exported, onnxruntime integer kernels: "
            f"{common.fmt(r['ort_kernels_agreement'])}; total {common.fmt(r['seconds'] / 60)} min"
        )
    if "adaround_walk" in results:
        rows = [[n, r["calibration_samples"], r["quant_onnx_seconds"], r["torch_fx_seconds"],
                 r["torch_fx_seconds"] / r["quant_onnx_seconds"], r["quant_onnx_cpu_seconds"], r["torch_fx_cpu_seconds"],
                 r["quant_onnx_metric"], r["torch_fx_metric"]] for n, r in results["adaround_walk"].items()]  # fmt: skip
        out.append(common.markdown_table(
            ["model", "calibration samples", "quant-onnx s", "quant-torch-fx s", "torch-fx / onnx", "quant-onnx CPU s",
             "quant-torch-fx CPU s", "quant-onnx metric", "quant-torch-fx metric"], rows))  # fmt: skip
    if "speed" in results:
        rows = [[n, r["batch"], r["qat_float_train_step_s"], r["qat_step_s"], r["qat_ratio"], r["qat_compiled_ratio"],
                 r.get("qat_whole_compiled_ratio"), r["a8w8_throughput_ratio"], r.get("a8w8_mse_throughput_ratio"), r["xint8_throughput_ratio"],
                 r.get("pt2e_x86_throughput_ratio")] for n, r in results["speed"].items()]  # fmt: skip
        out.append(common.markdown_table(
            ["model", "batch", "float train step s", "QAT step s", "QAT / float", "QAT / float (compile_fake_quant)",
             "QAT / float (whole model compiled)", "calib / infer throughput a8w8 (MinMax)", "a8w8, MSE histogram", "xint8 (pow2 MinMSE histogram)",
             "PT2E X86 (HistogramObserver)"], rows))  # fmt: skip
    return "\n\n".join(out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    parser.add_argument("--num-calib", type=int, default=512)
    parser.add_argument("--walk-calib", type=int, default=256, help="calibration samples of the adaround_walk part")
    parser.add_argument("--qat-batch", type=int, default=128)
    parser.add_argument(
        "--whole-compile",
        action="store_true",
        help="speed: also time the QAT step of the whole prepared model compiled (minutes per model)",
    )
    parser.add_argument("--fmnist-lr", type=float, default=1e-4)
    parser.add_argument("--fmnist-cle", action="store_true",
                        help="Fashion-MNIST QAT with CLE first and batch norm folded (PTQ row too)")  # fmt: skip
    parser.add_argument("--effnet-batch", type=int, default=16)
    parser.add_argument("--effnet-lr", type=float, default=1e-5)
    parser.add_argument("--effnet-qparam-lr", type=float, default=1e-3)
    parser.add_argument("--effnet-weight-lr-per-step", type=float, default=None,
                        help="each quantized weight's learning rate as a fraction of its quantization step")  # fmt: skip
    parser.add_argument("--no-effnet-cle", dest="effnet_cle", action="store_false",
                        help="QAT without CLE, batch norm simulated rather than folded")  # fmt: skip
    parser.add_argument(
        "--effnet-adaround",
        action="store_true",
        help="start QAT from the tuned AdaRound PTQ model (the xint8_adaround preset)",
    )
    parser.add_argument(
        "--effnet-augment",
        action="store_true",
        help="distil on randomly mirrored, zoomed and mixed calibration crops (teacher run per batch)",
    )
    parser.add_argument("--effnet-epochs", type=int, default=30)
    parser.add_argument("--effnet-budget", type=float, default=1800.0, help="seconds; the issue's limit is 30 min")
    parser.add_argument("--effnet-stop", type=float, default=1.01, help="stop once agreement reaches this")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=common.DEFAULT_THREADS)
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--quick", action="store_true", help="small evaluation sets, few steps")
    parser.add_argument("--quiet", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    results = common.load_results(args.results, args.resume)
    results.setdefault("environment", {})["torch"] = torch.__version__
    results["environment"]["threads"] = args.threads
    runners = {"ptq": part_ptq, "backends": part_backends, "qat_fmnist": part_qat_fmnist,
               "qat_effnet": part_qat_effnet, "speed": part_speed, "adaround_walk": part_adaround_walk}  # fmt: skip
    for part in args.parts:
        runners[part](args, results)
        common.write_json(args.results, results)
    print(tables(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
