"""The bias rule's int32 accumulator headroom (quant_core.bias).

An integer kernel adds ``sum (x - zx) * (w - zw)`` to the int32 bias codes in an int32
accumulator that wraps: a bias fitted only to int32 turned a +996083 output into -996083 in
onnxruntime's QLinearConv. The property tested: after :func:`fit_weight_to_bias` with the
layer's :func:`accumulation_headroom`, the worst case an adversarial input can drive the
accumulator to stays inside int32, computed exactly in int64 from the real codes.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from quant_core.bias import (
    DEFAULT_HEADROOM,
    MIN_BIAS_BUDGET,
    BiasRule,
    accumulation_headroom,
    encode_bias,
    fit_weight_to_bias,
)
from quant_core.qparams import QParams, quantize
from quant_core.spec import QuantSpec
from quant_core.weights import constant_qparams

INT32_MAX = int(np.iinfo(np.int32).max)
U8_RELU = QParams.per_tensor(0.02, 0, "uint8")  # codes 0..255 around zero point 0: the widest reach
U8_MID = QParams.per_tensor(0.02, 128, "uint8")
W8 = QParams.per_tensor(0.01, 0, "int8")


def _worst_accumulator(bias_codes: np.ndarray, w_codes: np.ndarray, w_zp: np.ndarray, x_qp: QParams) -> np.ndarray:
    """Per output channel (axis 0 of ``w_codes``), the largest ``|bias + sum (x - zx)(w - zw)|``
    any input can reach: each ``x`` at whichever end of its range pushes the sum away from 0
    in the bias's direction. Exact, in int64."""
    zx = int(np.asarray(x_qp.zero_point))
    hi, lo = x_qp.qmax - zx, x_qp.qmin - zx
    w = w_codes.reshape(w_codes.shape[0], -1).astype(np.int64) - np.asarray(w_zp, np.int64).reshape(-1, 1)
    push_up = np.where(w > 0, hi * w, lo * w).sum(axis=1)
    push_down = np.where(w > 0, lo * w, hi * w).sum(axis=1)
    b = bias_codes.astype(np.int64).reshape(-1)
    return np.maximum(np.abs(b + push_up), np.abs(b + push_down))


@st.composite
def layers(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, QParams, QParams, bool]:
    """(weight [Cout, Cin, kh, kw], bias [Cout], input qparams, weight qparams, pow2)."""
    cout = draw(st.integers(1, 4))
    cin = draw(st.integers(1, 64))
    k = draw(st.sampled_from([1, 3, 5]))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((cout, cin, k, k)) * draw(st.sampled_from([1e-9, 1e-3, 0.3]))).astype(np.float32)
    # Biases from ordinary to far past what int32 holds at input_scale * weight_scale.
    magnitude = draw(st.lists(st.floats(-3.0, 9.0), min_size=cout, max_size=cout))
    signs = rng.choice([-1.0, 1.0], cout)
    bias = (signs * 10.0 ** np.asarray(magnitude)).astype(np.float32)
    zero_point = draw(st.sampled_from([0, 128, 37, 255]))
    x_qp = QParams.per_tensor(draw(st.sampled_from([2.0**-7, 0.02, 0.3])), zero_point, "uint8")
    pow2 = draw(st.booleans())
    symmetric = pow2 or draw(st.booleans())
    spec = QuantSpec(
        dtype="int8",
        symmetric=symmetric,
        per_channel_axis=0 if draw(st.booleans()) else None,
        scale_type="power_of_two" if pow2 else "float",
        narrow_range=symmetric and draw(st.booleans()),
    )
    return weight, bias, x_qp, constant_qparams(weight, spec), pow2


@given(layers())
def test_fitted_bias_plus_worst_case_products_never_leave_int32(
    layer: tuple[np.ndarray, np.ndarray, QParams, QParams, bool],
) -> None:
    weight, bias, x_qp, w_qp, _ = layer
    room = accumulation_headroom(weight.shape, bias.size, x_qp, w_qp)
    fitted, _ = fit_weight_to_bias(bias, x_qp.scale, w_qp, headroom=room)
    assert np.all(fitted.scale >= w_qp.scale)  # raised, never lowered
    encoded = encode_bias(bias, x_qp.scale, fitted, None, integer_kernel=True, headroom=room)
    assert encoded.rule is BiasRule.PRODUCT and encoded.codes is not None
    w_codes = quantize(weight, fitted)
    zp = np.broadcast_to(np.asarray(fitted.zero_point), (weight.shape[0],))
    worst = _worst_accumulator(encoded.codes, w_codes, zp, x_qp)
    assert worst.max() <= INT32_MAX, (worst.max(), encoded.codes)


@given(layers())
def test_only_channels_whose_bias_crowds_the_accumulator_are_raised_and_just_enough(
    layer: tuple[np.ndarray, np.ndarray, QParams, QParams, bool],
) -> None:
    weight, bias, x_qp, w_qp, pow2 = layer
    room = np.broadcast_to(accumulation_headroom(weight.shape, bias.size, x_qp, w_qp), np.shape(w_qp.scale))
    budget = INT32_MAX - room
    before = np.abs(bias.astype(np.float64)) / (float(x_qp.scale) * w_qp.scale.astype(np.float64))
    if w_qp.scale.ndim == 0:
        before = before.max()
    fitted, note = fit_weight_to_bias(bias, x_qp.scale, w_qp, headroom=room)
    raised = fitted.scale > w_qp.scale
    assert np.all(before[~raised] <= budget[~raised])  # a channel left alone had room
    assert np.all(before[raised] > budget[raised] * (1 - 1e-5))  # a raised one had none
    assert (note is None) == (not raised.any())
    if raised.any():
        after = np.abs(bias.astype(np.float64)) / (float(x_qp.scale) * fitted.scale.astype(np.float64))
        if fitted.scale.ndim == 0:
            after = after.max()
        # Just enough: a float scale leaves the code within a part per 10**5 of the budget; a
        # power-of-two one within a factor of two (one step of its position).
        slack = 0.5 if pow2 else 1 - 1e-5
        assert np.all(after[raised] > slack * budget[raised])


def test_the_reported_layer_no_longer_wraps() -> None:
    # bug_bias_int32_overflow.py: a 3x3 Conv over 3 channels (K = 27) with a bias of 1e6 and
    # weights ~0.3 at a8w8. The old fit left the code 2400 below 2**31 - 1; the worst case of
    # 27 products of (255 - zx) x 128 then wrapped.
    rng = np.random.default_rng(0)
    weight = (rng.normal(size=(4, 3, 3, 3)) * 0.3).astype(np.float32)
    bias = np.array([1e6, -1e6, 3.0, 0.0], np.float32)
    x_qp = QParams.per_tensor(0.0306, 116, "uint8")
    w_qp = constant_qparams(weight, QuantSpec(dtype="int8", per_channel_axis=0))
    room = accumulation_headroom(weight.shape, bias.size, x_qp, w_qp)
    assert room.tolist() == [27 * 139 * 128] * 4
    fitted, note = fit_weight_to_bias(bias, x_qp.scale, w_qp, headroom=room)
    assert note is not None and "raised on 2 of 4 channels" in note
    codes = encode_bias(bias, x_qp.scale, fitted, None, integer_kernel=True, headroom=room).codes
    assert codes is not None
    assert np.all(np.abs(codes[:2].astype(np.int64)) + 27 * 139 * 128 <= INT32_MAX)
    assert np.all(np.abs(codes[:2]) > INT32_MAX - 27 * 139 * 128 - 5000)  # and no coarser than needed
    assert np.array_equal(fitted.scale[2:], w_qp.scale[2:])
    worst = _worst_accumulator(codes, quantize(weight, fitted), np.zeros(4, np.int64), x_qp)
    assert worst.max() <= INT32_MAX


@pytest.mark.parametrize(
    ("shape", "outputs", "x_qp", "w_qp", "expected"),
    [
        ((64, 32, 3, 3), 64, U8_RELU, W8, 288 * 255 * 128),  # Conv: Cin x kh x kw
        ((32, 1, 3, 3), 32, U8_MID, W8, 9 * 128 * 128),  # depthwise: 9 products per output
        ((512, 10), 10, U8_MID, W8, 512 * 128 * 128),  # Gemm transB=0 / MatMul [K, N]
        ((10, 512), 10, U8_MID, W8, 512 * 128 * 128),  # Gemm transB=1 [N, K]
        ((10, 512), 1, U8_MID, W8, 5120 * 128 * 128),  # a broadcast bias: every element counted
        ((8, 4), 4, U8_MID, QParams.per_tensor(0.01, 0, "int8", narrow_range=True), 8 * 128 * 127),
        ((8, 4), 4, QParams.per_tensor(0.1, 0, "int8"), W8, 8 * 128 * 128),  # int8 input around 0
        ((8, 4), 4, U8_MID, QParams.per_tensor(0.01, 100, "uint8"), 8 * 128 * 255),  # asymmetric: any zp
    ],
)
def test_accumulation_headroom_is_products_times_reaches(
    shape: tuple[int, ...], outputs: int, x_qp: QParams, w_qp: QParams, expected: int
) -> None:
    assert float(accumulation_headroom(shape, outputs, x_qp, w_qp)) == expected


def test_accumulation_headroom_is_per_channel_for_per_channel_weights() -> None:
    w_qp = QParams(np.full(3, 0.01, np.float32), np.zeros(3, np.int64), W8.dtype, axis=0)
    room = accumulation_headroom((3, 2, 1, 1), 3, U8_MID, w_qp)
    assert room.shape == (3,) and room.tolist() == [2 * 128 * 128] * 3


def test_without_headroom_the_fit_reserves_the_default() -> None:
    fitted, note = fit_weight_to_bias(np.array([1e9], np.float32), 1.0, QParams.per_tensor(1e-9, 0, "int8"))
    code = encode_bias(np.array([1e9], np.float32), 1.0, fitted, None, integer_kernel=True).codes
    assert note is not None and code is not None
    assert INT32_MAX - DEFAULT_HEADROOM - 5000 < abs(int(code[0])) <= INT32_MAX - DEFAULT_HEADROOM


def test_a_bias_that_fits_with_its_headroom_keeps_its_weight_scale() -> None:
    w_qp = QParams.per_tensor(0.01, 0, "int8")
    room = accumulation_headroom((16, 8), 16, U8_MID, w_qp)
    assert fit_weight_to_bias(np.full(16, 2.0, np.float32), 0.02, w_qp, headroom=room) == (w_qp, None)


def test_products_that_alone_reach_int32_leave_the_bias_its_floor_and_say_so() -> None:
    # 2**18 products of 128 x 128 reach 2**32 by themselves: no weight scale covers that.
    w_qp = QParams.per_tensor(1e-6, 0, "int8")
    room = accumulation_headroom((2**18, 1), 1, U8_MID, w_qp)
    assert float(room) > INT32_MAX
    fitted, note = fit_weight_to_bias(np.array([1e3], np.float32), 1e-3, w_qp, headroom=room)
    assert note is not None and f"keeps {MIN_BIAS_BUDGET} codes" in note
    code = encode_bias(np.array([1e3], np.float32), 1e-3, fitted, None, integer_kernel=True, headroom=room).codes
    assert code is not None and MIN_BIAS_BUDGET * 0.99 < abs(int(code[0])) <= MIN_BIAS_BUDGET


def test_encode_with_headroom_refuses_a_bias_the_fit_did_not_make_room_for() -> None:
    # A weight scale fitted with no headroom (the old rule) leaves the code at the int32 edge:
    # fine for int32 alone, float once the layer's products are counted.
    bias = np.array([5.0], np.float32)
    fitted, _ = fit_weight_to_bias(bias, 0.02, QParams.per_tensor(1e-12, 0, "int8"), headroom=0)
    room = accumulation_headroom((64, 1), 1, U8_MID, fitted)
    assert encode_bias(bias, 0.02, fitted, None, integer_kernel=True).rule is BiasRule.PRODUCT
    refused = encode_bias(bias, 0.02, fitted, None, integer_kernel=True, headroom=room)
    assert refused.rule is BiasRule.FLOAT and refused.note is not None and "products" in refused.note
    # Layers no integer kernel reads have no int32 accumulator: the headroom does not apply.
    kept = encode_bias(bias, 0.02, fitted, None, integer_kernel=False, headroom=room)
    assert kept.rule is BiasRule.PRODUCT


@pytest.mark.parametrize("bad", [-1.0, np.inf, np.nan])
def test_headroom_must_be_finite_and_non_negative(bad: float) -> None:
    with pytest.raises(ValueError, match=r"^headroom: .* allowed: finite values >= 0"):
        fit_weight_to_bias(np.array([1.0], np.float32), 0.02, W8, headroom=bad)
    with pytest.raises(ValueError, match=r"^headroom: "):
        encode_bias(np.array([1.0], np.float32), 0.02, W8, None, integer_kernel=True, headroom=bad)
