"""quant-npu-export: deployment checks for NPU-style integer hardware (XINT8).

This release holds the target profile and the conv shift rules of
``NPU-TARGET.md``; legalisation, the integer simulator and ``quant_info.json``
land with their own issue.
"""

from quant_npu.profile import BiasFormat, NPUProfile
from quant_npu.shifts import ShiftViolation, check_conv_shifts

__all__ = ["BiasFormat", "NPUProfile", "ShiftViolation", "check_conv_shifts"]
__version__ = "0.1.0"
