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

from quant_core.errors import ConfigError, DataError, ModelError


def _pair(value: Sequence[int], n: int, name: str) -> tuple[int, ...]:
    t = tuple(int(v) for v in value)
    if len(t) != n or any(v < 0 for v in t):
        raise ModelError(f"{name}: {value!r} is not allowed; allowed: {n} non-negative integers")
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
            raise ModelError("strides, dilations: must be >= 1")
        if not isinstance(self.groups, int) or self.groups < 1:
            raise ModelError(f"groups: {self.groups!r} is not allowed; allowed: an integer >= 1")

    def output_size(self, input_hw: tuple[int, int], kernel_hw: tuple[int, int]) -> tuple[int, int]:
        out = []
        for i in range(2):
            span = self.dilations[i] * (kernel_hw[i] - 1) + 1
            size = input_hw[i] + self.pads[i] + self.pads[i + 2] - span
            if size < 0:
                raise ModelError(f"conv: kernel {kernel_hw} does not fit the padded input {input_hw}")
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
        raise ModelError(f"activation: {activation!r} is not allowed; allowed: relu, relu6, None")


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


class PoolBuilder:
    """Builds a :class:`Pool` from a layer's inputs (and float targets) streamed batch by
    batch, so that a layer's inputs over the whole calibration set never need to be held
    at once: only the pool (``max_pool_bytes``) and one batch are in memory.

    The output positions are drawn once, for ``num_samples`` samples in all, and each
    batch contributes the rows at its positions: the pool equals :func:`build_pool` on the
    concatenated batches. Samples may change size between batches (text lines of several
    widths): from the first change on, the rows still to fill are shared out evenly over
    the samples to come.

    Args:
        weight_shape: ``[Cout, Cin/g, kh, kw]`` (Conv, with ``geometry``) or ``[out, in]``.
        geometry: the convolution's attributes; ``None`` for Gemm/MatMul.
        num_samples: samples that will be added, in all.
        with_targets: whether every batch comes with the float model's outputs.
        max_pool_bytes, min_rows, seed: as :func:`build_pool`.

    Example:
        >>> x = np.arange(2 * 1 * 3 * 3, dtype=np.float32).reshape(2, 1, 3, 3)
        >>> builder = PoolBuilder((1, 1, 2, 2), ConvGeometry(), num_samples=2, with_targets=False)
        >>> builder.add(x[:1]); builder.add(x[1:])
        >>> builder.pool().patches.shape == build_pool((1, 1, 2, 2), x, None, ConvGeometry()).patches.shape
        True
    """

    def __init__(
        self,
        weight_shape: tuple[int, ...],
        geometry: ConvGeometry | None,
        num_samples: int,
        *,
        with_targets: bool,
        max_pool_bytes: int = 256 << 20,
        min_rows: int = 0,
        seed: int = 0,
    ) -> None:
        self.weight_shape = tuple(int(d) for d in weight_shape)
        self.geometry = geometry
        self.num_samples = int(num_samples)
        self.with_targets = with_targets
        self.max_pool_bytes = max_pool_bytes
        self.min_rows = min_rows
        self.seed = seed
        self.cout = self.weight_shape[0]
        if geometry is None:
            if len(self.weight_shape) != 2:
                raise ModelError(f"weight: shape {weight_shape} needs a ConvGeometry (only [out, in] is a Gemm)")
            self.groups, self.k = 1, self.weight_shape[1]
        else:
            if len(self.weight_shape) != 4:
                raise ModelError(f"weight: shape {weight_shape} is not a 2-D convolution weight [Cout, Cin/g, kh, kw]")
            self.groups = geometry.groups
            self.k = self.weight_shape[1] * self.weight_shape[2] * self.weight_shape[3]
        self.seen = 0
        self.per_sample: int | None = None
        self.out_hw: tuple[int, int] | None = None
        self.flat: np.ndarray | None = None
        self.patches: np.ndarray | None = None
        self.targets: np.ndarray | None = None
        self._quota: tuple[np.ndarray, np.ndarray] | None = None  # (pool rows, sample of each)
        self._quota_rng: np.random.Generator | None = None

    def _layout(self, x: np.ndarray) -> tuple[int, tuple[int, ...], tuple[int, int] | None]:
        """Rows per sample, the layer's output shape and (a convolution) its output size for
        batch ``x`` (validated)."""
        if self.geometry is None:
            if x.ndim < 2 or x.shape[-1] != self.k:
                raise DataError(f"inputs: shape {x.shape} does not end in the weight's {self.k} input features")
            per_sample = int(np.prod(x.shape[1:-1], dtype=np.int64))
            return per_sample, (*x.shape[:-1], self.cout), None
        w = self.weight_shape
        if self.cout % self.groups or x.ndim != 4 or x.shape[1] != w[1] * self.groups:
            raise DataError(
                f"inputs: shape {x.shape} does not fit weight {w} with groups={self.groups} (expected NCHW)"
            )
        out_hw = self.geometry.output_size((x.shape[2], x.shape[3]), (w[2], w[3]))
        return out_hw[0] * out_hw[1], (x.shape[0], self.cout, *out_hw), out_hw

    def _start(self, per_sample: int) -> None:
        self.per_sample = per_sample
        total = self.num_samples * per_sample
        if total == 0:
            raise DataError("inputs: no samples")
        row_bytes = 4 * (self.groups * self.k + (self.cout if self.with_targets else 0))
        size = min(total, max(self.min_rows, self.max_pool_bytes // row_bytes, 1))
        self.flat = _choose_positions(total, size, np.random.default_rng(self.seed))
        self.patches = np.empty((self.groups, size, self.k), np.float32)
        if self.with_targets:
            self.targets = np.empty((self.groups, size, self.cout // self.groups), np.float32)

    def add(self, inputs: np.ndarray, targets: np.ndarray | None = None) -> None:
        """The next samples' inputs (and float outputs when ``with_targets``)."""
        x = inputs
        if (targets is not None) != self.with_targets:
            raise DataError(f"targets: expected {'one per batch' if self.with_targets else 'none'}")
        per_sample, out_shape, out_hw = self._layout(x)
        if targets is not None and tuple(targets.shape) != tuple(out_shape):
            raise DataError(f"targets: shape {tuple(targets.shape)} differs from the layer's output shape {out_shape}")
        if self.per_sample is None:
            self._start(per_sample)
            self.out_hw = out_hw
        assert self.flat is not None and self.patches is not None and self.per_sample is not None
        n = int(x.shape[0])
        if self.seen + n > self.num_samples:
            raise DataError(f"inputs: more than the {self.num_samples} samples the pool was sized for")
        if self._quota is None and (per_sample != self.per_sample or out_hw != self.out_hw):
            self._share_out_the_rest()
        if self._quota is None:
            lo, hi = self.seen * per_sample, (self.seen + n) * per_sample
            rows = np.nonzero((self.flat >= lo) & (self.flat < hi))[0]
            local = self.flat[rows] - lo
        else:
            rows, local = self._quota_rows(n, per_sample)
        self.seen += n
        if rows.size == 0:
            return
        cout_g = self.cout // self.groups
        if self.geometry is None:
            self.patches[0, rows] = np.asarray(x.reshape(-1, self.k)[local], np.float32)
            if targets is not None and self.targets is not None:
                self.targets[0, rows] = np.asarray(targets.reshape(-1, self.cout)[local], np.float32)
            return
        assert out_hw is not None
        w = self.weight_shape
        p = _conv_patches(x, (w[2], w[3]), self.geometry, local, out_hw)  # [P, Cin, khkw]
        self.patches[:, rows] = p.reshape(rows.size, self.groups, self.k).transpose(1, 0, 2)
        if targets is not None and self.targets is not None:
            s, rem = np.divmod(local, per_sample)
            oh, ow = np.divmod(rem, out_hw[1])
            t = np.asarray(targets[s, :, oh, ow], np.float32)  # [P, Cout]
            self.targets[:, rows] = t.reshape(rows.size, self.groups, cout_g).transpose(1, 0, 2)

    def _share_out_the_rest(self) -> None:
        """Samples of another size than the first (text lines of several widths): the pool
        rows not filled yet go to the samples still to come, the same number to each, at
        random positions of each (the rows drawn so far stay: samples of one size keep the
        uniform draw)."""
        assert self.flat is not None and self.per_sample is not None
        pending = np.nonzero(self.flat >= self.seen * self.per_sample)[0]
        remaining = self.num_samples - self.seen
        self._quota = (pending, self.seen + np.arange(pending.size) % max(remaining, 1))
        self._quota_rng = np.random.default_rng([self.seed, 1])

    def _quota_rows(self, n: int, per_sample: int) -> tuple[np.ndarray, np.ndarray]:
        """Pool rows for the next ``n`` samples of ``per_sample`` positions each, and the
        positions they take (flat within the batch)."""
        assert self._quota is not None and self._quota_rng is not None
        pending, owner = self._quota
        mine = (owner >= self.seen) & (owner < self.seen + n)
        rows = pending[mine]
        positions = self._quota_rng.integers(0, max(per_sample, 1), size=rows.size)
        return rows, (owner[mine] - self.seen) * per_sample + positions

    def pool(self) -> Pool:
        """The pool, once every sample was added."""
        if self.seen != self.num_samples or self.patches is None or self.per_sample is None:
            raise DataError(f"inputs: {self.seen} samples added; the pool was sized for {self.num_samples}")
        return Pool(self.patches, self.targets, self.per_sample)


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
    only used by the caller to size minibatches and is validated here. The arrays may be
    ``np.memmap``s; :class:`PoolBuilder` takes them batch by batch.
    """
    if positions_per_sample < 1:
        raise ConfigError(f"positions_per_sample: {positions_per_sample!r} is not allowed; allowed: an integer >= 1")
    builder = PoolBuilder(
        weight_shape,
        geometry,
        int(inputs.shape[0]),
        with_targets=targets is not None,
        max_pool_bytes=max_pool_bytes,
        min_rows=min_rows,
        seed=seed,
    )
    builder.add(inputs, targets)
    return builder.pool()


def rows_per_iteration(pool: Pool, batch_size: int, positions_per_sample: int) -> int:
    """Minibatch rows: ``batch_size`` samples' worth, each contributing at most
    ``positions_per_sample`` output positions, capped by the pool."""
    per = min(pool.rows_per_sample, positions_per_sample)
    return max(1, min(pool.patches.shape[1], batch_size * per))


def limit_samples(array: np.ndarray | None, num_samples: int | None) -> np.ndarray | None:
    return array if array is None or num_samples is None else array[:num_samples]
