"""A QDQ model compiled into the device's integer operations (see :func:`compile_program`).

The data path holds signed integer codes (``q - zero_point``) keyed like
:class:`~quant_core.onnx_qdq.reader.QDQGraph` tensors; shape computations (Shape -> Gather -> ...)
run on the host with ONNX's reference implementation, as the CPU part of a deployment
would run them. Graph inputs are quantized on the host (the profile's rounding in
``device`` mode), graph outputs are dequantized (exact).

Example:
    >>> import numpy as np
    >>> from onnx import TensorProto, helper, numpy_helper
    >>> from quant_npu.profile import NPUProfile
    >>> inits = [numpy_helper.from_array(np.array(0.5, np.float32), "s"),
    ...          numpy_helper.from_array(np.array(0, np.int8), "z")]
    >>> nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
    ...          helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
    ...          helper.make_node("MaxPool", ["xd"], ["p"], name="pool", kernel_shape=[2, 2]),
    ...          helper.make_node("QuantizeLinear", ["p", "s", "z"], ["pq"]),
    ...          helper.make_node("DequantizeLinear", ["pq", "s", "z"], ["y"])]
    >>> g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 2, 2])],
    ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 1, 1])], inits)
    >>> program = compile_program(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]),
    ...                           NPUProfile(), RoundMode.HALF_UP)
    >>> [(op.op_type, op.data, op.output) for op in program.operations], dict(program.outputs)
    ([('MaxPool', ('xq',), 'pq')], {'y': ('pq', 1)})
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
import numpy as np
import onnx

from quant_core.dtypes import DType
from quant_core.errors import ModelError
from quant_core.onnx_qdq.graph import node_label
from quant_core.onnx_qdq.reader import QDQGraph
from quant_core.qparams import QParams, quantize, round_values
from quant_core.spec import RoundMode
from quant_npu.approximations import is_device_hard_sigmoid, leaky_relu_alpha
from quant_npu.partitions import CpuSelection, cpu_steps
from quant_npu.plan import Step, plan
from quant_npu.profile import NPUProfile
from quant_npu.sim.arith import requantize, storage_dtype
from quant_npu.sim.elementwise import (
    ActivationKernel,
    AddKernel,
    DivKernel,
    HardSigmoidKernel,
    HardSwishKernel,
    MulKernel,
    PReluKernel,
    SoftmaxKernel,
    TableKernel,
    Tabulated,
)
from quant_npu.sim.epilogue import Activation, Epilogue
from quant_npu.sim.linear import (
    ActivationMatMulKernel,
    ConvKernel,
    ConvTransposeKernel,
    MatMulKernel,
    accumulator_bound,
    conv_transpose_bound,
)
from quant_npu.sim.movement import MOVES, pad
from quant_npu.sim.pool import AveragePoolKernel, GlobalAveragePoolKernel, MaxPoolKernel
from quant_npu.sim.resize import LinearResizeKernel
from quant_npu.sim.spatial import Geometry

_LOG = logging.getLogger(__name__)

SIMULATED_OPS = frozenset(
    {
        "Conv", "ConvTranspose", "Gemm", "MatMul", "Add", "Sub", "Mul", "Div", "Concat", "MaxPool",
        "AveragePool", "GlobalAveragePool", "ReduceMean", "Relu", "Clip", "LeakyRelu", "PRelu",
        "HardSigmoid", "HardSwish", "Sigmoid", "Tanh", "Softmax", "Pad", *MOVES,
    }
)  # fmt: skip
"""Op types the simulator has an integer kernel for."""

ELEMENTWISE_FLOAT_OPS = frozenset(
    {
        "Sigmoid", "Tanh", "Gelu", "Erf", "Exp", "Log", "Softplus", "Softsign", "Elu", "Selu", "Celu",
        "Mish", "HardSigmoid", "HardSwish", "LeakyRelu", "Relu", "Sqrt", "Abs", "Neg", "Reciprocal",
        "Sin", "Cos", "ThresholdedRelu",
    }
)  # fmt: skip
"""One-input elementwise ops: on the CPU, a table over every input code computes them exactly."""

Kernel = Callable[..., np.ndarray]


def node_error(name: str, op_type: str, message: str) -> ModelError:
    """A simulator refusal naming the node, as every one must."""
    return ModelError(f"node {name!r} ({op_type}): {message}")


@contextlib.contextmanager
def naming_the_node(name: str, op_type: str) -> Iterator[None]:
    """Re-raise a kernel's or a geometry's refusal (``Pad: negative pads are not
    simulated``) with the node it is about, unless it names one already."""
    try:
        yield
    except ModelError as exc:
        if str(exc).startswith("node "):
            raise
        raise node_error(name, op_type, str(exc)) from None


@attrs.frozen(eq=False)
class Operation:
    """One compiled step: ``kernel(*data, *params)`` writes ``output`` (see the module example)."""

    name: str
    op_type: str
    data: tuple[str, ...]
    params: tuple[str, ...]
    output: str
    kernel: Kernel


@attrs.frozen(eq=False)
class HostOperation:
    """A shape computation run with ONNX's reference implementation.

    Example:
        >>> from onnx.reference import ReferenceEvaluator
        >>> node = onnx.helper.make_node("Shape", ["x"], ["s"])
        >>> HostOperation(node, ReferenceEvaluator(node)).run({"x": np.zeros((2, 3))})["s"].tolist()
        [2, 3]
    """

    node: onnx.NodeProto
    evaluator: Any

    def run(self, values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        feeds = {name: values[name] for name in self.node.input if name}
        outputs = self.evaluator.run(None, feeds)
        return {name: np.asarray(value) for name, value in zip(self.node.output, outputs, strict=False) if name}


@attrs.frozen(eq=False)
class CpuOperation:
    """A node the CPU runs in float with ONNX's reference implementation: it reads
    ``integer`` tensors (input name -> key and fix position) dequantized, and constants and
    other CPU nodes' float results as they are; its outputs stay float.

    Example:
        >>> from onnx.reference import ReferenceEvaluator
        >>> node = onnx.helper.make_node("Sigmoid", ["x"], ["y"])
        >>> op = CpuOperation(node, ReferenceEvaluator(node), {"x": ("x_q", 2)})
        >>> op.run({"x_q": np.array([0, 4], np.int8)})["y"].round(4).tolist()
        [0.5, 0.7311...]
    """

    node: onnx.NodeProto
    evaluator: Any
    integer: Mapping[str, tuple[str, int]]
    quantized: Mapping[str, tuple[str, int, tuple[int, int]]] = attrs.field(factory=dict)
    mode: RoundMode = RoundMode.HALF_EVEN

    def run(self, values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The float results by name; an output the NPU reads (``quantized``: output name ->
        key, fix position, code range) as its codes under its key, as the model's
        QuantizeLinear computes them."""
        feeds = {}
        for name in self.node.input:
            if name in self.integer:
                key, position = self.integer[name]
                feeds[name] = np.ldexp(values[key].astype(np.float32), -position)
            elif name:
                feeds[name] = values[name]
        outputs = self.evaluator.run(None, feeds)
        found = {}
        for name, value in zip(self.node.output, outputs, strict=False):
            if name in self.quantized:
                key, position, (lo, hi) = self.quantized[name]
                scaled = round_values(np.ldexp(np.asarray(value, np.float64), position), self.mode)
                found[key] = np.clip(scaled, lo, hi).astype(storage_dtype(lo, hi))
            elif name:
                found[name] = np.asarray(value)
        return found


@attrs.frozen(eq=False)
class Program:
    """The compiled model: input quantizers, operations in order, output dequantizers
    (see the module example)."""

    inputs: Mapping[str, tuple[tuple[str, QParams], ...]]  # graph input -> (key, qparams) per QuantizeLinear
    raw_inputs: Mapping[str, tuple[str, int]]  # integer graph input read by a DequantizeLinear -> (key, zp)
    operations: tuple[Operation | HostOperation | CpuOperation, ...]
    constants: Mapping[str, np.ndarray]
    outputs: Mapping[str, tuple[str, int | None]]  # graph output -> (key, position; None: a CPU node's float)
    mode: RoundMode
    notes: tuple[str, ...] = ()


def _attributes(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _Compiler:
    def __init__(self, model: onnx.ModelProto, profile: NPUProfile, mode: RoundMode, cpu: CpuSelection) -> None:
        self.model = model
        self.profile = profile
        self.mode = mode
        self.qdq = QDQGraph(model)
        self.steps = plan(self.qdq, profile)
        self.on_cpu = {id(step) for step in cpu_steps(self.qdq, self.steps, cpu)}
        self.constants: dict[str, np.ndarray] = {}
        self.notes: list[str] = []
        self.float_values: set[str] = set()  # what CPU nodes write in float (the model's results)
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
        self.keys_of: dict[str, list[str]] = {}  # float tensor -> keys of every QuantizeLinear reading it
        for key, quantizer in self.qdq.quantizers.items():
            self.keys_of.setdefault(quantizer.input[0], []).append(key)

    # ------------------------------------------------------------------ tensors
    def fail(self, step: Step, message: str) -> ModelError:
        return node_error(step.name, step.op_type, message)

    def pos(self, step: Step, key: str | None) -> int:
        tensor = self.qdq.tensors.get(key) if key else None
        if tensor is None:
            raise self.fail(step, "an input or output is not quantized; the simulator runs integer tensors only")
        if tensor.position is None:
            raise self.fail(step, f"{key}: {tensor.describe()} has no fix position; run quant-npu legalize first")
        return tensor.position

    def range(self, key: str) -> tuple[int, int]:
        return self.qdq.tensors[key].value_range

    def bound(self, key: str) -> int:
        lo, hi = self.range(key)
        return max(abs(lo), abs(hi))

    def data(self, step: Step, indices: tuple[int, ...]) -> tuple[str, ...]:
        keys = []
        for i in indices:
            key = step.data_inputs[i] if i < len(step.data_inputs) else None
            if key is None:
                raise self.fail(step, f"input {i} is not quantized; the simulator runs integer tensors only")
            tensor = self.qdq.tensors[key]
            if tensor.is_constant and key not in self.constants:
                lo, hi = tensor.value_range
                self.constants[key] = tensor.values().astype(storage_dtype(min(lo, 0), max(hi, 0)))
            keys.append(key)
        return tuple(keys)

    def constant_values(self, step: Step, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Signed values and per-element-of-axis positions of a constant weight/bias input."""
        key = step.data_inputs[index] if index < len(step.data_inputs) else None
        tensor = self.qdq.tensors.get(key) if key else None
        if tensor is None or not tensor.is_constant:
            raise self.fail(step, f"input {index} is not an integer constant; run quant-npu legalize first")
        if tensor.fix_pos is None:
            raise self.fail(step, f"{key}: {tensor.describe()} has no fix position; run quant-npu legalize first")
        return tensor.values(), tensor.fix_pos

    def activation(self, step: Step) -> Activation | None:
        node = step.activation
        return None if node is None else self.activation_of(node, step)

    def activation_of(self, node: onnx.NodeProto, step: Step) -> Activation:
        if node.op_type == "Relu":
            return Activation("relu")
        if node.op_type == "LeakyRelu":
            alpha = float(_attributes(node).get("alpha", 0.01))
            numerator, bits = leaky_relu_alpha(alpha, self.profile)
            return Activation("leaky", numerator=numerator, bits=bits)
        attributes = _attributes(node)
        lo, hi = float(attributes.get("min", -math.inf)), float(attributes.get("max", math.inf))
        for index in (1, 2):
            if len(node.input) > index and node.input[index]:
                value = self.qdq.constant(node.input[index])
                if value is None:
                    raise self.fail(step, "Clip bounds are not constants")
                if index == 1:
                    lo = float(value.reshape(-1)[0])
                else:
                    hi = float(value.reshape(-1)[0])
        return Activation("clip", lo=lo, hi=hi)

    def params(self, step: Step, start: int) -> tuple[str, ...]:
        names = []
        for name in step.node.input[start:]:
            if name and self.qdq.constant(name) is not None:
                self.constants.setdefault(name, np.asarray(self.qdq.constant(name)))
            names.append(name)
        return tuple(names)

    # ------------------------------------------------------------------ kernels
    def compile(self, step: Step) -> Operation | CpuOperation:
        op = step.op_type
        if id(step) in self.on_cpu:
            return self._cpu(step)
        if op not in SIMULATED_OPS:
            raise self.fail(step, f"no integer kernel for {op}; simulated ops: {', '.join(sorted(SIMULATED_OPS))}")
        if op not in self.profile.accepted_ops:
            self.notes.append(f"node {step.name!r}: {op} is not an op of target '{self.profile.name}'")
        out = step.output
        out_pos = self.pos(step, out)
        assert out is not None
        out_range = self.range(out)
        builder = getattr(self, f"_{op.lower()}", None) or self._move
        with naming_the_node(step.name, op):
            data, params, kernel = builder(step, out_pos, out_range)
        return Operation(step.name, op, data, params, out, kernel)

    def further_outputs(self, step: Step) -> list[Operation]:
        """The step again for every further QuantizeLinear of its float result (quant_onnx
        writes one for a layer with its own input requantization): each rounds the exact
        result once at its own position, as onnxruntime quantizes the float twice."""
        tensor = self.qdq.tensors.get(step.output) if step.output else None
        if tensor is None or tensor.float_name is None:
            return []
        keys = [k for k in self.keys_of.get(tensor.float_name, []) if k != step.output]
        if keys and id(step) in self.on_cpu:
            raise self.fail(step, "a CPU node whose result is quantized twice is not simulated")
        operations = []
        for key in keys:
            builder = getattr(self, f"_{step.op_type.lower()}", None) or self._move
            with naming_the_node(step.name, step.op_type):
                data, params, kernel = builder(step, self.pos(step, key), self.range(key))
            operations.append(Operation(step.name, step.op_type, data, params, key, kernel))
        return operations

    def _spatial(self, step: Step, what: str) -> tuple[str, np.ndarray, np.ndarray, dict[str, Any]]:
        """Input key, weight values and positions, attributes of a 2-D Conv/ConvTranspose."""
        (x,) = self.data(step, (0,))
        weights, wpos = self.constant_values(step, 1)
        if weights.ndim != 4:
            raise self.fail(step, f"{weights.ndim - 2}-D {what}; allowed: 2-D")
        return x, weights, wpos, _attributes(step.node)

    def _conv(self, step: Step, out_pos: int, out_range: tuple[int, int]) -> tuple:
        x, weights, wpos, attributes = self._spatial(step, "convolution")
        ipos = self.pos(step, x)
        epilogue = self._epilogue(
            step, ipos + wpos, out_pos, out_range, 2, 1, 4, accumulator_bound(weights, self.bound(x))
        )
        geometry = Geometry.from_node_attributes(attributes, weights.shape[2:])
        kernel = ConvKernel(weights, int(attributes.get("group", 1)), geometry, epilogue, self.bound(x))
        return (x,), (), kernel

    def _convtranspose(self, step: Step, out_pos: int, out_range: tuple[int, int]) -> tuple:
        x, weights, wpos, attributes = self._spatial(step, "transposed convolution")
        if str(_text(attributes.get("auto_pad", "NOTSET"))) != "NOTSET" or "output_shape" in attributes:
            raise self.fail(step, "auto_pad or output_shape; simulated: explicit pads")
        group = int(attributes.get("group", 1))
        bound = conv_transpose_bound(weights, group, self.bound(x))
        epilogue = self._epilogue(step, self.pos(step, x) + wpos, out_pos, out_range, 2, 1, 4, bound)
        return (x,), (), ConvTransposeKernel(weights, attributes, epilogue, self.bound(x))

    def _epilogue(
        self, step: Step, acc_pos: np.ndarray, out_pos: int, out_range: tuple[int, int], bias_index: int | None,
        axis: int, ndim: int, bound: float,
    ) -> Epilogue:  # fmt: skip
        bias = bias_pos = None
        if bias_index is not None and len(step.node.input) > bias_index and step.node.input[bias_index]:
            bias, bias_pos = self.constant_values(step, bias_index)
            bias = bias.reshape(-1)
        return Epilogue(
            acc_pos=acc_pos, out_pos=out_pos, mode=self.mode, out_range=out_range, bias=bias, bias_pos=bias_pos,
            activation=self.activation(step), channel_axis=axis, acc_bound=bound, ndim=ndim,
        )  # fmt: skip

    def _gemm(self, step: Step, out_pos: int, out_range: tuple[int, int]) -> tuple:
        attributes = _attributes(step.node)
        for name, default in (("alpha", 1.0), ("beta", 1.0), ("transA", 0)):
            if attributes.get(name, default) != default:
                raise self.fail(step, f"Gemm {name}={attributes[name]}; simulated: {default}")
        (x,) = self.data(step, (0,))
        weights, wpos = self.constant_values(step, 1)
        if attributes.get("transB", 0):
            weights = weights.T
        ipos = self.pos(step, x)
        bound = accumulator_bound(weights, self.bound(x), channel_axis=1)
        epilogue = self._epilogue(step, ipos + wpos, out_pos, out_range, 2, -1, 2, bound)
        return (x,), (), MatMulKernel(weights, epilogue, self.bound(x))

    def _matmul(self, step: Step, out_pos: int, out_range: tuple[int, int]) -> tuple:
        b_key = step.data_inputs[1] if len(step.data_inputs) > 1 else None
        if b_key is not None and not self.qdq.tensors[b_key].is_constant:
            a, b = self.data(step, (0, 1))
            acc_pos = np.asarray(self.pos(step, a) + self.pos(step, b))
            shape = self.qdq.index.shape(step.node.input[1]) or []
            depth = shape[-2] if len(shape) >= 2 and isinstance(shape[-2], int) else 1 << 20
            epilogue = Epilogue(acc_pos=acc_pos, out_pos=out_pos, mode=self.mode, out_range=out_range,
                                activation=self.activation(step), acc_bound=float(depth) * self.bound(a) * self.bound(b))  # fmt: skip
            return (a, b), (), ActivationMatMulKernel(epilogue, depth, self.bound(a), self.bound(b))
        (x,) = self.data(step, (0,))
        weights, wpos = self.constant_values(step, 1)
        if weights.ndim != 2:
            raise self.fail(step, "MatMul weight of rank != 2; simulated: [K, N]")
        bound = accumulator_bound(weights, self.bound(x), channel_axis=1)
        ndim = len(self.qdq.index.shape(step.node.input[0]) or [0, 0])
        epilogue = self._epilogue(step, self.pos(step, x) + wpos, out_pos, out_range, None, -1, ndim, bound)
        return (x,), (), MatMulKernel(weights, epilogue, self.bound(x))

    def _add(self, step: Step, out_pos: int, out_range: tuple[int, int], subtract: bool = False) -> tuple:
        a, b = self.data(step, (0, 1))
        positions = (self.pos(step, a), self.pos(step, b))
        activation = self.activation(step)
        if activation is not None and activation.kind == "leaky":  # a profile's fusions may ask for it
            raise self.fail(step, "a fused LeakyRelu is not simulated after Add/Sub; allowed fused: Relu, Clip")
        kernel = AddKernel(positions, out_pos, self.mode, out_range, subtract, activation,
                           (self.bound(a), self.bound(b)))  # fmt: skip
        return (a, b), (), kernel

    def _sub(self, step: Step, out_pos: int, out_range: tuple[int, int]) -> tuple:
        return self._add(step, out_pos, out_range, subtract=True)

    def _binary(self, step: Step, out_pos: int, out_range: tuple[int, int], kind: type) -> tuple:
        a, b = self.data(step, (0, 1))
        return (a, b), (), kind((self.pos(step, a), self.pos(step, b)), out_pos, self.mode, out_range)

    def _mul(self, step: Step, out_pos: int, out_range: tuple[int, int]) -> tuple:
        return self._binary(step, out_pos, out_range, MulKernel)

    def _div(self, step: Step, out_pos: int, out_range: tuple[int, int]) -> tuple:
        return self._binary(step, out_pos, out_range, DivKernel)

    def _unary(self, step: Step) -> tuple[str, int]:
        (x,) = self.data(step, (0,))
        return x, self.pos(step, x)

    def _relu(self, step: Step, out_pos: int, out_range: tuple[int, int]) -> tuple:
        x, ipos = self._unary(step)
        kernel = ActivationKernel(self.activation_of(step.node, step), ipos, out_pos, self.mode, out_range)
        return (x,), (), Tabulated(kernel)

    _clip = _relu
    _leakyrelu = _relu

    def _hardsigmoid(self, step: Step, out_pos: int, out_range: tuple[int, int]) -> tuple:
        attributes = _attributes(step.node)
        if not is_device_hard_sigmoid(float(attributes.get("alpha", 0.2)), float(attributes.get("beta", 0.5))):
            raise self.fail(step, "HardSigmoid alpha/beta are not the device's 1/6, 0.5")
        x, ipos = self._unary(step)
        return (x,), (), Tabulated(HardSigmoidKernel(self.profile, ipos, out_pos, self.mode, out_range))

    def _prelu(self, step: Step, out_pos: int, out_range: tuple[int, int]) -> tuple:
        x, ipos = self._unary(step)
        slope, spos = self.constant_values(step, 1)
        if spos.size != 1:
            raise self.fail(step, "slope with one position per channel; simulated: one position")
        kernel = PReluKernel(slope, int(spos.reshape(-1)[0]), ipos, out_pos, self.mode, out_range)
        return (x,), (), kernel

    def _resize(self, step: Step, out_pos: int, out_range: tuple[int, int]) -> tuple:
        attributes = _attributes(step.node)
        if _text(attributes.get("mode", "nearest")) != "linear":
            return self._move(step, out_pos, out_range)
        x, ipos = self._unary(step)
        kernel = LinearResizeKernel(attributes, self.profile.resize_weight_bits, ipos, out_pos, self.mode, out_range)
        return (x,), self.params(step, 1), kernel

    def _cpu(self, step: Step) -> Operation | CpuOperation:
        """A node kept on the CPU: float on dequantized inputs (ONNX's reference
        implementation), its output quantized like the model's QuantizeLinear."""
        from onnx.reference import ReferenceEvaluator

        node = step.node
        if step.activation is not None:
            raise self.fail(step, "a fused activation on a CPU node; keep both or neither on the CPU")
        out = step.output
        opsets = {o.domain or "": o.version for o in self.model.opset_import}
        evaluator: Any = ReferenceEvaluator(node, opsets=opsets)
        self.notes.append(f"node {step.name!r}: {step.op_type} runs on the CPU in float")
        if out is None or any(o and self.qdq.quantized.get(o) is None for o in node.output):
            return self._cpu_result(step, evaluator)
        out_pos = self.pos(step, out)
        assert out is not None
        out_range = self.range(out)
        if step.op_type in ELEMENTWISE_FLOAT_OPS and len([n for n in node.input if n]) == 1:
            x, ipos = self._unary(step)

            def function(values: np.ndarray) -> np.ndarray:
                (result,) = evaluator.run(None, {node.input[0]: values.astype(np.float32)})
                return np.asarray(result, np.float64)

            kernel = TableKernel(function, ipos, out_pos, self.mode, self.range(x), out_range)
            return Operation(step.name, step.op_type, (x,), (), out, kernel)
        indices = tuple(i for i, k in enumerate(step.data_inputs) if k is not None)
        keys = self.data(step, indices)
        positions = [self.pos(step, k) for k in keys]
        others = {i: node.input[i] for i in range(len(node.input)) if i not in indices and node.input[i]}
        for name in others.values():
            value = self.qdq.constant(name)
            if value is not None:
                self.constants.setdefault(name, np.asarray(value))
        mode, dtype = self.mode, storage_dtype(*out_range)
        order = list(others)

        def run(*arguments: np.ndarray) -> np.ndarray:
            data = zip(indices, arguments[: len(indices)], positions, strict=True)
            feeds = {node.input[i]: np.ldexp(a.astype(np.float32), -p) for i, a, p in data}
            feeds.update({others[i]: v for i, v in zip(order, arguments[len(indices) :], strict=True)})
            result = evaluator.run(None, feeds)[0]
            scaled = round_values(np.ldexp(np.asarray(result, np.float64), out_pos), mode)
            return np.clip(scaled, *out_range).astype(dtype)

        return Operation(step.name, step.op_type, keys, tuple(others[i] for i in order), out, run)

    def _cpu_result(self, step: Step, evaluator: Any) -> CpuOperation:
        """A CPU node writing float (the results the planner leaves float, see
        :func:`~quant_npu.partitions.float_result_tail`): float on dequantized integer tensors
        and on earlier CPU nodes' float results, not requantized."""
        node = step.node
        integer: dict[str, tuple[str, int]] = {}
        for name, key in zip(node.input, step.data_inputs, strict=False):
            if not name:
                continue
            if key is not None and self.qdq.tensors[key].is_constant:
                self.constants.setdefault(name, self.qdq.tensors[key].real_values().astype(np.float32))
            elif key is not None:
                integer[name] = (key, self.pos(step, key))
            elif self.qdq.constant(name) is not None:
                self.constants.setdefault(name, np.asarray(self.qdq.constant(name)))
            elif name not in self.float_values and name not in self.qdq.host_values:
                raise self.fail(step, f"reads {name!r}, neither an integer tensor nor a CPU node's float result")
        quantized = {}
        for name in node.output:
            key = self.qdq.quantized.get(name) if name else None
            if key is not None:  # handed back to the NPU
                quantized[name] = (key, self.pos(step, key), self.range(key))
            elif name:
                self.float_values.add(name)
        return CpuOperation(node, evaluator, integer, quantized, self.mode)

    def _hardswish(self, step: Step, out_pos: int, out_range: tuple[int, int]) -> tuple:
        x, ipos = self._unary(step)
        return (x,), (), Tabulated(HardSwishKernel(self.profile, ipos, out_pos, self.mode, out_range))

    def _table(self, step: Step, out_pos: int, out_range: tuple[int, int], function: Callable) -> tuple:
        x, ipos = self._unary(step)
        return (x,), (), TableKernel(function, ipos, out_pos, self.mode, self.range(x), out_range)

    def _sigmoid(self, step: Step, out_pos: int, out_range: tuple[int, int]) -> tuple:
        return self._table(step, out_pos, out_range, lambda v: 1.0 / (1.0 + np.exp(-v)))

    def _tanh(self, step: Step, out_pos: int, out_range: tuple[int, int]) -> tuple:
        return self._table(step, out_pos, out_range, np.tanh)

    def _softmax(self, step: Step, out_pos: int, out_range: tuple[int, int]) -> tuple:
        x, ipos = self._unary(step)
        axis = int(_attributes(step.node).get("axis", -1 if self.opset >= 13 else 1))
        kernel = SoftmaxKernel(axis, ipos, out_pos, self.mode, self.range(x), out_range)
        if self.opset >= 13:
            return (x,), (), kernel
        flat = SoftmaxKernel(1, ipos, out_pos, self.mode, self.range(x), out_range)

        def coerced(values: np.ndarray) -> np.ndarray:
            # Before opset 13 ONNX normalises over every axis from ``axis`` on, as one
            # (the input seen as 2-D at ``axis``), not along ``axis`` alone.
            cut = axis % values.ndim
            rows = int(np.prod(values.shape[:cut], dtype=np.int64))
            return flat(values.reshape(rows, -1)).reshape(values.shape)

        return (x,), (), coerced

    def _concat(self, step: Step, out_pos: int, out_range: tuple[int, int]) -> tuple:
        keys = self.data(step, tuple(range(len(step.node.input))))
        shifts = [self.pos(step, k) - out_pos for k in keys]
        axis = int(_attributes(step.node).get("axis", 0))
        mode, dtype = self.mode, storage_dtype(*out_range)

        def concat(*parts: np.ndarray) -> np.ndarray:
            moved = [requantize(p, s, mode, *out_range, dtype) for p, s in zip(parts, shifts, strict=True)]
            return np.concatenate(moved, axis=axis)

        return keys, (), concat

    def _pool_geometry(self, step: Step) -> Geometry:
        attributes = _attributes(step.node)
        return Geometry.from_node_attributes(attributes, attributes.get("kernel_shape", ()))

    def _maxpool(self, step: Step, out_pos: int, out_range: tuple[int, int]) -> tuple:
        x, ipos = self._unary(step)
        if len(step.node.output) > 1 and step.node.output[1]:
            raise self.fail(step, "MaxPool indices output is not simulated")
        kernel = MaxPoolKernel(self._pool_geometry(step), ipos - out_pos, self.mode, self.range(x), out_range)
        return (x,), (), kernel

    def _averagepool(self, step: Step, out_pos: int, out_range: tuple[int, int]) -> tuple:
        x, ipos = self._unary(step)
        kernel = AveragePoolKernel(self._pool_geometry(step), self.profile, ipos - out_pos, self.mode, out_range)
        return (x,), (), kernel

    def _globalaveragepool(self, step: Step, out_pos: int, out_range: tuple[int, int]) -> tuple:
        x, ipos = self._unary(step)
        kernel = GlobalAveragePoolKernel(self.profile, ipos - out_pos, self.mode, out_range, first_axis=2)
        return (x,), (), kernel

    def _reducemean(self, step: Step, out_pos: int, out_range: tuple[int, int]) -> tuple:
        x, ipos = self._unary(step)
        attributes = _attributes(step.node)
        axes = attributes.get("axes")
        if axes is None and len(step.node.input) > 1 and step.node.input[1]:
            value = self.qdq.constant(step.node.input[1])
            axes = None if value is None else value.reshape(-1).tolist()
        rank = len(self.qdq.index.shape(step.node.input[0]) or [0, 0, 0, 0])
        if axes is None or sorted(int(a) % rank for a in axes) != [rank - 2, rank - 1]:
            raise self.fail(step, f"ReduceMean over axes {axes}; simulated: the last two (a global average pool)")
        keepdims = bool(attributes.get("keepdims", 1))
        return (x,), (), GlobalAveragePoolKernel(self.profile, ipos - out_pos, self.mode, out_range, keepdims)

    def _pad(self, step: Step, out_pos: int, out_range: tuple[int, int]) -> tuple:
        x, ipos = self._unary(step)
        attributes = _attributes(step.node)
        value = float(attributes.get("value", 0.0))
        if len(step.node.input) > 2 and step.node.input[2]:
            constant = self.qdq.constant(step.node.input[2])
            if constant is None:
                raise self.fail(step, "Pad value is not a constant")
            value = float(constant.reshape(-1)[0])
        lo, hi = self.range(x)
        fill = int(np.clip(round_values(np.array([np.ldexp(value, ipos)]), self.mode), lo, hi)[0])
        shift, mode, dtype = ipos - out_pos, self.mode, storage_dtype(*out_range)

        def padded(data: np.ndarray, *params: np.ndarray) -> np.ndarray:
            return requantize(pad(data, attributes, params, fill), shift, mode, *out_range, dtype)

        return (x,), self.params(step, 1), padded

    def _move(self, step: Step, out_pos: int, out_range: tuple[int, int]) -> tuple:
        x, ipos = self._unary(step)
        function = MOVES[step.op_type]
        attributes = _attributes(step.node)
        shift, mode, dtype = ipos - out_pos, self.mode, storage_dtype(*out_range)

        def move(data: np.ndarray, *params: np.ndarray) -> np.ndarray:
            return requantize(function(data, attributes, params), shift, mode, *out_range, dtype)

        return (x,), self.params(step, 1), move

    # ------------------------------------------------------------------ program
    def program(self) -> Program:
        from onnx.reference import ReferenceEvaluator

        by_node = {id(step.node): step for step in self.steps}
        absorbed = {id(step.activation) for step in self.steps if step.activation is not None}
        operations: list[Operation | HostOperation | CpuOperation] = []
        opsets = {o.domain or "": o.version for o in self.model.opset_import}
        for node in self.qdq.order:
            if node.output and node.output[0] in self.qdq.host_values:
                if node.op_type != "Constant":
                    operations.append(HostOperation(node, ReferenceEvaluator(node, opsets=opsets)))
                    for name in node.input:
                        value = self.qdq.constant(name)
                        if value is not None:
                            self.constants.setdefault(name, np.asarray(value))
                continue
            step = by_node.get(id(node))
            if step is not None:
                operations.append(self.compile(step))
                operations.extend(self.further_outputs(step))
            elif node.op_type == "QuantizeLinear" and node.input[0] in self.qdq.dequantized:
                operations.append(self.requantization(node))
            elif id(node) not in absorbed and node.op_type not in ("QuantizeLinear", "DequantizeLinear"):
                raise ModelError(f"node {node_label(node)!r} ({node.op_type}): not on the integer data path")
        for name in self.qdq.host_values:
            value = self.qdq.constant(name)
            if value is not None:
                self.constants.setdefault(name, np.asarray(value))
        return Program(
            inputs=self.inputs(), raw_inputs=self.raw_inputs(), operations=tuple(operations),
            constants=self.constants, outputs=self.outputs(), mode=self.mode, notes=tuple(self.notes),
        )  # fmt: skip

    def requantization(self, node: onnx.NodeProto) -> Operation:
        """A QuantizeLinear reading a DequantizeLinear's output (a tensor quantized twice,
        as the torch exporter writes a Concat's output before a Slice): the codes move to the
        second tensor's position, rounded once, saturated to its range."""
        source, key, name = self.qdq.dequantized[node.input[0]], node.output[0], node_label(node)
        positions = []
        for tensor in (self.qdq.tensors[source], self.qdq.tensors[key]):
            if tensor.position is None:
                message = f"{tensor.key}: {tensor.describe()} has no fix position; run quant-npu legalize first"
                raise node_error(name, node.op_type, message)
            positions.append(tensor.position)
        if self.qdq.tensors[source].is_constant and source not in self.constants:
            lo, hi = self.range(source)
            self.constants[source] = self.qdq.tensors[source].values().astype(storage_dtype(min(lo, 0), max(hi, 0)))
        shift, mode, out_range = positions[0] - positions[1], self.mode, self.range(key)
        dtype = storage_dtype(*out_range)

        def moved(codes: np.ndarray) -> np.ndarray:
            return requantize(codes, shift, mode, *out_range, dtype)

        return Operation(name, node.op_type, (source,), (), key, moved)

    def inputs(self) -> dict[str, tuple[tuple[str, QParams], ...]]:
        found: dict[str, list[tuple[str, QParams]]] = {}
        for key, quantizer in self.qdq.quantizers.items():
            source = quantizer.input[0]
            if not self.qdq.index.is_graph_input(source):
                continue
            tensor = self.qdq.tensors[key]
            if tensor.position is None:
                raise ModelError(f"input {source!r}: {tensor.describe()} has no fix position; run legalize first")
            qp = QParams.per_tensor(float(tensor.scale), int(tensor.zero_point), DType.parse(tensor.numpy_dtype.name))
            found.setdefault(source, []).append((key, qp))
        return {name: tuple(v) for name, v in found.items()}

    def raw_inputs(self) -> dict[str, tuple[str, int]]:
        return {
            key: (key, int(np.asarray(t.zero_point).reshape(-1)[0]))
            for key, t in self.qdq.tensors.items()
            if not t.is_constant and key not in self.qdq.quantizers and self.qdq.index.is_graph_input(key)
        }

    def outputs(self) -> dict[str, tuple[str, int | None]]:
        found: dict[str, tuple[str, int | None]] = {}
        for output in self.model.graph.output:
            if output.name in self.float_values:
                found[output.name] = (output.name, None)
                continue
            dq = self.qdq.producer(output.name)
            key = self.qdq.dequantized.get(output.name) if dq is not None else None
            if key is None or self.qdq.tensors[key].position is None:  # checked before use below
                raise ModelError(f"graph output {output.name!r}: not a DequantizeLinear of a fix-position tensor")
            position = self.qdq.tensors[key].position
            assert position is not None
            found[output.name] = (key, position)
        return found


def compile_program(
    model: onnx.ModelProto, profile: NPUProfile, mode: RoundMode, cpu: CpuSelection | None = None
) -> Program:
    """The integer program of a loaded QDQ model; one-line ModelError naming the node when
    an op has no integer kernel, a tensor has no fix position or a node is off the data path.
    Nodes ``cpu`` selects run in float between their quantized inputs and output."""
    return _Compiler(model, profile, mode, cpu or CpuSelection()).program()


def quantize_input(x: np.ndarray, qp: QParams, mode: RoundMode) -> np.ndarray:
    """Signed codes of a float graph input (the host's QuantizeLinear)."""
    codes = quantize(np.asarray(x, np.float32), attrs.evolve(qp, rounding=mode)).astype(np.int64) - int(qp.zero_point)
    return codes.astype(storage_dtype(qp.qmin - int(qp.zero_point), qp.qmax - int(qp.zero_point)))
