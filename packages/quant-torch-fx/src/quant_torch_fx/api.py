"""``ModelQuantizer``: the entry points users call.

    q = ModelQuantizer(qc.get_preset("xint8"))                      # any QuantConfig, a preset name or a JSON path
    qmodel = q.quantize_model(model, example_inputs, calib_loader)  # PTQ
    qat = q.prepare_qat(model, example_inputs)                      # QAT: train it like any module
    frozen = q.freeze(qmodel_or_qat)                                # qparams fixed, BN folded, bias int32
    q.export_onnx(frozen, example_inputs, "model_qdq.onnx")         # QDQ ONNX that onnxruntime runs

The model is captured with ``torch.export`` (batch axis dynamic), mapped onto the
planner (:mod:`quant_core.plan`: the same decisions as the ONNX backend for the same
config), instrumented with fake-quantize modules holding ``quant_core`` observers, and
calibrated or trained. The input model is never modified.

Partial quantization: ``exclude_modules`` (module-path globs) and
``exclude_module_types`` leave those modules' nodes float (the config's ``exclude``
matches node names, ``"<module path>/<op>"``); ``regions`` captures and quantizes only
the named submodules, the rest of the model runs (and exports) in float, which is also
how a model ``torch.export`` cannot capture as a whole is quantized.

The accuracy algorithms of a config run with :meth:`ModelQuantizer.quantize_model`
through the backend-neutral drivers of ``quant_algos`` (:mod:`quant_torch_fx.algorithms`):
CLE on the normalised float graph before planning, AdaRound, AdaQuant and bias
correction on the calibrated graph, in the ONNX backend's order. Mixed precision and
SmoothQuant are refused (quant-onnx runs them) rather than silently skipped.

Example:
    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(16, 2))
    >>> q = ModelQuantizer("xint8", quiet=True)
    >>> qmodel = q.quantize_model(net, torch.randn(1, 1, 4, 4), [torch.randn(8, 1, 4, 4) for _ in range(2)])
    >>> qmodel(torch.randn(3, 1, 4, 4)).shape
    torch.Size([3, 2])
"""

from __future__ import annotations

import copy
import fnmatch
import itertools
import os
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quant_algos.drivers.schedule import schedule
from quant_core.algorithm_config import ActivationEqualizationConfig, AlgorithmConfig, BiasCorrectionConfig
from quant_core.config import QuantConfig
from quant_core.errors import ConfigError, DataError, listed
from quant_core.plan import check_selectors
from quant_core.presets import resolve_config
from quant_core.qdq import ActivationEncoding
from quant_torch_fx.algorithms.passes import (
    SUPPORTED,
    check_algorithms,
    pre_pass,
    require_data,
    run_post_passes,
)
from quant_torch_fx.calibrate import (
    calibrate,
    calibrating,
    check_num_batches,
    finish_calibration,
    model_device,
    run_batches,
)
from quant_torch_fx.capture import as_args, capture, record_inputs
from quant_torch_fx.data import InputSignature, batches, keep_signature
from quant_torch_fx.distributed import gathered_batches
from quant_torch_fx.export import DEFAULT_OPSET, export_onnx
from quant_torch_fx.freeze import freeze
from quant_torch_fx.prepare import graph_info, prepare_graph, quantized_graphs
from quant_torch_fx.qat import QAT_METHODS, enable_qat


class ModelQuantizer:
    """Graph-mode PTQ and QAT of ``nn.Module`` s with one ``quant_core`` config.

    Args:
        config: a ``QuantConfig``, a preset name, a ``.json`` config path, or ``None`` (``a8w8``).
        exclude_modules: module-path globs whose nodes stay float (``"head"``, ``"layer4.*"``).
        exclude_module_types: module types whose nodes stay float (``torch.nn.Hardswish``).
        regions: quantize only these submodules (each captured on its own); the rest runs in float.
        dynamic_batch: capture with a dynamic batch axis (default).
        share_concat_scales: Concat's inputs and output share one scale (the planner's default).
        qat_method: ``"auto"`` (TQT for power-of-two specs, LSQ for float scales), ``"lsq"``,
            ``"tqt"`` or ``"ste"`` (qparams fixed from calibration, straight-through gradients).
        compile_fake_quant: QAT's power-of-two fake quantization through ``torch.compile``
            on CPU (needs a C++ compiler; the first steps compile). On a GPU compile the
            whole prepared model instead (``train_qat(..., compile_model=True)``).
        quiet: no progress bars.

    Example:
        >>> ModelQuantizer("xint8").config.name
        'xint8'
    """

    def __init__(
        self,
        config: QuantConfig | str | os.PathLike[str] | None = None,
        *,
        exclude_modules: Sequence[str] = (),
        exclude_module_types: Collection[type] = (),
        regions: Sequence[str] | None = None,
        dynamic_batch: bool = True,
        share_concat_scales: bool = True,
        qat_method: str = "auto",
        compile_fake_quant: bool = False,
        quiet: bool = False,
    ) -> None:
        self.config = resolve_config(config)
        check_algorithms(self.config)
        for field, flag in (
            ("dynamic_batch", dynamic_batch),
            ("share_concat_scales", share_concat_scales),
            ("compile_fake_quant", compile_fake_quant),
            ("quiet", quiet),
        ):
            if not isinstance(flag, bool):  # "no" and 0.0 would read as one another's opposite
                raise ConfigError(f"{field}: {flag!r} is not allowed; allowed: true, false")
        exclude_modules = _as_list(exclude_modules, "exclude_modules", "module-path globs")
        exclude_module_types = _as_list(exclude_module_types, "exclude_module_types", "nn.Module subclasses")
        if regions is not None:
            regions = _as_list(regions, "regions", "submodule paths")
            if not regions:  # quantizing nothing is no quantization at all
                raise ConfigError("regions: [] is not allowed; allowed: a list of submodule paths, or None (all)")
        # The preset corrections left out, and why (they run on a model captured whole).
        self.left_out: tuple[tuple[str, ...], str] | None = None
        if regions is not None:
            self.config, kinds = _without_corrections(self.config)
            if kinds:
                self.left_out = (kinds, "left out: it runs on a model captured whole, not with regions")
        if self.config.algorithms and regions is not None:
            raise ConfigError("regions: the config's algorithms run on a model captured whole; allowed with them: None")
        if qat_method not in QAT_METHODS:
            raise ConfigError(f"qat_method: {qat_method!r} is not allowed; allowed: {', '.join(QAT_METHODS)}")
        for name in regions or ():
            if not isinstance(name, str) or not name:
                raise ConfigError(f"regions: {name!r} is not allowed; allowed: submodule paths such as 'backbone'")
        for pattern in exclude_modules:
            if not isinstance(pattern, str):
                raise ConfigError(f"exclude_modules: {pattern!r} is not allowed; allowed: module-path globs (strings)")
        for kind in exclude_module_types:
            if not (isinstance(kind, type) and issubclass(kind, nn.Module)):
                raise ConfigError(
                    f"exclude_module_types: {kind!r} is not allowed; allowed: nn.Module subclasses such as "
                    "torch.nn.Hardswish"
                )
        self.exclude_modules = tuple(exclude_modules)
        self.exclude_module_types = tuple(exclude_module_types)
        self.regions = None if regions is None else tuple(regions)
        self.dynamic_batch = dynamic_batch
        self.share_concat_scales = share_concat_scales
        self.qat_method = qat_method
        self.compile_fake_quant = compile_fake_quant
        self.quiet = quiet

    # ---------------------------------------------------------------------------- capture
    def prepare(
        self,
        model: nn.Module,
        example_inputs: Any,
        *,
        mode: str = "ptq",
        float_pass: Callable[[torch.fx.GraphModule], dict[str, Any]] | None = None,
        fold_batch_norms: bool | None = None,
    ) -> nn.Module:
        """The instrumented model, not yet calibrated (``mode``: ``"ptq"`` or ``"qat"``).
        ``float_pass`` edits the normalised float graph before planning (CLE);
        ``fold_batch_norms`` (default: PTQ only) folds batch norm into the convolutions."""
        check_model(model)
        args = as_args(example_inputs)
        self._check_exclusions(model)
        excluded = self._excluded_types(model)
        if self.regions is None:
            gm = capture(model, args, dynamic_batch=self.dynamic_batch)
            prepared = self._instrument(gm, mode, excluded, float_pass, fold_batch_norms)
            keep_signature(prepared, self.signature(example_inputs))
            return prepared
        root = copy.deepcopy(model).eval()
        keywords: dict[str, tuple[str, ...]] = {}
        recorded = record_inputs(root, args, keywords)
        names = sorted(self.regions)
        for a, b in itertools.pairwise(names):
            if b.startswith(a + "."):
                raise ConfigError(f"regions: {b!r} lies inside {a!r}; allowed: regions that do not nest")
        for name in self.regions:
            try:
                sub = root.get_submodule(name)
            except AttributeError:
                raise ConfigError(f"regions: {name!r} is not a submodule of {type(model).__name__}") from None
            if name not in recorded:
                raise ConfigError(f"regions: {name!r} is not called when the model runs on the example inputs")
            if name in keywords:  # the captured region takes its positional arguments only
                raise ConfigError(
                    f"regions: {name!r} is called with keyword arguments ({', '.join(keywords[name])}); "
                    "allowed: submodules called with positional arguments only"
                )
            gm = capture(sub, recorded[name], dynamic_batch=self.dynamic_batch)
            root.set_submodule(
                name, self._instrument(gm, mode, excluded, None, fold_batch_norms, check_selectors=False)
            )
        _check_region_reads(model, root, args, self.regions)
        plans = [graph_info(gm).plan for gm in quantized_graphs(root)]
        check_selectors(
            self.config,
            [
                pair
                for plan in plans
                for pair in (*plan.quantized_nodes, *((f.name, f.op_type) for f in plan.float_nodes))
            ],
        )
        keep_signature(root, self.signature(example_inputs))
        return root

    def _check_exclusions(self, model: nn.Module) -> None:
        """Every ``exclude_modules`` glob names a module (a typo would quietly quantize what
        the user meant to keep float). Globs match module paths from the model's root, or
        from a region's root when ``regions`` are given."""
        roots = [""] if self.regions is None else [f"{name}." for name in self.regions]
        paths = [
            name[len(root) :]
            for name, _module in model.named_modules()
            for root in roots
            if name and name.startswith(root)
        ]
        for pattern in self.exclude_modules:
            if not any(fnmatch.fnmatchcase(path, pattern) for path in paths):
                shown = ", ".join(paths[:8]) + (", ..." if len(paths) > 8 else "")
                raise ConfigError(
                    f"exclude_modules: {pattern!r} matches no module of {type(model).__name__}; "
                    f"allowed: globs over its module paths ({shown})"
                )

    def _excluded_types(self, model: nn.Module) -> tuple[type, ...]:
        """``exclude_module_types`` with the model's own subclasses of them: graph nodes name
        each module's own class, and a subclass of an excluded type is that type."""
        wanted = self.exclude_module_types
        found = {type(m) for m in model.modules() if wanted and isinstance(m, wanted)} - set(wanted)
        return (*wanted, *sorted(found, key=lambda t: f"{t.__module__}.{t.__qualname__}"))

    def _instrument(
        self,
        gm: torch.fx.GraphModule,
        mode: str,
        excluded_types: tuple[type, ...],
        float_pass: Callable[[torch.fx.GraphModule], dict[str, Any]] | None = None,
        fold_batch_norms: bool | None = None,
        *,
        check_selectors: bool = True,
    ) -> torch.fx.GraphModule:
        prepared = prepare_graph(
            gm,
            self.config,
            mode=mode,
            exclude_modules=self.exclude_modules,
            exclude_module_types=excluded_types,
            share_concat_scales=self.share_concat_scales,
            float_pass=float_pass,
            fold_batch_norms=fold_batch_norms,
            check_selectors=check_selectors,
        )
        if self.left_out is not None:
            _report_left_out(prepared, *self.left_out)
        return prepared

    def signature(self, example_inputs: Any) -> InputSignature:
        """What a data batch must look like (the example inputs' shapes, any batch size)."""
        return InputSignature.of(as_args(example_inputs), self.dynamic_batch)

    # -------------------------------------------------------------------------------- PTQ
    def quantize_model(
        self, model: nn.Module, example_inputs: Any, calib_loader: Iterable[Any], *, num_batches: int | None = None
    ) -> nn.Module:
        """Post-training quantization: capture, plan, calibrate on ``calib_loader`` (tensors
        or ``(tensor, label)`` batches; a list works; its first ``config.calibration.num_samples``
        samples when the config sets them, as in the ONNX backend). Returns the fake-quantized
        model in eval mode; ``model`` is not modified."""
        check_model(model)
        check_num_batches(num_batches)
        if not self.config.algorithms:
            prepared = self.prepare(model, example_inputs, mode="ptq")
            calibrate(
                prepared,
                calib_loader,
                self.signature(example_inputs),
                num_batches=num_batches,
                num_samples=self.config.calibration.num_samples,
                quiet=self.quiet,
            )
            return prepared.eval()
        # The algorithms read the calibration set several times: it is held (on the model's
        # device), and under torch.distributed they read every rank's (the same model on all).
        held = self._hold(calib_loader, model, example_inputs, num_batches)
        union = gathered_batches(held)
        prepared = self.prepare(model, example_inputs, mode="ptq", float_pass=pre_pass(self.config, union))
        calibrate(prepared, held, self.signature(example_inputs), quiet=self.quiet)  # observers merge across ranks
        assert isinstance(prepared, torch.fx.GraphModule)
        run_post_passes(prepared, self.config, union, quiet=self.quiet)
        return prepared.eval()

    def _hold(self, loader: Iterable[Any], model: nn.Module, example_inputs: Any, num_batches: int | None) -> list[Any]:
        """The loader's first ``num_batches`` checked batches, on the model's device, as a list
        (for passes that read the calibration set more than once)."""
        signature = self.signature(example_inputs)
        num_samples = self.config.calibration.num_samples
        held = list(itertools.islice(batches(loader, signature, model_device(model), num_samples), num_batches))
        if not held:
            raise DataError("calibration: the data loader yielded no batches")
        return held

    def calibrate(
        self, prepared: nn.Module, calib_loader: Iterable[Any], example_inputs: Any, *, num_batches: int | None = None
    ) -> nn.Module:
        """(Re)calibrate a prepared model in place: activation observers over the data, then
        qparams (learnable QAT parameters start from them)."""
        signature = self.signature(example_inputs)
        with calibrating(prepared) as observing:
            run_batches(
                prepared,
                calib_loader,
                signature,
                num_batches=num_batches,
                num_samples=self.config.calibration.num_samples,
                quiet=self.quiet,
            )
            finish_calibration(prepared, observing)
        return prepared

    # -------------------------------------------------------------------------------- QAT
    def prepare_qat(
        self,
        model: nn.Module,
        example_inputs: Any,
        *,
        calib_loader: Iterable[Any] | None = None,
        num_batches: int | None = None,
        fold_batch_norm: bool = False,
    ) -> nn.Module:
        """A model to train with quantization in the loop (train mode). Batch norm after a
        convolution is simulated folded, or with ``fold_batch_norm`` folded into it now (its
        statistics final: what training with ``freeze_batch_norm=True`` does anyway, at less
        cost per step); the config's algorithms then run as ``quantize_model`` runs them
        (CLE on the folded float graph; AdaRound, AdaQuant and bias correction after the
        calibration over ``calib_loader``), so training starts from the PTQ model.
        Learnable qparams (``qat_method``) start from a calibration over ``calib_loader``
        when given, else from the first training batch."""
        check_model(model)
        config = self.config
        left_out: tuple[str, ...] = ()
        if not (fold_batch_norm and calib_loader is not None):
            # They rewrite folded weights and biases from calibration data; without both,
            # QAT trains around what they would even out and learns the biases itself.
            config, left_out = _without_corrections(config)
        kinds = [type(a).kind for a in config.algorithms]
        allowed = SUPPORTED if fold_batch_norm else ()
        refused = [kind for kind in kinds if kind not in allowed]
        if refused:
            raise ConfigError(
                f"config.algorithms: {', '.join(refused)} run with quantize_model (PTQ); allowed with QAT: "
                f"{', '.join(SUPPORTED)}, with fold_batch_norm=True"
            )
        post = [a.kind for a in schedule(config, SUPPORTED, backend="torch").after_calibration]
        require_data(post, calib_loader)
        float_pass = None
        union = None
        if config.algorithms:
            if calib_loader is not None:  # read several times: by CLE's checks, the calibration, the passes
                calib_loader = self._hold(calib_loader, model, example_inputs, num_batches)
                union = gathered_batches(calib_loader)  # as quantize_model: every rank's, for the algorithms
            float_pass = pre_pass(config, union)
        prepared = self.prepare(
            model, example_inputs, mode="qat", float_pass=float_pass, fold_batch_norms=fold_batch_norm
        )
        if left_out:
            _report_left_out(
                prepared, left_out, "left out: it runs under QAT with fold_batch_norm=True and a calib_loader"
            )
        enable_qat(prepared, self.qat_method, compiled=self.compile_fake_quant)
        if calib_loader is not None:
            self.calibrate(prepared, calib_loader, example_inputs, num_batches=num_batches)
        elif self.qat_method == "ste":
            raise ConfigError("prepare_qat: qat_method 'ste' keeps calibrated qparams; pass calib_loader")
        if post:
            assert isinstance(prepared, torch.fx.GraphModule) and union is not None
            run_post_passes(prepared.eval(), config, union, quiet=self.quiet)
            # Training goes on from the learned codes, and freezing keeps the qparams QAT learns.
            graph_info(prepared).fixed_weights.clear()
        return prepared.train()

    # ------------------------------------------------------------------------ freeze, export
    def freeze(self, model: nn.Module) -> nn.Module:
        """A frozen copy (see :mod:`quant_torch_fx.freeze`)."""
        return freeze(model)

    def export_onnx(
        self,
        model: nn.Module,
        example_inputs: Any,
        path: str | os.PathLike[str],
        *,
        opset: int = DEFAULT_OPSET,
        activation_encoding: ActivationEncoding = "x86_uint8",
        input_names: Sequence[str] | None = None,
        output_names: Sequence[str] | None = None,
    ) -> Path:
        """Write the QDQ ONNX model of ``model`` (frozen first if it is not) to ``path``,
        atomically."""
        graphs = quantized_graphs(model)
        frozen = model if graphs and all(graph_info(g).frozen for g in graphs) else freeze(model)
        return export_onnx(
            frozen,
            example_inputs,
            path,
            opset=opset,
            activation_encoding=activation_encoding,
            dynamic_batch=self.dynamic_batch,
            input_names=input_names,
            output_names=output_names,
        )

    def report(self, model: nn.Module) -> dict[str, Any]:
        """What was decided: per graph, quantized and float nodes (with reasons) and notes."""
        graphs = {}
        for index, gm in enumerate(quantized_graphs(model)):
            info = graph_info(gm)
            graphs[str(index)] = {
                "quantized_nodes": [name for name, _op in info.plan.quantized_nodes],
                "float_nodes": [
                    {"name": f.name, "op_type": f.op_type, "reason": f.reason} for f in info.plan.float_nodes
                ],
                "notes": [*info.plan.notes, *info.notes],
                "algorithms": dict(info.algorithms),
            }
        return graphs


def _check_region_reads(model: nn.Module, root: nn.Module, args: tuple[Any, ...], regions: Sequence[str]) -> None:
    """The model runs with its regions captured: a parent that reads a region's attributes
    (``nn.TransformerEncoderLayer`` reads ``self_attn.batch_first``) finds a graph module
    without them. The quantizers pass values through until calibration."""
    try:
        with torch.no_grad():
            root(*args)
    except AttributeError as exc:
        if "GraphModule" not in str(exc):
            raise
        attribute = exc.name or str(exc).rsplit(" ", 1)[-1].strip("'")
        readers = [name for name in regions if hasattr(model.get_submodule(name), attribute)] or list(regions)
        raise ConfigError(
            f"regions: {type(model).__name__} reads {attribute!r} of region {readers[0]!r}, which a captured "
            "region does not keep; allowed: submodules their parent only calls (quantize the parent)"
        ) from None


def _as_list(value: Any, field: str, allowed: str) -> tuple[Any, ...]:
    """``value``'s items: a bare string or type is refused, not taken as the list the user
    meant (a string would be iterated character by character)."""
    return listed(value, field, f"a list of {allowed}", single=False, any_iterable=True)


def check_model(model: Any) -> None:
    """``model`` is an ``nn.Module`` (a function would fail deep inside the capture)."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model: {type(model).__name__} is not allowed; allowed: a torch.nn.Module")


def _is_preset_correction(algorithm: AlgorithmConfig) -> bool:
    """Activation equalization and the analytic bias correction: what the 8-bit presets
    carry, left out (with a note) where the torch backend cannot run them, not refused."""
    return isinstance(algorithm, ActivationEqualizationConfig) or (
        isinstance(algorithm, BiasCorrectionConfig) and algorithm.analytic
    )


def _without_corrections(config: QuantConfig) -> tuple[QuantConfig, tuple[str, ...]]:
    """``config`` without its preset corrections, and their kinds."""
    kept = tuple(a for a in config.algorithms if not _is_preset_correction(a))
    left = tuple(a.kind for a in config.algorithms if _is_preset_correction(a))
    return (config.evolve(algorithms=kept) if left else config), left


def _report_left_out(prepared: nn.Module, kinds: Sequence[str], why: str) -> None:
    """Say in the model's report why the config's corrections ``kinds`` did not run."""
    for kind in kinds:
        entry: dict[str, Any] = {"notes": [why]}
        if kind == ActivationEqualizationConfig.kind:
            entry["equalized"] = []
        graph_info(prepared).algorithms[kind] = entry
