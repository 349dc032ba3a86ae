"""Accuracy-recovery algorithms on ONNX models: the ONNX side of the drivers and math in
``quant_algos`` (which decide; this package runs models through onnxruntime and edits
them).

Float-model pre-passes (before calibration): :func:`apply_cle`,
:func:`apply_activation_equalization`, :func:`apply_smoothquant`. QDQ-model post-passes, given the calibrated plan the model
was written from: :func:`apply_mixed_precision`, :func:`apply_reconstruction`
(AdaRound/AdaQuant, need ``quant-onnx[torch]``), :func:`apply_bias_correction`.
:func:`run_pre_passes` / :func:`run_post_passes` run what a config's ``algorithms`` list
asks for, in the order :mod:`quant_algos.drivers.schedule` gives both backends. Nothing
here imports torch.

Example:
    >>> from quant_onnx.algorithms import run_pre_passes, run_post_passes
    >>> callable(run_pre_passes) and callable(run_post_passes)
    True
"""

from quant_algos.drivers import CLEReport, MixedPrecisionReport, ReconstructionReport
from quant_onnx.algorithms.activation_equalization import (
    ActivationEqualizationReport,
    apply_activation_equalization,
    apply_activation_equalization_with_report,
)
from quant_onnx.algorithms.cle import apply_cle
from quant_onnx.algorithms.layerwise import apply_bias_correction, apply_reconstruction
from quant_onnx.algorithms.mixed_precision import apply_mixed_precision
from quant_onnx.algorithms.passes import PassesResult, run_post_passes, run_pre_passes
from quant_onnx.algorithms.runner import OnnxLayerRunner
from quant_onnx.algorithms.smoothquant import SmoothQuantReport, apply_smoothquant, apply_smoothquant_with_report

__all__ = [
    "ActivationEqualizationReport",
    "CLEReport",
    "MixedPrecisionReport",
    "OnnxLayerRunner",
    "PassesResult",
    "ReconstructionReport",
    "SmoothQuantReport",
    "apply_activation_equalization",
    "apply_activation_equalization_with_report",
    "apply_bias_correction",
    "apply_cle",
    "apply_mixed_precision",
    "apply_reconstruction",
    "apply_smoothquant",
    "apply_smoothquant_with_report",
    "run_post_passes",
    "run_pre_passes",
]
