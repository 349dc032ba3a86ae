"""Training data of a layer-wise reconstruction (AdaRound, AdaQuant), in numpy.

A Conv or Gemm layer is a matrix product per group: each output position reads one
patch of its input. Reconstruction only needs (patch, target) rows, and neighbouring
output positions of one image are strongly correlated, so a random **pool** of output
positions (across all samples) is extracted once and minibatches are drawn from it.
That makes an iteration's cost independent of the image resolution, which is what
keeps AdaRound on a whole network within minutes on a CPU.

Example:
    >>> import numpy as np
    >>> x = np.arange(2 * 1 * 3 * 3, dtype=np.float32).reshape(2, 1, 3, 3)
    >>> pool = build_pool((1, 1, 2, 2), x, None, ConvGeometry(), positions_per_sample=4)
    >>> pool.patches.shape, pool.rows_per_sample
    ((1, 8, 4), 4)
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np


def _pair(value: Sequence[int], n: int, name: str) -> tuple[int, ...]:
    t = tuple(int(v) for v in value)
    if len(t) != n or any(v < 0 for v in t):
        raise ValueError(f"{name}: {value!r} is not allowed; allowed: {n} non-negative integers")
    return t


@attrs.frozen
class ConvGeometry:
    """Attributes of a 2-D convolution, ONNX conventions.

    Args:
        strides: ``(sh, sw)``.
        pads: ``(top, left, bottom, right)`` (ONNX ``pads`` order; asymmetric allowed).
        dilations: ``(dh, dw)``.
        groups: the ``group`` attribute.

    Example:
        >>> ConvGeometry(strides=(2, 2), pads=(1, 1, 1, 1)).output_size((112, 112), (3, 3))
        (56, 56)
    """

    strides: tuple[int, ...] = attrs.field(default=(1, 1), converter=lambda v: _pair(v, 2, "strides"))
    pads: tuple[int, ...] = attrs.field(default=(0, 0, 0, 0), converter=lambda v: _pair(v, 4, "pads"))
    dilations: tuple[int, ...] = attrs.field(default=(1, 1), converter=lambda v: _pair(v, 2, "dilations"))
    groups: int = 1

    def __attrs_post_init__(self) -> None:
        if min(self.strides) < 1 or min(self.dilations) < 1:
            raise ValueError("strides, dilations: must be >= 1")
        if not isinstance(self.groups, int) or self.groups < 1:
            raise ValueError(f"groups: {self.groups!r} is not allowed; allowed: an integer >= 1")

    def output_size(self, input_hw: tuple[int, int], kernel_hw: tuple[int, int]) -> tuple[int, int]:
        out = []
        for i in range(2):
            span = self.dilations[i] * (kernel_hw[i] - 1) + 1
            size = input_hw[i] + self.pads[i] + self.pads[i + 2] - span
            if size < 0:
                raise ValueError(f"conv: kernel {kernel_hw} does not fit the padded input {input_hw}")
            out.append(size // self.strides[i] + 1)
        return out[0], out[1]


@attrs.frozen(eq=False)
class Pool:
    """Rows for reconstruction, grouped like the weight.

    Attributes:
        patches: ``[G, P, K]`` float32 inputs (``K = Cin/G * kh * kw``, or ``in`` for Gemm).
        targets: ``[G, P, Cout/G]`` float32 float outputs (pre-activation), or None to
            reconstruct the layer's own float output on the pool.
        rows_per_sample: output positions one sample contributes (``Ho * Wo``; rows per
            sample of a Gemm).
    """

    patches: np.ndarray
    targets: np.ndarray | None
    rows_per_sample: int


ACTIVATIONS = ("relu", "relu6", None)


def check_activation(activation: str | None) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: {activation!r} is not allowed; allowed: relu, relu6, None")


def _choose_positions(total: int, size: int, rng: np.random.Generator) -> np.ndarray:
    # Already shuffled, so that contiguous slices of the pool are random minibatches.
    return rng.permutation(total) if size >= total else rng.choice(total, size=size, replace=False)


def _conv_patches(
    x: np.ndarray, kernel: tuple[int, int], geo: ConvGeometry, flat: np.ndarray, out_hw: tuple[int, int]
) -> np.ndarray:
    """``[P, Cin, kh*kw]`` input patches at flat output positions ``n*Ho*Wo + oh*Wo + ow``,
    reading zeros outside the input (no padded copy of the whole input is made)."""
    ho, wo = out_hw
    n, rem = np.divmod(flat, ho * wo)
    oh, ow = np.divmod(rem, wo)
    h_in, w_in = x.shape[2:]
    cols = []
    for i in range(kernel[0]):
        h = oh * geo.strides[0] + i * geo.dilations[0] - geo.pads[0]
        for j in range(kernel[1]):
            w = ow * geo.strides[1] + j * geo.dilations[1] - geo.pads[1]
            valid = (h >= 0) & (h < h_in) & (w >= 0) & (w < w_in)
            vals = np.asarray(x[n, :, np.clip(h, 0, h_in - 1), np.clip(w, 0, w_in - 1)], np.float32)  # [P, Cin]
            vals[~valid] = 0.0
            cols.append(vals)
    return np.stack(cols, axis=-1)


def build_pool(
    weight_shape: tuple[int, ...],
    inputs: np.ndarray,
    targets: np.ndarray | None,
    geometry: ConvGeometry | None,
    *,
    positions_per_sample: int = 128,
    max_pool_bytes: int = 256 << 20,
    min_rows: int = 0,
    seed: int = 0,
) -> Pool:
    """Extract the reconstruction pool of a Conv (``geometry`` given, inputs
    ``[N, Cin, H, W]``, targets ``[N, Cout, Ho, Wo]``) or Gemm (``geometry`` None, weight
    ``[out, in]``, inputs ``[N, ..., in]``, targets ``[N, ..., out]``) layer.

    The pool holds at most ``max_pool_bytes`` (but at least ``min_rows`` rows when that
    many exist) of randomly chosen output positions; ``positions_per_sample`` is
    only used by the caller to size minibatches and is validated here.
    """
    if positions_per_sample < 1:
        raise ValueError(f"positions_per_sample: {positions_per_sample!r} is not allowed; allowed: an integer >= 1")
    x = inputs
    cout = int(weight_shape[0])
    rng = np.random.default_rng(seed)
    if geometry is None:
        if len(weight_shape) != 2:
            raise ValueError(f"weight: shape {weight_shape} needs a ConvGeometry (only [out, in] is a Gemm)")
        k = int(weight_shape[1])
        if x.ndim < 2 or x.shape[-1] != k:
            raise ValueError(f"inputs: shape {x.shape} does not end in the weight's {k} input features")
        rows = x.reshape(-1, k)
        per_sample = rows.shape[0] // max(x.shape[0], 1)
        groups, out_shape = 1, (*x.shape[:-1], cout)
    else:
        if len(weight_shape) != 4:
            raise ValueError(f"weight: shape {weight_shape} is not a 2-D convolution weight [Cout, Cin/g, kh, kw]")
        groups = geometry.groups
        if cout % groups or x.ndim != 4 or x.shape[1] != weight_shape[1] * groups:
            raise ValueError(
                f"inputs: shape {x.shape} does not fit weight {weight_shape} with groups={groups} (expected NCHW)"
            )
        kernel = (int(weight_shape[2]), int(weight_shape[3]))
        out_hw = geometry.output_size((x.shape[2], x.shape[3]), kernel)
        per_sample = out_hw[0] * out_hw[1]
        k = int(weight_shape[1]) * kernel[0] * kernel[1]
        out_shape = (x.shape[0], cout, *out_hw)
    if targets is not None and tuple(targets.shape) != tuple(out_shape):
        raise ValueError(f"targets: shape {tuple(targets.shape)} differs from the layer's output shape {out_shape}")
    total = x.shape[0] * per_sample
    if total == 0:
        raise ValueError("inputs: no samples")
    row_bytes = 4 * (groups * k + (cout if targets is not None else 0))
    size = min(total, max(min_rows, max_pool_bytes // row_bytes, 1))
    flat = _choose_positions(total, size, rng)

    if geometry is None:
        patches = np.asarray(rows[flat], np.float32)[None]  # [1, P, K]
        tgt = None if targets is None else np.asarray(targets.reshape(-1, cout)[flat], np.float32)[None]
        return Pool(patches, tgt, per_sample)

    p = _conv_patches(x, kernel, geometry, flat, out_hw)  # [P, Cin, khkw]
    patches = np.ascontiguousarray(p.reshape(size, groups, k).transpose(1, 0, 2))
    tgt = None
    if targets is not None:
        n, rem = np.divmod(flat, per_sample)
        oh, ow = np.divmod(rem, out_hw[1])
        t = np.asarray(targets[n, :, oh, ow], np.float32)  # [P, Cout]
        tgt = np.ascontiguousarray(t.reshape(size, groups, cout // groups).transpose(1, 0, 2))
    return Pool(patches, tgt, per_sample)


def rows_per_iteration(pool: Pool, batch_size: int, positions_per_sample: int) -> int:
    """Minibatch rows: ``batch_size`` samples' worth, each contributing at most
    ``positions_per_sample`` output positions, capped by the pool."""
    per = min(pool.rows_per_sample, positions_per_sample)
    return max(1, min(pool.patches.shape[1], batch_size * per))


def limit_samples(array: np.ndarray | None, num_samples: int | None) -> np.ndarray | None:
    return array if array is None or num_samples is None else array[:num_samples]
