"""Annotation: groups, fusion, pass-through reuse, weights, float nodes."""

from __future__ import annotations

import numpy as np
import pytest
from model_builders import GraphBuilder, conv_transpose_net, float_island_net, mlp, small_cnn
from onnx import helper

from quant_core.presets import get_preset
from quant_core.spec import QuantSpec
from quant_onnx.cli.config_overrides import override_config
from quant_onnx.pipeline.annotate import ensure_node_names, plan_model


def _nodes(model, op):
    return [n for n in model.graph.node if n.op_type == op]


def test_fused_activations_share_the_post_activation_group() -> None:
    model = small_cnn()
    ann = plan_model(model, get_preset("a8w8"))
    assert {f.op_type for f in ann.fused} == {"Relu", "Clip"}
    for fused in ann.fused:
        group = ann.group_of(fused.pre_tensor)
        assert group is ann.group_of(fused.post_tensor)
        assert fused.pre_tensor not in group.observed
    add = _nodes(model, "Add")[0]
    assert any(f.producer == add.name for f in ann.fused)
    assert ann.float_nodes == ()


def test_pass_through_and_concat_share_qparams() -> None:
    model = small_cnn()
    ann = plan_model(model, get_preset("a8w8"))
    pool = _nodes(model, "MaxPool")[0]
    assert ann.group_of(pool.input[0]) is ann.group_of(pool.output[0])
    assert pool.output[0] not in ann.group_of(pool.output[0]).observed
    concat = _nodes(model, "Concat")[0]
    group = ann.group_of(concat.output[0])
    assert all(ann.group_of(name) is group for name in concat.input)
    assert set(concat.input) <= set(group.observed)
    assert concat.output[0] not in group.observed
    flatten = _nodes(model, "Flatten")[0]
    assert ann.group_of(flatten.output[0]) is ann.group_of(flatten.input[0])


def test_weight_axes_follow_each_op() -> None:
    ann = plan_model(small_cnn(), get_preset("a8w8"))
    axes = {w.op_type: w.spec.per_channel_axis for w in ann.weights}
    assert axes == {"Conv": 0, "Gemm": 0}
    ann = plan_model(mlp(), get_preset("a8w8"))
    assert {w.op_type: w.spec.per_channel_axis for w in ann.weights} == {"MatMul": 1, "Gemm": 1}
    ann = plan_model(conv_transpose_net(), get_preset("a8w8"))
    assert {w.op_type: w.spec.per_channel_axis for w in ann.weights} == {"Conv": 0, "ConvTranspose": 1}
    per_tensor = override_config(get_preset("a8w8"), per_channel=False)
    assert {w.spec.per_channel_axis for w in plan_model(small_cnn(), per_tensor).weights} == {None}


def test_biases_are_recorded_with_their_input_and_weight() -> None:
    model = small_cnn()
    ann = plan_model(model, get_preset("a8w8"))
    conv = _nodes(model, "Conv")[0]
    bias = next(b for b in ann.biases if b.node == conv.name)
    assert (bias.tensor, bias.input_tensor, bias.weight_tensor) == (conv.input[2], conv.input[0], conv.input[1])
    assert len(ann.biases) == len(_nodes(model, "Conv")) + 1


def test_unsupported_and_excluded_nodes_are_listed() -> None:
    model = float_island_net()
    ann = plan_model(model, get_preset("a8w8"))
    assert [(f.op_type, f.reason) for f in ann.float_nodes] == [("Sin", "no quantization policy for this op type")]
    hswish = _nodes(model, "HardSwish")[0]
    assert ann.group_of(hswish.input[0]) is not None and ann.group_of(hswish.output[0]) is not None
    config = get_preset("a8w8").evolve(exclude=("Sigmoid", hswish.name))
    excluded = plan_model(model, config).float_nodes
    assert {(f.op_type, f.reason) for f in excluded} >= {
        ("Sigmoid", "excluded by the config"),
        ("HardSwish", "excluded by the config"),
    }


def test_shape_computations_are_never_quantized() -> None:
    b = GraphBuilder()
    x = b.input("x", ["N", 4, 2, 2])
    shape = b.node("Shape", [x])
    batch = b.node("Gather", [shape, b.const(np.array([0], np.int64))], axis=0)
    target = b.node("Concat", [batch, b.const(np.array([-1], np.int64))], axis=0)
    y = b.node("Reshape", [b.node("Relu", [x]), target])
    model = b.model([b.gemm(y, 16, 3)])
    ann = plan_model(model, get_preset("a8w8"))
    quantized = {m for g in ann.groups for m in g.members}
    assert not {shape, batch, target} & quantized
    assert y in quantized


def test_no_fusion_when_producer_output_has_other_consumers() -> None:
    b = GraphBuilder()
    x = b.input("x", ["N", 3, 4, 4])
    c = b.conv(x, 3, 4)
    r = b.node("Relu", [c])
    model = b.model([b.node("Add", [r, c])], rank=4)
    ann = plan_model(model, get_preset("a8w8"))
    assert ann.fused == ()
    assert ann.group_of(c) is not ann.group_of(r)


def test_per_channel_activation_spec_is_rejected_with_the_node_name() -> None:
    act = QuantSpec(dtype="uint8", symmetric=False, per_channel_axis=1)
    cfg = get_preset("a8w8")
    cfg = cfg.evolve(global_config=cfg.global_config.__class__(input=act, weight=cfg.global_config.weight, output=act))
    with pytest.raises(ValueError, match=r"input.per_channel_axis"):
        plan_model(small_cnn(), cfg)


def test_ensure_node_names_is_deterministic_and_unique() -> None:
    g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Relu", ["a"], ["b"], name="Relu_0")],
        "g",
        [helper.make_tensor_value_info("x", 1, [1])],
        [helper.make_tensor_value_info("b", 1, [1])],
    )
    model = helper.make_model(g)
    ensure_node_names(model)
    names = [n.name for n in model.graph.node]
    assert len(set(names)) == 2 and all(names)


def test_concat_sharing_can_be_turned_off() -> None:
    model = small_cnn()
    concat = _nodes(model, "Concat")[0]
    ann = plan_model(model, get_preset("a8w8"), share_concat_scales=False)
    groups = {id(ann.group_of(name)) for name in [*concat.input, concat.output[0]]}
    assert len(groups) == 3
