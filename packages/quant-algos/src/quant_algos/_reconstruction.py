"""The torch side shared by AdaRound and AdaQuant: the pool on the device, the layer
as a batched matrix product per group, the reconstruction loss, and the result."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any, Protocol

import attrs
import numpy as np

from quant_algos._torch import require_torch, torch_device, torch_threads
from quant_algos.reconstruction_data import ConvGeometry, Pool, PoolBuilder, check_activation, limit_samples
from quant_core.errors import ConfigError, ModelError
from quant_core.qparams import QParams, dequantize, fake_quantize, quantize

# Whole-pool evaluations run in chunks of this many rows to bound peak memory.
_EVAL_ROWS = 16384
# A minibatch's patches stay within this many bytes. A depthwise layer's patch row holds every
# channel (1152 x 5 x 5 floats on EfficientNet-Lite0's widest), so batch_size x positions rows
# would stream hundreds of MB per step (100 ms); each channel there has only k x k weights, and
# a few hundred rows per step fit them as well (measured: 4x faster AdaRound on those layers).
_MAX_MINIBATCH_BYTES = 16 << 20
_MIN_MINIBATCH_ROWS = 128


@attrs.frozen(eq=False)
class ReconstructionResult:
    """Outcome of AdaRound/AdaQuant for one layer.

    Attributes:
        weight: float32 weight whose values are exactly the chosen codes dequantized
            (``quantize(weight, qparams)`` gives ``codes``).
        bias: the (possibly learned) bias, or None.
        codes: the integer codes, in the qparams' numpy dtype.
        loss_nearest: reconstruction loss on the pool with round-to-nearest weights.
        loss: reconstruction loss on the pool with the returned weights.
        iterations: optimisation steps done.
        stopped_early: whether early stopping ended the run.
        fell_back: True when the learned weights were worse than nearest rounding on
            the pool and nearest rounding was returned instead.
    """

    weight: np.ndarray
    bias: np.ndarray | None
    codes: np.ndarray
    loss_nearest: float
    loss: float
    iterations: int
    stopped_early: bool
    fell_back: bool


def check_qparams(weight: np.ndarray, qp: QParams) -> None:
    if qp.axis is not None:
        if not 0 <= qp.axis < weight.ndim or qp.scale.shape != (weight.shape[qp.axis],):
            raise ModelError(
                f"weight_qparams: {qp.scale.size} scales along axis {qp.axis} do not fit weight {weight.shape}"
            )
    elif qp.scale.ndim != 0:
        raise ModelError(f"weight_qparams: per-tensor qparams with scale shape {qp.scale.shape}")


def _tensor(torch: ModuleType, array: np.ndarray) -> Any:
    """``array`` as a CPU tensor sharing its memory, or a copy where it is read-only (an
    initializer's view): torch warns on a tensor over memory it may not write."""
    return torch.from_numpy(array if array.flags.writeable else array.copy())


class LayerProblem:
    """One layer's reconstruction problem on a torch device."""

    def __init__(
        self,
        torch: ModuleType,
        pool: Pool,
        weight_shape: tuple[int, ...],
        bias: np.ndarray | None,
        float_weight: np.ndarray,
        activation: str | None,
        device: Any,
        rows: int,
        seed: int,
    ) -> None:
        check_activation(activation)
        self.torch = torch
        self.device = device
        self.activation = activation
        self.weight_shape = weight_shape
        self.x = torch.from_numpy(pool.patches).to(device)
        self.groups, self.size, self.k = self.x.shape
        self.cout_g = weight_shape[0] // self.groups
        self.rows = rows
        self.bias = None if bias is None else self.grouped_bias(_tensor(torch, np.asarray(bias, np.float32)).to(device))
        with torch.no_grad():
            if pool.targets is None:
                w = _tensor(torch, float_weight).to(device)
                target = torch.cat([self.output(w, self.bias, sl) for sl in self.chunks()], dim=1)
            else:
                target = torch.from_numpy(pool.targets).to(device)
            self.target = self.act(target)
        self.gen = torch.Generator().manual_seed(seed)

    def grouped_bias(self, b: Any) -> Any:
        return b.reshape(self.groups, 1, self.cout_g)

    def act(self, y: Any) -> Any:
        if self.activation == "relu":
            return self.torch.relu(y)
        if self.activation == "relu6":
            return self.torch.clamp(y, 0.0, 6.0)
        return y

    def chunks(self) -> list[slice]:
        return [slice(i, min(i + _EVAL_ROWS, self.size)) for i in range(0, self.size, _EVAL_ROWS)]

    def output(self, w: Any, b: Any, rows: slice) -> Any:
        """Pre-activation output ``[G, m, Cout/G]`` of weight ``w`` (in its own shape)."""
        x = self.x[:, rows]
        wg = w.reshape(self.groups, self.cout_g, self.k)
        if b is None:
            return self.torch.bmm(x, wg.transpose(1, 2))
        return self.torch.baddbmm(b, x, wg.transpose(1, 2))

    def eval_rows(self) -> slice:
        """A fixed slice of the (shuffled) pool for scoring during training."""
        return slice(0, min(self.size, _EVAL_ROWS))

    def next_batch(self) -> slice:
        start = int(self.torch.randint(0, self.size - self.rows + 1, (1,), generator=self.gen))
        return slice(start, start + self.rows)

    def loss(self, w: Any, b: Any, rows: slice) -> Any:
        """Squared error summed over channels, averaged over rows (AdaRound's objective)."""
        diff = self.act(self.output(w, b, rows)) - self.target[:, rows]
        return (diff * diff).sum() / (rows.stop - rows.start)

    def full_loss(self, weight: np.ndarray, bias: np.ndarray | None) -> float:
        torch = self.torch
        with torch.no_grad():
            w = _tensor(torch, np.asarray(weight, np.float32)).to(self.device)
            b = (
                self.bias
                if bias is None
                else self.grouped_bias(_tensor(torch, np.asarray(bias, np.float32)).to(self.device))
            )
            total = sum(float(self.loss(w, b, sl)) * (sl.stop - sl.start) for sl in self.chunks())
        return total / self.size


@attrs.frozen
class PoolSettings:
    """How a layer's reconstruction pool is drawn: output positions per sample in a
    minibatch, the pool's memory, and the sampling seed (results are deterministic for a seed).

    Example:
        >>> PoolSettings().max_pool_bytes // (1 << 20)
        64
    """

    positions_per_sample: int = 64
    max_pool_bytes: int = 64 << 20
    seed: int = 0

    def builder(
        self,
        weight_shape: tuple[int, ...],
        geometry: ConvGeometry | None,
        num_samples: int,
        *,
        with_targets: bool,
        batch_size: int,
    ) -> PoolBuilder:
        """A :class:`PoolBuilder` holding at least one minibatch (``batch_size`` samples' worth)."""
        if self.positions_per_sample < 1:
            raise ConfigError(
                f"positions_per_sample: {self.positions_per_sample!r} is not allowed; allowed: an integer >= 1"
            )
        return PoolBuilder(
            weight_shape,
            geometry,
            num_samples,
            with_targets=with_targets,
            max_pool_bytes=self.max_pool_bytes,
            min_rows=batch_size * self.positions_per_sample,
            seed=self.seed,
        )

    def pool_from_arrays(
        self,
        weight_shape: tuple[int, ...],
        inputs: np.ndarray,
        targets: np.ndarray | None,
        geometry: ConvGeometry | None,
        *,
        batch_size: int,
        num_samples: int | None,
    ) -> Pool:
        """The pool of whole arrays (``np.memmap`` stays lazy), first ``num_samples`` samples."""
        x = np.asarray(inputs) if not isinstance(inputs, np.ndarray) else inputs
        x = x if num_samples is None else x[:num_samples]
        t = limit_samples(targets, num_samples)
        builder = self.builder(
            weight_shape, geometry, int(x.shape[0]), with_targets=t is not None, batch_size=batch_size
        )
        builder.add(x, t)
        return builder.pool()


def make_problem(
    torch: ModuleType,
    weight: np.ndarray,
    bias: np.ndarray | None,
    qp: QParams,
    pool: Pool,
    *,
    activation: str | None,
    device: Any,
    batch_size: int,
    settings: PoolSettings,
) -> tuple[np.ndarray, LayerProblem]:
    """Validate the arguments and build the device-side problem."""
    w = np.asarray(weight, np.float32)
    check_qparams(w, qp)
    check_activation(activation)
    groups, size, k = pool.patches.shape
    if w.shape[0] % groups:
        raise ModelError(f"groups: {groups} does not divide Cout={w.shape[0]}")
    if bias is not None and np.shape(bias) != (w.shape[0],):
        raise ModelError(f"bias: shape {np.shape(bias)} does not match Cout={w.shape[0]}")
    per = settings.positions_per_sample
    rows = max(1, min(size, batch_size * min(pool.rows_per_sample, per)))
    rows = min(rows, max(_MIN_MINIBATCH_ROWS, _MAX_MINIBATCH_BYTES // (groups * k * pool.patches.itemsize)))
    problem = LayerProblem(torch, pool, w.shape, bias, w, activation, device, rows, settings.seed)
    return w, problem


def finish(
    problem: LayerProblem,
    w: np.ndarray,
    qp: QParams,
    codes: np.ndarray,
    bias: np.ndarray | None,
    iterations: int,
    stopped_early: bool,
) -> ReconstructionResult:
    """Score the learned codes against nearest rounding on the pool; keep the better."""
    nearest = fake_quantize(w, qp)
    loss_nearest = problem.full_loss(nearest, None)
    learned = dequantize(codes, qp)
    loss = problem.full_loss(learned, bias)
    # A NaN loss (an Inf in the layer's data) proves nothing better: AdaRound's rounding
    # variables go NaN there and every weight would come back rounded down.
    if not loss <= loss_nearest:
        return ReconstructionResult(
            nearest, problem_bias(problem), quantize(w, qp), loss_nearest, loss_nearest, iterations, stopped_early, True
        )
    return ReconstructionResult(learned, bias, codes, loss_nearest, loss, iterations, stopped_early, False)


def problem_bias(problem: LayerProblem) -> np.ndarray | None:
    return None if problem.bias is None else problem.bias.reshape(-1).cpu().numpy().copy()


class _ReconstructionConfig(Protocol):
    @property
    def device(self) -> str: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def num_samples(self) -> int | None: ...
    @property
    def num_threads(self) -> int | None: ...


Solver = Callable[..., "ReconstructionResult"]
"""``solver(torch, w, problem, qp, config, device, name=..., quiet=...)``: one algorithm's loop."""


def solve_layer(
    algorithm: str,
    solver: Solver,
    config: _ReconstructionConfig,
    weight: np.ndarray,
    bias: np.ndarray | None,
    weight_qparams: QParams,
    pool: Pool,
    *,
    activation: str | None,
    name: str,
    quiet: bool,
    settings: PoolSettings,
) -> ReconstructionResult:
    """What AdaRound and AdaQuant share: import torch (naming the extra when it is
    missing), pin the config's thread count, validate and build the layer problem on the
    configured device, then run ``solver`` on it."""
    torch = require_torch(algorithm)
    with torch_threads(torch, config.num_threads):
        device = torch_device(torch, config.device)
        w, problem = make_problem(
            torch,
            weight,
            bias,
            weight_qparams,
            pool,
            activation=activation,
            device=device,
            batch_size=config.batch_size,
            settings=settings,
        )
        return solver(torch, w, problem, weight_qparams, config, device, name=name, quiet=quiet)
