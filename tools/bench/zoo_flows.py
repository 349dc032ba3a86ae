"""The three quantization flows the zoo runs on one model, stage by stage (``tools/bench/zoo.py``).

* :func:`torch_backend`: quant-torch-fx ``a8w8``: capture (``ModelQuantizer.prepare``), calibrate
  (``ModelQuantizer.calibrate``; the two halves of ``quantize_model`` for a preset without
  algorithms), freeze, ``export_onnx``, then the file in onnxruntime's default session;
* :func:`onnx_backend`: the float model exported by torch's TorchScript exporter (opset 17, a
  tool-side step), quant-onnx ``a8w8`` (``quant_onnx.quantize``), the file in onnxruntime;
* :func:`pt2e`: torchao's PT2E with ``X86InductorQuantizer``'s default config.

Each flow returns ``{"ok", "failed": {"stage", "error"} | None, "seconds": {stage: s}, ...}``:
a stage that raises ends its flow and is recorded with its one-line error. Measurements after a
flow completed (coverage, node-by-node fidelity) fail on their own without failing the flow.

Example:
    >>> flow = Flow()
    >>> flow.stage("add", lambda: 1 + 1)
    2
    >>> try:
    ...     flow.stage("divide", lambda: 1 / 0)
    ... except FlowStopped:
    ...     pass
    >>> flow.failed
    {'stage': 'divide', 'error': 'ZeroDivisionError: division by zero'}
"""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from tools.bench import common, qdq_coverage

T = TypeVar("T")
PRESET = "a8w8"
CALIB_BATCH = 16
ERROR_CHARS = 240


class FlowStopped(Exception):
    """A stage failed: the flow ends here (the failure is in ``Flow.failed``)."""


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message``, at most ``ERROR_CHARS`` characters.

    Example:
        >>> one_line(ValueError("bad\\nmore"))
        'ValueError: bad'
    """
    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
    return line if len(line) <= ERROR_CHARS else line[: ERROR_CHARS - 3] + "..."


class Flow:
    """Stage timings and the first failure of one flow."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.failed: dict[str, str] | None = None
        self.traceback = ""
        self.results: dict[str, Any] = {}

    def stage(self, name: str, fn: Callable[[], T]) -> T:
        """``fn()`` timed as stage ``name``; on an exception the flow records it and stops."""
        start = time.perf_counter()
        try:
            return fn()
        except Exception as exc:
            self.failed = {"stage": name, "error": one_line(exc)}
            self.traceback = traceback.format_exc()
            raise FlowStopped(name) from exc
        finally:
            self.seconds[name] = time.perf_counter() - start

    def measure(self, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        """A measurement on a completed flow: its result, or its one-line error, under ``name``."""
        try:
            self.results[name] = fn()
        except Exception as exc:
            self.results[name] = {"error": one_line(exc)}

    def summary(self) -> dict[str, Any]:
        out = {"ok": self.failed is None, "failed": self.failed, "seconds": self.seconds, **self.results}
        if self.traceback:
            out["traceback"] = self.traceback[-3000:]
        return out


def run(flow_fn: Callable[[Flow], None]) -> dict[str, Any]:
    flow = Flow()
    with contextlib.suppress(FlowStopped):
        flow_fn(flow)
    return flow.summary()


# ---------------------------------------------------------------------------------------- scoring
def class_agreement(a: np.ndarray, b: np.ndarray, classes_from: int = 0) -> float:
    """Fraction of argmaxes over axis 1 (from channel ``classes_from``) that agree: per image,
    per pixel, per anchor.

    Example:
        >>> class_agreement(np.array([[0, 1.0], [2, 1]]), np.array([[0, 1.0], [0, 1]]))
        0.5
    """
    return float(np.mean(a[:, classes_from:].argmax(1) == b[:, classes_from:].argmax(1)))


def sqnr(reference: np.ndarray, value: np.ndarray) -> float:
    from quant_core.qparams import sqnr_db

    return sqnr_db(reference, value)


def torch_outputs(model: Any, x: np.ndarray, batch: int = CALIB_BATCH) -> np.ndarray:
    """The (single) output of a torch model over ``x``, batch by batch, as numpy."""
    import torch

    with torch.no_grad():
        return np.concatenate([model(torch.from_numpy(x[i : i + batch])).numpy() for i in range(0, len(x), batch)])


def torch_batches(x: np.ndarray, batch: int = CALIB_BATCH) -> list[Any]:
    import torch

    return [torch.from_numpy(np.ascontiguousarray(x[i : i + batch])) for i in range(0, len(x), batch)]


def output_step(path: Path) -> float | None:
    """How far the file's first output moves for one step of the quantized tensor it is
    computed from: its DequantizeLinear's step, or for float logits one input step through
    the last layer (:func:`quant_torch_fx.export_fidelity.output_tolerance`)."""
    import onnx

    from quant_torch_fx.export_fidelity import output_tolerance

    return output_tolerance(onnx.load(str(path), load_external_data=False))


def file_measures(flow: Flow, path: Path, x_node: np.ndarray) -> None:
    """Coverage and onnxruntime-kernel fidelity of one written QDQ file."""
    import onnx

    flow.measure("dq_fed", lambda: qdq_coverage.dq_fed_inputs(onnx.load(str(path))))
    flow.measure("kernels", lambda: qdq_coverage.kernel_coverage(path))
    flow.measure("kernel_fidelity", lambda: qdq_coverage.kernel_fidelity(path, x_node))


# ------------------------------------------------------------------------------------------ flows
def torch_backend(
    flow: Flow, model: Any, data: dict[str, Any], path: Path, measures: bool = True, preset: str = PRESET
) -> None:
    """quant-torch-fx under ``preset`` (``a8w8``); ``data``: ``calib``, ``eval``, ``node`` (inputs of the node-by-node
    comparisons), ``float_eval`` arrays and ``classes_from``; ``measures``: coverage and fidelity too."""
    import torch

    from quant_torch_fx import ModelQuantizer

    example = torch.from_numpy(data["eval"][:1])
    quantizer = ModelQuantizer(preset, quiet=True)
    # As a user runs a preset: capture, its algorithms (the 8-bit presets' corrections), calibration.
    prepared = flow.stage("quantize", lambda: quantizer.quantize_model(model, example, torch_batches(data["calib"])))
    frozen = flow.stage("freeze", lambda: quantizer.freeze(prepared))
    flow.stage("export", lambda: quantizer.export_onnx(frozen, example, path))
    frozen_out = flow.stage("run frozen", lambda: torch_outputs(frozen, data["eval"]))
    ort_out = flow.stage("onnxruntime", lambda: common.predict(str(path), data["eval"], batch_size=CALIB_BATCH))
    float_out, classes_from = data["float_eval"], data["classes_from"]
    step = output_step(path)
    difference = float(np.abs(ort_out - frozen_out).max())
    flow.results.update(
        {
            "sqnr_frozen": sqnr(float_out, frozen_out),
            "sqnr_onnx": sqnr(float_out, ort_out),
            "agreement_float": class_agreement(frozen_out, float_out, classes_from),
            "agreement_export_frozen": class_agreement(ort_out, frozen_out, classes_from),
            "export_frozen_max_abs": difference,
            "output_step": step,
            "export_frozen_steps": None if step is None else difference / step,
        }
    )
    if measures:
        file_measures(flow, path, data["node"])
        flow.measure("node_by_node", lambda: export_vs_frozen_nodes(frozen, path, data["node"]))
        flow.measure("isolated", lambda: export_vs_frozen_isolated(frozen, path, data["node"]))
        flow.measure("first_departure", lambda: first_departure(frozen, path, data["node"]))
        flow.measure("rounding_floor", lambda: rounding_floor(frozen, frozen_out, ort_out, path, data["eval"]))


def onnx_backend(
    flow: Flow,
    model: Any,
    data: dict[str, Any],
    float_path: Path,
    path: Path,
    measures: bool = True,
    preset: str = PRESET,
) -> None:
    """The float model exported to ONNX (tool side), then quant-onnx under ``preset`` (``a8w8``)."""
    import quant_onnx

    flow.stage("float export", lambda: export_float_onnx(model, data["eval"][:1], float_path))
    flow.stage(
        "quantize",
        lambda: quant_onnx.quantize(
            str(float_path), str(path), preset, data["calib"], batch_size=CALIB_BATCH, quiet=True
        ),
    )
    ort_out = flow.stage("onnxruntime", lambda: common.predict(str(path), data["eval"], batch_size=CALIB_BATCH))
    flow.results.update(
        {
            "sqnr_onnx": sqnr(data["float_eval"], ort_out),
            "agreement_float": class_agreement(ort_out, data["float_eval"], data["classes_from"]),
        }
    )
    if measures:
        file_measures(flow, path, data["node"])


def pt2e(flow: Flow, model: Any, data: dict[str, Any]) -> None:
    """torchao PT2E (``torch.export`` with a dynamic batch, ``X86InductorQuantizer`` default config)."""
    import torch
    from torchao.quantization.pt2e import move_exported_model_to_eval
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

    from tools.bench.torch_fx import pt2e_prepared

    calib = torch_batches(data["calib"])
    prepared = flow.stage("prepare", lambda: pt2e_prepared(model, calib[0]))

    def observe() -> None:
        with torch.no_grad():
            for batch in calib:
                prepared(batch)

    flow.stage("calibrate", observe)

    def convert() -> Any:
        converted = convert_pt2e(prepared)
        move_exported_model_to_eval(converted)
        return converted

    converted = flow.stage("convert", convert)
    out = flow.stage("run", lambda: torch_outputs(converted, data["eval"]))
    flow.results.update(
        {
            "sqnr": sqnr(data["float_eval"], out),
            "agreement_float": class_agreement(out, data["float_eval"], data["classes_from"]),
        }
    )


def export_float_onnx(model: Any, example: np.ndarray, path: Path) -> None:
    """The float model as a user hands it to quant-onnx: TorchScript exporter, opset 17, dynamic batch."""
    import torch

    with common.atomic_path(path, ".onnx") as tmp, torch.no_grad():
        torch.onnx.export(
            model,
            (torch.from_numpy(example),),
            str(tmp),
            dynamo=False,
            opset_version=17,
            input_names=["input"],
            output_names=["output"],
            dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}},
        )


# ------------------------------------------------------------------------------ export vs frozen
def frozen_quantized_tensors(frozen: Any, x: np.ndarray) -> list[tuple[str, np.ndarray, float]]:
    """``(quantizer key, fake-quantized value, scale)`` of every activation quantizer call of the
    frozen model on ``x``, in execution order (the order the exporter traces them in)."""
    import torch

    from quant_torch_fx.prepare import activation_quantizers, quantized_graphs

    keys = {id(fq): (key, fq) for gm in quantized_graphs(frozen) for key, fq in activation_quantizers(gm)}
    seen: list[tuple[str, np.ndarray, float]] = []
    handles = []
    for key, fq in keys.values():

        def hook(module: Any, _args: Any, output: Any, key: str = key) -> None:
            qp = module.current_qparams()
            seen.append((key, output.detach().numpy().copy(), float(np.asarray(qp.scale))))

        handles.append(fq.register_forward_hook(hook))
    try:
        with torch.no_grad():
            frozen(torch.from_numpy(x))
    finally:
        for handle in handles:
            handle.remove()
    return seen


def exported_quantized_tensors(path: Path, x: np.ndarray) -> list[tuple[str, np.ndarray, float]]:
    """``(QuantizeLinear name, dequantized value, scale)`` of every QuantizeLinear of the file, in
    graph order, run node by node (``ORT_DISABLE_ALL``: the file's meaning, no fused kernels)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    nodes = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
    names = [n.output[0] for n in nodes]
    values = qdq_coverage.run_outputs(qdq_coverage.with_outputs(model, names), x, "disable", names)
    out = []
    for node in nodes:
        scale = inits[node.input[1]].astype(np.float32)
        zero = inits[node.input[2]].astype(np.float32) if len(node.input) > 2 else np.float32(0)
        codes = values[node.output[0]].astype(np.float32)
        out.append((node.name or node.output[0], (codes - zero) * scale, float(scale)))
    return out


def export_vs_frozen_nodes(frozen: Any, path: Path, x: np.ndarray) -> dict[str, Any]:
    """Each QuantizeLinear of the exported file against the frozen model's fake-quantized tensor
    it was traced from, in quantization steps (:func:`qdq_coverage.step_differences`).

    The two lists are aligned in order: an exported QuantizeLinear takes the next frozen tensor
    with the same scale and shape (a quantizer of a constant is folded away by the exporter and is
    skipped); ``matched`` says how many of the file's QuantizeLinear found their tensor.
    """
    torch_side = frozen_quantized_tensors(frozen, x)
    onnx_side = exported_quantized_tensors(path, x)
    cursor, pairs = 0, []
    for name, value, scale in onnx_side:
        for k in range(cursor, len(torch_side)):
            key, reference, ref_scale = torch_side[k]
            if reference.shape == value.shape and np.isclose(ref_scale, scale, rtol=1e-6, atol=0):
                cursor = k + 1
                pairs.append((f"{name} ({key})", value, reference, scale))
                break
    summary = qdq_coverage.step_differences(pairs)
    summary.update({"tensors": len(onnx_side), "frozen_tensors": len(torch_side), "matched": len(pairs)})
    return summary


def _ort_runner(level: str) -> Callable[[Any, dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """Every output of a model in onnxruntime at optimisation ``level`` (:func:`common.make_session`)."""

    def run(model: Any, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        session = common.make_session(model.SerializeToString(), level=level)
        names = [o.name for o in session.get_outputs()]
        return dict(zip(names, session.run(names, feeds), strict=True))

    return run


def export_vs_frozen_isolated(frozen: Any, path: Path, x: np.ndarray) -> dict[str, Any]:
    """Each QuantizeLinear of the file computed from the frozen model's own codes of the tensors
    it reads (``isolated`` of :func:`quant_torch_fx.export_fidelity.node_by_node`), in
    onnxruntime node by node (``ORT_DISABLE_ALL``) and in its default session (``default_*``:
    integer kernels): the export's own difference per node, with nothing carried in from
    earlier layers, in quantization steps."""
    import onnx
    import torch

    from quant_torch_fx.export_fidelity import node_by_node

    model, inputs = onnx.load(str(path)), (torch.from_numpy(x),)
    out: dict[str, Any] = {}
    for prefix, level in (("", "disable"), ("default_", "all")):
        fidelity = node_by_node(model, frozen, inputs, _ort_runner(level))
        worst, worst_steps = max(fidelity.isolated.items(), key=lambda item: item[1], default=(None, None))
        out.update(
            {
                f"{prefix}tensors": len(fidelity.isolated) + len(fidelity.unmatched),
                f"{prefix}matched": len(fidelity.isolated),
                f"{prefix}within_one": fidelity.within_one_step("isolated"),
                f"{prefix}worst": worst,
                f"{prefix}worst_steps": worst_steps,
            }
        )
    return out


def first_departure(frozen: Any, path: Path, x: np.ndarray) -> dict[str, Any]:
    """Where the file (onnxruntime node by node) first departs from the frozen model end to end
    (:func:`quant_torch_fx.export_fidelity.first_departure`): the tensor, how many codes differ,
    by how many steps, and how far from the half step between the two codes either computation's
    value before rounding was (a few float32 roundings: a tie broken two ways)."""
    import attrs
    import onnx
    import torch

    from quant_torch_fx import export_fidelity

    departure = export_fidelity.first_departure(
        onnx.load(str(path)), frozen, (torch.from_numpy(x),), _ort_runner("disable")
    )
    return {"tensor": None} if departure is None else attrs.asdict(departure)


def rounding_floor(
    frozen: Any, frozen_out: np.ndarray, ort_out: np.ndarray, path: Path, x: np.ndarray
) -> dict[str, Any]:
    """How far float rounding alone moves the output: the frozen model against itself computed
    channels-last (other convolution kernels, another summation order), and the exported file in
    onnxruntime's default session against onnx's reference evaluator (another implementation of
    the same file); the largest absolute difference, and in output steps where the output has one
    (:func:`output_step`). A value that float rounding puts on the other side of a half step
    changes one code; a layer whose gain in steps exceeds one spreads it.

    The reference evaluator implements QuantizeLinear/DequantizeLinear from opset 19 on; the
    file (opset 17) is read at 19, where no op it holds changed meaning for float and 8-bit types.
    """
    import copy

    import onnx
    import torch
    from onnx.reference import ReferenceEvaluator

    other = copy.deepcopy(frozen).to(memory_format=torch.channels_last)
    with torch.no_grad():
        channels_last = other(torch.from_numpy(x).to(memory_format=torch.channels_last)).numpy()
    model = onnx.load(str(path))
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = max(opset.version, 19)
    reference = ReferenceEvaluator(model).run(None, {model.graph.input[0].name: x})[0]
    step = output_step(path)
    pairs = {
        "torch_channels_last": (channels_last, frozen_out),
        "ort_vs_reference": (reference, ort_out),
        "reference_vs_frozen": (reference, frozen_out),
    }
    out: dict[str, Any] = {}
    for name, (a, b) in pairs.items():
        largest = float(np.abs(a - b).max())
        out[f"{name}_max_abs"] = largest
        out[f"{name}_steps"] = None if step is None else largest / step
    return out
