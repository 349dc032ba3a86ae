"""A pretrained OCR recogniser no one here trained: PP-OCRv4's text recogniser (the ONNX
file that ships inside the ``rapidocr_onnxruntime`` wheel on PyPI, Apache-2.0) through
quant-onnx presets, scored by the character error rate against the float model's own text.

The model: a PP-LCNetV3 convolutional backbone (HardSwish written as ``x * Clip(x + 3, 0,
6) / 6``, scalar "learnable affine" Mul/Add after each activation, squeeze-excite), an SVTR
neck with two attention blocks (decomposed LayerNorm, Swish), a CTC head over 6,625 classes
with its Softmax; opset 12, dynamic width. It stands in for the issue's hidden recogniser,
which has this shape. ``--model v3`` takes PP-OCRv3's recogniser instead (from the 1.2.3
wheel): a MobileNetV1-style backbone with HardSwish and BN-folded Convs whose output
channels span ranges thousands of times apart, the same SVTR neck and head.

The data: the rendered text lines of ``tools.bench.synthetic.text_lines`` (the ``calib``
split to calibrate, ``eval`` to score), resized from 32x256 to 48x384 grey, repeated to
three channels and scaled to ``[-1, 1]`` as PaddleOCR does. The float model reads them
(``float`` row: CER against the rendered strings). Every model is read by greedy CTC
decoding with the model's own character table (its ``character`` metadata), and a quantized
model's CER is against the float model's reading.

A recipe is a preset name, optionally with algorithms it runs left out after ``-`` and
algorithms added after ``+`` (``activation_equalization``;
``smoothquant``: alpha
0.5, which also smooths every depthwise Conv's input; ``bias_correction``;
``analytic_bias_correction``; ``cle``: without high-bias absorption; ``gptq``), e.g.
``a8w8+smoothquant+bias_correction`` (an added bias correction replaces a preset's own),
``a8w8-activation_equalization-bias_correction`` (``a8w8`` without its two corrections: the
preset as it was before them).

``--ablate-convs`` quantizes one Conv at a time (every other op float) and prints the
output SQNR and CER each costs alone.

The wheel comes from the package registry (``pip download``), once, into ``.cache``.

Example:
    $ python -m tools.bench.ppocr                               # the default recipes, ~3 min
    $ python -m tools.bench.ppocr --model v3                    # PP-OCRv3's recogniser
    $ python -m tools.bench.ppocr --recipes a8w8 --num-eval 100 --ablate-convs
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a file: make `tools.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench import common, synthetic, tasks

# Recogniser -> (the wheel that ships it, its path inside the wheel).
RECOGNISERS = {
    "v4": ("rapidocr_onnxruntime==1.4.4", "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx"),
    "v3": ("rapidocr_onnxruntime==1.2.3", "rapidocr_onnxruntime/models/ch_PP-OCRv3_rec_infer.onnx"),
}
WORK_DIR = common.CACHE_DIR / "bench" / "ppocr"
HEIGHT, WIDTH = 48, 384


def model_path(version: str = "v4") -> Path:
    """The recogniser's ONNX file, extracted from the wheel (downloaded once)."""
    requirement, in_wheel = RECOGNISERS[version]
    target = WORK_DIR / Path(in_wheel).name
    if target.exists():
        return target
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(WORK_DIR), requirement],
        check=True,
    )
    wheel = WORK_DIR / f"{requirement.replace('==', '-')}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        part = target.with_suffix(".part")
        part.write_bytes(archive.read(in_wheel))
        part.replace(target)
    return target


def text_lines(split: str, count: int) -> tuple[np.ndarray, list[str]]:
    """``count`` rendered lines as the recogniser's input ``(count, 3, 48, 384)`` in ``[-1, 1]``."""
    from PIL import Image

    images, texts = synthetic.text_lines(split, count)
    out = np.empty((count, 3, HEIGHT, WIDTH), np.float32)
    for i, image in enumerate(images):
        resized = np.asarray(Image.fromarray(image).resize((WIDTH, HEIGHT), Image.BILINEAR), np.float32)
        out[i] = (resized / 127.5 - 1.0)[None]
    return out, texts


def run(session_source: str | bytes, x: np.ndarray, batch: int = 32) -> np.ndarray:
    """The recogniser's output ``(lines, positions, classes)`` over ``x`` in onnxruntime's default session."""
    session = common.make_session(session_source)
    return np.concatenate([session.run(None, {"x": x[i : i + batch]})[0] for i in range(0, len(x), batch)])


def characters(model: Any) -> list[str]:
    """Class ``i + 1`` -> character (class 0 is the blank): the model's ``character``
    metadata, then the space (``tasks.greedy_ctc_decode``'s charset)."""
    meta = {p.key: p.value for p in model.metadata_props}
    return [*meta["character"].split("\n"), " "]


def quantized_reading(
    path: Path, config: Any, out_path: Path, calib: np.ndarray, evaluation: np.ndarray, charset: list[str]
) -> tuple[np.ndarray, list[str], float]:
    """Quantize the recogniser with ``config`` into ``out_path``; its output over
    ``evaluation``, its reading, and the seconds quantization took."""
    import quant_onnx

    start = time.perf_counter()
    quant_onnx.quantize(str(path), str(out_path), config, calib, quiet=True)
    seconds = time.perf_counter() - start
    out = run(str(out_path), evaluation)
    return out, tasks.greedy_ctc_decode(out, charset), seconds


RECIPES = (
    "a8w8",
    "a8w8-bias_correction",  # the preset before its bias correction
    "a8w8-activation_equalization-bias_correction",  # ... and before its activation equalization
    "a8w8_percentile",
    "a16w8",
    "xint8",
)


def recipe(name: str) -> Any:
    """The config of a recipe name (see the module docstring)."""
    from quant_core import get_preset
    from quant_core.algorithm_config import (
        ActivationEqualizationConfig,
        BiasCorrectionConfig,
        CLEConfig,
        GPTQConfig,
        SmoothQuantConfig,
    )

    head, *extra = name.split("+")
    preset, *dropped = head.split("-")
    known = {
        "activation_equalization": ActivationEqualizationConfig(),
        "smoothquant": SmoothQuantConfig(alpha=0.5),
        "bias_correction": BiasCorrectionConfig(),
        "analytic_bias_correction": BiasCorrectionConfig(method="analytic"),
        "cle": CLEConfig(absorb_high_bias=False),
        "gptq": GPTQConfig(),
    }
    unknown = [e for e in extra if e not in known]
    if unknown:
        raise SystemExit(f"recipe {name!r}: unknown algorithm {unknown[0]!r}; allowed: {', '.join(known)}")
    unknown = [d for d in dropped if d not in known]
    if unknown:
        raise SystemExit(f"recipe {name!r}: unknown algorithm {unknown[0]!r}; allowed: {', '.join(known)}")
    config = get_preset(preset)
    config = config.evolve(algorithms=tuple(a for a in config.algorithms if a.kind not in dropped))
    added = [known[e] for e in extra]
    # An algorithm the preset already runs (a16w8's bias correction) is replaced, not run twice.
    kept = [a for a in config.algorithms if type(a).kind not in {type(b).kind for b in added}]
    return config.evolve(algorithms=(*kept, *added)) if extra else config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(RECOGNISERS), default="v4", help="PP-OCR recogniser version")
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), help="preset[+algorithm...]")
    parser.add_argument("--num-calib", type=int, default=128)
    parser.add_argument("--num-eval", type=int, default=300)
    parser.add_argument("--ablate-convs", action="store_true", help="each Conv quantized alone (a8w8)")
    args = parser.parse_args(argv)

    import onnx

    from quant_core import get_preset
    from quant_core.qparams import sqnr_db

    path = model_path(args.model)
    model = onnx.load(str(path))
    charset = characters(model)
    calib, _ = text_lines("calib", args.num_calib)
    evaluation, texts = text_lines("eval", args.num_eval)
    float_out = run(str(path), evaluation)
    reference = tasks.greedy_ctc_decode(float_out, charset)
    print(
        f"float: CER against the rendered text {tasks.character_error_rate(reference, texts):.4f} ({args.num_eval} lines)"
    )
    print("| recipe | CER against the float reading | lines read as float | output SQNR dB | quantize s |")
    print("|---|---|---|---|---|")
    for name in args.recipes:
        config = recipe(name)
        out, reading, seconds = quantized_reading(path, config, WORK_DIR / "recipe.onnx", calib, evaluation, charset)
        same = np.mean([a == b for a, b in zip(reading, reference, strict=True)])
        cer = tasks.character_error_rate(reading, reference)
        print(f"| {name} | {cer:.4f} | {same:.3f} | {sqnr_db(float_out, out):.1f} | {seconds:.1f} |")
    if args.ablate_convs:
        # Every op type the planner could quantize but Conv (BatchNormalization is folded
        # away, and an exclude entry matching no node is refused).
        ops = sorted(
            {n.op_type for n in model.graph.node} - {"Conv", "Constant", "BatchNormalization", "Cast", "Shape"}
        )
        convs = [n.name for n in model.graph.node if n.op_type == "Conv"]
        print(
            "\n| Conv quantized alone (a8w8, every other op float) | output SQNR dB | CER against the float reading |"
        )
        print("|---|---|---|")
        rows = []
        for conv in convs:
            config = get_preset("a8w8").evolve(exclude=(*ops, *(c for c in convs if c != conv)))
            out, reading, _ = quantized_reading(path, config, WORK_DIR / "one_conv.onnx", calib, evaluation, charset)
            rows.append((sqnr_db(float_out, out), tasks.character_error_rate(reading, reference), conv))
        for db, cer, conv in sorted(rows):
            print(f"| {conv} | {db:.1f} | {cer:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
