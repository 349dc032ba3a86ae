"""Stop listing initializers as graph inputs (IR < 4 exporters did) so they count as constants."""

from __future__ import annotations

import onnx

from quant_onnx.graph_edit import copy_model


def initializers_to_constants(model: onnx.ModelProto) -> onnx.ModelProto:
    """Return a copy of `model` whose graph inputs no longer include initializers.

    Such inputs could be overridden by a feed; a quantized model must not be, so they become constants.
    """
    out = copy_model(model)
    initializers_to_constants_inplace(out)
    return out


def initializers_to_constants_inplace(model: onnx.ModelProto) -> int:
    """In-place version; returns the number of graph inputs removed."""
    graph = model.graph
    names = {t.name for t in graph.initializer}
    keep = [v for v in graph.input if v.name not in names]
    removed = len(graph.input) - len(keep)
    del graph.input[:]
    graph.input.extend(keep)
    if removed:
        model.ir_version = max(model.ir_version, 4)
    return removed
