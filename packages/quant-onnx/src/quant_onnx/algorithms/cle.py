"""Cross-layer equalization of a float ONNX model (pre-pass, before calibration): the
ONNX side of :mod:`quant_algos.drivers.cle`.

The driver decides (chains, the ReLU6 rule, high-bias absorption, the new weights) on
the model mapped onto the planner's graph protocol, with onnxruntime as its tensor
source over the first ``CLEConfig.num_samples`` calibration samples; this module writes
the rescaled weights and biases into a new model and turns the chosen Clip(0, 6) nodes
into Relu. The input model is not modified.

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

from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np
import onnx
from onnx import helper

from quant_algos.drivers.cle import CLEReport, plan_equalization
from quant_core.algorithm_config import CLEConfig
from quant_core.onnx_qdq.graph import GraphIndex
from quant_onnx.algorithms.capture import Feeds, TensorCapture, prepare_batches
from quant_onnx.algorithms.channel_scaling import write_layers
from quant_onnx.graph_edit import copy_model
from quant_onnx.pipeline.annotate import plan_graph

__all__ = ["CLEReport", "FloatTensors", "apply_cle"]


class FloatTensors:
    """The driver's :class:`~quant_algos.drivers.cle.TensorSource`: ``model``'s tensors over
    ``batches`` through onnxruntime.

    Example:
        >>> FloatTensors(onnx.ModelProto(), []).batches
        []
    """

    def __init__(self, model: onnx.ModelProto, batches: Sequence[Feeds]) -> None:
        self.model = model
        self.batches = list(batches)

    def tensors(self, names: Sequence[str]) -> Iterator[Mapping[str, np.ndarray]]:
        yield from TensorCapture(self.model, names).iterate(self.batches)


def _replace_with_relu(model: onnx.ModelProto, names: set[str]) -> None:
    for i, node in enumerate(model.graph.node):
        if node.name in names:
            model.graph.node[i].CopyFrom(helper.make_node("Relu", [node.input[0]], list(node.output), name=node.name))


def apply_cle(
    model: onnx.ModelProto, config: CLEConfig, batches: Iterable[Feeds] | None = None
) -> tuple[onnx.ModelProto, CLEReport]:
    """Cross-layer equalization of ``model`` (pre-processed float model: BatchNorm
    folded, weights as initializers). Returns a new model and a :class:`CLEReport`.

    Args:
        model: the float model.
        config: steps, tolerance, ReLU6 replacement, bias in scale, high-bias absorption,
            the samples to measure.
        batches: calibration feeds (first ``config.num_samples`` samples), for the ReLU6
            check and high-bias absorption; without them both are done blind or skipped.
    """
    source = None if batches is None else FloatTensors(model, prepare_batches(batches, config.num_samples))
    index = GraphIndex(model.graph)
    equalization = plan_equalization(
        plan_graph(model), config, source, writable=lambda name: index.initializer_proto(name) is not None
    )
    out = copy_model(model)
    _replace_with_relu(out, set(equalization.report.replaced_relu6))
    write_layers(out, equalization.layers, equalization.refs)
    return out, equalization.report
