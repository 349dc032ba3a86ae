"""Accuracy-recovery algorithms on the torch backend: the torch side of the drivers in
``quant_algos.drivers`` (which decide; this package runs graph modules and writes their
tensors). CLE edits the normalised float graph before planning
(:func:`apply_cle`); GPTQ, AdaRound, AdaQuant and bias correction walk the calibrated graph
through :class:`TorchLayerRunner`. :class:`~quant_torch_fx.ModelQuantizer` runs what a
config's ``algorithms`` list asks for (:mod:`~quant_torch_fx.algorithms.passes`).

Example:
    >>> from quant_torch_fx.algorithms import SUPPORTED
    >>> SUPPORTED
    ('cle', 'activation_equalization', 'gptq', 'adaround', 'adaquant', 'bias_correction')
"""

from quant_torch_fx.algorithms.cle import apply_cle
from quant_torch_fx.algorithms.passes import SUPPORTED, check_algorithms, pre_pass, run_post_passes
from quant_torch_fx.algorithms.runner import TorchLayerRunner

__all__ = ["SUPPORTED", "TorchLayerRunner", "apply_cle", "check_algorithms", "pre_pass", "run_post_passes"]
