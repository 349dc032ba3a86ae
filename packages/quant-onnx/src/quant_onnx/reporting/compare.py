"""Float vs quantized model: top-1 agreement, output SQNR and per-layer SQNR.

Both models run in onnxruntime on the same batches. Outputs come from the quantized
model as deployed (graph optimisation ALL: the integer kernels); per-layer values come
from a copy of it that also outputs every activation DequantizeLinear, matched to the
float tensor it stands for (the QuantizeLinear's input, or the graph output a final
DequantizeLinear writes). SQNR accumulates signal and noise power batch by batch, so
memory does not grow with the number of samples.

Example:
    >>> import numpy as np
    >>> from onnx import helper, TensorProto
    >>> g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
    ...     [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3])],
    ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 3])])
    >>> m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    >>> result = compare_models(m, m, [{"x": np.eye(3, dtype=np.float32)}], quiet=True)
    >>> result.top1_agreement, result.output_sqnr_db["y"]
    (1.0, inf)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs
import numpy as np
import onnx
import onnxruntime as ort

from quant_algos.progress import first_taken, progress_bar
from quant_core.errors import ModelError
from quant_onnx.data import model_inputs
from quant_onnx.pipeline.calibrate import augmented_model, inference_session


def dequantized_tensors(quant_model: onnx.ModelProto) -> dict[str, str]:
    """Float tensor name -> name of a DequantizeLinear output carrying its quantized
    value, for every activation QuantizeLinear of a QDQ model."""
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in quant_model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    outputs = {o.name for o in quant_model.graph.output}
    result: dict[str, str] = {}
    for node in quant_model.graph.node:
        if node.op_type != "QuantizeLinear":
            continue
        dqs = [c.output[0] for c in consumers.get(node.output[0], []) if c.op_type == "DequantizeLinear"]
        if not dqs:
            continue
        as_output = [name for name in dqs if name in outputs]
        if as_output:  # a renamed graph output: the final DQ writes the float name
            result[as_output[0]] = as_output[0]
        else:
            result.setdefault(node.input[0], dqs[0])
    return result


@attrs.frozen
class LayerSQNR:
    """SQNR of one activation tensor, quantized vs float.

    Example:
        >>> LayerSQNR("conv1_out", 35.2).sqnr_db
        35.2
    """

    tensor: str
    sqnr_db: float


@attrs.frozen
class Comparison:
    """What :func:`compare_models` measured.

    Example:
        >>> Comparison(samples=0, top1_agreement=None, output_sqnr_db={}, layers=()).samples
        0
    """

    samples: int
    top1_agreement: float | None
    output_sqnr_db: Mapping[str, float]
    layers: tuple[LayerSQNR, ...]

    def to_data(self) -> dict[str, object]:
        """JSON-ready form (infinite SQNR written as a string, which JSON allows)."""
        return {
            "samples": self.samples,
            "top1_agreement": self.top1_agreement,
            "output_sqnr_db": {k: _json_float(v) for k, v in self.output_sqnr_db.items()},
            "layers": [{"tensor": layer.tensor, "sqnr_db": _json_float(layer.sqnr_db)} for layer in self.layers],
        }


def _json_float(value: float) -> float | str:
    return value if np.isfinite(value) else str(value)


class _PowerSums:
    """Running signal and noise power of one tensor pair."""

    def __init__(self) -> None:
        self.signal = 0.0
        self.noise = 0.0

    def add(self, reference: np.ndarray, approx: np.ndarray) -> None:
        ref = np.asarray(reference, np.float64)
        diff = ref - np.asarray(approx, np.float64)
        self.signal += float(np.sum(ref * ref))
        self.noise += float(np.sum(diff * diff))

    @property
    def sqnr_db(self) -> float:
        if self.noise == 0.0:
            return float("inf")
        if self.signal == 0.0:
            return float("-inf")
        return 10.0 * float(np.log10(self.signal / self.noise))


def compare_models(
    float_model: onnx.ModelProto,
    quant_model: onnx.ModelProto,
    batches: Iterable[Mapping[str, np.ndarray]],
    *,
    layers: bool = True,
    max_layer_samples: int | None = 64,
    total_batches: int | None = None,
    quiet: bool = False,
) -> Comparison:
    """Run both models over ``batches`` and compare them (see the module docstring).

    Top-1 agreement is reported for the first output when it is ``[N, classes]``;
    per-layer SQNR uses at most ``max_layer_samples`` samples (``None``: all).
    ``total_batches`` sizes the progress bar.
    """
    _check_same_interface(float_model, quant_model)
    output_names = [o.name for o in float_model.graph.output]
    float_names = _tensor_names(float_model)
    matched = {f: q for f, q in dequantized_tensors(quant_model).items() if f in float_names} if layers else {}
    layer_names = [f for f in matched if f not in output_names]
    float_session = inference_session(
        augmented_model(float_model, layer_names), ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    )
    quant_session = inference_session(quant_model, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    layer_session = None
    if layer_names:
        layer_session = inference_session(
            augmented_model(quant_model, [matched[f] for f in layer_names]), ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        )
    outputs = {name: _PowerSums() for name in output_names}
    per_layer = {name: _PowerSums() for name in layer_names}
    agree = total = layer_samples = seen = 0
    checked = first_taken(batches)  # a batch that does not fit fails before the bar is drawn
    with progress_bar(total=total_batches, desc="comparing", unit="batch", quiet=quiet) as bar:
        for batch in checked:
            feeds = {k: np.asarray(v) for k, v in batch.items()}
            n = len(next(iter(feeds.values())))
            seen += n
            float_values = dict(
                zip(output_names + layer_names, float_session.run(output_names + layer_names, feeds), strict=True)
            )
            quant_values = dict(zip(output_names, quant_session.run(output_names, feeds), strict=True))
            for name in output_names:
                _check_same_shape(name, float_values[name], quant_values[name])
                outputs[name].add(float_values[name], quant_values[name])
            first_f, first_q = float_values[output_names[0]], quant_values[output_names[0]]
            if first_f.ndim == 2 and first_f.shape[1] > 1:
                agree += int(np.sum(np.argmax(first_f, 1) == np.argmax(first_q, 1)))
                total += first_f.shape[0]
            if layer_session is not None and (max_layer_samples is None or layer_samples < max_layer_samples):
                values = layer_session.run([matched[f] for f in layer_names], feeds)
                for name, value in zip(layer_names, values, strict=True):
                    _check_same_shape(name, float_values[name], value)
                    per_layer[name].add(float_values[name], value)
                layer_samples += n
            del float_values, quant_values
            bar.update(1)
    return Comparison(
        samples=seen,  # every output's SQNR covers them all (the per-layer ones the first few)
        top1_agreement=(agree / total) if total else None,
        output_sqnr_db={name: sums.sqnr_db for name, sums in outputs.items()},
        layers=tuple(LayerSQNR(name, per_layer[name].sqnr_db) for name in layer_names),
    )


_SAME_MODEL = "allowed: the float model and a quantized copy of it"


def _interface(model: onnx.ModelProto) -> tuple[list[str], list[str]]:
    return sorted(spec.name for spec in model_inputs(model)), [v.name for v in model.graph.output]


def _check_same_interface(float_model: onnx.ModelProto, quant_model: onnx.ModelProto) -> None:
    """The quantized model reads and writes the float model's tensors, by name."""
    for what, float_names, quant_names in zip(
        ("inputs", "outputs"), _interface(float_model), _interface(quant_model), strict=True
    ):
        if float_names != quant_names:
            raise ModelError(
                f"quant_model: its {what} {quant_names} are not the float model's {float_names}; {_SAME_MODEL}"
            )


def _check_same_shape(tensor: str, float_value: np.ndarray, quant_value: np.ndarray) -> None:
    if float_value.shape != quant_value.shape:
        raise ModelError(
            f"tensor {tensor!r}: shape {list(float_value.shape)} in the float model, "
            f"{list(quant_value.shape)} in the quantized model; {_SAME_MODEL}"
        )


def _tensor_names(model: onnx.ModelProto) -> set[str]:
    graph = model.graph
    names = {v.name for v in graph.input} | {o for n in graph.node for o in n.output}
    return names
