"""``quant-onnx inspect``: what pre-processing changes in a float model and what a config
would quantize, or, for a model that is already quantized, what it holds.

Example:
    >>> from onnx import helper, TensorProto
    >>> g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
    ...     [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2])],
    ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])])
    >>> info = inspect_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), "a8w8")
    >>> info["already_quantized"], info["input_ops"]
    (False, {'Relu': 1})
"""

from __future__ import annotations

import collections
from typing import Any

import onnx

from quant_core.onnx_qdq.describe import QuantizedModelInfo, describe_quantized
from quant_core.onnx_qdq.model_io import check_float32, load_model, source_label

#: How ``inspect`` names each pre-processing pass's edits.
PREPROCESS_LABELS = {
    "initializers_to_constants": "initializers also listed as graph inputs, treated as constants",
    "constants_to_initializers": "Constant nodes turned into initializers",
    "eliminate_identities": "Identity nodes removed",
    "fold_constants": "constant subgraphs folded",
    "fold_batchnorm": "BatchNormalization nodes folded into Conv/ConvTranspose/Gemm",
    "fold_pads": "zero Pad nodes merged into Conv",
    "relu6_to_relu": "Clip(0, 6) nodes replaced by Relu",
    "fold_constants_again": "constant subgraphs folded after BN/Pad folding",
    "remove_dead_nodes": "dead nodes and unused initializers dropped",
}


def _op_counts(model: onnx.ModelProto) -> dict[str, int]:
    return dict(sorted(collections.Counter(node.op_type for node in model.graph.node).items()))


def inspect_model(model: Any, config: Any) -> dict[str, Any]:
    """What ``quant-onnx inspect`` prints, as data: ``model`` is a path, bytes or a
    ModelProto; ``config`` anything :func:`quant_onnx.api.resolve_config` takes."""
    loaded = load_model(model)
    quantized = describe_quantized(loaded)
    if quantized is not None:
        return {"already_quantized": True, "input_ops": _op_counts(loaded), "quantized_model": quantized.to_data()}
    from quant_onnx.api import ModelQuantizer

    check_float32(loaded, source_label(model))  # what quantize would refuse, named as it would
    prepared = ModelQuantizer(config, quiet=True).prepare(loaded)
    plan = prepared.plan
    return {
        "already_quantized": False,
        "input_ops": _op_counts(loaded),
        "ops": _op_counts(prepared.model),
        "quantized": dict(sorted(collections.Counter(op for _name, op in plan.quantized_nodes).items())),
        "float_nodes": [{"name": f.name, "op_type": f.op_type, "reason": f.reason} for f in plan.float_nodes],
        "fused_activations": [f.node for f in plan.fused],
        "activation_groups": len(plan.groups),
        "weights": len(plan.weights),
        "preprocess_changes": dict(prepared.preprocess_changes),
        "notes": list(plan.notes),
    }


def inspect_lines(info: dict[str, Any]) -> list[str]:
    """The text form of :func:`inspect_model`'s result."""
    if info["already_quantized"]:
        described = QuantizedModelInfo.from_data(info["quantized_model"])
        lines = described.lines()
        return lines
    ops = sorted(set(info["input_ops"]) | set(info["ops"]))
    width = max([len("op type"), *map(len, ops)]) + 2
    lines = [f"{'op type':<{width}}{'in file':>9}{'after pre-processing':>22}{'quantized':>11}"]
    for op in ops:
        lines.append(
            f"{op:<{width}}{info['input_ops'].get(op, 0):>9}{info['ops'].get(op, 0):>22}"
            f"{info['quantized'].get(op, 0):>11}"
        )
    changes = {k: v for k, v in info["preprocess_changes"].items() if v}
    lines.append("")
    if changes:
        lines.append("pre-processing:")
        lines.extend(f"  {count} {PREPROCESS_LABELS.get(name, name)}" for name, count in changes.items())
    else:
        lines.append("pre-processing: nothing to fold or remove")
    lines.append(
        f"\nwould quantize: {info['weights']} weights, {info['activation_groups']} activation groups, "
        f"{len(info['fused_activations'])} activations fused into their producer"
    )
    if info["float_nodes"]:
        lines.append("\nwould stay float:")
        lines.extend(f"  {n['name']} ({n['op_type']}): {n['reason']}" for n in info["float_nodes"])
    lines.extend(f"note: {note}" for note in info["notes"])
    return lines
