"""The layer-by-layer reconstruction loop shared by AdaRound, AdaQuant and GPTQ, on any backend.

For each quantized Conv/Gemm/MatMul, in order: its input as the quantized model computes
it (every earlier layer already updated) and the float model's output of the layer are
streamed batch by batch into a pool of output positions
(:class:`~quant_algos.reconstruction_data.PoolBuilder`: memory is the pool plus one
batch, whatever the calibration count), :func:`~quant_algos.adaround.adaround_pool`,
:func:`~quant_algos.adaquant.adaquant_pool` or :func:`~quant_algos.gptq.gptq_pool` (which
needs no float output) finds the codes (and AdaQuant the bias),
and the runner writes them back. The weight qparams are the calibrated plan's, never
re-derived.

Example:
    See the backends' tests (``test_algorithms*.py``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np

from quant_algos._reconstruction import PoolSettings
from quant_algos.drivers.runner import LayerRunner, QuantLayer, first_samples
from quant_algos.progress import progress_bar
from quant_core.algorithm_config import AdaQuantConfig, AdaRoundConfig, GPTQConfig, samples_to_use
from quant_core.errors import DataError


@attrs.frozen
class LayerOutcome:
    """One layer's result: reconstruction loss with nearest rounding and with the
    learned weights (on the layer's pool), iterations, whether nearest was kept, and
    the seconds spent capturing its data and learning.

    Example:
        >>> LayerOutcome("c", 2.0, 1.0, 100, False).fell_back
        False
    """

    name: str
    loss_nearest: float
    loss: float
    iterations: int
    fell_back: bool
    capture_seconds: float = 0.0
    learn_seconds: float = 0.0


@attrs.frozen
class ReconstructionReport:
    """What :func:`reconstruct_layers` did.

    Example:
        >>> ReconstructionReport("adaround", (LayerOutcome("c", 2.0, 1.0, 100, False),), ()).to_dict()["layers"][0]["loss"]
        1.0
    """

    method: str
    layers: tuple[LayerOutcome, ...]
    notes: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        """The record that goes into a report file. The seconds stay on the objects: two
        runs of one model, data and config must write identical reports."""
        layers = [attrs.asdict(o, filter=lambda field, _: field.name not in _TIMINGS) for o in self.layers]
        return {"method": self.method, "layers": layers, "notes": list(self.notes)}


_TIMINGS = frozenset({"capture_seconds", "learn_seconds"})


def _skip_reason(layer: QuantLayer) -> str | None:
    if layer.is_conv and (layer.float_weight.ndim != 4 or layer.geometry is None):
        return f"{layer.name}: only 2-D convolutions are reconstructed"
    return None


def _batches(
    runner: LayerRunner, layer: QuantLayer, with_targets: bool
) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
    """The layer's quantized inputs, each with the float model's output when asked for."""
    if not with_targets:
        yield from ((inputs, None) for inputs in runner.quantized_inputs(layer))
        return
    targets = runner.float_outputs(layer)
    if layer.bias_added_after and layer.bias is not None:
        # The problem adds the layer's bias to what it computes, so the target has it too: a
        # MatMul's bias that an Add adds after the output would otherwise be a constant error
        # the learned rounding bends every weight to cancel (PP-OCRv4's 6,625-class head:
        # 43% of its codes off nearest, 3.0% -> 15.8% CER).
        bias = np.asarray(layer.bias, np.float32)
        targets = (np.asarray(t) + bias for t in targets)
    yield from zip(runner.quantized_inputs(layer), targets, strict=True)


def reconstruct_layers(
    runner: LayerRunner,
    config: AdaRoundConfig | AdaQuantConfig | GPTQConfig,
    *,
    quiet: bool = False,
    settings: PoolSettings | None = None,
) -> ReconstructionReport:
    """AdaRound (``AdaRoundConfig``), AdaQuant (``AdaQuantConfig``) or GPTQ
    (``GPTQConfig``) over every layer of ``runner``; writes the learned codes (and
    AdaQuant's biases) back through it. AdaRound and AdaQuant need ``quant-algos[torch]``;
    GPTQ reads no float output (it needs only each layer's inputs) and no torch."""
    learn_bias = isinstance(config, AdaQuantConfig)
    with_targets = not isinstance(config, GPTQConfig)
    solve: Any
    if isinstance(config, GPTQConfig):
        from quant_algos.gptq import gptq_pool as solve
    elif learn_bias:
        from quant_algos.adaquant import adaquant_pool as solve
    else:
        from quant_algos.adaround import adaround_pool as solve
    method = config.kind
    batch_size = getattr(config, "batch_size", 1)
    pool_settings = settings or PoolSettings()
    count = min(runner.num_samples, samples_to_use(config))
    outcomes, notes = [], []
    layers = runner.layers()
    with progress_bar(total=len(layers), desc=method, unit="layer", quiet=quiet) as bar:
        for layer in layers:
            bar.update(1)
            reason = _skip_reason(layer)
            if reason is not None:
                notes.append(reason)
                continue
            start = time.perf_counter()
            builder = pool_settings.builder(
                layer.float_weight.shape, layer.geometry, count, with_targets=with_targets, batch_size=batch_size
            )
            try:
                for inputs, targets in first_samples(_batches(runner, layer, with_targets), count):
                    builder.add(inputs, targets)
                pool = builder.pool()
            except DataError as error:
                raise DataError(f"{method}: layer {layer.name!r}: {error}") from None
            captured = time.perf_counter()
            # AdaQuant learns a bias only where one can be written back: codes learned with a
            # bias the model then does not get can be worse than nearest rounding.
            extra = {"learn_bias": layer.bias_allowed} if learn_bias else {}
            result = solve(
                layer.float_weight,
                layer.bias,
                layer.weight_qparams,
                pool,
                config,  # type: ignore[arg-type]
                activation=layer.activation,
                name=layer.name,
                quiet=quiet,
                settings=pool_settings,
                **extra,
            )
            del pool, builder
            learned = time.perf_counter()
            runner.set_weight_codes(layer, result.codes)
            if learn_bias and result.bias is not None and not result.fell_back and layer.bias_allowed:
                note = runner.set_bias(layer, result.bias)
                if note is not None:
                    notes.append(f"{layer.name}: {note}")
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
    return ReconstructionReport(method, tuple(outcomes), tuple(notes))
