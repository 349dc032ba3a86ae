"""The trained reference models as torch modules: the definitions of
:mod:`tools.reference_models.nets`, :mod:`~tools.reference_models.transformer_nets` and
:mod:`~tools.reference_models.conv_nets` with the weights of the committed ONNX files
(``tools/models/*.onnx``; exported unfolded by ``tools/train_reference.py`` and
``tools/train_models.py``, so every initializer is named after its ``state_dict`` key).

Example:
    >>> model = load_reference_model("fmnist_resnet18")
    >>> model.training
    False
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

MODELS_DIR = Path(__file__).resolve().parents[1] / "models"
# name -> (module of tools.reference_models, builder, keyword arguments)
ARCHITECTURES = {
    "fmnist_resnet18": ("nets", "resnet18_shape", {"num_classes": 10, "width": 16, "in_ch": 1}),
    "fmnist_mobilenetv2": ("nets", "mobilenetv2_shape", {"num_classes": 10, "width_mult": 0.5, "in_ch": 1}),
    "fmnist_hardswish_se": ("conv_nets", "fmnist_hardswish_se", {}),
    "fmnist_deit": ("transformer_nets", "fmnist_deit", {}),
    "fmnist_deit_decomposed": ("transformer_nets", "fmnist_deit", {"norm": "decomposed", "gelu": "tanh"}),
    "ocr_ctc": ("transformer_nets", "ocr_ctc", {}),
    "fmnist_yolo": ("conv_nets", "fmnist_yolo", {}),
    "text_seg": ("conv_nets", "text_seg", {}),
}


def load_reference_model(name: str, models_dir: Path = MODELS_DIR):  # -> torch.nn.Module
    """``name`` (a key of :data:`ARCHITECTURES`) in eval mode with its trained weights."""
    import importlib

    import onnx
    import torch
    from onnx import numpy_helper

    if name not in ARCHITECTURES:
        raise ValueError(f"model: {name!r} is not known; allowed: {', '.join(ARCHITECTURES)}")
    module, builder, kwargs = ARCHITECTURES[name]
    model = getattr(importlib.import_module(f"tools.reference_models.{module}"), builder)(**kwargs)
    proto = onnx.load(str(models_dir / f"{name}.onnx"))
    weights = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    # The exporter deduplicates equal tensors behind Identity nodes (equal BN biases).
    for node in proto.graph.node:
        if node.op_type == "Identity" and node.input[0] in weights:
            weights.setdefault(node.output[0], weights[node.input[0]])
    state = model.state_dict()
    missing = [key for key in state if key not in weights and not key.endswith("num_batches_tracked")]
    if missing:
        raise ValueError(f"{name}.onnx lacks initializers for {missing[:5]}")
    with torch.no_grad():
        for key, value in state.items():
            if key in weights:
                value.copy_(torch.from_numpy(np.array(weights[key])))
    return model.eval()
