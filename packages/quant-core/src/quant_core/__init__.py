"""quant_core: the vocabulary shared by every backend of the toolkit (numpy + attrs only).

Example:
    >>> import numpy as np
    >>> import quant_core as qc
    >>> cfg = qc.get_preset("a8w8")
    >>> qp = qc.qparams_from_range(-1.0, 1.0, cfg.global_config.weight.evolve(per_channel_axis=None))
    >>> qc.quantize(np.array([0.5], np.float32), qp)
    array([64], dtype=int8)
    >>> qc.config_from_json(qc.config_to_json(cfg)) == cfg
    True
"""

from quant_core.algorithm_config import (
    ActivationEqualizationConfig,
    AdaQuantConfig,
    AdaRoundConfig,
    AlgorithmConfig,
    BiasCorrectionConfig,
    CLEConfig,
    GPTQConfig,
    MixedPrecisionConfig,
    PrecisionTarget,
    SensitivityMetric,
    SmoothQuantConfig,
)
from quant_core.config import CalibrationConfig, OperatorConfig, QuantConfig
from quant_core.dtypes import DType
from quant_core.observer_config import (
    MSE,
    Entropy,
    FixedRange,
    MinMax,
    MovingAverageMinMax,
    ObserverConfig,
    Percentile,
    PowerOfTwoMSE,
    observer_config,
)
from quant_core.presets import PRESETS, get_preset, list_presets, resolve_config
from quant_core.qparams import (
    QParams,
    bias_qparams,
    dequantize,
    fake_quantize,
    qparams_from_range,
    quantize,
    sqnr_db,
)
from quant_core.serialization import (
    SCHEMA_VERSION,
    config_from_json,
    config_to_json,
    from_data,
    load_config,
    save_config,
    to_data,
)
from quant_core.spec import Granularity, QuantSpec, RoundMode, ScaleType

__version__ = "0.1.0"

__all__ = [
    "MSE",
    "PRESETS",
    "SCHEMA_VERSION",
    "ActivationEqualizationConfig",
    "AdaQuantConfig",
    "AdaRoundConfig",
    "AlgorithmConfig",
    "BiasCorrectionConfig",
    "CLEConfig",
    "CalibrationConfig",
    "DType",
    "Entropy",
    "FixedRange",
    "GPTQConfig",
    "Granularity",
    "MinMax",
    "MixedPrecisionConfig",
    "MovingAverageMinMax",
    "ObserverConfig",
    "OperatorConfig",
    "Percentile",
    "PowerOfTwoMSE",
    "PrecisionTarget",
    "QParams",
    "QuantConfig",
    "QuantSpec",
    "RoundMode",
    "ScaleType",
    "SensitivityMetric",
    "SmoothQuantConfig",
    "__version__",
    "bias_qparams",
    "config_from_json",
    "config_to_json",
    "dequantize",
    "fake_quantize",
    "from_data",
    "get_preset",
    "list_presets",
    "load_config",
    "observer_config",
    "qparams_from_range",
    "quantize",
    "resolve_config",
    "save_config",
    "sqnr_db",
    "to_data",
]
