"""Bad input gets a one-line error naming the problem; partial quantization leaves the
rest float."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from models import conv_bn_net, images
from torch import nn

from quant_core.errors import ConfigError
from quant_torch_fx import CaptureError, DataError, ModelQuantizer
from quant_torch_fx.prepare import graph_info, quantized_graphs


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent control flow: torch.export cannot capture it
            return self.fc(x)
        return -self.fc(x)


class Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x)).mean((2, 3))


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = Backbone()
        self.head = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def test_uncapturable_model_names_the_construct_the_module_and_the_way_out() -> None:
    q = ModelQuantizer("a8w8", quiet=True)
    with pytest.raises(CaptureError) as info:
        q.quantize_model(Gated().eval(), torch.randn(1, 3, 8, 8), images(1))
    message = str(info.value)
    assert "\n" not in message
    assert "submodule 'head' (Gate)" in message
    assert "if x.sum() > 0" in message and "test_errors_partial.py" in message
    assert "regions=['backbone']" in message


def test_regions_quantize_only_the_named_submodules() -> None:
    model = Gated().eval()
    q = ModelQuantizer("a8w8", regions=["backbone"], quiet=True)
    qmodel = q.quantize_model(model, torch.randn(1, 3, 8, 8), images(2))
    assert isinstance(qmodel, Gated) and isinstance(qmodel.head, Gate)  # the head stays eager float
    assert len(quantized_graphs(qmodel)) == 1
    x = images(1, seed=3)[0]
    with torch.no_grad():
        torch.testing.assert_close(qmodel(x), model(x), rtol=0.1, atol=0.05)
        frozen = q.freeze(qmodel)
        assert frozen(x).shape == (8, 3)
    assert model.backbone.conv.weight.requires_grad  # the input model is untouched


def test_regions_must_exist_and_not_nest() -> None:
    with pytest.raises(ValueError, match="'missing' is not a submodule"):
        ModelQuantizer(regions=["missing"], quiet=True).prepare(Gated(), torch.randn(1, 3, 8, 8))
    with pytest.raises(ValueError, match="lies inside"):
        ModelQuantizer(regions=["backbone", "backbone.conv"], quiet=True).prepare(Gated(), torch.randn(1, 3, 8, 8))


class CallsAttention(nn.Module):
    """A parent calling its attention with keywords, or reading one of its attributes (as
    ``nn.TransformerEncoderLayer`` reads ``self_attn.batch_first``)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.how = how
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "keywords":
            return self.attn(x, x, x, attn_mask=self.mask)[0]
        return self.attn(x, x, x)[0] * self.attn.num_heads


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("keywords", r"regions: 'attn' is called with keyword arguments \(attn_mask\); allowed: submodules called"),
        ("attribute", r"regions: CallsAttention reads 'num_heads' of region 'attn', which a captured region"),
    ],
)
def test_a_region_its_parent_calls_with_keywords_or_reads_from_is_refused_by_name(how: str, message: str) -> None:
    # The region was captured with its positional arguments only and keeps no attributes:
    # torch's own ValueError (kwarg mismatch) or an AttributeError came out of calibration.
    x = torch.randn(4, 4, 8)
    with pytest.raises(ConfigError, match=message):
        ModelQuantizer("a8w8", regions=["attn"], quiet=True).quantize_model(CallsAttention(how).eval(), x[:1], [x])


class JoinsAnInfiniteConstant(nn.Module):
    """A Linear reading the input joined to a constant that holds -inf (no attention mask:
    nothing but the observer can refuse it)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        causal = torch.zeros(1, 4, 4)
        causal[0, 0, 3] = float("-inf")
        self.register_buffer("causal", causal)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.cat([x[..., :4], self.causal.expand(x.shape[0], 4, 4)], -1))


def test_an_infinite_constant_is_refused_naming_it() -> None:
    # The constant's observer refused it with "range: contains infinite values" and no name.
    x = torch.randn(4, 4, 8)
    with pytest.raises(DataError, match=r"^calibration: constant 'causal': range: contains infinite values"):
        ModelQuantizer("a8w8", quiet=True).quantize_model(JoinsAnInfiniteConstant().eval(), x[:1], [x])


def test_wrong_shape_loader_fails_on_its_first_batch_naming_the_expected_shape(capsys) -> None:
    seen = []

    def loader():
        for batch in images(3, shape=(3, 16, 16)):
            seen.append(batch)
            yield batch

    with pytest.raises(DataError, match=r"batch 0, input 0 has shape \[8, 3, 16, 16\]; expected \[N, 3, 8, 8\]"):
        ModelQuantizer().quantize_model(conv_bn_net(), torch.randn(1, 3, 8, 8), loader())
    assert len(seen) == 1
    assert "calibrating" not in capsys.readouterr().err  # it failed before a bar was drawn


@pytest.mark.parametrize(
    ("item", "match"),
    [
        ({"x": 1}, "batch 0 is a dict"),
        ((torch.zeros(2, 3, 8, 8, dtype=torch.long),), "dtype torch.int64"),
        (torch.zeros(2, 3, 8, 8, dtype=torch.float64), "dtype torch.float64; expected torch.float32"),
        (torch.zeros(3, 8, 8), r"shape \[3, 8, 8\]"),
    ],
)
def test_other_bad_batches(item: object, match: str) -> None:
    with pytest.raises(DataError, match=match):
        ModelQuantizer(quiet=True).quantize_model(conv_bn_net(), torch.randn(1, 3, 8, 8), [item])


def test_empty_loader_and_nan_data() -> None:
    with pytest.raises(DataError, match="no batches"):
        ModelQuantizer(quiet=True).quantize_model(conv_bn_net(), torch.randn(1, 3, 8, 8), [])
    bad = images(1)[0]
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"tensor 'x'.*NaN"):
        ModelQuantizer(quiet=True).quantize_model(conv_bn_net(), torch.randn(1, 3, 8, 8), [bad])


def test_bad_arguments_name_the_field() -> None:
    with pytest.raises(ValueError, match="qat_method: 'adam' is not allowed; allowed: auto, lsq, tqt, ste"):
        ModelQuantizer(qat_method="adam")
    with pytest.raises(ValueError, match="preset: 'int7' is not a known preset"):
        ModelQuantizer("int7")
    with pytest.raises(ValueError, match="example_inputs: dict is not allowed"):
        ModelQuantizer(quiet=True).prepare(conv_bn_net(), {"x": torch.zeros(1)})
    with pytest.raises(ValueError, match="ConvBnNet holds no quantized graph"):
        ModelQuantizer(quiet=True).freeze(conv_bn_net())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"exclude_module_types": nn.Conv2d},
            "exclude_module_types: <class 'torch.nn.modules.conv.Conv2d'> is not "
            "allowed; allowed: a list of nn.Module subclasses",
        ),
        ({"regions": "conv1"}, "regions: 'conv1' is not allowed; allowed: a list of submodule paths"),
        ({"regions": []}, "regions: [] is not allowed; allowed: a list of submodule paths, or None (all)"),
        ({"dynamic_batch": "no"}, "dynamic_batch: 'no' is not allowed; allowed: true, false"),
        ({"share_concat_scales": 1}, "share_concat_scales: 1 is not allowed; allowed: true, false"),
        ({"compile_fake_quant": None}, "compile_fake_quant: None is not allowed; allowed: true, false"),
        ({"quiet": "yes"}, "quiet: 'yes' is not allowed; allowed: true, false"),
    ],
)
def test_constructor_arguments_are_checked_at_construction(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        ModelQuantizer(**kwargs)  # type: ignore[arg-type]
    assert str(error.value) == message


@pytest.mark.parametrize("preset", ["xint8", "a8w8"])  # a8w8's algorithms read the model before it is captured
def test_a_model_that_is_no_module_is_refused_where_it_enters(preset: str) -> None:
    q = ModelQuantizer(preset, quiet=True)
    allowed = "model: function is not allowed; allowed: a torch.nn.Module"
    example = torch.randn(1, 3, 8, 8)
    for call in (
        lambda: q.quantize_model(lambda x: x, example, images(1)),  # type: ignore[arg-type]
        lambda: q.prepare(lambda x: x, example),  # type: ignore[arg-type]
        lambda: q.prepare_qat(lambda x: x, example, calib_loader=images(1)),  # type: ignore[arg-type]
    ):
        with pytest.raises(ConfigError) as error:
            call()
        assert str(error.value) == allowed


def test_freeze_before_calibration_is_refused() -> None:
    q = ModelQuantizer("a8w8", quiet=True)
    prepared = q.prepare(conv_bn_net(), torch.randn(1, 3, 8, 8))
    with pytest.raises(ValueError, match="has no qparams yet; calibrate"):
        q.freeze(prepared)


def _float_ops(model: nn.Module) -> set[str]:
    return {f.op_type for gm in quantized_graphs(model) for f in graph_info(gm).plan.float_nodes}


def _float_names(model: nn.Module) -> list[str]:
    return [f.name for gm in quantized_graphs(model) for f in graph_info(gm).plan.float_nodes]


def test_exclude_by_module_glob_type_and_node_name() -> None:
    data, example = images(2), torch.randn(1, 3, 8, 8)
    by_glob = ModelQuantizer("a8w8", exclude_modules=["head*"], quiet=True).quantize_model(conv_bn_net(), example, data)
    assert _float_names(by_glob) == ["head.1/linear"]
    by_type = ModelQuantizer("a8w8", exclude_module_types=[nn.Linear], quiet=True).quantize_model(
        conv_bn_net(), example, data
    )
    assert _float_names(by_type) == ["head.1/linear"]
    from quant_core.presets import get_preset

    config = get_preset("a8w8").evolve(exclude=("conv2/*", "Concat"))
    by_config = ModelQuantizer(config, quiet=True).quantize_model(conv_bn_net(), example, data)
    assert _float_names(by_config) == ["conv2/conv2d_1", "cat"]
    assert graph_info(quantized_graphs(by_config)[0]).plan.float_nodes[0].reason == "excluded by the config"


def test_excluded_parts_compute_in_float() -> None:
    model = conv_bn_net()
    q = ModelQuantizer("a8w8", exclude_modules=["*"], quiet=True)
    everything = q.quantize_model(model, torch.randn(1, 3, 8, 8), images(2))
    x = images(1, seed=7)[0]
    with torch.no_grad():
        got, expected = everything(x).numpy(), model(x).numpy()
    # only the graph input is still quantized (no node reads it as excluded input spec)
    assert np.max(np.abs(got - expected)) < 0.05


def test_export_warns_where_float_code_around_regions_depends_on_values(tmp_path) -> None:
    q = ModelQuantizer("a8w8", regions=["backbone"], quiet=True)
    frozen = q.freeze(q.quantize_model(Gated().eval(), torch.randn(1, 3, 8, 8), images(2)))
    with pytest.warns(UserWarning, match=r"value-dependent Python at .*test_errors_partial\.py:\d+: if x\.sum\(\) > 0"):
        q.export_onnx(frozen, torch.randn(1, 3, 8, 8), tmp_path / "m.onnx")


def test_an_exclusion_that_matches_no_module_is_refused() -> None:
    q = ModelQuantizer("a8w8", exclude_modules=["haed*"], quiet=True)
    with pytest.raises(ValueError, match=r"exclude_modules: 'haed\*' matches no module of ConvBnNet.*head\.1"):
        q.quantize_model(conv_bn_net(), torch.randn(1, 3, 8, 8), images(1))
    inside_region = ModelQuantizer("a8w8", regions=["backbone"], exclude_modules=["conv"], quiet=True)
    qmodel = inside_region.quantize_model(Gated().eval(), torch.randn(1, 3, 8, 8), images(1))
    assert _float_names(qmodel) == ["conv/conv2d"]


def test_a_fixed_batch_size_is_named_as_such() -> None:
    q = ModelQuantizer("a8w8", dynamic_batch=False, quiet=True)
    with pytest.raises(DataError, match=r"expected \[1, 3, 8, 8\] \(the example input's shape, the batch size fixed"):
        q.quantize_model(conv_bn_net(), torch.randn(1, 3, 8, 8), images(1))


class TwoRegions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = Backbone()
        self.head = nn.Sequential(nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def test_a_config_exclusion_that_matches_no_node_is_refused() -> None:
    from quant_core.presets import get_preset

    typo = ModelQuantizer(get_preset("a8w8").evolve(exclude=("conv2/conv2d_9",)), quiet=True)
    with pytest.raises(ValueError, match=r"^exclude: 'conv2/conv2d_9' matches no node name or op type .* conv1/"):
        typo.prepare(conv_bn_net(), torch.randn(1, 3, 8, 8))
    # With regions each is planned apart: a name need only be in one of them.
    config = get_preset("a8w8").evolve(exclude=("0/linear",))
    qmodel = ModelQuantizer(config, regions=["backbone", "head"], quiet=True).quantize_model(
        TwoRegions().eval(), torch.randn(1, 3, 8, 8), images(1)
    )
    assert _float_names(qmodel) == ["0/linear"]
    typo_in_regions = ModelQuantizer(config.evolve(exclude=("0/lnear",)), regions=["backbone", "head"], quiet=True)
    with pytest.raises(ValueError, match=r"^exclude: '0/lnear' matches no node"):
        typo_in_regions.prepare(TwoRegions().eval(), torch.randn(1, 3, 8, 8))


def test_all_zero_calibration_data_is_warned_of_and_noted() -> None:
    q = ModelQuantizer("a8w8", quiet=True)
    with pytest.warns(UserWarning, match=r"^input 'x': every calibration value was 0;") as caught:
        qmodel = q.quantize_model(conv_bn_net(), torch.randn(1, 3, 8, 8), [torch.zeros(4, 3, 8, 8)])
    assert caught[0].filename == __file__  # points at the user's call
    assert graph_info(quantized_graphs(qmodel)[0]).notes[0].startswith("input 'x': every calibration value was 0")
