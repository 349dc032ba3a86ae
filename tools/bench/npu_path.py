"""The NPU path of one model, step by step (issue 26): quantize, check, legalize, check,
simulate, with the model's accuracy after each step and the time legalize and simulate take.

For each config row (``a8w8`` as the CPU peer; ``xint8``, ``xint8_adaround``; ``+ conv``:
``QuantConfig.npu_conversions`` converts Sigmoid/SiLU/HardSigmoid to the device's
HardSigmoid before calibration; ``+ tanh``: every Sigmoid, SiLU's included, becomes the
exact ``0.5 * Tanh(0.5 x) + 0.5`` instead) the record holds:

* ``qdq``: the quantized model as written, in onnxruntime (graph optimisations off);
* ``check_before`` / ``check_after``: violations by rule of the default target before and
  after ``legalize``;
* ``legal``: the legalised model in onnxruntime; ``costs``: each conversion ``legalize``
  made, as the output SQNR of the converted QDQ model against the unconverted one;
* ``npu``: the legalised model through the integer simulator (the device's rounding), and
  its agreement with onnxruntime on the same model (dense outputs: share of values within
  one output step; classifiers: top-1 agreement), with onnx rounding too;
* ``cpu``: the other choice for the float ops: ``legalize --cpu`` keeps them on the CPU
  (named partitions) and the simulator computes them in float; ``cpu_tail``: only the
  Sigmoids that write a graph output (``--cpu Sigmoid@output``: one partition at the end),
  the rest converted;
* ``legalize_s``, ``simulate_s``: wall time on this machine (indicative: shared cores);
  measuring the conversions' costs (one onnxruntime run per rule) is timed apart, ``costs_s``.

Accuracy is the output SQNR (dB) against the float model on evaluation inputs never used
for calibration, plus the model's own metric (IoU for a segmenter, top-1 for a classifier).
Models come from a registry (:data:`PATH_MODELS`, the detectors of ``tools/npu_models.py``);
``--zoo MODULE`` adds a module's ``npu_bench_models()`` (name -> :class:`PathModel`).

Example:
    $ python -m tools.bench.npu --path --models yolo_silu se_decoder --rows xint8 "xint8 + conv"
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tools.bench import common

EVAL_COUNT = 256
CALIB_COUNT = 128
COST_SAMPLES = 32
CPU_OPS = "Sigmoid,Tanh,Gelu"
CPU_TAIL = "Sigmoid@output"


@dataclass(frozen=True)
class PathModel:
    """A model the NPU path runs: float ONNX, data, and how outputs are scored.

    Args:
        name: row label.
        float_path: returns the float ONNX path (building it on first use).
        calibration: returns calibration inputs (first axis = samples).
        evaluation: returns ``(inputs, truth)``; truth: masks (``"iou"``), per-image
            ``(boxes, classes)`` (``"map50"``), labels (``"accuracy"``) or None.
        metric: ``"sqnr"`` (dense outputs), ``"iou"``, ``"map50"`` or ``"accuracy"`` (output
            SQNR is always reported).
    """

    name: str
    float_path: Callable[[], Any]
    calibration: Callable[[], np.ndarray]
    evaluation: Callable[[], tuple[np.ndarray, Any]]
    metric: str


def _detector(name: str) -> PathModel:
    from tools import npu_models

    spec = npu_models.NPU_MODELS[name]

    def evaluation() -> tuple[np.ndarray, Any]:
        x, masks = npu_models.eval_data(EVAL_COUNT)
        return x, (npu_models.eval_boxes(EVAL_COUNT) if spec.metric == "map50" else masks)

    return PathModel(name, spec.ensure, lambda: npu_models.calibration_data(CALIB_COUNT), evaluation, spec.metric)


PATH_MODELS: dict[str, Callable[[], PathModel]] = {
    "yolo_silu": lambda: _detector("yolo_silu"),
    "se_decoder": lambda: _detector("se_decoder"),
}
"""Built-in models of the NPU path, by name (factories: nothing is built until used)."""

ROWS: dict[str, tuple[str, tuple[str, ...]]] = {
    "a8w8": ("a8w8", ()),
    "xint8": ("xint8", ()),
    "xint8 + conv": ("xint8", ("silu", "sigmoid", "hard_sigmoid")),
    "xint8_adaround": ("xint8_adaround", ()),
    "xint8_adaround + conv": ("xint8_adaround", ("silu", "sigmoid", "hard_sigmoid")),
    "xint8 + tanh": ("xint8", ("sigmoid_tanh", "hard_sigmoid")),
    "xint8_adaround + tanh": ("xint8_adaround", ("sigmoid_tanh", "hard_sigmoid")),
}
"""Row label -> (preset, conversions before calibration)."""


ZOO_SIZE = 128
ZOO_EVAL = 64


def load_zoo(module: str) -> dict[str, Callable[[], PathModel]]:
    """The NPU-path models of a zoo ``module``: its ``npu_bench_models()`` (name -> a
    :class:`PathModel` or a factory of one), or else its ``ZOO`` of entries with
    ``build(size)`` -> torch module (``tools/zoo_models.py``), each exported at
    :data:`ZOO_SIZE` and fed resized photo crops (its weights are random: output SQNR only)."""
    zoo = importlib.import_module(module)
    if hasattr(zoo, "npu_bench_models"):
        found = zoo.npu_bench_models()
        return {name: (entry if callable(entry) and not isinstance(entry, PathModel) else (lambda e=entry: e))
                for name, entry in found.items()}  # fmt: skip
    return {name: (lambda e=entry: _zoo_model(e)) for name, entry in zoo.ZOO.items()}


def _photos(split: str, count: int, size: int) -> np.ndarray:
    """Photo crops (224 x 224) resized to ``size`` by area averaging (integer factors) or sampling."""
    from tools.photo_crops import load_photo_crops

    crops = load_photo_crops(split, num=count)
    factor = crops.shape[-1] // size
    if factor * size == crops.shape[-1]:
        n, c = crops.shape[:2]
        return np.ascontiguousarray(crops.reshape(n, c, size, factor, size, factor).mean(axis=(3, 5)), np.float32)
    index = (np.arange(size) * crops.shape[-1] // size).astype(np.int64)
    return np.ascontiguousarray(crops[:, :, index][:, :, :, index], np.float32)


def _zoo_model(entry: Any) -> PathModel:
    path = common.CACHE_DIR / "bench" / "npu" / "zoo" / f"{entry.name}_{ZOO_SIZE}.onnx"
    size = entry.input_size(ZOO_SIZE)

    def float_path() -> Any:
        if not path.exists():
            import torch

            path.parent.mkdir(parents=True, exist_ok=True)
            model = entry.build(ZOO_SIZE)
            example = torch.zeros(2, 3, size, size)
            with common.atomic_path(path, ".onnx") as tmp, torch.no_grad():
                torch.onnx.export(
                    model, (example,), str(tmp), dynamo=False, opset_version=17,
                    input_names=["x"], dynamic_axes={"x": {0: "N"}},
                )  # fmt: skip
        return path

    return PathModel(
        entry.name,
        float_path,
        lambda: _photos("calibration", CALIB_COUNT, size),
        lambda: (_photos("evaluation", ZOO_EVAL, size), None),
        "sqnr",
    )


# ------------------------------------------------------------------------------ scoring


def run_ort(model: Any, x: np.ndarray) -> np.ndarray:
    return common.predict(
        model.SerializeToString() if hasattr(model, "SerializeToString") else model, x, level="disable"
    )


def output_step(model: Any) -> float | np.ndarray:
    """The scale of the DequantizeLinear writing the model's (first) output; for the
    planner's float result Concat, each input's scale over its channels (an array that
    broadcasts against the output)."""
    import onnx

    output = model.graph.output[0].name
    producer = next(n for n in model.graph.node if output in n.output)
    if producer.op_type != "Concat":
        return _dq_scale(model, producer)
    inferred = onnx.shape_inference.infer_shapes(model)
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in inferred.graph.value_info}
    axis = next((a.i for a in producer.attribute if a.name == "axis"), 0)
    steps = []
    for name in producer.input:
        dq = next(n for n in model.graph.node if name in n.output)
        rank = len(shapes[name])
        axis = axis % rank
        steps.append(np.full(shapes[name][axis], _dq_scale(model, dq)))
    return np.concatenate(steps).reshape([-1 if i == axis else 1 for i in range(rank)])


def _dq_scale(model: Any, dq: Any) -> float:
    import onnx

    scale = next(t for t in model.graph.initializer if t.name == dq.input[1])
    return float(onnx.numpy_helper.to_array(scale).reshape(-1)[0])


def score(model: PathModel, outputs: np.ndarray, reference: np.ndarray, truth: Any) -> dict[str, float]:
    from quant_core.qparams import sqnr_db

    scores = {"sqnr_db": float(sqnr_db(reference, outputs))}
    if model.metric == "iou" and truth is not None:
        from tools.npu_models import iou

        scores["iou"] = iou(outputs, truth)
    elif model.metric == "map50" and truth is not None:
        from tools.npu_models import map50

        scores["map50"] = map50(outputs, truth)
    elif model.metric == "accuracy" and truth is not None:
        scores["accuracy"] = common.accuracy(common.top1(outputs), truth)
    return scores


def agreement(model: PathModel, simulated: np.ndarray, expected: np.ndarray, step: float | np.ndarray) -> float:
    if model.metric == "accuracy":
        return common.agreement(common.top1(simulated), common.top1(expected))
    return float(np.mean(np.abs(simulated.astype(np.float64) - expected) <= step * (1 + 1e-6)))


# ------------------------------------------------------------------------------ the path


def run_path(model: PathModel, rows: Sequence[str], *, quiet: bool = True) -> dict[str, Any]:
    """Every row of ``rows`` for ``model`` (see the module docstring)."""
    import quant_onnx
    from quant_core.presets import get_preset
    from quant_npu import check, legalize_model, load_profile
    from quant_npu.conversions import conversion_costs
    from quant_npu.sim import NPUSimulator

    float_path = model.float_path()
    calibration = model.calibration()
    x, truth = model.evaluation()
    reference = run_ort(str(float_path), x).astype(np.float64)
    entry: dict[str, Any] = {"metric": model.metric, "num_eval": len(x), "num_calib": len(calibration)}
    entry["float"] = score(model, reference, reference, truth)
    entry["rows"] = {}
    for row in rows:
        preset, conversions = ROWS[row]
        config = get_preset(preset).evolve(npu_conversions=conversions)
        start = time.perf_counter()
        qdq = quant_onnx.quantize(str(float_path), None, config, calibration, quiet=quiet).model
        record: dict[str, Any] = {"quantize_s": time.perf_counter() - start}
        record["qdq"] = score(model, run_ort(qdq, x), reference, truth)
        if preset == "a8w8":
            entry["rows"][row] = record
            continue
        record["check_before"] = check(qdq).counts()
        start = time.perf_counter()
        legal = legalize_model(qdq)
        record["legalize_s"] = time.perf_counter() - start
        record["check_after"] = legal.remaining.counts()
        start = time.perf_counter()
        record["costs"] = conversion_costs(qdq, load_profile(), calibration[:COST_SAMPLES])
        record["costs_s"] = time.perf_counter() - start
        record["converted"] = sum(1 for c in legal.changes if c.kind == "conversion")
        expected = run_ort(legal.model, x)
        record["legal"] = score(model, expected, reference, truth)
        if legal.remaining.ok:
            start = time.perf_counter()
            simulator = NPUSimulator(legal.model)
            (device,) = simulator.run(x, quiet=True).values()
            record["simulate_s"] = time.perf_counter() - start
            (onnx_rounding,) = NPUSimulator(legal.model, rounding="onnx").run(x, quiet=True).values()
            step = output_step(legal.model)
            record["npu"] = score(model, device, reference, truth)
            record["agreement_device"] = agreement(model, device, expected, step)
            record["agreement_onnx"] = agreement(model, onnx_rounding, expected, step)
        if not conversions:
            record["cpu"] = cpu_variant(model, qdq, x, reference, truth, CPU_OPS)
        record["cpu_tail"] = cpu_variant(model, qdq, x, reference, truth, CPU_TAIL)
        entry["rows"][row] = record
        print(f"  {row:<24} {summary(record)}", flush=True)
    return entry


def cpu_variant(
    model: PathModel, qdq: Any, x: np.ndarray, reference: np.ndarray, truth: np.ndarray | None, cpu: str
) -> dict:
    """The ops ``cpu`` selects kept on the CPU instead of converted."""
    from quant_npu import legalize_model
    from quant_npu.sim import NPUSimulator

    legal = legalize_model(qdq, cpu=cpu)
    record: dict[str, Any] = {
        "partitions": len(legal.remaining.partitions),
        "check_after": legal.remaining.counts(),
        "legal": score(model, run_ort(legal.model, x), reference, truth),
    }
    if legal.remaining.ok:
        (device,) = NPUSimulator(legal.model, cpu=cpu).run(x, quiet=True).values()
        record["npu"] = score(model, device, reference, truth)
    return record


def summary(record: Mapping[str, Any]) -> str:
    parts = [f"QDQ {record['qdq']['sqnr_db']:.1f} dB"]
    if "legal" in record:
        parts.append(f"legal {record['legal']['sqnr_db']:.1f} dB")
    if "npu" in record:
        parts.append(f"NPU {record['npu']['sqnr_db']:.1f} dB, agree {record['agreement_device']:.3f}")
    if "check_before" in record:
        before, after = sum(record["check_before"].values()), sum(record["check_after"].values())
        parts.append(f"violations {before} -> {after}")
    return ", ".join(parts)


# ------------------------------------------------------------------------------ tables


def _metric(scores: Mapping[str, float] | None, metric: str) -> str:
    if not scores:
        return "-"
    text = f"{scores['sqnr_db']:.1f}"
    extra = scores.get(metric)
    return text if extra is None else f"{text} / {extra:.3f}"


def tables(results: Mapping[str, Any]) -> str:
    """One markdown table of every model and row."""
    rows = []
    for name, entry in results.items():
        metric = entry["metric"]
        unit = "SQNR dB" + ("" if metric == "sqnr" else f" / {metric}")
        float_extra = entry["float"].get(metric)
        rows.append([name, "float", unit, "-" if float_extra is None else f"{float_extra:.3f}"] + [None] * 9)
        for row, r in entry["rows"].items():
            before = ", ".join(f"{k} {v}" for k, v in sorted(r.get("check_before", {}).items())) or "-"
            after = ", ".join(f"{k} {v}" for k, v in sorted(r.get("check_after", {}).items())) or "ok"
            costs = ", ".join(f"{k} {v:.1f}" for k, v in r.get("costs", {}).items()) or "-"
            cpu, tail = r.get("cpu", {}), r.get("cpu_tail", {})
            rows.append(
                [
                    name, row, unit, _metric(r["qdq"], metric),
                    before if "check_before" in r else "-", after if "check_after" in r else "-",
                    _metric(r.get("legal"), metric), _metric(r.get("npu"), metric),
                    None if "agreement_device" not in r else f"{r['agreement_device']:.3f} / {r['agreement_onnx']:.3f}",
                    costs,
                    _metric(cpu.get("npu") or cpu.get("legal"), metric) if cpu else "-",
                    _metric(tail.get("npu") or tail.get("legal"), metric) if tail else "-",
                    None if "legalize_s" not in r else f"{r['legalize_s']:.1f} + {r.get('simulate_s', 0):.1f}",
                ]
            )  # fmt: skip
    return common.markdown_table(
        [
            "model", "config", "metric", "QDQ (ORT)", "check before legalize", "after legalize",
            "legalised (ORT)", "NPU simulator", "sim vs ORT (device / onnx rounding)",
            "conversion cost, dB SQNR vs unconverted", "--cpu Sigmoid,Tanh,Gelu (NPU sim)",
            "--cpu Sigmoid@output (NPU sim)", "legalize + simulate s",
        ],
        rows,
    )  # fmt: skip
