"""What a backend supplies so that the layer-wise algorithms run on its models.

The drivers (:mod:`~quant_algos.drivers.reconstruction`, :mod:`~quant_algos.drivers.bias_correction`)
walk a model's quantized layers in order; a :class:`LayerRunner` is the backend's side of
that walk: it describes each layer (:class:`QuantLayer`: float weight, the calibrated
plan's weight qparams, convolution geometry, the activation after it), runs the float and
the quantized model up to a layer over the calibration samples, and writes back what a
driver learned. quant-onnx implements it with onnxruntime sessions, quant-torch-fx with
torch modules; the loops themselves exist once, here.

Example:
    >>> import numpy as np
    >>> from quant_core.qparams import QParams
    >>> layer = QuantLayer("fc", "Gemm", np.ones((2, 3), np.float32), QParams.per_tensor(0.1, 0, "int8"),
    ...                    None, None, None, output_channel_axis=1, bias_allowed=True)
    >>> layer.out_channels, layer.is_conv
    (2, False)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol, TypeVar, cast

import attrs
import numpy as np

from quant_algos.reconstruction_data import ConvGeometry
from quant_core.qparams import QParams


@attrs.frozen(eq=False)
class QuantLayer:
    """One quantized Conv/Gemm/MatMul as the drivers see it.

    Attributes:
        name: the layer's node name.
        op_type: ``"Conv"``, ``"Gemm"`` or ``"MatMul"`` (the planner's vocabulary).
        float_weight: the float model's weight in ``[out, in, ...]`` layout.
        weight_qparams: the calibrated plan's weight qparams, axis in that layout.
        bias: the bias the quantized model holds now (real values), or ``None``.
        geometry: strides/pads/dilations/groups of a 2-D convolution; ``None`` otherwise.
        activation: ``"relu"``/``"relu6"`` when only that activation reads the float
            layer's output (drivers compare outputs after it), else ``None``.
        output_channel_axis: channel axis of the layer's output (1 for NCHW and
            ``[N, C]``, -1 for ``[..., N]`` MatMul outputs).
        bias_allowed: a bias can be written (Conv/Gemm whose input is quantized, or a
            MatMul whose output an Add of a float constant reads).
        bias_added_after: ``bias`` is that Add's constant, added after the output the
            runner gives (:meth:`LayerRunner.float_outputs` and
            :meth:`LayerRunner.quantized_outputs` leave it out, as they leave out no Conv's).
    """

    name: str
    op_type: str
    float_weight: np.ndarray
    weight_qparams: QParams
    bias: np.ndarray | None
    geometry: ConvGeometry | None
    activation: str | None
    output_channel_axis: int
    bias_allowed: bool
    bias_added_after: bool = False

    @property
    def is_conv(self) -> bool:
        return self.op_type == "Conv"

    @property
    def out_channels(self) -> int:
        return int(self.float_weight.shape[0])


class LayerRunner(Protocol):
    """A backend's float model, its quantized model, the calibration samples, and the
    quantized layers in topological order. Drivers call, per layer and in order:
    :meth:`quantized_inputs` and/or :meth:`quantized_outputs`, :meth:`float_outputs` (or,
    once for all layers, :meth:`float_input_means`, then :meth:`quantized_weight`), then the
    setters; a layer's data reflects every earlier layer as written back."""

    @property
    def num_samples(self) -> int:
        """Calibration samples the runner holds (the first axis of every batch)."""
        ...

    def layers(self) -> Sequence[QuantLayer]:
        """The quantized weighted layers, producers first."""
        ...

    def quantized_inputs(self, layer: QuantLayer) -> Iterator[np.ndarray]:
        """The layer's input in the quantized model, batch by batch (every earlier layer
        as written back)."""
        ...

    def quantized_outputs(self, layer: QuantLayer) -> Iterator[np.ndarray]:
        """The layer's output (before its activation) in the quantized model with its
        current weight and bias, batch by batch."""
        ...

    def float_outputs(self, layer: QuantLayer) -> Iterator[np.ndarray]:
        """The float model's output of the layer (before its activation), batch by batch."""
        ...

    def float_input_means(self, layers: Sequence[QuantLayer], count: int) -> dict[str, np.ndarray]:
        """Each layer's float input averaged over the first ``count`` samples, by layer name:
        a convolution's mean map ``[C, ...]``, a dense layer's mean over every axis but the
        last (:class:`~quant_algos.bias_correction.InputMeanAccumulator`). One call serves
        every layer, so a backend can compute them in one pass."""
        ...

    def quantized_weight(self, layer: QuantLayer) -> np.ndarray:
        """The weight the quantized model holds now, as real values (``[out, in, ...]``
        layout): its codes (learned ones included) dequantized."""
        ...

    def set_weight_codes(self, layer: QuantLayer, codes: np.ndarray) -> None:
        """Store new integer weight codes (``[out, in, ...]`` layout, ``layer.weight_qparams``)."""
        ...

    def set_bias(self, layer: QuantLayer, values: np.ndarray) -> str | None:
        """Store a new bias (real values; the backend encodes it by ``quant_core.bias``).
        Returns a note when the bias could not be stored as asked."""
        ...


_Batch = TypeVar("_Batch", bound=tuple[Any, ...])


def first_samples(batches: Iterable[_Batch], count: int) -> Iterator[_Batch]:
    """Each batch's arrays cut to the first ``count`` samples in all (``None`` entries
    pass as they are). Every batch is still read: a runner's walk moves past a layer only
    once its batches are drained.

    Example:
        >>> import numpy as np
        >>> [tuple(len(a) for a in b) for b in first_samples([(np.ones(3), np.ones(3))] * 3, 5)]
        [(3, 3), (2, 2)]
    """
    seen = 0
    for arrays in batches:
        first = next(a for a in arrays if a is not None)
        take = min(len(first), count - seen)
        if take > 0:
            yield cast(_Batch, tuple(None if a is None else a[:take] for a in arrays))
            seen += take
