"""``InterpolationMode`` and placeholders for the transform classes timm's data module imports."""

from torchvision._placeholder import module_getattr
from torchvision.transforms.functional import InterpolationMode

__all__ = ["InterpolationMode"]
__getattr__ = module_getattr("transforms")
