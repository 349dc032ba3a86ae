"""Reference models and data helpers for the quantization toolkit's developer tools.

Plain torch / numpy code with no dependency on the repo packages:

* :mod:`.nets` -- model definitions (``resnet18_shape``, ``mobilenetv2_shape``,
  ``resnet18_224``); importing it requires torch.
* :mod:`.data` -- ``load_fashion_mnist`` (numpy only, no torch import).

Submodules are imported lazily so that ``from tools.reference_models.data import
load_fashion_mnist`` works without torch installed.
"""

__all__ = ["data", "nets"]
