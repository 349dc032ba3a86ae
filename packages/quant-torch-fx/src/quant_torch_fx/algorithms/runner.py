"""The torch :class:`~quant_algos.drivers.runner.LayerRunner`: a calibrated graph
module (PTQ, or QAT with batch norm folded) is the quantized model, a copy of it with
every quantizer passing through is the float model; the layer-wise drivers of ``quant_algos`` (AdaRound, AdaQuant, bias
correction) walk them and write back through it.

Everything a driver needs to quantize comes from the calibrated graph: weight qparams
from its weight quantizers (:func:`quant_core.plan.plan_weight_qparams` set them), the
bias rule's inputs from the plan's bias slots and the activation quantizers. Layer inputs
and outputs are read by walking each model node by node over the held batches
(:class:`~quant_torch_fx.algorithms.incremental.IncrementalGraphRunner`: every node runs
once per model for a whole walk) on the model's device; they become numpy only where the
drivers' protocol takes them.

Learned weight codes are written as the values they stand for, and their qparams are
pinned (:attr:`~quant_torch_fx.prepare.QuantGraphInfo.fixed_weights`): freezing keeps
them rather than measuring the rewritten weight again. A corrected bias is written as
the values its ``quant_core.bias`` encoding stands for, so the fake-quantized model
computes what the frozen one will.

Example:
    See ``tests/test_algorithms.py``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.fx import GraphModule, Node

from quant_algos.bias_correction import InputMeanAccumulator
from quant_algos.drivers.layers import describe_layer
from quant_algos.drivers.live_store import LIVE_MEMORY_BYTES
from quant_algos.drivers.runner import QuantLayer, first_samples
from quant_core.bias import accumulation_headroom, encode_bias
from quant_core.errors import ConfigError
from quant_core.qparams import QParams, dequantize, quantize
from quant_torch_fx.algorithms.edit import bias_argument, bias_node, set_bias, set_constant
from quant_torch_fx.algorithms.incremental import IncrementalGraphRunner
from quant_torch_fx.algorithms.probe import Batch, float_mode, sample_count
from quant_torch_fx.aten_map import map_node
from quant_torch_fx.capture import copy_captured
from quant_torch_fx.graph_passes import get_attr_value
from quant_torch_fx.modules import ConvBn
from quant_torch_fx.prepare import activation_qparams_lookup, graph_info, weight_quantizers


def _oi(qp: QParams, transposed: bool) -> QParams:
    return qp.evolve(axis=1 - qp.axis) if transposed and qp.axis is not None else qp


def samples_first(values: np.ndarray, samples: int) -> np.ndarray:
    """A layer's input or output of one batch of ``samples`` with the samples on axis 0, as
    the drivers count them: a sequence-first tensor ``[tokens, batch, features]`` (what
    ``nn.MultiheadAttention`` projects) has them on axis 1, and its output projection reads
    ``[tokens * batch, features]``, which is split into ``samples`` groups of rows.

    Example:
        >>> samples_first(np.zeros((6, 8, 16)), 8).shape, samples_first(np.zeros((48, 16)), 8).shape
        ((8, 6, 16), (8, 6, 16))
    """
    if values.ndim < 2 or values.shape[0] == samples:
        return values
    axis = next((i for i in range(1, values.ndim - 1) if values.shape[i] == samples), None)
    if axis is not None:
        return np.moveaxis(values, axis, 0)
    if samples and values.shape[0] % samples == 0:
        return values.reshape(samples, -1, *values.shape[1:])
    return values


class TorchLayerRunner:
    """A :class:`~quant_algos.drivers.runner.LayerRunner` over a calibrated graph
    module ``gm`` (PTQ, or QAT with batch norm folded; changed in place) on held
    ``batches`` (model inputs on its device). ``float_gm``: the float reference, a
    :func:`~quant_torch_fx.capture.copy_captured` of ``gm`` made before any pass wrote
    into it (default: a copy of ``gm`` now).

    Example:
        >>> TorchLayerRunner.__name__
        'TorchLayerRunner'
    """

    def __init__(
        self,
        gm: GraphModule,
        batches: Sequence[Batch],
        *,
        memory_budget: int = LIVE_MEMORY_BYTES,
        float_gm: GraphModule | None = None,
    ) -> None:
        self.gm = gm
        self.info = graph_info(gm)
        simulated_batch_norm = any(isinstance(m, ConvBn) for m in gm.modules())
        if self.info.frozen or simulated_batch_norm:
            raise ConfigError(
                "algorithms: AdaRound, AdaQuant and bias correction run on a calibrated model before freezing: "
                "PTQ, or QAT with batch norm folded (prepare_qat(fold_batch_norm=True))"
            )
        # The float reference keeps the weights the walk rewrites. After an earlier pass wrote
        # learned weights into ``gm``, the caller passes the copy it made before that pass:
        # a copy of ``gm`` then would hold the learned weights as its "float" ones.
        self.float_gm = copy_captured(gm) if float_gm is None else float_gm
        self.batches = list(batches)
        self._count = sum(sample_count(b) for b in self.batches)
        # Each walk holds at most ``memory_budget`` bytes of live tensors; the rest wait on disk.
        self._quantized = IncrementalGraphRunner(gm, self.batches, memory_budget=memory_budget)
        self._reference = IncrementalGraphRunner(
            self.float_gm, self.batches, memory_budget=memory_budget, context=lambda: float_mode(self.float_gm)
        )
        self.notes: list[str] = []
        self._nodes = {node.name: node for node in gm.graph.nodes}
        self._quantizers = dict(weight_quantizers(gm))
        self._act = activation_qparams_lookup(gm)
        self._transposed: dict[str, bool] = {}
        self._layers = self._find_layers()

    @property
    def num_samples(self) -> int:
        return self._count

    def layers(self) -> Sequence[QuantLayer]:
        return self._layers

    # --- discovery ---------------------------------------------------------------------
    def _find_layers(self) -> list[QuantLayer]:
        by_fx = {fx: name for name, fx in self.info.weighted.items() if name in self._quantizers}
        found = [(by_fx[node.name], node) for node in self.gm.graph.nodes if node.name in by_fx]
        # A module called twice reads one weight (and bias) in two layers: codes or a bias
        # learned for one would be overwritten by the other's, so neither is reconstructed.
        readers: dict[str, list[str]] = {}
        for name, node in found:
            weight = self._weight_node(node)
            for param in (weight, bias_node(node)):
                if param is not None:
                    readers.setdefault(str(param.target), []).append(name)
        layers = []
        for name, node in found:
            shared = sorted({other for names in readers.values() if name in names for other in names} - {name})
            if shared:
                self.notes.append(f"{name}: weight shared with {', '.join(shared)} (a module called twice); left alone")
                continue
            layer = self._describe(name, node)
            if layer is not None:
                layers.append(layer)
        return layers

    def _describe(self, name: str, node: Node) -> QuantLayer | None:
        slot = self.info.plan.weight_of(name)
        assert slot is not None
        weight_node = self._weight_node(node)
        if slot.op_type not in ("Conv", "Gemm", "MatMul"):
            self.notes.append(f"{name}: {slot.op_type} layers are not reconstructed or corrected")
            return None
        if weight_node is None:
            self.notes.append(f"{name}: weight is not a tensor of the graph")
            return None
        weight = get_attr_value(self.float_gm, weight_node).detach().float().cpu().numpy()
        transposed = name in self.info.transposed_weights
        if slot.op_type == "MatMul" and weight.ndim != 2:
            self.notes.append(f"{name}: MatMul with a rank-{weight.ndim} weight is left alone")
            return None
        if bias_argument(node) is not None and bias_node(node) is None:
            self.notes.append(f"{name}: its bias is computed in the graph (not a constant); the layer is left alone")
            return None
        float_weight = np.ascontiguousarray(weight.T if transposed else weight, np.float32)
        bias_slot = self.info.plan.bias_of(name)
        input_quantized = bias_slot is not None and self._act(name, bias_slot.input_tensor) is not None
        bias = bias_node(node)
        mapped = map_node(node)
        self._transposed[name] = transposed
        return describe_layer(
            name,
            slot.op_type,
            {} if mapped is None else mapped.attributes,
            float_weight,
            _oi(self._quantizers[name].current_qparams(), transposed),
            None if bias is None else get_attr_value(self.gm, bias).detach().float().cpu().numpy().reshape(-1),
            self.info.layer_activations.get(name),
            input_quantized=input_quantized,
        )

    def _weight_node(self, node: Node) -> Node | None:
        """The ``get_attr`` behind the weight quantizer's call."""
        call = node.args[1] if len(node.args) > 1 else None
        if isinstance(call, Node) and call.op == "call_module" and call.args and isinstance(call.args[0], Node):
            call = call.args[0]
        return call if isinstance(call, Node) and call.op == "get_attr" else None

    # --- data ----------------------------------------------------------------------------
    def _fx(self, layer: QuantLayer) -> Node:
        return self._nodes[self.info.weighted[layer.name]]

    def _run(self, walk: IncrementalGraphRunner, name: str, *, commit: bool = True) -> Iterator[np.ndarray]:
        counts = (sample_count(b) for b in self.batches)  # the walk computes batch by batch
        for (value,), count in zip(walk.compute([name], commit=commit), counts, strict=False):
            yield samples_first(value.detach().float().cpu().numpy(), count)

    def close(self) -> None:
        """Delete the live tensors the walks left on disk."""
        self._quantized.close()
        self._reference.close()

    def quantized_inputs(self, layer: QuantLayer) -> Iterator[np.ndarray]:
        source = self._fx(layer).args[0]
        assert isinstance(source, Node)
        yield from self._run(self._quantized, source.name)

    def quantized_outputs(self, layer: QuantLayer) -> Iterator[np.ndarray]:
        yield from self._run(self._quantized, self._fx(layer).name, commit=False)

    def float_outputs(self, layer: QuantLayer) -> Iterator[np.ndarray]:
        yield from self._run(self._reference, self._fx(layer).name)

    def float_input_means(self, layers: Sequence[QuantLayer], count: int) -> dict[str, np.ndarray]:
        means = {}
        for layer in layers:
            # Every quantizer of the float copy passes through: the layer's input node there
            # holds the float model's input.
            source = self._fx(layer).args[0]
            assert isinstance(source, Node)
            acc = InputMeanAccumulator(layer.is_conv)
            for (inputs,) in first_samples(((x,) for x in self._run(self._reference, source.name)), count):
                acc.update(inputs)
            means[layer.name] = acc.mean()
        return means

    def quantized_weight(self, layer: QuantLayer) -> np.ndarray:
        weight = self._weight_node(self._fx(layer))
        assert weight is not None
        values = get_attr_value(self.gm, weight).detach().float().cpu().numpy()
        values = values.T if self._transposed[layer.name] else values
        return dequantize(quantize(values, layer.weight_qparams), layer.weight_qparams)

    # --- write back ----------------------------------------------------------------------
    def set_weight_codes(self, layer: QuantLayer, codes: np.ndarray) -> None:
        fq = self._quantizers[layer.name]
        qp = fq.current_qparams()
        values = dequantize(np.asarray(codes), layer.weight_qparams)
        stored = values.T if self._transposed[layer.name] else values
        weight = self._weight_node(self._fx(layer))
        assert weight is not None
        set_constant(self.gm, weight.name, torch.from_numpy(np.ascontiguousarray(stored, np.float32)))
        self.info.fixed_weights[layer.name] = qp

    def set_bias(self, layer: QuantLayer, values: np.ndarray) -> str | None:
        slot = self.info.plan.bias_of(layer.name)
        input_qp = None if slot is None else self._act(layer.name, slot.input_tensor)
        if slot is None or input_qp is None:
            return "no bias: the layer's input is not quantized"
        flat = np.asarray(values, np.float32).reshape(-1)
        weight_qp = self._quantizers[layer.name].current_qparams()
        # The new bias must leave the int32 accumulator room for the layer's products.
        headroom = accumulation_headroom(layer.float_weight.shape, flat.size, input_qp, weight_qp)
        encoded = encode_bias(
            flat, input_qp.scale, weight_qp, slot.spec, integer_kernel=slot.integer_kernel, headroom=headroom
        )
        stored = encoded.values() if encoded.codes is not None else flat
        node = self._fx(layer)
        had_bias = bias_node(node) is not None
        name = set_bias(self.gm, node, torch.from_numpy(np.asarray(stored, np.float32).copy()))
        if not had_bias:
            self.info.add_bias(layer.name, name)
            self._nodes = {n.name: n for n in self.gm.graph.nodes}
        return None if encoded.note is None else encoded.note
