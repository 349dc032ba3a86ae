"""Where a searched model will run: which recipes it allows, what it does to a written
model before running it, and how it runs it.

:class:`OnnxRuntime` is ``quant-onnx search``'s: every recipe, the QDQ model as written,
scored in onnxruntime's default CPU session (graph optimisation ALL: the integer kernels
a user's session runs). A package above quant-onnx plugs in another by implementing
:class:`Deployment`: ``quant_npu.recipe_search`` restricts the space to power-of-two
symmetric formats, legalises each candidate for the NPU profile, checks it and scores it
in the integer simulator (quant-onnx does not import quant_npu: it sits above).

Example:
    >>> deployment = OnnxRuntime()
    >>> deployment.name, deployment.allows(None) is None, deployment.scores_in_onnxruntime
    ('onnxruntime', True, True)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import attrs
import numpy as np
import onnx
import onnxruntime as ort

from quant_algos.search.evaluation import Runner
from quant_algos.search.space import SearchSpace
from quant_algos.search.targets import check_target, power_of_two_reason, target_space
from quant_core.config import QuantConfig
from quant_onnx.data import model_inputs
from quant_onnx.ort_session import inference_session
from quant_onnx.pipeline.calibrate import even_step


@attrs.frozen(eq=False)
class Finished:
    """A candidate as the deployment runs it, and whether it meets the deployment's rules.

    Attributes:
        model: the model deployed (an NPU deployment's legalised model).
        legal: ``True``/``False`` against the deployment's rules; ``None`` when it has none.
        detail: what breaks the rules, or what legalising changed (one line).

    Example:
        >>> Finished(onnx.ModelProto(), None).detail
        ''
    """

    model: onnx.ModelProto
    legal: bool | None
    detail: str = ""


class Deployment(Protocol):
    """What a search needs to know about where the model runs (module docstring)."""

    @property
    def name(self) -> str:
        """Shown in the report: ``onnxruntime``, ``npu:xint8``..."""

    @property
    def scores_in_onnxruntime(self) -> bool:
        """Whether :meth:`runner` is an onnxruntime session (its batch times are the
        latency column); otherwise the search times an onnxruntime session separately."""

    @property
    def requires_legal(self) -> bool:
        """Whether a candidate must be legal (``Finished.legal``) to meet the target."""

    def space(self) -> SearchSpace:
        """The space searched when the caller names none."""

    def allows(self, config: QuantConfig) -> str | None:
        """Why ``config`` cannot run here (one line), or ``None``."""

    def finish(self, model: onnx.ModelProto) -> Finished:
        """The written QDQ model as deployed."""

    def runner(self, model: onnx.ModelProto) -> Runner:
        """Runs the finished model on a batch of feeds."""


#: Input bytes of one onnxruntime run while scoring: a batch of large samples runs in
#: pieces of whole samples. Measured on 2 cores with 2 MiB of L2 each (docs/benchmarks.md,
#: issue 27, fifth session): EfficientNet-Lite0 (602 KB a 224x224 sample) ran 1.3-1.5x
#: faster per sample in runs of 1-4 samples than in one run of 32, whose activations leave
#: the cache, float and int8 alike (load 4-5; interleaved with a fresh session a run,
#: and beside more busy processes, both took the same time); a 32x32 Fashion-MNIST model (4 KB a sample) runs fastest at the whole batch
#: of 32. The outputs were the same bytes at every run size.
RUN_INPUT_BYTES = 2 << 20


def per_sample_outputs(model: onnx.ModelProto) -> bool:
    """Whether ``model``'s outputs hold one row per input sample, so a batch may run in
    pieces and its outputs be joined: every input and output has the same symbolic first
    dim, and every other output dim is fixed (a detector's variable count is not).

    Example:
        >>> from onnx import helper, TensorProto
        >>> def relu(out_shape):
        ...     g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
        ...         [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 2])],
        ...         [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)])
        ...     return helper.make_model(g)
        >>> per_sample_outputs(relu(["n", 2])), per_sample_outputs(relu(["n", "k"])), per_sample_outputs(relu([1, 2]))
        (True, False, False)
    """
    firsts: set[object] = set()
    for spec in model_inputs(model):
        if not spec.shape or not isinstance(spec.shape[0], str):
            return False
        firsts.add(spec.shape[0])
    for output in model.graph.output:
        dims = output.type.tensor_type.shape.dim
        if not dims or not dims[0].dim_param or any(not d.HasField("dim_value") for d in dims[1:]):
            return False
        firsts.add(dims[0].dim_param)
    return len(firsts) == 1


def onnxruntime_runner(model: onnx.ModelProto) -> Runner:
    """A function running ``model`` in onnxruntime's default CPU session (optimisation ALL);
    a batch whose inputs exceed :data:`RUN_INPUT_BYTES` runs in pieces of whole samples
    when the outputs are per sample (:func:`per_sample_outputs`).

    Example:
        >>> from onnx import helper, TensorProto
        >>> g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
        ...     [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 2])],
        ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 2])])
        >>> run = onnxruntime_runner(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8))
        >>> run({"x": np.array([[-1.0, 2.0]], np.float32)})[0].tolist()
        [[0.0, 2.0]]
    """
    session = inference_session(model, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    names = [o.name for o in model.graph.output]
    splittable = per_sample_outputs(model)

    def run(feeds: Mapping[str, np.ndarray]) -> Sequence[np.ndarray]:
        lengths = {len(v) for v in feeds.values()} if splittable else set()
        rows = lengths.pop() if len(lengths) == 1 else 0
        most = RUN_INPUT_BYTES // max(1, sum(v.nbytes for v in feeds.values()) // max(1, rows))
        if rows <= most:
            return session.run(names, dict(feeds))  # type: ignore[no-any-return]
        step = even_step(rows, max(1, most))
        parts = [session.run(names, {k: v[i : i + step] for k, v in feeds.items()}) for i in range(0, rows, step)]
        return [np.concatenate(column) for column in zip(*parts, strict=True)]

    return run


@attrs.frozen
class OnnxRuntime:
    """onnxruntime on the CPU: ``quant-onnx search``'s deployment (module docstring).

    ``power_of_two``: only recipes an xint8-style NPU can run (symmetric int8 with
    power-of-two scales; ``quant-onnx search --target xint8``), still scored in onnxruntime
    (legalising and checking against an NPU profile is quant_npu's).

    Example:
        >>> OnnxRuntime().space().formats
        ('a8w8',)
        >>> from quant_core.presets import get_preset
        >>> OnnxRuntime(power_of_two=True).allows(get_preset("a8w8"))
        'activation spec: scale_type float; allowed: power_of_two'
    """

    power_of_two: bool = False
    scores_in_onnxruntime: bool = True
    requires_legal: bool = False

    @property
    def name(self) -> str:
        return "onnxruntime:xint8" if self.power_of_two else "onnxruntime"

    def space(self) -> SearchSpace:
        return target_space("xint8" if self.power_of_two else None)

    def allows(self, config: QuantConfig | None) -> str | None:
        if not self.power_of_two or config is None:
            return None
        return power_of_two_reason(config)

    def finish(self, model: onnx.ModelProto) -> Finished:
        return Finished(model, None)

    def runner(self, model: onnx.ModelProto) -> Runner:
        return onnxruntime_runner(model)


def deployment_for(target: str | None) -> OnnxRuntime:
    """The deployment of ``--target`` (``None``: onnxruntime with every format; the
    targets and what they allow: :mod:`quant_algos.search.targets`).

    Example:
        >>> deployment_for("xint8").name
        'onnxruntime:xint8'
        >>> deployment_for("dpu")
        Traceback (most recent call last):
        ...
        quant_core.errors.ConfigError: target: 'dpu' is not allowed; allowed: xint8
    """
    return OnnxRuntime(power_of_two=check_target(target) is not None)
