"""Direct numpy references of the layers the algorithms transform (float64)."""

from __future__ import annotations

import numpy as np

from quant_algos.layer import Layer


def conv2d(
    x: np.ndarray,
    w: np.ndarray,
    b: np.ndarray | None = None,
    strides: tuple[int, int] = (1, 1),
    pads: tuple[int, int, int, int] = (0, 0, 0, 0),
    dilations: tuple[int, int] = (1, 1),
    groups: int = 1,
) -> np.ndarray:
    """ONNX Conv (NCHW, pads top/left/bottom/right) by explicit kernel-offset sums."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    n, _, h, wd = x.shape
    cout, cin_g, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    ho = (h + pads[0] + pads[2] - dilations[0] * (kh - 1) - 1) // strides[0] + 1
    wo = (wd + pads[1] + pads[3] - dilations[1] * (kw - 1) - 1) // strides[1] + 1
    out = np.zeros((n, cout, ho, wo))
    cout_g = cout // groups
    for g in range(groups):
        xs = xp[:, g * cin_g : (g + 1) * cin_g]
        ws = w[g * cout_g : (g + 1) * cout_g]
        for i in range(kh):
            for j in range(kw):
                r0, c0 = i * dilations[0], j * dilations[1]
                patch = xs[
                    :,
                    :,
                    r0 : r0 + strides[0] * (ho - 1) + 1 : strides[0],
                    c0 : c0 + strides[1] * (wo - 1) + 1 : strides[1],
                ]
                out[:, g * cout_g : (g + 1) * cout_g] += np.einsum("nchw,oc->nohw", patch, ws[:, :, i, j])
    if b is not None:
        out += np.asarray(b, np.float64).reshape(1, -1, 1, 1)
    return out


def apply_layer(layer: Layer, x: np.ndarray, pad: int = 0) -> np.ndarray:
    if layer.weight.ndim == 2:
        y = np.asarray(x, np.float64) @ layer.weight.astype(np.float64).T
        return y if layer.bias is None else y + layer.bias
    return conv2d(x, layer.weight, layer.bias, pads=(pad,) * 4, groups=layer.groups)


def relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0.0)


def chain(layers: list[Layer], x: np.ndarray, pad: int = 0) -> np.ndarray:
    """``layers`` with Relu between them (none after the last)."""
    y = x
    for i, layer in enumerate(layers):
        y = apply_layer(layer, y, pad)
        if i < len(layers) - 1:
            y = relu(y)
    return y


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
