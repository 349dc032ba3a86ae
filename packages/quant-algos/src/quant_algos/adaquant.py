"""AdaQuant (Hubara et al., "Accurate Post Training Quantization With Small
Calibration Sets", ICML 2021): learn each layer's weights and bias with quantization
in the loop (straight-through estimator), reconstructing its float output from
quantized upstream inputs. Needs ``pip install 'quant-algos[torch]'``.

Example:
    >>> import numpy as np
    >>> from quant_core.algorithm_config import AdaQuantConfig
    >>> from quant_core.qparams import QParams
    >>> rng = np.random.default_rng(0)
    >>> w = rng.normal(size=(6, 10)).astype(np.float32)
    >>> x = np.abs(rng.normal(size=(512, 10))).astype(np.float32)
    >>> x_quantized_upstream = np.floor(x * 2) / 2       # biased: a mean shift to learn away
    >>> r = adaquant_layer(w, np.zeros(6, np.float32), QParams.per_tensor(0.25, 0, "int8"),
    ...                    x_quantized_upstream, x @ w.T,
    ...                    config=AdaQuantConfig(learning_rate=1e-2, num_iterations=300), quiet=True)
    >>> r.loss < r.loss_nearest
    True
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from quant_algos._reconstruction import LayerProblem, PoolSettings, ReconstructionResult, finish, solve_layer
from quant_algos.reconstruction_data import ConvGeometry, Pool
from quant_core.algorithm_config import AdaQuantConfig
from quant_core.qparams import QParams, quantize

_CHECK_EVERY = 50
# Early stop: the smoothed loss must improve by this fraction within _PATIENCE checks.
_MIN_IMPROVEMENT = 1e-3
_PATIENCE = 4


def adaquant_layer(
    weight: np.ndarray,
    bias: np.ndarray | None,
    weight_qparams: QParams,
    inputs: np.ndarray,
    targets: np.ndarray | None = None,
    config: AdaQuantConfig | None = None,
    *,
    geometry: ConvGeometry | None = None,
    activation: str | None = None,
    name: str = "layer",
    quiet: bool = False,
    seed: int = 0,
    positions_per_sample: int = 64,
    max_pool_bytes: int = 64 << 20,
) -> ReconstructionResult:
    """Learn the weights (and the bias, when the layer has one) of one Conv2d or Gemm
    layer; the arguments are those of :func:`quant_algos.adaround.adaround_layer`.
    Every 50 iterations, and after the last, the quantized weights are scored on a fixed
    slice of the pool and the best are kept; early stop when that score has not improved
    by 0.1 % for 200 iterations. The returned ``weight`` is the learned weight quantized with
    ``weight_qparams`` and dequantized; ``bias`` is the learned float bias.
    """
    settings = PoolSettings(positions_per_sample, max_pool_bytes, seed)
    cfg = config or AdaQuantConfig()
    pool = settings.pool_from_arrays(
        np.shape(weight), inputs, targets, geometry, batch_size=cfg.batch_size, num_samples=cfg.num_samples
    )
    return adaquant_pool(
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


def adaquant_pool(
    weight: np.ndarray,
    bias: np.ndarray | None,
    weight_qparams: QParams,
    pool: Pool,
    config: AdaQuantConfig,
    *,
    activation: str | None = None,
    name: str = "layer",
    quiet: bool = False,
    settings: PoolSettings | None = None,
    learn_bias: bool = True,
) -> ReconstructionResult:
    """:func:`adaquant_layer` on a pool already drawn from the layer's data (what the
    layer-by-layer driver streams into, :mod:`quant_algos.drivers.reconstruction`).
    ``learn_bias=False``: the bias stays as given (a layer whose bias cannot be written
    back), so the weights are learned, and judged against nearest rounding, with the bias
    the model keeps; the result's ``bias`` is then None."""
    return solve_layer(
        "AdaQuant",
        partial(_adaquant_layer, learn_bias=learn_bias),
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


def _adaquant_layer(
    torch: Any,
    w: np.ndarray,
    problem: LayerProblem,
    qp: QParams,
    cfg: AdaQuantConfig,
    device: Any,
    *,
    name: str,
    quiet: bool,
    learn_bias: bool = True,
) -> ReconstructionResult:
    from quant_algos.torch_quant import FakeQuantizer  # torch is imported only when AdaQuant runs

    fake_quant = FakeQuantizer(qp, w.ndim, device)
    w_param = torch.from_numpy(w.copy()).to(device).requires_grad_(True)
    params = [w_param]
    b_param = None
    if problem.bias is not None and learn_bias:
        b_param = problem.bias.clone().requires_grad_(True)
        params.append(b_param)
    opt = torch.optim.Adam(params, lr=cfg.learning_rate)

    def fake_quant_ste(x: Any) -> Any:
        # Forward: exactly the codes quant_core would give (qp's rounding); backward: identity.
        return x + (fake_quant(x) - x).detach()

    # The STE iterates are noisy; keep the best quantized weights seen, scored on a
    # fixed slice of the pool, and stop once that score has stopped improving.
    check = problem.eval_rows()
    with torch.no_grad():
        best = float(problem.loss(fake_quant_ste(w_param), b_param, check))
    best_w, best_b = w_param.detach().clone(), None if b_param is None else b_param.detach().clone()
    stale, stopped_early, done = 0, False, 0
    with tqdm(total=cfg.num_iterations, desc=f"AdaQuant {name}", disable=quiet, leave=False, mininterval=0.5) as bar:
        for it in range(cfg.num_iterations):
            loss = problem.loss(fake_quant_ste(w_param), b_param, problem.next_batch())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            done = it + 1
            # The last step is scored too: otherwise every step after the last multiple of
            # _CHECK_EVERY (all of them, below it) would be thrown away.
            if done % _CHECK_EVERY == 0 or done == cfg.num_iterations:
                with torch.no_grad():
                    score = float(problem.loss(fake_quant_ste(w_param), b_param, check))
                bar.update(done - bar.n)
                bar.set_postfix(loss=f"{score:.4g}", refresh=False)
                if score < best:
                    stale = 0 if score < best * (1.0 - _MIN_IMPROVEMENT) else stale + 1
                    best, best_w = score, w_param.detach().clone()
                    best_b = None if b_param is None else b_param.detach().clone()
                else:
                    stale += 1
                if cfg.early_stop and stale >= _PATIENCE:
                    stopped_early = done < cfg.num_iterations
                    break
        bar.update(done - bar.n)

    learned_w = best_w.cpu().numpy()
    learned_b = None if best_b is None else best_b.reshape(-1).cpu().numpy().astype(np.float32)
    return finish(problem, w, qp, quantize(learned_w, qp), learned_b, done, stopped_early)
