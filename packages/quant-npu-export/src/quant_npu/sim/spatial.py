"""Sliding windows over NCHW integer tensors with ONNX's pads, strides, dilations,
``auto_pad`` and ``ceil_mode`` (shared by convolution and pooling).

Example:
    >>> g = Geometry.from_node_attributes({"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}, (3, 3))
    >>> w = g.windows(np.arange(16, dtype=np.int8).reshape(1, 1, 4, 4), fill=0)
    >>> w.shape, int(w[0, 0, 0, 0].sum())
    ((1, 1, 4, 4, 3, 3), 10)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from quant_core.errors import ModelError


@attrs.frozen
class Geometry:
    """Window geometry of a 2-D Conv or pool."""

    kernel: tuple[int, int]
    strides: tuple[int, int] = (1, 1)
    dilations: tuple[int, int] = (1, 1)
    pads: tuple[int, int, int, int] = (0, 0, 0, 0)  # top, left, bottom, right
    auto_pad: str = "NOTSET"
    ceil_mode: bool = False

    @classmethod
    def from_node_attributes(cls, attributes: Mapping[str, Any], kernel: Sequence[int]) -> Geometry:
        if len(kernel) != 2:
            raise ModelError(f"kernel {list(kernel)}: only 2-D windows are simulated; allowed: [kh, kw]")
        auto_pad = attributes.get("auto_pad", b"NOTSET")
        top, left, bottom, right = (int(p) for p in attributes.get("pads", (0, 0, 0, 0)))
        sh, sw = (int(s) for s in attributes.get("strides", (1, 1)))
        dh, dw = (int(d) for d in attributes.get("dilations", (1, 1)))
        return cls(
            kernel=(int(kernel[0]), int(kernel[1])),
            strides=(sh, sw),
            dilations=(dh, dw),
            pads=(top, left, bottom, right),
            auto_pad=auto_pad.decode() if isinstance(auto_pad, bytes) else str(auto_pad),
            ceil_mode=bool(attributes.get("ceil_mode", 0)),
        )

    def extent(self, axis: int) -> int:
        return (self.kernel[axis] - 1) * self.dilations[axis] + 1

    def padding(self, height: int, width: int) -> tuple[int, int, int, int]:
        """Explicit (top, left, bottom, right) pads for an input of ``height`` x ``width``,
        including the extra end padding ``ceil_mode`` needs."""
        if self.auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            begin, end = [], []
            for axis, size in enumerate((height, width)):
                out = math.ceil(size / self.strides[axis])
                total = max((out - 1) * self.strides[axis] + self.extent(axis) - size, 0)
                small, large = total // 2, total - total // 2
                begin.append(small if self.auto_pad == "SAME_UPPER" else large)
                end.append(large if self.auto_pad == "SAME_UPPER" else small)
            pads = [begin[0], begin[1], end[0], end[1]]
        elif self.auto_pad == "VALID":
            pads = [0, 0, 0, 0]
        else:
            pads = list(self.pads)
        if self.ceil_mode:
            for axis, size in enumerate((height, width)):
                padded = size + pads[axis] + pads[axis + 2]
                out = math.ceil((padded - self.extent(axis)) / self.strides[axis]) + 1
                if (out - 1) * self.strides[axis] >= size + pads[axis]:
                    out -= 1  # the last window must start inside the input or its begin padding
                needed = (out - 1) * self.strides[axis] + self.extent(axis) - padded
                pads[axis + 2] += max(needed, 0)
        return pads[0], pads[1], pads[2], pads[3]

    def windows(self, x: np.ndarray, fill: int | float) -> np.ndarray:
        """A ``(N, C, Ho, Wo, kh, kw)`` view of ``x`` padded with ``fill``."""
        top, left, bottom, right = self.padding(x.shape[2], x.shape[3])
        if top or left or bottom or right:
            x = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)), constant_values=fill)
        view = np.lib.stride_tricks.sliding_window_view(x, (self.extent(0), self.extent(1)), axis=(2, 3))
        dh, dw = self.dilations
        sh, sw = self.strides
        return view[:, :, ::sh, ::sw, ::dh, ::dw]
