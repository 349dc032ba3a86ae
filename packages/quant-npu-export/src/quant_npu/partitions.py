"""Nodes a user keeps on the CPU in float, and the partitions that makes.

Some users would rather split the graph than approximate a function: ``--cpu Sigmoid``
keeps every Sigmoid as it is (``legalize`` converts none of them, ``check`` reports no
rule for them). The NPU then hands the tensor to the CPU and takes the result back: each
group of connected CPU nodes is a :class:`Partition`, named by the integer tensors where
data leaves the NPU and where it comes back.

An entry ending in ``@output`` selects only nodes that write a graph output:
``Sigmoid@output`` keeps a detector's final sigmoids on the CPU (one partition at the end of
the graph) while the SiLUs inside are converted.

Example:
    >>> cpu = CpuSelection.parse("Sigmoid,head/*")
    >>> cpu.selects("stem/sig", "Sigmoid"), cpu.selects("head/conv", "Conv"), cpu.selects("conv", "Conv")
    (True, True, False)
    >>> tail = CpuSelection.parse("Sigmoid@output")
    >>> tail.selects("head", "Sigmoid", writes_output=True), tail.selects("silu", "Sigmoid")
    (True, False)
    >>> Partition(("sig",), ("Sigmoid",), ("c_q",), ("s_q",)).line
    'CPU partition: sig (Sigmoid); NPU -> CPU at c_q; CPU -> NPU at s_q'
"""

from __future__ import annotations

import fnmatch
import glob
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import onnx

from quant_core.onnx_qdq.reader import QDQGraph
from quant_npu.plan import Step


def _entries(value: Iterable[str] | str) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else list(value)
    return tuple(item.strip() for item in items if item and item.strip())


@attrs.frozen
class CpuSelection:
    """Op types or node-name globs that run on the CPU (see the module example)."""

    entries: tuple[str, ...] = attrs.field(default=(), converter=_entries)

    @classmethod
    def parse(cls, value: CpuSelection | Iterable[str] | str | None) -> CpuSelection:
        if isinstance(value, CpuSelection):
            return value
        return cls(() if value is None else value)

    def selects(self, node: str, op_type: str, writes_output: bool = False) -> bool:
        for entry in self.entries:
            pattern, _, where = entry.partition("@")
            if where and (where != "output" or not writes_output):
                continue
            if op_type == pattern or fnmatch.fnmatchcase(node, pattern):
                return True
        return False

    def including(self, entries: Iterable[str]) -> CpuSelection:
        """This selection with ``entries`` added (kept once, in order)."""
        return CpuSelection((*self.entries, *(e for e in entries if e not in self.entries)))

    def __bool__(self) -> bool:
        return bool(self.entries)


@attrs.frozen
class Partition:
    """Connected CPU nodes and the integer tensors at their boundary.

    Args:
        nodes, op_types: the CPU nodes.
        inputs: tensors the NPU hands to the CPU (keys of integer tensors, or float names).
        outputs: tensors the CPU hands back (or graph outputs it writes).
    """

    nodes: tuple[str, ...]
    op_types: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    @property
    def line(self) -> str:
        listed = ", ".join(f"{n} ({o})" for n, o in zip(self.nodes, self.op_types, strict=True))
        inputs = ", ".join(self.inputs) or "graph input"
        outputs = ", ".join(self.outputs) or "graph output"
        return f"CPU partition: {listed}; NPU -> CPU at {inputs}; CPU -> NPU at {outputs}"

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) for k, v in attrs.asdict(self).items()}


def writes_output(qdq: QDQGraph, node: onnx.NodeProto) -> bool:
    """Whether ``node`` writes a graph output (directly or through its Q/DQ pair)."""
    for name in node.output:
        key = qdq.quantized.get(name)
        if qdq.index.is_graph_output(name) or (key is not None and qdq.is_graph_output_key(key)):
            return True
    return False


def cpu_steps(qdq: QDQGraph, steps: Sequence[Step], cpu: CpuSelection) -> list[Step]:
    """The steps whose node (or fused activation) the selection keeps on the CPU."""
    if not cpu:
        return []
    return [s for s in steps if any(cpu.selects(n.name, n.op_type, writes_output(qdq, n)) for n in s.nodes)]


def partitions(qdq: QDQGraph, steps: Sequence[Step], cpu: CpuSelection) -> list[Partition]:
    """The CPU partitions of ``steps`` (CPU steps joined where one reads another's output)."""
    kept = cpu_steps(qdq, steps, cpu)
    if not kept:
        return []
    outputs = {id(s): _written(s) for s in kept}
    parent = {id(s): id(s) for s in kept}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    writer = {name: id(s) for s in kept for name in outputs[id(s)]}
    for step in kept:
        for name in _read(qdq, step):
            if name in writer:
                parent[find(id(step))] = find(writer[name])
    groups: dict[int, list[Step]] = {}
    for step in kept:
        groups.setdefault(find(id(step)), []).append(step)
    found = []
    for members in groups.values():
        inside = {name for s in members for name in outputs[id(s)]}
        reads = [name for s in members for name in _read(qdq, s) if name not in inside]
        leaving = [name for name in inside if _read_outside(qdq, name, members)]
        found.append(
            Partition(
                tuple(s.name for s in members),
                tuple(s.op_type for s in members),
                tuple(dict.fromkeys(reads)),
                tuple(sorted(leaving)),
            )
        )
    return found


def _written(step: Step) -> set[str]:
    names = {o for node in step.nodes for o in node.output if o}
    if step.output is not None:
        names.add(step.output)
    return names


def _read(qdq: QDQGraph, step: Step) -> list[str]:
    names = []
    for name, key in zip(step.node.input, step.data_inputs, strict=True):
        if not name or (key is None and (qdq.constant(name) is not None or name in qdq.host_values)):
            continue
        if key is not None and qdq.tensors[key].is_constant:
            continue
        names.append(key or name)
    return names


def _read_outside(qdq: QDQGraph, name: str, members: Sequence[Step]) -> bool:
    own = {id(n) for s in members for n in s.nodes}
    readers = qdq.readers(name) if name in qdq.tensors else qdq.consumers(name)
    outside = [r for r in readers if id(r) not in own and r.op_type != "QuantizeLinear"]
    return bool(outside) or qdq.is_graph_output_key(name) or qdq.index.is_graph_output(name)


_QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})


def float_result_tail(model: onnx.ModelProto) -> tuple[str, ...]:
    """Nodes that finish the model's results in float: each reads dequantized tensors,
    constants, shape values or another such node's outputs, and writes a float tensor that
    only such nodes or the graph outputs read (any other output it writes is quantized for
    the NPU: a Split whose other branch goes on to a layer). The planner leaves them float: a Concat that assembles
    the results (:data:`quant_core.plan.planner.RESULT_CONCAT_REASON`) and, under formats
    that are not power-of-two, the result tail (:mod:`quant_core.plan.tail`: a classifier's
    logits, a detector's box decoding). A deployment hands their inputs, the last integer
    tensors, to the CPU, which finishes the results."""
    qdq = QDQGraph(model)
    index = qdq.index
    tail = {
        id(node): node
        for node in model.graph.node
        if node.name
        and node.op_type not in _QDQ_OPS
        and node.op_type != "Constant"
        and not any(o in qdq.host_values for o in node.output)
    }

    def finishes_results(node: onnx.NodeProto) -> bool:
        results = False
        for out in node.output:
            if not out:
                continue
            readers = index.consumers(out)
            if readers and not index.is_graph_output(out) and all(r.op_type == "QuantizeLinear" for r in readers):
                continue  # quantized and handed back to the NPU (a Split's branch into the next layer)
            if not (readers or index.is_graph_output(out)) or any(id(r) not in tail for r in readers):
                return False
            results = True
        data = [name for name in node.input if name and name not in qdq.host_values and not index.is_constant(name)]
        for name in data:
            producer = index.producer(name)
            if producer is None or (producer.op_type != "DequantizeLinear" and id(producer) not in tail):
                return False
        return bool(data) and results

    # A node leaves the tail when it fails the test; only its neighbours' answers can change
    # then, so only they are tested again (one pass over a long float chain, not one per link).
    pending = list(tail.values())
    while pending:
        node = pending.pop()
        if id(node) not in tail or finishes_results(node):
            continue
        del tail[id(node)]
        producers = [index.producer(name) for name in node.input if name]
        readers = [reader for out in node.output if out for reader in index.consumers(out)]
        pending.extend(n for n in (*producers, *readers) if n is not None and id(n) in tail)
    return tuple(node.name for node in model.graph.node if id(node) in tail)


def deployment_selection(
    model: onnx.ModelProto,
    cpu: CpuSelection | Iterable[str] | str | None,
    result_tail: Sequence[str] | None = None,
) -> CpuSelection:
    """``cpu`` plus the nodes that finish the results in float (:func:`float_result_tail`,
    or ``result_tail`` when the caller has it already): the nodes that run on the CPU of a
    deployment. ``check``, ``legalize`` and the simulator read a model through this one
    selection, so a legalised model that ``legalize`` calls done also passes ``check`` and
    runs in the simulator without naming them."""
    tail = float_result_tail(model) if result_tail is None else result_tail
    return CpuSelection.parse(cpu).including(glob.escape(name) for name in tail)
