"""Accuracy-recovery algorithms on ONNX models: the graph plumbing around the math in
``quant_algos``.

Float-model pre-passes (before calibration): :func:`apply_cle`,
:func:`apply_smoothquant`. QDQ-model post-passes: :func:`apply_bias_correction`,
:func:`apply_adaround`, :func:`apply_adaquant` (these two need ``quant-onnx[torch]``),
:func:`apply_mixed_precision`. :func:`run_pre_passes` / :func:`run_post_passes` run
what a config's ``algorithms`` list asks for. Nothing here imports torch.

Example:
    >>> from quant_onnx.algorithms import PRE_PASSES, POST_PASSES
    >>> PRE_PASSES, POST_PASSES
    (('cle', 'smoothquant'), ('mixed_precision', 'adaround', 'adaquant', 'bias_correction'))
"""

from quant_onnx.algorithms.adaround import (
    ReconstructionReport,
    apply_adaquant,
    apply_adaquant_with_report,
    apply_adaround,
    apply_adaround_with_report,
)
from quant_onnx.algorithms.bias_correction import apply_bias_correction
from quant_onnx.algorithms.cle import CLEReport, apply_cle
from quant_onnx.algorithms.mixed_precision import MixedPrecisionReport, apply_mixed_precision
from quant_onnx.algorithms.passes import POST_PASSES, PRE_PASSES, PassesResult, run_post_passes, run_pre_passes
from quant_onnx.algorithms.smoothquant import SmoothQuantReport, apply_smoothquant, apply_smoothquant_with_report

__all__ = [
    "POST_PASSES",
    "PRE_PASSES",
    "CLEReport",
    "MixedPrecisionReport",
    "PassesResult",
    "ReconstructionReport",
    "SmoothQuantReport",
    "apply_adaquant",
    "apply_adaquant_with_report",
    "apply_adaround",
    "apply_adaround_with_report",
    "apply_bias_correction",
    "apply_cle",
    "apply_mixed_precision",
    "apply_smoothquant",
    "apply_smoothquant_with_report",
    "run_post_passes",
    "run_pre_passes",
]
