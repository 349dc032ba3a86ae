"""Placeholders for the dataset classes timm's dataset factory imports."""

from torchvision._placeholder import module_getattr

__getattr__ = module_getattr("datasets")
