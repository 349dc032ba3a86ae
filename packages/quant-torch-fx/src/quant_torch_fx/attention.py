"""``scaled_dot_product_attention`` written out in ATen ops, so that its two matmuls are
tensors and ops of their own for the planner (and integer kernels in the exported file):

    scores = matmul(q, k.transpose(-2, -1)) * scale    (scale: given, or 1/sqrt(head size))
    scores = scores + mask                              (a float mask as given; a boolean
                                                        mask and is_causal as 0 / -3.4e38)
    out    = matmul(softmax(scores, -1), v)

which is how the ONNX backend's files hold attention (``MatMul``, ``Mul``, ``Add``,
``Softmax``, ``MatMul``), so the one planner (:mod:`quant_core.plan`, its transformer
recipe included) decides for both backends alike: both inputs of ``Q·K^T`` and of
``attn·V`` quantized, the scores float, the softmax output on the ``[0, 1]`` grid.

The prepared graph (:func:`quant_torch_fx.prepare.normalize`) and the export's ATen graph
(:func:`quant_torch_fx.export_form.aten_graph`, float parts of a model included) both go
through :func:`decompose_attention`; the exporter has no attention rule of its own.

The new nodes are named after the attention node: ``<name>_qk``, ``_scaled``, ``_causal``,
``_masked``, ``_softmax``, ``_av`` (a config's ``node_overrides`` glob such as
``"blocks.*.attn/*_qk"`` selects the ``Q·K^T`` matmuls).

Grouped-query attention (``enable_gqa``, fewer key/value heads) repeats each key/value
head for its group of query heads (``unsqueeze``, ``expand``, ``flatten``), as torch does.
Attention dropout is refused: a captured model runs in eval mode, where it is 0.

``baddbmm(mask, q, k^T)`` (``nn.MultiheadAttention`` with ``need_weights`` and a mask) is
written out too, as ``bmm`` then ``add`` of its input (``<name>_bmm``, ``_add``).

A row whose every position a boolean mask hides: torch returns zeros, the decomposition
(masked positions at the most negative float32, not ``-inf``, so the row stays finite)
the mean of ``v``'s rows. Only such rows differ.

Example:
    >>> import torch
    >>> import torch.nn.functional as F
    >>> class Attend(torch.nn.Module):
    ...     def forward(self, q, k, v):
    ...         return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> q, k, v = (torch.randn(2, 3, 5, 4) for _ in range(3))
    >>> gm = torch.export.export(Attend(), (q, k, v)).module()
    >>> decompose_attention(gm)
    1
    >>> [n.target.__name__ for n in gm.graph.nodes if n.op == "call_function"]
    ['transpose.int', 'matmul.default', 'mul.Tensor', 'add.Tensor', 'softmax.int', 'matmul.default']
    >>> torch.allclose(gm(q, k, v), Attend()(q, k, v), atol=1e-6)
    True
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import GraphModule, Node

from quant_core.errors import ModelError
from quant_torch_fx.aten_map import op_name
from quant_torch_fx.onnx_rules import bind

aten = torch.ops.aten

MASKED = torch.finfo(torch.float32).min
"""What a hidden position adds to its score: exp() of it is 0 beside any visible score,
and a row hidden everywhere stays finite."""


def decompose_attention(gm: GraphModule) -> int:
    """Rewrite every ``scaled_dot_product_attention`` of ``gm`` as matmul, scale, mask,
    softmax, matmul (in place; see the module docstring). Returns how many were rewritten.
    Raises :class:`~quant_core.errors.ModelError` naming the node for dropout, and for a
    default scale or a causal mask over sizes only known at run time."""
    count = 0
    for node in list(gm.graph.nodes):
        if op_name(node) == "scaled_dot_product_attention":
            _Writer(gm, node).rewrite()
        elif op_name(node) == "baddbmm":
            _Writer(gm, node).rewrite_baddbmm()
        else:
            continue
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


class _Writer:
    """Writes one attention node's decomposition before it, with each new node's
    ``meta["val"]`` (computed on the graph's fake tensors) and module stack."""

    def __init__(self, gm: GraphModule, node: Node) -> None:
        self.gm = gm
        self.node = node
        self.bound = bind(node)
        first = node.all_input_nodes[0].meta.get("val") if node.all_input_nodes else None
        self.fake_mode = first.fake_mode if isinstance(first, FakeTensor) else None

    def error(self, what: str) -> ModelError:
        return ModelError(f"node {self.node.name!r} (scaled_dot_product_attention): {what}")

    def rewrite(self) -> None:
        q, k, v = self.bound["query"], self.bound["key"], self.bound["value"]
        dropout = self.bound.get("dropout_p") or 0.0
        if dropout != 0.0:
            raise self.error(f"dropout_p={dropout} is not allowed; allowed: 0.0 (capture the model in eval mode)")
        if self.bound.get("enable_gqa"):
            k, v = self.repeat_heads(k), self.repeat_heads(v)
        scores = self.call(aten.matmul.default, q, self.call(aten.transpose.int, k, -2, -1, name="key_t"), name="qk")
        scores = self.call(aten.mul.Tensor, scores, self.scale(q), name="scaled")
        if self.bound.get("is_causal"):
            scores = self.call(aten.add.Tensor, scores, self.causal_mask(q, k), name="causal")
        mask = self.bound.get("attn_mask")
        if mask is not None:
            scores = self.call(aten.add.Tensor, scores, self.additive(mask), name="masked")
        out = self.call(aten.matmul.default, self.call(aten.softmax.int, scores, -1, name="softmax"), v, name="av")
        self.node.replace_all_uses_with(out)
        self.gm.graph.erase_node(self.node)

    def rewrite_baddbmm(self) -> None:
        """``baddbmm(input, b1, b2, beta, alpha)`` as ``bmm(b1, b2) * alpha + input * beta``:
        ``nn.MultiheadAttention`` with ``need_weights`` adds its mask to the scores this way,
        and a fused op would hide ``Q·K^T`` and the mask from the planner (and has no ONNX
        rule). ``beta=0`` ignores ``input``, as torch does."""
        beta, alpha = self.bound.get("beta", 1), self.bound.get("alpha", 1)
        out = self.call(aten.bmm.default, self.bound["batch1"], self.bound["batch2"], name="bmm")
        if alpha != 1:
            out = self.call(aten.mul.Tensor, out, alpha, name="alpha")
        if beta != 0:
            added = self.bound["self"]
            if beta != 1:
                added = self.call(aten.mul.Tensor, added, beta, name="beta")
            out = self.call(aten.add.Tensor, out, added, name="add")
        self.node.replace_all_uses_with(out)
        self.gm.graph.erase_node(self.node)

    # ---------------------------------------------------------------------------- pieces
    def scale(self, q: Node) -> float:
        scale = self.bound.get("scale")
        if scale is not None:
            return float(scale)
        depth = self.size(q, -1)
        if depth is None:
            raise self.error("the head size is dynamic and no scale is given; allowed: a static head size or scale=")
        return 1.0 / math.sqrt(depth)

    def causal_mask(self, q: Node, k: Node) -> Node:
        length, source = self.size(q, -2), self.size(k, -2)
        if length is None or source is None:
            raise self.error("is_causal over a dynamic sequence length; allowed: static query and key lengths")
        allowed = torch.ones(length, source, dtype=torch.bool).tril()
        additive = torch.zeros(length, source).masked_fill(~allowed, MASKED).to(self.device(q))
        return self.constant(f"{self.node.name}_causal_mask", additive)

    def additive(self, mask: Node) -> Node:
        """A boolean mask (True: attend) as 0 / :data:`MASKED`; a float mask is added as given."""
        value = mask.meta.get("val")
        if not (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
            return mask
        # where(mask, 0, fill) of two constants: the planner recognises the mask by them
        visible = self.constant(f"{self.node.name}_mask_visible", torch.zeros((), device=self.device(mask)))
        fill = self.constant(f"{self.node.name}_mask_fill", torch.full((), MASKED, device=self.device(mask)))
        return self.call(aten.where.self, mask, visible, fill, name="mask_additive")

    def repeat_heads(self, tensor: Node) -> Node:
        """``[..., Hkv, S, E]`` -> ``[..., Hq, S, E]``, each head repeated ``Hq / Hkv`` times
        in place (``repeat_interleave`` on the head axis)."""
        heads, kv_heads = self.size(self.bound["query"], -3), self.size(tensor, -3)
        if heads is None or kv_heads is None or heads % kv_heads:
            raise self.error(
                f"enable_gqa with {heads} query heads over {kv_heads} key/value heads; "
                "allowed: static head counts, the query's a multiple of the key's"
            )
        if heads == kv_heads:
            return tensor
        rank = self.rank(tensor)
        grouped = self.call(aten.unsqueeze.default, tensor, -3, name=f"{tensor.name}_grouped")
        sizes = [-1] * (rank + 1)
        sizes[-3] = heads // kv_heads
        repeated = self.call(aten.expand.default, grouped, sizes, name=f"{tensor.name}_repeated")
        return self.call(aten.flatten.using_ints, repeated, -4, -3, name=f"{tensor.name}_heads")

    # ---------------------------------------------------------------------------- helpers
    def size(self, tensor: Node, axis: int) -> int | None:
        value = tensor.meta.get("val")
        if not isinstance(value, torch.Tensor):
            return None
        size = value.shape[axis]
        return size if isinstance(size, int) else None

    def rank(self, tensor: Node) -> int:
        value = tensor.meta.get("val")
        assert isinstance(value, torch.Tensor)
        return value.dim()

    def device(self, tensor: Node) -> torch.device:
        value = tensor.meta.get("val")
        return value.device if isinstance(value, torch.Tensor) else torch.device("cpu")

    def constant(self, base: str, value: torch.Tensor) -> Node:
        name, index = base, 1
        while hasattr(self.gm, name):
            name, index = f"{base}_{index}", index + 1
        self.gm.register_buffer(name, value)
        with self.gm.graph.inserting_before(self.node):
            node = self.gm.graph.get_attr(name)
        node.meta["val"] = self.fake(value)
        return node

    def fake(self, value: torch.Tensor) -> torch.Tensor:
        return self.fake_mode.from_tensor(value) if self.fake_mode is not None else value

    def call(self, target: Any, *args: Any, name: str, **kwargs: Any) -> Node:
        """A call of ``target`` named ``<attention node>_<name>`` (config globs and reports
        show where it came from)."""
        with self.gm.graph.inserting_before(self.node):
            node = self.gm.graph.create_node("call_function", target, args, kwargs, name=f"{self.node.name}_{name}")
        node.meta["nn_module_stack"] = dict(self.node.meta.get("nn_module_stack") or {})
        for key in ("stack_trace", "source_fn_stack", "torch_fn"):
            if key in self.node.meta:
                node.meta[key] = self.node.meta[key]
        node.meta["val"] = self.value(target, args, kwargs)
        return node

    def value(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The new node's fake value (what torch.export would have recorded)."""

        def val(a: Any) -> Any:
            return a.meta.get("val") if isinstance(a, Node) else a

        values = [val(a) for a in args]
        if any(isinstance(v, Node) or v is None for v in values):
            return None
        if self.fake_mode is None:
            return target(*values, **kwargs)
        with self.fake_mode:
            return target(*values, **kwargs)
