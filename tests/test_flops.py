"""Tests for lsvision.flops: fused attention counting against hand counts, per-call handles and mode handling."""

import copy
import logging
from math import prod
from typing import Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from fvcore.nn import ActivationCountAnalysis, FlopCountAnalysis
from fvcore.nn.jit_handles import get_shape

from timm.models.vision_transformer import VisionTransformer

from lsvision.flops import FlopReport, count_activations, count_flops, parameter_count

SDPA = 'scaled_dot_product_attention'


class FusedAttention(nn.Module):
    """Calls SDPA on its three inputs."""

    def __init__(self, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False, enable_gqa: bool = False):
        super().__init__()
        self.attn_mask = attn_mask
        self.is_causal = is_causal
        self.enable_gqa = enable_gqa

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=self.attn_mask, is_causal=self.is_causal, enable_gqa=self.enable_gqa)


class ExplicitAttention(nn.Module):
    """The same math as SDPA, written out (with broadcasting made explicit, so fvcore's matmul handle is exact)."""

    def __init__(self, attn_mask: Optional[torch.Tensor] = None):
        super().__init__()
        self.attn_mask = attn_mask

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        q = q.expand(*batch, *q.shape[-2:])
        k = k.expand(*batch, *k.shape[-2:])
        v = v.expand(*batch, *v.shape[-2:])
        attn = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
        if self.attn_mask is not None:
            attn = attn + self.attn_mask
        return attn.softmax(dim=-1) @ v


def sdpa_formula(q_shape, k_shape, v_shape, batch=None) -> int:
    """prod(batch) * L * S * (E + Ev), with the broadcast batch shape unless given."""
    if batch is None:
        batch = torch.broadcast_shapes(q_shape[:-2], k_shape[:-2], v_shape[:-2])
    (seq_q, dim_qk), seq_kv, dim_v = q_shape[-2:], k_shape[-2], v_shape[-1]
    return prod(batch) * seq_q * seq_kv * (dim_qk + dim_v)


def qkv(q_shape, k_shape, v_shape):
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(s, generator=gen) for s in (q_shape, k_shape, v_shape))


def tiny_vit(fused: bool = True) -> VisionTransformer:
    torch.manual_seed(0)
    model = VisionTransformer(img_size=64, patch_size=16, embed_dim=64, depth=2, num_heads=2, num_classes=10)
    for module in model.modules():
        if hasattr(module, 'fused_attn'):
            module.fused_attn = fused
    return model


def test_sdpa_matches_formula_and_explicit_attention():
    # all dims distinct, so a swapped dim in the handle would show
    q_shape, k_shape, v_shape = (2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 4)
    inputs = qkv(q_shape, k_shape, v_shape)
    expected = 2 * 3 * 5 * 7 * (8 + 4)
    assert sdpa_formula(q_shape, k_shape, v_shape) == expected

    report = count_flops(FusedAttention(), inputs)
    assert isinstance(report, FlopReport)
    assert report.total == expected
    assert report.by_operator == {SDPA: expected}
    assert report.unsupported == {}
    assert report.gflops == pytest.approx(expected / 1e9)

    explicit = FlopCountAnalysis(ExplicitAttention(), inputs).unsupported_ops_warnings(False)
    assert explicit.total() == expected
    assert count_flops(ExplicitAttention(), inputs).total == expected

    # plain fvcore misses fused attention entirely
    plain = FlopCountAnalysis(FusedAttention(), inputs).unsupported_ops_warnings(False)
    assert plain.total() == 0
    assert plain.unsupported_ops() == {f'aten::{SDPA}': 1}


@pytest.mark.parametrize('mask_kind', ['float', 'bool', 'causal'])
def test_masked_sdpa(mask_kind):
    q_shape, k_shape, v_shape = (2, 2, 6, 8), (2, 2, 6, 8), (2, 2, 6, 8)
    inputs = qkv(q_shape, k_shape, v_shape)
    seq = q_shape[-2]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    if mask_kind == 'float':
        model = FusedAttention(attn_mask=torch.zeros(seq, seq).masked_fill(~causal, float('-inf')))
    elif mask_kind == 'bool':
        model = FusedAttention(attn_mask=causal)
    else:
        model = FusedAttention(is_causal=True)
    expected = sdpa_formula(q_shape, k_shape, v_shape)
    # a mask does not change the dense matmul count, as in the explicit version with an additive mask
    explicit = ExplicitAttention(attn_mask=torch.zeros(seq, seq).masked_fill(~causal, float('-inf')))
    assert FlopCountAnalysis(explicit, inputs).unsupported_ops_warnings(False).total() == expected
    assert count_flops(model, inputs).by_operator == {SDPA: expected}
    assert count_activations(model, inputs) == prod(model(*inputs).shape)


@pytest.mark.parametrize(
    'q_shape, k_shape, v_shape',
    [
        ((1, 2, 5, 8), (3, 2, 7, 8), (3, 2, 7, 4)),  # query broadcast over the batch
        ((3, 2, 5, 8), (3, 1, 7, 8), (3, 1, 7, 4)),  # key/value broadcast over heads
        ((2, 5, 8), (4, 2, 7, 8), (4, 2, 7, 4)),  # query without a head dim
        ((5, 8), (7, 8), (7, 4)),  # no batch dims at all
    ],
)
def test_broadcast_sdpa(q_shape, k_shape, v_shape):
    inputs = qkv(q_shape, k_shape, v_shape)
    batch = torch.broadcast_shapes(q_shape[:-2], k_shape[:-2], v_shape[:-2])
    assert FusedAttention()(*inputs).shape[:-2] == batch
    expected = sdpa_formula(q_shape, k_shape, v_shape)
    assert count_flops(FusedAttention(), inputs).total == expected
    assert count_flops(ExplicitAttention(), inputs).total == expected


def test_gqa_sdpa():
    batch, q_heads, kv_heads = 2, 4, 2
    q_shape, k_shape, v_shape = (batch, q_heads, 5, 8), (batch, kv_heads, 7, 8), (batch, kv_heads, 7, 4)
    inputs = qkv(q_shape, k_shape, v_shape)
    expected = sdpa_formula(q_shape, k_shape, v_shape, batch=(batch, q_heads))
    assert count_flops(FusedAttention(enable_gqa=True), inputs).total == expected


def test_shape_and_tensor_input():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    expected_one = 4 * 3 * 3 * 3 * 6 * 6 + 4 * 6 * 6 * 5
    assert count_flops(model, (3, 8, 8)).total == expected_one
    assert count_flops(model, torch.zeros(2, 3, 8, 8)).total == 2 * expected_one
    assert count_flops(model, (3, 8, 8)).by_operator == {'conv': 4 * 3 * 3 * 3 * 6 * 6, 'linear': 4 * 6 * 6 * 5}
    assert parameter_count(model) == (4 * 3 * 3 * 3 + 4) + (4 * 6 * 6 * 5 + 5)


def test_vit_fused_equals_unfused():
    fused, unfused = tiny_vit(fused=True), tiny_vit(fused=False)
    size = (3, 64, 64)
    fused_report, unfused_report = count_flops(fused, size), count_flops(unfused, size)

    # the two models really take different paths
    assert SDPA in fused_report.by_operator and 'matmul' not in fused_report.by_operator
    assert 'matmul' in unfused_report.by_operator and SDPA not in unfused_report.by_operator
    assert fused_report.total == pytest.approx(unfused_report.total, rel=1e-3)
    assert fused_report.total == unfused_report.total

    # attention FLOPs from the shapes: depth * heads * N * N * 2 * head_dim, with N = 16 patches + cls token
    tokens, depth, heads, head_dim = (64 // 16) ** 2 + 1, 2, 2, 32
    attn_flops = depth * heads * tokens * tokens * 2 * head_dim
    assert fused_report.by_operator[SDPA] == attn_flops
    assert unfused_report.by_operator['matmul'] == attn_flops

    # plain fvcore silently drops fused attention
    x = torch.randn(1, *size)
    plain = FlopCountAnalysis(fused.eval(), x).unsupported_ops_warnings(False).uncalled_modules_warnings(False)
    assert plain.total() < fused_report.total
    assert fused_report.total - plain.total() == attn_flops

    assert sum(fused_report.by_operator.values()) == fused_report.total

    # activations: fused attention counts its output, as plain fvcore does not
    plain_acts = ActivationCountAnalysis(fused, x).unsupported_ops_warnings(False).uncalled_modules_warnings(False)
    assert count_activations(fused, size) - plain_acts.total() == depth * heads * tokens * head_dim


def test_known_free_ops_are_silent(caplog):
    with caplog.at_level(logging.WARNING):
        report = count_flops(tiny_vit(), (3, 64, 64))
    assert report.unsupported == {}
    assert {'aten::add', 'aten::gelu'} <= set(report.uncounted)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


class Cube(torch.autograd.Function):
    """A custom op fvcore knows nothing about."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x * x * x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class CubeModel(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Cube.apply(x)


def cube_flop_jit(inputs, outputs) -> int:
    return 2 * prod(get_shape(inputs[0]))


def test_custom_op_handles(caplog):
    op, size = 'prim::PythonOp.Cube', (4, 5)
    with caplog.at_level(logging.WARNING, logger='lsvision.flops'):
        before = count_flops(CubeModel(), size)
    assert before.total == 0 and before.unsupported == {op: 1}
    assert any(op in r.getMessage() for r in caplog.records)
    after = count_flops(CubeModel(), size, extra_handles={op: cube_flop_jit})
    assert after.total == 2 * 4 * 5 and after.by_operator == {'PythonOp.Cube': 2 * 4 * 5}  # fvcore drops 'prim::'
    assert after.unsupported == {}
    ignored = count_flops(CubeModel(), size, extra_handles={op: None})
    assert ignored.total == 0 and ignored.unsupported == {}


def test_baddbmm_counted_like_bmm():
    class BAddBmm(nn.Module):
        def forward(self, x, a, b):
            return torch.baddbmm(x, a, b)

    inputs = (torch.randn(3, 4, 6), torch.randn(3, 4, 5), torch.randn(3, 5, 6))
    assert count_flops(BAddBmm(), inputs).by_operator == {'baddbmm': 3 * 4 * 5 * 6}


def test_training_mode_restored_and_eval_used():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5), nn.Flatten(), nn.Linear(144, 2))
    model.train()
    model[1].eval()  # e.g. frozen batch norm inside a training model
    modes = [m.training for m in model.modules()]
    stats = copy.deepcopy(model[1].state_dict())

    report = count_flops(model, (3, 8, 8))
    count_activations(model, (3, 8, 8))
    assert [m.training for m in model.modules()] == modes
    # counted in eval mode: no running-stat update, and fvcore's inference batch norm count (2 per element)
    for key, value in stats.items():
        assert torch.equal(model[1].state_dict()[key], value)
    assert report.by_operator['batch_norm'] == 2 * 4 * 6 * 6
    assert report.total == count_flops(copy.deepcopy(model).eval(), (3, 8, 8)).total
    # ignoring an op fvcore has a default handle for
    no_bn = count_flops(model, (3, 8, 8), extra_handles={'aten::batch_norm': None})
    assert 'batch_norm' not in no_bn.by_operator and no_bn.unsupported == {}
    assert no_bn.total == report.total - report.by_operator['batch_norm']
    assert [m.training for m in model.modules()] == modes

    model.eval()
    count_flops(model, (3, 8, 8))
    assert not any(m.training for m in model.modules())


class _BroadcastMatmul(torch.nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b


@pytest.mark.parametrize('a_shape,b_shape', [
    ((2, 3, 4, 5), (7, 2, 3, 5, 6)),  # batch dims only on the right operand
    ((7, 2, 3, 4, 5), (3, 5, 6)),
    ((4, 5), (5, 6)),
    ((4, 5), (5,)),
])
def test_matmul_counts_broadcast_batch_dims(a_shape, b_shape):
    a, b = torch.randn(a_shape), torch.randn(b_shape)
    out = a @ b
    m = a_shape[-1]
    expected = out.numel() * m
    assert count_flops(_BroadcastMatmul(), (a, b)).total == expected
