"""Writing QDQ tensors into an ONNX model: fresh names, integer initializers (4-bit
packed), qparam initializers and QuantizeLinear/DequantizeLinear nodes in the domain
their format needs. The ONNX backend's writer and the NPU legaliser add Q/DQ through a
:class:`QDQBuilder`, so a 16-bit pair below opset 21, a per-channel axis or a 4-bit
initializer is written one way; the torch backend's export, which writes its nodes as it
walks torch's graph at an opset that takes every format it stores, stores its integer
initializers with :func:`tensor_proto`.

Example:
    >>> import numpy as np
    >>> from onnx import helper
    >>> model = helper.make_model(helper.make_graph([], "g", [], []), opset_imports=[helper.make_opsetid("", 13)])
    >>> builder = QDQBuilder(model)
    >>> qp = QParams.per_tensor(0.5, 0, "int16")
    >>> node = builder.qdq_node("QuantizeLinear", "x", "xq", builder.qparam_initializers("x", qp), qp)
    >>> node.domain, builder.contrib_domain_used, [t.name for t in model.graph.initializer]
    ('com.microsoft', True, ['x_scale', 'x_zero_point'])
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from quant_core.dtypes import DType
from quant_core.onnx_qdq.graph import DEFAULT_DOMAINS, GraphIndex, int_attribute
from quant_core.onnx_qdq.tensor_types import ONNX_DTYPES
from quant_core.qdq import required_opset
from quant_core.qparams import QParams

CONTRIB_DOMAIN = "com.microsoft"
"""onnxruntime's contrib domain: its QuantizeLinear/DequantizeLinear take 16-bit types at any opset."""

QUANTIZE = "QuantizeLinear"
DEQUANTIZE = "DequantizeLinear"


def default_opset(model: onnx.ModelProto) -> int:
    """The model's default-domain opset (0 when it declares none).

    Example:
        >>> default_opset(helper.make_model(helper.make_graph([], "g", [], []),
        ...     opset_imports=[helper.make_opsetid("", 17)]))
        17
    """
    return next((int(o.version) for o in model.opset_import if o.domain in DEFAULT_DOMAINS), 0)


def exact_int32(values: np.ndarray) -> tuple[np.ndarray, QParams]:
    """A float32 vector as int32 codes times one power-of-two scale per element (axis 0),
    zero point 0: a DequantizeLinear of these gives back ``values`` bit for bit (each code
    is the 24-bit mantissa, exact in float32; scaling by a power of two is exact).

    Example:
        >>> codes, qp = exact_int32(np.array([0.1, -3.0, 0.0], np.float32))
        >>> bool(np.array_equal(codes.astype(np.float32) * qp.scale, np.array([0.1, -3.0, 0.0], np.float32)))
        True
    """
    value = np.asarray(values, np.float32).reshape(-1)
    _mantissa, exponent = np.frexp(value)
    scale = np.ldexp(np.float32(1.0), np.maximum(exponent - 24, -149)).astype(np.float32)  # 2**-149: smallest float32
    codes = np.rint(value.astype(np.float64) / scale.astype(np.float64)).astype(np.int32)
    zero_point = np.zeros(value.shape, np.int64)
    return codes, QParams(scale=scale, zero_point=zero_point, dtype=DType.INT32, axis=0)


def output_channels(node: onnx.NodeProto, weight_shape: tuple[int, ...]) -> int:
    """Length of a Conv/ConvTranspose/Gemm bias (its output channels) given its weight's shape.

    Example:
        >>> output_channels(helper.make_node("Gemm", ["a", "b"], ["y"], transB=1), (4, 3))
        4
    """
    if node.op_type == "ConvTranspose":
        return int(weight_shape[1]) * int_attribute(node, "group", 1)
    if node.op_type == "Gemm" and not int_attribute(node, "transB", 0):
        return int(weight_shape[1])
    return int(weight_shape[0])


def tensor_proto(name: str, value: np.ndarray, dtype: DType | None = None) -> onnx.TensorProto:
    """An initializer ``name`` holding ``value`` (4-bit formats packed as ONNX stores them).

    Example:
        >>> tensor_proto("w", np.array([1, -2], np.int8), DType.INT4).data_type == onnx.TensorProto.INT4
        True
    """
    if dtype in (DType.INT4, DType.UINT4):
        return helper.make_tensor(name, ONNX_DTYPES[dtype], value.shape, np.asarray(value).reshape(-1).tolist())
    return numpy_helper.from_array(np.array(value, order="C"), name)


class QDQBuilder:
    """Adds initializers and Q/DQ nodes to ``model`` (edited in place: callers pass their
    own copy). New names never collide with a name the graph uses or this builder gave.

    ``contrib_domain_used`` says whether a 16-bit pair went to :data:`CONTRIB_DOMAIN`
    (the model's opset is below the 21 standard ONNX needs for 16-bit Q/DQ);
    :func:`quant_core.onnx_qdq.finish.finish_for_onnxruntime` declares that domain and
    notes it.
    """

    def __init__(self, model: onnx.ModelProto, index: GraphIndex | None = None) -> None:
        self.model = model
        self.graph = model.graph
        self.index = index if index is not None else GraphIndex(model.graph)
        self.opset = default_opset(model)
        self.contrib_domain_used = False

    def unique_name(self, prefix: str) -> str:
        return self.index.unique_name(prefix)

    def initializer(self, prefix: str, value: np.ndarray, dtype: DType | None = None) -> str:
        """A new initializer named after ``prefix`` holding ``value``; its name."""
        name = self.index.unique_name(prefix)
        self.graph.initializer.append(tensor_proto(name, value, dtype))
        return name

    def qparam_initializers(self, base: str, qp: QParams) -> tuple[str, str]:
        """``{base}_scale`` and ``{base}_zero_point`` initializers of ``qp`` (zero point in its dtype)."""
        scale = self.initializer(f"{base}_scale", np.asarray(qp.scale, np.float32))
        zero_point = np.asarray(qp.zero_point).astype(qp.dtype.numpy_dtype)
        return scale, self.initializer(f"{base}_zero_point", zero_point, qp.dtype)

    def domain_for(self, dtype: DType) -> str:
        """The default domain, or the contrib domain for a 16-bit pair below opset 21."""
        if dtype.bits == 16 and self.opset < required_opset([dtype]):
            self.contrib_domain_used = True
            return CONTRIB_DOMAIN
        return ""

    def qdq_node(self, op: str, source: str, output: str, params: tuple[str, str], qp: QParams) -> onnx.NodeProto:
        """A ``QuantizeLinear``/``DequantizeLinear`` (``op``) of ``source`` into ``output``
        with the qparam initializers ``params`` of ``qp`` (its ``axis`` when per channel).
        The node is returned, not placed: the caller puts it in order."""
        name = self.index.unique_name(f"{output}_{op}")
        domain = self.domain_for(qp.dtype)
        # An explicit empty domain would be serialized: standard nodes leave it unset.
        node = helper.make_node(op, [source, *params], [output], name=name, **({"domain": domain} if domain else {}))
        if qp.axis is not None:
            node.attribute.append(helper.make_attribute("axis", int(qp.axis)))
        return node

    def dequantized_constant(self, prefix: str, codes: np.ndarray, qp: QParams) -> tuple[onnx.NodeProto, str]:
        """``codes`` as an integer initializer behind a new DequantizeLinear (returned, not
        placed) and the name of the float tensor it writes."""
        quantized = self.initializer(f"{prefix}_quantized", codes, qp.dtype)
        params = self.qparam_initializers(prefix, qp)
        output = self.index.unique_name(f"{prefix}_DequantizeLinear_Output")
        return self.qdq_node(DEQUANTIZE, quantized, output, params, qp), output
