"""``InterpolationMode`` (the real enum) and placeholders for the functional transforms."""

from enum import Enum

from torchvision._placeholder import module_getattr


class InterpolationMode(Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


__getattr__ = module_getattr("transforms.functional")
