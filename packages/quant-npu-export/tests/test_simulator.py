"""The integer simulator against onnxruntime and an independent half-up reference.

Where every op rounds the same way in both (Conv+Relu chains, MaxPool, Concat, Add with
aligned positions, power-of-two global pools), ``onnx`` rounding must give the same bits
as onnxruntime with graph optimisations off, and ``device`` rounding the same bits as
ONNX's reference evaluator with a half-up QuantizeLinear.
"""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from builders import GraphBuilder, QDQWriter, activation_net, conv_chain, mobile_block, ort_run, quantize, random_inputs
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from quant_core.errors import ConfigError, DataError, ModelError
from quant_npu.legalize import legalize_model
from quant_npu.profile import NPUProfile, get_profile
from quant_npu.sim import NPUSimulator, simulate


class QuantizeLinear(OpRun):
    """QuantizeLinear rounding half up (``floor(x + 0.5)``), per-tensor, for the reference
    (ONNX's reference evaluator takes an op's type from its class name)."""

    op_domain = ""

    def _run(self, x, y_scale, y_zero_point=None, **_attributes):  # type: ignore[override]
        dtype = np.int8 if y_zero_point is None else y_zero_point.dtype
        zero = 0 if y_zero_point is None else int(y_zero_point)
        info = np.iinfo(dtype)
        codes = np.floor(x.astype(np.float64) / float(y_scale) + 0.5) + zero  # exact: power-of-two scales
        return (np.clip(codes, info.min, info.max).astype(dtype),)


def legal(build, encoding: str = "x86_uint8", target: str = "xint8", config: str = "xint8") -> onnx.ModelProto:
    result = legalize_model(quantize(build(), config, encoding=encoding), target)
    assert result.remaining.ok, result.remaining.format_text()
    return result.model


@pytest.mark.parametrize("build", [conv_chain, mobile_block])
@pytest.mark.parametrize("encoding", ["x86_uint8", "as_spec"])
@pytest.mark.parametrize("target", ["xint8", "xint8_int32_bias", "dpu"])
def test_bit_exact_with_onnxruntime(build, encoding: str, target: str) -> None:
    model = legal(build, encoding, target)
    x = random_inputs(build(), 96, seed=11) * 1.5
    expected = ort_run(model, x)[0]
    got = simulate(model, x, target, rounding="onnx", quiet=True)
    (output,) = got.values()
    assert output.dtype == np.float32 and output.shape == expected.shape
    np.testing.assert_array_equal(output, expected)


@pytest.mark.parametrize("build", [conv_chain, mobile_block])
def test_device_rounding_matches_a_half_up_reference(build) -> None:
    model = legal(build, "as_spec")
    x = random_inputs(build(), 64, seed=12)
    reference_model = onnx.ModelProto()
    reference_model.CopyFrom(model)
    reference_model.opset_import[0].version = 21  # ONNX's reference QDQ kernels start at opset 19
    expected = ReferenceEvaluator(reference_model, new_ops=[QuantizeLinear]).run(None, {"x": x})[0]
    (got,) = simulate(model, x, rounding="device", quiet=True).values()
    np.testing.assert_array_equal(got, expected)
    (onnx_mode,) = simulate(model, x, rounding="onnx", quiet=True).values()
    assert not np.array_equal(got, onnx_mode)  # ties are common after power-of-two shifts


def test_device_approximations_stay_close_to_onnxruntime() -> None:
    model = legal(activation_net, target="xint8_int32_bias")
    x = random_inputs(activation_net(), 64, seed=13)
    expected = ort_run(model, x)[0]
    (got,) = simulate(model, x, "xint8_int32_bias", rounding="onnx", quiet=True).values()
    assert not np.array_equal(got, expected)  # 7/64 for 1/9, 26/256 for 0.1, 2731/16384 for 1/6, integer softmax
    assert np.abs(got - expected).max() <= 0.1  # softmax probabilities: within a few codes


def test_batches_and_integer_outputs() -> None:
    model = legal(conv_chain)
    x = random_inputs(conv_chain(), 37, seed=14)
    simulator = NPUSimulator(model)
    whole = simulator.run(x, quiet=True)["gemm30_out"] if "gemm30_out" in simulator.program.outputs else None
    outputs = [next(iter(simulator.run(x, batch_size=b, quiet=True).values())) for b in (1, 7, 64)]
    assert all(np.array_equal(outputs[0], o) for o in outputs[1:])
    (codes,) = simulator.run(x, batch_size=8, quiet=True, integer=True).values()
    assert codes.dtype == np.int8
    (_key, position) = next(iter(simulator.program.outputs.values()))
    np.testing.assert_array_equal(np.ldexp(codes.astype(np.float32), -position), outputs[0])
    assert whole is None or np.array_equal(whole, outputs[0])


def test_shape_computations_run_on_the_host() -> None:
    # torch's flatten: Reshape(x, Concat(Unsqueeze(Gather(Shape(x), 0)), [-1])), as EfficientNet exports it
    b = GraphBuilder(3)
    x = b.input("x", ["N", 3, 8, 8])
    h = b.node("GlobalAveragePool", [b.node("Relu", [b.conv(x, 3, 8)])])
    batch = b.node("Unsqueeze", [b.node("Gather", [b.node("Shape", [x]), b.const(np.array(0, np.int64))], axis=0),
                                 b.const(np.array([0], np.int64))])  # fmt: skip
    shape = b.node("Concat", [batch, b.const(np.array([-1], np.int64))], axis=0)
    float_model = b.model([b.gemm(b.node("Reshape", [h, shape]), 8, 4)])
    model = legalize_model(quantize(float_model), "xint8_int32_bias").model
    data = random_inputs(float_model, 16)
    (got,) = simulate(model, data, "xint8_int32_bias", rounding="onnx", quiet=True).values()
    np.testing.assert_array_equal(got, ort_run(model, data)[0])


@pytest.mark.parametrize("positions", [(4, 2), (2, 4), (3, 3)])
def test_a_tensor_quantized_twice_is_requantized(positions: tuple[int, int]) -> None:
    """A QuantizeLinear reading a DequantizeLinear (quant_torch_fx writes one before the
    Slice of a Concat's output) moves the codes to the second position, rounded once as
    onnxruntime rounds them; the simulator used to fail with a KeyError on it."""
    first, second = positions
    w = QDQWriter()
    twice = w.quantize(w.quantize(w.op("Relu", [w.quantize("x", 5)], "relu"), first), second)
    y = w.op("MaxPool", [twice], "pool", kernel_shape=[2, 2])
    model = w.model([("x", ["N", 2, 4, 4])], [w.quantize(y, second)])
    x = np.random.default_rng(0).normal(size=(64, 2, 4, 4)).astype(np.float32) * 3
    (got,) = simulate(model, x, rounding="onnx", quiet=True).values()
    np.testing.assert_array_equal(got, ort_run(model, x)[0])


def test_a_result_quantized_at_two_positions_is_rounded_once_for_each() -> None:
    """quant_onnx writes a second QuantizeLinear of a float result for a layer with its
    own input requantization; each tensor is the exact result rounded once (not the first
    tensor's codes rounded again), as onnxruntime computes them. It used to be a KeyError."""
    w = QDQWriter()
    conv = w.op("Conv", [w.quantize("x", 5), w.constant(np.arange(-8, 10, dtype=np.int8).reshape(2, 1, 3, 3), 4)],
                "conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=2)  # fmt: skip
    a = w.op("MaxPool", [w.quantize(conv, 3)], "pool", kernel_shape=[2, 2])
    b = w.op("MaxPool", [w.quantize(conv, 1)], "pool2", kernel_shape=[2, 2])
    model = w.model([("x", ["N", 2, 4, 4])], [w.quantize(a, 3), w.quantize(b, 1)])
    x = np.random.default_rng(0).normal(size=(64, 2, 4, 4)).astype(np.float32) * 3
    got = simulate(model, x, rounding="onnx", quiet=True)
    for output, expected in zip(got.values(), ort_run(model, x), strict=True):
        np.testing.assert_array_equal(output, expected)


@pytest.mark.parametrize("shape", [[4, 8], [4, 2, 4, 4]])
def test_global_average_pool_averages_every_spatial_axis(shape: list[int]) -> None:
    """GlobalAveragePool of a 3-D or 5-D input averages axes 2 on (as onnxruntime does; a
    power-of-two count is exact); the kernel used to average the last two axes, so a 3-D
    input lost its channels."""
    b = GraphBuilder(3)
    float_model = b.model([b.node("GlobalAveragePool", [b.input("x", ["N", *shape])])], rank=len(shape) + 1)
    model = legalize_model(quantize(float_model), "xint8").model
    x = random_inputs(float_model, 16)
    (got,) = simulate(model, x, rounding="onnx", quiet=True).values()
    np.testing.assert_array_equal(got, ort_run(model, x)[0])


def test_errors_name_the_node() -> None:
    w = QDQWriter()
    y = w.op("Relu", [w.quantize("x", 0, scale=0.3)], "relu")
    with pytest.raises(ModelError, match=r"node 'relu' \(Relu\): q\d+: int8 scale 0\.3 has no fix position; run quant"):
        NPUSimulator(w.model([("x", [1, 4])], [w.quantize(y, 4)]))
    w = QDQWriter()
    y = w.op("Sin", [w.quantize("x", 4)], "sin")
    with pytest.raises(ModelError, match="node 'sin' \\(Sin\\): no integer kernel for Sin"):
        NPUSimulator(w.model([("x", [1, 4])], [w.quantize(y, 4)]))
    w = QDQWriter()
    y = w.op("Relu", [w.quantize("x", 4)], "relu")
    z = w.op("Relu", [y], "relu2")  # float edge: relu writes a float tensor
    with pytest.raises(ModelError, match="node 'relu' \\(Relu\\): an input or output is not quantized"):
        NPUSimulator(w.model([("x", [1, 4])], [w.quantize(z, 4)]))
    simulator = NPUSimulator(legal(conv_chain))
    with pytest.raises(DataError, match="data: input 'x' is missing"):
        simulator.run({"y": np.zeros((1, 3, 8, 8), np.float32)}, quiet=True)
    with pytest.raises(ConfigError, match="batch_size: 0 is out of range"):
        simulator.run(np.zeros((1, 3, 8, 8), np.float32), batch_size=0, quiet=True)
    with pytest.raises(DataError, match=r"data: input 'x' expected shape \[N,3,8,8\] got \[1, 3, 8, 9\]"):
        simulator.run(np.zeros((1, 3, 8, 9), np.float32), quiet=True)
    with pytest.raises(DataError, match="data: input 'x' has dtype <U1; allowed: real numbers"):
        simulator.run(np.array(["a"]), quiet=True)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (np.zeros((0, 3, 8, 8), np.float32), "data: input 'x' has no samples"),
        (np.full((2, 3, 8, 8), np.nan, np.float32), "data: input 'x' contains NaN"),
        (np.full((2, 3, 8, 8), -np.inf), "data: input 'x' contains Inf"),
        (np.ones((2, 3, 8, 8), bool), "data: input 'x' expected dtype float32 got bool"),
        (np.ones((2, 3, 8, 8), np.int64), "data: input 'x' expected dtype float32 got int64"),
        (np.ones((2, 3, 8, 8), np.complex64), "data: input 'x' has dtype complex64; allowed: real numbers"),
    ],
)
def test_data_that_is_not_finite_real_samples_of_the_input_type_is_refused(data, message) -> None:
    with pytest.raises(DataError, match=f"^{re.escape(message)}"):
        NPUSimulator(legal(conv_chain)).run(data, quiet=True)


def test_a_fusion_the_simulator_lacks_is_a_model_error_naming_the_node() -> None:
    # a profile may fuse LeakyRelu into Add; the integer Add kernel only clamps (Relu, Clip)
    w = QDQWriter()
    added = w.op("Add", [w.quantize("x", 4), w.quantize("x", 4)], "add")
    y = w.op("LeakyRelu", [w.quantize(added, 4)], "leaky", alpha=0.1)
    fields = get_profile("xint8").to_dict()
    fields["fusions"] = {**fields["fusions"], "Add": ["Relu", "LeakyRelu"]}
    with pytest.raises(ModelError, match=r"node 'add' \(Add\): a fused LeakyRelu is not simulated after Add/Sub"):
        NPUSimulator(w.model([("x", [1, 4])], [w.quantize(y, 4)]), NPUProfile.from_dict(fields))


def test_ops_outside_the_target_are_noted() -> None:
    w = QDQWriter()
    y = w.op("Sigmoid", [w.quantize("x", 4)], "sig")
    simulator = NPUSimulator(w.model([("x", [1, 4])], [w.quantize(y, 7)]))
    assert simulator.notes == ("node 'sig': Sigmoid is not an op of target 'xint8'",)
    x = np.linspace(-4, 4, 8, dtype=np.float32).reshape(2, 4)
    (got,) = simulator.run(x, quiet=True).values()
    assert np.abs(got - 1 / (1 + np.exp(-x))).max() <= 1 / 128 + 1 / 32  # table, one rounding; input at 2**-4


@pytest.mark.parametrize("build", [conv_chain, mobile_block])
def test_the_blas_thread_count_follows_the_load_and_changes_no_output(build, monkeypatch) -> None:
    """While the machine is busy the simulator's products run on one BLAS thread (beside
    other work OpenBLAS's threads wait on each other); they are exact, so the outputs are
    the same bits on one thread or several."""
    from threadpoolctl import threadpool_info

    import quant_npu.sim.threads as threads

    model = legal(build)
    x = random_inputs(build(), 48, seed=15)
    simulator = NPUSimulator(model)
    seen: list[int] = []
    run_batch = simulator.run_batch

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(min((i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"), default=1))
        return run_batch(*args, **kwargs)

    monkeypatch.setattr(simulator, "run_batch", recording)
    outputs = {}
    for busy in (False, True):
        monkeypatch.setattr(threads, "machine_is_busy", lambda busy=busy: busy)
        seen.clear()
        (outputs[busy],) = simulator.run(x, batch_size=16, quiet=True).values()
        if busy:
            assert seen and set(seen) == {1}
    np.testing.assert_array_equal(outputs[True], outputs[False])
