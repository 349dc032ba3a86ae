"""The planner's transformer recipe (quant_core.plan.transformer): which blocks it
recognises and which format each of their tensors gets under the existing presets."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from quant_core.config import QuantConfig
from quant_core.dtypes import DType
from quant_core.observer_config import FixedRange, MinMax
from quant_core.observers import FixedRangeObserver, make_observer
from quant_core.plan import PlanGraph, PlanNode, plan_quantization
from quant_core.plan.transformer import find_blocks, widened
from quant_core.presets import get_preset
from quant_core.qparams import qparams_from_range
from quant_core.serialization import config_from_json, config_to_json
from quant_core.spec import QuantSpec

D = 4
RNG = np.random.default_rng(0)
CONSTANTS: dict[str, np.ndarray] = {
    **{w: RNG.standard_normal((D, D)).astype(np.float32) for w in ("wq", "wk", "wv", "wo", "w1", "w2")},
    **{b: RNG.standard_normal(D).astype(np.float32) for b in ("bo", "b1", "b2", "g1", "g2", "beta1", "beta2")},
    "scale": np.float32(0.5),
    "sqrt2": np.float32(np.sqrt(2.0)),
    "one": np.float32(1.0),
    "half": np.float32(0.5),
    "eps": np.float32(1e-5),
    "two": np.float32(2.0),
    "c3": np.float32(0.044715),
    "k": np.float32(np.sqrt(2.0 / np.pi)),
}


def n(name: str, op: str, inputs: tuple[str, ...], outputs: tuple[str, ...], **attrs: object) -> PlanNode:
    return PlanNode(name, op, inputs, outputs, attrs)


def erf_gelu(x: str, out: str, half_first: bool = False) -> list[PlanNode]:
    core = [n("g_div", "Div", (x, "sqrt2"), ("g_d",)), n("g_erf", "Erf", ("g_d",), ("g_e",)),
            n("g_add", "Add", ("g_e", "one"), ("g_a",))]  # fmt: skip
    if half_first:
        return [*core, n("g_half", "Mul", (x, "half"), ("g_h",)), n("g_mul", "Mul", ("g_h", "g_a"), (out,))]
    return [*core, n("g_mul", "Mul", (x, "g_a"), ("g_m",)), n("g_half", "Mul", ("g_m", "half"), (out,))]


def tanh_gelu(x: str, out: str) -> list[PlanNode]:
    return [n("t_pow", "Pow", (x, "c3_exp"), ("t_p",)), n("t_c", "Mul", ("t_p", "c3"), ("t_c3",)),
            n("t_in", "Add", (x, "t_c3"), ("t_s",)), n("t_k", "Mul", ("t_s", "k"), ("t_ks",)),
            n("t_tanh", "Tanh", ("t_ks",), ("t_t",)), n("t_one", "Add", ("t_t", "one"), ("t_a",)),
            n("t_mul", "Mul", (x, "t_a"), ("t_m",)), n("t_half", "Mul", ("t_m", "half"), (out,))]  # fmt: skip


def tanh_gelu_torch(x: str, out: str) -> list[PlanNode]:
    """torch.onnx's tanh GELU below opset 20: x**3 as two Muls, nine nodes."""
    return [n("t_sq", "Mul", (x, x), ("t_x2",)), n("t_cube", "Mul", (x, "t_x2"), ("t_p",)),
            n("t_c", "Mul", ("t_p", "c3"), ("t_c3",)), n("t_in", "Add", (x, "t_c3"), ("t_s",)),
            n("t_k", "Mul", ("t_s", "k"), ("t_ks",)), n("t_tanh", "Tanh", ("t_ks",), ("t_t",)),
            n("t_one", "Add", ("t_t", "one"), ("t_a",)), n("t_mul", "Mul", (x, "t_a"), ("t_m",)),
            n("t_half", "Mul", ("t_m", "half"), (out,))]  # fmt: skip


def decomposed_ln(x: str, out: str, gamma: str, beta: str, p: str) -> list[PlanNode]:
    return [n(f"{p}_mean", "ReduceMean", (x,), (f"{p}_m",), axes=(-1,)), n(f"{p}_sub", "Sub", (x, f"{p}_m"), (f"{p}_d",)),
            n(f"{p}_pow", "Pow", (f"{p}_d", "two"), (f"{p}_sq",)),
            n(f"{p}_var", "ReduceMean", (f"{p}_sq",), (f"{p}_v",), axes=(-1,)),
            n(f"{p}_eps", "Add", (f"{p}_v", "eps"), (f"{p}_ve",)), n(f"{p}_sqrt", "Sqrt", (f"{p}_ve",), (f"{p}_s",)),
            n(f"{p}_div", "Div", (f"{p}_d", f"{p}_s"), (f"{p}_n",)), n(f"{p}_g", "Mul", (f"{p}_n", gamma), (f"{p}_ng",)),
            n(f"{p}_b", "Add", (f"{p}_ng", beta), (out,))]  # fmt: skip


def layer_norm(x: str, out: str, gamma: str, beta: str, p: str, decomposed: bool) -> list[PlanNode]:
    if decomposed:
        return decomposed_ln(x, out, gamma, beta, p)
    return [n(f"{p}_ln", "LayerNormalization", (x, gamma, beta), (out,))]


def block(decomposed: bool = False, gelu: str = "erf") -> PlanGraph:
    """A pre-norm transformer block: x + attn(ln1(x)), then + mlp(ln2(.)), then a final norm."""
    nodes = [
        *layer_norm("x", "n1", "g1", "beta1", "ln1", decomposed),
        n("q", "MatMul", ("n1", "wq"), ("q",)), n("k", "MatMul", ("n1", "wk"), ("k",)),
        n("v", "MatMul", ("n1", "wv"), ("v",)), n("kt", "Transpose", ("k",), ("kt",), perm=(1, 0)),
        n("qs", "Mul", ("q", "scale"), ("qs",)), n("qk", "MatMul", ("qs", "kt"), ("s",)),
        n("softmax", "Softmax", ("s",), ("p",), axis=-1), n("av", "MatMul", ("p", "v"), ("o",)),
        n("proj", "MatMul", ("o", "wo"), ("op",)), n("proj_bias", "Add", ("op", "bo"), ("ob",)),
        n("res1", "Add", ("x", "ob"), ("r1",)),
        *layer_norm("r1", "n2", "g2", "beta2", "ln2", decomposed),
        n("fc1", "MatMul", ("n2", "w1"), ("h",)), n("fc1_bias", "Add", ("h", "b1"), ("hb",)),
        *(erf_gelu("hb", "ge") if gelu == "erf" else tanh_gelu("hb", "ge") if gelu == "tanh"
          else tanh_gelu_torch("hb", "ge") if gelu == "tanh_torch" else [n("gelu", "Gelu", ("hb",), ("ge",))]),
        n("fc2", "MatMul", ("ge", "w2"), ("f",)), n("fc2_bias", "Add", ("f", "b2"), ("fb",)),
        n("res2", "Add", ("r1", "fb"), ("r2",)),
        *layer_norm("r2", "y", "g1", "beta1", "ln_f", decomposed),
    ]  # fmt: skip
    constants = {**CONSTANTS, "c3_exp": np.float32(3.0)}
    return PlanGraph(nodes, inputs=("x",), outputs=("y",), constant=constants.get)


def cnn() -> PlanGraph:
    w = RNG.standard_normal((4, 4, 3, 3)).astype(np.float32)
    nodes = [n("conv", "Conv", ("x", "w"), ("c",)), n("relu", "Relu", ("c",), ("r",)),
             n("conv2", "Conv", ("r", "w"), ("c2",)), n("add", "Add", ("r", "c2"), ("a",)),
             n("gap", "GlobalAveragePool", ("a",), ("g",)), n("flat", "Flatten", ("g",), ("f",)),
             n("fc", "MatMul", ("f", "wf"), ("y0",)), n("bias", "Add", ("y0", "bf"), ("y1",)),
             n("softmax", "Softmax", ("y1",), ("y",))]  # fmt: skip
    consts = {"w": w, "wf": np.ones((4, 3), np.float32), "bf": np.zeros(3, np.float32)}
    return PlanGraph(nodes, inputs=("x",), outputs=("y",), constant=consts.get)


def dtype_of(plan, tensor: str) -> str | None:
    group = plan.group_of(tensor)
    return None if group is None else group.spec.dtype.value


@pytest.mark.parametrize("decomposed", [False, True])
@pytest.mark.parametrize("gelu", ["erf", "tanh", "tanh_torch", "op"])
def test_block_formats_under_a8w8(decomposed: bool, gelu: str) -> None:
    graph = block(decomposed, gelu)
    plan = plan_quantization(graph, get_preset("a8w8"))
    # Residual stream (x + attention, + MLP, and x itself, which ln1 and res1 read): float,
    # as PT2E leaves it (no integer kernel reads it; 16 bits under power-of-two formats).
    for tensor in ("x", "r1", "r2"):
        assert plan.group_of(tensor) is None, tensor
    # The branch outputs into it, a Linear's output (MatMul + bias Add): float, so the layer
    # keeps an integer kernel with a float output.
    assert plan.group_of("ob") is None and plan.group_of("fb") is None
    # Every MatMul input (both inputs of Q.K^T and attn.V, every linear layer's) quantized, 8 bits.
    for node in graph.nodes:
        if node.op_type == "MatMul":
            data = [t for t in node.inputs if graph.constant(t) is None]
            assert data and all(dtype_of(plan, t) == "uint8" for t in data), (node.name, data)
    assert {t for node in graph.nodes if node.op_type == "MatMul" for t in node.inputs} >= {"qs", "kt", "p", "v"}
    # Softmax output: its observed range (min-max; the fixed [0, 1] grid under power-of-two
    # formats); every MatMul input keeps the preset's min-max observer (a percentile clipped
    # the trained fmnist_deit's outlier features: 32.3 -> 25.3 dB; MSE on the GELU outputs cost
    # it 1.6 dB, MSE on the norm outputs gained nothing on the trained models).
    group = plan.group_of("p")
    assert group is not None and group.spec.observer == MinMax()
    for tensor in ("n1", "n2", "qs", "kt", "v", "ge"):
        assert plan.group_of(tensor).spec.observer == MinMax(), tensor  # type: ignore[union-attr]
    # GELU internals, its input (only the GELU reads it), the linear products before a bias, the scores: float.
    internals = {"erf": ["g_d", "g_e", "g_a", "hb"], "tanh": ["t_p", "t_c3", "t_s", "t_ks", "t_t", "t_a", "hb"],
                 "tanh_torch": ["t_x2", "t_p", "t_c3", "t_s", "t_ks", "t_t", "t_a", "hb"],
                 "op": ["hb"]}[gelu]  # fmt: skip
    if decomposed:
        internals += ["ln1_m", "ln1_d", "ln1_sq", "ln1_v", "ln1_ve", "ln1_s", "ln1_n", "ln1_ng"]
    for tensor in [*internals, "op", "h", "f", "s"]:  # "s": the attention scores into the softmax
        assert plan.group_of(tensor) is None, tensor
    # The linear layers' constant biases (the Adds after their MatMuls): float, as PT2E keeps them.
    for bias in ("bo", "b1", "b2"):
        assert plan.group_of(bias) is None, bias
    # The GELU output and the norm outputs feed MatMuls: 8 bits.
    assert dtype_of(plan, "ge") == dtype_of(plan, "n1") == dtype_of(plan, "n2") == "uint8"
    assert any(note.startswith("transformer recipe: 3 LayerNorm, 1 GELU, 1 Softmax") for note in plan.notes)


def test_recipe_off_plans_by_the_op_table() -> None:
    graph = block(gelu="op")
    plan = plan_quantization(graph, get_preset("a8w8").evolve(transformer_recipe=False))
    assert dtype_of(plan, "r1") == "uint8"
    assert all(plan.group_of(t) is not None for t in ("op", "hb", "bo", "b1"))
    # After the last MatMul (fc2) the block only computes the result: the tail, float either way.
    assert plan.group_of("b2") is None and plan.group_of("r2") is None
    assert plan.group_of("p").spec.observer == plan.group_of("n1").spec.observer == MinMax()  # type: ignore[union-attr]
    assert not any("transformer recipe" in note for note in plan.notes)


def test_xint8_widens_to_int16_power_of_two() -> None:
    plan = plan_quantization(block(), get_preset("xint8"))
    for tensor in ("x", "r1", "r2"):
        spec = plan.group_of(tensor).spec  # type: ignore[union-attr]
        assert spec.dtype is DType.INT16 and spec.scale_type.value == "power_of_two", tensor
    assert dtype_of(plan, "n1") == "int8"


def test_xint8_widens_a_decomposed_layernorms_internals_to_int16() -> None:
    """An integer-only device computes the decomposed LayerNorm op by op: its variance at
    8 bits lost the trained fmnist_deit_decomposed (xint8 top-1 0.7604 -> 0.8453 at 16 bits,
    level with the LayerNormalization op's 0.8445)."""
    plan = plan_quantization(block(decomposed=True), get_preset("xint8"))
    for tensor in ("ln1_m", "ln1_d", "ln1_sq", "ln1_v", "ln1_ve", "ln1_s", "ln1_n", "ln1_ng"):
        spec = plan.group_of(tensor).spec  # type: ignore[union-attr]
        assert spec.dtype is DType.INT16 and spec.scale_type.value == "power_of_two", tensor
    # The norm's output feeds the MatMuls: the preset's 8 bits.
    assert dtype_of(plan, "n1") == "int8"


def test_a16w8_keeps_the_stream_float() -> None:
    plan = plan_quantization(block(), get_preset("a16w8"))
    assert plan.group_of("r1") is None and dtype_of(plan, "n1") == "uint16"


@pytest.mark.parametrize(("preset", "direct", "stream"), [("a8w8", "uint8", None), ("xint8", "int8", "int16")])
def test_a_layer_reading_the_residual_stream_gets_an_8_bit_input(preset: str, direct: str, stream: str | None) -> None:
    """a8w8: the stream tensor a MatMul reads is quantized for it at 8 bits (no 16-bit copy);
    xint8: 16 bits, and the MatMul gets its own 8-bit requantization."""
    nodes = [n("add", "Add", ("x", "x2"), ("r",)), n("ln", "LayerNormalization", ("r", "g1", "beta1"), ("y",)),
             n("fc", "MatMul", ("r", "wq"), ("z",))]  # fmt: skip
    graph = PlanGraph(nodes, inputs=("x", "x2"), outputs=("y", "z"), constant=CONSTANTS.get)
    plan = plan_quantization(graph, get_preset(preset))
    requant = plan.requant_of("fc", "r")
    if stream is None:
        assert dtype_of(plan, "r") == direct and requant is None
    else:
        assert dtype_of(plan, "r") == stream and requant is not None and requant.spec.dtype.value == direct


def test_class_and_distillation_tokens_joined_to_the_stream_stay_float() -> None:
    """ViT/DeiT: learned tokens concatenated with the patch embedding (a Conv) start the
    stream. a8w8: the Concat and the tokens are float (one 8-bit scale with the patches
    wiped out DeiT's distillation token), the Conv output keeps its 8 bits; xint8: one group."""
    nodes = [n("conv", "Conv", ("img", "wc"), ("c",)), n("flat", "Reshape", ("c", "shape"), ("p",)),
             n("tok", "Expand", ("cls", "shape"), ("t",)), n("cat", "Concat", ("t", "p"), ("e",), axis=1),
             n("pos", "Add", ("e", "pos_embed"), ("x",)), n("ln", "LayerNormalization", ("x", "g1", "beta1"), ("n1",)),
             n("fc", "MatMul", ("n1", "wq"), ("h",)), n("res", "Add", ("x", "h"), ("r",)),
             n("ln_f", "LayerNormalization", ("r", "g2", "beta2"), ("y",))]  # fmt: skip
    consts = {**CONSTANTS, "wc": RNG.standard_normal((D, 3, 2, 2)).astype(np.float32), "shape": np.ones(3),
              "cls": np.full((1, 1, D), 0.02, np.float32), "pos_embed": np.zeros((1, 3, D), np.float32)}  # fmt: skip
    graph = PlanGraph(nodes, inputs=("img",), outputs=("y",), constant=consts.get)
    plan = plan_quantization(graph, get_preset("a8w8"))
    assert [plan.group_of(t) for t in ("t", "e", "x", "pos_embed", "r")] == [None] * 5
    assert dtype_of(plan, "c") == "uint8" and dtype_of(plan, "n1") == "uint8"
    npu = plan_quantization(graph, get_preset("xint8"))
    assert npu.group_of("e") is not None and npu.group_of("e") == npu.group_of("t")


def test_cnn_plan_is_unchanged() -> None:
    """No LayerNorm, GELU or attention: identical plans with the recipe on and off (a
    classifier's Softmax is not an attention softmax: no MatMul reads it)."""
    on = plan_quantization(cnn(), get_preset("a8w8"))
    off = plan_quantization(cnn(), get_preset("a8w8").evolve(transformer_recipe=False))
    assert on == off
    assert find_blocks(cnn()).residual == frozenset() and find_blocks(cnn()).float_tensors == frozenset()


def test_gelu_with_an_outside_reader_is_not_a_gelu() -> None:
    nodes = [*erf_gelu("x", "y"), n("tap", "Relu", ("g_e",), ("t",))]
    graph = PlanGraph(nodes, inputs=("x",), outputs=("y", "t"), constant=CONSTANTS.get)
    assert find_blocks(graph).gelus == ()


def test_half_first_gelu_is_recognised() -> None:
    graph = PlanGraph(erf_gelu("x", "y", half_first=True), inputs=("x",), outputs=("y",), constant=CONSTANTS.get)
    blocks = find_blocks(graph)
    assert blocks.gelus == ("g_erf",) and {"g_d", "g_e", "g_a", "g_h"} <= blocks.float_tensors


@given(st.sampled_from([d for d in DType if d.is_integer]), st.booleans())
def test_widened_keeps_signedness_and_never_narrows(dtype: DType, symmetric: bool) -> None:
    spec = QuantSpec(dtype=dtype, symmetric=symmetric or dtype.signed)
    wide = widened(spec)
    assert wide.dtype.bits == max(16, dtype.bits) and wide.dtype.signed == dtype.signed
    assert wide.evolve(dtype=dtype) == spec


@given(
    st.lists(st.floats(-50, 50, allow_nan=False, width=32), min_size=1, max_size=20),
    st.floats(-4, 0), st.floats(0.01, 4),
    st.sampled_from([("uint8", False), ("int8", True), ("uint16", False)]),
)  # fmt: skip
def test_fixed_range_ignores_the_data(values: list[float], lo: float, hi: float, fmt: tuple[str, bool]) -> None:
    spec = QuantSpec(dtype=fmt[0], symmetric=fmt[1], observer=FixedRange(lo, hi))
    obs = make_observer(spec)
    assert isinstance(obs, FixedRangeObserver)
    obs.update(np.array(values, np.float32))
    assert obs.qparams() == qparams_from_range(lo, hi, spec)


def test_fixed_range_validation_and_json() -> None:
    with pytest.raises(ValueError, match="per_channel_axis: null"):
        QuantSpec(dtype="int8", per_channel_axis=0, observer=FixedRange())
    with pytest.raises(ValueError, match="min_val"):
        FixedRange(0.5, 1.0)
    config = get_preset("a8w8").evolve(transformer_recipe=False)
    assert config_from_json(config_to_json(config)) == config
    assert '"transformer_recipe": false' in config_to_json(config)
    with pytest.raises(ValueError, match="transformer_recipe"):
        QuantConfig(global_config=config.global_config, transformer_recipe="yes")  # type: ignore[arg-type]


def test_logits_stay_float_their_inputs_do_not() -> None:
    """DeiT's two heads averaged: the layer outputs, their sum and the halved sum are the
    logits (float: the result tail, recipe or not); the heads' input stays 8-bit."""
    nodes = [n("add", "Add", ("x", "x2"), ("r",)), n("ln", "LayerNormalization", ("r", "g1", "beta1"), ("t",)),
             n("head", "Gemm", ("t", "wq"), ("a",)), n("head_dist", "Gemm", ("t", "wk"), ("b",)),
             n("sum", "Add", ("a", "b"), ("s",)), n("avg", "Div", ("s", "two"), ("y",))]  # fmt: skip
    graph = PlanGraph(nodes, inputs=("x", "x2"), outputs=("y",), constant=CONSTANTS.get)
    plan = plan_quantization(graph, get_preset("a8w8"))
    assert [plan.group_of(t) for t in ("a", "b", "s", "y")] == [None] * 4
    assert dtype_of(plan, "t") == "uint8" and plan.group_of("r") is None
    off = plan_quantization(graph, get_preset("a8w8").evolve(transformer_recipe=False))
    assert [off.group_of(t) for t in ("a", "b", "s", "y", "two")] == [None] * 5
    assert all(plan_quantization(graph, get_preset("xint8")).group_of(t) is not None for t in ("a", "b", "s", "y"))


def test_swin_shapes_stage_start_and_biased_scores() -> None:
    """A stage that starts with a Linear (Swin's patch merging): its output is the stream a
    norm and the residual Add read (float, so the layer keeps an integer kernel with a float
    output); attention scores plus a position bias into the softmax: float; the data-movement
    copy of the stream the norm reads: float like the stream (a8w8)."""
    nodes = [n("merge", "MatMul", ("x", "wq"), ("m",)), n("view", "Reshape", ("m", "shape"), ("mv",)),
             n("ln", "LayerNormalization", ("mv", "g1", "beta1"), ("t",)),
             n("q", "MatMul", ("t", "wk"), ("q",)), n("qk", "MatMul", ("q", "t"), ("s",)),
             n("bias", "Add", ("s", "pos"), ("sb",)), n("softmax", "Softmax", ("sb",), ("p",)),
             n("av", "MatMul", ("p", "t"), ("o",)), n("proj", "MatMul", ("o", "wv"), ("po",)),
             n("res", "Add", ("mv", "po"), ("r",)), n("ln2", "LayerNormalization", ("r", "g2", "beta2"), ("y",))]  # fmt: skip
    graph = PlanGraph(nodes, inputs=("x", "pos"), outputs=("y",), constant={**CONSTANTS, "shape": np.ones(2)}.get)
    plan = plan_quantization(graph, get_preset("a8w8"))
    assert plan.group_of("m") is None and plan.group_of("mv") is None
    assert plan.group_of("s") is None and plan.group_of("sb") is None
    assert plan.group_of("r") is None and dtype_of(plan, "t") == "uint8"
    assert plan.group_of("p").spec.observer == MinMax()  # type: ignore[union-attr]
    assert plan_quantization(graph, get_preset("xint8")).group_of("p").spec.observer == FixedRange(0.0, 1.0)  # type: ignore[union-attr]


@pytest.mark.parametrize("path", [("Gather",), ("Slice", "Gather"), ("Slice", "Gather", "Identity")])
def test_class_token_is_quantized_where_the_head_reads_it(path: tuple[str, ...]) -> None:
    """ViT's class token: the final norm output and every data-movement step after it are
    float; only the tensor the head reads is quantized, on its own range (torch's export
    slices then selects; ONNX gathers)."""
    nodes = [n("add", "Add", ("x", "x2"), ("r",)), n("ln", "LayerNormalization", ("r", "g1", "beta1"), ("t0",))]
    for i, op in enumerate(path):
        nodes.append(n(f"m{i}", op, (f"t{i}",), (f"t{i + 1}",)))
    nodes.append(n("head", "Gemm", (f"t{len(path)}", "wq"), ("y",)))
    graph = PlanGraph(nodes, inputs=("x", "x2"), outputs=("y",), constant=CONSTANTS.get)
    plan = plan_quantization(graph, get_preset("a8w8"))
    assert [plan.group_of(f"t{i}") for i in range(len(path))] == [None] * len(path)
    head_input = plan.group_of(f"t{len(path)}")
    assert head_input is not None and head_input.observed == (f"t{len(path)}",)
    # An integer-only device (power-of-two formats) runs no float op: the chain keeps its format.
    assert plan_quantization(graph, get_preset("xint8")).group_of("t0") is not None


@pytest.mark.parametrize("path", [("Gather",), ("Slice", "Gather")])
def test_class_and_distillation_tokens_each_quantized_where_their_head_reads_them(path: tuple[str, ...]) -> None:
    """DeiT: two tokens taken from the final norm output, each into its own head. Every
    movement step on both paths is float, each head input on its own range (quant-torch-fx's
    ``slice`` outputs were quantized on all tokens' range: scale 0.033 against the tokens'
    0.019 and 0.020, about 1 dB of DeiT-Tiny's output SQNR)."""
    nodes = [n("add", "Add", ("x", "x2"), ("r",)), n("ln", "LayerNormalization", ("r", "g1", "beta1"), ("t",))]
    for token in ("c", "d"):
        names = ["t", *(f"{token}{i}" for i in range(1, len(path) + 1))]
        nodes += [n(f"{token}_m{i}", op, (names[i],), (names[i + 1],)) for i, op in enumerate(path)]
        nodes.append(n(f"head_{token}", "Gemm", (names[-1], "wq"), (f"y{token}",)))
    graph = PlanGraph(nodes, inputs=("x", "x2"), outputs=("yc", "yd"), constant=CONSTANTS.get)
    plan = plan_quantization(graph, get_preset("a8w8"))
    last = len(path)
    moved = ["t", *(f"{token}{i}" for token in "cd" for i in range(1, last))]
    assert [plan.group_of(name) for name in moved] == [None] * len(moved)
    for token in "cd":
        head_input = plan.group_of(f"{token}{last}")
        assert head_input is not None and head_input.observed == (f"{token}{last}",)


def test_copies_of_the_stream_stay_float_with_it() -> None:
    """Swin's patch merging: slices of the stream concatenated into a norm, then a Linear.
    a8w8: the slices and the Concat are float like the stream (quantized they rounded it to
    8 bits on their own); the Linear's input (the norm output) 8 bits. xint8: 16 bits."""
    nodes = [n("res", "Add", ("x", "x2"), ("r",)), n("ln0", "LayerNormalization", ("r", "g1", "beta1"), ("n0",)),
             n("fc0", "MatMul", ("n0", "wq"), ("h",)), n("res2", "Add", ("r", "h"), ("r2",)),
             n("ln1", "LayerNormalization", ("r2", "g1", "beta1"), ("y0",)),
             n("s0", "Slice", ("r2",), ("a",)), n("s1", "Slice", ("r2",), ("b",)),
             n("cat", "Concat", ("a", "b"), ("m",), axis=-1), n("ln2", "LayerNormalization", ("m", "g2", "beta2"), ("mn",)),
             n("reduce", "MatMul", ("mn", "wk"), ("y",))]  # fmt: skip
    graph = PlanGraph(nodes, inputs=("x", "x2"), outputs=("y", "y0"), constant=CONSTANTS.get)
    plan = plan_quantization(graph, get_preset("a8w8"))
    assert [plan.group_of(t) for t in ("r2", "a", "b", "m")] == [None] * 4
    assert dtype_of(plan, "mn") == "uint8"
    assert dtype_of(plan_quantization(graph, get_preset("xint8")), "m") == "int16"


def test_a_gemm_over_flattened_tokens_writing_the_stream_keeps_a_float_output() -> None:
    # torch exports a Linear over [B*T, C] tokens as Gemm, then Reshape/Transpose back to
    # [B, T, C] before the residual Add (nn.MultiheadAttention's out_proj): that output stays
    # float as a MatMul + Add's does (before: 8 bits, 36.3 against 37.1 dB).
    graph = block()
    nodes = []
    for node in graph.nodes:
        if node.name == "proj":
            nodes += [n("proj", "Gemm", ("o", "wo", "bo"), ("ob2",)), n("unflat", "Reshape", ("ob2", "shape"), ("ob3",)),
                      n("swap", "Transpose", ("ob3",), ("ob",), perm=(1, 0))]  # fmt: skip
        elif node.name != "proj_bias":
            nodes.append(node)
    constants = {**CONSTANTS, "c3_exp": np.float32(3.0), "shape": np.array([-1, D], np.int64)}
    gemm = PlanGraph(nodes, inputs=("x",), outputs=("y",), constant=constants.get)
    plan = plan_quantization(gemm, get_preset("a8w8"))
    for tensor in ("ob2", "ob3", "ob"):
        assert plan.group_of(tensor) is None, tensor
    assert dtype_of(plan, "o") == "uint8"  # the Gemm still reads an 8-bit input
