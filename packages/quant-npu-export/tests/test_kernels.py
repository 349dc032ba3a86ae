"""Integer kernels against independent references: onnx.reference on exact small
integers for the data movement and accumulation, exact rationals for every rounding."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator

from quant_core.spec import RoundMode
from quant_npu.profile import NPUProfile
from quant_npu.sim.elementwise import (
    ActivationKernel,
    AddKernel,
    DivKernel,
    HardSigmoidKernel,
    HardSwishKernel,
    MulKernel,
    SoftmaxKernel,
    TableKernel,
    Tabulated,
)
from quant_npu.sim.epilogue import Activation, Epilogue
from quant_npu.sim.linear import ConvKernel, MatMulKernel, accumulator_bound, float32_blocks
from quant_npu.sim.movement import MOVES, pad
from quant_npu.sim.pool import AveragePoolKernel, GlobalAveragePoolKernel, MaxPoolKernel
from quant_npu.sim.spatial import Geometry

UP, EVEN = RoundMode.HALF_UP, RoundMode.HALF_EVEN
I8 = (-128, 127)
RNG = np.random.default_rng(0)


def exact_round(value: Fraction, mode: RoundMode) -> int:
    floor = math.floor(value)
    rest = value - floor
    if rest != Fraction(1, 2):
        return floor + (rest > Fraction(1, 2))
    return floor + 1 if mode is UP or floor % 2 else floor


def saturate(value: int, lo: int = -128, hi: int = 127) -> int:
    return max(lo, min(hi, value))


def reference(op: str, inputs: list[np.ndarray], **attrs: object) -> np.ndarray:
    names = [f"i{k}" if v is not None else "" for k, v in enumerate(inputs)]
    node = helper.make_node(op, names, ["y"], **attrs)
    feeds = {n: v for n, v in zip(names, inputs, strict=True) if n}
    return ReferenceEvaluator(node).run(None, feeds)[0]


def identity_epilogue(bound: float) -> Epilogue:
    return Epilogue(acc_pos=0, out_pos=0, mode=EVEN, out_range=(-(2**40), 2**40), acc_bound=bound)


CONV_CASES = [
    ({"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}, 1, (6, 5)),
    ({"kernel_shape": [3, 3], "strides": [2, 2], "pads": [0, 1, 1, 0]}, 1, (6, 5)),
    ({"kernel_shape": [3, 3], "dilations": [2, 2], "pads": [2, 2, 2, 2]}, 1, (6, 4)),
    ({"kernel_shape": [2, 2], "auto_pad": "SAME_UPPER", "strides": [2, 2]}, 1, (4, 4)),
    ({"kernel_shape": [3, 3], "auto_pad": "SAME_LOWER"}, 1, (4, 4)),
    ({"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "group": 2}, 2, (6, 4)),
    ({"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "group": 6}, 6, (6, 6)),
    ({"kernel_shape": [5, 5], "strides": [2, 2], "pads": [2, 2, 2, 2], "group": 6}, 6, (6, 6)),
    ({"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "group": 3}, 3, (3, 6)),  # depth multiplier 2
    ({"kernel_shape": [1, 1]}, 1, (6, 7)),
    # many channels per group: channels-last columns (the rows above gather NCHW planes)
    ({"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}, 1, (20, 5)),
    ({"kernel_shape": [3, 3], "strides": [2, 2], "dilations": [2, 2], "pads": [2, 1, 2, 0], "group": 2}, 2, (36, 4)),
    ({"kernel_shape": [1, 1], "strides": [2, 2]}, 1, (18, 3)),
    # mostly padding: tap by tap over the image pixels
    ({"kernel_shape": [3, 3], "dilations": [3, 3], "pads": [3, 3, 3, 3]}, 1, (16, 4)),
    ({"kernel_shape": [3, 3], "strides": [2, 2], "dilations": [2, 2], "pads": [2, 1, 2, 0]}, 1, (17, 3)),
    ({"kernel_shape": [2, 2], "auto_pad": "SAME_UPPER", "strides": [2, 2]}, 1, (16, 4)),
]


@pytest.mark.parametrize(("attrs", "group", "channels"), CONV_CASES)
def test_conv_accumulates_exactly(attrs: dict, group: int, channels: tuple[int, int]) -> None:
    cin, cout = channels
    x = RNG.integers(-128, 128, (3, cin, 7, 6)).astype(np.int8)
    w = RNG.integers(-127, 128, (cout, cin // group, *attrs["kernel_shape"]))
    expected = reference("Conv", [x.astype(np.float64), w.astype(np.float64)], **attrs)
    kernel = ConvKernel(w, group, Geometry.from_node_attributes(attrs, w.shape[2:]), identity_epilogue(1e9), 128)
    np.testing.assert_array_equal(kernel.accumulate(x), expected)
    # channels-last memory (what a depthwise output hands on) gives the same sums
    x_last = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    np.testing.assert_array_equal(kernel.accumulate(x_last), expected)


def test_accumulator_bound_picks_float64_when_float32_could_round() -> None:
    w = np.full((2, 1024, 3, 3), 127)
    assert accumulator_bound(w, 128) == 128 * 127 * 1024 * 9
    kernel = ConvKernel(w, 1, Geometry((3, 3)), identity_epilogue(1e12), 128)
    x = np.full((1, 1024, 3, 3), 127, np.int8)
    assert kernel.accumulate(x).dtype == np.float64
    assert kernel.accumulate(x)[0, 0, 0, 0] == 127 * 127 * 1024 * 9  # above 2**24, exact


def test_mostly_padded_convolutions_run_tap_by_tap(monkeypatch: pytest.MonkeyPatch) -> None:
    attrs = {"kernel_shape": [3, 3], "dilations": [4, 4], "pads": [4, 4, 4, 4]}
    w = RNG.integers(-127, 128, (5, 24, 3, 3))
    x = RNG.integers(-128, 128, (2, 24, 6, 5)).astype(np.int8)
    kernel = ConvKernel(w, 1, Geometry.from_node_attributes(attrs, (3, 3)), identity_epilogue(1e9), 128)
    monkeypatch.setattr(kernel, "_im2col", lambda _x: pytest.fail("im2col on a mostly padded convolution"))
    got = kernel.accumulate(x)
    expected = reference("Conv", [x.astype(np.float64), w.astype(np.float64)], **attrs)
    np.testing.assert_array_equal(got, expected)


def test_float32_blocks_stay_exact_above_two_to_the_24() -> None:
    w = RNG.integers(-127, 128, (3, 600, 3, 3))
    w[0] = 127  # the channel whose sum sets the bound
    kernel = ConvKernel(w, 1, Geometry((3, 3)), identity_epilogue(1e12), 128)
    assert kernel.dtype == np.float64 and kernel.blocks is not None and len(kernel.blocks) > 1
    rows = np.abs(kernel.matrices.astype(np.float64)) * 128
    for block in kernel.blocks:  # every block's partial sums are float32-exact
        assert rows[:, block].sum(axis=1).max() < 2**24
    x = np.full((2, 600, 3, 3), 127, np.int8)
    x[1] = RNG.integers(-128, 128, (600, 3, 3))
    expected = np.einsum("nchw,mchw->nm", x.astype(np.int64), w.astype(np.int64))
    got = kernel.accumulate(x)
    assert got.dtype == np.float64 and abs(float(got[0, 0, 0, 0])) > 2**24
    np.testing.assert_array_equal(got[:, :, 0, 0], expected)
    assert float32_blocks(np.full((1, 4, 1), 2**20), 2**4) is None  # one row reaches 2**24
    padded = ConvKernel(w, 1, Geometry((3, 3), pads=(1, 1, 1, 1)), identity_epilogue(1e12), 128)
    assert padded.taps_exact  # tap by tap: float32 products per tap, summed in float64
    expected = reference("Conv", [x.astype(np.float64), w.astype(np.float64)], pads=[1, 1, 1, 1])
    np.testing.assert_array_equal(padded.accumulate(x), expected)


def epilogue_reference(acc: int, acc_pos: int, bias: int, bias_pos: int, activation: Activation | None,
                       out_pos: int, mode: RoundMode) -> int:  # fmt: skip
    value = Fraction(acc, 2**acc_pos) + Fraction(bias) / Fraction(2) ** bias_pos
    if activation is not None:
        if activation.kind == "leaky":
            value = value if value >= 0 else value * Fraction(activation.numerator, 2**activation.bits)
        else:
            lo, hi = activation.bounds
            value = max(value, Fraction(lo)) if math.isfinite(lo) else value
            value = min(value, Fraction(hi)) if math.isfinite(hi) else value
    return saturate(exact_round(value * Fraction(2) ** out_pos, mode))


@pytest.mark.parametrize("mode", [UP, EVEN])
@pytest.mark.parametrize(
    "activation",
    [None, Activation("relu"), Activation("clip", lo=0.0, hi=6.0), Activation("clip", lo=-0.3, hi=0.7),
     Activation("leaky", numerator=26, bits=8)],
)  # fmt: skip
@pytest.mark.parametrize(("acc_pos", "bias_pos", "out_pos"), [(9, 5, 4), (6, 9, 3), (10, 10, -1), (4, 2, 6)])
def test_epilogue_rounds_once(mode: RoundMode, activation: Activation | None, acc_pos: int, bias_pos: int,
                              out_pos: int) -> None:  # fmt: skip
    acc = RNG.integers(-20000, 20000, (200, 3)).astype(np.float32)
    bias = RNG.integers(-128, 128, 3)
    epilogue = Epilogue(acc_pos=acc_pos, out_pos=out_pos, mode=mode, out_range=I8, bias=bias, bias_pos=bias_pos,
                        activation=activation, channel_axis=1, acc_bound=20000, ndim=2)  # fmt: skip
    got = epilogue(acc)
    for i in range(0, 200, 7):
        for c in range(3):
            expected = epilogue_reference(int(acc[i, c]), acc_pos, int(bias[c]), bias_pos, activation, out_pos, mode)
            assert got[i, c] == expected, (i, c)


def test_epilogue_per_channel_positions() -> None:
    acc = RNG.integers(-5000, 5000, (50, 4)).astype(np.float64)
    acc_pos, bias_pos = np.array([8, 9, 10, 7]), np.array([4, 12, 6, 7])
    bias = RNG.integers(-128, 128, 4)
    epilogue = Epilogue(acc_pos=acc_pos, out_pos=3, mode=UP, out_range=I8, bias=bias, bias_pos=bias_pos,
                        channel_axis=1, acc_bound=5000, ndim=2)  # fmt: skip
    got = epilogue(acc)
    for i in range(50):
        for c in range(4):
            expected = epilogue_reference(int(acc[i, c]), int(acc_pos[c]), int(bias[c]), int(bias_pos[c]), None, 3, UP)
            assert got[i, c] == expected


def test_gemm_matmul_kernel() -> None:
    x = RNG.integers(-128, 128, (5, 7)).astype(np.int8)
    w = RNG.integers(-127, 128, (7, 4))
    kernel = MatMulKernel(w, identity_epilogue(1e9), 128)
    np.testing.assert_array_equal(kernel(x), x.astype(np.int64) @ w)


@pytest.mark.parametrize(
    "attrs",
    [
        {"kernel_shape": [2, 2], "strides": [2, 2]},
        {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
        {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1},
        {"kernel_shape": [2, 2], "dilations": [2, 2]},
    ],
)
def test_max_pool(attrs: dict) -> None:
    x = RNG.integers(-128, 128, (2, 3, 7, 7)).astype(np.int8)
    expected = reference("MaxPool", [x.astype(np.float32)], **attrs)
    kernel = MaxPoolKernel(Geometry.from_node_attributes(attrs, attrs["kernel_shape"]), 0, UP, I8, I8)
    np.testing.assert_array_equal(kernel(x), expected)
    halved = MaxPoolKernel(Geometry.from_node_attributes(attrs, attrs["kernel_shape"]), 1, UP, I8, I8)(x)
    np.testing.assert_array_equal(halved, np.floor(expected / 2 + 0.5))


@pytest.mark.parametrize("mode", [UP, EVEN])
@pytest.mark.parametrize(("kernel", "pads"), [((3, 3), [1, 1, 1, 1]), ((2, 2), [0, 0, 0, 0]), ((5, 5), [2, 2, 2, 2])])
def test_average_pool_uses_the_device_factor(mode: RoundMode, kernel: tuple[int, int], pads: list[int]) -> None:
    profile = NPUProfile()
    x = RNG.integers(-128, 128, (2, 3, 6, 6)).astype(np.int8)
    attrs = {"kernel_shape": list(kernel), "pads": pads, "count_include_pad": 1}
    sums = np.rint(reference("AveragePool", [x.astype(np.float64)], **attrs) * kernel[0] * kernel[1]).astype(int)
    geometry = Geometry.from_node_attributes(attrs, kernel)
    got = AveragePoolKernel(geometry, profile, shift=-1, mode=mode, out_range=I8)(x)
    from quant_npu.approximations import average_pool_factor

    n, m = average_pool_factor(*kernel, profile)
    expected = np.vectorize(lambda s: saturate(exact_round(Fraction(int(s) * n * 2, 2**m), mode)))(sums)
    np.testing.assert_array_equal(got, expected)


def test_global_average_pool_single_and_two_stages() -> None:
    profile = NPUProfile(global_pool_max_elements=16)
    x = RNG.integers(-128, 128, (2, 3, 4, 4)).astype(np.int8)
    one = GlobalAveragePoolKernel(NPUProfile(), 0, UP, I8)(x)
    np.testing.assert_array_equal(one[..., 0, 0], [[exact_round(Fraction(int(v), 16), UP) for v in c] for c in
                                                   x.reshape(2, 3, 16).sum(-1)])  # fmt: skip
    wide = RNG.integers(-128, 128, (1, 2, 5, 6)).astype(np.int8)
    two = GlobalAveragePoolKernel(profile, 0, EVEN, I8, keepdims=False)(wide)
    from quant_npu.approximations import average_pool_factor

    (nw, mw), (nh, mh) = average_pool_factor(1, 6, profile), average_pool_factor(5, 1, profile)
    for c in range(2):
        rows = [saturate(exact_round(Fraction(int(r.sum()) * nw, 2**mw), EVEN)) for r in wide[0, c]]
        assert two[0, c] == saturate(exact_round(Fraction(sum(rows) * nh, 2**mh), EVEN))


def test_add_sub_mul_div() -> None:
    a = RNG.integers(-128, 128, 300).astype(np.int8)
    b = RNG.integers(-128, 128, 300).astype(np.int8)
    add = AddKernel((5, 2), 3, UP, I8)(a, b)
    sub = AddKernel((5, 2), 3, EVEN, I8, subtract=True, activation=Activation("relu"))(a, b)
    mul = MulKernel((5, 4), 6, UP, I8)(a, b)
    div = DivKernel((5, 4), 3, EVEN, I8)(a, b)
    for i in range(300):
        va, vb = Fraction(int(a[i]), 32), Fraction(int(b[i]), 4)
        assert add[i] == saturate(exact_round((va + vb) * 8, UP))
        assert sub[i] == saturate(exact_round(max(va - vb, Fraction(0)) * 8, EVEN))
        assert mul[i] == saturate(exact_round(va * Fraction(int(b[i]), 16) * 64, UP))
        if b[i] != 0:
            assert div[i] == saturate(exact_round(va / Fraction(int(b[i]), 16) * 8, EVEN))


def test_standalone_activations() -> None:
    x = np.arange(-128, 128, dtype=np.int8)
    leaky = ActivationKernel(Activation("leaky", numerator=26, bits=8), 4, 4, UP, I8)(x)
    clip = ActivationKernel(Activation("clip", lo=0.0, hi=6.0), 4, 3, EVEN, I8)(x)
    for q in range(-128, 128):
        value = Fraction(q, 16)
        slope = value if value >= 0 else value * Fraction(26, 256)
        assert leaky[q + 128] == saturate(exact_round(slope * 16, UP))
        assert clip[q + 128] == saturate(exact_round(min(max(value, Fraction(0)), Fraction(6)) * 8, EVEN))


@pytest.mark.parametrize("in_pos", [0, 4, 7, -1])
def test_hard_sigmoid_and_swish(in_pos: int) -> None:
    profile = NPUProfile()
    x = np.arange(-128, 128, dtype=np.int8)
    sigmoid = HardSigmoidKernel(profile, in_pos, 7, UP, I8)(x)
    swish = HardSwishKernel(profile, in_pos, 4, UP, I8)(x)
    for q in range(-128, 128):
        value = Fraction(q) / Fraction(2) ** in_pos
        h = min(max(value + 3, Fraction(0)), Fraction(6)) * Fraction(2731, 16384)
        h_code = saturate(exact_round(h * 128, UP))
        assert sigmoid[q + 128] == h_code
        assert swish[q + 128] == saturate(exact_round(value * Fraction(h_code, 128) * 16, UP))


@pytest.mark.parametrize("dtype", [np.int8, np.int16])
def test_tabulated_kernels_equal_the_kernels(dtype: type) -> None:
    profile = NPUProfile()
    info = np.iinfo(dtype)
    x = np.concatenate([np.arange(-128, 128), RNG.integers(info.min, int(info.max) + 1, 2999)]).astype(dtype)
    x[:2] = info.min, info.max
    out = (-(2**15), 2**15 - 1)
    kernels = [
        HardSigmoidKernel(profile, 3, 7, UP, I8),
        HardSwishKernel(profile, 5, 4, EVEN, out),
        ActivationKernel(Activation("leaky", numerator=26, bits=8), 4, 2, UP, out),
        ActivationKernel(Activation("clip", lo=0.0, hi=6.0), 4, 3, EVEN, I8),
    ]
    for kernel in kernels:
        table = Tabulated(kernel)
        got = table(x.reshape(3, -1))
        np.testing.assert_array_equal(got, kernel(x.reshape(3, -1)))
        assert got.dtype == kernel(x[:1]).dtype
        wide = x.astype(np.int64)  # no table for wider codes: the kernel itself
        np.testing.assert_array_equal(table(wide), kernel(wide))


def test_table_and_softmax() -> None:
    x = np.arange(-128, 128, dtype=np.int8)
    tanh = TableKernel(np.tanh, 5, 7, UP, I8, I8)(x)
    np.testing.assert_array_equal(tanh, np.clip(np.floor(np.tanh(x / 32.0) * 128 + 0.5), -128, 127))
    logits = RNG.integers(-128, 128, (20, 10)).astype(np.int8)
    probabilities = SoftmaxKernel(-1, 4, 7, EVEN, I8, I8)(logits).astype(np.float64) / 128
    exact = np.exp(logits / 16.0) / np.exp(logits / 16.0).sum(-1, keepdims=True)
    assert np.abs(probabilities - exact).max() <= 1.5 / 128


@pytest.mark.parametrize(
    ("op", "params", "attrs"),
    [
        ("Reshape", [np.array([0, -1])], {}),
        ("Flatten", [], {"axis": 2}),
        ("Transpose", [], {"perm": [0, 2, 3, 1]}),
        ("Squeeze", [np.array([1])], {}),
        ("Unsqueeze", [np.array([0, -1])], {}),
        ("Slice", [np.array([1, -3]), np.array([3, 100]), np.array([2, 3]), np.array([1, 2])], {}),
        ("Slice", [np.array([-1]), np.array([-(2**62)]), np.array([3]), np.array([-2])], {}),
        ("Resize", [None, np.array([1, 1, 2, 3], np.float32)], {"mode": "nearest"}),
        ("Resize", [None, np.array([1, 1, 0.5, 2.5], np.float32)],
         {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}),
        ("Resize", [None, None, np.array([2, 1, 5, 7])],
         {"mode": "nearest", "coordinate_transformation_mode": "align_corners", "nearest_mode": "round_prefer_ceil"}),
    ],
)  # fmt: skip
def test_movement_matches_onnx_reference(op: str, params: list, attrs: dict) -> None:
    x = RNG.integers(-128, 128, (2, 1, 4, 5)).astype(np.int8)
    expected = reference(op, [x.astype(np.float32), *params], **attrs)
    np.testing.assert_array_equal(MOVES[op](x, attrs, params), expected)


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge"])
def test_pad(mode: str) -> None:
    x = RNG.integers(-128, 128, (1, 2, 4, 4)).astype(np.int8)
    pads = np.array([0, 0, 1, 2, 0, 0, 2, 1])
    expected = reference("Pad", [x.astype(np.float32), pads, np.array(3.0, np.float32)], mode=mode)
    np.testing.assert_array_equal(pad(x, {"mode": mode}, [pads], fill=3), expected)
