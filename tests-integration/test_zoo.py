"""The model zoo's pieces (tools/bench/zoo.py, tools/zoo_models.py, tools/zoo_shims) on tiny inputs.

The zoo itself runs in ``nox -s zoo`` (``python -m tools.bench.zoo --check``); here: its doctests,
the torchvision shim, the check that keeps the expected-failure list honest, and one small model
through the torch backend's flow and the node-by-node comparison.
"""

from __future__ import annotations

import doctest
import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # the repository's tools/, beside the installed packages
    sys.path.insert(0, str(REPO_ROOT))

from tools import zoo_models  # noqa: E402
from tools.bench import qdq_coverage, zoo, zoo_flows  # noqa: E402


@pytest.mark.parametrize("module", ["tools.bench.zoo", "tools.bench.zoo_flows", "tools.bench.qdq_coverage",
                                    "tools.zoo_models"])  # fmt: skip
def test_doctests(module: str) -> None:
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result


def test_shim_frozen_batch_norm_matches_batch_norm() -> None:
    zoo_models.use_torchvision_shim()
    from torchvision.ops.misc import FrozenBatchNorm2d

    bn = torch.nn.BatchNorm2d(6).eval()
    zoo_models.randomise_untrained_state(bn, seed=3)
    frozen = FrozenBatchNorm2d(6)
    frozen.load_state_dict(bn.state_dict())  # num_batches_tracked is dropped
    x = torch.randn(2, 6, 5, 5)
    torch.testing.assert_close(frozen(x), bn(x))


def test_untrained_constants_are_drawn_and_the_rest_kept() -> None:
    head = torch.nn.Linear(16, 4)
    torch.nn.init.zeros_(head.weight)
    norm = torch.nn.LayerNorm(16)
    model = torch.nn.Sequential(norm, head)
    model.register_parameter("layer_scale", torch.nn.Parameter(torch.full((16,), 1e-6)))
    model.register_parameter("slope", torch.nn.Parameter(torch.tensor([0.25])))
    pos = torch.nn.Parameter(torch.randn(3, 16))
    model.register_parameter("pos", pos)
    kept = pos.detach().clone()
    zoo_models.randomise_untrained_state(model, seed=0)
    assert head.weight.std() > 0.1 and head.bias.abs().max() > 0  # zero head and zero bias drawn
    assert float(norm.weight.min()) >= 0.8 and float(norm.weight.max()) <= 1.2 and norm.weight.std() > 0
    assert float(model.layer_scale.min()) >= 0.1 and float(model.layer_scale.max()) <= 1.0
    assert model.slope.item() == 0.25 and torch.equal(model.pos, kept)


def test_shim_placeholders_import_but_refuse_use() -> None:
    zoo_models.use_torchvision_shim()
    from torchvision.datasets import CIFAR10
    from torchvision.transforms import InterpolationMode, ToTensor
    from torchvision.transforms.functional import resize

    assert InterpolationMode.BICUBIC.value == "bicubic"
    with pytest.raises(NotImplementedError, match=r"torchvision\.transforms\.ToTensor: not available"):
        ToTensor()
    with pytest.raises(NotImplementedError, match=r"datasets\.CIFAR10"):
        CIFAR10("x")
    with pytest.raises(NotImplementedError, match=r"functional\.resize"):
        resize(None, 3)


def test_check_flags_unlisted_failures_and_listed_passes() -> None:
    failed = {"ok": False, "failed": {"stage": "export", "error": "RuntimeError: boom"}}
    ok = {"ok": True}
    results = {"a": {"torch_fx": failed, "quant_onnx": ok, "pt2e": failed}, "b": {"torch_fx": ok, "quant_onnx": ok}}
    assert zoo.check(results, {("a", "torch_fx", "export"): "known"}) == []  # PT2E is never checked
    assert zoo.check(results, {}) == ["a / quant-torch-fx: failed at export: RuntimeError: boom"]
    moved = zoo.check(results, {("a", "torch_fx", "quantize"): "known"})
    assert moved == ["a / quant-torch-fx: failed at export (listed at quantize): RuntimeError: boom"]
    fixed = zoo.check(results, {("a", "torch_fx", "export"): "known", ("b", "quant_onnx", "quantize"): "known"})
    assert fixed == [
        "b / quant-onnx: listed as failing at quantize but ran end to end: remove it from EXPECTED_FAILURES"
    ]
    crashed = {"c": {"job_failed": {"stage": "job", "error": "killed by the watchdog (timeout)"}}}
    assert len(zoo.check(crashed, {})) == 2


def test_expected_failures_name_real_models_backends_and_stages() -> None:
    stages = {"torch_fx": {"quantize", "freeze", "export", "run frozen", "onnxruntime"},
              "quant_onnx": {"float export", "quantize", "onnxruntime"}}  # fmt: skip
    for (model, backend, stage), why in zoo.EXPECTED_FAILURES.items():
        assert model in zoo_models.ZOO and stage in stages[backend] and why


def test_torch_flow_on_a_small_model(tmp_path: Path) -> None:
    """The torch backend's flow end to end on the PReLU net: every quantized tensor of the
    exported file is matched to a frozen tensor, and node by node they agree within one step."""
    torch.set_num_threads(1)
    entry = zoo_models.ZOO["prelu_net"]
    model = entry.build(64)
    data = {"calib": zoo.noise(8, 64, 1), "eval": zoo.noise(4, 64, 2)}
    data.update(node=data["eval"], float_eval=zoo_flows.torch_outputs(model, data["eval"]), classes_from=0)
    result = zoo_flows.run(lambda flow: zoo_flows.torch_backend(flow, model, data, tmp_path / "m.onnx"))
    assert result["ok"], result
    nodes = result["node_by_node"]
    assert nodes["matched"] == nodes["tensors"] > 5
    assert nodes["within_one"] == 1.0
    isolated = result["isolated"]
    assert isolated["matched"] == isolated["tensors"] == nodes["tensors"] and isolated["within_one"] == 1.0
    assert isolated["default_matched"] == nodes["tensors"] and isolated["default_within_one"] == 1.0
    departure = result["first_departure"]
    assert departure["tensor"] is None or (departure["steps"] >= 1 and departure["tie_distance"] >= 0), departure
    floor = result["rounding_floor"]
    pairs = ("torch_channels_last", "ort_vs_reference", "reference_vs_frozen")
    assert all(0 <= floor[f"{pair}_steps"] < 4 and floor[f"{pair}_max_abs"] >= 0 for pair in pairs), floor
    assert result["sqnr_frozen"] > 15 and result["dq_fed"]["weights_dq"] == result["dq_fed"]["weights"] == 5
    assert result["kernels"]["float"] == 0 and result["kernels"]["integer"] == 5


def test_step_differences_counts_elements_and_names_the_worst() -> None:
    a = np.zeros((2, 3), np.float32)
    b = a.copy()
    b[1, 2] = 0.5
    summary = qdq_coverage.step_differences([("p", a, a, 0.25), ("q", a, b, 0.25)])
    assert summary["within_one"] == 0.5 and summary["worst"] == "q" and summary["worst_steps"] == 2.0
    assert summary["first_beyond_one"] == "q" and summary["elements_beyond_one"] == pytest.approx(1 / 12)
