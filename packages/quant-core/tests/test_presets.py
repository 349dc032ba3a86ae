from __future__ import annotations

from pathlib import Path

import pytest

from quant_core.algorithm_config import AdaRoundConfig, CLEConfig
from quant_core.config import QuantConfig
from quant_core.dtypes import DType
from quant_core.observer_config import MinMax, Percentile, PowerOfTwoMSE
from quant_core.presets import PRESETS, get_preset, list_presets
from quant_core.presets_doc import TABLE_BEGIN, TABLE_END, main, presets_table, render_doc
from quant_core.spec import OUTPUT_CHANNELS, RoundMode, ScaleType

DOC = Path(__file__).resolve().parents[3] / "docs" / "presets.md"
REQUIRED = {"xint8", "a8w8", "a16w8", "int8_cnn_accurate", "int8_cnn_cle"}


@pytest.mark.parametrize("name", list_presets())
def test_each_preset_builds_a_fresh_named_config(name: str) -> None:
    cfg = get_preset(name)
    assert isinstance(cfg, QuantConfig) and cfg.name == name
    assert get_preset(name) == cfg and get_preset(name) is not cfg
    op = cfg.global_config
    assert op.input is not None and op.weight is not None and op.output is not None
    if name == "xint8_int8_bias":  # the NPU profile's device format: int8 at its own position
        assert op.bias is not None and op.bias.dtype.value == "int8" and op.bias.scale_type.value == "power_of_two"
    else:
        assert op.bias is None  # int32 at input_scale * weight_scale
    assert op.weight.symmetric and op.weight.dtype.signed
    assert PRESETS[name].description


def test_required_presets_exist() -> None:
    assert set(list_presets()) >= REQUIRED


def test_xint8_is_the_npu_default() -> None:
    op = get_preset("xint8").global_config
    for spec in (op.input, op.weight, op.output):
        assert spec is not None
        assert spec.dtype is DType.INT8 and spec.symmetric and spec.per_channel_axis is None
        assert spec.scale_type is ScaleType.POWER_OF_TWO and spec.rounding is RoundMode.HALF_EVEN
    assert op.input is not None and op.input.observer == PowerOfTwoMSE()
    assert op.weight is not None and op.weight.observer == MinMax()


def test_xint8_u8_has_the_same_numbers_as_xint8() -> None:
    from quant_core.qparams import dequantize, qparams_from_range

    a = get_preset("xint8").global_config.input
    b = get_preset("xint8_u8").global_config.input
    assert a is not None and b is not None and b.dtype is DType.UINT8 and b.symmetric
    qa, qb = qparams_from_range(-3.0, 5.0, a), qparams_from_range(-3.0, 5.0, b)
    assert float(qa.scale) == float(qb.scale) and int(qb.zero_point) == 128
    assert dequantize([qa.qmin, qa.qmax], qa).tolist() == dequantize([qb.qmin, qb.qmax], qb).tolist()


def test_a8w8_family() -> None:
    op = get_preset("a8w8").global_config
    assert op.input is not None and op.weight is not None
    assert op.input.dtype is DType.UINT8 and not op.input.symmetric and op.input.scale_type is ScaleType.FLOAT
    assert op.weight.dtype is DType.INT8 and op.weight.per_channel_axis == OUTPUT_CHANNELS
    assert get_preset("a8w8_per_tensor").global_config.weight.per_channel_axis is None  # type: ignore[union-attr]
    assert get_preset("a16w8").global_config.input.dtype is DType.UINT16  # type: ignore[union-attr]
    assert get_preset("w4a8").global_config.weight.dtype is DType.INT4  # type: ignore[union-attr]


def test_algorithm_presets() -> None:
    accurate = get_preset("int8_cnn_accurate")
    assert accurate.algorithms == (AdaRoundConfig(),)
    assert accurate.global_config.input.observer == Percentile(99.999)  # type: ignore[union-attr]
    assert accurate.global_config.weight == get_preset("a8w8").global_config.weight
    cle = get_preset("int8_cnn_cle")
    assert cle.algorithms == (CLEConfig(),)
    assert cle.global_config == get_preset("xint8").global_config


def test_xint8_adaround_keeps_xint8_formats_and_tunes_only_calibration_and_algorithms() -> None:
    tuned, base = get_preset("xint8_adaround"), get_preset("xint8")
    op, ref = tuned.global_config, base.global_config
    assert (op.input, op.output, op.bias) == (ref.input, ref.output, ref.bias)
    assert op.weight is not None and ref.weight is not None
    # same format (a clipped weight saturates at -127 as on the NPU); MinMSE positions
    assert op.weight.evolve(observer=MinMax()) == ref.weight and ref.weight.qrange == (-127, 127)
    assert op.weight.observer == PowerOfTwoMSE()
    assert tuned.algorithms == (CLEConfig(), AdaRoundConfig(learning_rate=0.1, batch_size=4))


@pytest.mark.parametrize("bad", ["int7", "", "XINT8", None])
def test_unknown_preset_lists_allowed_names(bad: object) -> None:
    with pytest.raises(
        ValueError, match=r"^preset: .* is not a known preset; allowed: xint8, xint8_u8, xint8_int8_bias, a8w8"
    ):
        get_preset(bad)  # type: ignore[arg-type]


def test_table_has_a_row_per_preset() -> None:
    rows = presets_table().splitlines()[2:]
    assert [row.split(" | ")[0] for row in rows] == [f"| `{name}`" for name in list_presets()]
    assert all(row.count(" | ") == 6 for row in rows)


def test_docs_table_is_up_to_date() -> None:
    if not DOC.exists():
        pytest.skip("docs/presets.md is outside this checkout (installed package)")
    text = DOC.read_text(encoding="utf-8")
    assert render_doc(text) == text, "docs/presets.md is stale: run `python -m quant_core.presets_doc docs/presets.md`"


def test_render_doc_needs_markers() -> None:
    with pytest.raises(ValueError, match="markers not found"):
        render_doc("# no table here\n")


def test_main_rewrites_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.md"
    path.write_text(f"intro\n{TABLE_BEGIN}\nstale\n{TABLE_END}\noutro\n", encoding="utf-8")
    assert main([str(path)]) == 0
    assert path.read_text(encoding="utf-8") == f"intro\n{TABLE_BEGIN}\n{presets_table()}{TABLE_END}\noutro\n"
    assert main([]) == 0
    assert capsys.readouterr().out == presets_table()
