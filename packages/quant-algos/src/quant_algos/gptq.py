"""GPTQ: weight rounding with the error of each column compensated on the columns after it.

A layer computes ``y = x W^T`` over input patches ``x`` (a convolution's patches per
group, as :class:`~quant_algos.reconstruction_data.Pool` holds them). Rounding ``W`` changes
the output by ``x (W - Q)^T``, whose expected square is ``tr(D H D^T)`` with ``D = W - Q``
and ``H = X^T X``. GPTQ (Frantar et al., 2022, after Optimal Brain Quantization) rounds the
columns in order; after rounding column ``j`` it moves the columns not yet rounded by the
least-squares answer to that column's error, ``-err_j H^-1[j, j+1:] / H^-1[j, j]``, read
off the upper Cholesky factor of ``H^-1``. Each row keeps its own grid (per-channel
qparams), so the result is in the plan's format, power-of-two scales included.

No optimiser runs: a layer costs one Cholesky factorisation and ``K`` rank-one updates.
The rounding is kept only where it lowers the pool's output error below nearest
rounding's (it does on every layer measured; a fallback keeps nearest otherwise).

Example:
    >>> import numpy as np
    >>> from quant_core.qparams import QParams
    >>> qp = QParams.per_tensor(0.5, 0, "int8")
    >>> w = np.array([[0.3, 0.3]])
    >>> gptq_codes(w, np.eye(2), qp, damping=0.01).tolist()  # uncorrelated inputs: nearest
    [[1, 1]]
    >>> gptq_codes(w, np.array([[1.0, 0.99], [0.99, 1.0]]), qp, damping=0.01).tolist()  # the error moves on
    [[1, 0]]
"""

from __future__ import annotations

import numpy as np

from quant_algos._reconstruction import PoolSettings, ReconstructionResult, check_qparams
from quant_algos.reconstruction_data import Pool
from quant_core.algorithm_config import GPTQConfig
from quant_core.errors import DataError, ModelError
from quant_core.qparams import QParams, dequantize, quantize

# Columns rounded between two matrix products (GPTQ's "lazy batch" of 128).
_BLOCK = 128


def gptq_codes(
    weight: np.ndarray, hessian: np.ndarray, qparams: QParams, *, damping: float, act_order: bool = False
) -> np.ndarray:
    """GPTQ's codes for ``weight`` (``[groups, out, K]`` or one group ``[out, K]``) given
    each group's input Hessian ``X^T X`` (``[groups, K, K]`` or ``[K, K]``) and the
    weight's qparams (per output row, axis 0 over ``groups * out`` rows, or per tensor).

    ``damping`` times the mean of each Hessian's diagonal is added to it; an input that is
    always zero (a zero diagonal) gets a unit one, so its weight rounds to nearest.
    ``act_order``: round the columns of the largest inputs (Hessian diagonal) first, so the
    columns left to absorb errors are the ones whose errors matter least.
    """
    single = np.ndim(weight) == 2
    w = np.array(weight, np.float64, ndmin=3, copy=True)
    h = np.array(hessian, np.float64, ndmin=3, copy=True)
    groups, out, k = w.shape
    if h.shape != (groups, k, k):
        raise DataError(f"hessian: shape {list(h.shape)} does not fit {groups} group(s) of {k} inputs")
    if act_order:
        order = np.argsort(-np.einsum("gkk->gk", h), axis=1, kind="stable")
        w = np.take_along_axis(w, order[:, None, :], axis=2)
        h = np.take_along_axis(np.take_along_axis(h, order[:, :, None], axis=1), order[:, None, :], axis=2)
        permuted = gptq_codes(w, h, qparams, damping=damping)
        codes = np.empty_like(permuted)
        np.put_along_axis(codes, order[:, None, :], permuted, axis=2)
        return codes[0] if single else codes
    diagonal = np.einsum("gkk->gk", h)  # a view: writes go into h
    diagonal[diagonal <= 0] = 1.0
    diagonal += damping * diagonal.mean(axis=1, keepdims=True)
    # Upper Cholesky factor of H^-1: row j holds the compensation of column j's error.
    upper = np.linalg.cholesky(np.linalg.inv(h)).transpose(0, 2, 1)
    codes = np.empty((groups, out, k), qparams.dtype.numpy_dtype)
    # Blocks of columns: a column's error reaches the rest of its block at once, the
    # columns after the block in one matrix product per block (the same sums, grouped).
    for start in range(0, k, _BLOCK):
        end = min(start + _BLOCK, k)
        errors = np.empty((groups, out, end - start))
        for j in range(start, end):
            column = w[:, :, j].reshape(-1, 1)  # every group's rows at once, in row order
            code = quantize(column, qparams)
            codes[:, :, j] = code.reshape(groups, out)
            error = (column - dequantize(code, qparams)).reshape(groups, out) / upper[:, j, j][:, None]
            errors[:, :, j - start] = error
            w[:, :, j + 1 : end] -= error[:, :, None] * upper[:, None, j, j + 1 : end]
        w[:, :, end:] -= np.matmul(errors, upper[:, start:end, end:])
    return codes[0] if single else codes


def _output_error(delta: np.ndarray, hessian: np.ndarray) -> float:
    """``sum ||X D^T||^2`` over groups, from the Hessians (``[G, out, K]``, ``[G, K, K]``)."""
    return float(np.einsum("gok,gkl,gol->", delta, hessian, delta))


def gptq_pool(
    weight: np.ndarray,
    bias: np.ndarray | None,
    weight_qparams: QParams,
    pool: Pool,
    config: GPTQConfig,
    *,
    activation: str | None = None,
    name: str = "layer",
    quiet: bool = False,
    settings: PoolSettings | None = None,
) -> ReconstructionResult:
    """GPTQ on a layer's pool (what the layer-by-layer driver streams into): the Hessian of
    each group from the pool's patches, the codes, and the output error before and after
    on the pool (nearest rounding is returned when GPTQ's is not lower). ``activation``,
    ``name``, ``quiet`` and ``settings`` are the reconstruction driver's, unused: GPTQ
    minimises the error before the activation."""
    del activation, name, quiet, settings
    w = np.asarray(weight, np.float32)
    check_qparams(w, weight_qparams)
    if weight_qparams.axis not in (None, 0):  # the rows below are the output channels
        raise ModelError(
            f"weight_qparams.axis: {weight_qparams.axis} is not allowed for GPTQ; allowed: None (per tensor) "
            "or 0 (per output channel)"
        )
    groups, rows = pool.patches.shape[:2]
    patches = pool.patches.astype(np.float32, copy=False)
    hessian = np.matmul(patches.transpose(0, 2, 1), patches).astype(np.float64)
    grouped = w.reshape(groups, w.shape[0] // groups, -1).astype(np.float64)
    flat_qp = weight_qparams if weight_qparams.axis is None else weight_qparams.evolve(axis=0)
    nearest = quantize(grouped.reshape(w.shape[0], -1), flat_qp).reshape(grouped.shape)
    learned = gptq_codes(grouped, hessian, flat_qp, damping=config.damping, act_order=config.act_order)

    def error(codes: np.ndarray) -> float:
        values = dequantize(codes.reshape(w.shape[0], -1), flat_qp).reshape(grouped.shape)
        return _output_error(grouped - values, hessian) / max(rows, 1)

    loss_nearest, loss = error(nearest), error(learned)
    fell_back = not loss < loss_nearest
    chosen = (nearest if fell_back else learned).reshape(w.shape)
    return ReconstructionResult(
        weight=dequantize(chosen, weight_qparams).astype(np.float32),
        bias=None if bias is None else np.asarray(bias),
        codes=chosen,
        loss_nearest=loss_nearest,
        loss=loss_nearest if fell_back else loss,
        iterations=0,
        stopped_early=False,
        fell_back=fell_back,
    )
