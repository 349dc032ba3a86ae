"""AdaRound (Nagel et al., "Up or Down? Adaptive Rounding for Post-Training
Quantization", ICML 2020): learn, per weight, whether to round down or up so that the
layer's output on quantized upstream inputs matches its float output.

Each weight is ``s * (floor(w / s) + h(V))`` with the rectified sigmoid
``h(V) = clip(sigmoid(V) * (zeta - gamma) + gamma, 0, 1)``; ``V`` is trained with Adam
on the reconstruction loss plus ``reg_param * sum(1 - |2h - 1|**beta)``, which (after a
warm start without it) pushes every ``h`` to 0 or 1 as ``beta`` anneals from
``beta_start`` to ``beta_end``. The scales stay fixed (per-tensor, per-channel, power
of two alike). Needs ``pip install 'quant-algos[torch]'``.

Example:
    >>> import numpy as np
    >>> from quant_core.algorithm_config import AdaRoundConfig
    >>> from quant_core.qparams import QParams
    >>> rng = np.random.default_rng(0)
    >>> w = rng.normal(size=(8, 4, 3, 3)).astype(np.float32)
    >>> x = rng.normal(size=(16, 4, 8, 8)).astype(np.float32)
    >>> qp = QParams.per_tensor(0.25, 0, "int8")
    >>> r = adaround_layer(w, None, qp, x, config=AdaRoundConfig(num_iterations=200),
    ...                    geometry=ConvGeometry(pads=(1, 1, 1, 1)), quiet=True)
    >>> r.loss < r.loss_nearest
    True
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tqdm.auto import tqdm

from quant_algos._reconstruction import (
    LayerProblem,
    PoolSettings,
    ReconstructionResult,
    finish,
    problem_bias,
    solve_layer,
)
from quant_algos.reconstruction_data import ConvGeometry, Pool
from quant_core.algorithm_config import AdaRoundConfig
from quant_core.qparams import QParams, round_values
from quant_core.spec import RoundMode

ZETA = 1.1
GAMMA = -0.1
# How often (iterations) to check early stopping and refresh the progress bar.
_CHECK_EVERY = 50


def beta_at(iteration: int, config: AdaRoundConfig) -> float | None:
    """Regulariser exponent at ``iteration``: None during the warm start, then linear
    decay from ``beta_start`` to ``beta_end``."""
    warm = int(config.warm_start * config.num_iterations)
    if iteration < warm:
        return None
    span = max(config.num_iterations - warm, 1)
    rel = (iteration - warm) / span
    return config.beta_end + (config.beta_start - config.beta_end) * max(0.0, 1.0 - rel)


def adaround_layer(
    weight: np.ndarray,
    bias: np.ndarray | None,
    weight_qparams: QParams,
    inputs: np.ndarray,
    targets: np.ndarray | None = None,
    config: AdaRoundConfig | None = None,
    *,
    geometry: ConvGeometry | None = None,
    activation: str | None = None,
    name: str = "layer",
    quiet: bool = False,
    seed: int = 0,
    positions_per_sample: int = 64,
    max_pool_bytes: int = 64 << 20,
) -> ReconstructionResult:
    """Learn the rounding of one Conv2d (``geometry`` given) or Gemm layer.

    Args:
        weight: float weight ``[Cout, Cin/g, kh, kw]`` or ``[out, in]``.
        bias: float bias or None (kept as is).
        weight_qparams: the weight's fixed quantization parameters.
        inputs: the layer's input as the quantized model computes it (upstream layers
            quantized and, where done, already AdaRounded), ``[N, Cin, H, W]`` or
            ``[N, ..., in]``; ``np.memmap`` works.
        targets: the float model's output of this layer (pre-activation), same leading
            shape as the layer output; None reconstructs the float layer applied to
            ``inputs``.
        config: iterations, batch size, learning rate, regulariser, device, early stop,
            num_samples (first ``num_samples`` of ``inputs``/``targets``).
        geometry: strides, ONNX pads, dilations, groups of a convolution.
        activation: "relu", "relu6" or None, applied to output and target.
        name: shown on the progress bar.
        quiet: no progress bar.
        seed: minibatch and pool sampling seed (results are deterministic for a seed).
        positions_per_sample: output positions per sample in a minibatch.
        max_pool_bytes: memory for the pool of (patch, target) rows.

    Returns:
        :class:`ReconstructionResult`; ``weight`` is ``(floor(w/s) + [h(V) >= 0.5]) * s``,
        ``floor(w/s)`` where ``w/s`` is already on the grid (a weight rounds to its floor or
        ceil, never further), and never worse than nearest rounding on the pool: otherwise
        nearest is returned.
    """
    settings = PoolSettings(positions_per_sample, max_pool_bytes, seed)
    cfg = config or AdaRoundConfig()
    pool = settings.pool_from_arrays(
        np.shape(weight), inputs, targets, geometry, batch_size=cfg.batch_size, num_samples=cfg.num_samples
    )
    return adaround_pool(
        weight,
        bias,
        weight_qparams,
        pool,
        cfg,
        activation=activation,
        name=name,
        quiet=quiet,
        settings=settings,
    )


def adaround_pool(
    weight: np.ndarray,
    bias: np.ndarray | None,
    weight_qparams: QParams,
    pool: Pool,
    config: AdaRoundConfig,
    *,
    activation: str | None = None,
    name: str = "layer",
    quiet: bool = False,
    settings: PoolSettings | None = None,
) -> ReconstructionResult:
    """:func:`adaround_layer` on a pool already drawn from the layer's data (what the
    layer-by-layer driver streams into, :mod:`quant_algos.drivers.reconstruction`)."""
    return solve_layer(
        "AdaRound",
        _adaround_layer,
        config,
        weight,
        bias,
        weight_qparams,
        pool,
        activation=activation,
        name=name,
        quiet=quiet,
        settings=settings or PoolSettings(),
    )


def _adaround_layer(
    torch: Any,
    w: np.ndarray,
    problem: LayerProblem,
    qp: QParams,
    cfg: AdaRoundConfig,
    device: Any,
    *,
    name: str,
    quiet: bool,
) -> ReconstructionResult:
    shape = qp.broadcast_shape(w.ndim)
    scale_np = qp.scale.reshape(shape)
    zp_np = qp.zero_point.reshape(shape).astype(np.float32)
    w_floor_np = round_values(w / scale_np, RoundMode.FLOOR)  # same float32 division as quant_core.quantize
    rest = np.clip(w / scale_np - w_floor_np, 0.0, 1.0)
    # A weight on the grid (a pruned zero) has floor == ceil: rounding it "up" would move it
    # a whole step, so its h stays 0 and only the others choose.
    movable_np = (rest > 0).astype(np.float32)
    # Start V where h(V) equals the fractional part, i.e. at the float weight.
    v_init = -np.log((ZETA - GAMMA) / (np.clip(rest, 1e-4, 1 - 1e-4) - GAMMA) - 1.0)

    def t(a: np.ndarray) -> Any:
        return torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(device)

    scale, zp, w_floor, movable = t(scale_np), t(zp_np), t(w_floor_np), t(movable_np)
    qmin, qmax = float(qp.qmin), float(qp.qmax)
    v = t(v_init).requires_grad_(True)
    opt = torch.optim.Adam([v], lr=cfg.learning_rate)

    def h_of(v_: Any) -> Any:
        return torch.clamp(torch.sigmoid(v_) * (ZETA - GAMMA) + GAMMA, 0.0, 1.0) * movable

    def soft_weight(h: Any) -> Any:
        return (torch.clamp(w_floor + h + zp, qmin, qmax) - zp) * scale

    stopped_early = False
    done = 0
    with tqdm(total=cfg.num_iterations, desc=f"AdaRound {name}", disable=quiet, leave=False, mininterval=0.5) as bar:
        for it in range(cfg.num_iterations):
            rows = problem.next_batch()
            h = h_of(v)
            loss = problem.loss(soft_weight(h), problem.bias, rows)
            beta = beta_at(it, cfg)
            if beta is not None:
                loss = loss + cfg.reg_param * (1.0 - (2.0 * h - 1.0).abs().pow(beta)).sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            done = it + 1
            if done % _CHECK_EVERY == 0:
                bar.update(_CHECK_EVERY)
                bar.set_postfix(loss=f"{float(loss.detach()):.4g}", refresh=False)
                if cfg.early_stop and beta is not None:
                    with torch.no_grad():
                        hv = h_of(v)
                        if bool(((hv == 0) | (hv == 1)).all()):
                            stopped_early = done < cfg.num_iterations
                            break
        bar.update(done - bar.n)

    with torch.no_grad():
        up = (h_of(v) >= 0.5).cpu().numpy().astype(np.float32)
    codes = np.clip(w_floor_np + up + zp_np, qp.qmin, qp.qmax).astype(qp.dtype.numpy_dtype)
    return finish(problem, w, qp, codes, problem_bias(problem), done, stopped_early)
