import pytest
from hypothesis import given
from hypothesis import strategies as st

from quant_npu import NPUProfile, check_conv_shifts


@given(st.integers(-10, 20), st.integers(-10, 20), st.integers(-10, 20))
def test_shift_cut_rule_matches_definition(ipos, wpos, opos):
    violations = check_conv_shifts("n", ipos=ipos, wpos=wpos, opos=opos)
    shift_cut = wpos + ipos - opos
    assert (len(violations) == 0) == (0 <= shift_cut <= 16)


def test_shift_bias_lower_bound_depends_on_leaky_relu():
    # shift_cut = 2 -> lower bound min(0, -14) = -14 normally, 0 before a LeakyRelu
    assert check_conv_shifts("n", ipos=1, wpos=1, opos=0, bpos=4) == []
    rules = [v.rule for v in check_conv_shifts("n", ipos=1, wpos=1, opos=0, bpos=4, leaky_relu_follows=True)]
    assert rules == ["shift_bias"]


def test_profile_rejects_unknown_weight_range():
    with pytest.raises(ValueError, match="weight_qmin"):
        NPUProfile(weight_qmin=-100)
