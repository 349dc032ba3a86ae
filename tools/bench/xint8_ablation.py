"""What a power-of-two (``xint8``) transformer file loses, by tensor class: each class of
quantized tensors swapped to float, then to 16 bits, the rest as written; the file in
onnxruntime (default session), scored against the float file.

The files are the zoo's (``python -m tools.bench.zoo --models vit_tiny --quick --size 96
--no-measures --threads 1 --preset xint8 --no-pt2e`` writes ``.cache/bench/zoo/files/
vit_tiny_float.onnx`` and ``vit_tiny_quant_onnx.onnx``), the data the zoo's evaluation and
calibration noise. A class is a set of activation tensors (their QuantizeLinear/
DequantizeLinear pairs) and constants (their DequantizeLinear), recognised from the
scope names torch's ONNX exporter gives timm's ViT/DeiT (``/blocks/blocks.N/attn/...``)
and the graph around each Softmax (:func:`classes`).

"16 bits" is a power-of-two int16 grid on the tensor's min-max range (the float file's
values on the calibration noise for an activation, the float weight for a constant): the
residual stream's format, here given to another class. The 8-bit rows (``rules``) keep
the format and change one position rule: the softmax output on its observed range or on
an unsigned ``[0, 1]`` grid, the linear weights at the position of least squared error.

Example:
    $ python -m tools.bench.zoo --models vit_tiny --quick --size 96 --no-measures --threads 1 --preset xint8 --no-pt2e
    $ python -m tools.bench.xint8_ablation --models vit_tiny
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a file: make `tools.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench.qdq_ablation import FILES, float_values, print_rows, score, without_qdq

INT16_MAX = 32767
LINEARS = ("attn/qkv", "attn/proj", "mlp/fc1", "mlp/fc2")


class FileView:
    """The Q/DQ structure of a quantized file: each activation QuantizeLinear by the tensor
    it reads, each constant DequantizeLinear by its constant, and who reads what."""

    def __init__(self, model: Any) -> None:
        graph = model.graph
        self.model = model
        self.inits = {t.name: t for t in graph.initializer}
        self.producer = {out: node for node in graph.node for out in node.output}
        self.readers: dict[str, list[Any]] = {}
        for node in graph.node:
            for name in node.input:
                self.readers.setdefault(name, []).append(node)
        self.quantize = {
            n.input[0]: n for n in graph.node if n.op_type == "QuantizeLinear" and n.input[0] not in self.inits
        }
        self.constants = {
            n.input[0]: n for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] in self.inits
        }

    def bits(self, tensor: str) -> int:
        """Bits of the activation ``tensor``'s codes."""
        return self.constant_bits(self.quantize[tensor].input[2])

    def real_readers(self, tensor: str) -> list[Any]:
        """Readers of ``tensor`` looking through its Q -> DQ copies."""
        found = []
        for node in self.readers.get(tensor, []):
            if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
                found += self.real_readers(node.output[0])
            else:
                found.append(node)
        return found

    def real_producer(self, tensor: str) -> Any | None:
        """The node computing ``tensor``, looking back through DQ -> Q copies."""
        node = self.producer.get(tensor)
        while node is not None and node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            node = self.producer.get(node.input[0])
        return node

    def is_constant(self, tensor: str) -> bool:
        node = self.real_producer(tensor)
        inputs = {i.name for i in self.model.graph.input}
        return (node is None and tensor not in inputs) or (node is not None and node.op_type == "Constant")

    def constant_bits(self, name: str) -> int:
        return int(np.dtype(self._np_type(self.inits[name].data_type)).itemsize * 8)

    @staticmethod
    def _np_type(data_type: int) -> Any:
        from onnx import helper

        return helper.tensor_dtype_to_np_dtype(data_type)


def _attention_sets(view: FileView) -> tuple[set[str], set[str]]:
    """(the scores: Q.K^T output to the softmax input; the attention output: attn.V output
    to the projection's input), as computed tensor names."""
    scores: set[str] = set()
    after: set[str] = set()
    for node in view.model.graph.node:
        if node.op_type != "Softmax":
            continue
        tensor = node.input[0]
        while (producer := view.real_producer(tensor)) is not None:
            scores.add(producer.output[0])
            if producer.op_type == "MatMul":
                break
            tensor = next(i for i in producer.input if not view.is_constant(i))
        frontier = [node.output[0]]
        while frontier:
            for reader in view.real_readers(frontier.pop()):
                out = reader.output[0]
                if reader.op_type == "MatMul" and any(view.is_constant(i) for i in reader.input):
                    continue  # the projection: its product is a linear's
                if out not in after and reader.op_type != "Softmax":
                    after.add(out)
                    frontier.append(out)
    return scores, after


def activation_class(view: FileView, tensor: str, scores: set[str], after: set[str]) -> str:
    """The class of the activation ``tensor`` (names of timm's ViT/DeiT ONNX export)."""
    producer = view.real_producer(tensor)
    op = producer.op_type if producer is not None else ""
    if view.bits(tensor) >= 16:
        return "residual stream (16-bit already)"
    if "/blocks/" not in tensor:
        if tensor == "input" or tensor.startswith("/patch_embed") or op in ("Expand", "Concat"):
            return "patch embedding (input, Conv output) and tokens"
        return "head (final norm, class token(s), logits)"
    if op == "LayerNormalization":
        return "LayerNorm outputs (qkv / fc1 inputs)"
    if op == "MatMul" and any(f"/{linear}/" in tensor for linear in LINEARS):
        return "linear products before the bias Add"
    if "/mlp/fc1/" in tensor:
        return "GELU input (fc1 output)"
    if "/mlp/act/" in tensor:
        return (
            "GELU output (fc2 input)"
            if any(r.op_type == "MatMul" for r in view.real_readers(tensor))
            else ("GELU internals")
        )
    if "/attn/proj/" in tensor or "/mlp/fc2/" in tensor:
        return "branch outputs (proj / fc2 into the residual Add)"
    if op == "Softmax":
        return "softmax output"
    if tensor in scores:
        return "attention scores (Q.K^T into softmax)"
    if tensor in after:
        return "attention output (attn.V, proj input)"
    if "/attn/" in tensor:
        return "Q, K, V (qkv output to the Q.K^T / attn.V inputs)"
    return "other"


def constant_class(view: FileView, name: str) -> str:
    """The class of the quantized constant ``name`` (the DequantizeLinear's input) by what reads it."""
    dq = view.constants[name]
    readers = view.readers.get(dq.output[0], [])
    out = readers[0].output[0] if readers else ""
    op = readers[0].op_type if readers else ""
    original = name.removesuffix("_quantized")
    if op in ("MatMul", "Gemm", "Conv") and readers[0].input[1] == dq.output[0]:
        if "/attn/" in out:
            return "weights: attention linears (qkv, proj)"
        if "/mlp/" in out:
            return "weights: MLP linears (fc1, fc2)"
        if "patch_embed" in out:
            return "weights: patch embedding"
        return "weights: head"
    if original.endswith(".bias") or op in ("Conv", "Gemm"):
        return "biases"
    if original.endswith(("_token", "pos_embed")):
        return "tokens and position embedding"
    return "constant operands (attention scale, GELU constants)"


def classes(view: FileView) -> dict[str, tuple[set[str], set[str]]]:
    """label -> (activation tensors, constants) of every class in ``view``'s file."""
    scores, after = _attention_sets(view)
    found: dict[str, tuple[set[str], set[str]]] = {}
    for tensor in view.quantize:
        found.setdefault(activation_class(view, tensor, scores, after), (set(), set()))[0].add(tensor)
    for name in view.constants:
        found.setdefault(constant_class(view, name), (set(), set()))[1].add(name)
    return dict(sorted(found.items()))


# ----------------------------------------------------------------------------- transformations
def _copy(model: Any) -> Any:
    import onnx

    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def _pow2_scale(magnitude: float, qmax: int) -> float:
    """The finest power-of-two step whose ``qmax`` codes hold ``magnitude`` (min-max)."""
    return 2.0 ** math.ceil(math.log2(magnitude / qmax)) if magnitude > 0 else 1.0


def _domain_for(node: Any, dtype: Any) -> None:
    """Opset 17's QuantizeLinear/DequantizeLinear take 8-bit types only: 16-bit codes go to
    onnxruntime's ``com.microsoft`` ops (as quant-onnx writes the residual stream)."""
    if np.dtype(dtype).itemsize > 1:
        node.domain = "com.microsoft"


def requantized_activations(model: Any, grids: dict[str, tuple[float, Any]]) -> Any:
    """A copy of ``model`` whose activation Q/DQ pairs of ``grids`` (tensor -> (scale, zero
    point dtype)) use that scale and a zero zero point of that dtype."""
    from onnx import numpy_helper

    out = _copy(model)
    view = FileView(out)
    for tensor, (scale, dtype) in grids.items():
        q = view.quantize[tensor]
        scale_name, zp_name = f"{tensor}_ablation_scale", f"{tensor}_ablation_zero_point"
        out.graph.initializer.extend(
            [
                numpy_helper.from_array(np.array(scale, np.float32), scale_name),
                numpy_helper.from_array(np.array(0, dtype), zp_name),
            ]
        )
        for node in [q, *(d for d in view.readers.get(q.output[0], []) if d.op_type == "DequantizeLinear")]:
            node.input[1], node.input[2] = scale_name, zp_name
            _domain_for(node, dtype)
    return out


def requantized_constants(model: Any, values: dict[str, np.ndarray], scales: dict[str, float], dtype: Any) -> Any:
    """A copy of ``model`` whose quantized constants ``scales`` (name -> scale) are the float
    ``values`` (same names) rounded to that scale in ``dtype`` (symmetric, zero point 0)."""
    from onnx import numpy_helper

    out = _copy(model)
    view = FileView(out)
    info = np.iinfo(dtype)
    for name, scale in scales.items():
        dq = view.constants[name]
        codes = np.clip(np.round(values[name] / scale), -info.max, info.max).astype(dtype)
        stem = f"{name}_ablation"
        out.graph.initializer.extend(
            [
                numpy_helper.from_array(codes, f"{stem}_codes"),
                numpy_helper.from_array(np.array(scale, np.float32), f"{stem}_scale"),
                numpy_helper.from_array(np.array(0, dtype), f"{stem}_zero_point"),
            ]
        )
        dq.input[0], dq.input[1], dq.input[2] = f"{stem}_codes", f"{stem}_scale", f"{stem}_zero_point"
        _domain_for(dq, dtype)
        if len(dq.attribute):
            del dq.attribute[:]  # per-tensor now: no axis
    return out


def floated_constants(model: Any, values: dict[str, np.ndarray], names: set[str]) -> Any:
    """A copy of ``model`` whose quantized constants ``names`` are their float ``values``."""
    from onnx import numpy_helper

    out = _copy(model)
    view = FileView(out)
    added = [numpy_helper.from_array(values[n].astype(np.float32), view.constants[n].output[0]) for n in names]
    kept = [n for n in out.graph.node if not (n.op_type == "DequantizeLinear" and n.input[0] in names)]
    del out.graph.node[:]
    out.graph.node.extend(kept)
    out.graph.initializer.extend(added)
    return out


def mse_position(value: np.ndarray, qmax: int = 127) -> float:
    """The power-of-two step of least squared error for ``value`` on ``qmax`` codes (symmetric),
    searched from the min-max step down 8 positions.

    Example:
        >>> w = np.random.default_rng(0).normal(0, 0.02, 4096)
        >>> mse_position(w) <= _pow2_scale(float(np.abs(w).max()), 127)
        True
    """
    top = _pow2_scale(float(np.abs(value).max()), qmax)

    def error(step: float) -> float:
        return float(np.mean((np.clip(np.round(value / step), -qmax, qmax) * step - value) ** 2))

    return min((top / 2**k for k in range(9)), key=error)


# ------------------------------------------------------------------------------------ the table
class Ablation:
    """One model's files, data and reference, and the variants scored on them."""

    def __init__(self, name: str, num_eval: int, num_calib: int) -> None:
        import onnx
        import onnxruntime as ort

        from tools.bench.zoo import DATA_SEEDS, noise

        self.model = onnx.load(str(FILES / f"{name}_quant_onnx.onnx"))
        self.float_model = onnx.load(str(FILES / f"{name}_float.onnx"))
        side = self.float_model.graph.input[0].type.tensor_type.shape.dim[2].dim_value or 96
        self.x = noise(num_eval, side, DATA_SEEDS["eval"])
        calib = noise(num_calib, side, DATA_SEEDS["calib"])
        session = ort.InferenceSession(self.float_model.SerializeToString(), providers=["CPUExecutionProvider"])
        feed = session.get_inputs()[0].name
        self.reference = np.concatenate(
            [session.run(None, {feed: self.x[i : i + 8]})[0] for i in range(0, len(self.x), 8)]
        )
        self.view = FileView(self.model)
        self.classes = classes(self.view)
        known = {t.name for t in self.float_model.graph.initializer} | {
            o for n in self.float_model.graph.node for o in n.output
        }
        # Constants by their DequantizeLinear input; the float file names them without the suffix.
        originals = {c: c.removesuffix("_quantized") for c in self.view.constants}
        found = float_values(self.float_model, [o for o in originals.values() if o in known], calib[:1])
        self.values = {c: found[o] for c, o in originals.items() if o in found}
        self.magnitude = self._activation_magnitudes(calib, known)
        missing = [t for t in self.view.quantize if t not in self.magnitude]
        if missing:
            print(f"  not in the float file (kept 8-bit in the 16-bit rows): {missing}", flush=True)

    def _activation_magnitudes(self, calib: np.ndarray, known: set[str]) -> dict[str, float]:
        import onnxruntime as ort

        wanted = {t.removesuffix("_float") if t not in known else t for t in self.view.quantize}
        names = [t for t in wanted if t in known and t != "input"]
        probe = _copy(self.float_model)
        outputs = {o.name for o in probe.graph.output}
        import onnx

        probe.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names if n not in outputs)
        session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
        feed = session.get_inputs()[0].name
        order = [o.name for o in session.get_outputs()]
        largest = dict.fromkeys(order, 0.0)
        for i in range(0, len(calib), 8):
            for n, v in zip(order, session.run(None, {feed: calib[i : i + 8]}), strict=True):
                largest[n] = max(largest[n], float(np.max(np.abs(v))))
        largest["input"] = float(np.max(np.abs(calib)))
        # quant-onnx writes a quantized graph output as NAME_float (its DequantizeLinear's
        # output keeps NAME): the float file's NAME.
        for tensor in self.view.quantize:
            original = tensor.removesuffix("_float")
            if tensor not in largest and original in largest:
                largest[tensor] = largest[original]
        return largest

    def score(self, model: Any) -> float:
        return score(model, self.x, self.reference)

    def floated(self, acts: set[str], consts: set[str]) -> Any:
        return without_qdq(floated_constants(self.model, self.values, consts & set(self.values)), acts)

    def widened(self, acts: set[str], consts: set[str], model: Any = None) -> Any:
        grids = {
            t: (_pow2_scale(self.magnitude[t], INT16_MAX), np.int16)
            for t in acts
            if t in self.magnitude and self.view.bits(t) < 16
        }
        weights = {
            c: _pow2_scale(float(np.abs(self.values[c]).max()), INT16_MAX)
            for c in consts
            if c in self.values and self.view.constant_bits(c) < 16
        }
        return requantized_constants(
            requantized_activations(self.model if model is None else model, grids), self.values, weights, np.int16
        )

    def rules(self) -> list[tuple[str, int, float]]:
        """8-bit alternatives for the classes the ablation points at."""
        softmax = self.classes.get("softmax output", (set(), set()))[0]
        linear = set().union(
            *(
                self.classes.get(f"weights: {k}", (set(), set()))[1]
                for k in ("attention linears (qkv, proj)", "MLP linears (fc1, fc2)")
            )
        )
        all_weights = {c for label, (_, cs) in self.classes.items() if label.startswith("weights") for c in cs}
        observed = {t: (_pow2_scale(self.magnitude[t], 127), np.int8) for t in softmax}
        unsigned = {t: (2.0**-8, np.uint8) for t in softmax}
        mse = {c: mse_position(self.values[c]) for c in linear if c in self.values}
        mse_all = {c: mse_position(self.values[c]) for c in all_weights if c in self.values}
        variants: list[tuple[str, int, Callable[[], Any]]] = [
            ("softmax output int8 on its observed range (power of two)", len(softmax),
             lambda: requantized_activations(self.model, observed)),
            ("softmax output uint8 on [0, 1] (step 2**-8)", len(softmax),
             lambda: requantized_activations(self.model, unsigned)),
            ("attention/MLP weights int8 at the MSE position", len(mse),
             lambda: requantized_constants(self.model, self.values, mse, np.int8)),
            ("every weight int8 at the MSE position", len(mse_all),
             lambda: requantized_constants(self.model, self.values, mse_all, np.int8)),
        ]  # fmt: skip
        from onnx import numpy_helper

        written = {c: float(numpy_helper.to_array(self.view.inits[self.view.constants[c].input[1]])) for c in mse}
        ceiling = sum(mse[c] != _pow2_scale(float(np.abs(self.values[c]).max()), 127) for c in mse)
        print(
            f"  MSE positions of {len(mse)} linear weights: {ceiling} off min-max (the power that holds the "
            f"largest element), {sum(mse[c] != written[c] for c in mse)} off the file's",
            flush=True,
        )
        return [(label, count, self.score(build())) for label, count, build in variants]


def ablate(name: str, num_eval: int, num_calib: int) -> list[tuple[str, str, float | None, float | None]]:
    """Rows (class, count, SQNR with it float, SQNR with it at 16 bits)."""
    run = Ablation(name, num_eval, num_calib)
    rows: list[tuple[str, str, float | None, float | None]] = [("none (the file)", "", run.score(run.model), None)]
    every_act: set[str] = set()
    every_const: set[str] = set()
    for label, (acts, consts) in run.classes.items():
        every_act |= acts
        every_const |= consts
        count = f"{len(acts)}" if acts else f"{len(consts)} const"
        widened = None if label.startswith("residual") else run.score(run.widened(acts, consts))
        rows.append((label, count, run.score(run.floated(acts, consts)), widened))
        print(f"  {label}: {rows[-1][2:]}", flush=True)
    weights = {c for label, (_, cs) in run.classes.items() if label.startswith("weights") for c in cs}
    rows.append(("every weight", f"{len(weights)} const", run.score(run.floated(set(), weights)),
                 run.score(run.widened(set(), weights))))  # fmt: skip
    rows.append(("every activation", f"{len(every_act)}", run.score(run.floated(every_act, set())),
                 run.score(run.widened(every_act, set()))))  # fmt: skip
    rows.append(("everything", "", run.score(run.floated(every_act, every_const)),
                 run.score(run.widened(every_act, every_const))))  # fmt: skip
    for label, count, value in run.rules():
        rows.append((f"8-bit rule: {label}", f"{count}", value, None))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--models", nargs="+", required=True)
    parser.add_argument("--eval", type=int, default=8, help="evaluation samples (the zoo's --quick: 8)")
    parser.add_argument("--calib", type=int, default=16, help="calibration samples (the zoo's --quick: 16)")
    args = parser.parse_args(argv)
    for name in args.models:
        headers = ["tensor class", "count", "SQNR dB, class float", "SQNR dB, class 16-bit"]
        print_rows(name, headers, ablate(name, args.eval, args.calib))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
