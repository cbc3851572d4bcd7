"""The shared hierarchical pieces: the base class's constructor contract, the pre-norm block and stage that CvT,
CvT-LS and ViL-LS share (their state-dict layout), and the long-short layer's pluggable q, k, v modules."""
from functools import partial

import pytest
import torch
import torch.nn as nn

import timm

import lsvision  # noqa: F401  (registers the models)
from lsvision.layers import LinearQkv, LongShortAttention2d
from lsvision.models._hierarchical import ConvEmbed, HierarchicalTransformer, PreNormBlock, TransformerStage
from lsvision.models.cvt import ConvAttention, ConvDynamicProjection, SepConvQkv
from lsvision.models.vil_ls import RelPosAttention


class _TwoStageModel(HierarchicalTransformer):
    """The smallest model built on the base: everything the base needs is a constructor argument."""

    def __init__(self, global_pool: str = 'avg', cls_token_last: bool = False):
        dims = (8, 16)
        stages, feature_info, in_chs = [], [], 3
        for i, dim in enumerate(dims):
            attn = partial(LongShortAttention2d, num_heads=2, window_size=2, dp_rank=2)
            stages.append(TransformerStage(
                ConvEmbed(in_chs, dim, 2), dim, depth=1, attn_layer=attn,
                num_prefix_tokens=int(cls_token_last and i == len(dims) - 1)))
            feature_info.append(dict(num_chs=dim, reduction=2 ** (i + 1), module=f'stages.{i}'))
            in_chs = dim
        super().__init__(
            stages, feature_info, in_chans=3, num_classes=5, global_pool=global_pool, img_size=16, min_input_size=4)


def test_base_takes_its_contract_as_constructor_arguments():
    torch.manual_seed(0)
    model = _TwoStageModel().eval()
    assert (model.num_features, model.head_hidden_size, model.num_classes) == (16, 16, 5)
    assert (model.in_chans, model.min_input_size, model.img_size, model.global_pool) == (3, 4, (16, 16), 'avg')
    assert [f['module'] for f in model.feature_info] == ['stages.0', 'stages.1']
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert model(x).shape == (2, 5)
        assert model.forward_features(x).shape == (2, 16, 4, 4)
        taps = model.forward_intermediates(x, intermediates_only=True)
    assert [t.shape[1:] for t in taps] == [(8, 8, 8), (16, 4, 4)]
    with pytest.raises(AssertionError, match='smaller than the smallest'):
        model(torch.randn(1, 3, 2, 2))
    assert _TwoStageModel('token', cls_token_last=True)(x).shape == (2, 5)


def test_base_refuses_a_token_head_without_a_cls_token():
    with pytest.raises(AssertionError, match="needs a cls token in the last stage; pass global_pool='avg'"):
        _TwoStageModel('token')
    with pytest.raises(AssertionError, match='global_pool must be one of'):
        _TwoStageModel('max')


@pytest.mark.parametrize('name,attn_type', [
    ('cvt_13', ConvAttention), ('cvt_ls_13', LongShortAttention2d), ('vil_ls_medium', LongShortAttention2d)])
def test_cvt_and_vil_share_the_block_and_stage(name, attn_type):
    model = timm.create_model(name, device='meta')
    assert all(type(s) is TransformerStage and type(s.patch_embed) is ConvEmbed for s in model.stages)
    blocks = [b for s in model.stages for b in s.blocks]
    assert all(type(b) is PreNormBlock for b in blocks)
    assert isinstance(blocks[0].attn, attn_type)
    if name == 'vil_ls_medium':  # full attention in stages 3-4; norm eps 1e-6 (CvT: 1e-5)
        assert isinstance(model.stages[2].blocks[0].attn, RelPosAttention)
    assert blocks[0].norm1.eps == (1e-6 if name.startswith('vil') else 1e-5)


# the state-dict keys of one CvT-LS block, stage patch embedding and cls token: no official checkpoint pins them
# (as Microsoft's pin CvT's and NVIDIA's pin ViL-LS's), and trained lsvision checkpoints depend on them
CVT_LS_STAGE3_KEYS = {
    'patch_embed.proj.weight', 'patch_embed.proj.bias', 'patch_embed.norm.weight', 'patch_embed.norm.bias',
    'cls_token',
    *(f'blocks.0.{n}' for n in (
        'norm1.weight', 'norm1.bias', 'norm2.weight', 'norm2.bias',
        'mlp.fc1.weight', 'mlp.fc1.bias', 'mlp.fc2.weight', 'mlp.fc2.bias',
        'attn.proj.weight', 'attn.proj.bias', 'attn.norm_local.weight', 'attn.norm_local.bias',
        'attn.norm_global.weight', 'attn.norm_global.bias',
        'attn.dynamic_proj.dw.weight', 'attn.dynamic_proj.dw.bias',
        'attn.dynamic_proj.pw.weight', 'attn.dynamic_proj.pw.bias',
        *(f'attn.qkv.{c}.{p}' for c in 'qkv' for p in (
            'dw.weight', 'dw.bias', 'pw.weight', 'pw.bias',
            'bn.weight', 'bn.bias', 'bn.running_mean', 'bn.running_var', 'bn.num_batches_tracked')),
    )),
}


def test_cvt_ls_state_dict_layout():
    model = timm.create_model('cvt_ls_13', depths=(1, 1, 1), device='meta')
    assert set(model.stages[2].state_dict()) == CVT_LS_STAGE3_KEYS


def test_long_short_layer_takes_any_qkv_module():
    """The layer knows no model: q, k, v and projection-logit modules are classes or partials it calls."""
    torch.manual_seed(0)
    attn = LongShortAttention2d(16, 2, 2, 2, qkv_layer=partial(LinearQkv, bias=False)).eval()
    assert isinstance(attn.qkv, LinearQkv) and attn.qkv.bias is None
    x = torch.randn(1, 1 + 4 * 4, 16)
    with torch.no_grad():
        ref = attn(x, (4, 4))
        attn.reparameterize()  # the default Linear modules offer no fusion: nothing changes
    assert attn.fused_proj is None and attn.qkv is not None and not attn.reparameterized
    with torch.no_grad():
        torch.testing.assert_close(attn(x, (4, 4)), ref, rtol=0, atol=0)


def test_cvt_ls_convs_fuse_through_their_own_hook():
    qkv = SepConvQkv(8).eval()
    assert qkv.fuse_projections(nn.Linear(8, 4)) is None  # only with CvT-LS's projection conv
    bn = qkv.k.bn
    qkv.k.bn = nn.BatchNorm2d(8, track_running_stats=False)  # no running statistics: nothing to fold
    assert qkv.fuse_projections(ConvDynamicProjection(8, 4)) is None
    qkv.k.bn = bn
    fused = qkv.fuse_projections(ConvDynamicProjection(8, 4).eval())
    assert fused is not None and fused.reparameterized


def test_cvt_names_an_unknown_attention():
    with pytest.raises(ValueError, match=r"attn_type must be one of \('conv', 'long_short'\), got 'full'"):
        timm.create_model('cvt_13', attn_type='full', device='meta')


@pytest.mark.parametrize('train', [True, False])
def test_cvt_ls_stacked_qkv_equals_three_convs(train):
    """`SepConvQkv.forward_stacked` (CUDA's: one cast of the map, the pointwise convs as one batched GEMM, the
    projection-logit conv on the same map) gives the three `SepConv2d` calls' q, k, v and `ConvDynamicProjection`'s
    logits, their gradients (map and every parameter) and the BatchNorm running statistics."""
    results = []
    for stacked in (False, True):
        torch.manual_seed(0)
        qkv, dp = SepConvQkv(8).double().train(train), ConvDynamicProjection(8, 6).double().train(train)
        for c in (qkv.q, qkv.k, qkv.v):  # BatchNorms that are not the identity
            nn.init.normal_(c.bn.weight, 1., .3), nn.init.normal_(c.bn.bias, 0., .3)
        x = torch.randn(2, 1 + 5 * 7, 8, dtype=torch.float64, requires_grad=True)
        feat_map = x[:, 1:].transpose(1, 2).reshape(2, 8, 5, 7)
        if stacked:
            q, kv, logits = qkv.forward_stacked(feat_map, dp)
            out = [q, *kv.unbind(0), logits]
        else:
            out = [c(feat_map) for c in (qkv.q, qkv.k, qkv.v)] + [dp(x[:, 1:], (5, 7))]
        sum((o * (i + 1)).sin().sum() for i, o in enumerate(out)).backward()
        results.append([*out, x.grad, *[p.grad for p in (*qkv.parameters(), *dp.parameters())], *qkv.buffers()])
    assert qkv.stacks() and len(results[1]) == len(results[0])
    for ours, theirs in zip(results[1], results[0]):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)
