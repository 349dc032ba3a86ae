"""Python entry points: :func:`quantize` and :class:`ModelQuantizer`.

The quantizer runs in phases, each with a typed result, so that accuracy algorithms
can hook in between them:

1. :meth:`ModelQuantizer.prepare`: load (a copy), pre-process (BN folding, constant
   folding, Pad folding, opset raised where the formats need it), name every node, run
   the model hooks, plan (:mod:`quant_core.plan`). -> :class:`PreparedModel`
2. :meth:`ModelQuantizer.calibrate`: stream the data through onnxruntime into observers,
   then run the calibrated hooks. -> :class:`~quant_onnx.pipeline.calibrate.CalibratedModel`
3. :meth:`ModelQuantizer.write`: the QDQ model, with what writing it decided (notes, how
   each bias was stored). -> :class:`~quant_onnx.pipeline.qdq_writer.WrittenModel`

Each call returns its own result; the quantizer keeps no state between calls, so one
:class:`ModelQuantizer` serves any number of models.

:meth:`ModelQuantizer.quantize` also runs the config's ``algorithms``
(:mod:`quant_onnx.algorithms`): CLE, activation equalization and SmoothQuant on the float
model between phases 1 and 2 (the model is planned again after them), mixed precision,
AdaRound, AdaQuant and bias correction on the QDQ model after phase 3. These read the
calibration set several times, so with algorithms configured it is held in memory. Where
activation equalization is the only float-model pass and every observer keeps min and
max (``a8w8``), it is measured in the calibration pass itself
(:mod:`quant_onnx.algorithms.equalized_calibration`): one float pass instead of two.

Example:
    >>> import numpy as np, tempfile, os
    >>> from onnx import helper, numpy_helper, TensorProto
    >>> w = numpy_helper.from_array(np.full((4, 3, 1, 1), 0.5, np.float32), "w")
    >>> g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"])], "g",
    ...     [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 4, 4])],
    ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 4, 4])], [w])
    >>> model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    >>> data = np.random.default_rng(0).normal(size=(8, 3, 4, 4)).astype(np.float32)
    >>> out = os.path.join(tempfile.mkdtemp(), "q.onnx")
    >>> result = quantize(model, out, "a8w8", data, quiet=True)
    >>> sorted({n.op_type for n in result.model.graph.node})
    ['Conv', 'DequantizeLinear', 'QuantizeLinear']
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import onnx

from quant_algos.drivers.schedule import schedule
from quant_core import presets
from quant_core.algorithm_config import ActivationEqualizationConfig, check_in_range
from quant_core.bias import EncodedBias
from quant_core.config import QuantConfig
from quant_core.onnx_qdq.model_io import check_output_paths, load_float_model, opset_version, save_model
from quant_core.plan import PlanGraph, QuantPlan
from quant_core.qdq import encode_activation_dtype, required_opset
from quant_core.spec import QuantSpec
from quant_onnx.algorithms.equalized_calibration import calibrate_with_equalization, one_pass_observers
from quant_onnx.algorithms.layerwise import input_mean_request
from quant_onnx.algorithms.mixed_precision import EvaluateFn
from quant_onnx.algorithms.passes import PassesResult, run_post_passes, run_pre_passes
from quant_onnx.data import CalibrationReader, ImageOptions
from quant_onnx.pipeline.annotate import ensure_node_names, plan_model
from quant_onnx.pipeline.calibrate import CalibratedModel, calibrate
from quant_onnx.pipeline.preprocess import PreprocessOptions, preprocess_with_report
from quant_onnx.pipeline.qdq_writer import WriterOptions, WrittenModel, write_qdq_with_notes
from quant_onnx.reporting.compare import Comparison, compare_models
from quant_onnx.reporting.report import build_report, run_notes, write_report

ModelSource = str | os.PathLike[str] | bytes | onnx.ModelProto
ModelHook = Callable[[onnx.ModelProto], onnx.ModelProto]
"""Edits the pre-processed float model before planning (returns a new model)."""
CalibratedHook = Callable[[CalibratedModel, Sequence[Mapping[str, np.ndarray]]], CalibratedModel]
"""Refines a calibrated model given a few held calibration batches (returns a new one)."""
QDQHook = Callable[[onnx.ModelProto, CalibratedModel, Sequence[Mapping[str, np.ndarray]]], onnx.ModelProto]
"""Post-pass on the written QDQ model (e.g. bias correction or AdaRound editing its
integer initializers), given the calibrated state and the held batches."""


def resolve_config(config: QuantConfig | str | os.PathLike[str] | None) -> QuantConfig:
    """A :class:`QuantConfig` from a config, a preset name, a ``.json`` config file or
    ``None`` (the ``a8w8`` preset): :func:`quant_core.presets.resolve_config`.

    Example:
        >>> resolve_config(None).name
        'a8w8'
    """
    return presets.resolve_config(config)


def config_specs(config: QuantConfig) -> list[QuantSpec]:
    """Every spec a config can hand out (global, per op type, per name)."""
    operators = [config.global_config, *config.op_type_overrides.values(), *config.name_overrides.values()]
    return [s for op in operators for s in (op.input, op.weight, op.bias, op.output) if s is not None]


@attrs.frozen(eq=False)
class PreparedModel:
    """Phase 1's result: the pre-processed float model (named nodes) and its plan.

    Example:
        >>> PreparedModel(onnx.ModelProto(), None, {}).preprocess_changes
        {}
    """

    model: onnx.ModelProto
    plan: QuantPlan
    preprocess_changes: Mapping[str, int]


@attrs.frozen(eq=False)
class QuantizationResult:
    """What one :meth:`ModelQuantizer.quantize` call produced. ``report`` is the full report
    (only when a report path was given); ``algorithms`` what each config algorithm did,
    ``notes`` every note of the run (the plan's, calibration's and writing's: biases kept
    float, weight scales raised...) and ``biases`` how each layer's bias was stored (always).

    Example:
        >>> QuantizationResult(onnx.ModelProto(), None, None, None).algorithms
        {}
    """

    model: onnx.ModelProto
    calibrated: CalibratedModel | None
    report: dict[str, Any] | None
    output_path: Path | None
    algorithms: Mapping[str, Any] = attrs.field(factory=dict)
    notes: tuple[str, ...] = ()
    biases: Mapping[str, EncodedBias] = attrs.field(factory=dict)


class _HeldBatches:
    """Passes batches through while keeping the first ``limit`` samples (for hooks and
    the report's SQNR): the data may be a one-shot generator."""

    def __init__(self, batches: Iterable[Mapping[str, np.ndarray]], limit: int) -> None:
        self.batches = batches
        self.limit = limit
        self.held: list[dict[str, np.ndarray]] = []
        self._count = 0

    def __iter__(self) -> Iterator[Mapping[str, np.ndarray]]:
        for batch in self.batches:
            if self._count < self.limit:
                n = len(next(iter(batch.values())))
                take = min(n, self.limit - self._count)
                self.held.append({k: np.array(v[:take]) for k, v in batch.items()})
                self._count += take
            yield batch


class ModelQuantizer:
    """Static post-training quantization of an ONNX model to QDQ, in phases.

    Args:
        config: a ``QuantConfig``, a preset name, a ``.json`` config path, or ``None``
            for ``a8w8``.
        preprocess_options: pre-processing passes (default: all exact ones).
        writer_options: encoding of the QDQ model (default: uint8 activations for x86).
        model_hooks: run on the pre-processed float model before planning.
        calibrated_hooks: run on the calibrated model before writing.
        qdq_hooks: run by :meth:`quantize` on the written QDQ model.
        hold_samples: calibration samples kept in memory for hooks and the report.
        share_concat_scales: Concat's inputs and output share one scale (range = union).
        evaluate: ``model -> score`` (higher is better) for mixed precision's
            ``evaluate`` metric.
        quiet: no progress bars.

    Example:
        >>> import numpy as np
        >>> from onnx import helper, TensorProto
        >>> g = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "g",
        ...     [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2])],
        ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])])
        >>> quantizer = ModelQuantizer("a8w8", quiet=True)
        >>> prepared = quantizer.prepare(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8))
        >>> calibrated = quantizer.calibrate(prepared, np.ones((4, 2), np.float32))
        >>> [n.op_type for n in quantizer.write(calibrated).model.graph.node]
        ['QuantizeLinear', 'DequantizeLinear', 'Add', 'QuantizeLinear', 'DequantizeLinear']
    """

    def __init__(
        self,
        config: QuantConfig | str | os.PathLike[str] | None = None,
        *,
        preprocess_options: PreprocessOptions | None = None,
        writer_options: WriterOptions | None = None,
        model_hooks: Sequence[ModelHook] = (),
        calibrated_hooks: Sequence[CalibratedHook] = (),
        qdq_hooks: Sequence[QDQHook] = (),
        hold_samples: int = 32,
        share_concat_scales: bool = True,
        evaluate: EvaluateFn | None = None,
        quiet: bool = False,
    ) -> None:
        check_in_range("hold_samples", hold_samples, lambda v: isinstance(v, int) and v >= 0, "an integer >= 0")
        self.config = resolve_config(config)
        self.preprocess_options = preprocess_options or PreprocessOptions()
        self.writer_options = writer_options or WriterOptions()
        self.model_hooks = tuple(model_hooks)
        self.calibrated_hooks = tuple(calibrated_hooks)
        self.qdq_hooks = tuple(qdq_hooks)
        self.hold_samples = hold_samples
        self.share_concat_scales = share_concat_scales
        self.evaluate = evaluate
        self.quiet = quiet

    def required_opset(self) -> int:
        """The opset the QDQ formats of this config need."""
        encoding = self.writer_options.activation_encoding
        return required_opset(
            encode_activation_dtype(s.dtype, encoding) for s in config_specs(self.config) if s.is_quantized
        )

    def prepare(self, model: ModelSource) -> PreparedModel:
        """Phase 1 (see the module docstring). ``model`` is never modified."""
        return self.replan(*self.preprocess(model))

    def preprocess(self, model: ModelSource) -> tuple[onnx.ModelProto, dict[str, int]]:
        """Phase 1 without the plan: the pre-processed float model (named nodes, the
        config's model hooks run) and what pre-processing changed."""
        loaded = load_float_model(model)
        options = self.preprocess_options
        if self.config.npu_conversions and not options.npu_conversions:
            options = attrs.evolve(options, npu_conversions=self.config.npu_conversions)
        needed = self.required_opset()
        if opset_version(loaded) < needed and (options.target_opset or 0) < needed:
            options = attrs.evolve(options, target_opset=needed)
        result = preprocess_with_report(loaded, options)
        float_model = result.model
        ensure_node_names(float_model)
        for hook in self.model_hooks:
            float_model = hook(float_model)
            ensure_node_names(float_model)
        return float_model, dict(result.changes)

    def replan(
        self, float_model: onnx.ModelProto, preprocess_changes: Mapping[str, int], *, graph: PlanGraph | None = None
    ) -> PreparedModel:
        """A :class:`PreparedModel` for an edited float model (same inputs and node names);
        ``graph``: its :func:`~quant_onnx.pipeline.annotate.plan_graph`, when already made."""
        plan = plan_model(float_model, self.config, share_concat_scales=self.share_concat_scales, graph=graph)
        return PreparedModel(float_model, plan, dict(preprocess_changes))

    def calibration_batches(
        self,
        prepared: PreparedModel,
        calibration_data: Any,
        *,
        num_samples: int | None = None,
        batch_size: int | None = None,
        image_options: ImageOptions | None = None,
    ) -> CalibrationReader:
        """Validated feeds for ``prepared``'s inputs (see :mod:`quant_onnx.data`)."""
        return CalibrationReader(
            prepared.model,
            calibration_data,
            batch_size=batch_size or self.config.calibration.batch_size,
            num_samples=num_samples if num_samples is not None else self.config.calibration.num_samples,
            image_options=image_options,
        )

    def calibrate(
        self,
        prepared: PreparedModel,
        calibration_data: Any,
        *,
        num_samples: int | None = None,
        batch_size: int | None = None,
        image_options: ImageOptions | None = None,
    ) -> CalibratedModel:
        """Phase 2 (see the module docstring). ``calibration_data``: see :func:`quantize`."""
        calibrated, _held = self._calibrate(prepared, calibration_data, num_samples, batch_size, image_options)
        return calibrated

    def _calibrate(
        self,
        prepared: PreparedModel,
        data: Any,
        num_samples: int | None,
        batch_size: int | None,
        image_options: ImageOptions | None,
    ) -> tuple[CalibratedModel, list[dict[str, np.ndarray]]]:
        batches = self.calibration_batches(
            prepared, data, num_samples=num_samples, batch_size=batch_size, image_options=image_options
        )
        held = _HeldBatches(batches, self.hold_samples)
        calibrated = calibrate(
            prepared.model,
            prepared.plan,
            held,
            total_batches=batches.num_batches(),
            quiet=self.quiet,
            input_means=input_mean_request(prepared.model, self.config),  # one float pass less
        )
        return self._after_calibration(calibrated, held.held), held.held

    def _after_calibration(self, calibrated: CalibratedModel, held: list[dict[str, np.ndarray]]) -> CalibratedModel:
        for hook in self.calibrated_hooks:
            calibrated = hook(calibrated, held)
        return calibrated

    def equalizes_in_calibration(self, prepared: PreparedModel) -> ActivationEqualizationConfig | None:
        """The activation equalization :meth:`quantize` measures in its calibration pass
        (:func:`~quant_onnx.algorithms.equalized_calibration.calibrate_with_equalization`)
        for ``prepared`` (the pre-processed model, planned): ``None`` unless it is the
        config's only pre-pass and every observer keeps min and max (it then runs as a
        pre-pass, before calibration). The search follows the same rule."""
        algorithm = self.equalization_only()
        return algorithm if algorithm is not None and one_pass_observers(prepared.plan) else None

    def equalization_only(self) -> ActivationEqualizationConfig | None:
        """The config's activation equalization where it is its only pre-pass (the first
        condition of :meth:`equalizes_in_calibration`, which needs no plan)."""
        before = schedule(self.config).before_calibration
        only = before[0] if len(before) == 1 else None
        return only if isinstance(only, ActivationEqualizationConfig) else None

    def _equalize_in_calibration(
        self,
        prepared: PreparedModel,
        feeds: list[Mapping[str, np.ndarray]],
        num_samples: int | None,
        batch_size: int | None,
        image_options: ImageOptions | None,
    ) -> tuple[PreparedModel, CalibratedModel, list[dict[str, np.ndarray]], dict[str, Any]] | None:
        """Activation equalization and calibration in one float pass
        (:mod:`quant_onnx.algorithms.equalized_calibration`): the equalized model, its
        calibration, the held samples and the equalization's report; ``None`` unless the
        equalization is the config's only pre-pass and every observer keeps min and max."""
        algorithm = self.equalizes_in_calibration(prepared)
        if algorithm is None:
            return None
        batches = self.calibration_batches(
            prepared, feeds, num_samples=num_samples, batch_size=batch_size, image_options=image_options
        )
        held = _HeldBatches(batches, self.hold_samples)
        planned: list[PreparedModel] = []

        def plan_of(model: onnx.ModelProto) -> QuantPlan:
            planned.append(self.replan(model, prepared.preprocess_changes))
            return planned[-1].plan

        result = calibrate_with_equalization(
            prepared.model,
            prepared.plan,
            self.config,
            algorithm,
            held,
            plan_of,
            total_batches=batches.num_batches(),
            quiet=self.quiet,
        )
        equalized = planned[-1]
        report = result.report.to_dict()
        if result.calibrated is None:
            calibrated, held_samples = self._calibrate(equalized, feeds, num_samples, batch_size, image_options)
            return equalized, calibrated, held_samples, report
        return equalized, self._after_calibration(result.calibrated, held.held), held.held, report

    def write(self, calibrated: CalibratedModel) -> WrittenModel:
        """Phase 3: the QDQ model, the notes writing it made and how each bias was stored."""
        return write_qdq_with_notes(calibrated, self.writer_options)

    def run_pre_passes(
        self, prepared: PreparedModel, feeds: Sequence[Mapping[str, np.ndarray]]
    ) -> tuple[PreparedModel, dict[str, Any]]:
        """The config's algorithms that edit the float model (CLE, SmoothQuant), as
        :meth:`quantize` runs them: the prepared model planned again after them (unchanged
        when none runs) and a report per algorithm."""
        pre = run_pre_passes(prepared.model, self.config, feeds, quiet=self.quiet)
        if pre.reports:
            prepared = self.replan(pre.model, prepared.preprocess_changes)
        return prepared, pre.reports

    def run_post_passes(
        self, calibrated: CalibratedModel, quantized: onnx.ModelProto, feeds: Sequence[Mapping[str, np.ndarray]]
    ) -> PassesResult:
        """The config's algorithms on the written QDQ model (mixed precision, AdaRound,
        AdaQuant, bias correction), as :meth:`quantize` runs them."""
        return run_post_passes(
            calibrated,
            quantized,
            self.config,
            feeds,
            writer_options=self.writer_options,
            share_concat_scales=self.share_concat_scales,
            evaluate=self.evaluate,
            quiet=self.quiet,
        )

    def quantize(
        self,
        model_in: ModelSource,
        model_out: str | os.PathLike[str] | None,
        calibration_data: Any,
        *,
        num_samples: int | None = None,
        batch_size: int | None = None,
        report_path: str | os.PathLike[str] | None = None,
        image_options: ImageOptions | None = None,
    ) -> QuantizationResult:
        """All phases; writes ``model_out`` (atomically) and ``report_path`` when given.
        Nothing is written when any input is invalid; both output locations are checked
        (folder exists and is writable, not the input) before any work."""
        input_path = model_in if isinstance(model_in, str | os.PathLike) else None
        data = {"the calibration data": calibration_data}
        check_output_paths(model_out, report_path, input_path=input_path, data=data)  # before any work
        prepared = self.prepare(model_in)
        feeds: list[Mapping[str, np.ndarray]] | None = None
        algorithm_reports: dict[str, Any] = {}
        one_pass = None
        if self.config.algorithms:
            feeds = list(
                self.calibration_batches(
                    prepared,
                    calibration_data,
                    num_samples=num_samples,
                    batch_size=batch_size,
                    image_options=image_options,
                )
            )
            image_options = None  # applied: the feeds are the folder's preprocessed samples
            one_pass = self._equalize_in_calibration(prepared, feeds, num_samples, batch_size, image_options)
            if one_pass is None:
                prepared, pre_reports = self.run_pre_passes(prepared, feeds)
                algorithm_reports.update(pre_reports)
            calibration_data = feeds
        if one_pass is not None:
            prepared, calibrated, held, algorithm_reports[ActivationEqualizationConfig.kind] = one_pass
        else:
            calibrated, held = self._calibrate(prepared, calibration_data, num_samples, batch_size, image_options)
        written = self.write(calibrated)
        quantized = written.model
        if feeds is not None:
            post = self.run_post_passes(calibrated, quantized, feeds)
            quantized = post.model
            calibrated = post.calibrated or calibrated
            algorithm_reports.update(post.reports)
        for hook in self.qdq_hooks:
            quantized = hook(quantized, calibrated, held)
        report = None
        if report_path is not None:
            comparison: Comparison | None = None
            if held:
                comparison = compare_models(prepared.model, quantized, held, quiet=True)
            files = {
                "input": None if input_path is None else str(input_path),
                "output": None if model_out is None else str(model_out),
            }
            report = build_report(
                calibrated,
                config=self.config,
                comparison=comparison,
                notes=written.notes,
                files=files,
                biases=written.biases,
                activation_encoding=self.writer_options.activation_encoding,
            )
            if algorithm_reports:
                report["algorithms"] = algorithm_reports
        path = None
        if model_out is not None:
            path = save_model(quantized, model_out, input_path=input_path)
        if report is not None and report_path is not None:
            write_report(report, report_path)
        notes = run_notes(calibrated, written.notes)
        return QuantizationResult(quantized, calibrated, report, path, algorithm_reports, notes, dict(written.biases))


def quantize(
    model_in: ModelSource,
    model_out: str | os.PathLike[str] | None,
    config: QuantConfig | str | os.PathLike[str] | None,
    calibration_data: Any,
    *,
    num_samples: int | None = None,
    batch_size: int | None = None,
    preprocess_options: PreprocessOptions | None = None,
    report_path: str | os.PathLike[str] | None = None,
    quiet: bool = False,
    image_options: ImageOptions | None = None,
    evaluate: EvaluateFn | None = None,
) -> QuantizationResult:
    """Quantize ``model_in`` (path, bytes or ModelProto; never modified) to a QDQ model at
    ``model_out`` (``None``: only returned) with ``config`` (a ``QuantConfig``, a preset
    name such as ``"a8w8"`` or ``"xint8"``, a ``.json`` path, or ``None`` for a8w8),
    calibrated on ``calibration_data``: an iterable of ``{input_name: array}`` dicts, an
    array (single-input models; first axis = samples), or a ``.npy``/``.npz``/image-folder
    path. ``evaluate``: the score mixed precision's ``evaluate`` metric uses. See the
    module docstring for the phases and the algorithms."""
    quantizer = ModelQuantizer(config, preprocess_options=preprocess_options, evaluate=evaluate, quiet=quiet)
    return quantizer.quantize(
        model_in,
        model_out,
        calibration_data,
        num_samples=num_samples,
        batch_size=batch_size,
        report_path=report_path,
        image_options=image_options,
    )
