"""quant-npu-export: deployment checks, legalisation, an integer-only simulator and
``quant_info.json`` for NPU-style integer hardware (AMD Ryzen AI NPU, Vitis AI DPU).

Example:
    >>> import quant_npu
    >>> quant_npu.load_profile().name, quant_npu.list_profiles()[0]
    ('xint8', 'xint8')
"""

from quant_npu.check import CheckResult, check
from quant_npu.legalize import Change, LegalizeResult, legalize, legalize_model
from quant_npu.profile import BiasFormat, NPUProfile, get_profile, list_profiles, load_profile
from quant_npu.quant_info import ImportResult, export_quant_info, import_quant_info, write_quant_info
from quant_npu.sim import NPUSimulator, simulate
from quant_npu.violations import RULES, Violation

__all__ = [
    "RULES",
    "BiasFormat",
    "Change",
    "CheckResult",
    "ImportResult",
    "LegalizeResult",
    "NPUProfile",
    "NPUSimulator",
    "Violation",
    "check",
    "export_quant_info",
    "get_profile",
    "import_quant_info",
    "legalize",
    "legalize_model",
    "list_profiles",
    "load_profile",
    "simulate",
    "write_quant_info",
]
__version__ = "0.1.0"
