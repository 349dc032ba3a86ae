"""Natural-photo crops for calibrating and scoring 224x224 ImageNet models without ImageNet.

Sources are the natural colour photos bundled with scikit-image (``skimage.data``) and
scikit-learn (``load_sample_images``). They are split **by source photo**: the calibration
crops and the evaluation crops never come from the same picture, so a quantizer is scored
on photos it has not seen. (Both stereo motorcycle views are one source.)

Each crop is a seeded random square window at one of several scales of the photo's short
side, randomly mirrored, resized to 224x224 with Pillow (bicubic), and normalised as
``(x - 127) / 128`` into float32 NCHW, the preprocessing EfficientNet-Lite expects.
Results are cached as ``.npy`` under ``.cache/photo_crops/``.

Example:
    >>> from tools.photo_crops import load_photo_crops, normalise
    >>> load_photo_crops("calibration", num=4).shape  # doctest: +SKIP
    (4, 3, 224, 224)
    >>> normalise(np.full((1, 2, 2, 3), 255, np.uint8)).max()
    np.float32(1.0)

    $ python tools/photo_crops.py            # build and cache both splits
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: make `tools.*` importable
    sys.path.insert(0, str(REPO_ROOT))

from tools.bench.common import atomic_path  # noqa: E402

DEFAULT_CACHE = REPO_ROOT / ".cache" / "photo_crops"
IMAGE_SIZE = 224
MEAN = 127.0
STD = 128.0
# Crop side as a fraction of the photo's short side: whole-photo views down to close-ups.
SCALES = (1.0, 0.75, 0.55, 0.4, 0.3)
SPLITS = ("calibration", "evaluation")
DEFAULT_COUNTS = {"calibration": 512, "evaluation": 520}
SEEDS = {"calibration": 1234, "evaluation": 5678}
# Bump when the crop recipe changes so stale caches are not reused.
RECIPE_VERSION = 1


def _skimage(name: str) -> Callable[[], list[np.ndarray]]:
    def load() -> list[np.ndarray]:
        import skimage.data

        image = getattr(skimage.data, name)()
        return list(image) if isinstance(image, tuple) else [image]

    return load


def _stereo_motorcycle() -> list[np.ndarray]:
    import skimage.data

    left, right, _disparity = skimage.data.stereo_motorcycle()
    return [left, right]


def _sklearn(filename: str) -> Callable[[], list[np.ndarray]]:
    def load() -> list[np.ndarray]:
        from sklearn.datasets import load_sample_images

        images = load_sample_images()
        for path, image in zip(images.filenames, images.images, strict=True):
            if os.path.basename(path) == filename:
                return [image]
        raise ValueError(f"sklearn sample image {filename!r} not found")

    return load


# source name -> loader of its RGB uint8 (H, W, 3) views. skimage's "cat" is "chelsea" again.
SOURCES: dict[str, Callable[[], list[np.ndarray]]] = {
    "chelsea": _skimage("chelsea"),
    "rocket": _skimage("rocket"),
    "china": _sklearn("china.jpg"),
    "hubble_deep_field": _skimage("hubble_deep_field"),
    "immunohistochemistry": _skimage("immunohistochemistry"),
    "astronaut": _skimage("astronaut"),
    "coffee": _skimage("coffee"),
    "motorcycle": _stereo_motorcycle,
    "flower": _sklearn("flower.jpg"),
    "retina": _skimage("retina"),
}
# Disjoint by construction; each side mixes everyday objects, a scene and a scientific image.
SPLIT_SOURCES: dict[str, tuple[str, ...]] = {
    "calibration": ("chelsea", "rocket", "china", "hubble_deep_field", "immunohistochemistry"),
    "evaluation": ("astronaut", "coffee", "motorcycle", "flower", "retina"),
}


def normalise(images_u8: np.ndarray) -> np.ndarray:
    """uint8 NHWC RGB -> float32 NCHW ``(x - 127) / 128``."""
    if images_u8.ndim != 4 or images_u8.shape[-1] != 3:
        raise ValueError(f"images: expected (N, H, W, 3) RGB, got shape {images_u8.shape}")
    x = images_u8.astype(np.float32).transpose(0, 3, 1, 2)
    return np.ascontiguousarray((x - np.float32(MEAN)) / np.float32(STD))


def random_crops(
    views: Sequence[np.ndarray],
    count: int,
    rng: np.random.Generator,
    size: int = IMAGE_SIZE,
    scales: Sequence[float] = SCALES,
) -> np.ndarray:
    """``count`` square crops of ``views`` (RGB uint8 HWC) resized to ``size``: uint8 (count, size, size, 3)."""
    from PIL import Image

    out = np.empty((count, size, size, 3), dtype=np.uint8)
    for i in range(count):
        view = views[int(rng.integers(len(views)))]
        height, width = view.shape[:2]
        side = max(8, round(float(rng.choice(scales)) * min(height, width)))
        top = int(rng.integers(0, height - side + 1))
        left = int(rng.integers(0, width - side + 1))
        crop = Image.fromarray(np.ascontiguousarray(view[top : top + side, left : left + side, :3]))
        if rng.random() < 0.5:
            crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        out[i] = np.asarray(crop.resize((size, size), Image.Resampling.BICUBIC))
    return out


def build_crops(split: str, num: int | None = None, seed: int | None = None) -> np.ndarray:
    """Build ``num`` normalised crops of ``split``'s photos, spread evenly over its sources."""
    if split not in SPLIT_SOURCES:
        raise ValueError(f"split: {split!r} is not known; allowed: {', '.join(SPLITS)}")
    num = DEFAULT_COUNTS[split] if num is None else num
    if num <= 0:
        raise ValueError(f"num: {num} is out of range; allowed: an integer > 0")
    rng = np.random.default_rng(SEEDS[split] if seed is None else seed)
    sources = SPLIT_SOURCES[split]
    per_source = [num // len(sources) + (1 if k < num % len(sources) else 0) for k in range(len(sources))]
    parts = [random_crops(SOURCES[name](), n, rng) for name, n in zip(sources, per_source, strict=True) if n]
    images = np.concatenate(parts)
    # Interleave sources so any prefix (num=...) still covers every photo.
    order = np.argsort(
        np.concatenate([np.arange(n) * len(sources) + k for k, n in enumerate(per_source)]), kind="stable"
    )
    return normalise(images[order])


def cache_path(split: str, num: int, cache_dir: Path = DEFAULT_CACHE) -> Path:
    return Path(cache_dir) / f"{split}_{num}_v{RECIPE_VERSION}.npy"


def load_photo_crops(split: str, num: int | None = None, cache_dir: Path = DEFAULT_CACHE) -> np.ndarray:
    """Cached normalised crops of ``split`` (``"calibration"`` or ``"evaluation"``), float32 (N, 3, 224, 224).

    A smaller ``num`` is served from the default-size cache when present (same crops, same order).
    """
    if split not in SPLIT_SOURCES:
        raise ValueError(f"split: {split!r} is not known; allowed: {', '.join(SPLITS)}")
    full = DEFAULT_COUNTS[split]
    num = full if num is None else num
    for candidate in (cache_path(split, num, cache_dir), cache_path(split, full, cache_dir)):
        if candidate.exists():
            data = np.load(candidate, mmap_mode="r")
            if len(data) >= num:
                return np.ascontiguousarray(data[:num])
    data = build_crops(split, max(num, full))
    save_array(cache_path(split, len(data), cache_dir), data)
    return np.ascontiguousarray(data[:num])


def save_array(path: Path, array: np.ndarray) -> None:
    """Write ``array`` to ``path`` as .npy atomically."""
    with atomic_path(path, ".npy") as tmp, open(tmp, "wb") as f:
        np.save(f, array)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build and cache the natural-photo crop sets.")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    args = parser.parse_args(argv)
    for split in SPLITS:
        x = load_photo_crops(split, cache_dir=args.cache_dir)
        print(f"{split}: {x.shape} from {', '.join(SPLIT_SOURCES[split])} -> {args.cache_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
