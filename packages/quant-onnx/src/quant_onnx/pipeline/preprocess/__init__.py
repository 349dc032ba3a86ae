"""Pre-processing of float ONNX models before quantization.

`preprocess` returns a new model in which every weight is an initializer that reaches its Conv/Gemm
directly: Constant nodes become initializers, Identity wrappers go, shape arithmetic is folded,
BatchNormalization is merged into Conv/ConvTranspose/Gemm, zero Pads are merged into Convs, dead
nodes and unused initializers are dropped and the opset is at least 13.  The input is never modified.

Example:
    >>> import numpy as np
    >>> from onnx import TensorProto, helper, numpy_helper
    >>> from quant_onnx.pipeline.preprocess import PreprocessOptions, preprocess
    >>> w = numpy_helper.from_array(np.ones((2, 1, 1, 1), np.float32), "w")
    >>> bn = [numpy_helper.from_array(np.ones(2, np.float32), n) for n in ("g", "b", "m", "v")]
    >>> x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4])
    >>> y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 4, 4])
    >>> nodes = [helper.make_node("Conv", ["x", "w"], ["c"]),
    ...          helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["y"])]
    >>> m = helper.make_model(helper.make_graph(nodes, "g", [x], [y], [w, *bn]),
    ...                       opset_imports=[helper.make_opsetid("", 11)])
    >>> out = preprocess(m, PreprocessOptions())
    >>> [n.op_type for n in out.graph.node], out.opset_import[0].version
    (['Conv'], 13)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import attrs
import onnx

from quant_core.conversions import parse_conversions
from quant_core.errors import ConfigError
from quant_core.onnx_qdq.model_io import check_model
from quant_onnx.pipeline.preprocess.bn_folding import fold_batchnorm, fold_batchnorm_inplace
from quant_onnx.pipeline.preprocess.constant_folding import fold_constants, fold_constants_inplace
from quant_onnx.pipeline.preprocess.constants_to_initializers import (
    constants_to_initializers,
    constants_to_initializers_inplace,
)
from quant_onnx.pipeline.preprocess.dead_node_removal import remove_dead_nodes, remove_dead_nodes_inplace
from quant_onnx.pipeline.preprocess.identity_elimination import eliminate_identities, eliminate_identities_inplace
from quant_onnx.pipeline.preprocess.initializer_inputs import (
    initializers_to_constants,
    initializers_to_constants_inplace,
)
from quant_onnx.pipeline.preprocess.npu_conversions import apply_npu_conversions, apply_npu_conversions_inplace
from quant_onnx.pipeline.preprocess.opset import default_target_opset, upgrade_opset
from quant_onnx.pipeline.preprocess.pad_folding import fold_pads, fold_pads_inplace
from quant_onnx.pipeline.preprocess.relu6_to_relu import relu6_to_relu, relu6_to_relu_inplace
from quant_onnx.pipeline.preprocess.shape_inference import infer_shapes, infer_shapes_inplace

__all__ = [
    "PreprocessOptions",
    "PreprocessResult",
    "apply_npu_conversions",
    "constants_to_initializers",
    "default_target_opset",
    "eliminate_identities",
    "fold_batchnorm",
    "fold_constants",
    "fold_pads",
    "infer_shapes",
    "initializers_to_constants",
    "preprocess",
    "preprocess_with_report",
    "relu6_to_relu",
    "remove_dead_nodes",
    "upgrade_opset",
]

_LOG = logging.getLogger(__name__)


def _npu_conversions(value: object) -> tuple[str, ...]:
    return parse_conversions(value)  # type: ignore[arg-type]


@attrs.frozen(kw_only=True)
class PreprocessOptions:
    """Which pre-processing passes run (all exact ones on by default; relu6_to_relu is opt-in).

    `npu_conversions` names :mod:`quant_core.conversions` rules applied to the float graph (the
    quantizer sets it from ``QuantConfig.npu_conversions``).
    `target_opset=None` means max(13, model opset).  Initializers that old exporters also listed as
    graph inputs are always treated as constants and dropped from the inputs.

    Example:
        >>> PreprocessOptions(relu6_to_relu=True, target_opset=17).fold_batchnorm
        True
    """

    constants_to_initializers: bool = True
    eliminate_identities: bool = True
    fold_constants: bool = True
    fold_batchnorm: bool = True
    fold_pads: bool = True
    relu6_to_relu: bool = False
    npu_conversions: tuple[str, ...] = attrs.field(default=(), converter=_npu_conversions)
    remove_dead_nodes: bool = True
    target_opset: int | None = attrs.field(default=None)
    check: bool = True

    @target_opset.validator
    def _check_opset(self, _attribute: attrs.Attribute, value: int | None) -> None:
        if value is not None and not (isinstance(value, int) and 13 <= value <= 23):
            raise ConfigError(f"PreprocessOptions.target_opset must be None or an int from 13 to 23, got {value!r}")


@attrs.frozen
class PreprocessResult:
    """A pre-processed model and how many edits each pass made (pass name -> count).

    Example:
        >>> PreprocessResult(onnx.ModelProto(), {"fold_batchnorm": 2}).changes["fold_batchnorm"]
        2
    """

    model: onnx.ModelProto
    changes: dict[str, int]


def preprocess(model: onnx.ModelProto, options: PreprocessOptions | None = None) -> onnx.ModelProto:
    """Return a pre-processed copy of `model` (see the module docstring); `model` is not touched."""
    return preprocess_with_report(model, options).model


def preprocess_with_report(model: onnx.ModelProto, options: PreprocessOptions | None = None) -> PreprocessResult:
    """Like `preprocess`, also returning per-pass edit counts (for reports and logs)."""
    opts = options or PreprocessOptions()
    changes: dict[str, int] = {}
    # upgrade_opset always returns a copy; the passes below edit that copy in place.
    out = upgrade_opset(model, opts.target_opset)
    steps: list[tuple[str, bool, Callable[[onnx.ModelProto], object]]] = [
        ("initializers_to_constants", True, initializers_to_constants_inplace),
        ("constants_to_initializers", opts.constants_to_initializers, constants_to_initializers_inplace),
        ("eliminate_identities", opts.eliminate_identities, eliminate_identities_inplace),
        ("fold_constants", opts.fold_constants, fold_constants_inplace),
        ("fold_batchnorm", opts.fold_batchnorm, fold_batchnorm_inplace),
        ("fold_pads", opts.fold_pads, fold_pads_inplace),
        ("relu6_to_relu", opts.relu6_to_relu, relu6_to_relu_inplace),
        (
            "npu_conversions",
            bool(opts.npu_conversions),
            partial(apply_npu_conversions_inplace, rules=opts.npu_conversions),
        ),
        # Folding BN / Pads can leave newly constant chains and orphaned weights.
        ("fold_constants_again", opts.fold_constants, fold_constants_inplace),
        ("remove_dead_nodes", opts.remove_dead_nodes, remove_dead_nodes_inplace),
    ]
    for name, enabled, apply in steps:
        if enabled:
            changes[name] = int(apply(out))  # type: ignore[call-overload]
            _LOG.debug("preprocess %s: %d change(s)", name, changes[name])
    infer_shapes_inplace(out, refresh=True)
    if opts.check:
        check_model(out, "pre-processed model")
    return PreprocessResult(out, changes)
