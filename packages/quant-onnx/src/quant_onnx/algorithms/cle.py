"""Cross-layer equalization of a float ONNX model (pre-pass, before calibration).

Finds conv->conv and conv->depthwise->conv chains (:mod:`chains`), equalizes them with
``quant_algos.cle.equalize_chains`` and writes the rescaled weights and biases into a
new model. With ``replace_relu6_with_relu`` the Clip(0, 6) nodes inside chains become
Relu first, as Quark's ``ReplaceClip6Relu`` does, but only those that the calibration
batches show clip nothing (no input above 6, ``RELU6_CLIPPED_FRACTION``): elsewhere the replacement changes the float function. Unchecked, it takes
EfficientNet-Lite0 (ReLU6 after every conv) from 1.0 to 0.23 top-1 agreement with
itself, before any quantization. Without calibration batches every Clip(0, 6) in a chain
is replaced and the report says it was unchecked. High-bias absorption needs each first
layer's per-channel pre-activation mean and standard deviation; they are measured on
the calibration batches when given (BatchNorm is already folded), else absorption is
skipped and the report says so.

Example:
    >>> import numpy as np
    >>> from onnx import TensorProto, helper, numpy_helper
    >>> from quant_core.algorithm_config import CLEConfig
    >>> inits = [numpy_helper.from_array(np.array([[[[1.0]]], [[[8.0]]]], np.float32), "w1"),
    ...          numpy_helper.from_array(np.array([[[[2.0]], [[2.0]]]], np.float32), "w2")]
    >>> nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], name="c1"), helper.make_node("Relu", ["a"], ["r"], name="r"),
    ...          helper.make_node("Conv", ["r", "w2"], ["y"], name="c2")]
    >>> g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 2, 2])],
    ...                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 2, 2])], inits)
    >>> model, report = apply_cle(helper.make_model(g), CLEConfig())
    >>> report.chains, [round(float(v), 4) for v in numpy_helper.to_array(model.graph.initializer[0]).ravel()]
    ((('c1', 'c2'),), [1.4142, 4.0])
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import onnx
from onnx import helper

from quant_algos.cle import equalize_chains, expected_min
from quant_core.algorithm_config import CLEConfig
from quant_onnx.algorithms._graph import copy_model, set_initializer
from quant_onnx.algorithms.capture import Feeds, TensorCapture, prepare_batches
from quant_onnx.algorithms.chains import ChainSearch, LayerRef, find_chains
from quant_onnx.graph import GraphIndex

# Outputs captured per onnxruntime run when measuring statistics: bounds the memory of
# one batch's intermediate tensors on wide networks.
_OUTPUTS_PER_RUN = 16
#: A Clip(0, 6) may become Relu when at most this fraction of its calibration inputs exceeds 6:
#: even 1e-4 moved 0.75% of EfficientNet-Lite0's top-1 predictions.
RELU6_CLIPPED_FRACTION = 0.0


@attrs.frozen
class CLEReport:
    """What :func:`apply_cle` did.

    Attributes:
        chains: equalized chains (node names; pairs and depthwise triples).
        replaced_relu6: Clip(0, 6) nodes replaced by Relu (these change the float function).
        absorbed: first layers whose high bias moved into the next layer.
        steps: equalization sweeps done; converged / max_change as in quant_algos.
        notes: what was skipped and why.

    Example:
        >>> CLEReport((("a", "b"),), (), (), 1, True, 0.0, ()).to_dict()["chains"]
        [['a', 'b']]
    """

    chains: tuple[tuple[str, ...], ...]
    replaced_relu6: tuple[str, ...]
    absorbed: tuple[str, ...]
    steps: int
    converged: bool
    max_change: float
    notes: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (for the quantization report)."""
        return {
            "chains": [list(c) for c in self.chains],
            "replaced_relu6": list(self.replaced_relu6),
            "absorbed": list(self.absorbed),
            "steps": self.steps,
            "converged": self.converged,
            "max_change": self.max_change,
            "notes": list(self.notes),
        }


def _einsum_spec(ndim: int, axis: int) -> str:
    letters = "abcdefghij"[:ndim]
    return f"{letters},{letters}->{letters[axis]}"


class ChannelMoments:
    """Streaming per-channel mean and standard deviation along ``axis``.

    Example:
        >>> import numpy as np
        >>> m = ChannelMoments(axis=1)
        >>> m.update(np.array([[0.0, 1.0], [2.0, 1.0]]))
        >>> m.mean().tolist(), m.std().tolist()
        ([1.0, 1.0], [1.0, 0.0])
    """

    def __init__(self, axis: int = 1) -> None:
        self.axis = axis
        self._sum: np.ndarray | None = None
        self._sq: np.ndarray | None = None
        self._count = 0

    def update(self, x: np.ndarray) -> None:
        a = np.asarray(x)
        axis = self.axis % a.ndim
        others = tuple(i for i in range(a.ndim) if i != axis)
        # Sums per channel without moving the (large) tensor around; squares in float64.
        s = a.sum(axis=others, dtype=np.float64)
        sq = np.einsum(_einsum_spec(a.ndim, axis), a, a, dtype=np.float64)
        self._sum = s if self._sum is None else self._sum + s
        self._sq = sq if self._sq is None else self._sq + sq
        self._count += a.size // max(a.shape[axis], 1)

    def mean(self) -> np.ndarray:
        if self._sum is None or not self._count:
            raise ValueError("ChannelMoments: no values were accumulated")
        return self._sum / self._count

    def std(self) -> np.ndarray:
        assert self._sq is not None
        var = self._sq / self._count - np.square(self.mean())
        return np.sqrt(np.maximum(var, 0.0))


def _pre_activation_stats(
    model: onnx.ModelProto, refs: Sequence[LayerRef], batches: Sequence[Feeds]
) -> dict[str, np.ndarray]:
    """``mean - 3 std`` per output channel of each layer's output (quant_algos.expected_min)."""
    out: dict[str, np.ndarray] = {}
    for start in range(0, len(refs), _OUTPUTS_PER_RUN):
        chunk = refs[start : start + _OUTPUTS_PER_RUN]
        tensors = [ref.node.output[0] for ref in chunk]
        moments = {
            t: ChannelMoments(axis=1 if ref.family == "conv" else -1) for t, ref in zip(tensors, chunk, strict=True)
        }
        for values in TensorCapture(model, tensors).iterate(batches):
            for tensor, value in values.items():
                moments[tensor].update(value)
        for tensor, ref in zip(tensors, chunk, strict=True):
            out[ref.node.name] = expected_min(moments[tensor].mean(), moments[tensor].std())
    return out


def _clipped_fractions(model: onnx.ModelProto, clips: Sequence[str], batches: Sequence[Feeds]) -> dict[str, float]:
    """Fraction of each Clip(0, 6) node's input values above 6 over ``batches``."""
    inputs = {node.name: node.input[0] for node in model.graph.node if node.name in set(clips)}
    above: dict[str, int] = dict.fromkeys(inputs, 0)
    total: dict[str, int] = dict.fromkeys(inputs, 0)
    names = sorted(inputs)
    for start in range(0, len(names), _OUTPUTS_PER_RUN):
        chunk = names[start : start + _OUTPUTS_PER_RUN]
        for values in TensorCapture(model, [inputs[n] for n in chunk]).iterate(batches):
            for name in chunk:
                value = values[inputs[name]]
                above[name] += int(np.count_nonzero(value > 6.0))
                total[name] += int(value.size)
    return {name: above[name] / max(total[name], 1) for name in names}


def _replace_with_relu(model: onnx.ModelProto, names: set[str]) -> None:
    for i, node in enumerate(model.graph.node):
        if node.name in names:
            model.graph.node[i].CopyFrom(helper.make_node("Relu", [node.input[0]], list(node.output), name=node.name))


def _write_layers(model: onnx.ModelProto, search: ChainSearch, new_layers: Mapping[str, Any]) -> None:
    index = GraphIndex(model.graph)
    nodes = {node.name: node for node in model.graph.node}
    for name, layer in new_layers.items():
        ref = search.layers[name]
        weight = layer.weight.T if ref.transposed else layer.weight
        set_initializer(model, ref.weight_name, np.ascontiguousarray(weight, np.float32))
        if layer.bias is None:
            continue
        if ref.bias_name is not None:
            set_initializer(model, ref.bias_name, np.asarray(layer.bias, np.float32))
        else:  # high-bias absorption gave a bias-free layer a bias
            bias_name = index.unique_name(f"{name}_bias")
            set_initializer(model, bias_name, np.asarray(layer.bias, np.float32))
            node = nodes[name]
            while len(node.input) < 3:
                node.input.append("")
            node.input[2] = bias_name


def apply_cle(
    model: onnx.ModelProto,
    config: CLEConfig,
    batches: Iterable[Feeds] | None = None,
    *,
    num_samples: int | None = 64,
) -> tuple[onnx.ModelProto, CLEReport]:
    """Cross-layer equalization of ``model`` (pre-processed float model: BatchNorm
    folded, weights as initializers). Returns a new model and a :class:`CLEReport`;
    the input is not modified.

    Args:
        model: the float model.
        config: steps, tolerance, Relu6 replacement, bias in scale, high-bias absorption.
        batches: calibration feeds, used only for high-bias absorption (first
            ``num_samples`` samples); without them absorption is skipped.
        num_samples: samples used to measure the pre-activation statistics.
    """
    notes: list[str] = []
    prepared = None if batches is None else prepare_batches(batches, num_samples)
    replace: bool | set[str] = config.replace_relu6_with_relu
    if config.replace_relu6_with_relu:
        candidates = sorted({n for link in find_chains(model, replace_relu6=True).links.values() for n in link.relu6})
        if prepared is None:
            notes.append("Clip(0, 6) replaced by Relu unchecked: no calibration data to check what they clip")
        elif candidates:
            fractions = _clipped_fractions(model, candidates, prepared)
            replace = {name for name, f in fractions.items() if f <= RELU6_CLIPPED_FRACTION}
            kept = sorted((f, name) for name, f in fractions.items() if f > RELU6_CLIPPED_FRACTION)
            if kept:
                worst = ", ".join(f"{name} ({f:.2%})" for f, name in kept[::-1][:5])
                notes.append(
                    f"kept {len(kept)} Clip(0, 6) of {len(candidates)}: they clip calibration inputs above 6 "
                    f"(Relu would change the float function), e.g. {worst}"
                )
    search = find_chains(model, replace_relu6=replace)
    if not search.chains:
        notes.append("no equalizable chains found")
        return copy_model(model), CLEReport((), (), (), 0, True, 0.0, tuple(notes))
    in_chains = {name for chain in search.chains for name in chain}
    expected_mins: dict[str, np.ndarray] = {}
    if config.absorb_high_bias:
        firsts = [
            search.layers[link.first]
            for link in search.links.values()
            if link.absorbable and link.first in in_chains and search.layers[link.first].layer.bias is not None
        ]
        if batches is None:
            notes.append("high-bias absorption skipped: no calibration data given")
        elif firsts:
            assert prepared is not None
            expected_mins = _pre_activation_stats(model, firsts, prepared)
    layers = {name: search.layers[name].layer for name in in_chains}
    result = equalize_chains(layers, search.chains, config, expected_mins or None)
    out = copy_model(model)
    replaced = sorted({name for chain in search.chains for a in chain[:-1] for name in search.links[a].relu6})
    _replace_with_relu(out, set(replaced))
    changed = {name: layer for name, layer in result.layers.items() if layer is not layers[name]}
    _write_layers(out, search, changed)
    absorbed = tuple(name for name, c in result.absorbed.items() if np.any(np.asarray(c) > 0))
    report = CLEReport(
        chains=tuple(search.chains),
        replaced_relu6=tuple(replaced),
        absorbed=absorbed,
        steps=result.steps,
        converged=bool(result.converged),
        max_change=float(result.max_change),
        notes=tuple(notes),
    )
    return out, report
