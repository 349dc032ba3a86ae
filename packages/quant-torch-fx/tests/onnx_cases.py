"""One small float module per translated ATen op family, and a runner that writes it with
the exporter's emitter and compares an ONNX runtime's outputs with torch's. Shared by
``test_onnx_ops.py`` (onnx's reference evaluator) and the integration test that runs the
same cases in onnxruntime."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from torch import nn

from quant_torch_fx.export_form import aten_graph
from quant_torch_fx.onnx_emit import emit_onnx


class Lambda(nn.Module):
    def __init__(self, fn: Callable[..., Any], *params: torch.Tensor) -> None:
        super().__init__()
        self.fn = fn
        for i, p in enumerate(params):
            self.register_buffer(f"p{i}", p)

    def forward(self, x: torch.Tensor) -> Any:
        return self.fn(x, *[getattr(self, f"p{i}") for i in range(len(self._buffers))])


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=_g(seed))


IMAGE = (2, 4, 7, 9)
TOKENS = (2, 5, 8)


def _conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(4, 6, 3, stride=2, padding=1, dilation=1),
        nn.Conv2d(6, 6, 3, padding="same", dilation=2, groups=3),
        nn.ConvTranspose2d(6, 4, 3, stride=2, padding=1, output_padding=1),
        nn.BatchNorm2d(4).eval(),  # unfolded: no convolution reads... the transposed one does not fold
        nn.PReLU(4),
    ).eval()


def _window_attention_bias() -> nn.Module:
    """Swin's relative position bias: a table gathered by a constant index, then viewed."""
    table = _rand(9, 2, seed=3)
    index = torch.randint(0, 9, (4, 4), generator=_g(4))

    def fn(x: torch.Tensor, table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        bias = table[index.view(-1)].view(4, 4, -1).permute(2, 0, 1)
        return x + bias.unsqueeze(0)

    return Lambda(fn, table, index)


def _window_partition(x: torch.Tensor) -> torch.Tensor:
    b, h, w, c = x.shape
    x = torch.roll(x, shifts=(-1, -1), dims=(1, 2))
    x = x.view(b, h // 2, 2, w // 2, 2, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, 4, c)
    return x.flip(1)


def _grid_points(x: torch.Tensor) -> torch.Tensor:
    """A YOLO head's anchor points: meshgrid of both indexings over the feature map."""
    h, w = x.shape[2:]
    sy, sx = torch.meshgrid(torch.arange(h) + 0.5, x[0, 0, 0, :w], indexing="ij")
    gx, gy = torch.meshgrid(x[0, 0, 0, :w], torch.arange(h) * 2.0, indexing="xy")
    return x + torch.stack((sx + gx, sy * gy), 0).sum(0)


def _cumulative_positions(x: torch.Tensor) -> torch.Tensor:
    """EdgeNeXt's positional encoding: cumulative sums of a bool mask, then of floats."""
    mask = ~torch.zeros((x.shape[0], x.shape[2], x.shape[3]), dtype=torch.bool)
    return x + mask.cumsum(1, dtype=torch.float32).unsqueeze(1) + x.cumsum(-1) + mask.cumsum(2).unsqueeze(1)


def _attention(mask: str) -> Callable[..., torch.Tensor]:
    def fn(x: torch.Tensor) -> torch.Tensor:
        q, k, v = x.reshape(x.shape[0], 5, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
        if mask == "bool":
            m = torch.tril(torch.ones(5, 5, dtype=torch.bool))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        if mask == "float":
            m = torch.arange(25.0).reshape(5, 5) / 25.0
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.3)
        return F.scaled_dot_product_attention(q, k, v, is_causal=mask == "causal")

    return fn


CASES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], int]] = {
    # name: (module factory, input shape, opset)
    "gelu_erf": (lambda: nn.GELU(), TOKENS, 17),
    "gelu_tanh": (lambda: nn.GELU(approximate="tanh"), TOKENS, 17),
    "gelu_opset20": (lambda: nn.Sequential(nn.GELU(), nn.GELU(approximate="tanh")), TOKENS, 20),
    "layer_norm": (lambda: nn.LayerNorm(8, eps=1e-3), TOKENS, 17),
    "layer_norm_two_axes_no_affine": (lambda: nn.LayerNorm([5, 8], elementwise_affine=False), TOKENS, 17),
    "group_norm": (lambda: nn.GroupNorm(2, 4, eps=1e-3), IMAGE, 17),
    "softmax_axes": (lambda: Lambda(lambda x: F.softmax(x, 1) + F.log_softmax(x, -1)), TOKENS, 17),
    "hard_activations": (
        lambda: Lambda(lambda x: F.hardswish(x * 4) + F.hardsigmoid(x * 4) + F.relu6(x * 5)),
        IMAGE,
        17,
    ),
    "clamps": (
        lambda: Lambda(lambda x: F.hardtanh(x, -0.5, 0.7) + x.clamp(min=-0.2) + x.clamp(max=0.1) + x.clamp(-1, 1)),
        IMAGE,
        17,
    ),
    "activations": (
        lambda: Lambda(
            lambda x: F.leaky_relu(x, 0.2) + F.elu(x) + F.silu(x) + F.mish(x) + torch.tanh(x) + torch.sigmoid(x)
        ),
        IMAGE,
        17,
    ),
    "math": (
        lambda: Lambda(
            lambda x: (
                torch.erf(x)
                + torch.exp(x)
                + torch.sqrt(x.abs())
                + torch.rsqrt(x.abs() + 1)
                - x.neg()
                + x.pow(2)
                + x.abs().pow(0.5)
                + torch.reciprocal(x.abs() + 1)
                + x.floor()
                + x.ceil()
                + x.round()
            )
        ),
        IMAGE,
        17,
    ),
    "arithmetic": (
        lambda: Lambda(
            lambda x: (
                (1.5 - x)
                + torch.sub(x, x * 2, alpha=3)
                + x / 3
                + torch.div(x, 0.3, rounding_mode="floor")
                + torch.div(x, 0.3, rounding_mode="trunc")
                + torch.add(x, x, alpha=2)
                + 2**x
                + torch.maximum(x, -x)
            )
        ),
        IMAGE,
        17,
    ),
    "compare_where": (
        lambda: Lambda(
            lambda x: (
                torch.where(x > 0.1, x, -x) + x.masked_fill(x < -0.3, 2.0) + (x >= 0).float() + (x != x.abs()).float()
            )
        ),
        IMAGE,
        17,
    ),
    "boolean_masks": (
        lambda: Lambda(
            lambda x: (
                torch.where(((x > 0.5) | (x < -0.5)) & ~(x > 1.5), x, -x)
                + ((x > 0) ^ (x.abs() < 0.2)).float()
                + torch.logical_xor(x > 0.3, x < 0.6).float()
            )
        ),
        IMAGE,
        17,
    ),
    "nearest_scale": (lambda: nn.Upsample(scale_factor=2, mode="nearest"), IMAGE, 17),
    "nearest_size": (lambda: Lambda(lambda x: F.interpolate(x, size=(12, 5), mode="nearest")), IMAGE, 17),
    "nearest_exact": (lambda: Lambda(lambda x: F.interpolate(x, size=(12, 5), mode="nearest-exact")), IMAGE, 17),
    "bilinear": (lambda: Lambda(lambda x: F.interpolate(x, scale_factor=2, mode="bilinear")), IMAGE, 17),
    "bilinear_size": (lambda: Lambda(lambda x: F.interpolate(x, size=(10, 4), mode="bilinear")), IMAGE, 17),
    "bilinear_corners": (
        lambda: Lambda(lambda x: F.interpolate(x, size=(10, 13), mode="bilinear", align_corners=True)),
        IMAGE,
        17,
    ),
    "bicubic": (lambda: Lambda(lambda x: F.interpolate(x, scale_factor=2, mode="bicubic")), IMAGE, 17),
    "avg_pool": (lambda: nn.AvgPool2d(3, 2, 1), IMAGE, 17),
    "avg_pool_ceil": (lambda: nn.AvgPool2d(3, 2, 1, ceil_mode=True), IMAGE, 17),
    "avg_pool_ceil_no_pad_count": (lambda: nn.AvgPool2d(3, 2, 1, ceil_mode=True, count_include_pad=False), IMAGE, 17),
    "avg_pool_ceil_no_padding": (lambda: nn.AvgPool2d(2, ceil_mode=True), IMAGE, 17),
    "avg_pool_divisor": (lambda: nn.AvgPool2d(3, 1, 1, divisor_override=4), IMAGE, 17),
    "max_pool": (lambda: nn.MaxPool2d(3, 2, 1, dilation=1, ceil_mode=True), IMAGE, 17),
    "max_pool_dilated": (lambda: nn.MaxPool2d(2, 1, 0, dilation=2), IMAGE, 17),
    "adaptive_pools": (
        lambda: Lambda(
            lambda x: torch.cat(
                [
                    F.adaptive_avg_pool2d(x, 1).flatten(1),
                    F.adaptive_avg_pool2d(x, (7, 3)).flatten(1),
                    F.adaptive_avg_pool2d(x, (3, 4)).flatten(1),
                    F.adaptive_max_pool2d(x, (2, 3)).flatten(1),
                ],
                1,
            )
        ),
        IMAGE,
        17,
    ),
    "pads": (
        lambda: Lambda(
            lambda x: (
                F.pad(x, (1, 2, 0, 1), value=0.5).sum()
                + F.pad(x, (2, 1, 1, 2), mode="reflect")[:, :, :7, :9]
                + F.pad(x, (1, 1, 2, 0), mode="replicate")[:, :, 2:, 1:-1]
                + F.pad(x, (2, 1, 1, 1), mode="circular")[:, :, 1:-1, 2:-1]
            )
        ),
        IMAGE,
        17,
    ),
    "circular_pad_opset19": (lambda: Lambda(lambda x: F.pad(x, (2, 1, 1, 1), mode="circular")), IMAGE, 19),
    "slicing": (
        lambda: Lambda(
            lambda x: [
                x[:, 1:, -3:],
                x[:, :-1, :3],
                x[..., ::2, 1:4],
                x.narrow(1, 1, 3),
                x[:, -2:, 2:5],
                x.select(2, -1),
                x[:, 5:],
            ]
        ),
        IMAGE,
        17,
    ),
    "splits": (
        lambda: Lambda(
            lambda x: [*torch.split(x, 3, 2), *torch.chunk(x, 3, 3), *x.unbind(1), torch.stack([x, x * 2], 1)]
        ),
        IMAGE,
        17,
    ),
    "reshapes": (
        lambda: Lambda(
            lambda x: [
                x.view(x.shape[0], -1),
                x.reshape(-1, 9),
                x.flatten(1),
                x.flatten(0, 1),
                x.flatten(2),
                x.permute(0, 2, 3, 1),
                x.transpose(1, 3).contiguous(),
                x.unflatten(1, (2, 2)),
                x.mean(1, keepdim=True).expand(-1, 3, -1, -1),
                x[:, :1].expand_as(x),
                x.repeat(1, 2, 1, 1),
                x[:, :1].squeeze(1),
                x.unsqueeze(-1),
                x.movedim(1, -1),
                x.reshape(x.shape[0] * 4, 63),
            ]
        ),
        IMAGE,
        17,
    ),
    "reductions": (
        lambda: Lambda(
            lambda x: [
                x.mean((2, 3)),
                x.sum(1, keepdim=True),
                x.amax(-1),
                x.mean(),
                x.sum(),
                x.max(2)[0],
                x.norm(dim=1),
                x.max(),
                torch.max(x, x.flip(3)),
                x.min(1, keepdim=True)[1],
                F.layer_norm(x, (9,)),
            ]
        ),
        IMAGE,
        17,
    ),
    "matmuls": (
        lambda: Lambda(
            lambda x, w, m: [x @ w, torch.bmm(x, x.transpose(1, 2)), (x.unsqueeze(1) @ m).sum(1), torch.mm(x[0], w)],
            _rand(8, 3, seed=5),
            _rand(3, 8, 2, seed=6),
        ),
        TOKENS,
        17,
    ),
    "linears": (
        lambda: nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 4, bias=False)).eval(),
        TOKENS,
        17,
    ),
    "linear_2d": (lambda: nn.Sequential(nn.Flatten(), nn.Linear(40, 6)).eval(), TOKENS, 17),
    "attention": (lambda: Lambda(_attention("none")), (2, 5, 24), 17),
    "attention_bool_mask": (lambda: Lambda(_attention("bool")), (2, 5, 24), 17),
    "attention_float_mask": (lambda: Lambda(_attention("float")), (2, 5, 24), 17),
    "attention_causal": (lambda: Lambda(_attention("causal")), (2, 5, 24), 17),
    "multihead_attention": (lambda: nn.MultiheadAttention(8, 2, batch_first=True).eval(), TOKENS, 17),
    "window_bias": (_window_attention_bias, (2, 2, 4, 4), 17),
    "window_partition": (lambda: Lambda(_window_partition), (2, 4, 6, 3), 17),
    "gather": (
        lambda: Lambda(
            lambda x, i: torch.gather(x, 2, i.expand(x.shape[0], -1, -1)) + x.index_select(1, i[0, :, 0]),
            torch.tensor([[[1], [0], [4], [2], [3]]]),
        ),
        TOKENS,
        17,
    ),
    "convolutions": (_conv_net, IMAGE, 17),
    "conv1d": (
        lambda: nn.Sequential(nn.Conv1d(5, 4, 3, padding=2, dilation=2), nn.MaxPool1d(2), nn.AvgPool1d(2)).eval(),
        TOKENS,
        17,
    ),
    "pixel_shuffles": (
        lambda: Lambda(lambda x: F.pixel_unshuffle(F.pixel_shuffle(torch.cat([x, x], 1), 2), 2)),
        (2, 8, 3, 5),
        17,
    ),
    "creation": (
        lambda: Lambda(
            lambda x: (
                x + torch.arange(9.0) + torch.zeros_like(x) + torch.full((7, 9), 0.5) + torch.ones(x.shape[0], 1, 1, 1)
            )
        ),
        IMAGE,
        17,
    ),
    "meshgrid_grid_points": (lambda: Lambda(_grid_points), IMAGE, 17),
    "cumsum_of_a_mask": (lambda: Lambda(_cumulative_positions), IMAGE, 17),
}
"""Op family -> (module factory, input shape, opset). Every module takes a batch dimension
that the export keeps dynamic."""


def export_case(name: str) -> tuple[nn.Module, onnx.ModelProto, int]:
    """The case's module, its ONNX model (batch dynamic) and the opset."""
    factory, shape, opset = CASES[name]
    module = factory().eval()
    example = _rand(*shape, seed=1)
    args = (example, example, example) if isinstance(module, nn.MultiheadAttention) else (example,)
    with torch.no_grad():
        gm = aten_graph(module, args, dynamic_batch=True)
    names = [f"input_{i}" for i in range(len(args))]
    model = emit_onnx(gm, opset=opset, input_names=names, output_names=None)
    onnx.checker.check_model(model, full_check=True)
    return module, model, len(args)


def case_inputs(name: str, batch: int = 3) -> list[torch.Tensor]:
    """Inputs of another batch size than the example's."""
    _factory, shape, _opset = CASES[name]
    return [_rand(batch, *shape[1:], seed=7)]


def flat(value: Any) -> list[np.ndarray]:
    if isinstance(value, torch.Tensor):
        return [value.detach().numpy()]
    return [leaf for v in value for leaf in flat(v)]


def check_case(name: str, run: Callable[[onnx.ModelProto, dict[str, np.ndarray]], list[np.ndarray]]) -> None:
    """``run``'s outputs of the case's ONNX model equal torch's (float32 rounding apart)."""
    module, model, count = export_case(name)
    (x,) = case_inputs(name)
    args = [x] * count
    with torch.no_grad():
        expected = flat(module(*args))
    got = run(model, {f"input_{i}": a.numpy() for i, a in enumerate(args)})
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape, (g.shape, e.shape)
        np.testing.assert_allclose(g.astype(np.float64), e.astype(np.float64), rtol=2e-5, atol=2e-5)
