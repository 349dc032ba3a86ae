"""Fuzzing the ONNX loader: mutated real models go through what ``quant-onnx inspect``
does (load, check, pre-process, plan or describe) and, when that works, through a whole
quantization with calibration data made for the unmutated model. Each must either work or
fail with one of our own one-line errors (ModelError, DataError), never anything else.

Mutations: truncated bytes, bit flips, wrong element types, graph cycles, missing
inputs/initializers, huge or negative dims, bad opsets, corrupted attributes and op
types, external data pointing anywhere. Seeds: the test models, a QDQ model written by
quant-onnx and a reference model from ``tools/models``. Hypothesis runs derandomized, so
every run tries the same cases.
"""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import conv_bn_relu_model, identity_weight_model, opset11_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from model_builders import float_island_net, mlp, quantize_in_memory, random_inputs, small_cnn
from onnx import TensorProto

from quant_core.errors import DataError, ModelError
from quant_onnx.api import ModelQuantizer
from quant_onnx.cli.inspection import inspect_model

EXAMPLES = 1200
REFERENCE = Path(__file__).resolve().parents[3] / "tools" / "models" / "fmnist_mobilenetv2.onnx"
HUGE_DIMS = (0, -1, -(2**40), 2**31, 2**40, 2**62)
OPSETS = (-5, 0, 1, 7, 10, 22, 30, 1000, 2**40)
LOCATIONS = ("../../etc/passwd", "/etc/passwd", "", "missing.bin", "a/../../b", "C:\\\\x", "dir/", "\\\\server\\x")
ELEMENT_TYPES = (*TensorProto.DataType.values(), 33, 99, 1 << 20)  # and three that are no type


def _seeds() -> list[tuple[str, bytes]]:
    models = {
        "small_cnn": small_cnn(),
        "mlp": mlp(),
        "conv_bn_relu": conv_bn_relu_model(),
        "identity_weights": identity_weight_model(),
        "opset11": opset11_model(),
        "float_island": float_island_net(),
        "qdq_small_cnn": quantize_in_memory(small_cnn(), "a8w8", random_inputs(small_cnn(), 8))[1],
    }
    seeds = [(name, model.SerializeToString()) for name, model in models.items()]
    if REFERENCE.is_file():
        seeds.append(("fmnist_mobilenetv2", REFERENCE.read_bytes()))
    return seeds


SEEDS = _seeds()


def _parse(data: bytes) -> onnx.ModelProto:
    model = onnx.ModelProto()
    model.ParseFromString(data)
    return model


def _calibration_data(data: bytes) -> np.ndarray:
    """Four samples for the seed model's input (unknown dims: 2)."""
    dims = [d.dim_value or 2 for d in _parse(data).graph.input[0].type.tensor_type.shape.dim]
    return np.random.default_rng(0).normal(size=[4, *dims[1:]]).astype(np.float32)


CALIBRATION = {name: _calibration_data(data) for name, data in SEEDS}


@st.composite
def mutated_models(draw) -> tuple[str, bytes]:
    """(mutation label, serialized model)."""
    seed_name, data = draw(st.sampled_from(SEEDS))
    kind = draw(
        st.sampled_from(
            ("truncate", "bit_flips", "dtype", "cycle", "missing", "huge_dims", "opset", "attribute", "op_type",
             "external", "node_order")
        )
    )  # fmt: skip
    label = f"{kind} of {seed_name}"
    if kind == "truncate":
        return label, data[: draw(st.integers(0, len(data) - 1))]
    if kind == "bit_flips":
        flipped = bytearray(data)
        for _ in range(draw(st.integers(1, 8))):
            position = draw(st.integers(0, len(data) - 1))
            flipped[position] ^= 1 << draw(st.integers(0, 7))
        return label, bytes(flipped)
    model = _parse(data)
    graph = model.graph
    nodes = list(graph.node)
    if kind == "dtype":
        element_type = draw(st.sampled_from(ELEMENT_TYPES))
        if graph.initializer and draw(st.booleans()):
            graph.initializer[draw(st.integers(0, len(graph.initializer) - 1))].data_type = element_type
        else:
            graph.input[0].type.tensor_type.elem_type = element_type
    elif kind == "cycle":
        i = draw(st.integers(0, len(nodes) - 1))
        j = draw(st.integers(i, len(nodes) - 1))
        if graph.node[i].input:
            graph.node[i].input[draw(st.integers(0, len(graph.node[i].input) - 1))] = graph.node[j].output[0]
    elif kind == "missing":
        what = draw(st.sampled_from(("initializer", "graph_input", "node_input", "graph_output")))
        if what == "initializer" and graph.initializer:
            del graph.initializer[draw(st.integers(0, len(graph.initializer) - 1))]
        elif what == "graph_input":
            del graph.input[0]
        elif what == "node_input":
            node = graph.node[draw(st.integers(0, len(nodes) - 1))]
            if node.input:
                node.input[draw(st.integers(0, len(node.input) - 1))] = "nowhere"
        else:
            del graph.output[0]
    elif kind == "huge_dims":
        dim = draw(st.sampled_from(HUGE_DIMS))
        if graph.initializer and draw(st.booleans()):
            tensor = graph.initializer[draw(st.integers(0, len(graph.initializer) - 1))]
            if tensor.dims:
                tensor.dims[draw(st.integers(0, len(tensor.dims) - 1))] = dim
            else:
                tensor.dims.append(dim)
        else:
            dims = graph.input[0].type.tensor_type.shape.dim
            dims[draw(st.integers(0, len(dims) - 1))].dim_value = dim
    elif kind == "opset":
        choice = draw(st.sampled_from(("version", "domain", "drop", "duplicate")))
        if choice == "version":
            model.opset_import[0].version = draw(st.sampled_from(OPSETS))
        elif choice == "domain":
            model.opset_import[0].domain = draw(st.sampled_from(("com.microsoft", "ai.onnx.ml", "x", "ai.onnx")))
        elif choice == "drop":
            del model.opset_import[:]
        else:
            model.opset_import.add(domain="", version=draw(st.sampled_from(OPSETS)))
    elif kind == "attribute":
        with_attributes = [n for n in graph.node if n.attribute]
        if with_attributes:
            node = draw(st.sampled_from(with_attributes))
            attribute = node.attribute[draw(st.integers(0, len(node.attribute) - 1))]
            value = draw(st.sampled_from((0, -1, 2**40, -(2**40))))
            if attribute.ints:
                attribute.ints[draw(st.integers(0, len(attribute.ints) - 1))] = value
            elif attribute.type == onnx.AttributeProto.INT:
                attribute.i = value
            elif attribute.type == onnx.AttributeProto.FLOAT:
                attribute.f = draw(st.sampled_from((float("nan"), float("inf"), -1.0, 0.0, 1e30)))
            else:
                attribute.type = draw(st.sampled_from(tuple(onnx.AttributeProto.AttributeType.values())))
    elif kind == "op_type":
        node = graph.node[draw(st.integers(0, len(nodes) - 1))]
        node.op_type = draw(st.sampled_from(("Conv", "Gemm", "MatMul", "Add", "Relu", "NoSuchOp", "QLinearConv",
                                             "DequantizeLinear", "BatchNormalization", "Concat", "")))  # fmt: skip
    elif kind == "external":
        if graph.initializer:
            tensor = graph.initializer[draw(st.integers(0, len(graph.initializer) - 1))]
            tensor.data_location = TensorProto.EXTERNAL
            tensor.ClearField("raw_data")
            tensor.external_data.add(key="location", value=draw(st.sampled_from(LOCATIONS)))
            if draw(st.booleans()):
                tensor.external_data.add(key="offset", value=draw(st.sampled_from(("0", "-1", "x", str(2**63)))))
    elif kind == "node_order":
        order = draw(st.permutations(range(len(nodes))))
        del graph.node[:]
        graph.node.extend(nodes[i] for i in order)
    return label, model.SerializeToString()


OUR_ERRORS = (ModelError, DataError)


def test_fuzzed_models_load_or_fail_with_our_one_line_errors(record_count) -> None:
    outcomes: collections.Counter[str] = collections.Counter()
    kinds: collections.Counter[str] = collections.Counter()

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(mutated_models())
    def fuzz(case: tuple[str, bytes]) -> None:
        label, data = case
        kind, seed = label.split(" of ")
        kinds[kind] += 1
        stage = "inspect"
        try:
            inspect_model(data, "a8w8")
            stage = "quantize"
            ModelQuantizer("a8w8", quiet=True).quantize(data, None, CALIBRATION[seed])
        except OUR_ERRORS as exc:
            message = str(exc)
            assert message and "\n" not in message, (label, message)
            outcomes[f"{type(exc).__name__} in {stage}"] += 1
        except Exception as exc:
            pytest.fail(f"{label}: {type(exc).__name__} escaped {stage}: {exc}")
        else:
            outcomes["quantized"] += 1

    fuzz()
    total = sum(outcomes.values())
    record_count(
        f"fuzzed {total} models ({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))}): "
        f"{', '.join(f'{k} {n}' for k, n in sorted(outcomes.items()))}, 0 crashes"
    )
    assert total >= 1000, f"only {total} fuzz cases ran"
