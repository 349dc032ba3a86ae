"""Calibration data reading, batching and validation."""

from __future__ import annotations

import sys

import numpy as np
import onnx
import pytest
from conftest import conv_bn_relu_model, make_model, vi
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper

from quant_core.errors import ConfigError, DataError, MissingDependencyError
from quant_onnx.data import (
    CalibrationReader,
    ImageOptions,
    InputSpec,
    calibration_batches,
    iter_npz,
    load_calibration_data,
    model_inputs,
)

F32 = np.dtype("float32")
IMG = [InputSpec("x", ("N", 3, 4, 4), F32)]


def samples(n: int, shape=(3, 4, 4), seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, *shape)).astype(np.float32)


def two_input_specs() -> list[InputSpec]:
    return [InputSpec("a", ("N", 2), F32), InputSpec("b", ("N", 3), F32)]


def test_model_inputs_skips_initializers_and_reads_dims():
    model = conv_bn_relu_model()
    model.graph.input.append(vi("w", [8, 3, 3, 3]))
    specs = model_inputs(model)
    assert specs == [InputSpec("x", ("N", 3, 8, 8), F32)]
    assert specs[0].describe_shape() == "[N,3,8,8]"


@given(
    n=st.integers(1, 23),
    batch=st.integers(1, 8),
    limit=st.one_of(st.none(), st.integers(1, 30)),
    chunk=st.integers(1, 9),
)
@settings(max_examples=60, deadline=None)
def test_rebatching_preserves_order_and_counts(n, batch, limit, chunk):
    data = samples(n, (2,))
    chunks = [data[i : i + chunk] for i in range(0, n, chunk)]
    specs = [InputSpec("x", ("N", 2), F32)]
    out = list(calibration_batches(specs, chunks, batch_size=batch, num_samples=limit))
    expected = data[: n if limit is None else min(n, limit)]
    assert all(b["x"].shape[0] == batch for b in out[:-1])
    assert 1 <= out[-1]["x"].shape[0] <= batch
    np.testing.assert_array_equal(np.concatenate([b["x"] for b in out]), expected)


def test_array_dict_and_sample_iterables():
    data = samples(5)
    for source in (data, {"x": data}, list(data), [{"x": s} for s in data], iter([data[:2], data[2:]])):
        out = list(calibration_batches(IMG, source, batch_size=2))
        assert [b["x"].shape[0] for b in out] == [2, 2, 1]
        np.testing.assert_array_equal(np.concatenate([b["x"] for b in out]), data)


def test_multi_input_dicts_and_cast_to_model_dtype():
    specs = two_input_specs()
    items = [{"a": np.ones((3, 2)), "b": np.zeros((3, 3))}, {"a": np.ones(2), "b": np.zeros(3)}]
    out = list(calibration_batches(specs, items, batch_size=4))
    assert [b["a"].shape for b in out] == [(4, 2)]
    assert out[0]["a"].dtype == np.float32 and out[0]["b"].dtype == np.float32


def test_fixed_batch_dim_forces_batch_size_and_drops_remainder():
    specs = [InputSpec("x", (1, 3, 4, 4), F32)]
    reader = CalibrationReader(specs, samples(3), batch_size=8)
    assert reader.batch_size == 1
    assert [b["x"].shape for b in reader] == [(1, 3, 4, 4)] * 3
    specs2 = [InputSpec("x", (2, 3, 4, 4), F32)]
    assert len(list(calibration_batches(specs2, samples(5)))) == 2
    specs4 = [InputSpec("x", (4, 3, 4, 4), F32)]
    with pytest.raises(DataError, match=r"^calibration data: 3 sample\(s\), fewer than the batch of 4 the model fixes"):
        list(calibration_batches(specs4, samples(10), num_samples=3))


def test_reader_from_model_and_iterable_twice():
    reader = CalibrationReader(conv_bn_relu_model(), samples(4, (3, 8, 8)), batch_size=3)
    assert [b["x"].shape[0] for b in reader] == [3, 1]
    assert [b["x"].shape[0] for b in reader] == [3, 1]  # re-iterable over an array source


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"y": samples(2)}, "unknown input 'y' (model inputs: 'x')"),
        (samples(2, (1, 28, 28)), "input 'x' expected shape [N,3,4,4] got [N,1,28,28]"),
        (samples(2, (3, 4)), "input 'x' expected shape [N,3,4,4] got [N,2,3,4]"),  # read as one sample
        (np.ones((2, 3), np.float32), "input 'x' expected shape [N,3,4,4] got [2,3]"),
        (np.zeros((2, 3, 4, 4), np.uint8), "input 'x' expected dtype float32 got uint8"),
        (np.full((2, 3, 4, 4), np.nan, np.float32), "input 'x' contains NaN"),
        (np.full((2, 3, 4, 4), np.inf, np.float32), "input 'x' contains Inf"),
        ([], "no samples for input 'x'"),
        (samples(0), "no samples for input 'x'"),
        (42, "unsupported type int"),
    ],
)
def test_validation_errors_name_the_input(data, message):
    with pytest.raises(DataError) as info:
        list(calibration_batches(IMG, data, batch_size=2))
    assert str(info.value).startswith("calibration data: ") and message in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_input_and_mismatched_counts():
    specs = two_input_specs()
    with pytest.raises(DataError, match="input 'b' is missing"):
        list(calibration_batches(specs, [{"a": np.ones(2)}]))
    with pytest.raises(DataError, match="different sample counts"):
        list(calibration_batches(specs, {"a": np.ones((2, 2)), "b": np.ones((3, 3))}))
    with pytest.raises(DataError, match="single-input model"):
        list(calibration_batches(specs, np.ones((2, 2))))


def test_samples_of_another_size_start_a_batch_of_their_own():
    # Text lines of several widths: one batch holds one size, in the order they come.
    specs = [InputSpec("x", ("N", 3, "H", "W"), F32)]
    items = [samples(1, (3, 4, 4))[0], samples(1, (3, 4, 4))[0], samples(1, (3, 5, 5))[0], samples(1, (3, 4, 4))[0]]
    batches = list(calibration_batches(specs, items, batch_size=4))
    assert [b["x"].shape for b in batches] == [(2, 3, 4, 4), (1, 3, 5, 5), (1, 3, 4, 4)]
    np.testing.assert_array_equal(batches[0]["x"], np.stack(items[:2]))
    np.testing.assert_array_equal(batches[1]["x"][0], items[2])
    np.testing.assert_array_equal(batches[2]["x"][0], items[3])
    # A model that fixes its batch size cannot take a short batch: mixed sizes stay an error.
    fixed = [InputSpec("x", (2, 3, "H", "W"), F32)]
    with pytest.raises(DataError, match="input 'x' samples have different shapes"):
        list(calibration_batches(fixed, items[1:3], batch_size=2))


def test_bad_arguments():
    with pytest.raises(ValueError, match="batch_size"):
        CalibrationReader(IMG, samples(1), batch_size=0)
    with pytest.raises(ValueError, match="num_samples"):
        CalibrationReader(IMG, samples(1), num_samples=0)


def test_npy_is_memory_mapped(tmp_path):
    data = samples(7)
    path = tmp_path / "calib.npy"
    np.save(path, data)
    chunks = list(load_calibration_data(path, IMG))
    assert isinstance(chunks[0]["x"], np.memmap)
    out = list(calibration_batches(IMG, str(path), batch_size=3, num_samples=5))
    assert [b["x"].shape[0] for b in out] == [3, 2]
    assert not isinstance(out[0]["x"], np.memmap)
    np.testing.assert_array_equal(np.concatenate([b["x"] for b in out]), data[:5])


def test_npz_keys_are_input_names_and_read_lazily(tmp_path):
    path = tmp_path / "calib.npz"
    np.savez(path, a=np.ones((4, 2), np.float32), b=np.zeros((4, 3), np.float32), extra=np.ones(1))
    reader = iter_npz(path)  # keep the generator alive: it owns the open archive
    chunk = next(reader)
    assert dict.__getitem__(chunk, "a") is None  # nothing decompressed yet
    assert chunk["a"].shape == (4, 2)
    with pytest.raises(DataError, match="unknown input 'extra'"):
        list(calibration_batches(two_input_specs(), path))
    np.savez(path, a=np.ones((4, 2), np.float32), b=np.zeros((4, 3), np.float32))
    out = list(calibration_batches(two_input_specs(), path, batch_size=3))
    assert [b["b"].shape for b in out] == [(3, 3), (1, 3)]


def test_damaged_npz_files_are_data_errors(tmp_path):
    # numpy says ValueError (an object array) or zipfile.BadZipFile: a bug report unless caught
    objects = tmp_path / "objects.npz"
    np.savez(objects, x=np.array([{"a": 1}] * 2, dtype=object))
    with pytest.raises(DataError, match=r"cannot read 'x' of '.*objects\.npz': Object arrays cannot be loaded"):
        list(calibration_batches(IMG, objects))
    cut = tmp_path / "cut.npz"
    np.savez(cut, x=samples(4))
    cut.write_bytes(cut.read_bytes()[:100])
    with pytest.raises(DataError, match=r"cannot read '.*cut\.npz': File is not a zip file"):
        list(calibration_batches(IMG, cut))


@pytest.mark.parametrize("name", ["empty.npy", "empty.npz"])
def test_an_empty_array_file_is_a_data_error(tmp_path, name):
    empty = tmp_path / name
    empty.write_bytes(b"")  # a failed export, a disk that filled: numpy says EOFError
    with pytest.raises(DataError, match=rf"cannot read '.*{name}': No data left in file"):
        list(calibration_batches(IMG, empty))


def test_empty_evaluation_labels_are_a_data_error(tmp_path, capsys):
    from quant_onnx.cli.main import main

    model = make_model([helper.make_node("Relu", ["x"], ["y"], name="r")], [vi("x", ["N", 2])], [vi("y", ["N", 2])])
    onnx.save(model, tmp_path / "m.onnx")
    np.save(tmp_path / "x.npy", np.ones((8, 2), np.float32))
    (tmp_path / "labels.npy").write_bytes(b"")
    data = str(tmp_path / "x.npy")
    args = ["search", str(tmp_path / "m.onnx"), str(tmp_path / "q.onnx"), "--calib-data", data, "--eval-data", data]
    args += ["--eval-labels", str(tmp_path / "labels.npy"), "--metric", "accuracy", "--target-score", "0.5", "--quiet"]
    assert main(args) == 2  # before: a raw EOFError traceback
    assert "labels: cannot read" in capsys.readouterr().err


def test_unsupported_paths(tmp_path):
    (tmp_path / "data.csv").write_text("1,2")
    with pytest.raises(DataError, match=r"unsupported type '\.csv'"):
        list(calibration_batches(IMG, tmp_path / "data.csv"))
    with pytest.raises(DataError, match="neither a file nor a folder"):
        list(calibration_batches(IMG, tmp_path / "missing.npy"))
    with pytest.raises(DataError, match="no image files"):
        list(calibration_batches(IMG, tmp_path))


def _write_images(folder, count=3, size=(6, 5), mode="RGB"):
    image = pytest.importorskip("PIL.Image")
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    arrays = []
    for i in range(count):
        shape = (size[0], size[1], 3) if mode == "RGB" else size
        pixels = rng.integers(0, 256, shape, dtype=np.uint8)
        image.fromarray(pixels, mode).save(folder / f"img{i}.png")
        arrays.append(pixels)
    return arrays


def test_image_folder_nchw_with_mean_std(tmp_path):
    pixels = _write_images(tmp_path / "imgs", size=(4, 4))
    options = ImageOptions(mean=(0.5, 0.4, 0.3), std=(0.2, 0.2, 0.25))
    out = list(calibration_batches(IMG, tmp_path / "imgs", batch_size=2, image_options=options))
    assert [b["x"].shape for b in out] == [(2, 3, 4, 4), (1, 3, 4, 4)]
    expected = ((pixels[0] / 255.0 - np.array([0.5, 0.4, 0.3])) / np.array([0.2, 0.2, 0.25])).transpose(2, 0, 1)
    np.testing.assert_allclose(out[0]["x"][0], expected, rtol=1e-5, atol=1e-5)


def test_image_folder_resizes_to_model_and_nhwc_grayscale(tmp_path):
    _write_images(tmp_path / "g", size=(9, 7), mode="L")
    specs = [InputSpec("img", ("N", 4, 4, 1), F32)]
    out = list(calibration_batches(specs, tmp_path / "g", batch_size=4, image_options=ImageOptions(layout="nhwc")))
    assert out[0]["img"].shape == (3, 4, 4, 1)
    assert out[0]["img"].min() >= 0.0 and out[0]["img"].max() <= 1.0


def test_image_options_validation():
    with pytest.raises(ConfigError, match="layout"):
        ImageOptions(layout="chw")
    with pytest.raises(ConfigError, match="std"):
        ImageOptions(std=(0.0,))
    with pytest.raises(ConfigError, match="resize"):
        ImageOptions(resize=(0, 3))


@pytest.mark.parametrize(
    ("options", "allowed"),
    [
        ({"mean": ("a",)}, "mean: ('a',) is out of range; allowed: one or more finite numbers"),
        ({"mean": (float("nan"),)}, "mean: (nan,) is out of range; allowed: one or more finite numbers"),
        ({"std": (float("inf"),)}, "std: (inf,) is out of range; allowed: one or more finite non-zero numbers"),
        ({"std": (0.5, "b")}, "std: (0.5, 'b') is out of range"),
        ({"resize": (32.5, 32)}, "resize: (32.5, 32) is out of range; allowed: null or two integers > 0"),
        ({"resize": (32,)}, "resize: (32,) is out of range"),
        ({"resize": (True, 32)}, "resize: (True, 32) is out of range"),
    ],
)
def test_image_options_of_the_wrong_type_fail_at_construction(options, allowed):
    with pytest.raises(ConfigError) as caught:
        ImageOptions(**options)
    assert str(caught.value).startswith(allowed), caught.value


def test_image_options_take_numpy_scalars():
    options = ImageOptions(resize=(np.int64(8), 8), mean=(np.float32(0.5),), std=tuple(np.full(3, 0.25, np.float32)))
    assert options.resize == (8, 8) and len(options.std) == 3


def test_missing_pillow_names_the_extra(tmp_path, monkeypatch):
    (tmp_path / "a.png").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(MissingDependencyError, match=r"quant-onnx\[images\]"):
        list(calibration_batches(IMG, tmp_path))


def test_model_without_inputs_is_an_error():
    model = make_model([helper.make_node("Constant", [], ["y"], value_float=1.0)], [], [vi("y", [])])
    with pytest.raises(DataError, match="no inputs"):
        CalibrationReader(model, [])


def test_one_shot_iterator_cannot_be_read_twice():
    reader = CalibrationReader(IMG, iter(samples(2)), batch_size=2)
    assert len(list(reader)) == 1
    with pytest.raises(DataError, match="already consumed"):
        list(reader)


def test_inputs_calibration_cannot_batch_or_would_wrap_are_refused() -> None:
    scalar = make_model([helper.make_node("Identity", ["s"], ["y"], name="id")], [vi("s", [])], [vi("y", [])])
    with pytest.raises(DataError, match=r"input 's' is a scalar; calibration needs a batch axis"):
        list(calibration_batches(scalar, [{"s": np.float32(1.0)}]))
    int32 = make_model(
        [helper.make_node("Identity", ["i"], ["y"], name="id")], [vi("i", ["N", 2], 6)], [vi("y", ["N", 2], 6)]
    )
    assert next(iter(calibration_batches(int32, [np.array([[1, 2]], np.int64)])))["i"].dtype == np.int32
    with pytest.raises(DataError, match=r"input 'i' has values outside int32"):
        list(calibration_batches(int32, [np.array([[2**40 + 5, 1]], np.int64)]))


def test_sixteen_bit_images_are_scaled_to_their_depth(tmp_path) -> None:
    from PIL import Image

    folder = tmp_path / "images"
    folder.mkdir()
    Image.fromarray(np.full((8, 8), 40000, np.uint16)).save(folder / "a.png")
    for channels in (1, 3):
        model = make_model(
            [helper.make_node("Identity", ["x"], ["y"], name="id")],
            [vi("x", [1, channels, 8, 8])],
            [vi("y", [1, channels, 8, 8])],
        )
        batch = next(iter(calibration_batches(model, str(folder))))
        np.testing.assert_allclose(batch["x"], 40000 / 65535, rtol=1e-6)


def test_a_preset_with_algorithms_reads_an_image_folder_with_options(tmp_path):
    # The folder is read once into feeds; they were handed on with the options, which then
    # refused them as "not an image folder": a8w8 (equalization, bias correction) failed.
    from quant_onnx import quantize

    _write_images(tmp_path / "imgs", count=4, size=(7, 6))
    model = conv_bn_relu_model()
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim[2:]]
    options = ImageOptions(resize=tuple(shape), mean=(0.5,), std=(0.25,))
    assert quantize(model, None, "a8w8", tmp_path / "imgs", quiet=True, image_options=options).model.graph.node


def test_a_16_bit_pgm_is_read_as_16_bit(tmp_path):
    image = pytest.importorskip("PIL.Image")
    folder = tmp_path / "pgm"
    folder.mkdir()
    gray = np.random.default_rng(0).integers(0, 65536, (4, 4)).astype(np.uint16)
    header = b"P5\n4 4\n65535\n"
    (folder / "a.pgm").write_bytes(header + gray.astype(">u2").tobytes())
    assert image.open(folder / "a.pgm").mode == "I"
    specs = [InputSpec("x", ("N", 1, 4, 4), F32)]
    out = list(calibration_batches(specs, folder))
    np.testing.assert_allclose(out[0]["x"][0, 0], gray / 65535.0, atol=1e-6)


def test_an_image_past_pillows_size_limit_is_one_data_error(tmp_path, monkeypatch):
    image = pytest.importorskip("PIL.Image")
    _write_images(tmp_path / "big", count=1, size=(40, 40))
    monkeypatch.setattr(image, "MAX_IMAGE_PIXELS", 100)  # 1600 pixels: over twice the limit
    with pytest.raises(DataError, match="cannot read image"):
        list(calibration_batches(IMG, tmp_path / "big"))


def test_num_samples_reads_nothing_past_the_limit():
    pulled = []

    def source():
        for i in range(5):
            pulled.append(i)
            yield samples(1, seed=i)

    out = list(CalibrationReader(IMG, source(), batch_size=4, num_samples=2))
    assert sum(len(b["x"]) for b in out) == 2 and pulled == [0, 1]


def test_integer_data_into_a_wider_integer_input_and_float_overflow():
    specs = [InputSpec("ids", ("N", 3), np.dtype("int64"))]
    out = list(CalibrationReader(specs, np.array([[1, 2, 3]], np.uint16)))
    assert out[0]["ids"].dtype == np.int64
    half = [InputSpec("x", ("N", 2), np.dtype("float16"))]
    with pytest.raises(DataError, match="outside float16's range"):
        list(CalibrationReader(half, np.array([[70000.0, 1.0]], np.float32)))


def test_an_image_folder_for_an_integer_input_is_refused_naming_it(tmp_path):
    _write_images(tmp_path / "u8", count=1, size=(4, 4))
    specs = [InputSpec("x", ("N", 3, 4, 4), np.dtype("uint8"))]
    with pytest.raises(DataError, match="feeds float inputs; input 'x' is uint8"):
        list(calibration_batches(specs, tmp_path / "u8"))


def test_search_evaluation_samples_of_two_shapes_are_one_data_error():
    from quant_onnx.recipe_search.evaluation import load_evaluation_data

    model = make_model(
        [helper.make_node("Relu", ["x"], ["y"], name="r")], [vi("x", ["N", 3, "H", 4])], [vi("y", ["N", 3, "H", 4])]
    )
    data = [samples(2, (3, 4, 4)), samples(2, (3, 5, 4))]
    with pytest.raises(DataError, match="evaluation data: input 'x' samples have different shapes"):
        load_evaluation_data(model, data)


def test_image_options_serve_only_the_data_that_is_an_image_folder(tmp_path):
    # The search reads two data sets: an array file beside a folder was refused the options.
    from quant_onnx.data import for_image_folder

    _write_images(tmp_path / "imgs", count=1)
    options = ImageOptions(resize=(4, 4))
    assert for_image_folder(tmp_path / "imgs", options) is options
    assert for_image_folder(str(tmp_path / "c.npy"), options) is None and for_image_folder(samples(1), options) is None
