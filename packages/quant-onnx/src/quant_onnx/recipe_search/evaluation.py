"""Reading a search's evaluation data for an ONNX model: any form calibration data takes
(arrays, ``.npy`` files, image folders), into memory, then split as every search splits
it (:func:`quant_algos.search.evaluation.evaluation_data`).

Example:
    >>> from onnx import helper, TensorProto
    >>> g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
    ...     [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 2])],
    ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 2])])
    >>> model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    >>> data = load_evaluation_data(model, np.zeros((10, 2), np.float32))
    >>> len(data.select), len(data.holdout), data.fixed_batch
    (7, 3, None)
"""

from __future__ import annotations

import sys
from typing import Any

import attrs
import numpy as np
import onnx

from quant_algos.search.evaluation import EvaluationData, evaluation_data
from quant_core.errors import DataError
from quant_onnx.data import CalibrationReader, ImageOptions, model_inputs


def load_evaluation_data(
    model: onnx.ModelProto,
    data: Any,
    *,
    labels: Any = None,
    holdout: float = 0.3,
    seed: int = 0,
    batch_size: int = 32,
    num_samples: int | None = None,
    image_options: ImageOptions | None = None,
) -> EvaluationData:
    """Read ``data`` (any form calibration data takes) for ``model``'s inputs into memory
    and split it. ``labels``: an array or ``.npy`` path, one per sample."""
    specs = model_inputs(model)
    fixed = {spec.fixed_batch for spec in specs} - {None}
    # Read as one batch, the batch axis free: an array's samples then stay where they are,
    # instead of being cut into batches and copied together again (a fresh copy of 520 Lite0
    # crops, 313 MB, took 1-1.5 s to fault in), and a model that fixes its batch loses no
    # sample (EvaluationData.feeds pads its short last batch).
    free = [attrs.evolve(s, shape=("N", *s.shape[1:])) if s.fixed_batch and s.shape else s for s in specs]
    reader = CalibrationReader(free, data, batch_size=sys.maxsize, num_samples=num_samples, image_options=image_options)
    batches = list(reader)
    if not batches:
        raise DataError("evaluation data: no samples")
    if len(batches) == 1:
        inputs = dict(batches[0])
    else:
        for name in batches[0]:
            shapes = sorted({tuple(b[name].shape[1:]) for b in batches})
            if len(shapes) > 1:  # the reader gives samples of another size a batch of their own
                raise DataError(
                    f"evaluation data: input '{name}' samples have different shapes {list(shapes[0])} and "
                    f"{list(shapes[1])}; allowed: one shape (resize them, e.g. --resize for an image folder)"
                )
        inputs = {name: np.concatenate([b[name] for b in batches]) for name in batches[0]}
    return evaluation_data(
        inputs,
        labels=labels,
        holdout=holdout,
        seed=seed,
        batch_size=batch_size,
        fixed_batch=fixed.pop() if fixed else None,
    )
