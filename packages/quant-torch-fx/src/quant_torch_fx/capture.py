"""Capture a model with ``torch.export.export``, batch dimension dynamic by default.

Users capture with one sample and calibrate, train or evaluate with batches of 64 or
500, so the first axis of every tensor input that shares the first input's batch size
is a dynamic dimension. ``torch.export`` specialises a dimension of size 1, so a
batch-of-one example is captured as a batch of two (the sample repeated); the graph
then takes any batch size.

When ``torch.export`` fails, :func:`capture` raises a :class:`CaptureError` naming the
construct (torch's first message line), where it is (file and line), and the deepest
submodule that cannot be captured, with how to leave it out: quantize the capturable
submodules only (``regions=[...]``).

Example:
    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 2))
    >>> gm = capture(net, (torch.randn(1, 4),))
    >>> gm(torch.randn(5, 4)).shape
    torch.Size([5, 2])
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
import re
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch import nn
from torch.export import Dim
from torch.fx import GraphModule
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from quant_core.errors import CaptureError, DataError, ModelError
from quant_torch_fx.autocast_regions import inline_disabled_autocast
from quant_torch_fx.naming import module_paths

ModuleT = TypeVar("ModuleT", bound=nn.Module)


def copy_captured(model: ModuleT) -> ModuleT:
    """A deep copy of a module that holds captured graphs. Copying one makes torch 2.13's
    own pytree code warn that its ``LeafSpec`` check is deprecated: torch's warning, not
    something the user can act on, so it is silenced for this copy only."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
        return copy.deepcopy(model)


def as_args(example_inputs: Any) -> tuple[Any, ...]:
    """Example inputs as a positional-argument tuple (a lone tensor becomes a 1-tuple).

    Example:
        >>> len(as_args(torch.zeros(1))), len(as_args([torch.zeros(1), torch.zeros(2)]))
        (1, 2)
    """
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, list | tuple):
        return tuple(example_inputs)
    raise DataError(
        f"example_inputs: {type(example_inputs).__name__} is not allowed; allowed: a tensor or a tuple of tensors"
    )


def batched(args: tuple[Any, ...], dim: Any = None) -> tuple[tuple[Any, ...], Any]:
    """Arguments repeated to a batch of two where needed, and the dynamic-shape spec giving
    their batch dimension ``dim`` (default: any batch from 1 on)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.dim() > 0]
    if not tensors:
        return args, None
    batch = tensors[0].shape[0]
    dim = Dim("batch", min=1) if dim is None else dim
    shapes: list[Any] = []
    new_args: list[Any] = []
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.dim() > 0 and arg.shape[0] == batch:
            shapes.append({0: dim})
            new_args.append(torch.cat([arg, arg]) if batch == 1 else arg)
        else:
            shapes.append(None)
            new_args.append(arg)
    return tuple(new_args), tuple(shapes)


@contextlib.contextmanager
def quiet_torch() -> Iterator[None]:
    """torch's logs and prints silenced: ``torch.export`` prints the partial graph on
    failure, and the error raised from it says what matters."""
    quiet_logs = logging.getLogger("torch")
    level = quiet_logs.level
    quiet_logs.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        quiet_logs.setLevel(level)


def export_program(model: nn.Module, args: tuple[Any, ...], dynamic_shapes: Any) -> torch.export.ExportedProgram:
    with quiet_torch():
        return torch.export.export(model, args, dynamic_shapes=dynamic_shapes, strict=False)


def export_dynamic_batch(model: nn.Module, args: tuple[Any, ...]) -> torch.export.ExportedProgram:
    """``torch.export`` of ``model`` on ``args`` with a dynamic batch dimension (see :func:`batched`)."""
    capture_args, shapes = batched(args)
    try:
        return export_program(model, capture_args, shapes)
    except Exception as exc:
        # The model bounds its batch: on CUDA, eval-mode batch norm takes cuDNN's kernel for
        # batches up to 65535 only, and torch records that as a guard that any batch from 1
        # violates. Let torch choose the range it can prove (Dim.AUTO), as long as the batch
        # stays dynamic; the graph's guards are not checked when it runs.
        auto = getattr(Dim, "AUTO", None)
        if shapes is None or auto is None or "Constraints violated" not in str(exc):
            raise
        first_error = exc
    capture_args, shapes = batched(args, dim=auto)
    program = export_program(model, capture_args, shapes)
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder" and n.name in _user_inputs(program)]
    values = [n.meta.get("val") for n in placeholders]
    if not any(isinstance(v, torch.Tensor) and v.dim() and not is_concrete_int(v.shape[0]) for v in values):
        raise first_error  # the batch got fixed: the caller decides what a fixed batch means
    return program


def _user_inputs(program: torch.export.ExportedProgram) -> set[str]:
    return set(program.graph_signature.user_inputs)


def capture(
    model: nn.Module,
    example_inputs: Any,
    *,
    dynamic_batch: bool = True,
    dynamic_shapes: Any = None,
    diagnose: bool = True,
) -> GraphModule:
    """``torch.export`` graph module of a copy of ``model`` in eval mode (``model`` itself
    is not touched). ``dynamic_shapes`` overrides the dynamic batch; ``diagnose``: on
    failure, find the submodule that cannot be captured (captures each submodule)."""
    _check_float32(model, as_args(example_inputs))
    model_copy = copy.deepcopy(model).eval()
    args = as_args(example_inputs)
    try:
        if dynamic_shapes is None and dynamic_batch:
            program = export_dynamic_batch(model_copy, args)
        else:
            program = export_program(model_copy, args, dynamic_shapes)
    except Exception as exc:  # torch raises many unrelated types here
        raise CaptureError(_explain(model_copy, args, exc, diagnose)) from exc
    gm = program.module(check_guards=False)
    assert isinstance(gm, GraphModule)
    inline_disabled_autocast(gm)
    _note_batch_norm_updates(gm, model_copy)
    # ExportedProgram.module() makes train()/eval() raise; the prepared graph calls
    # batch-norm and dropout modules that follow the mode, so give the methods back.
    for method in ("train", "eval"):
        gm.__dict__.pop(method, None)
    return gm


def _check_float32(model: nn.Module, args: tuple[Any, ...]) -> None:
    """Refuse a float64, float16 or bfloat16 model or example input up front: the fake
    quantizers, the frozen model and the export compute in float32, and a model in another
    type would fail later, inside a convolution, naming no layer."""
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, value in named:
            if value.is_floating_point() and value.dtype != torch.float32:
                raise ModelError(
                    f"model {kind} '{name}' is {str(value.dtype).removeprefix('torch.')}; the torch backend "
                    "quantizes float32 models: call model.float() first (autocast regions inside may stay)"
                )
    for index, arg in enumerate(args):
        if isinstance(arg, torch.Tensor) and arg.is_floating_point() and arg.dtype != torch.float32:
            raise DataError(
                f"example input {index} is {str(arg.dtype).removeprefix('torch.')}; allowed: float32 "
                "(the model's own type): pass x.float()"
            )


#: Node meta key: ``(momentum, num_batches_tracked)`` of the ``nn.BatchNorm`` module a
#: captured ``batch_norm`` came from.
BATCH_NORM_UPDATES = "batch_norm_updates"


def _note_batch_norm_updates(gm: GraphModule, model: nn.Module) -> None:
    """Record how each batch norm module updates its statistics on the captured op: an
    eval-mode capture passes momentum 0.0 for ``momentum=None`` (a cumulative average, which
    also needs ``num_batches_tracked``), so the graph alone cannot tell it from a frozen one."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or "batch_norm" not in str(node.target):
            continue
        for path in reversed(module_paths(node)):
            try:
                module = model.get_submodule(path)
            except AttributeError:
                continue
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                tracked = module.num_batches_tracked
                node.meta[BATCH_NORM_UPDATES] = (module.momentum, None if tracked is None else int(tracked))
            break


def describe_failure(exc: BaseException) -> tuple[str, str]:
    """``(construct, location)`` from a ``torch.export`` error: its first line and the user
    code that raised it (``file:line: code``), or ``""`` when torch does not say.

    Example:
        >>> describe_failure(RuntimeError('Could not guard\\nThe following call raised this error:\\n  File "m.py", line 5, in forward\\n    if x.sum() > 0:\\n'))
        ('Could not guard', 'm.py:5 in forward: if x.sum() > 0:')
    """
    text = str(exc).strip()
    construct = text.splitlines()[0].strip() if text else type(exc).__name__
    construct = re.sub(r"\s+", " ", construct)[:300]
    lines = text.splitlines()
    location = ""
    frames = [i for i, line in enumerate(lines) if line.strip().startswith('File "')]
    torch_dir = os.path.dirname(torch.__file__)
    user = [i for i in frames if torch_dir not in lines[i]]
    if user:
        i = user[-1]
        match = re.search(r'File "([^"]+)", line (\d+), in (\S+)', lines[i])
        code = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if match:
            location = f"{match.group(1)}:{match.group(2)} in {match.group(3)}"
            location += f": {code}" if code else ""
    return construct, location


def record_inputs(
    model: nn.Module, args: tuple[Any, ...], keywords: dict[str, tuple[str, ...]] | None = None
) -> dict[str, tuple[Any, ...]]:
    """Each submodule's positional arguments on its first call while ``model`` runs (and in
    ``keywords``, when given, the names of the keyword arguments of the calls that pass any)."""
    recorded: dict[str, tuple[Any, ...]] = {}
    handles = []
    for name, module in model.named_modules():
        if not name:
            continue

        def hook(_module: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any], name: str = name) -> None:
            recorded.setdefault(name, inputs)
            if keywords is not None and kwargs:
                keywords.setdefault(name, tuple(kwargs))

        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(*args)
    except Exception:  # the model may not even run eagerly; diagnose with what was recorded
        pass
    finally:
        for handle in handles:
            handle.remove()
    return recorded


def _captures(module: nn.Module, inputs: tuple[Any, ...]) -> BaseException | None:
    try:
        export_program(module, inputs, None)
    except Exception as exc:
        return exc
    return None


def failing_submodule(
    model: nn.Module, args: tuple[Any, ...], max_depth: int = 8
) -> tuple[str, BaseException | None, list[str]]:
    """The deepest submodule that ``torch.export`` cannot capture (``""``: the model's own
    code), its error, and the top-level children that do capture."""
    recorded = record_inputs(model, args)
    capturable: list[str] = []
    for name, _child in model.named_children():
        if name in recorded and _captures(_child, recorded[name]) is None:
            capturable.append(name)
    path, error = "", None
    module = model
    for _ in range(max_depth):
        found = False
        for name, child in module.named_children():
            full = f"{path}.{name}" if path else name
            if full not in recorded:
                continue
            failure = _captures(child, recorded[full])
            if failure is not None:
                path, error, module, found = full, failure, child, True
                break
        if not found:
            break
    return path, error, capturable


def _explain(model: nn.Module, args: tuple[Any, ...], exc: BaseException, diagnose: bool) -> str:
    construct, location = describe_failure(exc)
    where = f" at {location}" if location else ""
    message = f"model: torch.export cannot capture {type(model).__name__}: {construct}{where}"
    if not diagnose:
        return message
    path, error, capturable = failing_submodule(model, args)
    if path:
        inner_construct, inner_location = describe_failure(error) if error is not None else (construct, location)
        kind = type(model.get_submodule(path)).__name__
        where = f" at {inner_location}" if inner_location else ""
        message = f"model: torch.export cannot capture submodule {path!r} ({kind}): {inner_construct}{where}"
    hint = _hint(path, capturable)
    return f"{message}; {hint}"


def _hint(path: str, capturable: Sequence[str]) -> str:
    top = path.split(".")[0] if path else ""
    others = [name for name in capturable if name != top]
    if others:
        regions = ", ".join(repr(n) for n in others)
        return (
            f"leave it out by quantizing only the submodules that capture: ModelQuantizer(config, regions=[{regions}]) "
            "(the rest runs in float), or rewrite the construct without data-dependent Python control flow"
        )
    return "rewrite the construct without data-dependent Python control flow, or quantize capturable submodules with regions=[...]"
