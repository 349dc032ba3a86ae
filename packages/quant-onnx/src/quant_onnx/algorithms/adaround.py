"""AdaRound and AdaQuant on a QDQ model (post-passes, need ``quant-onnx[torch]``).

Layers are processed in graph order. For each quantized Conv/Gemm/MatMul the layer's
input is taken from the quantized model with every upstream layer already updated
(the DequantizeLinear output feeding it), the target from the float model (the
matching node's output, pre-activation; a Relu/Relu6 that follows it in the float
graph is applied to output and target), the weight qparams from the DequantizeLinear
initializers. ``quant_algos.adaround.adaround_layer`` / ``adaquant.adaquant_layer``
learn the codes; they replace the int8 weight initializer (AdaQuant also the int32
bias codes). The graph structure is unchanged.

Both models are walked with :class:`~quant_onnx.algorithms.capture.IncrementalRunner`
(each node runs once over the samples: about one forward pass per model for the
whole network). ``num_samples`` (``DEFAULT_NUM_SAMPLES`` when unset) bounds the
samples captured and the live memory; the learning itself draws random output
positions from a bounded pool (quant_algos.reconstruction_data), so its cost does not
grow with the image size. quant_onnx never imports torch; quant_algos does, lazily.

Example:
    See ``tests-integration/test_onnx_adaround.py``.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import numpy as np
import onnx
from tqdm.auto import tqdm

from quant_core.algorithm_config import AdaQuantConfig, AdaRoundConfig
from quant_onnx.algorithms._graph import copy_model, set_initializer
from quant_onnx.algorithms.capture import Feeds, IncrementalRunner, prepare_batches
from quant_onnx.algorithms.qdq_layers import MatchedLayer, bias_codes, bias_scale, match_float_layers, write_bias
from quant_onnx.graph import GraphIndex

#: Samples captured when the config leaves ``num_samples`` unset.
DEFAULT_NUM_SAMPLES = 256


def require_torch(feature: str) -> None:
    """ImportError naming the extra when PyTorch is not installed (checked before any
    work, without importing torch here)."""
    if importlib.util.find_spec("torch") is None:
        raise ImportError(
            f"{feature} needs PyTorch: pip install 'quant-onnx[torch]' (which installs 'quant-algos[torch]')"
        )


@attrs.frozen
class LayerOutcome:
    """One layer's result: reconstruction loss with nearest rounding and with the
    learned weights (on the layer's pool), iterations, whether nearest was kept, and
    the seconds spent capturing its data and learning."""

    name: str
    loss_nearest: float
    loss: float
    iterations: int
    fell_back: bool
    capture_seconds: float = 0.0
    learn_seconds: float = 0.0


@attrs.frozen
class ReconstructionReport:
    """What :func:`apply_adaround` / :func:`apply_adaquant` did.

    Example:
        >>> ReconstructionReport("adaround", (LayerOutcome("c", 2.0, 1.0, 100, False),), ()).to_dict()["layers"][0]["loss"]
        1.0
    """

    method: str
    layers: tuple[LayerOutcome, ...]
    notes: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "layers": [attrs.asdict(o) for o in self.layers], "notes": list(self.notes)}


def _geometry_ok(pair: MatchedLayer) -> str | None:
    layer = pair.layer
    if layer.op_type == "Conv" and layer.weight.codes.ndim != 4:
        return f"{layer.name}: only 2-D convolutions are reconstructed"
    return None


def _reconstruct(
    method: str,
    solve: Callable[..., Any],
    float_model: onnx.ModelProto,
    qdq_model: onnx.ModelProto,
    batches: Iterable[Feeds],
    config: AdaRoundConfig | AdaQuantConfig,
    learn_bias: bool,
    quiet: bool,
) -> tuple[onnx.ModelProto, ReconstructionReport]:
    feeds = prepare_batches(batches, config.num_samples or DEFAULT_NUM_SAMPLES)
    pairs, notes = match_float_layers(float_model, qdq_model)
    out = copy_model(qdq_model)
    quantized, reference = IncrementalRunner(feeds), IncrementalRunner(feeds)
    outcomes = []
    for pair in tqdm(pairs, desc=method, unit="layer", disable=quiet):
        layer = pair.layer
        skip = _geometry_ok(pair)
        if skip is not None:
            notes.append(skip)
            continue
        start = time.perf_counter()
        inputs = quantized.concat(out, layer.input_tensor)
        targets = reference.concat(float_model, pair.float_output)
        geometry = layer.geometry((int(inputs.shape[2]), int(inputs.shape[3]))) if layer.op_type == "Conv" else None
        bias = layer.bias.values() if layer.bias is not None else None
        captured = time.perf_counter()
        result = solve(
            pair.float_weight,
            bias,
            layer.weight_qparams_oi(),
            inputs,
            targets,
            config,
            geometry=geometry,
            activation=pair.activation,
            name=layer.name,
            quiet=quiet,
        )
        del inputs, targets
        learned = time.perf_counter()
        codes = np.asarray(result.codes)
        set_initializer(out, layer.weight.codes_name, layer.weight.with_codes(layer.to_oi(codes).copy()).codes)
        if learn_bias and result.bias is not None and not result.fell_back:
            scale = bias_scale(layer)
            if scale is not None:
                write_bias(out, layer, bias_codes(result.bias, scale), GraphIndex(out.graph))
        outcomes.append(
            LayerOutcome(
                layer.name,
                float(result.loss_nearest),
                float(result.loss),
                int(result.iterations),
                bool(result.fell_back),
                round(captured - start, 3),
                round(learned - captured, 3),
            )
        )
    return out, ReconstructionReport(method, tuple(outcomes), tuple(notes))


def apply_adaround_with_report(
    float_model: onnx.ModelProto,
    qdq_model: onnx.ModelProto,
    batches: Iterable[Feeds],
    config: AdaRoundConfig,
    *,
    quiet: bool = False,
) -> tuple[onnx.ModelProto, ReconstructionReport]:
    """:func:`apply_adaround` that also returns the per-layer report."""
    require_torch("AdaRound")
    from quant_algos.adaround import adaround_layer

    return _reconstruct("adaround", adaround_layer, float_model, qdq_model, batches, config, False, quiet)


def apply_adaquant_with_report(
    float_model: onnx.ModelProto,
    qdq_model: onnx.ModelProto,
    batches: Iterable[Feeds],
    config: AdaQuantConfig,
    *,
    quiet: bool = False,
) -> tuple[onnx.ModelProto, ReconstructionReport]:
    """:func:`apply_adaquant` that also returns the per-layer report."""
    require_torch("AdaQuant")
    from quant_algos.adaquant import adaquant_layer

    return _reconstruct("adaquant", adaquant_layer, float_model, qdq_model, batches, config, True, quiet)


def apply_adaround(
    float_model: onnx.ModelProto,
    qdq_model: onnx.ModelProto,
    batches: Iterable[Feeds],
    config: AdaRoundConfig,
    quiet: bool = False,
) -> onnx.ModelProto:
    """A copy of ``qdq_model`` whose int8 weight codes were chosen by AdaRound.

    Args:
        float_model: the float model ``qdq_model`` was written from (same node names).
        qdq_model: standard QDQ model.
        batches: calibration feeds; the first ``config.num_samples`` samples are used.
        config: iterations, batch size, learning rate, regulariser, device, early stop.
        quiet: no progress bars.

    Raises:
        ImportError: PyTorch is not installed (names the ``quant-onnx[torch]`` extra).
    """
    return apply_adaround_with_report(float_model, qdq_model, batches, config, quiet=quiet)[0]


def apply_adaquant(
    float_model: onnx.ModelProto,
    qdq_model: onnx.ModelProto,
    batches: Iterable[Feeds],
    config: AdaQuantConfig,
    quiet: bool = False,
) -> onnx.ModelProto:
    """A copy of ``qdq_model`` whose weight codes and int32 bias codes were learned by
    AdaQuant; arguments as :func:`apply_adaround`."""
    return apply_adaquant_with_report(float_model, qdq_model, batches, config, quiet=quiet)[0]
