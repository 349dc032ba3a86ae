"""A model over 2 GiB (weights in an external data file) quantizes with peak memory under
twice its size: the weights stay in their file (memory-mapped, read tensor by tensor),
onnxruntime reads them from there, and quantization works in blocks.

Marked ``big_model``: it writes 2.6 GB to a temp folder and takes about 40 s here (2 shared
cores); the ``onnx`` nox session runs it on its own after the other tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

pytestmark = pytest.mark.big_model

N_IN, N_OUT, LAYERS = 16384, 14336, 3  # 0.94 + 2 x 0.82 GB of float32 weights
MEASURE = textwrap.dedent(
    """
    import atexit, resource, sys
    atexit.register(lambda: print(f"peak_rss_bytes {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}"))
    from quant_onnx.cli.main import main
    sys.exit(main(sys.argv[1:]))
    """
)


def _row_block(rows: range, layer: int) -> np.ndarray:
    """Rows of a layer's weight: a cheap, varied pattern (no random generator over GBs)."""
    base = ((np.arange(N_OUT, dtype=np.int64) * 7919) % 251 - 125).astype(np.float32) * 1e-3
    shifts = (np.arange(rows.start, rows.stop)[:, None] + np.arange(N_OUT)[None, :] + layer) % N_OUT
    return base[shifts]


def _write_model(folder: Path) -> tuple[Path, int]:
    """x [N, 16384] -> (MatMul -> Relu) x 3, weights in ``big.data``; never more than a
    block of rows in memory."""
    nodes, initializers, x, offset = [], [], "x", 0
    with open(folder / "big.data", "wb") as data:
        for layer in range(LAYERS):
            rows = N_IN if layer == 0 else N_OUT
            for start in range(0, rows, 1024):
                data.write(_row_block(range(start, min(start + 1024, rows)), layer).tobytes())
            length = rows * N_OUT * 4
            weight = TensorProto(name=f"w{layer}", data_type=TensorProto.FLOAT, dims=[rows, N_OUT])
            weight.data_location = TensorProto.EXTERNAL
            for key, value in (("location", "big.data"), ("offset", str(offset)), ("length", str(length))):
                weight.external_data.add(key=key, value=value)
            offset += length
            initializers.append(weight)
            nodes += [
                helper.make_node("MatMul", [x, f"w{layer}"], [f"m{layer}"], name=f"mm{layer}"),
                helper.make_node("Relu", [f"m{layer}"], [f"r{layer}"], name=f"relu{layer}"),
            ]
            x = f"r{layer}"
    graph = helper.make_graph(
        nodes,
        "big",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", N_IN])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["N", N_OUT])],
        initializers,
    )
    path = folder / "big.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), path)
    return path, offset


def test_model_over_2gb_quantizes_under_twice_its_size_in_memory(tmp_path, record_count) -> None:
    model, size = _write_model(tmp_path)
    assert size > 2**31  # over protobuf's 2 GiB limit: it can only exist with external data
    data, out = tmp_path / "x.npy", tmp_path / "big.int8.onnx"
    np.save(data, np.random.default_rng(0).normal(size=(8, N_IN)).astype(np.float32))
    result = subprocess.run(
        [sys.executable, "-c", MEASURE, "quantize", str(model), str(out), "--calib-data", str(data), "--quiet"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    peak = int(result.stdout.split("peak_rss_bytes ")[1])
    record_count(
        f"{size / 1e9:.2f} GB model quantized with peak RSS {peak / 1e9:.2f} GB ({peak / size:.2f}x its size); "
        f"output {out.stat().st_size / 1e9:.2f} GB"
    )
    assert peak < 2 * size, f"peak RSS {peak / 1e9:.2f} GB is not under twice the model's {size / 1e9:.2f} GB"

    quantized = onnx.load(str(out))
    onnx.checker.check_model(quantized)
    codes = {t.name: t for t in quantized.graph.initializer if t.data_type == TensorProto.INT8 and len(t.dims) == 2}
    assert sorted(t.dims[0] for t in codes.values()) == sorted([N_IN] + [N_OUT] * (LAYERS - 1))
    # Spot check: the first rows of the first weight dequantize to the float values.
    first = next(t for t in codes.values() if t.dims[0] == N_IN)
    dq = next(n for n in quantized.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == first.name)
    scale = onnx.numpy_helper.to_array(next(t for t in quantized.graph.initializer if t.name == dq.input[1]))
    rows = onnx.numpy_helper.to_array(first)[:4].astype(np.float32)
    assert np.max(np.abs(rows * scale - _row_block(range(4), 0))) <= np.max(scale) / 2 + 1e-7
