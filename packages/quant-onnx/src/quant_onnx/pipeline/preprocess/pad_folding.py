"""Fold constant zero Pads on spatial dims into the `pads` attribute of the Conv(s) reading them.

onnxruntime has no integer Pad kernel, so an explicit Pad before a Conv keeps the activation in float
between a DequantizeLinear and a QuantizeLinear.  Only Conv is handled: MaxPool pads with -inf and
AveragePool's count_include_pad would change results, so those Pads stay.
"""

from __future__ import annotations

import numpy as np
import onnx

from quant_core.onnx_qdq.graph import GraphIndex, is_default_domain, node_attribute
from quant_core.plan import pads_keep_channels
from quant_onnx.graph_edit import copy_model, remove_nodes, set_attr


def fold_pads(model: onnx.ModelProto) -> onnx.ModelProto:
    """Return a copy of `model` with foldable Pad -> Conv pairs merged into the Conv."""
    out = copy_model(model)
    fold_pads_inplace(out)
    return out


def fold_pads_inplace(model: onnx.ModelProto) -> int:
    """In-place version; returns the number of Pad nodes removed."""
    graph = model.graph
    index = GraphIndex(graph)
    doomed: list[onnx.NodeProto] = []
    for pad in graph.node:
        if pad.op_type != "Pad" or not is_default_domain(pad):
            continue
        padded = pad.output[0]
        convs = index.consumers(padded)
        if not convs or index.is_graph_output(padded):
            continue
        if any(c.op_type != "Conv" or not is_default_domain(c) or list(c.input).count(padded) != 1 for c in convs):
            continue
        if any(c.input[0] != padded for c in convs):
            continue
        spatial = _spatial_pads(pad, index)
        if spatial is None:
            continue
        if not all(_conv_accepts(c, len(spatial) // 2) for c in convs):
            continue
        for conv in convs:
            old = list(node_attribute(conv, "pads", [0] * len(spatial)))
            if node_attribute(conv, "auto_pad", b"NOTSET") in (b"VALID", "VALID"):
                # VALID ignores `pads`; NOTSET with explicit pads is the same convolution.
                set_attr(conv, "auto_pad", "NOTSET")
                old = [0] * len(spatial)
            set_attr(conv, "pads", [int(a) + int(b) for a, b in zip(old, spatial, strict=True)])
            conv.input[0] = pad.input[0]
        doomed.append(pad)
    remove_nodes(graph, doomed)
    return len(doomed)


def _spatial_pads(pad: onnx.NodeProto, index: GraphIndex) -> list[int] | None:
    """Pads of the spatial dims as [x1_begin, x2_begin, ..., x1_end, ...] if the Pad is foldable."""
    if node_attribute(pad, "mode", b"constant") not in (b"constant", "constant"):
        return None
    if len(pad.input) < 2:
        return None  # opset < 11 form (pads attribute) is out of scope; the version converter rewrites it
    pads = index.constant(pad.input[1])
    if pads is None:
        return None
    pads = np.asarray(pads, dtype=np.int64).reshape(-1)
    if len(pad.input) > 2 and pad.input[2]:
        fill = index.constant(pad.input[2])
        if fill is None or np.any(np.asarray(fill) != 0):
            return None
    rank_shape = index.shape(pad.input[0])
    if len(pad.input) > 3 and pad.input[3]:
        axes = index.constant(pad.input[3])
        if axes is None or rank_shape is None:
            return None
        rank = len(rank_shape)
        full = np.zeros(2 * rank, dtype=np.int64)
        axes = np.asarray(axes, dtype=np.int64).reshape(-1)
        if len(pads) != 2 * len(axes):
            return None
        for i, axis in enumerate(axes):
            full[int(axis) % rank] = pads[i]
            full[rank + int(axis) % rank] = pads[len(axes) + i]
        pads = full
    rank = len(pads) // 2
    if rank < 3 or np.any(pads < 0):
        return None  # negative pads crop; nothing to fold
    if not pads_keep_channels(pads):
        return None  # padding batch or channel dims is not a convolution padding
    begins, ends = pads[:rank], pads[rank:]
    return [int(v) for v in begins[2:]] + [int(v) for v in ends[2:]]


def _conv_accepts(conv: onnx.NodeProto, spatial_rank: int) -> bool:
    auto_pad = node_attribute(conv, "auto_pad", b"NOTSET")
    if auto_pad not in (b"NOTSET", "NOTSET", b"VALID", "VALID"):
        return False
    pads = node_attribute(conv, "pads", None)
    return pads is None or len(pads) == 2 * spatial_rank  # type: ignore[arg-type]
