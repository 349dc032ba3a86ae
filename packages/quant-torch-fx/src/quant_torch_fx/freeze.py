"""``freeze``: a calibrated or trained model with everything fixed, as the deployed model
computes it (and as :mod:`quant_torch_fx.export` writes it).

On a copy of the model, for every prepared graph:

1. each :class:`~quant_torch_fx.modules.ConvBn` is folded with its running statistics
   into a plain convolution (float64 fold, as the ONNX backend folds BatchNormalization);
2. activation qparams are fixed (learned LSQ/TQT values become plain qparams);
3. weight qparams come from :func:`quant_core.plan.plan_weight_qparams` (observer, or the
   learned qparams), with the scale raised where the int32 bias would not fit;
4. each bias is encoded by :func:`quant_core.bias.encode_bias` and the model computes with
   the values its codes stand for;
5. a fused Relu/Clip whose bounds the quantizer's saturation applies exactly is removed,
   as the QDQ writer drops it.

The frozen model is in eval mode and its parameters take no gradients.

Example:
    >>> import torch
    >>> from quant_core.presets import get_preset
    >>> from quant_torch_fx import ModelQuantizer
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.ReLU())
    >>> q = ModelQuantizer(get_preset("a8w8"), quiet=True)
    >>> frozen = q.freeze(q.quantize_model(net, torch.randn(1, 3, 4, 4), [torch.randn(8, 3, 4, 4)]))
    >>> [n.target.__name__ for n in frozen.graph.nodes if n.op == "call_function"]
    ['conv2d.default']
"""

from __future__ import annotations

import torch
from torch import nn
from torch.fx import GraphModule, Node

from quant_core.bias import encode_layer_bias
from quant_core.errors import ModelError
from quant_core.plan import plan_weight_qparams
from quant_core.qdq import activation_is_absorbed
from quant_torch_fx.capture import copy_captured
from quant_torch_fx.modules import ConvBn, aten_op
from quant_torch_fx.prepare import (
    WEIGHTS,
    activation_qparams_lookup,
    activation_quantizers,
    constant_lookup,
    graph_info,
    quantized_graphs,
    weight_quantizers,
)
from quant_torch_fx.quantizer import FakeQuantizer


def freeze(model: nn.Module) -> nn.Module:
    """A frozen copy of ``model`` (see the module docstring); ``model`` is not changed."""
    _check_freezable(model)
    return _freeze(copy_captured(model))


def freeze_in_place(model: nn.Module) -> nn.Module:
    """:func:`freeze` without the copy: ``model`` itself is frozen and returned (for a
    caller that throws the unfrozen model away, as a recipe search does)."""
    _check_freezable(model)
    return _freeze(model)


def _check_freezable(model: nn.Module) -> None:
    graphs = quantized_graphs(model)
    if not graphs:
        raise ModelError(
            f"model: {type(model).__name__} holds no quantized graph; use ModelQuantizer.quantize_model or prepare_qat"
        )
    for gm in graphs:
        _check_ready(gm)


def _freeze(frozen: nn.Module) -> nn.Module:
    for gm in quantized_graphs(frozen):
        if graph_info(gm).frozen:
            continue
        _fold_conv_bn(gm)
        _fix_activations(gm)
        _fix_weights(gm)
        _encode_biases(gm)
        _drop_absorbed_activations(gm)
        graph_info(gm).frozen = True
        gm.graph.lint()
        gm.recompile()
    frozen.eval()
    for parameter in frozen.parameters():
        parameter.requires_grad_(False)
    return frozen


def _check_ready(gm: GraphModule) -> None:
    for key, fq in activation_quantizers(gm):
        if fq.qparams is None and not (fq.learning is not None and fq.initialized):
            raise ModelError(
                f"freeze: activation {key!r} has no qparams yet; calibrate the model (or train it a step) first"
            )


def _fold_conv_bn(gm: GraphModule) -> None:
    info = graph_info(gm)
    weights: nn.ModuleDict = gm.get_submodule(WEIGHTS)  # type: ignore[assignment]
    for node in list(gm.graph.nodes):
        if node.op != "call_module":
            continue
        module = gm.get_submodule(str(node.target))
        if not isinstance(module, ConvBn):
            continue
        path = str(node.target)
        weight, bias = module.folded()
        holder = nn.Module()
        holder.weight = nn.Parameter(weight, requires_grad=False)
        holder.bias = nn.Parameter(bias, requires_grad=False)
        fq = module.weight_quantizer
        gm.add_submodule(path, holder)
        plan_node = next((name for name, fx in info.weighted.items() if fx == node.name), None)
        with gm.graph.inserting_before(node):
            w = gm.graph.get_attr(f"{path}.weight")
            b = gm.graph.get_attr(f"{path}.bias")
            quantized_w: Node = w
            if fq is not None and plan_node is not None:
                key = plan_node.replace(".", "_").replace("/", "_")
                while key in weights:
                    key += "_"
                weights[key] = fq
                info.weights[plan_node] = f"{WEIGHTS}.{key}"
                quantized_w = gm.graph.call_module(f"{WEIGHTS}.{key}", (w,), {"observe_batch": False})
            conv = gm.graph.call_function(aten_op(module.op_name), (node.args[0], quantized_w, b, *module.conv_args))
        conv.meta = dict(node.meta)
        node.replace_all_uses_with(conv)
        gm.graph.erase_node(node)
        if plan_node is not None:
            info.weighted[plan_node] = conv.name
        for name, fx_name in list(info.nodes.items()):
            if fx_name == node.name:
                info.nodes[name] = conv.name


def _check_learned_scale(fq: FakeQuantizer) -> None:
    """An LSQ scale that training pushed to zero or below is clamped to a tiny value in the
    forward, where it gets no gradient back: every value then quantizes to one code, and a
    frozen model would carry that silently."""
    if fq.learning != "lsq" or fq.learned is None:
        return
    lowest = float(fq.learned.detach().min())
    if lowest <= 0.0:
        raise ModelError(
            f"freeze: the learned LSQ scale of {fq.name!r} fell to {lowest:.3g}; training moved it past zero. "
            "Its learning rate was too large for it: with train_qat, lower qparam_lr (or lr); with your own "
            "optimizer, give each scale a rate relative to its size, as "
            "quant_torch_fx.training.default_optimizer(model, lr, qparam_lr=None) does"
        )


def _fixed(fq: FakeQuantizer) -> None:
    _check_learned_scale(fq)
    qp = fq.current_qparams()
    fq.learning = None
    if fq.learned is not None:
        del fq.learned
        fq.learned = None
    fq.set_qparams(qp)
    fq.observing, fq.quantizing, fq.initialized = False, True, True


def _fix_activations(gm: GraphModule) -> None:
    for _key, fq in activation_quantizers(gm):
        _fixed(fq)


def _fix_weights(gm: GraphModule) -> None:
    info = graph_info(gm)
    for _node, fq in weight_quantizers(gm):
        _check_learned_scale(fq)
    learned = {node: fq.current_qparams() for node, fq in weight_quantizers(gm) if fq.learning is not None}
    learned.update(info.fixed_weights)  # codes learned by AdaRound/AdaQuant are at these qparams
    qparams, notes = plan_weight_qparams(info.plan, constant_lookup(gm), activation_qparams_lookup(gm), learned)
    info.notes.extend(note for note in notes if note not in info.notes)
    for node, fq in weight_quantizers(gm):
        fq.track = False
        fq.learning = None
        if fq.learned is not None:
            del fq.learned
            fq.learned = None
        fq.set_qparams(qparams[node])
        fq.observing, fq.quantizing = False, True


def _encode_biases(gm: GraphModule) -> None:
    info = graph_info(gm)
    values = constant_lookup(gm)
    act = activation_qparams_lookup(gm)
    by_name = {n.name: n for n in gm.graph.nodes}
    weight_qparams = dict(weight_quantizers(gm))
    for slot in info.plan.biases:
        value = values(slot.tensor)
        input_qp = act(slot.node, slot.input_tensor)
        fq = weight_qparams.get(slot.node)
        consumer = by_name.get(info.weighted.get(slot.node, ""))
        if fq is None or consumer is None:
            continue  # no quantized weight, so no bias slot to encode (the plan keeps the layer float)
        encoded, notes = encode_layer_bias(
            slot.node,
            value,
            None if input_qp is None else input_qp.scale,
            fq.current_qparams(),
            slot.spec,
            integer_kernel=slot.integer_kernel,
        )
        info.notes.extend(notes)
        if encoded is None:
            continue
        info.biases[slot.node] = encoded
        stored = encoded.values()
        if stored is None:
            continue
        bias_node = consumer.args[slot.input_index]
        if not isinstance(bias_node, Node) or bias_node.op != "get_attr":
            continue
        owner, _, leaf = str(bias_node.target).rpartition(".")
        parent = gm.get_submodule(owner) if owner else gm
        name = f"{leaf}_encoded"
        while hasattr(parent, name):
            name += "_"
        device = getattr(parent, leaf).device
        parent.register_buffer(name, torch.from_numpy(stored.reshape(value.shape).copy()).to(device))
        with gm.graph.inserting_before(consumer):
            new = gm.graph.get_attr(f"{owner}.{name}" if owner else name)
        consumer.replace_input_with(bias_node, new)
        if not bias_node.users:
            gm.graph.erase_node(bias_node)


def _drop_absorbed_activations(gm: GraphModule) -> None:
    info = graph_info(gm)
    by_name = {n.name: n for n in gm.graph.nodes}
    act = activation_qparams_lookup(gm)
    for fused in info.plan.fused:
        qp = act(fused.node, fused.post_tensor)
        node = by_name.get(info.nodes.get(fused.node, ""))
        if qp is None or node is None or not activation_is_absorbed(qp, fused.bounds):
            continue
        pre = node.args[0]
        users = list(node.users)
        if not (isinstance(pre, Node) and pre.op == "call_module" and len(users) == 1):
            continue
        post = users[0]
        if post.op != "call_module" or post.target != pre.target:
            continue
        post.replace_all_uses_with(pre)
        gm.graph.erase_node(post)
        gm.graph.erase_node(node)
