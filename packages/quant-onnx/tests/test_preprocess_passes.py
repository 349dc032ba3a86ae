"""Each pre-processing pass keeps outputs identical (onnxruntime) and removes what it should."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import (
    assert_same_outputs,
    clip6_model,
    constant_weight_model,
    conv_bn_relu_model,
    conv_transpose_bn_model,
    depthwise_bn_model,
    gemm_bn_model,
    identity_weight_model,
    make_model,
    op_types,
    opset11_model,
    pad_conv_model,
    run_ort,
    same_pad_model,
    tensor,
    vi,
    weight,
)
from onnx import helper

from quant_core.errors import ModelError
from quant_core.onnx_qdq.model_io import model_hash, opset_version
from quant_onnx.pipeline.preprocess import (
    constants_to_initializers,
    eliminate_identities,
    fold_batchnorm,
    fold_constants,
    fold_pads,
    infer_shapes,
    initializers_to_constants,
    relu6_to_relu,
    remove_dead_nodes,
    upgrade_opset,
)

PASSES = [
    constants_to_initializers,
    eliminate_identities,
    fold_batchnorm,
    fold_constants,
    fold_pads,
    infer_shapes,
    initializers_to_constants,
    relu6_to_relu,
    remove_dead_nodes,
    upgrade_opset,
]


@pytest.mark.parametrize("apply", PASSES, ids=lambda f: f.__name__)
def test_passes_never_modify_their_input(apply):
    model = depthwise_bn_model()
    before = model_hash(model)
    out = apply(model)
    assert model_hash(model) == before
    assert out is not model


def test_constants_to_initializers():
    model = constant_weight_model()
    out = constants_to_initializers(model)
    assert op_types(out) == ["Conv"]
    assert {t.name for t in out.graph.initializer} == {"w", "b"}
    assert_same_outputs(model, out)


def test_constant_graph_output_stays_a_node():
    nodes = [helper.make_node("Constant", [], ["y"], value=tensor("v", np.ones(2, np.float32)))]
    model = make_model(nodes, [], [vi("y", [2])])
    assert op_types(constants_to_initializers(model)) == ["Constant"]


def test_identity_elimination_rewires_weights_and_graph_output():
    model = identity_weight_model()
    out = eliminate_identities(model)
    assert "Identity" not in op_types(out)
    convs = [n for n in out.graph.node if n.op_type == "Conv"]
    assert [c.input[1] for c in convs] == ["w", "w"]
    assert convs[1].output[0] == "y"  # producer renamed to the graph output
    assert_same_outputs(model, out)


def test_identity_between_input_and_output_is_kept():
    model = make_model([helper.make_node("Identity", ["x"], ["y"])], [vi("x", [2])], [vi("y", [2])])
    assert op_types(eliminate_identities(model)) == ["Identity"]


def test_inference_dropout_is_removed():
    nodes = [helper.make_node("Dropout", ["x"], ["d"]), helper.make_node("Relu", ["d"], ["y"])]
    model = make_model(nodes, [vi("x", [1, 4])], [vi("y", [1, 4])])
    out = eliminate_identities(model)
    assert op_types(out) == ["Relu"]
    assert_same_outputs(model, out)


@pytest.mark.parametrize("bias", [True, False])
def test_bn_folding_conv(bias):
    model = conv_bn_relu_model(bias=bias)
    out = fold_batchnorm(model)
    assert op_types(out) == ["Conv", "Relu"]
    assert_same_outputs(model, out)


def test_bn_folding_depthwise():
    model = depthwise_bn_model()
    out = fold_batchnorm(model)
    assert "BatchNormalization" not in op_types(out)
    conv = out.graph.node[0]
    assert conv.attribute[0].name == "group" and conv.attribute[0].i == 16
    assert_same_outputs(model, out)


@pytest.mark.parametrize("group", [1, 2])
def test_bn_folding_conv_transpose(group):
    model = conv_transpose_bn_model(group)
    out = fold_batchnorm(model)
    assert op_types(out) == ["ConvTranspose"]
    assert_same_outputs(model, out)


@pytest.mark.parametrize(("trans_b", "beta", "bias_shape"), [(1, 0.5, (5,)), (0, 1.0, (1, 5)), (0, 2.0, (1,))])
def test_bn_folding_gemm(trans_b, beta, bias_shape):
    model = gemm_bn_model(trans_b, beta, bias_shape)
    out = fold_batchnorm(model)
    assert op_types(out) == ["Flatten", "Gemm"]
    gemm = out.graph.node[1]
    assert {a.name: helper.get_attribute_value(a) for a in gemm.attribute}["beta"] == 1.0
    assert_same_outputs(model, out)


def test_bn_not_folded_when_conv_output_is_shared_or_graph_output():
    model = conv_bn_relu_model()
    shared = onnx.ModelProto()
    shared.CopyFrom(model)
    shared.graph.node.append(helper.make_node("Relu", ["c"], ["extra"]))
    shared.graph.output.append(vi("extra", ["N", 8, 8, 8]))
    out = fold_batchnorm(shared)
    assert "BatchNormalization" in op_types(out)


def test_standalone_bn_is_kept():
    inits = conv_bn_relu_model().graph.initializer
    bn = [t for t in inits if t.name.startswith("bn_")]
    nodes = [helper.make_node("BatchNormalization", ["x", *(t.name for t in bn)], ["y"])]
    model = make_model(nodes, [vi("x", ["N", 8, 2, 2])], [vi("y", ["N", 8, 2, 2])], bn)
    assert op_types(fold_batchnorm(model)) == ["BatchNormalization"]


def test_bn_folding_with_shared_weight_keeps_other_user_intact():
    model = conv_bn_relu_model(bias=False)
    shared = onnx.ModelProto()
    shared.CopyFrom(model)
    shared.graph.node.append(helper.make_node("Conv", ["x", "w"], ["c2"], name="conv2", pads=[1, 1, 1, 1]))
    shared.graph.output.append(vi("c2", ["N", 8, 8, 8]))
    out = fold_batchnorm(shared)
    assert "BatchNormalization" not in op_types(out)
    assert_same_outputs(shared, out)


@pytest.mark.parametrize(
    ("pads", "conv_pads"), [((0, 0, 1, 2, 0, 0, 2, 1), (1, 0, 0, 1)), ((0, 0, 1, 1, 0, 0, 1, 1), (0, 0, 0, 0))]
)
def test_pad_folding(pads, conv_pads):
    model = pad_conv_model(pads, conv_pads)
    out = fold_pads(model)
    assert op_types(out) == ["Conv"]
    conv_pads_after = helper.get_attribute_value(out.graph.node[0].attribute[0])
    assert list(conv_pads_after) == [a + b for a, b in zip(conv_pads, pads[2:4] + pads[6:8], strict=True)]
    assert_same_outputs(model, out)


@pytest.mark.parametrize(
    "pads",
    [
        (0, 1, 1, 1, 0, 0, 1, 1),  # channel padding
        (0, 0, -1, 0, 0, 0, 0, 0),  # crop
    ],
)
def test_pad_not_folded_when_not_spatial_zero_padding(pads):
    model = pad_conv_model(pads, (0, 0, 0, 0))
    assert "Pad" in op_types(fold_pads(model))


def test_pad_with_nonzero_value_or_reflect_mode_is_kept():
    model = pad_conv_model()
    reflect = onnx.ModelProto()
    reflect.CopyFrom(model)
    reflect.graph.node[0].attribute[0].s = b"reflect"
    assert "Pad" in op_types(fold_pads(reflect))
    valued = onnx.ModelProto()
    valued.CopyFrom(model)
    valued.graph.initializer.append(tensor("fill", np.array(1.0, np.float32)))
    valued.graph.node[0].input.append("fill")
    assert "Pad" in op_types(fold_pads(valued))


def test_pad_before_maxpool_is_kept():
    inits = [tensor("pads", np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64))]
    nodes = [
        helper.make_node("Pad", ["x", "pads"], ["p"]),
        helper.make_node("MaxPool", ["p"], ["y"], kernel_shape=[3, 3]),
    ]
    model = make_model(nodes, [vi("x", [1, 2, 4, 4])], [vi("y", [1, 2, 4, 4])], inits)
    assert "Pad" in op_types(fold_pads(model))


def test_pad_folding_with_axes_input_opset18():
    inits = [
        weight("w", [4, 3, 3, 3]),
        tensor("pads", np.array([1, 2, 1, 0], np.int64)),
        tensor("axes", np.array([2, 3], np.int64)),
    ]
    nodes = [
        helper.make_node("Pad", ["x", "pads", "", "axes"], ["p"], name="pad"),
        helper.make_node("Conv", ["p", "w"], ["y"], name="conv"),
    ]
    model = make_model(nodes, [vi("x", [1, 3, 8, 8])], [vi("y", [1, 4, 8, 8])], inits, opset=18)
    out = fold_pads(infer_shapes(model))
    assert op_types(out) == ["Conv"]
    assert_same_outputs(model, out)


def test_constant_folding_of_same_padding_with_dynamic_batch():
    model = same_pad_model()
    out = remove_dead_nodes(fold_constants(model))
    assert op_types(out) == ["Pad", "Conv", "Relu"]
    assert_same_outputs(model, out, batch=3)
    both = fold_pads(out)
    assert op_types(both) == ["Conv", "Relu"]
    assert_same_outputs(model, both, batch=1)


def test_constant_folding_skips_dynamic_dims_and_quantize_nodes():
    inits = [
        tensor("zero", np.array(0, np.int64)),
        tensor("s", np.array(0.1, np.float32)),
        tensor("w", np.ones(3, np.float32)),
    ]
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["batch"], axis=0),  # dynamic batch: must stay
        helper.make_node("QuantizeLinear", ["w", "s"], ["wq"]),
        helper.make_node("DequantizeLinear", ["wq", "s"], ["wd"]),
        helper.make_node("Mul", ["x", "wd"], ["y"]),
    ]
    model = make_model(nodes, [vi("x", ["N", 3])], [vi("y", ["N", 3]), vi("batch", [])], inits)
    out = fold_constants(model)
    assert op_types(out) == op_types(model)


def test_constant_folding_chain_of_weight_ops():
    inits = [weight("w", [3, 4]), tensor("perm_scale", np.array(2.0, np.float32))]
    nodes = [
        helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
        helper.make_node("Mul", ["wt", "perm_scale"], ["ws"]),
        helper.make_node("MatMul", ["x", "ws"], ["y"]),
    ]
    model = make_model(nodes, [vi("x", ["N", 4])], [vi("y", ["N", 3])], inits)
    out = fold_constants(model)
    assert op_types(out) == ["MatMul"]
    assert_same_outputs(model, out)


def test_constant_folding_leaves_unknown_ops():
    nodes = [helper.make_node("MyOp", ["c"], ["d"], domain="custom"), helper.make_node("Add", ["x", "d"], ["y"])]
    graph = helper.make_graph(nodes, "g", [vi("x", [2])], [vi("y", [2])], [tensor("c", np.ones(2, np.float32))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid("custom", 1)])
    out = fold_constants(model)
    assert op_types(out) == ["MyOp", "Add"]


def test_relu6_to_relu_only_on_request_and_exact_below_six():
    model = clip6_model()
    out = relu6_to_relu(model)
    assert op_types(out) == ["Conv", "Relu"]
    # Outputs agree wherever the Conv output stays below 6 (small inputs).
    feeds = {"x": np.random.default_rng(0).uniform(-0.3, 0.3, (2, 3, 4, 4)).astype(np.float32)}
    np.testing.assert_allclose(run_ort(model, feeds)[0], run_ort(out, feeds)[0], atol=1e-6)


def test_clip_with_other_bounds_is_kept():
    model = clip6_model()
    other = onnx.ModelProto()
    other.CopyFrom(model)
    for t in other.graph.initializer:
        if t.name == "six":
            t.CopyFrom(tensor("six", np.array(5.0, np.float32)))
    assert "Clip" in op_types(relu6_to_relu(other))


def test_dead_node_removal():
    model = conv_bn_relu_model()
    dead = onnx.ModelProto()
    dead.CopyFrom(model)
    dead.graph.node.append(helper.make_node("Sigmoid", ["c"], ["unused"]))
    dead.graph.initializer.append(tensor("orphan", np.ones(3, np.float32)))
    out = remove_dead_nodes(dead)
    assert op_types(out) == op_types(model)
    assert "orphan" not in {t.name for t in out.graph.initializer}
    assert [i.name for i in out.graph.input] == ["x"]


def test_initializers_listed_as_inputs_become_constants():
    model = conv_bn_relu_model()
    old = onnx.ModelProto()
    old.CopyFrom(model)
    old.graph.input.extend([vi(t.name, list(t.dims)) for t in old.graph.initializer])
    out = initializers_to_constants(old)
    assert [i.name for i in out.graph.input] == ["x"]
    assert_same_outputs(model, out)


def test_upgrade_opset11_to_13():
    model = opset11_model()
    out = upgrade_opset(model)
    assert opset_version(out) == 13
    squeeze = next(n for n in out.graph.node if n.op_type == "Squeeze")
    assert len(squeeze.input) == 2  # axes moved from attribute to input at opset 13
    assert_same_outputs(model, out)
    assert opset_version(upgrade_opset(model, 17)) == 17


def test_upgrade_refuses_downgrade():
    with pytest.raises(ModelError, match="downgrading"):
        upgrade_opset(conv_bn_relu_model(opset=17), 13)


def test_shape_inference_tolerates_unknown_ops():
    nodes = [helper.make_node("MyOp", ["x"], ["d"], domain="custom"), helper.make_node("Relu", ["d"], ["y"])]
    graph = helper.make_graph(nodes, "g", [vi("x", [2])], [vi("y", [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid("custom", 1)])
    out = infer_shapes(model)
    assert op_types(out) == ["MyOp", "Relu"]


def test_constant_folding_shape_slice_of_static_dims():
    inits = [
        tensor("starts", np.array([-2], np.int64)),
        tensor("ends", np.array([4], np.int64)),
        tensor("minus_one", np.array([-1], np.int64)),
    ]
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Slice", ["shape", "starts", "ends"], ["hw"]),
        helper.make_node("Concat", ["minus_one", "hw"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
    ]
    model = make_model(nodes, [vi("x", ["N", 3, 6, 7])], [vi("y", [None, 6, 7])], inits)
    out = remove_dead_nodes(fold_constants(model))
    assert op_types(out) == ["Reshape"]
    np.testing.assert_array_equal(
        next(onnx.numpy_helper.to_array(t) for t in out.graph.initializer if t.name == "target"), [-1, 6, 7]
    )
    assert_same_outputs(model, out, batch=3)


def test_constant_folding_does_not_bloat_the_file():
    inits = [tensor("big_shape", np.array([1024, 1024], np.int64)), tensor("small_shape", np.array([2, 3], np.int64))]
    nodes = [
        helper.make_node("ConstantOfShape", ["big_shape"], ["big"]),
        helper.make_node("ConstantOfShape", ["small_shape"], ["small"]),
        helper.make_node("ReduceSum", ["big"], ["total"], keepdims=0),
        helper.make_node("ReduceSum", ["small"], ["total_small"], keepdims=0),
        helper.make_node("Add", ["total", "total_small"], ["t"]),
        helper.make_node("Add", ["x", "t"], ["y"]),
    ]
    model = make_model(nodes, [vi("x", [2])], [vi("y", [2])], inits)
    out = fold_constants(model)
    assert op_types(out) == ["ConstantOfShape", "ReduceSum", "Add", "Add"]
    assert_same_outputs(model, out)
