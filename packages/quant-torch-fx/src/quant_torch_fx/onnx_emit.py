"""An export form's ATen graph (:func:`quant_torch_fx.export_form.aten_graph`) written as an
ONNX graph, node for node.

Each FX node is translated by its entry in :data:`quant_torch_fx.aten_map.ATEN_OPS`, the
table the planner reads too: the emitter asks the entry for the op type the plan gave the
node and the rule writes that op (or, where the entry says so, the ops it is written as),
so a plan and the file cannot name different ops. The two QDQ custom ops become
``QuantizeLinear`` (one per quantized tensor) with a ``DequantizeLinear`` per reading node,
and integer initializers behind a ``DequantizeLinear``. ``SymInt`` arithmetic (the dynamic
batch) becomes int64 ``Shape``/``Gather``/``Mul``/``Concat`` nodes beside the data path.

Names are deterministic: initializers are the ``state_dict`` paths of the tensors they
hold, nodes and their output tensors the FX node names (helpers ``<fx name>/<op type>``,
constants ``<fx name>/<what>``),
activation QDQ nodes ``<tensor>_QuantizeLinear`` / ``<tensor>_DequantizeLinear``.

Example:
    >>> import torch
    >>> gm = torch.export.export(torch.nn.Sequential(torch.nn.Hardswish()), (torch.randn(2, 3),)).module()
    >>> model = emit_onnx(gm, opset=17, input_names=["input"], output_names=["output"])
    >>> [(n.op_type, n.name) for n in model.graph.node]
    [('HardSwish', 'hardswish')]
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from torch.fx import GraphModule, Node

from quant_core.dtypes import DType
from quant_core.errors import ConfigError, ModelError, listed
from quant_core.onnx_qdq.build import tensor_proto
from quant_core.onnx_qdq.tensor_types import DTYPE_OF_ONNX, ONNX_DTYPES
from quant_core.qparams import QParams, quantize
from quant_core.spec import RoundMode
from quant_torch_fx.aten_map import ATEN_OPS, AtenOp, op_name
from quant_torch_fx.graph_passes import get_attr_value
from quant_torch_fx.graph_plan import module_paths
from quant_torch_fx.onnx_context import RuleContext
from quant_torch_fx.onnx_rules import bind
from quant_torch_fx.onnx_types import onnx_type
from quant_torch_fx.onnx_values import Constant, Dequantized, Folded, Quantized, Size
from quant_torch_fx.qdq_ops import DEQUANTIZE, QUANTIZE_DEQUANTIZE

UNFOLDED = frozenset(
    {"rand", "randn", "rand_like", "randn_like", "randint", "bernoulli", "normal", "uniform", "dropout"}
)
"""ATen ops never computed at export even on constants (random ones)."""

_SYMBOLIC = {
    operator.add: "Add",
    operator.sub: "Sub",
    operator.mul: "Mul",
    operator.floordiv: "Div",  # sizes are not negative: truncation is the floor
    operator.mod: "Mod",
}


def _flat(values: Any) -> list[Any]:
    if isinstance(values, list | tuple):
        return [leaf for v in values for leaf in _flat(v)]
    if isinstance(values, dict):
        return [leaf for v in values.values() for leaf in _flat(v)]
    return [values]


class Emitter:
    """Writes one ATen graph as ONNX (see the module docstring). Rules call its helpers."""

    def __init__(self, gm: GraphModule, opset: int) -> None:
        self.gm = gm
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: dict[str, TensorProto] = {}
        self.node_names: set[str] = set()
        self.tensor_names: set[str] = set()
        self.values: dict[Node, Any] = {}
        self.current: Node | None = None
        self.graph_inputs: set[str] = set()
        self.readers: dict[tuple[Node | None, int, bool], str] = {}  # (reader, value, transposed) -> DQ output
        self.constants: dict[tuple[str, int, bool], str] = {}  # (source, element type, transposed) -> initializer

    # --- names -------------------------------------------------------------------------------
    def _unique(self, base: str, taken: set[str]) -> str:
        name, index = base, 1
        while name in taken:
            name, index = f"{base}_{index}", index + 1
        taken.add(name)
        return name

    def tensor_name(self, base: str) -> str:
        return self._unique(base, self.tensor_names)

    @property
    def prefix(self) -> str:
        return self.current.name if self.current is not None else "graph"

    # --- writing -----------------------------------------------------------------------------
    def add(self, op_type: str, inputs: Sequence[str], outputs: int = 1, **attributes: Any) -> Any:
        """Append an ``op_type`` node reading ``inputs`` (``""``: an omitted optional input);
        returns its output name (a list of names when ``outputs`` > 1). Attributes that are
        ``None`` are left out."""
        name = self._unique(f"{self.prefix}/{op_type}", self.node_names)
        names = [self.tensor_name(name if outputs == 1 else f"{name}_{i}") for i in range(outputs)]
        kept = {k: v for k, v in attributes.items() if v is not None}
        self.nodes.append(helper.make_node(op_type, list(inputs), names, name=name, **kept))
        return names[0] if outputs == 1 else names

    def initializer(self, value: np.ndarray, base: str, elem_type: int | None = None) -> str:
        """A new initializer holding ``value`` (named from ``base``)."""
        name = self.tensor_name(base)
        if elem_type in (TensorProto.INT4, TensorProto.UINT4):
            tensor = tensor_proto(name, value, DTYPE_OF_ONNX[elem_type])  # packed as the layer packs them
        else:
            array = np.array(value, order="C")  # keeps 0-d arrays 0-d (ascontiguousarray does not)
            if elem_type is not None:
                array = array.astype(helper.tensor_dtype_to_np_dtype(elem_type))
            tensor = numpy_helper.from_array(array, name)
        self.initializers[name] = tensor
        return name

    def const(self, value: Any, hint: str, dtype: torch.dtype = torch.float32) -> str:
        """A constant (a number or an array) as an initializer of ``dtype``."""
        array = np.asarray(value, dtype=helper.tensor_dtype_to_np_dtype(onnx_type(dtype)))
        return self.initializer(array, f"{self.prefix}/{hint}")

    def ints(self, values: Sequence[Any], hint: str = "shape") -> str:
        """A 1-D int64 tensor of ``values`` (ints and ``SymInt`` nodes)."""
        resolved = [self.value(v) if isinstance(v, Node) else v if isinstance(v, Size) else int(v) for v in values]
        if all(isinstance(v, int) for v in resolved):
            return self.const(np.asarray(resolved, np.int64).reshape(-1), hint, torch.int64)
        parts: list[str] = []
        run: list[int] = []
        for v in resolved:
            if isinstance(v, int):
                run.append(v)
                continue
            if run:
                parts.append(self.const(np.asarray(run, np.int64), hint, torch.int64))
                run = []
            if not isinstance(v, Size):
                raise self.error(f"a size of type {type(v).__name__}; allowed: ints and SymInts")
            parts.append(v.tensor)
        if run:
            parts.append(self.const(np.asarray(run, np.int64), hint, torch.int64))
        return parts[0] if len(parts) == 1 else self.add("Concat", parts, axis=0)

    # --- reading FX values ------------------------------------------------------------------------
    def value(self, arg: Any) -> Any:
        """The emitted value of an FX argument (literals as they are)."""
        if isinstance(arg, Node):
            return self.values[arg]
        if isinstance(arg, list | tuple):
            return type(arg)(self.value(a) for a in arg)
        return arg

    def tensor(self, arg: Any, dtype: torch.dtype | None = None) -> str:
        """An ONNX tensor name for an FX argument: a node's output (through a
        ``DequantizeLinear`` for quantized ones), or a number as a constant of ``dtype``
        (default float32), cast to ``dtype`` when given and different."""
        value = self.value(arg) if isinstance(arg, Node) else arg
        if isinstance(value, Quantized):
            name = self.dequantized(value)
        elif isinstance(value, Dequantized):
            name = self.weight(value)
        elif isinstance(value, Constant):
            name = self.attr(value.node)
        elif isinstance(value, Folded):
            name = self.folded(value)
        elif isinstance(value, Size):
            name = value.tensor
        elif isinstance(value, str):
            name = value
        elif isinstance(value, bool | int | float):
            return self.const(value, "scalar", dtype or (torch.float32 if isinstance(value, float) else torch.int64))
        else:
            raise self.error(f"an argument of type {type(value).__name__} where a tensor belongs")
        if dtype is not None and isinstance(arg, Node) and self.dtype(arg) != dtype:
            return self.add("Cast", [name], to=onnx_type(dtype))
        return name

    def shape_source(self, arg: Node) -> str:
        """The tensor a ``Shape`` of ``arg`` reads: the codes of a quantized activation (8 bits
        and more: not every onnxruntime Shape kernel takes 4-bit types), else ``arg`` itself."""
        value = self.value(arg)
        if isinstance(value, Quantized) and value.bits >= 8:
            return value.codes
        return self.tensor(arg)

    def dequantized(self, value: Quantized) -> str:
        key = (self.current, id(value), False)
        if key not in self.readers:
            output = self.tensor_name(f"{value.source}_DequantizeLinear_Output")
            self._dequantize_node(value.codes, value.scale, value.zero_point, None, output, value.source)
            self.readers[key] = output
        return self.readers[key]

    def _dequantize_node(
        self, codes: str, scale: str, zero_point: str, axis: int | None, output: str, base: str
    ) -> None:
        name = self._unique(f"{base}_DequantizeLinear", self.node_names)
        node = helper.make_node("DequantizeLinear", [codes, scale, zero_point], [output], name=name)
        if axis is not None:
            node.attribute.append(helper.make_attribute("axis", axis))
        self.nodes.append(node)

    def weight(self, value: Dequantized, transposed: bool = False) -> str:
        """A ``DequantizeLinear`` of integer codes (``transposed``: the 2-D codes stored
        ``[in, out]``, the channel axis moved with them)."""
        key = (self.current, id(value), transposed)
        if key in self.readers:
            return self.readers[key]
        codes = self.attr(value.codes, ONNX_DTYPES[value.dtype], transposed=transposed)
        scale = self.attr(value.scale)
        zero_point = self.attr(value.zero_point, ONNX_DTYPES[value.dtype])
        axis = value.axis
        if transposed and axis is not None:
            axis = 1 - axis % 2
        output = self.tensor_name(f"{codes}_DequantizeLinear_Output")
        self._dequantize_node(codes, scale, zero_point, axis, output, codes)
        self.readers[key] = output
        return output

    def attr(self, node: Node, elem_type: int | None = None, transposed: bool = False) -> str:
        """The initializer of a ``get_attr`` node, named by its target (the ``state_dict`` path)."""
        target = str(node.target)
        key = (target, elem_type or 0, transposed)
        if key not in self.constants:
            value = get_attr_value(self.gm, node).detach().cpu()
            array = value.numpy() if value.dtype != torch.bfloat16 else value.float().numpy()
            if transposed:
                array = array.T
            base = target if not transposed or not self._other_readers(node) else f"{target}_transposed"
            self.constants[key] = self.initializer(array, base, elem_type)
        return self.constants[key]

    def folded(self, value: Folded) -> str:
        key = (f"{value.name}\0{id(value)}", 0, False)  # \0: no get_attr target has it
        if key not in self.constants:
            tensor = value.tensor.detach().cpu()
            array = tensor.numpy() if tensor.dtype != torch.bfloat16 else tensor.float().numpy()
            self.constants[key] = self.initializer(array, value.name)
        return self.constants[key]

    def constant_value(self, arg: Any) -> Any:
        """The real value of a constant FX argument (``None`` when it is not one)."""
        value = self.value(arg) if isinstance(arg, Node) else arg
        if isinstance(value, Constant):
            return get_attr_value(self.gm, value.node)
        if isinstance(value, Folded):
            return value.tensor
        if isinstance(value, list | tuple):
            items = [self.constant_value(v) for v in value]
            return (
                None
                if any(i is None and v is not None for i, v in zip(items, value, strict=True))
                else type(value)(items)
            )
        if isinstance(value, Size | Quantized | Dequantized | str):
            return None
        return value

    def _other_readers(self, node: Node) -> bool:
        """Whether a ``get_attr`` is also read other than transposed (then both forms are written)."""
        for user in node.users:
            readers = list(user.users) if user.target is DEQUANTIZE else [user]
            source = user if user.target is DEQUANTIZE else node
            if any(not _reads_transposed(reader, source) for reader in readers):
                return True
        return False

    def bind(self, node: Node) -> dict[str, Any]:
        return bind(node)

    # --- static information ----------------------------------------------------------------------
    def meta(self, arg: Any) -> Any:
        return arg.meta.get("val") if isinstance(arg, Node) else None

    def dtype(self, arg: Any) -> torch.dtype:
        meta = self.meta(arg)
        if isinstance(meta, torch.Tensor):
            return meta.dtype
        if isinstance(arg, float):
            return torch.float32
        if isinstance(arg, bool):
            return torch.bool
        return torch.int64

    def rank(self, arg: Any) -> int:
        meta = self.meta(arg)
        if not isinstance(meta, torch.Tensor):
            raise self.error(f"{getattr(arg, 'name', arg)!r} has no known rank")
        return meta.dim()

    def shape(self, arg: Any) -> list[int | None]:
        """Static sizes of ``arg`` (``None`` where the size is symbolic)."""
        meta = self.meta(arg)
        if not isinstance(meta, torch.Tensor):
            raise self.error(f"{getattr(arg, 'name', arg)!r} has no known shape")
        return [int(s) if isinstance(s, int) else None for s in meta.shape]

    def sizes(self, arg: Node) -> list[Any]:
        """``arg``'s sizes: ints, or ``Shape`` reads of ``arg`` where they are symbolic."""
        sizes: list[Any] = []
        for axis, size in enumerate(self.shape(arg)):
            if size is None:
                source = self.shape_source(arg)
                sizes.append(Size(self.add("Shape", [source], start=axis, end=axis + 1)))
            else:
                sizes.append(size)
        return sizes

    def out_dtype(self) -> torch.dtype:
        assert self.current is not None
        meta = self.current.meta.get("val")
        if isinstance(meta, list | tuple):
            meta = meta[0]
        return meta.dtype if isinstance(meta, torch.Tensor) else torch.float32

    # --- errors -------------------------------------------------------------------------------------
    def error(self, what: str) -> ModelError:
        node = self.current
        if node is None:
            return ModelError(f"export: {what}")
        return ModelError(f"export: node {node.name!r} ({_describe(node)}{_where(node)}): {what}")

    # --- the graph ------------------------------------------------------------------------------
    def run(self, input_names: Sequence[str], output_names: Sequence[str] | None) -> onnx.GraphProto:
        graph = self.gm.graph
        live = _live(graph)
        inputs: list[onnx.ValueInfoProto] = []
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        tensors_in = [n for n in placeholders if isinstance(n.meta.get("val"), torch.Tensor)]
        input_names = check_names(input_names, len(tensors_in), "input_names", "input", ())
        for node, name in zip(tensors_in, input_names, strict=True):
            self.tensor_names.add(name)
            self.graph_inputs.add(name)
            self.values[node] = name
            inputs.append(_value_info(name, node.meta["val"]))
        for node in graph.nodes:
            if node.op == "placeholder":
                self.values.setdefault(node, node.meta.get("val"))
                continue
            if node not in live or node.op == "output":
                continue
            self.current = node
            if node.op == "get_attr":
                self.values[node] = Constant(node)
            elif node.op == "call_function":
                self.values[node] = self.call(node)
            else:
                raise self.error(f"{node.op} {node.target!r} cannot be written (only ATen calls are)")
        self.current = None
        outputs = self._outputs(graph.output_node(), output_names)
        return helper.make_graph(self.nodes, "quant_torch_fx", inputs, outputs, list(self.initializers.values()))

    def call(self, node: Node) -> Any:
        target = node.target
        if target is QUANTIZE_DEQUANTIZE:
            return self._quantize(node)
        if target is DEQUANTIZE:
            codes, scale, zero_point, axis, dtype = node.args
            assert isinstance(codes, Node) and isinstance(scale, Node) and isinstance(zero_point, Node)
            return Dequantized(codes, scale, zero_point, axis if axis is None else int(axis), DType(dtype))  # type: ignore[arg-type]
        if target is operator.getitem:
            source, index = node.args
            return self.value(source)[index]  # type: ignore[index]
        if target in _SYMBOLIC or target is operator.neg:
            return self._symbolic(node)
        folded = self._fold(node)
        if folded is not None:
            return folded
        name = op_name(node)
        if name == "sym_size":
            source, axis = node.args
            return Size(self.add("Shape", [self.shape_source(source)], start=int(axis), end=int(axis) + 1))  # type: ignore[arg-type,call-overload]
        entry = ATEN_OPS.get(name) or (ATEN_OPS.get(name[:-1]) if name.endswith("_") else None)
        if entry is None or entry.emit is None:
            raise self.error("no ONNX translation for this op (quant_torch_fx.aten_map.ATEN_OPS lists the ops written)")
        start = len(self.nodes)
        planned = entry.op_type(node)
        context: RuleContext = self  # the rules' view of the emitter (checked by mypy)
        result = entry.emit(context, node, planned)
        self._check_written(entry, planned, start)
        result = self._name_result(node, result, start)
        if name.endswith("_") and node.args and isinstance(node.args[0], Node):
            self.values[node.args[0]] = result  # later readers of the mutated tensor see the new value
        return result

    def _fold(self, node: Node) -> Any:
        """The value of an ATen call on constants alone, computed by torch (``None`` when an
        input is not constant)."""
        target = node.target
        if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten" or op_name(node) in UNFOLDED:
            return None
        values = [self.constant_value(a) for a in node.all_input_nodes]
        if any(v is None for v in values):
            return None
        args = torch.fx.node.map_arg(node.args, self.constant_value)
        kwargs = torch.fx.node.map_arg(node.kwargs, self.constant_value)
        with torch.no_grad():
            result = target(*args, **kwargs)
        if isinstance(result, torch.Tensor):
            return Folded(result, node.name)
        if isinstance(result, list | tuple):
            return [Folded(r, f"{node.name}_{i}") if isinstance(r, torch.Tensor) else r for i, r in enumerate(result)]
        return result

    def _quantize(self, node: Node) -> Quantized:
        x, scale, zero_point, qmin, _qmax, rounding, dtype = node.args
        assert isinstance(scale, Node) and isinstance(zero_point, Node)
        stored = DType(dtype)  # type: ignore[arg-type]
        scale_name = self.attr(scale)
        zero_name = self.attr(zero_point, ONNX_DTYPES[stored])
        constant = self.constant_value(x)
        if isinstance(constant, torch.Tensor):  # stored as its integer codes
            qp = QParams(
                scale=get_attr_value(self.gm, scale).numpy(),
                zero_point=get_attr_value(self.gm, zero_point).numpy().astype(np.int64),
                dtype=stored,
                narrow_range=bool(qmin != stored.qmin),
                rounding=RoundMode(rounding),
            )
            base = str(x.target) if isinstance(x, Node) and x.op == "get_attr" else getattr(x, "name", "constant")
            codes = self.initializer(
                quantize(constant.detach().cpu().float().numpy(), qp), f"{base}_quantized", ONNX_DTYPES[stored]
            )
            return Quantized(codes, scale_name, zero_name, base, stored.bits)
        source = self.tensor(x)
        name = self._unique(f"{source}_QuantizeLinear", self.node_names)
        codes = self.tensor_name(f"{source}_QuantizeLinear_Output")
        self.nodes.append(helper.make_node("QuantizeLinear", [source, scale_name, zero_name], [codes], name=name))
        return Quantized(codes, scale_name, zero_name, source, stored.bits)

    def _symbolic(self, node: Node) -> Any:
        if node.target is operator.neg:
            (operand,) = node.args
            value = self.value(operand)
            return -value if isinstance(value, int) else Size(self.add("Neg", [value.tensor]))
        a, b = (self.value(arg) for arg in node.args)
        if isinstance(a, int) and isinstance(b, int):
            return node.target(a, b)  # type: ignore[operator]
        op = _SYMBOLIC[node.target]  # type: ignore[index]
        operands = [
            v.tensor if isinstance(v, Size) else self.const(np.asarray([v], np.int64), "size", torch.int64)
            for v in (a, b)
        ]
        return Size(self.add(op, operands))

    def _check_written(self, entry: AtenOp, planned: str, start: int) -> None:
        written = {n.op_type for n in self.nodes[start:]}
        allowed = {planned, *entry.written_as, *HELPERS}
        if not written <= allowed:
            extra = ", ".join(sorted(written - allowed))
            raise self.error(f"the rule for {planned} wrote {extra}, which aten_map does not list for it")

    def _name_result(self, node: Node, result: Any, start: int) -> Any:
        """Give the node that writes the result the FX node's name (and its tensor too);
        returns the result under its new name."""
        if not isinstance(result, str):
            if isinstance(result, list) and result and all(isinstance(r, str) for r in result):
                producer = next((n for n in self.nodes[start:] if result[0] in n.output), None)
                if producer is not None and all(r in producer.output for r in result):
                    self._rename_node(producer, node.name)
            return result
        producer = next((n for n in reversed(self.nodes[start:]) if result in n.output), None)
        if producer is None or node.name in self.tensor_names:
            return result
        self._rename_node(producer, node.name)
        self.tensor_names.add(node.name)
        self._rename_tensor(result, node.name, self.nodes[start:])
        return node.name

    def _rename_node(self, producer: onnx.NodeProto, name: str) -> None:
        if name in self.node_names:
            return
        self.node_names.discard(producer.name)
        self.node_names.add(name)
        producer.name = name

    def _rename_tensor(self, old: str, new: str, nodes: Iterable[onnx.NodeProto]) -> None:
        for n in nodes:
            for i, name in enumerate(n.input):
                if name == old:
                    n.input[i] = new
            for i, name in enumerate(n.output):
                if name == old:
                    n.output[i] = new

    def _outputs(self, output: Node, names: Sequence[str] | None) -> list[onnx.ValueInfoProto]:
        leaves = [leaf for leaf in _flat(output.args[0]) if isinstance(leaf, Node)]
        leaves = [leaf for leaf in leaves if isinstance(leaf.meta.get("val"), torch.Tensor)]
        wanted = default_names("output", len(leaves)) if names is None else names
        wanted = check_names(wanted, len(leaves), "output_names", "output", self.graph_inputs)
        infos = []
        written: set[str] = set()
        for leaf, name in zip(leaves, wanted, strict=True):
            value = self.values[leaf]
            if isinstance(value, Quantized):
                self.tensor_names.add(name)
                self._dequantize_node(value.codes, value.scale, value.zero_point, None, name, value.source)
            else:
                tensor = self.tensor(leaf)
                produced = any(tensor in n.output for n in self.nodes)
                if tensor in written or not produced or tensor in self.graph_inputs:
                    self.nodes.append(
                        helper.make_node("Identity", [tensor], [name], name=self._unique(name, self.node_names))
                    )
                elif tensor != name:
                    self._rename_tensor(tensor, name, self.nodes)
                written.add(name)
            infos.append(_value_info(name, leaf.meta["val"]))
        return infos


HELPERS = frozenset(
    {"DequantizeLinear", "Shape", "Gather", "Concat", "Cast", "Reshape", "Squeeze", "Unsqueeze", "Identity"}
)
"""Op types any rule may write beside its own: the DequantizeLinear of what it reads, shape
arithmetic and type conversions."""


def _reads_transposed(reader: Node, dequantize: Node) -> bool:
    """Whether ``reader`` reads ``dequantize``'s weight pre-transposed (``linear`` over tokens)."""
    meta = reader.args[0].meta.get("val") if reader.args and isinstance(reader.args[0], Node) else None
    return (
        op_name(reader) == "linear"
        and isinstance(meta, torch.Tensor)
        and meta.dim() != 2
        and reader.args[1] is dequantize
    )


def check_names(names: Any, count: int, field: str, what: str, taken: Collection[str]) -> list[str]:
    """``names``, one unique non-empty string per graph input or output (``what``), none of
    them ``taken`` (the inputs' names, for the outputs): an extra name would be dropped
    unseen, and a repeated or empty one makes an invalid graph that fails the ONNX checker."""
    names = list(listed(names, field, f"a list of {count} name(s), one per {what}", single=False, any_iterable=True))
    if len(names) != count:
        raise ConfigError(f"{field}: {len(names)} name(s) for {count} tensor {what}(s); allowed: one per {what}")
    seen: set[str] = set(taken)
    for name in names:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{field}: {name!r} is not allowed; allowed: non-empty strings")
        if name in seen:
            clash = "an input's name" if name in taken else "given twice"
            raise ConfigError(f"{field}: {name!r} is {clash}; allowed: a unique name per {what}")
        seen.add(name)
    return names


def default_names(prefix: str, count: int) -> list[str]:
    """``prefix`` for one tensor, ``prefix_0``, ``prefix_1``... for several.

    Example:
        >>> default_names("input", 1), default_names("output", 2)
        (['input'], ['output_0', 'output_1'])
    """
    return [prefix if count == 1 else f"{prefix}_{i}" for i in range(count)]


def _value_info(name: str, meta: torch.Tensor) -> onnx.ValueInfoProto:
    dims: list[Any] = []
    for size in meta.shape:
        dims.append(int(size) if isinstance(size, int) else _symbol_name(size))
    return helper.make_tensor_value_info(name, onnx_type(meta.dtype), dims)


def _symbol_name(size: Any) -> str | None:
    """``"batch"`` for the dynamic batch symbol itself, ``None`` (unknown) for expressions of it."""
    expr = getattr(getattr(size, "node", None), "expr", None)
    return "batch" if expr is not None and getattr(expr, "is_Symbol", False) else None


def _live(graph: torch.fx.Graph) -> set[Node]:
    """Nodes the outputs depend on (run-time assertions and dead code left out)."""
    live: set[Node] = set()
    stack = [graph.output_node()]
    while stack:
        node = stack.pop()
        if node in live:
            continue
        live.add(node)
        stack.extend(node.all_input_nodes)
    return live


def _describe(node: Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{op_name(node)}.{target._overloadname}" if target.namespace == "aten" else str(target)
    return getattr(target, "__name__", str(target))


def _where(node: Node) -> str:
    paths = module_paths(node)
    return f" in module {paths[-1]!r}" if paths else ""


def emit_onnx(
    gm: GraphModule, *, opset: int, input_names: Sequence[str], output_names: Sequence[str] | None
) -> onnx.ModelProto:
    """The ONNX model of ``gm`` (an export form's ATen graph) at default-domain ``opset``."""
    emitter = Emitter(gm, opset)
    graph = emitter.run(input_names, output_names)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="quant_torch_fx")
    model.ir_version = helper.find_min_ir_version_for([helper.make_opsetid("", opset)])
    return model
