"""Seeded generators of the synthetic task data (numpy + Pillow): nothing is stored, everything regenerates.

* :func:`text_lines` -- 32x256 grey text lines (1-4 words, DejaVu fonts, offsets, blur, noise)
  and their strings, for the CTC recogniser ``ocr_ctc``.
* :func:`detection_scenes` -- 96x96 grey scenes with 1-4 Fashion-MNIST items pasted at random
  positions and scales on a noisy background, with xyxy boxes and classes, for ``fmnist_yolo``.
* :func:`text_scenes` -- 128x128 colour scenes with words and clutter on a noisy background, with
  the text-region mask (each word's box), for ``text_seg``.

Sample ``i`` of a split is drawn from its own generator seeded with ``(task, split, i)``, so the
first 512 samples of a split are the same whatever count is asked for. Splits: ``train`` (what the
model was trained on), ``calib`` (calibration for quantization) and ``eval`` (held out); detection
scenes take their items from the Fashion-MNIST training images for ``train``/``calib`` and from the
test images for ``eval``.

Example:
    >>> images, texts = text_lines("eval", 2)
    >>> images.shape, images.dtype, len(texts)
    ((2, 32, 256), dtype('uint8'), 2)
    >>> text_lines("eval", 1)[1] == texts[:1]
    True
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np

SPLITS = {"train": 0, "calib": 1, "eval": 2}
_TASK_SEEDS = {"text_lines": 101, "detection": 102, "text_scenes": 103}

FONT_DIR = Path(os.environ.get("DEJAVU_FONT_DIR", "/usr/share/fonts/truetype/dejavu"))
FONTS = (
    "DejaVuSans.ttf",
    "DejaVuSans-Bold.ttf",
    "DejaVuSans-Oblique.ttf",
    "DejaVuSansCondensed.ttf",
    "DejaVuSansMono.ttf",
    "DejaVuSerif.ttf",
    "DejaVuSerif-Bold.ttf",
    "DejaVuSerifCondensed-Italic.ttf",
)

# The recogniser's characters; CTC class i + 1 is CHARSET[i], class 0 the blank.
CHARSET = " 0123456789abcdefghijklmnopqrstuvwxyz"
# Common English words, written out so that the vocabulary never depends on a download.
WORDS = tuple(
    """
    a about above across act add after again against age ago air all almost alone along already also always
    am among an and animal another answer any are area arm around art as ask at away back bad ball bank base
    be bear beat became because become bed been before began begin behind being below best better between big
    bird black blue board boat body book both box boy bring brother brown build built busy but buy by call
    came can car care carry case cat catch cause center certain change check child children city class clean
    clear close cold color come common could country course cover cross cut dark day deep did different do
    does dog done door down draw dream drive dry during each early earth east easy eat edge egg end enough
    even evening ever every example eye face fact fall family far farm fast father feel feet few field fight
    figure fill final find fine fire first fish five floor fly follow food foot for force form found four
    free friend from front full game garden gave get girl give glass go gold good got great green ground
    group grow had half hand happy hard has have he head hear heard heart heat heavy help her here high hill
    him his hold home horse hot hour house how hundred idea if in inch iron is island it its job join jump
    just keep kept kind king knew know lady land large last late laugh law lay lead learn leave left leg less
    let letter life light like line list little live long look lost lot love low machine made main make man
    many map mark may me mean measure men might mile milk mind minute miss money month moon more morning most
    mother mountain move much music must my name near need never new next night nine no north not note
    nothing now number object of off often oil old on once one only open or order other our out over own page
    paper part party pass past pay people picture piece place plan plant play point poor power press pretty
    pull put question quick quiet rain ran reach read ready real red rest rich ride right river road rock
    room round rule run said same sat save saw say school sea second see seem sell send sent seven shape she
    ship shop short should show side sign simple since sing sister sit six size sky sleep slow small snow so
    soft some song soon sound south space speak special spring stand star start state stay step still stone
    stood stop story street strong study such summer sun sure table tail take talk tall teach tell ten test
    than that the their them then there these they thing think third this those three through time to today
    together told too took top toward town tree true try turn two under until up upon us use very voice wait
    walk wall want warm was watch water wave way we week well went were west what wheel when where which
    while white who whole why wide wild will wind window winter wish with without woman wood word work world
    would write year yes yet you young your zero
    """.split()  # noqa: SIM905  (a 400-word list literal reads worse)
)
NUMBER_RATE = 0.15  # share of line words that are numbers (1-4 digits) instead of English words

LINE_HEIGHT, LINE_WIDTH = 32, 256
DETECTION_SIZE = 96
SCENE_SIZE = 128


def sample_rng(task: str, split: str, index: int) -> np.random.Generator:
    """The generator of sample ``index`` of ``split`` (one per sample: any prefix is reproducible)."""
    if split not in SPLITS:
        raise ValueError(f"split: {split!r} is not known; allowed: {', '.join(SPLITS)}")
    return np.random.default_rng([_TASK_SEEDS[task], SPLITS[split], index])


@functools.lru_cache(maxsize=256)
def _font(name: str, size: int):  # -> ImageFont.FreeTypeFont
    from PIL import ImageFont

    return ImageFont.truetype(str(FONT_DIR / name), size)


def random_words(rng: np.random.Generator, count: int) -> list[str]:
    """``count`` vocabulary words; about 15% are numbers of 1-4 digits."""
    words = []
    for _ in range(count):
        if rng.random() < NUMBER_RATE:
            words.append(str(rng.integers(0, 10 ** int(rng.integers(1, 5)))))
        else:
            words.append(WORDS[int(rng.integers(len(WORDS)))])
    return words


def _finish(image, rng: np.random.Generator, max_blur: float, max_noise: float) -> np.ndarray:
    """Blur (Pillow Gaussian) and additive Gaussian noise; uint8 array out."""
    from PIL import ImageFilter

    radius = float(rng.uniform(0.0, max_blur))
    if radius > 0.2:
        image = image.filter(ImageFilter.GaussianBlur(radius))
    array = np.asarray(image, dtype=np.float32)
    array = array + rng.normal(0.0, float(rng.uniform(0.0, max_noise)), array.shape)
    return np.clip(np.rint(array), 0, 255).astype(np.uint8)


# ------------------------------------------------------------------------------ text lines
def text_line(rng: np.random.Generator) -> tuple[np.ndarray, str]:
    """One grey 32x256 line (dark text on a lighter background) and its text."""
    from PIL import Image, ImageDraw

    words = random_words(rng, int(rng.integers(1, 5)))
    font_name = FONTS[int(rng.integers(len(FONTS)))]
    size = int(rng.integers(15, 23))
    text = " ".join(words)
    while True:  # shrink the font, then drop words, until the line fits
        left, top, right, bottom = _font(font_name, size).getbbox(text)
        if right - left <= LINE_WIDTH - 6 and bottom - top <= LINE_HEIGHT - 4:
            break
        if size > 13:
            size -= 1
        else:
            words = words[:-1]
            text = " ".join(words)
    font = _font(font_name, size)
    background = int(rng.integers(120, 256))
    ink = int(rng.integers(0, background - 70))
    image = Image.new("L", (LINE_WIDTH, LINE_HEIGHT), background)
    free_x = LINE_WIDTH - (right - left)
    x = int(rng.integers(0, min(free_x, 24) + 1)) - left
    free_y = LINE_HEIGHT - (bottom - top)
    y = int(np.clip(free_y // 2 + rng.integers(-3, 4), 0, free_y)) - top
    ImageDraw.Draw(image).text((x, y), text, fill=ink, font=font)
    return _finish(image, rng, max_blur=1.0, max_noise=10.0), text


def text_lines(split: str, count: int, start: int = 0) -> tuple[np.ndarray, list[str]]:
    """Lines ``start .. start + count`` of ``split``: uint8 ``(count, 32, 256)`` and their strings."""
    images = np.empty((count, LINE_HEIGHT, LINE_WIDTH), np.uint8)
    texts = []
    for i in range(count):
        images[i], text = text_line(sample_rng("text_lines", split, start + i))
        texts.append(text)
    return images, texts


def encode_text(text: str) -> list[int]:
    """CTC targets of ``text`` (class 0 is the blank).

    Example:
        >>> encode_text("a 1")
        [12, 1, 3]
    """
    try:
        return [CHARSET.index(c) + 1 for c in text]
    except ValueError:
        raise ValueError(f"text: {text!r} has a character outside {CHARSET!r}") from None


# ------------------------------------------------------------------------ detection scenes
def _smooth_field(rng: np.random.Generator, size: int, channels: int = 0) -> np.ndarray:
    """A float32 low-frequency field in 0..255 (6x6 random values, bicubic-upsampled): uneven light."""
    from PIL import Image

    coarse = rng.uniform(0, 255, (6, 6, channels) if channels else (6, 6)).astype(np.uint8)
    return np.asarray(Image.fromarray(coarse).resize((size, size), Image.BICUBIC), np.float32)


def _box_iou(box: np.ndarray, boxes: list[np.ndarray]) -> float:
    if not boxes:
        return 0.0
    other = np.stack(boxes)
    wh = np.clip(np.minimum(box[2:], other[:, 2:]) - np.maximum(box[:2], other[:, :2]), 0, None)
    inter = wh[:, 0] * wh[:, 1]
    area = (box[2] - box[0]) * (box[3] - box[1])
    areas = (other[:, 2] - other[:, 0]) * (other[:, 3] - other[:, 1])
    return float(np.max(inter / (area + areas - inter)))


@functools.lru_cache(maxsize=2)
def _fashion_items(source: str) -> tuple[np.ndarray, np.ndarray]:
    from tools.reference_models.data import load_fashion_mnist_raw

    return load_fashion_mnist_raw(source)


def detection_scene(rng: np.random.Generator, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One grey 96x96 scene, its boxes ``(n, 4)`` float32 pixel xyxy (x2/y2 exclusive), classes ``(n,)``."""
    from PIL import Image

    items, labels = _fashion_items("test" if split == "eval" else "train")
    smooth = _smooth_field(rng, DETECTION_SIZE)
    noise = rng.normal(0.0, float(rng.uniform(3, 20)), smooth.shape)
    scene = float(rng.uniform(0, 50)) + smooth * float(rng.uniform(0, 0.25)) + noise
    boxes: list[np.ndarray] = []
    classes: list[int] = []
    for _ in range(int(rng.integers(1, 5))):
        pick = int(rng.integers(len(items)))
        side = int(rng.integers(24, 45))
        item = np.asarray(Image.fromarray(items[pick]).resize((side, side), Image.BILINEAR), np.float32)
        rows, cols = np.nonzero(item > 40)
        if rows.size == 0:
            continue
        for _attempt in range(20):  # a place that overlaps the others by IoU 0.2 at most
            x0, y0 = (int(v) for v in rng.integers(0, DETECTION_SIZE - side + 1, 2))
            box = np.array([x0 + cols.min(), y0 + rows.min(), x0 + cols.max() + 1, y0 + rows.max() + 1], np.float32)
            if _box_iou(box, boxes) <= 0.2:
                break
        else:
            continue
        region = scene[y0 : y0 + side, x0 : x0 + side]
        np.maximum(region, item * float(rng.uniform(0.6, 1.0)), out=region)
        boxes.append(box)
        classes.append(int(labels[pick]))
    image = np.clip(np.rint(scene), 0, 255).astype(np.uint8)
    return image, np.array(boxes, np.float32).reshape(-1, 4), np.array(classes, np.int64)


def detection_scenes(split: str, count: int, start: int = 0) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """Scenes ``start .. start + count``: uint8 ``(count, 96, 96)``, per-scene boxes and classes."""
    images = np.empty((count, DETECTION_SIZE, DETECTION_SIZE), np.uint8)
    boxes, classes = [], []
    for i in range(count):
        images[i], b, c = detection_scene(sample_rng("detection", split, start + i), split)
        boxes.append(b)
        classes.append(c)
    return images, boxes, classes


# ----------------------------------------------------------------------------- text scenes
def text_scene(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One RGB 128x128 scene (HWC uint8) with 1-5 words and clutter, and its text-region mask (uint8 0/1)."""
    from PIL import Image, ImageDraw

    background = rng.uniform(0, 255, 3) * 0.6 + _smooth_field(rng, SCENE_SIZE, 3) * 0.4
    light = float(background.mean()) > 128  # dark text on light scenes and the other way round
    image = Image.fromarray(np.clip(background, 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(0, 4))):  # clutter: lines and boxes that are not text
        xy = sorted(rng.integers(0, SCENE_SIZE, 2)), sorted(rng.integers(0, SCENE_SIZE, 2))
        colour = tuple(int(v) for v in rng.integers(0, 256, 3))
        if rng.random() < 0.5:
            draw.line([(xy[0][0], xy[1][0]), (xy[0][1], xy[1][1])], fill=colour, width=int(rng.integers(1, 4)))
        else:
            draw.rectangle([xy[0][0], xy[1][0], xy[0][1], xy[1][1]], outline=colour, width=int(rng.integers(1, 3)))
    mask = np.zeros((SCENE_SIZE, SCENE_SIZE), np.uint8)
    placed: list[np.ndarray] = []
    for _ in range(int(rng.integers(1, 6))):
        text = " ".join(random_words(rng, int(rng.integers(1, 3))))
        font = _font(FONTS[int(rng.integers(len(FONTS)))], int(rng.integers(11, 25)))
        left, top, right, bottom = font.getbbox(text)
        if right - left >= SCENE_SIZE - 4:
            continue
        for _attempt in range(20):  # words do not touch (2 px apart)
            x = int(rng.integers(2, SCENE_SIZE - (right - left) - 1))
            y = int(rng.integers(2, SCENE_SIZE - (bottom - top) - 1))
            box = np.array([x - 2, y - 2, x + right - left + 2, y + bottom - top + 2], np.float32)
            if _box_iou(box, placed) == 0.0:
                break
        else:
            continue
        ink = rng.integers(0, 90, 3) if light else rng.integers(170, 256, 3)
        draw.text((x - left, y - top), text, fill=tuple(int(v) for v in ink), font=font)
        mask[y : y + bottom - top, x : x + right - left] = 1
        placed.append(box)
    return _finish(image, rng, max_blur=0.8, max_noise=8.0), mask


def text_scenes(split: str, count: int, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Scenes ``start .. start + count``: uint8 ``(count, 128, 128, 3)`` images, uint8 ``(count, 128, 128)`` masks."""
    images = np.empty((count, SCENE_SIZE, SCENE_SIZE, 3), np.uint8)
    masks = np.empty((count, SCENE_SIZE, SCENE_SIZE), np.uint8)
    for i in range(count):
        images[i], masks[i] = text_scene(sample_rng("text_scenes", split, start + i))
    return images, masks
