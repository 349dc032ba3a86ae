"""onnxruntime sessions whose failures are one-line :class:`~quant_core.errors.ModelError`.

onnxruntime raises its own exception types (``Fail``, ``InvalidGraph``,
``InvalidArgument``...), subclasses of neither ValueError nor RuntimeError, with
multi-line messages, and logs the same failure to stderr first. A model that passes
onnx's checker can still be one onnxruntime cannot load or run (a Conv on uint8 data, a
``group`` of 0), so every session the toolkit opens goes through here: its log is
silenced below fatal and its errors name what failed in one line.

Example:
    >>> from onnx import helper, TensorProto
    >>> g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
    ...     [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
    ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    >>> m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    >>> session = inference_session(m, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    >>> session.run(None, {"x": np.array([-1.0, 2.0], np.float32)})[0].tolist()
    [0.0, 2.0]
    >>> session.run(None, {"x": np.zeros(3, np.int64)})
    Traceback (most recent call last):
    ...
    quant_core.errors.ModelError: onnxruntime cannot run the model: Unexpected input data type. Actual: (tensor(int64)) , expected: (tensor(float))
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from quant_algos.shared_cores import machine_is_busy
from quant_core.errors import ModelError, one_line
from quant_core.onnx_qdq.tensor_data import bound_folders, without_basepath

_PREFIX = re.compile(r"^\[ONNXRuntimeError\]\s*:\s*\d+\s*:\s*\w+\s*:\s*")
_EXTERNAL_FOLDER = "session.model_external_initializers_file_folder_path"


def _is_onnxruntime_error(exc: BaseException) -> bool:
    return type(exc).__module__.startswith("onnxruntime")


def _message(exc: BaseException) -> str:
    """onnxruntime's message without its ``[ONNXRuntimeError] : 1 : FAIL :`` prefix, every
    line kept (a node's name can follow the first line) and joined into one."""
    text = _PREFIX.sub("", str(exc).strip())
    return one_line(text) if text else type(exc).__name__


@contextmanager
def onnxruntime_errors(what: str) -> Iterator[None]:
    """Turn onnxruntime's own exceptions raised in the block into
    ``ModelError("onnxruntime cannot <what>: <its message on one line>")``."""
    try:
        yield
    except UnicodeDecodeError:  # onnxruntime's message quotes model text that is not UTF-8
        raise ModelError(f"onnxruntime cannot {what}: the model holds text that is not valid UTF-8") from None
    except Exception as exc:
        if not _is_onnxruntime_error(exc):
            raise
        raise ModelError(f"onnxruntime cannot {what}: {_message(exc)}") from None


class CheckedSession:
    """An ``ort.InferenceSession`` whose :meth:`run` raises ModelError on failure; every
    other attribute is the session's own.

    Example:
        >>> CheckedSession.__name__
        'CheckedSession'
    """

    def __init__(self, session: ort.InferenceSession) -> None:
        self.session = session

    def run(
        self, output_names: Sequence[str] | None, feeds: Mapping[str, np.ndarray], run_options: Any = None
    ) -> list[Any]:
        with onnxruntime_errors("run the model"):
            return self.session.run(output_names, dict(feeds), run_options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)


#: Whether the toolkit's sessions let onnxruntime's idle intra-op threads spin: ``None``
#: decides per session from the load (:func:`quant_algos.shared_cores.machine_is_busy`):
#: spinning on a quiet machine (one-sample calibration runs 0.33 against 0.43 s), sleeping
#: when other work shares the cores (2.2 against 1.1 s). Spinning changes no result.
ALLOW_SPINNING: bool | None = None


def session_options(level: ort.GraphOptimizationLevel) -> ort.SessionOptions:
    """Options for the toolkit's sessions: ``level`` of graph optimisation, idle threads
    spinning or sleeping (:data:`ALLOW_SPINNING`), log at fatal only (failures reach the
    user as ModelError instead)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    options.log_severity_level = 4
    spin = not machine_is_busy() if ALLOW_SPINNING is None else ALLOW_SPINNING
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    return options


def inference_session(model: onnx.ModelProto, level: ort.GraphOptimizationLevel) -> CheckedSession:
    """A CPU session on an in-memory model; onnxruntime reads tensors that
    :func:`~quant_core.onnx_qdq.model_io.load_model` left in their files from there."""
    options = session_options(level)
    folders = bound_folders(model)
    if len(folders) > 1:
        raise ModelError(f"model: external data in {len(folders)} folders; onnxruntime reads from one")
    if folders:
        options.add_session_config_entry(_EXTERNAL_FOLDER, str(folders.pop()))
        model = without_basepath(model)
    with onnxruntime_errors("load the model"):
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return CheckedSession(session)
