"""Named configs users ask for by name (``xint8``, ``a8w8``...).

A preset holds specs only: which operators get which spec is the planner's business
(:mod:`quant_core.plan`); per-channel weights are per *output* channel
(:data:`~quant_core.spec.OUTPUT_CHANNELS`), on whichever axis each op keeps them. ``bias=None`` means "int32 at input_scale * weight_scale", the form
integer kernels need. ``docs/presets.md`` is generated from this registry
by :mod:`quant_core.presets_doc` and a test keeps it in sync.

Example:
    >>> from quant_core.presets import get_preset, list_presets
    >>> "xint8" in list_presets()
    True
    >>> cfg = get_preset("xint8")
    >>> cfg.name, cfg.global_config.weight.scale_type.value
    ('xint8', 'power_of_two')
    >>> get_preset("int7")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    quant_core.errors.ConfigError: preset: 'int7' is not a known preset; allowed: xint8, ...
"""

from __future__ import annotations

import os
from collections.abc import Callable

import attrs

from quant_core.algorithm_config import (
    ActivationEqualizationConfig,
    AdaRoundConfig,
    AlgorithmConfig,
    BiasCorrectionConfig,
    CLEConfig,
    GPTQConfig,
)
from quant_core.config import OperatorConfig, QuantConfig
from quant_core.dtypes import DType
from quant_core.errors import ConfigError
from quant_core.observer_config import MinMax, ObserverConfig, Percentile, PowerOfTwoMSE
from quant_core.spec import OUTPUT_CHANNELS, QuantSpec, ScaleType


@attrs.frozen
class Preset:
    """One registry entry: a factory building the config, and what it is for.

    Example:
        >>> PRESETS["a8w8"].description.startswith("onnxruntime")
        True
    """

    name: str
    description: str
    factory: Callable[[], QuantConfig]


# ------------------------------------------------------------------- building blocks


def _pow2_act(dtype: DType = DType.INT8) -> QuantSpec:
    # Symmetric power-of-two activations found by Quark's MinMSE position search.
    return QuantSpec(dtype=dtype, symmetric=True, scale_type=ScaleType.POWER_OF_TWO, observer=PowerOfTwoMSE())


def _pow2_weight() -> QuantSpec:
    # A power-of-two position may clip the largest weights (the nearest power, as Quark's):
    # saturate them at -127, not -128, as the NPU's weight codes allow (NPU-TARGET: Quark's [-127, 127]).
    return QuantSpec(
        dtype=DType.INT8, symmetric=True, scale_type=ScaleType.POWER_OF_TWO, narrow_range=True, observer=MinMax()
    )


def _asym_act(dtype: DType = DType.UINT8, observer: ObserverConfig | None = None) -> QuantSpec:
    return QuantSpec(dtype=dtype, symmetric=False, observer=observer or MinMax())


def _sym_weight(dtype: DType = DType.INT8, per_channel: bool = True) -> QuantSpec:
    return QuantSpec(dtype=dtype, symmetric=True, per_channel_axis=OUTPUT_CHANNELS if per_channel else None)


def _config(name: str, act: QuantSpec, weight: QuantSpec, algorithms: tuple[AlgorithmConfig, ...] = ()) -> QuantConfig:
    op = OperatorConfig(input=act, weight=weight, bias=None, output=act)
    return QuantConfig(global_config=op, algorithms=algorithms, name=name)


# --------------------------------------------------------------------------- presets


def xint8() -> QuantConfig:
    """int8 symmetric power-of-two per-tensor everywhere, MinMSE activations, int32
    bias: the NPU default.

    Example:
        >>> xint8().global_config.input.observer.method
        'minmse_pow2'
    """
    return _config("xint8", _pow2_act(), _pow2_weight())


def xint8_u8() -> QuantConfig:
    """xint8's numbers with activations written as uint8 at zero point 128, the form
    onnxruntime's fast x86 kernels accept.

    Example:
        >>> xint8_u8().global_config.input.dtype.value
        'uint8'
    """
    return _config("xint8_u8", _pow2_act(DType.UINT8), _pow2_weight())


def xint8_int8_bias() -> QuantConfig:
    """xint8 with each bias stored as the NPU's default profile takes it: int8 at its own
    power-of-two scale (what Quark's XINT8 code writes), so legalising for that profile
    leaves the biases as quantized (and bias correction or AdaRound see the real format).

    Example:
        >>> bias = xint8_int8_bias().global_config.bias
        >>> bias.dtype.value, bias.scale_type.value
        ('int8', 'power_of_two')
    """
    config = _config("xint8_int8_bias", _pow2_act(), _pow2_weight())
    bias = QuantSpec(dtype=DType.INT8, symmetric=True, scale_type=ScaleType.POWER_OF_TWO, observer=MinMax())
    return attrs.evolve(config, global_config=attrs.evolve(config.global_config, bias=bias))


# The 8-bit presets with per-channel float-scale weights take the two corrections that keep
# the float function and cost one float pass each (docs/benchmarks.md): activation
# equalization evens out activation channels where a per-channel weight scale absorbs it
# (PP-OCRv3's recogniser from 95% of characters misread to 1.6% with both; a CNN whose Convs end in
# ReLU or ReLU6 has no such site), and the analytic bias correction removes the mean shift
# the int8 weight rounding adds (PP-OCRv4's recogniser 3.6% -> 2.0%, EfficientNet-Lite0's
# top-1 agreement +5 points, the random-weight ViT and DeiT past PT2E's SQNR).
_CORRECTED = (ActivationEqualizationConfig(), BiasCorrectionConfig(method="analytic"))


def a8w8() -> QuantConfig:
    """uint8 asymmetric min-max activations, int8 symmetric per-channel weights, float
    scales; activation equalization where it is free (Conv outputs before HardSwish/SiLU
    chains, depthwise inputs), then the analytic bias correction of the weight rounding.

    Example:
        >>> a8w8().global_config.weight.per_channel_axis, [a.kind for a in a8w8().algorithms]
        ('output', ['activation_equalization', 'bias_correction'])
    """
    return _config("a8w8", _asym_act(), _sym_weight(), _CORRECTED)


def a8w8_per_tensor() -> QuantConfig:
    """a8w8 with one weight scale per tensor.

    Example:
        >>> a8w8_per_tensor().global_config.weight.per_channel_axis is None
        True
    """
    return _config("a8w8_per_tensor", _asym_act(), _sym_weight(per_channel=False))


def a8w8_percentile() -> QuantConfig:
    """a8w8 with activations clipped at the 99.999th percentile.

    Example:
        >>> a8w8_percentile().global_config.output.observer.percentile
        99.999
    """
    return _config("a8w8_percentile", _asym_act(observer=Percentile(99.999)), _sym_weight(), _CORRECTED)


def a16w8() -> QuantConfig:
    """uint16 asymmetric activations, int8 per-channel weights rounded by GPTQ, then the
    analytic bias correction.

    With 16-bit activations nearly lossless, the int8 weights are what is left of the
    error. GPTQ rounds each layer's weights against its inputs, and the bias correction
    removes the mean shift left (at 16-bit activations the one-pass analytic form does what
    the layer walk does). Against the walk alone, on 512 calibration samples:
    EfficientNet-Lite0's top-1 agreement with float 0.936 -> 0.955 in the same time
    (29 against 31 s); PP-OCRv4's recogniser 0.60% -> 0.23% CER against the float reading;
    the trained detector's output 38.1 -> 47.4 dB (docs/benchmarks.md).

    Example:
        >>> a16w8().global_config.input.dtype.value, [type(a).kind for a in a16w8().algorithms]
        ('uint16', ['gptq', 'bias_correction'])
    """
    algorithms = (GPTQConfig(), BiasCorrectionConfig(method="analytic"))
    return _config("a16w8", _asym_act(DType.UINT16), _sym_weight(), algorithms)


def w4a8() -> QuantConfig:
    """int4 symmetric per-channel weights, uint8 asymmetric activations.

    Example:
        >>> w4a8().global_config.weight.dtype.value
        'int4'
    """
    return _config("w4a8", _asym_act(), _sym_weight(DType.INT4))


def int8_cnn_accurate() -> QuantConfig:
    """a8w8 with percentile activations and AdaRound weights.

    Example:
        >>> int8_cnn_accurate().algorithm("adaround") is not None
        True
    """
    return attrs.evolve(a8w8_percentile(), algorithms=(AdaRoundConfig(),), name="int8_cnn_accurate")


def int8_cnn_cle() -> QuantConfig:
    """xint8 after cross-layer equalization.

    Example:
        >>> [type(a).kind for a in int8_cnn_cle().algorithms]
        ['cle']
    """
    return attrs.evolve(xint8(), algorithms=(CLEConfig(),), name="int8_cnn_cle")


def xint8_adaround() -> QuantConfig:
    """xint8 tuned for accuracy: MinMSE power-of-two weight positions (the activations'
    search, applied to each weight, codes in [-127, 127]), cross-layer equalization, then
    AdaRound at learning rate 0.1 on minibatches of 4 samples (the regime of Quark's
    ``XINT8_ADAROUND``).

    The same integer formats as ``xint8``. Measured against Quark's recipe on the same
    calibration crops (docs/benchmarks.md): EfficientNet-Lite0 0.877 top-1 agreement with
    float where Quark reaches 0.869, in 0.19x its CPU time and 0.20x its memory; AdaRound's
    default minibatch of 32 gave 0.848 and took 5x longer.

    Example:
        >>> cfg = xint8_adaround()
        >>> [type(a).kind for a in cfg.algorithms], cfg.algorithm("adaround").batch_size
        (['cle', 'adaround'], 4)
        >>> cfg.global_config.weight.observer.method
        'minmse_pow2'
    """
    weight = attrs.evolve(_pow2_weight(), observer=PowerOfTwoMSE())
    algorithms = (CLEConfig(), AdaRoundConfig(learning_rate=0.1, batch_size=4))
    return _config("xint8_adaround", _pow2_act(), weight, algorithms)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("xint8", "NPU default (AMD Ryzen AI / DPU XINT8); also runs anywhere as QDQ", xint8),
        Preset("xint8_u8", "xint8 numerics on onnxruntime x86, where integer kernels need uint8 activations", xint8_u8),
        Preset(
            "xint8_int8_bias",
            "NPUs whose bias is int8 at its own position (the default NPU profile): legalising changes no bias",
            xint8_int8_bias,
        ),
        Preset("a8w8", "onnxruntime CPU INT8: the fast, accurate default for CNNs", a8w8),
        Preset("a8w8_per_tensor", "backends or runtimes without per-channel weights", a8w8_per_tensor),
        Preset("a8w8_percentile", "models whose activations have rare outliers", a8w8_percentile),
        Preset("a16w8", "accuracy-sensitive models (detection, segmentation, super-resolution)", a16w8),
        Preset("w4a8", "smallest weights; expect an accuracy drop without AdaRound/QAT", w4a8),
        Preset(
            "int8_cnn_accurate",
            "best PTQ accuracy for CNNs on onnxruntime when calibration time is available",
            int8_cnn_accurate,
        ),
        Preset(
            "int8_cnn_cle", "NPU CNNs whose per-tensor weights lose accuracy (MobileNet-style depthwise)", int8_cnn_cle
        ),
        Preset(
            "xint8_adaround",
            "best NPU (xint8) accuracy without training: our counterpart of Quark's XINT8_ADAROUND",
            xint8_adaround,
        ),
    )
}


def list_presets() -> tuple[str, ...]:
    """Names of all presets, in table order.

    Example:
        >>> list_presets()[:3]
        ('xint8', 'xint8_u8', 'xint8_int8_bias')
    """
    return tuple(PRESETS)


def get_preset(name: str) -> QuantConfig:
    """A fresh config for the preset ``name`` (its ``name`` field is ``name``).

    Example:
        >>> get_preset("a16w8").name
        'a16w8'
    """
    try:
        preset = PRESETS[name]
    except (KeyError, TypeError):
        raise ConfigError(f"preset: {name!r} is not a known preset; allowed: {', '.join(PRESETS)}") from None
    return preset.factory()


DEFAULT_PRESET = "a8w8"
"""The preset every entry point uses when given no config: what an onnxruntime user
expects (uint8 activations, int8 per-channel weights)."""


def resolve_config(config: QuantConfig | str | os.PathLike[str] | None, default: str = DEFAULT_PRESET) -> QuantConfig:
    """A :class:`QuantConfig` from a config, a preset name, a ``.json`` config file, or
    ``None`` (the ``default`` preset): what every backend's entry point accepts.

    Example:
        >>> resolve_config(None).name, resolve_config("xint8").name
        ('a8w8', 'xint8')
        >>> resolve_config(3)
        Traceback (most recent call last):
        ...
        quant_core.errors.ConfigError: config: int is not allowed; allowed: a QuantConfig, a preset name, a .json path
    """
    if config is None:
        return get_preset(default)
    if isinstance(config, QuantConfig):
        return config
    if isinstance(config, os.PathLike) or (isinstance(config, str) and config.endswith(".json")):
        from quant_core.serialization import load_config

        return load_config(config)
    if isinstance(config, str):
        return get_preset(config)
    raise ConfigError(
        f"config: {type(config).__name__} is not allowed; allowed: a QuantConfig, a preset name, a .json path"
    )
