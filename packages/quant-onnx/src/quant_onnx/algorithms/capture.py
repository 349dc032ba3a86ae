"""Capture tensors of an ONNX model with onnxruntime, batch by batch.

The algorithm passes need a few intermediate tensors (a layer's input, its float
output) over the calibration batches.

- :class:`TensorCapture` runs a copy of the model pruned to the nodes those tensors
  depend on and either yields the tensors batch by batch (streaming statistics, memory
  independent of the number of samples) or concatenates them.
- :class:`IncrementalRunner` walks a model layer by layer for the passes that change
  weights as they go (bias correction, AdaRound): it keeps the live tensors of every
  batch and each call runs only the nodes not run yet, so a whole sweep over the
  network costs about one forward pass instead of one per layer (the nodes of a layer
  run only after the pass has finished changing it).

Example:
    >>> import numpy as np
    >>> from onnx import TensorProto, helper
    >>> nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"), helper.make_node("Neg", ["r"], ["y"], name="neg")]
    >>> g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 2])],
    ...                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 2])])
    >>> model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=10)
    >>> batches = prepare_batches([{"x": np.array([[-1.0, 2.0]], np.float32)}] * 3, num_samples=2)
    >>> TensorCapture(model, ["r"]).collect(batches)["r"].tolist()
    [[0.0, 2.0], [0.0, 2.0]]
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from quant_algos.drivers.live_store import LIVE_MEMORY_BYTES, LiveStore
from quant_core.errors import ConfigError, DataError, ModelError
from quant_core.onnx_qdq.graph import GraphIndex, node_inputs
from quant_onnx.data import num_rows
from quant_onnx.pipeline.calibrate import inference_session

Feeds = Mapping[str, np.ndarray]


def prepare_batches(batches: Iterable[Feeds], num_samples: int | None = None) -> list[dict[str, np.ndarray]]:
    """The first ``num_samples`` samples (all when None) of ``batches`` (validated
    ``{input name: array}`` feeds, samples on the first axis) as a list, because every
    pass reads them several times. DataError when there are none."""
    out: list[dict[str, np.ndarray]] = []
    seen = 0
    for batch in batches:
        if num_samples is not None and seen >= num_samples:
            break
        feeds = {name: np.asarray(value) for name, value in batch.items()}
        rows = num_rows(feeds)
        if num_samples is not None and seen + rows > num_samples:
            feeds = {name: value[: num_samples - seen] for name, value in feeds.items()}
            rows = num_samples - seen
        if rows:
            out.append(feeds)
            seen += rows
    if not out:
        raise DataError("calibration data: no samples")
    return out


def count_samples(batches: Sequence[Feeds]) -> int:
    return sum(num_rows(b) for b in batches)


def pruned_model(model: onnx.ModelProto, outputs: Sequence[str]) -> onnx.ModelProto:
    """A copy of ``model`` whose graph outputs are ``outputs`` and that keeps only the
    nodes, inputs and initializers they depend on."""
    index = GraphIndex(model.graph)
    needed: set[str] = set()
    keep: set[int] = set()
    position = {id(node): i for i, node in enumerate(model.graph.node)}
    stack = list(outputs)
    while stack:
        tensor = stack.pop()
        if tensor in needed:
            continue
        needed.add(tensor)
        producer = index.producer(tensor)
        if producer is None:
            if not (index.is_graph_input(tensor) or index.constant(tensor) is not None):
                raise ModelError(f"capture: tensor {tensor!r} is not computed by the model")
            continue
        keep.add(position[id(producer)])
        stack.extend(node_inputs(producer))
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    kept_nodes = [graph.node[i] for i in sorted(keep)]
    del graph.node[:]
    graph.node.extend(kept_nodes)
    kept_inits = [t for t in graph.initializer if t.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(kept_inits)
    kept_inputs = [v for v in graph.input if v.name in needed]
    del graph.input[:]
    graph.input.extend(kept_inputs)
    del graph.output[:]
    graph.output.extend(output_info(index, name) for name in outputs)
    return out


def output_info(index: GraphIndex, name: str) -> onnx.ValueInfoProto:
    """A graph output declaration: typed when the type is known, else left for
    onnxruntime to infer (QuantizeLinear outputs rarely have value_info)."""
    elem = index.elem_type(name)
    return helper.make_tensor_value_info(name, elem, None) if elem else onnx.ValueInfoProto(name=name)


def with_graph(model: onnx.ModelProto, graph: onnx.GraphProto) -> onnx.ModelProto:
    """A model with ``model``'s header (IR version, opsets, functions) around ``graph``
    (without copying ``model``'s own, possibly large, graph)."""
    out = onnx.ModelProto()
    out.ir_version = model.ir_version
    out.opset_import.extend(model.opset_import)
    out.functions.extend(model.functions)
    out.graph.CopyFrom(graph)
    return out


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    """A CPU session that computes what the graph says on every CPU.

    Float graphs run fully optimised (their fusions are exact). Graphs holding Q/DQ nodes
    stay at basic optimisation: the extended fusions would move them into onnxruntime's
    integer kernels, whose u8 x s8 products saturate on x86 CPUs without VNNI, and they
    would rewrite a segment that starts at a DequantizeLinear output into a dynamically
    quantized kernel. Algorithms must not depend on the machine they run on."""
    has_qdq = any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in model.graph.node)
    level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC if has_qdq else ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return inference_session(model, level)


class TensorCapture:
    """Computes ``outputs`` (tensor names) of ``model`` over batches with onnxruntime.

    Example:
        >>> import numpy as np
        >>> from onnx import TensorProto, helper
        >>> g = helper.make_graph([helper.make_node("Abs", ["x"], ["y"], name="abs")], "g",
        ...     [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None])],
        ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])])
        >>> cap = TensorCapture(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=10), ["y"])
        >>> [b["y"].tolist() for b in cap.iterate([{"x": np.array([-1.0], np.float32)}])]
        [[1.0]]
    """

    def __init__(self, model: onnx.ModelProto, outputs: Sequence[str]) -> None:
        if not outputs:
            raise ConfigError("outputs: at least one tensor name is needed")
        self.outputs = list(dict.fromkeys(outputs))
        self._session = session(pruned_model(model, self.outputs))
        self._inputs = [i.name for i in self._session.get_inputs()]

    def run(self, batch: Feeds) -> dict[str, np.ndarray]:
        """The outputs for one batch."""
        missing = [name for name in self._inputs if name not in batch]
        if missing:
            raise DataError(f"calibration data: input {missing[0]!r} is missing")
        values = self._session.run(self.outputs, {name: batch[name] for name in self._inputs})
        return dict(zip(self.outputs, values, strict=True))

    def iterate(self, batches: Iterable[Feeds]) -> Iterator[dict[str, np.ndarray]]:
        """The outputs batch by batch (nothing is kept between batches)."""
        for batch in batches:
            yield self.run(batch)

    def collect(self, batches: Iterable[Feeds]) -> dict[str, np.ndarray]:
        """The outputs of all batches, concatenated along the first axis (a scalar, such as
        a model output that sums its batch, as one value per batch)."""
        parts: dict[str, list[np.ndarray]] = {name: [] for name in self.outputs}
        for values in self.iterate(batches):
            for name, value in values.items():
                parts[name].append(np.atleast_1d(value))
        return {name: np.concatenate(chunks, axis=0) for name, chunks in parts.items()}


def _node_key(node: onnx.NodeProto) -> str:
    """A node's identity that survives weight edits and node insertions: its first output."""
    return next(o for o in node.output if o)


class _Structure:
    """What :class:`IncrementalRunner` looks up in one model's graph: the index and every
    node's place in a topological order. Built once per model and rebuilt only when the
    model gains nodes (the only structural edit the runner allows), so a layer-by-layer
    walk indexes its graph a few times instead of several times per layer. Structure only:
    initializer values change between calls and are read from the graph itself."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.num_nodes = len(model.graph.node)
        self.index = GraphIndex(model.graph)
        self.position = {_node_key(n): i for i, n in enumerate(self.index.topological_order())}

    def describes(self, model: onnx.ModelProto) -> bool:
        return model is self.model and len(model.graph.node) == self.num_nodes


class IncrementalRunner:
    """Runs a model piece by piece over fixed batches, keeping each batch's live tensors.

    ``compute(model, tensors)`` runs the nodes that ``tensors`` need and that have not
    run yet (on the current ``model``: its weights may have changed between calls, its
    structure only by added nodes), remembers the tensors later nodes will read and
    yields the requested ones batch by batch (consume them all: the walk's state advances
    as the batches run). With ``commit=False`` nothing is remembered: how a pass evaluates
    one layer before changing it. Live tensors beyond ``memory_budget`` bytes wait on disk
    (:class:`~quant_algos.drivers.live_store.LiveStore`), so memory does not grow with the number of samples.

    Example:
        >>> import numpy as np
        >>> from onnx import TensorProto, helper
        >>> nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Neg", ["r"], ["y"])]
        >>> g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None])],
        ...                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])])
        >>> model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=10)
        >>> runner = IncrementalRunner([{"x": np.array([-1.0, 2.0], np.float32)}])
        >>> runner.concat(model, "r").tolist(), runner.concat(model, "y").tolist()
        ([0.0, 2.0], [-0.0, -2.0])
        >>> runner.nodes_run, runner.index_builds
        (2, 1)
    """

    def __init__(self, batches: Sequence[Feeds], memory_budget: int = LIVE_MEMORY_BYTES) -> None:
        self._live = LiveStore(len(batches), memory_budget)
        for i, batch in enumerate(batches):
            for name, value in batch.items():
                self._live.put(i, name, np.asarray(value))
        self._done: set[str] = set()
        self._structure: _Structure | None = None
        self._index_builds = 0

    @property
    def nodes_run(self) -> int:
        return len(self._done)

    @property
    def index_builds(self) -> int:
        """How many times a graph was indexed (once per model, again after nodes were added)."""
        return self._index_builds

    def index(self, model: onnx.ModelProto) -> GraphIndex:
        """The index of ``model``'s graph as it is now, built again only when ``model`` is
        another model or gained nodes. Its structure is current; read initializer values
        from the graph (they may have been rewritten since it was built)."""
        return self._structure_of(model).index

    def _structure_of(self, model: onnx.ModelProto) -> _Structure:
        if self._structure is None or not self._structure.describes(model):
            self._structure = _Structure(model)
            self._index_builds += 1
        return self._structure

    @property
    def spilled(self) -> int:
        """Live tensors waiting on disk now."""
        return self._live.spilled

    def close(self) -> None:
        """Delete what waits on disk (also done when the runner is garbage collected)."""
        self._live.close()

    def advance(self, model: onnx.ModelProto, tensors: Sequence[str]) -> None:
        """Run (and remember) what ``tensors`` need, without returning them."""
        for _ in self.compute(model, tensors):
            pass

    def concat(self, model: onnx.ModelProto, tensor: str, commit: bool = True) -> np.ndarray:
        """One tensor over all batches, concatenated along the first (sample) axis."""
        return np.concatenate([b[tensor] for b in self.compute(model, [tensor], commit=commit)], axis=0)

    def compute(
        self, model: onnx.ModelProto, tensors: Sequence[str], *, commit: bool = True
    ) -> Iterator[dict[str, np.ndarray]]:
        structure = self._structure_of(model)
        index = structure.index
        live = self._live.names()
        segment: dict[str, onnx.NodeProto] = {}
        inputs: set[str] = set()
        stack = list(tensors)
        while stack:
            tensor = stack.pop()
            if not tensor or tensor in live:
                inputs.update([tensor] if tensor else [])
                continue
            if index.initializer_proto(tensor) is not None:
                continue
            producer = index.producer(tensor)
            if producer is None:
                raise ModelError(f"capture: tensor {tensor!r} is not computed by the model")
            key = _node_key(producer)
            if key in self._done:
                raise ModelError(f"capture: tensor {tensor!r} was already released; request tensors in graph order")
            if key not in segment:
                segment[key] = producer
                stack.extend(node_inputs(producer))
        wanted = list(dict.fromkeys(tensors))
        keep: list[str] = []
        if segment and commit:
            finished = self._done | segment.keys()
            for node in segment.values():
                for out in node.output:
                    if out and any(_node_key(c) not in finished for c in index.consumers(out)):
                        keep.append(out)
        return self._batches(model, structure, segment, sorted(inputs), wanted, keep, commit)

    def _batches(
        self,
        model: onnx.ModelProto,
        structure: _Structure,
        segment: dict[str, onnx.NodeProto],
        inputs: list[str],
        wanted: list[str],
        keep: list[str],
        commit: bool,
    ) -> Iterator[dict[str, np.ndarray]]:
        outputs = list(dict.fromkeys(wanted + keep))
        sess = self._segment_session(model, structure, list(segment.values()), inputs, outputs) if segment else None
        for i in range(len(self._live)):
            values: dict[str, np.ndarray] = {}
            if sess is not None:
                ran = sess.run(outputs, {t: self._live.get(i, t) for t in inputs})
                values = dict(zip(outputs, ran, strict=True))
            if commit:
                for t in keep:
                    self._live.put(i, t, values[t])
            yield {t: values[t] if t in values else self._live.get(i, t) for t in wanted}
        if commit and segment:
            self._done |= segment.keys()
            self._release(structure.index)

    def _release(self, index: GraphIndex) -> None:
        """Drop the live tensors no pending node reads any more."""
        for tensor in self._live.names():
            if all(_node_key(c) in self._done for c in index.consumers(tensor)):
                self._live.drop(tensor)

    def _segment_session(
        self,
        model: onnx.ModelProto,
        structure: _Structure,
        nodes: list[onnx.NodeProto],
        inputs: list[str],
        outputs: list[str],
    ) -> ort.InferenceSession:
        nodes = sorted(nodes, key=lambda n: structure.position[_node_key(n)])
        read = {name for node in nodes for name in node_inputs(node)}
        graph = helper.make_graph(
            nodes,
            "segment",
            [
                helper.make_tensor_value_info(t, helper.np_dtype_to_tensor_dtype(self._live.get(0, t).dtype), None)
                for t in inputs
            ],
            [output_info(structure.index, t) for t in outputs],
            [t for t in model.graph.initializer if t.name in read],
        )
        return session(with_graph(model, graph))
