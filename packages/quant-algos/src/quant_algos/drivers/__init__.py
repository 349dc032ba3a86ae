"""Backend-neutral drivers of the accuracy algorithms: the loops and rules, written once.

A backend supplies a :class:`~quant_algos.drivers.runner.LayerRunner` (its float and
quantized models over the calibration samples, and a way to write back) for the
layer-wise algorithms, a :class:`~quant_algos.drivers.cle.TensorSource` and the planner's
graph view for CLE, and build/score callbacks for mixed precision:

- :func:`~quant_algos.drivers.reconstruction.reconstruct_layers`: AdaRound / AdaQuant.
- :func:`~quant_algos.drivers.bias_correction.correct_biases`: empirical bias correction.
- :func:`~quant_algos.drivers.cle.plan_equalization`: cross-layer equalization (chains,
  the ReLU6 rule, high-bias absorption).
- :func:`~quant_algos.drivers.mixed_precision.run_mixed_precision`: mixed precision.

Example:
    >>> from quant_algos.drivers import QuantLayer, correct_biases, plan_equalization
    >>> callable(correct_biases) and callable(plan_equalization)
    True
"""

from quant_algos.drivers.bias_correction import correct_biases
from quant_algos.drivers.cle import CLEReport, Equalization, TensorSource, plan_equalization
from quant_algos.drivers.mixed_precision import MixedPrecisionReport, run_mixed_precision
from quant_algos.drivers.reconstruction import LayerOutcome, ReconstructionReport, reconstruct_layers
from quant_algos.drivers.runner import LayerRunner, QuantLayer

__all__ = [
    "CLEReport",
    "Equalization",
    "LayerOutcome",
    "LayerRunner",
    "MixedPrecisionReport",
    "QuantLayer",
    "ReconstructionReport",
    "TensorSource",
    "correct_biases",
    "plan_equalization",
    "reconstruct_layers",
    "run_mixed_precision",
]
