"""Fashion-MNIST loader (numpy only -- deliberately no torch import).

``load_fashion_mnist(split)`` returns images as float32 NCHW ``(N, 1, 32, 32)``,
zero-padded by 2 px from 28x28 (padding applied in raw pixel space, i.e. the pad
value is 0 before normalisation) and normalised with ``(x/255 - MEAN) / STD``,
plus labels as int64 ``(N,)``.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np

DEFAULT_ROOT = Path(os.environ.get("FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist"))
MEAN = 0.2860
STD = 0.3530
PAD = 2
IMAGE_SIZE = 28 + 2 * PAD  # 32

CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)

_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (optionally gzip-compressed) into a numpy array."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path}: not an IDX file (bad magic)")
    dtype_code, ndim = raw[2], raw[3]
    if dtype_code not in _DTYPES:
        raise ValueError(f"{path}: unknown IDX dtype code 0x{dtype_code:02x}")
    dims = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    offset = 4 + 4 * ndim
    dtype = np.dtype(_DTYPES[dtype_code])
    count = int(np.prod(dims)) if dims else 1
    if len(raw) - offset != count * dtype.itemsize:
        raise ValueError(f"{path}: size mismatch (header says {dims})")
    arr = np.frombuffer(raw, dtype=dtype, count=count, offset=offset)
    return arr.reshape(dims).astype(dtype.newbyteorder("="), copy=True)


def load_fashion_mnist_raw(split: str, root: str | os.PathLike | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Return the raw ``uint8 (N, 28, 28)`` images and ``int64 (N,)`` labels."""
    if split in ("t10k", "val"):
        split = "test"
    if split not in _FILES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    root = Path(root) if root is not None else DEFAULT_ROOT
    img_name, lbl_name = _FILES[split]
    images = read_idx(root / img_name)
    labels = read_idx(root / lbl_name).astype(np.int64)
    if images.shape[0] != labels.shape[0] or images.shape[1:] != (28, 28):
        raise ValueError(f"unexpected Fashion-MNIST shapes {images.shape} / {labels.shape}")
    return images, labels


def preprocess(images_u8: np.ndarray) -> np.ndarray:
    """uint8 ``(N, 28, 28)`` -> normalised float32 ``(N, 1, 32, 32)``."""
    x = np.zeros((images_u8.shape[0], 1, IMAGE_SIZE, IMAGE_SIZE), dtype=np.float32)
    x[:, 0, PAD : PAD + 28, PAD : PAD + 28] = images_u8.astype(np.float32) / 255.0
    x -= np.float32(MEAN)
    x /= np.float32(STD)
    return x


def load_fashion_mnist(split: str, root: str | os.PathLike | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Load a Fashion-MNIST split ready for the reference models.

    Args:
        split: ``"train"`` (60k) or ``"test"`` (10k; ``"t10k"``/``"val"`` accepted).
        root: directory with the four ``*-ubyte.gz`` files (default
            ``$FASHION_MNIST_DIR`` or ``/usr/share/datasets/fashion-mnist``).

    Returns:
        ``(images, labels)``: float32 ``(N, 1, 32, 32)`` C-contiguous, normalised with
        mean 0.2860 / std 0.3530; int64 ``(N,)``.
    """
    images, labels = load_fashion_mnist_raw(split, root)
    return preprocess(images), labels
