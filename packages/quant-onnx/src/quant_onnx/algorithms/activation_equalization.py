"""Activation equalization on a float ONNX model (pre-pass, before calibration): the sites
:func:`quant_algos.activation_equalization.equalization_sites` finds, measured in one pass
(per-channel max ``|x|`` reduced inside onnxruntime) and rescaled so that every channel
reaches the tensor's largest. The float function is unchanged (up to float rounding).

A site is left alone, with a note, where the config's formats would make a scale cost
something: a Conv involved without per-output-channel float-scale weights, or
power-of-two activations (the chains are quantized step by step there).

Example:
    See ``tests/test_algorithms_activation_equalization.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs
import numpy as np
import onnx

from quant_algos.activation_equalization import EqualizationSite, equalization_sites, equalizing_scales
from quant_core.algorithm_config import ActivationEqualizationConfig, samples_to_use
from quant_core.config import QuantConfig
from quant_core.onnx_qdq.graph import GraphIndex, plan_graph
from quant_core.plan.activation_chains import ActivationChains, find_chains
from quant_core.spec import ScaleType
from quant_onnx.algorithms.capture import Feeds, prepare_batches
from quant_onnx.algorithms.channel_scaling import fold_into_producer, insert_mul
from quant_onnx.algorithms.reductions import Reduction, reduce_over
from quant_onnx.graph_edit import copy_model, set_initializer


@attrs.frozen
class EqualizedActivation:
    """One equalized activation: its site, where ``1/s`` (input side) or ``s`` (output
    side) went (``"into:<node>"`` or ``"mul:<new node>"``), and how far apart its channels'
    ranges were (largest max ``|x|`` over the smallest live one)."""

    side: str
    tensor: str
    layer: str
    compensated: str
    spread: float


@attrs.frozen
class ActivationEqualizationReport:
    """What :func:`apply_activation_equalization` did.

    Example:
        >>> ActivationEqualizationReport((), ("no site",)).to_dict()
        {'equalized': [], 'notes': ['no site']}
    """

    equalized: tuple[EqualizedActivation, ...]
    notes: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"equalized": [attrs.asdict(e) for e in self.equalized], "notes": list(self.notes)}


def _free_here(config: QuantConfig, site: EqualizationSite) -> str | None:
    """Why a per-channel scale at ``site`` would cost precision under ``config``, or None."""
    for name in sorted({site.layer, site.fold} - {None}):
        operator = config.for_node(name, "Conv")
        weight = operator.weight if operator is not None else None
        if weight is None or weight.per_channel_axis is None or weight.scale_type is ScaleType.POWER_OF_TWO:
            return f"{name}: weights not per output channel with a float scale"
        output = operator.output if operator is not None else None
        if output is not None and output.scale_type is ScaleType.POWER_OF_TWO:
            return f"{name}: power-of-two activations (activation chains are quantized there)"
    return None


def _chains(model: onnx.ModelProto, index: GraphIndex, config: QuantConfig) -> ActivationChains:
    return find_chains(plan_graph(model, index)) if config.transformer_recipe else ActivationChains()


def apply_activation_equalization_with_report(
    model: onnx.ModelProto,
    batches: Iterable[Feeds],
    algorithm: ActivationEqualizationConfig,
    config: QuantConfig,
) -> tuple[onnx.ModelProto, ActivationEqualizationReport]:
    """A copy of ``model`` (pre-processed float model) with its activations equalized
    (module docstring), and the report."""
    index = GraphIndex(model.graph)
    notes: list[str] = []
    sites = []
    for site in equalization_sites(plan_graph(model, index), _chains(model, index, config)):
        why = _free_here(config, site)
        if why is None:
            sites.append(site)
        else:
            notes.append(f"{site.tensor} ({site.side} of {site.layer}): left alone; {why}")
    out = copy_model(model)
    if not sites:
        return out, ActivationEqualizationReport((), (*notes, "no activation to equalize"))
    weights = {n.name: n.input[1] for n in model.graph.node if n.op_type == "Conv"}
    reductions = []
    for site in sites:
        channels = int(np.asarray(index.constant(weights[site.layer])).shape[0])
        reductions.append(Reduction(site.tensor, "ReduceMax", (0, 2), (0, channels, -1), absolute=True))
    absmax: dict[str, np.ndarray] = {}
    for batch in reduce_over(model, reductions, prepare_batches(batches, samples_to_use(algorithm))):
        for site, (reduced, _shape) in zip(sites, batch, strict=True):
            value = reduced.astype(np.float64)
            absmax[site.tensor] = value if site.tensor not in absmax else np.maximum(absmax[site.tensor], value)
    equalized = []
    for site in sites:
        scales = equalizing_scales(absmax[site.tensor])
        if np.allclose(scales, 1.0):
            continue
        current = GraphIndex(out.graph)  # weights as the sites before left them
        weight = np.asarray(current.constant(weights[site.layer]))
        rank = weight.ndim
        if site.side == "output":
            # The Conv computes y / s; a Mul by s starts the chain that reads y.
            if fold_into_producer(out, current, site.tensor, "conv", rank, 1.0 / scales) is None:
                notes.append(f"{site.tensor} (output of {site.layer}): left alone; its Conv's weights are not its own")
                continue
            compensated = f"mul:{insert_mul(out, GraphIndex(out.graph), site.tensor, 'conv', rank, scales, 'equaliz')}"
        else:
            # The input is divided by s where it is written; filter c takes s_c.
            if site.fold is None:
                compensated = f"mul:{insert_mul(out, current, site.tensor, 'conv', rank, 1.0 / scales, 'equaliz')}"
            elif (folded := fold_into_producer(out, current, site.tensor, "conv", rank, 1.0 / scales)) is not None:
                compensated = f"into:{folded}"
            else:
                notes.append(
                    f"{site.tensor} (input of {site.layer}): left alone; {site.fold}'s weights are not its own"
                )
                continue
            shape = (-1,) + (1,) * (rank - 1)
            set_initializer(out.graph, weights[site.layer], (weight * scales.reshape(shape)).astype(weight.dtype))
        live = absmax[site.tensor][absmax[site.tensor] > 0]
        spread = float(live.max() / live.min()) if live.size else 1.0
        equalized.append(EqualizedActivation(site.side, site.tensor, site.layer, compensated, spread))
    return out, ActivationEqualizationReport(tuple(equalized), tuple(notes))


def apply_activation_equalization(
    model: onnx.ModelProto,
    batches: Iterable[Feeds],
    algorithm: ActivationEqualizationConfig,
    config: QuantConfig,
) -> onnx.ModelProto:
    """:func:`apply_activation_equalization_with_report` without the report."""
    return apply_activation_equalization_with_report(model, batches, algorithm, config)[0]
