"""quant-torch-fx against onnxruntime and quant-onnx (everything installed):

- one config, two backends: quant_torch_fx's exported QDQ model and quant_onnx's QDQ of the
  torch-exported float model carry the same activation and weight scales, op by op, on
  the trained Fashion-MNIST reference models;
- every convolution and the classifier land in onnxruntime's integer kernels;
- the exported model's outputs stay within one output quantization step of the frozen
  torch model (node by node, as the QDQ model defines them).
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
quant_onnx = pytest.importorskip("quant_onnx")

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import onnx  # noqa: E402
from onnx import numpy_helper  # noqa: E402

from quant_core.presets import get_preset  # noqa: E402
from quant_core.serialization import load_config, save_config  # noqa: E402
from quant_torch_fx import ModelQuantizer  # noqa: E402
from quant_torch_fx.export import onnx_model  # noqa: E402
from quant_torch_fx.export_fidelity import output_tolerance  # noqa: E402
from tools.bench.common import float_compute_nodes  # noqa: E402
from tools.reference_models.data import DEFAULT_ROOT, load_fashion_mnist  # noqa: E402
from tools.reference_models.torch_weights import load_reference_model  # noqa: E402

if not (DEFAULT_ROOT / "t10k-images-idx3-ubyte.gz").exists():
    pytest.skip("Fashion-MNIST is not installed (dataset-fashion-mnist)", allow_module_level=True)

MODELS = ("fmnist_resnet18", "fmnist_mobilenetv2")
EXAMPLE = torch.zeros(1, 1, 32, 32)


@pytest.fixture(scope="module")
def images() -> np.ndarray:
    return load_fashion_mnist("test")[0]


def _float_onnx(model: torch.nn.Module) -> onnx.ModelProto:
    """What a user hands quant-onnx: the TorchScript export, batch norm unfolded."""
    buffer = io.BytesIO()
    torch.onnx.export(
        model, (EXAMPLE,), buffer, dynamo=False, opset_version=17, do_constant_folding=False,
        input_names=["input"], output_names=["output"], dynamic_axes={"input": {0: "n"}, "output": {0: "n"}},
    )  # fmt: skip
    return onnx.load_from_string(buffer.getvalue())


def _layer_scales(model: onnx.ModelProto) -> list[tuple[str, float | None, list[float] | None, float | None]]:
    """Per Conv/Gemm/Add/pool in graph order: (op, input scale, weight scales, output scale)."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    producers = {out: n for n in model.graph.node for out in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    def dq_scale(tensor: str) -> np.ndarray | None:
        node = producers.get(tensor)
        return inits[node.input[1]] if node is not None and node.op_type == "DequantizeLinear" else None

    rows = []
    for node in model.graph.node:
        if node.op_type not in ("Conv", "Gemm", "Add", "GlobalAveragePool"):
            continue
        quantize = [c for c in consumers.get(node.output[0], []) if c.op_type == "QuantizeLinear"]
        out = float(inits[quantize[0].input[1]]) if quantize else None
        x = dq_scale(node.input[0])
        w = dq_scale(node.input[1]) if node.op_type in ("Conv", "Gemm") else None
        rows.append((node.op_type, None if x is None else float(x), None if w is None else w.reshape(-1).tolist(), out))
    return rows


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("preset", ["a8w8", "xint8"])
def test_one_config_two_backends_give_equal_scales(name: str, preset: str, images: np.ndarray, tmp_path: Path) -> None:
    config_path = tmp_path / f"{preset}.json"
    save_config(get_preset(preset), config_path)
    config = load_config(config_path)
    model = load_reference_model(name)
    calib = images[:128]
    onnx_side = quant_onnx.quantize(_float_onnx(model), None, config, calib, batch_size=32, quiet=True).model
    q = ModelQuantizer(config, quiet=True)
    frozen = q.freeze(
        q.quantize_model(model, EXAMPLE, [torch.from_numpy(calib[i : i + 32]) for i in range(0, 128, 32)])
    )
    torch_side = onnx_model(frozen, (EXAMPLE,))
    a, b = _layer_scales(onnx_side), _layer_scales(torch_side)
    assert [row[0] for row in a] == [row[0] for row in b] and len(a) > 20
    # Float scales come from ranges that onnxruntime's and torch's float arithmetic compute
    # a rounding apart; power-of-two positions must agree exactly.
    rtol = 0.0 if preset == "xint8" else 1e-5
    for (op, x1, w1, y1), (_op, x2, w2, y2) in zip(a, b, strict=True):
        assert (x1 is None) == (x2 is None) and (y1 is None) == (y2 is None), op
        for u, v in ((x1, x2), (y1, y2)):
            if u is not None and v is not None:
                assert v == pytest.approx(u, rel=rtol, abs=0), op
        if w1 is not None or w2 is not None:
            np.testing.assert_allclose(w2, w1, rtol=rtol)


@pytest.fixture(scope="module", params=[(m, p) for m in MODELS for p in ("a8w8", "xint8", "a8w8_per_tensor")])
def exported(request: pytest.FixtureRequest, images: np.ndarray, tmp_path_factory: pytest.TempPathFactory):
    name, preset = request.param
    q = ModelQuantizer(preset, quiet=True)
    calib = [torch.from_numpy(images[i : i + 32]) for i in range(0, 128, 32)]
    frozen = q.freeze(q.quantize_model(load_reference_model(name), EXAMPLE, calib))
    path = q.export_onnx(frozen, EXAMPLE, tmp_path_factory.mktemp("qdq") / f"{name}_{preset}.onnx")
    return name, preset, frozen, path


def test_every_conv_and_the_classifier_run_in_integer_kernels(exported) -> None:
    _name, _preset, _frozen, path = exported
    counts = float_compute_nodes(path)
    assert counts["total"] >= 21
    assert counts["float"] == 0, counts["float_nodes"]


def _session(path: Path, level: ort.GraphOptimizationLevel) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    options.intra_op_num_threads = 2
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def test_outputs_within_one_output_step_of_the_frozen_model(exported, images: np.ndarray) -> None:
    _name, _preset, frozen, path = exported
    x = images[1000:1200]
    with torch.no_grad():
        expected = frozen(torch.from_numpy(x)).numpy()
    # The logits' step under xint8; under a8w8 they are float (the result tail): one step of
    # the last layer's quantized input carried through its weights.
    step = output_tolerance(onnx.load(str(path)))
    assert step is not None

    def steps_apart(got: np.ndarray) -> np.ndarray:
        return np.abs(got - expected) / step

    node_by_node = _session(path, ort.GraphOptimizationLevel.ORT_DISABLE_ALL).run(None, {"input": x})[0]
    assert steps_apart(node_by_node).max() <= 1
    kernels = _session(path, ort.GraphOptimizationLevel.ORT_ENABLE_ALL).run(None, {"input": x})[0]
    # Integer kernels requantize between layers with their own rounding; a rounding apart in
    # one layer can move a few logits by a step more, never the prediction of most samples.
    assert np.mean(steps_apart(kernels) <= 1) >= 0.99
    assert np.mean(kernels.argmax(1) == expected.argmax(1)) >= 0.99
