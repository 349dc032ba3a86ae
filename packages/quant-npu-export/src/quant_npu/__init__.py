"""quant-npu-export: deployment checks, legalisation, an integer-only simulator and
``quant_info.json`` for NPU-style integer hardware (AMD Ryzen AI NPU, Vitis AI DPU).

Example:
    >>> import quant_npu
    >>> quant_npu.load_profile().name
    'xint8'
"""

from quant_npu.check import CheckResult, check
from quant_npu.profile import BiasFormat, NPUProfile, get_profile, list_profiles, load_profile
from quant_npu.violations import Violation

__all__ = [
    "BiasFormat",
    "CheckResult",
    "NPUProfile",
    "Violation",
    "check",
    "get_profile",
    "list_profiles",
    "load_profile",
]
__version__ = "0.1.0"
