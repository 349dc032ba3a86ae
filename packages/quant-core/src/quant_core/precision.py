"""Raising layers to wider formats (mixed precision), as config edits every backend applies
the same way.

A layer raised to ``a16w8`` reads its input as 16-bit (``uint8`` -> ``uint16``,
``int8`` -> ``int16``, 4-bit likewise), ``a8w16`` keeps its input and gets 16-bit weights,
``a16w16`` both. :func:`raised_config` writes those as name overrides that come first,
so re-planning the model gives the raised layers their formats with the same rules as
any hand-written config (the planner then gives a raised layer its own input
requantization, :class:`quant_core.plan.InputRequant`).

Example:
    >>> from quant_core.algorithm_config import PrecisionTarget
    >>> from quant_core.presets import get_preset
    >>> cfg = raised_config(get_preset("a8w8"), {"conv[1]": PrecisionTarget.A16W8}, {"conv[1]": "Conv"})
    >>> layer = cfg.for_node("conv[1]", "Conv")
    >>> layer.input.dtype.value, layer.weight.dtype.value, cfg.for_node("conv1", "Conv").input.dtype.value
    ('uint16', 'int8', 'uint8')
"""

from __future__ import annotations

from collections.abc import Mapping

from quant_core.algorithm_config import PrecisionTarget
from quant_core.config import OperatorConfig, QuantConfig
from quant_core.dtypes import DType
from quant_core.errors import ConfigError
from quant_core.spec import QuantSpec

RAISES_ACTIVATION = {PrecisionTarget.A16W8: True, PrecisionTarget.A8W16: False, PrecisionTarget.A16W16: True}
RAISES_WEIGHT = {PrecisionTarget.A16W8: False, PrecisionTarget.A8W16: True, PrecisionTarget.A16W16: True}

_WIDER = {
    DType.INT4: DType.INT16,
    DType.INT8: DType.INT16,
    DType.UINT4: DType.UINT16,
    DType.UINT8: DType.UINT16,
}


def widen(spec: QuantSpec | None) -> QuantSpec | None:
    """``spec`` in 16 bits, same signedness and everything else (``None`` and formats of 16
    bits or more unchanged).

    Example:
        >>> widen(QuantSpec(dtype="uint8", symmetric=False)).dtype.value
        'uint16'
    """
    if spec is None or spec.dtype not in _WIDER:
        return spec
    return spec.evolve(dtype=_WIDER[spec.dtype])


def raised_weight_bits(base_bits: int, target: PrecisionTarget) -> int:
    """Bits of a weight stored at ``base_bits`` once its layer is raised to ``target`` (what
    :func:`raised_config` gives it: 16 where the target widens weights, else unchanged).

    Example:
        >>> raised_weight_bits(4, PrecisionTarget.A8W16), raised_weight_bits(4, PrecisionTarget.A16W8)
        (16, 4)
    """
    return max(base_bits, 16) if RAISES_WEIGHT[target] else base_bits


def _literal_glob(name: str) -> str:
    """A glob matching exactly ``name`` (``*``, ``?`` and ``[`` escaped)."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def raised_config(
    config: QuantConfig, assignment: Mapping[str, PrecisionTarget], op_types: Mapping[str, str]
) -> QuantConfig:
    """``config`` with each layer of ``assignment`` (node name -> target) raised; ``op_types``
    gives each raised node's op type (to find the operator config it had)."""
    overrides: dict[str, OperatorConfig] = {}
    for name, target in assignment.items():
        current = config.for_node(name, op_types[name])
        if current is None:
            raise ConfigError(f"node {name!r}: excluded by the config; it cannot be raised")
        overrides[_literal_glob(name)] = OperatorConfig(
            input=widen(current.input) if RAISES_ACTIVATION[target] else current.input,
            weight=widen(current.weight) if RAISES_WEIGHT[target] else current.weight,
            bias=current.bias,
            output=current.output,
        )
    # The raised entries first (the first matching glob decides) and in place of an entry of
    # the same name: ``{**new, **old}`` would keep the old value under that key.
    kept = {glob: op for glob, op in config.name_overrides.items() if glob not in overrides}
    return config.evolve(name_overrides={**overrides, **kept})
