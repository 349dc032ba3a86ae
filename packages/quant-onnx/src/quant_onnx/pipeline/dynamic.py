"""Dynamic quantization: weights quantized offline, activations at run time.

For users of ``onnxruntime.quantization.quantize_dynamic``; no calibration data. Each
Conv, MatMul and Gemm with a constant weight becomes::

    x -> DynamicQuantizeLinear -> (x_q uint8, x_scale, x_zp)     (one per input tensor)
    ConvInteger / MatMulInteger(x_q, w_q int8, x_zp, 0) -> int32
    Cast(float) * (x_scale * w_scale) [+ bias] -> y

Weights are symmetric (zero point 0), per channel along the output-channel axis when
the config's weight spec is per channel; ``DynamicQuantizeLinear`` fixes the activation
format (uint8, asymmetric, per tensor). A node whose weight spec is not 8-bit symmetric
stays float, with a note logged; a config under which no node can be quantized for that
reason (``w4a8``) is refused, as is an ``exclude`` entry or ``name_overrides`` glob that
matches no node (as in static mode).

Example:
    >>> import numpy as np
    >>> from onnx import helper, numpy_helper, TensorProto
    >>> w = numpy_helper.from_array(np.ones((3, 2), np.float32), "w")
    >>> g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
    ...     [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
    ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])], [w])
    >>> m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    >>> [n.op_type for n in quantize_dynamic_model(m).graph.node]
    ['DynamicQuantizeLinear', 'MatMulInteger', 'Cast', 'Mul', 'Mul']
"""

from __future__ import annotations

import logging
import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from quant_core.config import QuantConfig
from quant_core.dtypes import DType
from quant_core.errors import ConfigError
from quant_core.onnx_qdq.graph import GraphIndex, is_default_domain, node_attribute, node_inputs, plan_node
from quant_core.onnx_qdq.model_io import check_output_path, load_float_model, save_model
from quant_core.plan import check_selectors, resolve_weight_spec
from quant_core.qparams import quantize
from quant_core.spec import QuantSpec
from quant_core.weights import constant_qparams
from quant_onnx.pipeline.annotate import ensure_node_names
from quant_onnx.pipeline.preprocess import PreprocessOptions, preprocess

_DYNAMIC_OPS = ("Conv", "MatMul", "Gemm")
_CONV_ATTRIBUTES = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")
_LOG = logging.getLogger(__name__)


class _DynamicWriter:
    def __init__(self, model: onnx.ModelProto, config: QuantConfig) -> None:
        self.model = model
        self.graph = model.graph
        self.config = config
        self.index = GraphIndex(self.graph)
        self.quantized_inputs: dict[str, tuple[str, str, str]] = {}
        self.replaced: set[str] = set()
        self.notes: list[str] = []
        self.rewritten = 0
        self.unusable_specs: list[QuantSpec] = []

    def name(self, prefix: str) -> str:
        return self.index.unique_name(prefix)

    def const(self, prefix: str, value: np.ndarray) -> str:
        name = self.name(prefix)
        self.graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def weight_spec(self, node: onnx.NodeProto) -> QuantSpec | None:
        cfg = self.config.for_node(node.name, node.op_type)
        spec = None if cfg is None else cfg.weight
        if spec is None or not spec.is_quantized:
            return None
        if spec.dtype not in (DType.INT8, DType.UINT8) or not spec.symmetric:
            self.unusable_specs.append(spec)
            self.notes.append(f"node {node.name!r}: dynamic mode needs an 8-bit symmetric weight spec; kept float")
            return None
        return spec.evolve(dtype=DType.INT8)

    def dynamic_input(self, tensor: str, out: list[onnx.NodeProto]) -> tuple[str, str, str]:
        if tensor not in self.quantized_inputs:
            outputs = (
                self.name(f"{tensor}_quantized"),
                self.name(f"{tensor}_scale"),
                self.name(f"{tensor}_zero_point"),
            )
            out.append(
                helper.make_node(
                    "DynamicQuantizeLinear", [tensor], list(outputs), name=self.name(f"{tensor}_DynamicQuantizeLinear")
                )
            )
            self.quantized_inputs[tensor] = outputs
        return self.quantized_inputs[tensor]

    def rewrite(self, node: onnx.NodeProto, out: list[onnx.NodeProto]) -> bool:
        if node.op_type not in _DYNAMIC_OPS or not is_default_domain(node) or len(node.input) < 2:
            return False
        weight = self.index.constant(node.input[1])
        if weight is None or weight.dtype != np.float32:
            return False
        spec = self.weight_spec(node)
        if spec is None:
            return False
        bias = self.index.constant(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        if node.op_type == "MatMul" and weight.ndim != 2:
            return False
        spec, note = resolve_weight_spec(plan_node(node), spec, weight.ndim)
        if note is not None:
            self.notes.append(note)
        if node.op_type == "Gemm":
            if int(node_attribute(node, "transA", 0)) != 0 or (len(node.input) > 2 and node.input[2] and bias is None):
                return False
            if int(node_attribute(node, "transB", 0)):
                weight = weight.T  # stored [K, N] here: the output channels move to axis 1
                spec = spec if spec.per_channel_axis is None else spec.evolve(per_channel_axis=1)
            weight = (weight * np.float32(node_attribute(node, "alpha", 1.0))).astype(np.float32)
            if bias is not None:
                bias = (bias * np.float32(node_attribute(node, "beta", 1.0))).astype(np.float32)
        is_conv = node.op_type == "Conv"
        qp = constant_qparams(weight, spec)
        base = node.input[1]
        w_q = self.const(f"{base}_quantized", quantize(weight, qp))
        w_zp = self.const(f"{base}_zero_point", np.zeros((), np.int8))
        x_q, x_scale, x_zp = self.dynamic_input(node.input[0], out)
        acc = self.name(f"{node.name}_int32")
        if is_conv:
            attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name in _CONV_ATTRIBUTES}
            out.append(
                helper.make_node(
                    "ConvInteger",
                    [x_q, w_q, x_zp, w_zp],
                    [acc],
                    name=self.name(f"{node.name}_ConvInteger"),
                    **attributes,
                )
            )
        else:
            out.append(
                helper.make_node(
                    "MatMulInteger", [x_q, w_q, x_zp, w_zp], [acc], name=self.name(f"{node.name}_MatMulInteger")
                )
            )
        shape = (-1,) + (1,) * (weight.ndim - 2) if is_conv else (-1,)  # the output's channel axis
        w_scale = self.const(
            f"{base}_scale", np.asarray(qp.scale, np.float32).reshape(shape if qp.axis is not None else ())
        )
        as_float = self.name(f"{node.name}_float")
        out.append(
            helper.make_node("Cast", [acc], [as_float], to=TensorProto.FLOAT, name=self.name(f"{node.name}_Cast"))
        )
        scale = self.name(f"{node.name}_scale")
        out.append(helper.make_node("Mul", [x_scale, w_scale], [scale], name=self.name(f"{node.name}_scale_Mul")))
        result = node.output[0]
        scaled = result if bias is None else self.name(f"{node.name}_scaled")
        out.append(helper.make_node("Mul", [as_float, scale], [scaled], name=self.name(f"{node.name}_Mul")))
        if bias is not None:
            b = bias.reshape(shape) if is_conv else bias
            b_name = self.const(f"{node.input[2]}_bias", b.astype(np.float32))
            out.append(helper.make_node("Add", [scaled, b_name], [result], name=self.name(f"{node.name}_bias_Add")))
            self.replaced.add(node.input[2])
        self.replaced.add(node.input[1])
        self.rewritten += 1
        return True

    def run(self) -> onnx.ModelProto:
        nodes: list[onnx.NodeProto] = []
        for node in self.graph.node:
            if not self.rewrite(node, nodes):
                nodes.append(node)
        # An If/Loop branch reads outer names implicitly: they are used too.
        used = {name for node in nodes for name in node_inputs(node)} | {o.name for o in self.graph.output}
        del self.graph.node[:]
        self.graph.node.extend(nodes)
        kept = [t for t in self.graph.initializer if t.name in used or t.name not in self.replaced]
        del self.graph.initializer[:]
        self.graph.initializer.extend(kept)
        return self.model


def quantize_dynamic_model(
    model: onnx.ModelProto | str | os.PathLike[str] | bytes,
    config: QuantConfig | str | None = None,
    *,
    preprocess_options: PreprocessOptions | None = None,
) -> onnx.ModelProto:
    """The dynamically quantized model (see the module docstring); ``model`` is not
    modified. ``config``: only the weight specs (and exclusions) are used; default a8w8."""
    from quant_core.presets import resolve_config

    quant_config = resolve_config(config)
    # Refused as in static mode: a float16 graph's ops would all stay float, and a quantized
    # one would be quantized a second time, both reported as success.
    float_model = preprocess(load_float_model(model), preprocess_options)
    ensure_node_names(float_model)
    check_selectors(quant_config, ((node.name, node.op_type) for node in float_model.graph.node))
    writer = _DynamicWriter(float_model, quant_config)
    quantized = writer.run()
    if writer.unusable_specs and not writer.rewritten:
        # An all-float "quantized" model is never what was asked for: say so instead of writing it.
        spec = writer.unusable_specs[0]
        form = "symmetric" if spec.symmetric else "asymmetric"
        raise ConfigError(
            f"weight: {spec.dtype.value} {form} (config {quant_config.name!r}) cannot be quantized dynamically, "
            "so no node would be; allowed: int8 or uint8 symmetric weights, such as preset a8w8"
        )
    for note in writer.notes:
        _LOG.warning(note)
    return quantized


def float_nodes(model: onnx.ModelProto) -> list[tuple[str, str]]:
    """``(name, op_type)`` of the Conv, MatMul and Gemm nodes a dynamically quantized
    ``model`` still runs in float (every quantized one became an integer op)."""
    return [(node.name, node.op_type) for node in model.graph.node if node.op_type in _DYNAMIC_OPS]


def quantize_dynamic(
    model_in: str | os.PathLike[str] | onnx.ModelProto,
    model_out: str | os.PathLike[str],
    config: QuantConfig | str | None = None,
    *,
    preprocess_options: PreprocessOptions | None = None,
) -> onnx.ModelProto:
    """Quantize dynamically and write ``model_out`` atomically (never over the input; its
    folder must exist and be writable, checked first)."""
    input_path = model_in if isinstance(model_in, str | os.PathLike) else None
    check_output_path(model_out, input_path=input_path)
    quantized = quantize_dynamic_model(model_in, config, preprocess_options=preprocess_options)
    save_model(quantized, model_out, input_path=input_path)
    return quantized
