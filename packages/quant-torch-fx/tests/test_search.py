"""quant_torch_fx.search: the recipe search over ModelQuantizer, checked against each recipe
quantized and frozen on its own (the independent reference), scored here with numpy."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from models import mobile_block_net

from quant_algos.search import SearchSpace, observer_stage, split_indices
from quant_core.algorithm_config import CLEConfig, SmoothQuantConfig
from quant_core.config import CalibrationConfig
from quant_core.errors import ConfigError, DataError
from quant_core.observer_config import MSE, MinMax, Percentile, PowerOfTwoMSE
from quant_torch_fx import ModelQuantizer, search

CALIBRATION = CalibrationConfig(batch_size=16)


@pytest.fixture(scope="module")
def net():
    return mobile_block_net(seed=4)  # min-max misses the best score here (with float logits: seed 3 ties)


@pytest.fixture(scope="module")
def calib():
    return torch.randn(48, 3, 8, 8, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def evaluation():
    return torch.randn(120, 3, 8, 8, generator=torch.Generator().manual_seed(2))


def alone(net, calib, config):
    """The recipe on its own: what a user runs with the winning config."""
    q = ModelQuantizer(config, quiet=True)
    return q.freeze(q.quantize_model(net, calib[:1], list(calib.split(16))))


def top1(model, x):
    with torch.no_grad():
        return model(x).argmax(dim=1).numpy()


def logits(model, x):
    with torch.no_grad():
        return model(x).double().numpy()


def sqnr(outputs, reference):  # independent of quant_core: output SQNR in dB
    return 10.0 * np.log10(np.sum(reference**2) / np.sum((reference - outputs) ** 2))


def test_a_target_the_cheapest_candidate_misses_is_met_by_a_later_one(net, calib, evaluation):
    space = SearchSpace(formats=("a8w8",), activation_observers=(MinMax(), Percentile(99.0), MSE()))
    candidates = observer_stage(space, CALIBRATION)
    select, held = split_indices(len(evaluation), 0.3, seed=0)
    reference = logits(net, evaluation)
    outputs = {c.name: logits(alone(net, calib, c.config), evaluation) for c in candidates}
    full = {name: sqnr(o[select], reference[select]) for name, o in outputs.items()}
    cheapest = candidates[0].name
    target = max(full.values()) - 1e-9
    assert full[cheapest] < target, "the cheapest candidate meets the best score: the test would test nothing"

    result = search(
        net, calib[:1], calib, evaluation, target=target, metric="sqnr", space=candidates, batch_size=16, quiet=True
    )

    assert result.met and result.chosen is not None and result.chosen.name != cheapest
    assert result.candidates[0].name == cheapest and result.candidates[0].status == "missed"
    winner = result.chosen
    assert winner.score == pytest.approx(full[winner.name], rel=1e-6)
    # Held out: re-scored on samples the search never selected on, and in the report.
    expected_holdout = sqnr(outputs[winner.name][held], reference[held])
    assert result.holdout_score == pytest.approx(expected_holdout, rel=1e-6)
    assert result.report["holdout_score"] == pytest.approx(expected_holdout, rel=1e-6)
    assert result.report["split"] == {"select": len(select), "holdout": len(held)}
    # Derived from one statistics pass, the chosen model is the recipe's own, bit for bit.
    own = alone(net, calib, winner.config).state_dict()
    for key, value in result.model.state_dict().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, own[key]), key
    assert [p.pre_passes for p in result.statistics] == ["none"]
    assert result.statistics[0].served[0] == cheapest


def test_a_user_metric_over_labels(net, calib, evaluation):
    labels = top1(net, evaluation).copy()
    labels[::4] = (labels[::4] + 1) % 5  # a quarter wrong: accuracy differs from agreement

    def accuracy(outputs, reference, samples):
        return (outputs.argmax(axis=1) == samples.labels).astype(np.float64)

    accuracy.per_sample = True
    config_space = SearchSpace(formats=("a8w8",), activation_observers=(MinMax(),))
    result = search(
        net, calib[:1], calib, evaluation, target=0.0, metric=accuracy, labels=torch.from_numpy(labels),
        space=config_space, batch_size=16, quiet=True,
    )  # fmt: skip
    select, held = split_indices(len(evaluation), 0.3, seed=0)
    predictions = top1(alone(net, calib, result.chosen.config), evaluation)
    assert result.metric == "accuracy" and result.met
    assert result.chosen.score == pytest.approx(float(np.mean(predictions[select] == labels[select])))
    assert result.holdout_score == pytest.approx(float(np.mean(predictions[held] == labels[held])))


def test_what_the_torch_backend_cannot_run_is_a_skipped_row_with_the_reason(net, calib, evaluation, tmp_path):
    space = SearchSpace(
        formats=("a8w8",), activation_observers=(MinMax(),), corrections=((SmoothQuantConfig(),), (CLEConfig(),))
    )
    report = tmp_path / "search.json"
    result = search(
        net, calib[:1], calib, evaluation, target=1.01, space=space, batch_size=16, quiet=True, report_path=report
    )
    rows = {row.name: row for row in result.candidates}
    assert rows["a8w8/minmax+smoothquant"].status == "skipped"
    assert "smoothquant runs in quant-onnx only" in rows["a8w8/minmax+smoothquant"].error
    assert rows["a8w8/minmax+cle"].status in ("missed", "stopped")
    assert not result.met and result.stopped_by == "space"
    written = json.loads(report.read_text())
    assert written == json.loads(json.dumps(result.report)) and written["deployment"] == "torch"
    assert [row["name"] for row in written["candidates"]] == [row.name for row in result.candidates]


def test_the_xint8_target_skips_formats_the_npu_cannot_run(net, calib, evaluation):
    candidates = [
        *observer_stage(SearchSpace(formats=("a8w8", "xint8"), activation_observers=(MinMax(),)), CALIBRATION)
    ]
    result = search(
        net, calib[:1], calib, evaluation, target=0.0, space=candidates, deployment="xint8", batch_size=16, quiet=True
    )
    rows = {row.name: row for row in result.candidates}
    assert rows["a8w8/minmax"].status == "skipped" and "power_of_two" in rows["a8w8/minmax"].error
    assert result.chosen.name == "xint8/minmax" and result.deployment == "torch:xint8"
    assert result.metric == "agreement"  # the default: top-1 agreement with the float model


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"target": "high"}, "target"),
        ({"target": float("inf")}, "target"),
        ({"budget_s": 0}, "budget_s"),
        ({"deployment": "dpu"}, "deployment"),
        ({"metric": "top5"}, "metric"),
        ({"eval_data": "images.npy"}, "eval_data"),
        ({"holdout": 1.5}, "holdout"),
        ({"report_path": "/no/such/folder/r.json"}, "report_path"),
        ({"model": "model.onnx"}, "model"),
        ({"eval_batch_size": 0}, "eval_batch_size"),
        ({"eval_samples": -5}, "eval_samples"),  # before: scored all but the last 5
    ],
)
def test_bad_arguments_fail_with_one_line_naming_the_field(net, calib, evaluation, kwargs, field):
    arguments = {"model": net, "eval_data": evaluation, "target": 0.9} | kwargs
    model, eval_data = arguments.pop("model"), arguments.pop("eval_data")
    with pytest.raises((ConfigError, ValueError)) as error:
        search(model, calib[:1], calib, eval_data, quiet=True, **arguments)
    message = str(error.value)
    assert message.startswith(f"{field}: ") and "\n" not in message


@pytest.mark.parametrize("metric", [None, "sqnr"])
def test_labels_the_metric_never_reads_are_refused(net, calib, evaluation, metric):
    labels = torch.zeros(len(evaluation), dtype=torch.int64)  # one per sample: only the metric is wrong
    with pytest.raises(ConfigError, match=r"^labels: read only by metric 'accuracy' or a user metric"):
        search(net, calib[:1], calib, evaluation, target=0.9, metric=metric, labels=labels, quiet=True)


def test_every_derived_candidate_is_its_own_quantization_bit_for_bit(net, calib, evaluation, monkeypatch):
    """Histograms of one pass and weight ranges selected once serve every candidate: each
    built model equals the recipe quantized and frozen alone, and the reuse is reported."""
    from quant_torch_fx import recipe_search

    built = {}
    build = recipe_search._TorchBackend.build

    def recording(self, candidate):
        found = build(self, candidate)
        built[candidate.name] = (candidate.config, found.model)
        return found

    monkeypatch.setattr(recipe_search._TorchBackend, "build", recording)
    space = SearchSpace(
        formats=("xint8",),
        activation_observers=(MinMax(), PowerOfTwoMSE(), Percentile(99.0)),
        weight_observers=(None, PowerOfTwoMSE()),
    )
    candidates = observer_stage(space, CALIBRATION)
    result = search(net, calib[:1], calib, evaluation, target=1.01, space=candidates, batch_size=16, quiet=True)
    assert set(built) == {c.name for c in candidates}
    for name, (config, model) in built.items():
        own = alone(net, calib, config).state_dict()
        for key, value in model.state_dict().items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, own[key]), f"{name}: {key}"
    reuse = result.report["reuse"]
    assert reuse["statistics_passes"] == 1 and reuse["weight_qparams_reused"] > 0
    assert all(row.statistics.startswith("statistics pass 1") for row in result.candidates)


def test_numpy_data_in_another_float_dtype_is_fed_in_the_models(net, calib, evaluation):
    space = SearchSpace(formats=("a8w8",), activation_observers=(MinMax(),))
    result = search(
        net, calib[:1], calib.double().numpy(), evaluation.double().numpy(), target=0.0, space=space, quiet=True
    )
    as_float32 = search(net, calib[:1], calib, evaluation, target=0.0, space=space, quiet=True)
    assert result.met and result.chosen.score == as_float32.chosen.score


def _with_specs(config, change):
    """``config`` with ``change`` applied to every quantized activation spec."""
    import attrs

    def operator(op):
        fields = {k: change(getattr(op, k)) for k in ("input", "output") if getattr(op, k) is not None}
        return attrs.evolve(op, **fields)

    return config.evolve(
        global_config=operator(config.global_config),
        op_type_overrides={k: operator(v) for k, v in config.op_type_overrides.items()},
        name_overrides={k: operator(v) for k, v in config.name_overrides.items()},
    )


def test_recipes_that_differ_outside_the_tensors_are_not_the_same_model() -> None:
    """Rounding is in no buffer: two recipes that differ only there both run, and a
    recipe's NPU conversions change the float graph the statistics are taken on."""
    import copy

    from torch import nn

    from quant_algos.search.space import TIER_8BIT, make_candidate, with_observers
    from quant_core.presets import get_preset
    from quant_torch_fx import recipe_search as rs
    from quant_torch_fx.capture import as_args, capture
    from quant_torch_fx.data import InputSignature
    from quant_torch_fx.prepare import normalize

    net = mobile_block_net(seed=4)
    calib = torch.randn(48, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    evaluation = torch.randn(120, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    base = with_observers(
        get_preset("a8w8").evolve(algorithms=(), calibration=CalibrationConfig(batch_size=16)), MinMax()
    )
    floor = _with_specs(base, lambda s: s.evolve(rounding="floor") if s.is_quantized else s)
    space = [make_candidate("a8w8/floor", floor, TIER_8BIT), make_candidate("a8w8/half_even", base, TIER_8BIT)]
    result = search(
        net, calib[:1], calib, evaluation, target=200.0, metric="sqnr", space=space, batch_size=16, quiet=True
    )
    rows = {row.name: row for row in result.candidates}
    assert rows["a8w8/half_even"].same_as == "" and rows["a8w8/half_even"].score > rows["a8w8/floor"].score

    torch.manual_seed(0)
    sig_net = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.Sigmoid(), nn.Conv2d(8, 8, 3), nn.Flatten(), nn.Linear(128, 10)
    ).eval()
    plain = make_candidate("a8w8/minmax", base, TIER_8BIT)
    converted = make_candidate("a8w8/minmax[npu]", base.evolve(npu_conversions=("sigmoid",)), TIER_8BIT)
    args = as_args(calib[:1])
    signature = InputSignature.of(args, True)
    held = rs.calibration_batches(calib, signature, None, 16, None)
    normalized = capture(copy.deepcopy(sig_net), args, dynamic_batch=True)
    normalize(normalized, fold_batch_norms=True)
    backend = rs._TorchBackend(normalized, held, signature, ["input_0"], None, None)
    for found in (plain, converted):
        quantizer = ModelQuantizer(found.config, quiet=True)
        alone = quantizer.freeze(quantizer.quantize_model(sig_net, calib[:1], list(calib.split(16))))
        built = backend.build(found)
        assert built.digest == rs._digest(alone), found.name


def _with_nan(samples: int) -> torch.Tensor:
    x = torch.randn(samples, 3, 8, 8)
    x[1, 0, 0, 0] = float("nan")
    return x


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"calibration_data": _with_nan(48)}, "calibration_data: batch 0, input 0 holds NaN or infinite values"),
        ({"eval_data": _with_nan(120)}, "eval_data, input 0 holds NaN or infinite values"),
        (
            {"eval_data": torch.randn(8, 1, 8, 8)},
            r"eval_data, input 0 has shape \[8, 1, 8, 8\]; expected \[N, 3, 8, 8\]",
        ),
        ({"eval_data": torch.zeros(8, 3, 8, 8, dtype=torch.long)}, "eval_data, input 0 has dtype torch.int64"),
        ({"calibration_data": [torch.randn(0, 3, 8, 8)]}, "empty"),  # met in the build, by every candidate
    ],
)
def test_bad_data_is_one_data_error_not_a_failed_row_per_candidate(net, calib, evaluation, data, match):
    arguments = {"calibration_data": calib, "eval_data": evaluation} | data
    space = SearchSpace(formats=("xint8",), activation_observers=(MinMax(),))
    with pytest.raises(DataError, match=match) as error:
        search(
            net, calib[:1], arguments["calibration_data"], arguments["eval_data"], target=0.0, space=space, quiet=True
        )
    assert "\n" not in str(error.value)
