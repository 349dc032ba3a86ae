"""No rule twice: the decisions that set scales live in quant_core (the planner, the bias
rule, the qparam math) and the algorithm loops in quant_algos (the drivers); a backend maps
its graph onto them and supplies runners. This check fails when a backend package defines
one of those decisions again.

    python tools/check_decisions.py            # exit 1 and one line per finding

Run by the ``layering`` nox session beside the import contracts (``.importlinter``).

Example:
    >>> [p.name for p in BACKENDS]
    ['quant_onnx', 'quant_torch_fx', 'quant_npu']
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = [
    ROOT / "packages" / "quant-onnx" / "src" / "quant_onnx",
    ROOT / "packages" / "quant-torch-fx" / "src" / "quant_torch_fx",
    ROOT / "packages" / "quant-npu-export" / "src" / "quant_npu",
]

# (pattern at the start of a line, where the one definition lives)
FORBIDDEN = [
    (r"class OpKind\b", "quant_core.plan.ops (op kinds)"),
    (r"class OpPolicy\b", "quant_core.plan.ops (the op table)"),
    (r"(POLICIES|FUSABLE_PRODUCERS|HOMOGENEOUS_ACTIVATIONS)\s*[:=]", "quant_core.plan.ops (the op table)"),
    (r"def (policy_for|clip_bounds|activation_kind|weight_channel_axis)\b", "quant_core.plan.ops"),
    (r"class _?UnionFind\b", "quant_core.plan.planner (shared-scale groups)"),
    (r"class (TensorGroup|WeightSlot|BiasSlot|FusedActivation|QuantPlan|InputRequant)\b", "quant_core.plan.planner"),
    (r"def (resolve_weight_spec|plan_quantization)\b", "quant_core.plan.planner"),
    (
        r"def (encode_bias|fit_weight_to_bias|accumulation_headroom|quantize_bias|bias_codes|bias_qparams)\b",
        "quant_core.bias (the bias rule)",
    ),
    (r"def (qparams_from_range|constant_qparams|round_values)\b", "quant_core (qparam math)"),
    (r"def (find_chains|plan_equalization|clipped_fractions)\b", "quant_algos.drivers.cle (CLE chains and ReLU6 rule)"),
    (r"RELU6_CLIPPED_FRACTION\s*=", "quant_algos.drivers.cle (the ReLU6 rule)"),
    (r"def (reconstruct_layers|correct_biases|search_mixed_precision|run_mixed_precision)\b", "quant_algos.drivers"),
    (r"DEFAULT_NUM_SAMPLES\s*=", "quant_core.algorithm_config (one default sample count)"),
    (r"def (require_torch|check_torch)\b", "quant_algos._torch"),
    (r"def widen\b|RAISES_(ACTIVATION|WEIGHT)\s*=", "quant_core.precision (mixed-precision formats)"),
]


def findings(roots: list[Path] = BACKENDS) -> list[str]:
    """``path:line: <definition> belongs in <place>`` for every forbidden definition."""
    patterns = [(re.compile(rf"^\s*{pattern}"), place) for pattern, place in FORBIDDEN]
    out = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                for pattern, place in patterns:
                    if pattern.match(line):
                        out.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()} -- belongs in {place}")
    return out


def unlisted_npu_modules(config: Path = ROOT / ".importlinter") -> list[str]:
    """quant_npu modules (vitis aside) the torch-free contract of ``.importlinter`` does not
    name: that contract lists them one by one (it must not match quant_npu.vitis), so a new
    module must be added to it.

    Example:
        >>> unlisted_npu_modules()
        []
    """
    text = config.read_text(encoding="utf-8")
    section = text.split("[importlinter:contract:npu-torch-only-in-vitis]", 1)[1].split("[importlinter:", 1)[0]
    listed = set(re.findall(r"^\s+(quant_npu[\w.*]*)$", section, flags=re.M))
    root = BACKENDS[2]
    missing = []
    for path in sorted(root.glob("*.py")):
        name = "quant_npu" if path.stem == "__init__" else f"quant_npu.{path.stem}"
        if name not in listed:
            missing.append(f"{config.name}: npu-torch-only-in-vitis does not list {name}")
    for package in sorted(p for p in root.iterdir() if (p / "__init__.py").exists() and p.name != "vitis"):
        if f"quant_npu.{package.name}" not in listed or f"quant_npu.{package.name}.*" not in listed:
            missing.append(f"{config.name}: npu-torch-only-in-vitis does not list quant_npu.{package.name}(.*)")
    return missing


def main() -> int:
    found = findings() + unlisted_npu_modules()
    for line in found:
        print(line)
    print(f"check_decisions: {len(found)} backend definitions of planner/driver rules", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
