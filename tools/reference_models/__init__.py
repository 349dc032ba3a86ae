"""Reference models and data helpers for the quantization toolkit's developer tools.

Plain torch / numpy code with no dependency on the repo packages:

* :mod:`.nets` -- model definitions (``resnet18_shape``, ``mobilenetv2_shape``,
  ``resnet18_224``); importing it requires torch.
* :mod:`.transformer_nets` (``fmnist_deit``, ``ocr_ctc``) and :mod:`.conv_nets`
  (``fmnist_hardswish_se``, ``fmnist_yolo``, ``text_seg``) -- the task models of
  ``tools/train_models.py``, built from :mod:`.layers`; they require torch.
* :mod:`.torch_weights` -- ``load_reference_model(name)``: any of them with its trained weights.
* :mod:`.data` -- ``load_fashion_mnist`` (numpy only, no torch import).

Submodules are imported lazily so that ``from tools.reference_models.data import
load_fashion_mnist`` works without torch installed.
"""

__all__ = ["conv_nets", "data", "layers", "nets", "torch_weights", "transformer_nets"]
