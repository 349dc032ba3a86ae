"""Cross-layer equalization (Nagel et al., "Data-Free Quantization Through Weight
Equalization and Bias Correction", ICCV 2019) and high-bias absorption.

For ``y = W2 relu(W1 x + b1)`` and any positive per-channel ``s``,
``relu(x / s) = relu(x) / s``, so dividing output channel ``i`` of layer 1 by ``s_i``
and multiplying input channel ``i`` of layer 2 by ``s_i`` leaves the function
unchanged. Choosing ``s_i = sqrt(r1_i / r2_i)`` (``r`` = per-channel max |w|) makes the
two channel ranges equal, which is what per-tensor quantization of depthwise-heavy
networks needs. A conv -> depthwise -> conv triple is equalized in one go with the
cube-root formulation of AIMET/Quark: all three ranges become ``cbrt(r1 r2 r3)``.

The activation between the layers must be Relu (or none): a backend replaces Relu6 /
``Clip(0, 6)`` with Relu first when ``CLEConfig.replace_relu6_with_relu`` is set and
otherwise does not form chains through them.

Example:
    >>> import numpy as np
    >>> from quant_core.algorithm_config import CLEConfig
    >>> rng = np.random.default_rng(0)
    >>> layers = {"a": Layer(rng.normal(size=(4, 3, 3, 3)) * [[[[1]]], [[[9]]], [[[0.1]]], [[[2]]]], np.ones(4)),
    ...           "b": Layer(rng.normal(size=(5, 4, 1, 1)), None)}
    >>> result = equalize_chains(layers, [("a", "b")], CLEConfig(steps=1))
    >>> ranges = output_ranges(result.layers["a"]) / input_ranges(result.layers["b"])
    >>> np.allclose(ranges, 1.0)
    True
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import attrs
import numpy as np

from quant_algos.layer import (
    Layer,
    add_bias,
    input_ranges,
    output_ranges,
    response_to_constant,
    scale_inputs,
    scale_outputs,
)
from quant_core.algorithm_config import CLEConfig
from quant_core.errors import ConfigError, DataError, ModelError


def _safe_ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """``num / den`` where both are positive, else 1 (a dead channel keeps its scale)."""
    ok = (num > 0) & (den > 0)
    return np.where(ok, num / np.where(ok, den, 1.0), 1.0)


def _check_link(first: Layer, second: Layer, names: tuple[str, str]) -> None:
    if first.out_channels != second.in_channels:
        raise ModelError(
            f"chain {names[0]}->{names[1]}: {names[0]} has {first.out_channels} output channels "
            f"but {names[1]} reads {second.in_channels}"
        )


def pair_scales(l1: Layer, l2: Layer, bias_in_scale: bool = False) -> np.ndarray:
    """Equalizing scales ``s`` for ``l1 -> relu -> l2``: ``s_i = sqrt(r1_i * r2_i) / r2_i``."""
    r1 = output_ranges(l1, include_bias=bias_in_scale)
    r2 = input_ranges(l2)
    return np.sqrt(_safe_ratio(r1, r2))


def equalize_pair(l1: Layer, l2: Layer, bias_in_scale: bool = False) -> tuple[Layer, Layer, np.ndarray]:
    """Equalize ``l1 -> relu -> l2``; returns the new layers and ``s`` (l1's outputs were
    divided by ``s``, l2's inputs multiplied by it).

    Example:
        >>> import numpy as np
        >>> a = Layer(np.array([[1.0], [8.0]]), None)
        >>> b = Layer(np.array([[2.0, 2.0]]), None)
        >>> a2, b2, s = equalize_pair(a, b)
        >>> np.round(a2.weight.ravel(), 4).tolist(), np.round(b2.weight.ravel(), 4).tolist()
        ([1.4142, 4.0], [1.4142, 4.0])
    """
    _check_link(l1, l2, ("first", "second"))
    s = pair_scales(l1, l2, bias_in_scale)
    return scale_outputs(l1, s), scale_inputs(l2, s), s


def equalize_triple(
    l1: Layer, dw: Layer, l3: Layer, bias_in_scale: bool = False
) -> tuple[Layer, Layer, Layer, np.ndarray, np.ndarray]:
    """Equalize ``l1 -> relu -> depthwise -> relu -> l3``. Returns the new layers and the
    scales ``s12`` (l1 outputs divided, dw weights multiplied) and ``s23`` (dw outputs
    divided, l3 inputs multiplied); afterwards the three per-channel ranges are equal.

    Example:
        >>> import numpy as np
        >>> a = Layer(np.array([[1.0], [8.0]]), None)
        >>> dw = Layer(np.array([[[[4.0]]], [[[1.0]]]]), None, groups=2)
        >>> c = Layer(np.array([[2.0, 1.0]]), None)
        >>> a2, dw2, c2, _, _ = equalize_triple(a, dw, c)
        >>> [round(float(np.abs(x.weight).max()), 6) for x in (a2, dw2, c2)]
        [2.0, 2.0, 2.0]
    """
    if not dw.is_depthwise:
        raise ModelError(f"middle layer: groups={dw.groups} with weight {dw.weight.shape} is not depthwise")
    _check_link(l1, dw, ("first", "depthwise"))
    _check_link(dw, l3, ("depthwise", "last"))
    r1 = output_ranges(l1, include_bias=bias_in_scale)
    r2 = output_ranges(dw)
    r3 = input_ranges(l3)
    alive = (r1 > 0) & (r2 > 0) & (r3 > 0)
    cube = np.cbrt(np.where(alive, r1 * r2 * r3, 1.0))
    s12 = np.where(alive, _safe_ratio(r1, cube), 1.0)
    s23 = np.where(alive, _safe_ratio(cube, r3), 1.0)
    dw_new = scale_outputs(scale_inputs(dw, s12), s23)  # depthwise: input channel i == output channel i
    return scale_outputs(l1, s12), dw_new, scale_inputs(l3, s23), s12, s23


def expected_min(mean: np.ndarray, std: np.ndarray, num_std: float = 3.0) -> np.ndarray:
    """Per-channel lower bound of a pre-activation, ``mean - num_std * |std|``: from a
    folded BatchNorm use ``mean=beta, std=gamma``; from data, the measured mean/std."""
    return np.asarray(mean, np.float64) - num_std * np.abs(np.asarray(std, np.float64))


def absorb_high_bias(l1: Layer, l2: Layer, l1_expected_min: np.ndarray) -> tuple[Layer, Layer, np.ndarray]:
    """Move ``c = max(0, expected_min)`` from l1's bias into l2's bias across a Relu:
    ``relu(x) = relu(x - c) + c`` while ``x >= c``, and l2 of a constant is known.

    Returns the new layers and ``c``. Exact wherever the pre-activation stays above
    ``c`` (and away from l2's zero-padded borders); it lowers l1's output range.

    Example:
        >>> import numpy as np
        >>> a = Layer(np.ones((2, 1)), np.array([5.0, -1.0]))
        >>> b = Layer(np.ones((1, 2)), np.zeros(1))
        >>> a2, b2, c = absorb_high_bias(a, b, np.array([4.0, -3.0]))
        >>> a2.bias.tolist(), b2.bias.tolist(), c.tolist()
        ([1.0, -1.0], [4.0], [4.0, 0.0])
    """
    _check_link(l1, l2, ("first", "second"))
    c = np.maximum(np.asarray(l1_expected_min, np.float64), 0.0)
    if c.shape != (l1.out_channels,):
        raise DataError(f"expected_min: shape {c.shape} does not match {l1.out_channels} output channels")
    if l1.bias is None:  # nothing to move out of: the shift would have to come from the weights
        return l1, l2, np.zeros_like(c)
    return add_bias(l1, -c), add_bias(l2, response_to_constant(l2, c)), c


@attrs.frozen
class CLEResult:
    """Outcome of :func:`equalize_chains`.

    Attributes:
        layers: every input layer by name, equalized where it was part of a chain.
        output_divisors: per layer whose output channels were scaled, the cumulative
            per-channel divisor (its outputs are ``old / divisor``); a backend uses it to
            rescale anything measured on those outputs before CLE.
        absorbed: per layer that gave up bias, the amount ``c`` moved to the next layer.
        steps: sweeps done.
        converged: whether the last sweep changed every scale by less than the tolerance.
        max_change: ``max |s - 1|`` of the last sweep.
    """

    layers: dict[str, Layer]
    output_divisors: dict[str, np.ndarray]
    absorbed: dict[str, np.ndarray]
    steps: int
    converged: bool
    max_change: float


def _validate_chains(layers: Mapping[str, Layer], chains: Sequence[Sequence[str]]) -> list[tuple[str, ...]]:
    out = []
    for chain in chains:
        names = tuple(chain)
        if len(names) not in (2, 3):
            raise ConfigError(f"chain {names}: length {len(names)} is not allowed; allowed: 2 (pair), 3 (triple)")
        for name in names:
            if name not in layers:
                raise ConfigError(f"chain {names}: unknown layer {name!r}")
        for a, b in itertools.pairwise(names):
            _check_link(layers[a], layers[b], (a, b))
        if len(names) == 3 and not layers[names[1]].is_depthwise:
            raise ConfigError(f"chain {names}: middle layer {names[1]!r} is not depthwise")
        out.append(names)
    return out


def equalize_chains(
    layers: Mapping[str, Layer],
    chains: Sequence[Sequence[str]],
    config: CLEConfig,
    expected_mins: Mapping[str, np.ndarray] | None = None,
) -> CLEResult:
    """Equalize every chain (pairs ``(a, b)`` and triples ``(a, dw, c)`` of layer names),
    sweeping ``config.steps`` times, or until the scales stop changing when
    ``config.steps == 0``. Chains may share layers (``a->b`` and ``b->c``); that is why
    several sweeps help. Then, if ``config.absorb_high_bias``, absorb high biases for
    every consecutive pair whose first layer has an entry in ``expected_mins``
    (pre-activation lower bounds in the units *before* CLE, see :func:`expected_min`).

    The inputs are not modified.
    """
    todo = _validate_chains(layers, chains)
    current = dict(layers)
    divisors: dict[str, np.ndarray] = {}

    def divide(name: str, s: np.ndarray) -> None:
        divisors[name] = divisors.get(name, np.ones_like(s)) * s

    max_sweeps = config.max_steps if config.adaptive else config.steps
    steps, change = 0, 0.0
    for _ in range(max_sweeps):
        change = 0.0
        for names in todo:
            if len(names) == 2:
                a, b = names
                current[a], current[b], s = equalize_pair(current[a], current[b], config.bias_in_scale)
                divide(a, s)
                change = max(change, float(np.max(np.abs(s - 1.0), initial=0.0)))
            else:
                a, d, last = names
                current[a], current[d], current[last], s12, s23 = equalize_triple(
                    current[a], current[d], current[last], config.bias_in_scale
                )
                divide(a, s12)
                divide(d, s23)
                change = max(change, float(np.max(np.abs(np.concatenate([s12, s23]) - 1.0), initial=0.0)))
        steps += 1
        if config.adaptive and change < config.tolerance:
            break

    absorbed: dict[str, np.ndarray] = {}
    if config.absorb_high_bias and expected_mins:
        for names in todo:
            for a, b in itertools.pairwise(names):
                if a not in expected_mins:
                    continue
                lower = np.asarray(expected_mins[a], np.float64) / divisors.get(a, 1.0)
                current[a], current[b], shift = absorb_high_bias(current[a], current[b], lower)
                absorbed[a] = absorbed[a] + shift if a in absorbed else shift
    return CLEResult(
        layers=current,
        output_divisors=divisors,
        absorbed=absorbed,
        steps=steps,
        converged=change < config.tolerance,
        max_change=change,
    )
