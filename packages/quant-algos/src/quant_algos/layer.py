"""``Layer``: the weight and bias of one Conv/Gemm as plain numpy arrays, and the
per-channel operations the closed-form algorithms (CLE, SmoothQuant) share.

Weights follow the ONNX/PyTorch layout: ``[Cout, Cin/groups, kh, kw]`` for a
convolution (any number of spatial dims), ``[out, in]`` for a fully connected layer
(a backend transposes a MatMul ``[in, out]`` weight or a ``Gemm(transB=0)`` weight
before and after).

Example:
    >>> import numpy as np
    >>> conv = Layer(np.ones((4, 2, 3, 3), np.float32), np.zeros(4, np.float32))
    >>> conv.out_channels, conv.in_channels, conv.is_depthwise
    (4, 2, False)
    >>> scale_outputs(conv, np.full(4, 2.0)).weight[0, 0, 0, 0]
    np.float32(0.5)
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from quant_core.errors import ModelError


def _as_weight(value: object) -> np.ndarray:
    w = np.asarray(value)
    if w.ndim < 2:
        raise ModelError(f"weight: rank {w.ndim} is not allowed; allowed: 2 ([out, in]) or >= 3 ([Cout, Cin/g, k...])")
    if not np.issubdtype(w.dtype, np.floating):
        raise ModelError(f"weight: dtype {w.dtype} is not allowed; allowed: a float dtype")
    return w


def _as_bias(value: object) -> np.ndarray | None:
    return None if value is None else np.asarray(value)


@attrs.frozen(eq=False)
class Layer:
    """Weight (and bias) of one Conv or Gemm layer.

    Args:
        weight: ``[Cout, Cin/groups, k...]`` or ``[out, in]``.
        bias: ``[Cout]`` or None.
        groups: the convolution's ``group`` attribute (1 for Gemm).

    Example:
        >>> import numpy as np
        >>> dw = Layer(np.ones((8, 1, 3, 3), np.float32), None, groups=8)
        >>> dw.is_depthwise, dw.in_channels
        (True, 8)
    """

    weight: np.ndarray = attrs.field(converter=_as_weight)
    bias: np.ndarray | None = attrs.field(default=None, converter=_as_bias)
    groups: int = 1

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.groups, int) or self.groups < 1 or self.weight.shape[0] % self.groups:
            raise ModelError(
                f"groups: {self.groups!r} is not allowed; allowed: a positive divisor of Cout={self.weight.shape[0]}"
            )
        if self.weight.ndim == 2 and self.groups != 1:
            raise ModelError("groups: a 2-D [out, in] weight must have groups=1")
        if self.bias is not None and self.bias.shape != (self.weight.shape[0],):
            raise ModelError(f"bias: shape {self.bias.shape} does not match Cout={self.weight.shape[0]}")

    @property
    def out_channels(self) -> int:
        return int(self.weight.shape[0])

    @property
    def in_channels(self) -> int:
        return int(self.weight.shape[1]) * self.groups

    @property
    def is_depthwise(self) -> bool:
        """One input channel per output channel and group (``groups == Cin == Cout``)."""
        return self.groups > 1 and self.weight.shape[1] == 1 and self.groups == self.out_channels

    def evolve(self, **changes: Any) -> Layer:
        return attrs.evolve(self, **changes)


def output_ranges(layer: Layer, include_bias: bool = False) -> np.ndarray:
    """Max |w| of each output channel (optionally also |bias|), float64 ``[Cout]``."""
    w = np.abs(layer.weight.astype(np.float64)).reshape(layer.out_channels, -1)
    r = w.max(axis=1)
    if include_bias and layer.bias is not None:
        r = np.maximum(r, np.abs(layer.bias.astype(np.float64)))
    return r


def _grouped(weight: np.ndarray, groups: int) -> np.ndarray:
    """View ``[Cout, Cin_g, k...]`` as ``[groups, Cout_g, Cin_g, prod(k)]``."""
    cout, cin_g = weight.shape[:2]
    return weight.reshape(groups, cout // groups, cin_g, -1)


def input_ranges(layer: Layer) -> np.ndarray:
    """Max |w| over everything that reads each input channel, float64 ``[Cin]``."""
    w = np.abs(_grouped(layer.weight.astype(np.float64), layer.groups))
    return w.max(axis=(1, 3)).reshape(-1)  # [groups, Cin_g] -> channel g*Cin_g + j


def scale_outputs(layer: Layer, divisor: np.ndarray) -> Layer:
    """Divide output channel ``i`` (weight row and bias) by ``divisor[i]``."""
    d = np.asarray(divisor, np.float64)
    shape = (-1,) + (1,) * (layer.weight.ndim - 1)
    weight = (layer.weight / d.reshape(shape)).astype(layer.weight.dtype)
    bias = None if layer.bias is None else (layer.bias / d).astype(layer.bias.dtype)
    return layer.evolve(weight=weight, bias=bias)


def scale_inputs(layer: Layer, factor: np.ndarray) -> Layer:
    """Multiply every weight that reads input channel ``j`` by ``factor[j]``."""
    f = np.asarray(factor, np.float64)
    if f.shape != (layer.in_channels,):
        raise ModelError(f"scale: {f.shape[0] if f.ndim else 0} values for a layer with {layer.in_channels} inputs")
    cin_g = layer.weight.shape[1]
    f = f.reshape(layer.groups, 1, cin_g, 1)
    weight = (_grouped(layer.weight, layer.groups) * f).reshape(layer.weight.shape).astype(layer.weight.dtype)
    return layer.evolve(weight=weight)


def response_to_constant(layer: Layer, value: np.ndarray) -> np.ndarray:
    """Output of the layer (without bias) for an input that is ``value[j]`` everywhere
    on channel ``j``: what a constant shift of its input adds to each output channel
    (exact away from zero-padded borders)."""
    v = np.asarray(value, np.float64)
    g = _grouped(layer.weight.astype(np.float64), layer.groups)  # [G, Cout_g, Cin_g, K]
    v = v.reshape(layer.groups, 1, -1, 1)
    return (g * v).sum(axis=(2, 3)).reshape(-1)


def add_bias(layer: Layer, delta: np.ndarray) -> Layer:
    """Add ``delta`` to the bias (creating a zero bias when the layer has none)."""
    base = np.zeros(layer.out_channels, layer.weight.dtype) if layer.bias is None else layer.bias
    return layer.evolve(bias=(base + np.asarray(delta, np.float64)).astype(base.dtype))
