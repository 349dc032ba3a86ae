"""GraphIndex lookups and topological sort."""

from __future__ import annotations

import numpy as np
from conftest import constant_weight_model, identity_weight_model, make_model, tensor, vi
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper

from quant_core.onnx_qdq.graph import GraphIndex, node_inputs, topological_sort
from quant_onnx.pipeline.preprocess.shape_inference import typed_index


def test_producers_consumers_constants():
    model = identity_weight_model()
    idx = GraphIndex(model.graph)
    assert idx.producer("w_id").name == "id_w"
    assert idx.producer("w") is None
    assert [n.name for n in idx.consumers("w_id")] == ["id_w2", "conv1"]
    assert idx.is_graph_output("y") and idx.is_graph_input("x") and not idx.is_graph_input("w")
    assert idx.constant("w").shape == (3, 3, 3, 3)
    assert idx.constant("w_id") is None  # computed by a node
    assert idx.is_constant("") and idx.is_constant("b") and not idx.is_constant("x")
    assert idx.used("c1") and not idx.used("nothing")


def test_constant_nodes_resolve():
    idx = GraphIndex(constant_weight_model().graph)
    np.testing.assert_allclose(idx.constant("b"), [0.1, -0.2, 0.3, 0.0])
    assert idx.constant("w").shape == (4, 3, 3, 3)
    assert idx.is_constant("w")
    assert idx.shape("w") is None  # no value_info before shape inference


def test_shapes_dtypes_and_initializer_inputs():
    model = identity_weight_model()
    model.graph.input.append(vi("w", [3, 3, 3, 3]))  # old exporter style
    idx = GraphIndex(model.graph)
    assert not idx.is_graph_input("w") and idx.constant("w") is not None
    assert idx.shape("x") == ["N", 3, 5, 5]
    assert idx.shape("b") == [3]
    assert idx.dtype("x") == np.float32 and idx.dtype("b") == np.float32
    assert idx.dtype("c1") is None


def test_unique_names_are_fresh_and_reserved():
    idx = GraphIndex(identity_weight_model().graph)
    assert idx.unique_name("w") == "w_1"
    assert idx.unique_name("w") == "w_2"
    assert idx.unique_name("fresh") == "fresh"
    assert idx.unique_name("fresh") == "fresh_1"


def test_subgraph_reads_count_as_consumers():
    then_out = vi("t", [1])
    then = helper.make_graph([helper.make_node("Identity", ["outer"], ["t"])], "then", [], [then_out])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["e"])], "else", [], [vi("e", [1])])
    nodes = [
        helper.make_node("Relu", ["x"], ["outer"]),
        helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other),
    ]
    model = make_model(nodes, [vi("x", [1]), vi("cond", [], 9)], [vi("y", [1])])
    idx = GraphIndex(model.graph)
    assert [n.op_type for n in idx.consumers("outer")] == ["If"]
    assert node_inputs(model.graph.node[1]) == ["cond", "outer", "x"]


@settings(max_examples=30, deadline=None)
@given(st.permutations(list(range(6))))
def test_topological_sort_orders_any_shuffle(perm):
    # chain a -> n0 -> n1 -> ... -> n5 plus a side branch reading n1
    nodes = [helper.make_node("Relu", [f"t{i}"], [f"t{i + 1}"], name=f"n{i}") for i in range(5)]
    nodes.append(helper.make_node("Add", ["t2", "t5"], ["out"], name="n5"))
    shuffled = [nodes[i] for i in perm]
    order = [n.name for n in topological_sort(shuffled, available=["t0"])]
    assert order == [f"n{i}" for i in range(6)]


def test_topological_sort_is_stable_for_independent_nodes():
    nodes = [helper.make_node("Relu", ["x"], [f"y{i}"], name=f"r{i}") for i in (3, 1, 2)]
    assert [n.name for n in topological_sort(nodes)] == ["r3", "r1", "r2"]
    assert GraphIndex(make_model(nodes, [vi("x", [1])], [vi(f"y{i}", [1]) for i in (3, 1, 2)]).graph)


def test_constant_value_forms():
    nodes = [
        helper.make_node("Constant", [], ["a"], value_int=3),
        helper.make_node("Constant", [], ["b"], value_ints=[1, 2]),
        helper.make_node("Constant", [], ["c"], value_float=1.5),
        helper.make_node("Constant", [], ["d"], value=tensor("v", np.arange(4, dtype=np.int32))),
    ]
    graph = helper.make_graph(nodes, "g", [], [vi(n, None, 1) for n in "abcd"])
    idx = GraphIndex(graph)
    assert idx.constant("a") == 3 and idx.constant("a").dtype == np.int64
    assert list(idx.constant("b")) == [1, 2]
    assert idx.constant("c") == np.float32(1.5)
    assert idx.constant("d").dtype == np.int32


def test_typed_index_infers_shapes_without_touching_the_model():
    model = identity_weight_model()
    idx = typed_index(model)
    assert idx.shape("c1") == ["N", 3, 5, 5] and idx.dtype("c1") == np.float32
    assert len(model.graph.value_info) == 0
    assert idx.producer("c1") is model.graph.node[2]  # the caller's own node objects
