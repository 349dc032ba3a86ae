"""The NPU conversions of :mod:`quant_core.conversions` as ONNX graph edits, for both
of their callers: quant-onnx converts a float graph before calibration
(``quant_onnx.pipeline.preprocess.npu_conversions``, ``QuantConfig.npu_conversions``) and
``quant_npu.legalize`` converts a calibrated QDQ graph for a target that cannot run a node.

:class:`OnnxConversions` holds the edits on a float graph: Sigmoid and SiLU become the
device's HardSigmoid, HardSwish its ``x * HardSigmoid(x)``, ConvTranspose a zero insertion
and a Conv... A QDQ caller overrides the hooks that differ there (a new intermediate tensor
gets a Q/DQ pair, a new constant operand is an integer constant, a ConvTranspose weight is
integer codes). Which nodes a rule matches, and the constants, are
:mod:`quant_core.conversions`'; this module only edits the graph.

Example:
    >>> import numpy as np
    >>> from onnx import TensorProto, helper
    >>> from quant_core.conversions import Match
    >>> nodes = [helper.make_node("Tanh", ["x"], ["y"], name="t")]
    >>> g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
    ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    >>> converter = OnnxConversions(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]))
    >>> converter.apply(Match("tanh", "t"))
    True
    >>> converter.done[0].line, [n.op_type for n in converter.graph.node]
    ('t (Tanh) -> Mul + Clip [tanh]', ['Mul', 'Clip'])
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import numpy as np
import onnx
from onnx import helper, numpy_helper

from quant_core.conversions import (
    DEVICE_HARD_SIGMOID_ALPHA,
    DEVICE_HARD_SIGMOID_BETA,
    GELU_SIGMOID_SCALE,
    GLOBAL_POOL_MAX_ELEMENTS,
    SIGMOID_TANH_OFFSET,
    SIGMOID_TANH_SCALE,
    TANH_SLOPE,
    ConvTransposeAsConv,
    Match,
    conv_weight,
    pool_split,
)
from quant_core.errors import ModelError
from quant_core.onnx_qdq.graph import Dim, GraphIndex


@attrs.frozen
class Converted:
    """One node rewritten: by which rule, into which op types.

    Example:
        >>> Converted("silu", "sig", "Sigmoid", ("HardSigmoid",)).line
        'sig (Sigmoid) -> HardSigmoid [silu]'
    """

    rule: str
    node: str
    op_type: str
    result: tuple[str, ...]

    @property
    def line(self) -> str:
        return f"{self.node} ({self.op_type}) -> {' + '.join(self.result)} [{self.rule}]"


class OnnxConversions:
    """Applies conversion matches to ``model`` in place (callers pass their own copy).
    ``rules``: the rules in force, where one rule's result is another's input (a ReduceMean
    made a GlobalAveragePool is split by ``global_pool`` too: matches are found once, on the
    graph before any edit)."""

    def __init__(self, model: onnx.ModelProto, rules: Iterable[str] = ()) -> None:
        self.model = model
        self.rules = frozenset(rules)
        self.graph = model.graph
        self.index = GraphIndex(model.graph)
        self.done: list[Converted] = []
        self.notes: list[str] = []

    # ------------------------------------------------------------------ hooks
    def edge(self, tensor: str, source: str, role: str) -> str:
        """A new intermediate tensor ``tensor`` (computed from ``source``; ``role`` says
        what it holds: ``hard_sigmoid``, ``tanh``, ``scaled``, ``halved``, ``moved``); returns the name its
        readers read. Float graph: the tensor itself."""
        return tensor

    def operand(self, prefix: str, value: float) -> str:
        """A new constant Mul operand."""
        return self.constant(prefix, np.asarray(value, np.float32))

    def shape(self, tensor: str) -> list[Dim] | None:
        """The shape of ``tensor`` as far as it is known."""
        return self.index.shape(tensor)

    def conv_weight(self, node: onnx.NodeProto, group: int) -> str | None:
        """The equivalent Conv's weight input for a ConvTranspose (None: cannot)."""
        weight = self.index.constant(node.input[1])
        if weight is None:
            return None
        return self.constant(f"{node.input[1]}_conv", conv_weight(np.asarray(weight), group))

    # ------------------------------------------------------------------ helpers
    def constant(self, prefix: str, value: np.ndarray) -> str:
        name = self.index.unique_name(prefix)
        self.graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def tensor(self, prefix: str) -> str:
        return self.index.unique_name(prefix)

    def node_named(self, name: str) -> onnx.NodeProto:
        for node in self.graph.node:
            if node.name == name:
                return node
        raise ModelError(f"node {name!r}: not found in the graph")

    def remove(self, nodes: Sequence[onnx.NodeProto]) -> None:
        """Drop ``nodes`` (a replaced pattern's other nodes)."""
        gone = {id(n) for n in nodes}
        kept = [n for n in self.graph.node if id(n) not in gone]
        del self.graph.node[:]
        self.graph.node.extend(kept)

    def replace(self, node: onnx.NodeProto, new: Sequence[onnx.NodeProto]) -> None:
        """``new`` in ``node``'s place (graph order stays topological)."""
        nodes = list(self.graph.node)
        position = next(i for i, n in enumerate(nodes) if n is node)
        del self.graph.node[:]
        self.graph.node.extend([*nodes[:position], *new, *nodes[position + 1 :]])

    @staticmethod
    def hard_sigmoid(inputs: list[str], outputs: list[str], name: str) -> onnx.NodeProto:
        return helper.make_node(
            "HardSigmoid", inputs, outputs, name=name, alpha=DEVICE_HARD_SIGMOID_ALPHA, beta=DEVICE_HARD_SIGMOID_BETA
        )

    # ------------------------------------------------------------------ rules
    def apply(self, match: Match) -> bool:
        node = self.node_named(match.node)
        handlers: dict[str, Callable[[onnx.NodeProto, Match], tuple[str, ...] | None]] = {
            "silu": self._to_hard_sigmoid,
            "sigmoid": self._to_hard_sigmoid,
            "hard_sigmoid": self._to_hard_sigmoid,
            "sigmoid_tanh": self._sigmoid_tanh,
            "hard_swish": self._hard_swish,
            "tanh": self._tanh,
            "gelu": self._gelu,
            "conv_transpose": self._conv_transpose,
            "split": self._split,
            "reduce_mean": self._global_pool,
            "global_pool": self._split_global_pool,
        }
        op_type = node.op_type
        result = handlers[match.rule](node, match)
        if result is None:
            return False
        self.done.append(Converted(match.rule, match.node, op_type, result))
        return True

    def _to_hard_sigmoid(self, node: onnx.NodeProto, _match: Match) -> tuple[str, ...]:
        self.replace(node, [self.hard_sigmoid(list(node.input[:1]), list(node.output[:1]), node.name)])
        return ("HardSigmoid",)

    def _sigmoid_tanh(self, node: onnx.NodeProto, _match: Match) -> tuple[str, ...]:
        x, y = node.input[0], node.output[0]
        halved, tanh, scaled = self.tensor(f"{y}_halved"), self.tensor(f"{y}_tanh"), self.tensor(f"{y}_tanh_halved")
        first = helper.make_node(
            "Mul",
            [x, self.operand(f"{node.name}_scale", SIGMOID_TANH_SCALE)],
            [halved],
            name=self.tensor(f"{node.name}_halve"),
        )
        tanh_node = helper.make_node(
            "Tanh", [self.edge(halved, x, "halved")], [tanh], name=self.tensor(f"{node.name}_tanh")
        )
        second = helper.make_node(
            "Mul",
            [self.edge(tanh, halved, "tanh"), self.operand(f"{node.name}_tanh_scale", SIGMOID_TANH_SCALE)],
            [scaled],
            name=self.tensor(f"{node.name}_tanh_halve"),
        )
        offset = self.operand(f"{node.name}_offset", SIGMOID_TANH_OFFSET)
        add = helper.make_node("Add", [self.edge(scaled, tanh, "halved"), offset], [y], name=node.name)
        self.replace(node, [first, tanh_node, second, add])
        return ("Mul", "Tanh", "Mul", "Add")

    def _hard_swish(self, node: onnx.NodeProto, _match: Match) -> tuple[str, ...]:
        x, y = node.input[0], node.output[0]
        gate = self.tensor(f"{y}_hard_sigmoid")
        sigmoid = self.hard_sigmoid([x], [gate], self.tensor(f"{node.name}_hard_sigmoid"))
        mul = helper.make_node("Mul", [x, self.edge(gate, x, "hard_sigmoid")], [y], name=node.name)
        self.replace(node, [sigmoid, mul])
        return ("HardSigmoid", "Mul")

    def _tanh(self, node: onnx.NodeProto, _match: Match) -> tuple[str, ...]:
        x, y = node.input[0], node.output[0]
        scaled = self.tensor(f"{y}_scaled")
        mul = helper.make_node(
            "Mul", [x, self.operand(f"{node.name}_slope", TANH_SLOPE)], [scaled], name=self.tensor(f"{node.name}_scale")
        )
        bounds = [
            self.constant(f"{node.name}_{k}", np.asarray(v, np.float32)) for k, v in (("min", -1.0), ("max", 1.0))
        ]
        clip = helper.make_node("Clip", [self.edge(scaled, x, "scaled"), *bounds], [y], name=node.name)
        self.replace(node, [mul, clip])
        return ("Mul", "Clip")

    def _gelu(self, node: onnx.NodeProto, match: Match) -> tuple[str, ...]:
        x, y = node.input[0], node.output[0]
        if node.op_type == "Erf":  # the erf form: x from its first node, y from its last
            chain = [self.node_named(name) for name in match.related]
            x, y = chain[0].input[0], chain[-1].output[0]
            self.remove(chain)
            node = self.node_named(match.node)  # the graph's nodes were copied
        scaled, gate = self.tensor(f"{y}_scaled"), self.tensor(f"{y}_hard_sigmoid")
        operand = self.operand(f"{node.name}_scale", GELU_SIGMOID_SCALE)
        mul = helper.make_node("Mul", [x, operand], [scaled], name=self.tensor(f"{node.name}_scale"))
        sigmoid = self.hard_sigmoid([self.edge(scaled, x, "scaled")], [gate], self.tensor(f"{node.name}_hard_sigmoid"))
        out = helper.make_node("Mul", [x, self.edge(gate, scaled, "hard_sigmoid")], [y], name=node.name)
        self.replace(node, [mul, sigmoid, out])
        return ("Mul", "HardSigmoid", "Mul")

    def _global_pool(self, node: onnx.NodeProto, match: Match) -> tuple[str, ...]:
        pool = helper.make_node("GlobalAveragePool", [node.input[0]], [node.output[0]], name=node.name)
        self.replace(node, [pool])
        # the graph holds a copy of ``pool``: split that one
        split = self._split_global_pool(self.node_named(node.name), match) if "global_pool" in self.rules else None
        return split or ("GlobalAveragePool",)

    def _split_global_pool(self, node: onnx.NodeProto, _match: Match) -> tuple[str, ...] | None:
        shape = self.shape(node.input[0])
        if shape is None or len(shape) != 4 or not all(isinstance(d, int) for d in shape[2:]):
            return None
        height, width = int(shape[2]), int(shape[3])  # type: ignore[arg-type]
        if height * width <= GLOBAL_POOL_MAX_ELEMENTS:
            return None  # one stage on the device
        (kh, second_h), (kw, second_w) = pool_split(height), pool_split(width)
        if kh * kw == 1 or second_h * second_w > GLOBAL_POOL_MAX_ELEMENTS:
            self.notes.append(f"node {node.name!r} (GlobalAveragePool): {height}x{width} has no two-stage split")
            return None
        x, y = node.input[0], node.output[0]
        pooled = self.tensor(f"{y}_stage1")
        first = helper.make_node(
            "AveragePool",
            [x],
            [pooled],
            name=self.tensor(f"{node.name}_stage1"),
            kernel_shape=[kh, kw],
            strides=[kh, kw],
        )
        second = helper.make_node("GlobalAveragePool", [self.edge(pooled, x, "moved")], [y], name=node.name)
        self.replace(node, [first, second])
        return ("AveragePool", "GlobalAveragePool")

    def _split(self, node: onnx.NodeProto, _match: Match) -> tuple[str, ...] | None:
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        shape = self.shape(node.input[0])
        axis = int(attributes.get("axis", 0))
        sizes: Any = self.index.constant(node.input[1]) if len(node.input) > 1 and node.input[1] else None
        sizes = attributes.get("split") if sizes is None else sizes
        outputs = [o for o in node.output]
        if sizes is None:
            length = None if shape is None else shape[axis]
            # opset 18's num_outputs splits unevenly: chunks of ceil(length / n), the last smaller
            uneven = "num_outputs" in attributes
            if not isinstance(length, int) or (length % len(outputs) and not uneven):
                self.notes.append(f"node {node.name!r} (Split): sizes unknown; left as it is")
                return None
            chunk = -(-length // len(outputs))
            sizes = [min(chunk, max(length - i * chunk, 0)) for i in range(len(outputs))]
        bounds = np.cumsum([0, *(int(s) for s in np.asarray(sizes).reshape(-1))])
        axes = self.constant(f"{node.name}_axis", np.array([axis], np.int64))
        slices = []
        for i, output in enumerate(outputs):
            if not output:
                continue
            starts = self.constant(f"{node.name}_start_{i}", np.array([bounds[i]], np.int64))
            ends = self.constant(f"{node.name}_end_{i}", np.array([bounds[i + 1]], np.int64))
            name = node.name if i == 0 else self.tensor(f"{node.name}_{i}")
            slices.append(helper.make_node("Slice", [node.input[0], starts, ends, axes], [output], name=name))
        self.replace(node, slices)
        return tuple(n.op_type for n in slices)

    def _conv_transpose(self, node: onnx.NodeProto, _match: Match) -> tuple[str, ...] | None:
        x, y = node.input[0], node.output[0]
        shape = self.shape(x)
        weight_shape = self.weight_shape(node)
        if shape is None or len(shape) != 4 or not all(isinstance(d, int) for d in shape[2:]) or weight_shape is None:
            self.notes.append(f"node {node.name!r} (ConvTranspose): spatial size unknown; left as it is")
            return None
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        form = ConvTransposeAsConv.from_attributes(attributes, weight_shape)
        weight = self.conv_weight(node, form.group)
        if weight is None:
            self.notes.append(f"node {node.name!r} (ConvTranspose): weight is not a constant; left as it is")
            return None
        height, width = int(shape[2]), int(shape[3])  # type: ignore[arg-type]
        (sh, sw), new = form.strides, []
        axes = self.constant(f"{node.name}_axes", np.array([3, 5], np.int64))
        unsqueezed = self.tensor(f"{y}_unsqueezed")
        new.append(helper.make_node("Unsqueeze", [x, axes], [unsqueezed], name=self.tensor(f"{node.name}_unsqueeze")))
        pads = self.constant(f"{node.name}_zeros", np.array([0] * 6 + [0, 0, 0, sh - 1, 0, sw - 1], np.int64))
        spread = self.tensor(f"{y}_spread")
        new.append(
            helper.make_node(
                "Pad", [self.edge(unsqueezed, x, "moved"), pads], [spread], name=self.tensor(f"{node.name}_zero_pad")
            )
        )
        target = self.constant(f"{node.name}_shape", np.array([0, 0, height * sh, width * sw], np.int64))
        inserted = self.tensor(f"{y}_zero_inserted")
        new.append(
            helper.make_node(
                "Reshape", [self.edge(spread, x, "moved"), target], [inserted], name=self.tensor(f"{node.name}_reshape")
            )
        )
        source = self.edge(inserted, x, "moved")
        if any(form.crop_begin) or any(form.crop_end):
            starts = self.constant(f"{node.name}_starts", np.array(form.crop_begin, np.int64))
            ends = self.constant(
                f"{node.name}_ends",
                np.array([height * sh - form.crop_end[0], width * sw - form.crop_end[1]], np.int64),
            )
            crop_axes = self.constant(f"{node.name}_crop_axes", np.array([2, 3], np.int64))
            cropped = self.tensor(f"{y}_cropped")
            new.append(
                helper.make_node(
                    "Slice", [source, starts, ends, crop_axes], [cropped], name=self.tensor(f"{node.name}_crop")
                )
            )
            source = self.edge(cropped, x, "moved")
        inputs = [source, weight, *([node.input[2]] if len(node.input) > 2 and node.input[2] else [])]
        conv = helper.make_node(
            "Conv",
            inputs,
            [y],
            name=node.name,
            kernel_shape=list(weight_shape[2:]),
            pads=list(form.pads),
            dilations=list(form.dilations),
            group=form.group,
        )
        new.append(conv)
        self.replace(node, new)
        return tuple(n.op_type for n in new)

    def weight_shape(self, node: onnx.NodeProto) -> list[int] | None:
        weight = self.index.constant(node.input[1])
        return None if weight is None else list(np.asarray(weight).shape)


__all__ = ["Converted", "OnnxConversions"]
