"""quant_algos: accuracy-recovery algorithms as math on numpy arrays.

Backends find the layers (Conv/Gemm chains, captured activations) and call these
functions; nothing here knows about ONNX or torch modules. AdaRound and AdaQuant use
PyTorch, imported only when they run (``pip install 'quant-algos[torch]'``).

Example:
    >>> import numpy as np
    >>> import quant_algos as qa
    >>> from quant_core.algorithm_config import CLEConfig
    >>> rng = np.random.default_rng(0)
    >>> layers = {"c1": qa.Layer(rng.normal(size=(8, 3, 3, 3)), np.zeros(8)),
    ...           "c2": qa.Layer(rng.normal(size=(4, 8, 1, 1)), np.zeros(4))}
    >>> result = qa.equalize_chains(layers, [("c1", "c2")], CLEConfig(steps=0))
    >>> result.converged
    True
"""

from quant_algos._reconstruction import ReconstructionResult
from quant_algos.adaquant import adaquant_layer
from quant_algos.adaround import adaround_layer
from quant_algos.bias_correction import MeanErrorAccumulator, correct_bias
from quant_algos.cle import (
    CLEResult,
    absorb_high_bias,
    equalize_chains,
    equalize_pair,
    equalize_triple,
    expected_min,
)
from quant_algos.layer import Layer, input_ranges, output_ranges
from quant_algos.mixed_precision import MixedPrecisionResult, Step, search_mixed_precision
from quant_algos.reconstruction_data import ConvGeometry
from quant_algos.smoothquant import (
    ActivationAbsMax,
    SmoothQuantResult,
    scale_weight_inputs,
    smooth_layers,
    smoothquant_scales,
    weight_absmax,
)

__all__ = [
    "ActivationAbsMax",
    "CLEResult",
    "ConvGeometry",
    "Layer",
    "MeanErrorAccumulator",
    "MixedPrecisionResult",
    "ReconstructionResult",
    "SmoothQuantResult",
    "Step",
    "absorb_high_bias",
    "adaquant_layer",
    "adaround_layer",
    "correct_bias",
    "equalize_chains",
    "equalize_pair",
    "equalize_triple",
    "expected_min",
    "input_ranges",
    "output_ranges",
    "scale_weight_inputs",
    "search_mixed_precision",
    "smooth_layers",
    "smoothquant_scales",
    "weight_absmax",
]
