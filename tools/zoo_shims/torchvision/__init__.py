"""A stand-in for torchvision: only what timm imports (see tools/zoo_shims/README.md)."""

__version__ = "0.0.0+zoo-shim"
