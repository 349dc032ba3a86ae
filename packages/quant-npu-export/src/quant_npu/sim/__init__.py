"""The integer-only NPU simulator: :class:`NPUSimulator` and :func:`simulate`.

Example:
    >>> from quant_npu.sim import NPUSimulator, simulate
    >>> callable(simulate)
    True
"""

from quant_npu.sim.runner import NPUSimulator, simulate

__all__ = ["NPUSimulator", "simulate"]
