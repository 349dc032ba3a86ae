"""Hypothesis strategies for valid quant_core specs and configs (shared by tests)."""

from __future__ import annotations

from hypothesis import strategies as st

from quant_core.algorithm_config import (
    ActivationEqualizationConfig,
    AdaQuantConfig,
    AdaRoundConfig,
    BiasCorrectionConfig,
    CLEConfig,
    MixedPrecisionConfig,
    PrecisionTarget,
    SensitivityMetric,
    SmoothQuantConfig,
)
from quant_core.config import CalibrationConfig, OperatorConfig, QuantConfig
from quant_core.dtypes import FLOAT_DTYPES, INTEGER_DTYPES
from quant_core.observer_config import MSE, Entropy, MinMax, MovingAverageMinMax, Percentile, PowerOfTwoMSE
from quant_core.spec import QuantSpec, RoundMode, ScaleType

positive = st.floats(min_value=1e-6, max_value=1e3, allow_nan=False, allow_infinity=False)
unit = st.floats(min_value=0.0, max_value=1.0)
pos_int = st.integers(min_value=1, max_value=10_000)
opt_pos_int = st.none() | pos_int
bins = st.integers(min_value=8, max_value=1 << 15).map(lambda b: 2 * b)
device = st.sampled_from(["cpu", "cuda", "cuda:0", "cuda:3"])
names = st.text(alphabet="abcdefgh/_.*?0123456789", min_size=1, max_size=12)


@st.composite
def observers(draw: st.DrawFn, per_channel: bool, pow2: bool, dynamic: bool) -> object:
    """An observer config valid for a spec with these properties."""
    if dynamic:
        return MinMax()
    options = [st.just(MinMax()), st.builds(MovingAverageMinMax, momentum=st.floats(0.01, 0.99))]
    if not per_channel:
        options += [
            st.builds(Percentile, percentile=st.floats(50.0, 100.0, exclude_min=True), bins=bins),
            bins.flatmap(lambda b: st.builds(Entropy, bins=st.just(b), num_quantized_bins=st.integers(2, b))),
            st.builds(MSE, bins=bins, num_candidates=st.integers(2, 10_000)),
        ]
        if pow2:
            options.append(
                st.builds(PowerOfTwoMSE, bins=bins, search_below=st.integers(0, 16), search_above=st.integers(0, 16))
            )
    return draw(st.one_of(options))


@st.composite
def specs(draw: st.DrawFn, integer_only: bool = False) -> QuantSpec:
    """Any valid QuantSpec."""
    dtypes = INTEGER_DTYPES if integer_only else INTEGER_DTYPES + FLOAT_DTYPES
    dtype = draw(st.sampled_from(dtypes))
    rounding = draw(st.sampled_from(list(RoundMode)))
    if dtype.is_float:
        return QuantSpec(dtype=dtype, rounding=rounding, symmetric=draw(st.booleans()))
    symmetric = draw(st.booleans())
    dynamic = draw(st.booleans())
    axis = None if dynamic else draw(st.none() | st.integers(0, 4))
    scale_type = draw(st.sampled_from(list(ScaleType)))
    return QuantSpec(
        dtype=dtype,
        symmetric=symmetric,
        per_channel_axis=axis,
        scale_type=scale_type,
        rounding=rounding,
        observer=draw(observers(axis is not None, scale_type is ScaleType.POWER_OF_TWO, dynamic)),
        narrow_range=symmetric and draw(st.booleans()),
        dynamic=dynamic,
    )


operator_configs = st.builds(
    OperatorConfig,
    input=st.none() | specs(),
    weight=st.none() | specs(),
    bias=st.none() | specs(),
    output=st.none() | specs(),
)

_algorithm_strategies = [
    st.builds(
        CLEConfig,
        steps=st.integers(0, 10),
        tolerance=positive,
        max_steps=pos_int,
        replace_relu6_with_relu=st.booleans(),
        bias_in_scale=st.booleans(),
        absorb_high_bias=st.booleans(),
    ),
    st.builds(BiasCorrectionConfig, num_samples=opt_pos_int),
    st.builds(SmoothQuantConfig, alpha=unit, num_samples=opt_pos_int),
    st.builds(ActivationEqualizationConfig, num_samples=opt_pos_int),
    st.tuples(positive, positive).flatmap(
        lambda betas: st.builds(
            AdaRoundConfig,
            device=device,
            batch_size=pos_int,
            num_iterations=pos_int,
            learning_rate=positive,
            reg_param=positive,
            beta_start=st.just(max(betas)),
            beta_end=st.just(min(betas)),  # annealed downwards
            warm_start=unit,
            early_stop=st.booleans(),
            num_samples=opt_pos_int,
        )
    ),
    st.builds(
        AdaQuantConfig,
        device=device,
        batch_size=pos_int,
        num_iterations=pos_int,
        learning_rate=positive,
        early_stop=st.booleans(),
        num_samples=opt_pos_int,
    ),
    st.builds(
        MixedPrecisionConfig,
        target_types=st.lists(st.sampled_from(list(PrecisionTarget)), min_size=1, max_size=3).map(tuple),
        metric=st.sampled_from(list(SensitivityMetric)),
        accuracy_target=st.floats(-100, 100),
        size_budget=st.none() | st.floats(1.0, 4.0),
        max_layers=opt_pos_int,
    ),
]


@st.composite
def algorithm_lists(draw: st.DrawFn) -> tuple[object, ...]:
    """Distinct algorithms in a random order."""
    chosen = draw(st.lists(st.integers(0, len(_algorithm_strategies) - 1), unique=True, max_size=6))
    return tuple(draw(_algorithm_strategies[i]) for i in chosen)


quant_configs = st.builds(
    QuantConfig,
    global_config=operator_configs,
    op_type_overrides=st.dictionaries(
        st.sampled_from(["Conv", "Gemm", "MatMul", "Add", "Concat"]), operator_configs, max_size=3
    ),
    name_overrides=st.dictionaries(names, operator_configs, max_size=3),
    exclude=st.lists(names, max_size=3).map(tuple),
    algorithms=algorithm_lists(),
    calibration=st.builds(CalibrationConfig, num_samples=opt_pos_int, batch_size=pos_int),
    name=st.none() | names,
)
