"""What to quantize and how: one config class shared by every backend.

Resolution for a node: excluded (by name glob or op type) -> not quantized; else the
first ``name_overrides`` glob that matches its name; else its op type's entry in
``op_type_overrides``; else ``global_config``. An override replaces the whole
:class:`OperatorConfig` (use ``attrs.evolve`` on the global one to change a field).

Example:
    >>> from quant_core.config import QuantConfig, OperatorConfig
    >>> from quant_core.spec import QuantSpec
    >>> act = QuantSpec(dtype="uint8", symmetric=False)
    >>> w = QuantSpec(dtype="int8", per_channel_axis=0)
    >>> cfg = QuantConfig(
    ...     global_config=OperatorConfig(input=act, weight=w, output=act),
    ...     name_overrides={"head/*": OperatorConfig(input=act.evolve(dtype="uint16"), weight=w)},
    ...     exclude=("Softmax",),
    ... )
    >>> cfg.for_node("head/fc", "Gemm").input.dtype.value
    'uint16'
    >>> cfg.for_node("sm", "Softmax") is None
    True
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

import attrs

from quant_core.algorithm_config import AlgorithmConfig
from quant_core.conversions import parse_conversions
from quant_core.errors import ConfigError, listed
from quant_core.spec import QuantSpec


def _optional_spec(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:  # type: ignore[type-arg]
    if value is not None and not isinstance(value, QuantSpec):
        raise ConfigError(f"{attribute.name}: {type(value).__name__} is not allowed; allowed: a QuantSpec or null")


@attrs.frozen
class OperatorConfig:
    """Specs of one operator's tensors; ``None`` leaves that tensor in float.

    ``input``/``output`` are activation specs, ``weight`` the weight's, ``bias`` the
    bias's (``None`` for conv/gemm means "int32 at input_scale * weight_scale", the
    form integer kernels need).

    Args:
        input: spec of the data inputs (activations); ``None``: float.
        weight: spec of a Conv/Gemm/MatMul weight; ``None``: float.
        bias: spec of a Conv/Gemm bias; ``None``: the bias rule (``quant_core.bias``:
            int32 at input_scale * weight_scale, wider where that cannot hold it).
        output: spec of the outputs; ``None``: float.

    Example:
        >>> from quant_core.spec import QuantSpec
        >>> OperatorConfig(weight=QuantSpec(dtype="int8")).input is None
        True
    """

    input: QuantSpec | None = attrs.field(default=None, validator=_optional_spec)
    weight: QuantSpec | None = attrs.field(default=None, validator=_optional_spec)
    bias: QuantSpec | None = attrs.field(default=None, validator=_optional_spec)
    output: QuantSpec | None = attrs.field(default=None, validator=_optional_spec)


def _instance_of(cls: type, allowed: str) -> Any:
    def validator(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:  # type: ignore[type-arg]
        if not isinstance(value, cls):
            raise ConfigError(f"{attribute.name}: {type(value).__name__} is not allowed; allowed: {allowed}")

    return validator


def _optional_str(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:  # type: ignore[type-arg]
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{attribute.name}: {value!r} is not allowed; allowed: a string or null")


def _overrides(field: str, value: Any) -> dict[str, OperatorConfig]:
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"{field}: {type(value).__name__} is not allowed; allowed: a mapping of name -> OperatorConfig"
        )
    for key, item in value.items():
        if not isinstance(key, str) or not isinstance(item, OperatorConfig):
            raise ConfigError(f"{field}[{key!r}]: allowed: a string key and an OperatorConfig value")
    # A copy, in the caller's order: name overrides are matched first to last.
    return dict(value)


# Named converters (mypy's attrs plugin needs named functions), one per field so that
# errors name it.
def _op_type_overrides(value: Any) -> dict[str, OperatorConfig]:
    return _overrides("op_type_overrides", value)


def _name_overrides(value: Any) -> dict[str, OperatorConfig]:
    return _overrides("name_overrides", value)


def _item_set(value: Mapping[str, OperatorConfig]) -> frozenset[tuple[str, OperatorConfig]]:
    return frozenset(value.items())


def _item_sequence(value: Mapping[str, OperatorConfig]) -> tuple[tuple[str, OperatorConfig], ...]:
    return tuple(value.items())


def _str_tuple(value: Any) -> tuple[str, ...]:
    items = listed(value, "exclude", "a list of node-name globs or op types (strings)")
    for item in items:
        if not isinstance(item, str):
            raise ConfigError(f"exclude: {item!r} is not allowed; allowed: node-name globs or op types (strings)")
    return items


def _algorithms(value: Any) -> tuple[AlgorithmConfig, ...]:
    from quant_core.algorithm_config import ALGORITHM_CONFIGS

    names = ", ".join(ALGORITHM_CONFIGS)
    items = listed(value, "algorithms", f"a list of algorithm configs ({names})", single=False)
    allowed = tuple(ALGORITHM_CONFIGS.values())
    for item in items:
        if not isinstance(item, allowed):
            raise ConfigError(f"algorithms: {type(item).__name__} is not allowed; allowed: {names}")
    kinds = [type(item).kind for item in items]
    duplicated = sorted({k for k in kinds if kinds.count(k) > 1})
    if duplicated:
        raise ConfigError(f"algorithms: {', '.join(duplicated)} listed twice; each algorithm may appear once")
    return items


def _npu_conversions(value: Any) -> tuple[str, ...]:
    return parse_conversions(value)


@attrs.frozen
class CalibrationConfig:
    """How much calibration data to use and in what batches.

    Args:
        num_samples: calibration samples used (``None``: all that are given).
        batch_size: samples per calibration batch.

    Example:
        >>> CalibrationConfig(num_samples=256, batch_size=32).batch_size
        32
    """

    num_samples: int | None = attrs.field(default=None)
    batch_size: int = attrs.field(default=16)

    @num_samples.validator
    def _vn(self, attribute: attrs.Attribute, value: Any) -> None:  # type: ignore[type-arg]
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise ConfigError(f"num_samples: {value!r} is out of range; allowed: null or an integer > 0")

    @batch_size.validator
    def _vb(self, attribute: attrs.Attribute, value: Any) -> None:  # type: ignore[type-arg]
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"batch_size: {value!r} is out of range; allowed: an integer > 0")


@attrs.frozen
class QuantConfig:
    """A whole model's quantization config. For each node: excluded (by name glob or op
    type) -> left float; else the first ``name_overrides`` glob that matches its name;
    else its op type's ``op_type_overrides`` entry; else ``global_config``.

    Args:
        global_config: specs for every operator not otherwise configured.
        op_type_overrides: op type (``"Conv"``, ``"Gemm"``...) -> specs.
        name_overrides: node-name glob -> specs; first match wins, in insertion order. A
            glob that matches no node of the model is refused when it is planned.
        exclude: node-name globs or op types left in float. An entry that matches no node
            is refused when the model is planned (a typo would quantize what was meant to
            stay float), unless it is an op type the planner quantizes (a reused config).
        algorithms: accuracy-recovery algorithms to run, in order.
        calibration: sample count and batch size.
        name: the preset name this config came from, if any (informational).
        npu_conversions: conversions (:data:`quant_core.conversions.RULES`) applied to the
            float graph before calibration, so that calibration and AdaRound see the
            function an NPU computes (e.g. ``("silu", "sigmoid", "hard_sigmoid")``: Sigmoid
            and SiLU become the device's HardSigmoid). Empty: the graph is left as it is.
        transformer_recipe: recognise LayerNorm, GELU, Softmax and residual blocks and
            give their tensors the formats that serve them under this config's specs:
            the residual stream, LayerNorm/GELU internals and linear biases float, Softmax
            outputs on their observed range (power-of-two formats: the stream at 16 bits,
            the softmax on the fixed ``[0, 1]`` grid; ``docs/transformers.md``); and the
            activation chains between layers (scalar affine steps, decomposed HardSwish,
            SiLU and Swish: ``quant_core.plan.activation_chains``), quantized at their end
            only (power-of-two formats: every step, as before). A CNN without these blocks
            and chains plans the same either way. ``false``: every tensor by the op table
            only.
    """

    global_config: OperatorConfig = attrs.field(validator=_instance_of(OperatorConfig, "an OperatorConfig"))
    # Compared (and hashed) as their items: name overrides in order, since the first
    # matching glob decides and two orders are two configs; op types in any order.
    op_type_overrides: Mapping[str, OperatorConfig] = attrs.field(
        factory=dict, converter=_op_type_overrides, eq=_item_set
    )
    name_overrides: Mapping[str, OperatorConfig] = attrs.field(
        factory=dict, converter=_name_overrides, eq=_item_sequence
    )
    exclude: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    algorithms: tuple[AlgorithmConfig, ...] = attrs.field(default=(), converter=_algorithms)
    calibration: CalibrationConfig = attrs.field(
        factory=CalibrationConfig, validator=_instance_of(CalibrationConfig, "a CalibrationConfig")
    )
    name: str | None = attrs.field(default=None, validator=_optional_str)
    npu_conversions: tuple[str, ...] = attrs.field(default=(), converter=_npu_conversions)
    transformer_recipe: bool = attrs.field(default=True, validator=_instance_of(bool, "true or false"))

    def is_excluded(self, node_name: str, op_type: str) -> bool:
        return any(op_type == pattern or fnmatch.fnmatchcase(node_name, pattern) for pattern in self.exclude)

    def for_node(self, node_name: str, op_type: str) -> OperatorConfig | None:
        """The operator config that applies to one node, or ``None`` when excluded."""
        if self.is_excluded(node_name, op_type):
            return None
        for pattern, config in self.name_overrides.items():
            if fnmatch.fnmatchcase(node_name, pattern):
                return config
        return self.op_type_overrides.get(op_type, self.global_config)

    def algorithm(self, kind: str) -> AlgorithmConfig | None:
        """The configured algorithm of this kind (``"cle"``, ``"adaround"``...), if any."""
        for item in self.algorithms:
            if type(item).kind == kind:
                return item
        return None

    def evolve(self, **changes: Any) -> QuantConfig:
        result: QuantConfig = attrs.evolve(self, **changes)
        return result
