"""Running a compiled program over batches, with a progress bar."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import onnx

from quant_core.errors import ConfigError, DataError
from quant_npu.partitions import CpuSelection, deployment_selection
from quant_npu.profile import NPUProfile, load_profile
from quant_npu.sim.program import Operation, Program, compile_program, naming_the_node, quantize_input
from quant_npu.sim.threads import blas_threads

ModelSource = str | os.PathLike[str] | onnx.ModelProto
BATCH_ELEMENTS = 2**25
"""Automatic batch size: the largest tensor of a batch holds about this many elements
(128 MB as float32), at most :data:`MAX_BATCH` samples."""
MAX_BATCH = 1024


class NPUSimulator:
    """An integer-only simulation of what an XINT8 NPU computes for a QDQ model.

    Args:
        model: a legalised QDQ model (path or ModelProto; never modified).
        target: profile (name, ``.json`` file or :class:`NPUProfile`; default ``xint8``).
        rounding: ``"device"`` (the profile's rounding, half-up by default) or ``"onnx"``
            (half-to-even, what onnxruntime's QuantizeLinear does), or a RoundMode name.
        cpu: op types or node-name globs that run on the CPU in float (``legalize``'s
            ``cpu``): computed between their quantized inputs and output; the planner's
            float result Concat runs there too, as ``legalize`` says.

    Example:
        >>> import numpy as np
        >>> from onnx import TensorProto, helper, numpy_helper
        >>> inits = [numpy_helper.from_array(np.array(0.25, np.float32), "s"),
        ...          numpy_helper.from_array(np.array(0, np.int8), "z")]
        >>> nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
        ...          helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
        ...          helper.make_node("Relu", ["xd"], ["r"], name="relu"),
        ...          helper.make_node("QuantizeLinear", ["r", "s", "z"], ["rq"]),
        ...          helper.make_node("DequantizeLinear", ["rq", "s", "z"], ["y"])]
        >>> g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3])],
        ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 3])], inits)
        >>> sim = NPUSimulator(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]))
        >>> sim.run(np.array([[-1.0, 0.375, 0.625]], np.float32), quiet=True)["y"].tolist()
        [[0.0, 0.5, 0.75]]
    """

    def __init__(
        self,
        model: ModelSource,
        target: str | os.PathLike[str] | NPUProfile | None = None,
        rounding: str = "device",
        cpu: CpuSelection | Iterable[str] | str | None = None,
    ) -> None:
        from quant_core.onnx_qdq.model_io import load_model

        self.profile = load_profile(target)
        self.rounding = self.profile.rounding_for(rounding)
        self.model = load_model(model)
        self.program: Program = compile_program(
            self.model, self.profile, self.rounding, deployment_selection(self.model, cpu)
        )

    @property
    def notes(self) -> tuple[str, ...]:
        return self.program.notes

    @property
    def input_names(self) -> list[str]:
        return list(self.program.inputs) + [k for k in self.program.raw_inputs if k not in self.program.inputs]

    def _feeds(self, data: np.ndarray | Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return model_feeds(self.model, self.input_names, data)

    def run_batch(
        self, feeds: Mapping[str, np.ndarray], integer: bool = False, sizes: list[int] | None = None
    ) -> dict[str, np.ndarray]:
        """One batch through the program; outputs dequantized (float32) or, with
        ``integer``, the signed integer codes. ``sizes`` collects every tensor's element count."""
        program = self.program
        values: dict[str, np.ndarray] = dict(program.constants)
        for name, quantizers in program.inputs.items():
            values[name] = feeds[name]
            for key, qp in quantizers:
                values[key] = quantize_input(feeds[name], qp, program.mode)
        for name, (key, zero_point) in program.raw_inputs.items():
            values[key] = np.asarray(feeds[name]).astype(np.int64) - zero_point
        for operation in program.operations:
            if not isinstance(operation, Operation):  # shape values, the CPU's float results
                values.update(operation.run(values))
                continue
            arguments = [values[k] for k in operation.data]
            arguments += [values[p] if p else None for p in operation.params]  # type: ignore[misc]
            with naming_the_node(operation.name, operation.op_type):
                values[operation.output] = operation.kernel(*arguments)
            if sizes is not None:
                sizes.append(values[operation.output].size)
        outputs = {}
        for name, (key, position) in program.outputs.items():
            codes = values[key]
            if position is None:  # a CPU node's float result
                outputs[name] = codes
            else:
                outputs[name] = codes if integer else np.ldexp(codes.astype(np.float32), -position).astype(np.float32)
        return outputs

    def run(
        self,
        data: np.ndarray | Mapping[str, np.ndarray],
        *,
        batch_size: int | None = None,
        quiet: bool = False,
        integer: bool = False,
    ) -> dict[str, np.ndarray]:
        """Every graph output for ``data`` (one array for a single-input model, else
        ``{input name: array}``; first axis = samples), batch by batch (``batch_size``
        None: sized from the model's largest tensor, see :data:`BATCH_ELEMENTS`)."""
        from tqdm import tqdm

        if batch_size is not None and batch_size < 1:
            raise ConfigError(f"batch_size: {batch_size} is out of range; allowed: an integer >= 1")
        feeds = self._feeds(data)
        count = len(next(iter(feeds.values())))
        if batch_size is None:
            batch_size = self.automatic_batch_size(feeds)
        parts: dict[str, list[np.ndarray]] = {}
        starts = range(0, count, batch_size)
        for start in tqdm(starts, desc="simulate", unit="batch", disable=quiet):
            batch = {n: v[start : start + batch_size] for n, v in feeds.items()}
            with blas_threads():  # exact products: the thread count changes no output
                outputs = self.run_batch(batch, integer)
            for name, value in outputs.items():
                parts.setdefault(name, []).append(value)
        return {name: np.concatenate(values) for name, values in parts.items()}

    def automatic_batch_size(self, feeds: Mapping[str, np.ndarray]) -> int:
        """Samples per batch so that the largest tensor holds about :data:`BATCH_ELEMENTS`
        elements (measured on one sample)."""
        sizes: list[int] = []
        self.run_batch({n: v[:1] for n, v in feeds.items()}, sizes=sizes)
        largest = max([*sizes, *(v[:1].size for v in feeds.values()), 1])
        return int(max(1, min(MAX_BATCH, 2 ** int(np.log2(max(BATCH_ELEMENTS // largest, 1))))))


def model_feeds(
    model: onnx.ModelProto, names: Sequence[str], data: np.ndarray | Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """``data`` (one array for a single-input model, else ``{input name: array}``) as
    ``{name: array}`` for the graph inputs ``names``, each checked by :func:`_check_input`;
    a DataError names the first input that does not fit."""
    if isinstance(data, Mapping):
        missing = [n for n in names if n not in data]
        if missing:
            raise DataError(f"data: input {missing[0]!r} is missing; model inputs: {', '.join(names)}")
        feeds = {n: np.asarray(data[n]) for n in names}
    else:
        if len(names) != 1:
            raise DataError(f"data: one array given; the model has inputs {', '.join(names)} (use a .npz)")
        feeds = {names[0]: np.asarray(data)}
    for name, value in feeds.items():
        _check_input(model, name, value)
    sizes = {len(v) for v in feeds.values()}
    if len(sizes) != 1:
        raise DataError(f"data: inputs have different sample counts {sorted(sizes)}")
    return feeds


def _check_input(model: onnx.ModelProto, name: str, value: np.ndarray) -> None:
    """``value`` is finite real numbers of the graph input's kind, in its shape (axis 0,
    the samples, any size but 0): what does not fit is the caller's data, not a fault of
    the simulator, and a NaN would come out as some finite code instead of an error."""
    from quant_core.onnx_qdq.graph import data_fits_input, value_info_shape

    if value.dtype.kind not in "biuf":  # complex too: quantizing would drop the imaginary part
        raise DataError(f"data: input {name!r} has dtype {value.dtype}; allowed: real numbers")
    graph_input = next((vi for vi in model.graph.input if vi.name == name), None)
    elem_type = graph_input.type.tensor_type.elem_type if graph_input is not None else 0
    if elem_type:
        expected = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
        if not data_fits_input(value.dtype, expected):
            raise DataError(
                f"data: input {name!r} expected dtype {expected} got {value.dtype} (convert the data first)"
            )
    if value.ndim == 0:
        raise DataError(f"data: input {name!r} is a scalar; allowed: an array with the samples on axis 0")
    if len(value) == 0:
        raise DataError(f"data: input {name!r} has no samples")
    if value.dtype.kind == "f" and not np.isfinite(value).all():
        raise DataError(f"data: input {name!r} contains {'NaN' if np.isnan(value).any() else 'Inf'}")
    dims = value_info_shape(graph_input) if graph_input is not None else None
    if dims is None:
        return
    fits = value.ndim == len(dims) and all(
        not isinstance(d, int) or d == s for d, s in zip(dims[1:], value.shape[1:], strict=True)
    )
    if not fits:
        shown = ",".join(["N", *(str(d) if d is not None else "?" for d in dims[1:])])
        raise DataError(f"data: input {name!r} expected shape [{shown}] got {list(value.shape)}")


def simulate(
    model: ModelSource,
    data: np.ndarray | Mapping[str, np.ndarray],
    target: str | os.PathLike[str] | NPUProfile | None = None,
    *,
    rounding: str = "device",
    batch_size: int | None = None,
    quiet: bool = False,
    cpu: CpuSelection | Iterable[str] | str | None = None,
) -> dict[str, np.ndarray]:
    """:class:`NPUSimulator` in one call: graph output name -> float32 array."""
    return NPUSimulator(model, target, rounding, cpu).run(data, batch_size=batch_size, quiet=quiet)
