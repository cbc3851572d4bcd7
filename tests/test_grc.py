"""GRC-Attention (Cached Transformers): the layer and the GRC backbones.

PVT v1 (`pvt_*`, `pvt_*_grc`), PVT v2 (`pvt_v2_*_grc`), Swin (`swin_*_grc`) and ViT/DeiT (`vit_small_*_grc`,
`deit_small_*_grc`). Assertions follow the GRC spec §6. Models are tiny (1-2 blocks per stage, 32-96 px) except for
parameter counts (meta device) and the FLOP overheads (224 px, four small models).
"""
import os
import re
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn as nn
from _helpers import (
    TINY_CONFIGS,
    TINY_TWO_STAGE_FAMILIES,
    forkserver,
    free_port,
    grc_caches,
    grc_modules,
    perturb,
    shapes_only,
    tiny_model,
)
from grc_reference import grc_reference, pvt_self_attention, swin_self_attention, vit_self_attention

import timm
from timm.layers import Attention as TimmAttention
from timm.models.pvt_v2 import Attention as TimmPvtV2Attention
from timm.models.swin_transformer import WindowAttention as TimmWindowAttention

import lsvision  # noqa: F401  (registers the models)
from lsvision.flops import count_flops
from lsvision.layers import GatedRecurrentCache, GrcAttention, GrcConfig, wrap_attention_with_grc
from lsvision.models import CheckpointMismatchError
from lsvision.models.pvt import PvtAttention, PvtGrcAttention
from lsvision.models.pvt_v2_grc import PvtV2GrcAttention
from lsvision.models.swin_grc import SwinGrcWindowAttention
from lsvision.models.vit_grc import VitGrcAttention

SWIN_T = 'swin_tiny_patch4_window7_224_grc'
VIT_S = 'vit_small_patch16_224_grc'

# spec §3/§4 parameter counts; measured exactly, and they round to the spec's M figures
PARAMS = {
    'pvt_tiny': 13_229_288, 'pvt_small': 24_485_864, 'pvt_medium': 44_208_104, 'pvt_large': 61_369_320,
    'pvt_tiny_grc': 15_671_048, 'pvt_small_grc': 29_357_417, 'pvt_medium_grc': 53_476_517,
    'pvt_large_grc': 74_374_170,
    'pvt_v2_b0_grc': 4_289_640, 'pvt_v2_b1_grc': 16_450_760, 'pvt_v2_b2_grc': 30_234_409,
    'pvt_v2_b3_grc': 54_507_109, 'pvt_v2_b4_grc': 75_560_922, 'pvt_v2_b5_grc': 99_504_727,
    'pvt_v2_b2_li_grc': 26_723_881,
    SWIN_T: 33_806_950, 'swin_small_patch4_window7_224_grc': 59_681_302,
    'swin_base_patch4_window7_224_grc': 105_563_856,
    VIT_S: 26_582_704, 'deit_small_patch16_224_grc': 26_582_704,
}
SPEC_M = {
    'pvt_tiny': 13.23, 'pvt_small': 24.49, 'pvt_medium': 44.21, 'pvt_large': 61.37,
    'pvt_tiny_grc': 15.67, 'pvt_small_grc': 29.36, 'pvt_medium_grc': 53.48, 'pvt_large_grc': 74.37,
    'pvt_v2_b0_grc': 4.29, 'pvt_v2_b1_grc': 16.45, 'pvt_v2_b2_grc': 30.23, 'pvt_v2_b3_grc': 54.51,
    'pvt_v2_b4_grc': 75.56, 'pvt_v2_b5_grc': 99.50, 'pvt_v2_b2_li_grc': 26.72,
    SWIN_T: 33.81, 'swin_small_patch4_window7_224_grc': 59.68, 'swin_base_patch4_window7_224_grc': 105.56,
    VIT_S: 26.58, 'deit_small_patch16_224_grc': 26.58,
}

# name -> kwargs of a tiny config of each GRC model the tests build (T_m follows img_size)
TINY = {name: kwargs for name, kwargs in TINY_CONFIGS.items() if name.endswith('_grc')}
FIRST_CACHE_LEN = {'pvt_tiny_grc': 256, 'pvt_v2_b0_grc': 256, 'pvt_v2_b2_li_grc': 256, SWIN_T: 49, VIT_S: 17}
PVT_TINY = [n for n in TINY if n.startswith('pvt')]


def _tiny(name, **kwargs):
    return tiny_model(name, num_classes=10, **kwargs)


def _nparams(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize('name', list(PARAMS))
def test_param_count(name):
    with shapes_only():
        model = timm.create_model(name)
    n = _nparams(model)
    assert n == PARAMS[name]
    assert round(n / 1e6, 2) == SPEC_M[name]


@pytest.mark.parametrize('name,count', [
    ('pvt_tiny_grc', 8), ('pvt_v2_b2_grc', 16), ('pvt_v2_b0_grc', 8), (SWIN_T, 12), (VIT_S, 12)])
def test_one_grc_per_block(name, count):
    with shapes_only():
        model = timm.create_model(name)
    assert len(grc_modules(model)) == count
    assert all(isinstance(m.attn.grc, GatedRecurrentCache) for m in model.modules() if hasattr(m, 'attn'))


@pytest.mark.parametrize('base', ['pvt_tiny', 'pvt_v2_b0', 'swin_tiny_patch4_window7_224', 'vit_small_patch16_224'])
def test_overhead_band(base):
    torch.manual_seed(0)
    plain = timm.create_model(base).eval()
    grc = timm.create_model(base + '_grc').eval()
    caches = grc_caches(grc)
    dp = _nparams(grc) / _nparams(plain) - 1
    df = count_flops(grc, (3, 224, 224)).total / count_flops(plain, (3, 224, 224)).total - 1
    assert 0.12 <= dp <= 0.25, dp
    assert 0.12 <= df <= 0.25, df
    assert all(torch.equal(a, b) for a, b in zip(caches, grc_caches(grc))), 'FLOP counting in eval changed a cache'


@pytest.mark.parametrize('name', list(TINY))
def test_cache_buffers_and_lambda(name):
    model = _tiny(name)
    sd = model.state_dict()
    grcs = dict((n, m) for n, m in model.named_modules() if isinstance(m, GatedRecurrentCache))
    for n, m in grcs.items():
        c = m.cache
        assert c.shape == (1, m.cache_len, int(0.5 * m.dim))
        assert c.dtype == torch.float32 and not c.requires_grad and not c.any()
        assert f'{n}.cache' in sd
        assert m.lam.shape == (m.num_heads,)
        torch.testing.assert_close(torch.sigmoid(m.lam), torch.full_like(m.lam, 0.5))
    # the cache follows the training resolution (stage grids at 64 px, a window, prefix + patches)
    assert next(iter(grcs.values())).cache_len == FIRST_CACHE_LEN[name]
    lam = _tiny(name, grc_lam_init=-1.0)
    assert all(torch.allclose(m.lam, torch.full_like(m.lam, -1.0)) for m in grc_modules(lam))


@pytest.mark.parametrize('name', PVT_TINY)
def test_forward_shapes_and_sizes(name):
    model = _tiny(name).eval()
    for b in (1, 2):
        out = model(torch.randn(b, 3, 64, 64))
        assert out.shape == (b, 10) and torch.isfinite(out).all()
    # other resolutions (summary resized to T_m) and non-square inputs, eval and train
    assert model(torch.randn(1, 3, 96, 96)).shape == (1, 10)
    model.train()
    assert torch.isfinite(model(torch.randn(2, 3, 64, 96))).all()


@pytest.mark.parametrize('name', list(TINY))
def test_train_steps(name):
    model = _tiny(name, drop_path_rate=0.1).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 3, 64, 64)
    before = grc_caches(model)
    model(x).logsumexp(-1).mean().backward()
    after = grc_caches(model)
    assert all(not torch.equal(a, b) for a, b in zip(before, after)), 'a cache did not change in train mode'
    opt.step()  # keep the grads: two steps accumulate
    model(torch.randn(2, 3, 64, 64)).logsumexp(-1).mean().backward()  # no graph kept across steps
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
        if '.grc.' in n and not (name == VIT_S and n.startswith(f'blocks.{len(model.blocks) - 1}.attn.grc.pe')):
            # ViT's last-block PE only feeds patch outputs that the token head never uses
            assert p.grad.abs().sum() > 0, f'zero gradient for {n}'
    # stateful: same input twice in train mode gives different outputs
    with torch.no_grad():
        assert not torch.allclose(model(x), model(x))


def test_stored_cache_is_batch_mean():
    torch.manual_seed(0)
    grc = GatedRecurrentCache(32, 2, cache_len=16, cache_hw=(4, 4)).train()
    with torch.no_grad():
        grc.cache.normal_()
    start = grc.cache.clone()
    x, o = torch.randn(4, 16, 32), torch.randn(4, 16, 32)
    grc(x, o, [4, 4])
    batch = grc.cache.clone()
    singles = []
    for i in range(4):
        grc.cache.copy_(start)
        grc(x[i:i + 1], o[i:i + 1], [4, 4])
        singles.append(grc.cache.clone())
    torch.testing.assert_close(batch, torch.stack(singles).mean(0), atol=1e-6, rtol=0)


@pytest.mark.parametrize('name', list(TINY))
def test_eval_batch_independent_and_frozen(name):
    model = _tiny(name).train()
    with torch.no_grad():
        model(torch.randn(4, 3, 64, 64))  # non-zero caches
    model.eval()
    caches = grc_caches(model)
    x = torch.randn(4, 3, 64, 64)
    with torch.no_grad():
        full = model(x)
        ones = torch.cat([model(x[i:i + 1]) for i in range(4)])
        perm = torch.tensor([2, 0, 3, 1])
        permuted = model(x[perm])
        mixed = model(torch.cat([x[:2], torch.randn(3, 3, 64, 64)]))[:2]
        again = model(x)
    torch.testing.assert_close(ones, full, atol=1e-5, rtol=0)
    torch.testing.assert_close(permuted, full[perm], atol=1e-5, rtol=0)
    torch.testing.assert_close(mixed, full[:2], atol=1e-5, rtol=0)
    assert torch.equal(again, full)
    assert all(torch.equal(a, b) for a, b in zip(caches, grc_caches(model))), 'eval changed a cache'
    model.train()  # train resumes updates
    with torch.no_grad():
        model(x)
    assert all(not torch.equal(a, b) for a, b in zip(caches, grc_caches(model)))


@pytest.mark.parametrize('name', list(TINY))
def test_state_dict_round_trip(name, tmp_path):
    model = _tiny(name).train()
    with torch.no_grad():
        model(torch.randn(2, 3, 64, 64))
    model.eval()
    torch.save(model.state_dict(), tmp_path / 'w.pth')
    fresh = _tiny(name)
    fresh.load_state_dict(torch.load(tmp_path / 'w.pth'), strict=True)
    fresh.eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        ref = model(x)
        assert torch.equal(fresh(x), ref)
        fresh.reset_cache()
        assert not torch.allclose(fresh(x), ref), 'zeroing the caches did not change the outputs'


def _reference_case(case):
    """A GRC attention (D = 32, 2 heads, D_m = 16) of one backbone kind, how to call it, its self branch restated
    (grc_reference), and the (batch, grid) of its train steps and eval calls (grids other than the cache's make the
    summary resize to T_m)."""
    torch.manual_seed(0)
    if case.startswith('vit'):
        config = GrcConfig(summary_src='input', eval_update=False) if case == 'vit_input_frozen_eval' else None
        attn = wrap_attention_with_grc(TimmAttention(32, 2, qkv_bias=True), VitGrcAttention, 32, 2, cache_hw=(4, 4),
                                       config=config, num_prefix_tokens=1)
        return (attn, lambda a, x, hw: a(x, feat_size=list(hw)), lambda a, x, hw: vit_self_attention(a, x),
                [(3, (4, 4)), (2, (5, 6)), (4, (4, 4))], [(3, (4, 4)), (2, (3, 5))])
    if case == 'pvt_v1_sr':  # spatial reduction 2 on the patch grid and on the cache grid, a cls token (prefix)
        attn = wrap_attention_with_grc(PvtAttention(32, 2, sr_ratio=2, num_prefix_tokens=1), PvtGrcAttention, 32, 2,
                                       cache_hw=(8, 8), num_prefix_tokens=1, mem_attn_kwargs=dict(sr_ratio=2))
        return (attn, lambda a, x, hw: a(x, list(hw)), lambda a, x, hw: pvt_self_attention(a, x, hw, prefix=1),
                [(3, (8, 8)), (2, (6, 10)), (3, (8, 8))], [(3, (8, 8)), (2, (4, 6))])
    if case == 'pvt_v2_linear':  # linear SRA: pool 7, 1x1 conv, LN, GELU
        attn = wrap_attention_with_grc(TimmPvtV2Attention(32, 2, linear_attn=True), PvtV2GrcAttention, 32, 2,
                                       cache_hw=(8, 8), mem_attn_kwargs=dict(linear_attn=True))
        return (attn, lambda a, x, hw: a(x, list(hw)), lambda a, x, hw: pvt_self_attention(a, x, hw),
                [(3, (8, 8)), (2, (8, 8)), (3, (8, 8))], [(3, (8, 8))])
    assert case == 'swin'  # 4x4 windows, 3 windows per image, a shift mask; the cache has one slot per window slot
    attn = wrap_attention_with_grc(TimmWindowAttention(32, 2, window_size=4), SwinGrcWindowAttention, 32, 2,
                                   cache_hw=(4, 4), mem_attn_kwargs=dict(window_size=(4, 4)))
    mask = torch.zeros(3, 16, 16, dtype=torch.float64).masked_fill(torch.rand(3, 16, 16) > 0.7, -100.)
    return (attn, lambda a, x, hw: a(x, mask), lambda a, x, hw: swin_self_attention(a, x, mask),
            [(6, (4, 4)), (3, (4, 4)), (6, (4, 4))], [(6, (4, 4))])


@pytest.mark.parametrize('case', ['vit', 'vit_input_frozen_eval', 'pvt_v1_sr', 'pvt_v2_linear', 'swin'])
def test_grc_matches_spec_reference_fp64(case):
    """Against grc_reference (spec §1.2 written out from the parameters), in fp64 with random mixing logits, a
    non-zero cache and perturbed weights: three train steps (output, stored cache = batch mean of the per-sample
    update, and every parameter's gradient; SGD in between), then eval (output; the cache is not written)."""
    attn, run, self_ref, train_steps, eval_calls = _reference_case(case)
    grc = attn.grc
    attn = attn.double().train()
    perturb(attn, 0.2)  # off the init, so that every term matters
    with torch.no_grad():
        grc.lam.normal_()  # sigmoid(lam) away from 0 and 1: both branches count
        grc.cache.normal_()
    params = dict(attn.named_parameters())
    opt = torch.optim.SGD(params.values(), lr=0.01)
    p = grc.num_prefix_tokens
    for batch, hw in train_steps:
        x = torch.randn(batch, p + hw[0] * hw[1], 32, dtype=torch.float64)
        weight = torch.randn_like(x)
        before = grc.cache.clone()
        out = run(attn, x, hw)
        want, stored = grc_reference(grc, x, self_ref(attn, x, hw), hw, before, training=True)
        torch.testing.assert_close(out, want, rtol=0, atol=1e-10)  # measured <= 4e-15
        # the stored update; the layer averages in fp32 (buffers are fp32), hence fp32 rounding (measured <= 2.4e-7)
        torch.testing.assert_close(grc.cache, stored, rtol=0, atol=5e-7)
        got = torch.autograd.grad((out * weight).mean(), list(params.values()), allow_unused=True)
        ref = torch.autograd.grad((want * weight).mean(), list(params.values()), allow_unused=True)
        for name, a, b in zip(params, got, ref):
            assert (a is None) == (b is None), name
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10, msg=lambda m, name=name: f'{name}: {m}')
                params[name].grad = a
        opt.step()
    attn.eval()
    frozen = grc.cache.clone()
    with torch.no_grad():
        for batch, hw in eval_calls:
            x = torch.randn(batch, p + hw[0] * hw[1], 32, dtype=torch.float64)
            want, _ = grc_reference(grc, x, self_ref(attn, x, hw), hw, frozen, training=False)
            torch.testing.assert_close(run(attn, x, hw), want, rtol=0, atol=1e-10)
    assert torch.equal(grc.cache, frozen), 'eval wrote the cache'


def test_reduction_to_wrapped_attention_pvt_v2():
    torch.manual_seed(0)
    attn = wrap_attention_with_grc(TimmPvtV2Attention(64, num_heads=2, sr_ratio=2), PvtV2GrcAttention, 64, 2,
                                   cache_hw=(8, 8), mem_attn_kwargs=dict(sr_ratio=2)).train()
    with torch.no_grad():
        attn.grc.cache.normal_()
        attn.grc.lam.fill_(float('-inf'))
        attn.grc.pe.weight.zero_()
        attn.grc.pe.bias.zero_()
    plain = TimmPvtV2Attention(64, num_heads=2, sr_ratio=2)
    missing, unexpected = plain.load_state_dict(attn.state_dict(), strict=False)
    assert not missing and all(k.startswith('grc.') for k in unexpected)
    x = torch.randn(2, 64, 64)
    assert torch.equal(attn(x, [8, 8]), plain(x, [8, 8]))


def test_reduction_to_wrapped_attention_swin():
    torch.manual_seed(0)
    attn = wrap_attention_with_grc(TimmWindowAttention(32, 2, window_size=7), SwinGrcWindowAttention, 32, 2,
                                   cache_hw=(7, 7), mem_attn_kwargs=dict(window_size=(7, 7))).train()
    with torch.no_grad():
        attn.grc.cache.normal_()
        attn.grc.lam.fill_(float('-inf'))
        attn.grc.pe.weight.zero_()
        attn.grc.pe.bias.zero_()
    plain = TimmWindowAttention(32, 2, window_size=7)
    missing, unexpected = plain.load_state_dict(attn.state_dict(), strict=False)
    assert not missing and all(k.startswith('grc.') for k in unexpected)
    x = torch.randn(4, 49, 32)
    mask = torch.zeros(2, 49, 49).masked_fill(torch.rand(2, 49, 49) > 0.7, -100.)
    assert torch.equal(attn(x, mask), plain(x, mask))
    assert torch.equal(attn(x), plain(x))


def test_reduction_to_wrapped_attention_vit():
    torch.manual_seed(0)
    attn = wrap_attention_with_grc(TimmAttention(64, 2, qkv_bias=True), VitGrcAttention, 64, 2, cache_hw=(4, 4),
                                   num_prefix_tokens=1).train()
    with torch.no_grad():
        attn.grc.cache.normal_()
        attn.grc.lam.fill_(float('-inf'))
        attn.grc.pe.weight.zero_()
        attn.grc.pe.bias.zero_()
    plain = TimmAttention(64, 2, qkv_bias=True)
    missing, unexpected = plain.load_state_dict(attn.state_dict(), strict=False)
    assert not missing and all(k.startswith('grc.') for k in unexpected)
    x = torch.randn(2, 17, 64)
    assert torch.equal(attn(x), plain(x))


def test_reduction_to_wrapped_attention_pvt_v1():
    model = _tiny('pvt_tiny_grc').train()
    n = 0
    for m in model.modules():
        if isinstance(m, PvtGrcAttention):
            with torch.no_grad():
                m.grc.cache.normal_()
                m.grc.lam.fill_(float('-inf'))
                m.grc.pe.weight.zero_()
                m.grc.pe.bias.zero_()
            h, w = m.grc.cache_hw
            x = torch.randn(2, m.num_prefix_tokens + h * w, m.q.in_features)
            assert torch.equal(m(x, [h, w]), m.self_attention(x, [h, w]))
            n += 1
    assert n == 4


def test_generic_wrapper():
    torch.manual_seed(0)
    attn = GrcAttention(nn.Identity(), 32, 4, cache_len=17, cache_hw=(4, 4), num_prefix_tokens=1)
    with torch.no_grad():
        attn.grc.lam.fill_(float('-inf'))
        attn.grc.pe.weight.zero_()
        attn.grc.pe.bias.zero_()
    x = torch.randn(2, 17, 32)
    assert torch.equal(attn(x), x)


def test_baseline_weights_load(tmp_path):
    torch.manual_seed(0)
    base = timm.create_model('pvt_v2_b0')
    torch.save(base.state_dict(), tmp_path / 'pvt_v2_b0.pth')
    model = timm.create_model(
        'pvt_v2_b0_grc', pretrained=True,
        pretrained_cfg_overlay=dict(file=str(tmp_path / 'pvt_v2_b0.pth')))
    sd = model.state_dict()
    for k, v in base.state_dict().items():
        assert torch.equal(sd[k], v), k
    assert all(not m.cache.any() for m in grc_modules(model))
    missing, unexpected = timm.create_model('pvt_v2_b0_grc').load_state_dict(
        base.state_dict(), strict=False)
    assert missing and all('.attn.grc.' in k for k in missing) and not unexpected
    # PVT v1: plain -> GRC
    v1 = timm.create_model('pvt_tiny', **TINY_CONFIGS['pvt_tiny'])
    missing, unexpected = timm.create_model('pvt_tiny_grc', **TINY['pvt_tiny_grc']).load_state_dict(
        v1.state_dict(), strict=False)
    assert missing and all('.attn.grc.' in k for k in missing) and not unexpected


@pytest.mark.parametrize('name', [SWIN_T, VIT_S])
def test_baseline_weights_load_swin_vit(name, tmp_path):
    torch.manual_seed(0)
    base = timm.create_model(name[:-4], num_classes=10, **TINY[name])
    torch.save(base.state_dict(), tmp_path / 'base.pth')
    model = timm.create_model(
        name, pretrained=True, num_classes=10, pretrained_cfg_overlay=dict(file=str(tmp_path / 'base.pth')),
        **TINY[name])
    sd = model.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in base.state_dict().items() if not k.startswith('head'))
    missing, unexpected = timm.create_model(name, num_classes=10, **TINY[name]).load_state_dict(
        base.state_dict(), strict=False)
    assert missing and all('.attn.grc.' in k for k in missing) and not unexpected


def test_swin_set_input_size():
    model = _tiny(SWIN_T).train()
    with torch.no_grad():
        model(torch.randn(2, 3, 64, 64))
    model.set_input_size(img_size=(96, 96), window_size=8)
    grc = grc_modules(model)[0]
    assert grc.cache.shape == (1, 64, 16) and grc.cache.any()
    assert grc.mem_attn.relative_position_bias_table.shape == (15 * 15, 2)
    assert model(torch.randn(2, 3, 96, 96)).shape == (2, 10)
    model.eval()
    x = torch.randn(2, 3, 96, 96)
    with torch.no_grad():
        torch.testing.assert_close(torch.cat([model(x[:1]), model(x[1:])]), model(x), atol=1e-5, rtol=0)


def test_vit_dynamic_img_size():
    model = _tiny(VIT_S, dynamic_img_size=True).train()
    assert model(torch.randn(2, 3, 80, 80)).shape == (2, 10)  # 26 tokens, cache of 17
    model.eval()
    assert torch.isfinite(model(torch.randn(1, 3, 96, 96))).all()


def test_official_pvt_v1_names_map():
    from official_layouts import official_pvt  # whai362/PVT names, from the test's own tables

    from lsvision.models.pvt import checkpoint_filter_fn
    model = timm.create_model('pvt_tiny', **TINY_CONFIGS['pvt_tiny'])
    sd = model.state_dict()
    sd_official = official_pvt(model)
    assert 'patch_embed1.proj.weight' in sd_official and 'block4.0.attn.q.weight' in sd_official
    filtered = checkpoint_filter_fn(sd_official, model)
    assert filtered.keys() == sd.keys()
    assert all(torch.equal(filtered[k], sd[k]) for k in sd)


def test_grad_checkpointing_raises():
    for name in TINY:
        with pytest.raises(RuntimeError, match='gradient checkpointing'):
            _tiny(name).set_grad_checkpointing(True)
    timm.create_model('pvt_tiny', **TINY_CONFIGS['pvt_tiny']).set_grad_checkpointing(True)  # plain PVT supports it


def test_bad_options_and_layer_inputs():
    # wrong image inputs of the PVT GRC models: tests/test_input_sizes.py (every family)
    with pytest.raises(ValueError, match='cache width'):
        timm.create_model('pvt_v2_b0_grc', grc_ratio=0.3, device='meta')
    with pytest.raises(ValueError, match='summary_src'):
        GrcConfig(summary_src='x')
    with pytest.raises(ValueError, match='summary_src'):
        timm.create_model(SWIN_T, grc_summary_src='x', device='meta')
    grc = GatedRecurrentCache(32, 2, 16, cache_hw=(4, 4))
    with pytest.raises(ValueError, match='width'):
        grc(torch.randn(1, 16, 16), torch.randn(1, 16, 16), [4, 4])
    with pytest.raises(ValueError, match='patches'):
        grc(torch.randn(1, 16, 32), torch.randn(1, 16, 32), [3, 3])
    for name in ('pvt_tiny_grc', 'pvt_v2_b0_grc', SWIN_T, VIT_S):
        with pytest.raises(TypeError):
            timm.create_model(name, not_an_arg=1, device='meta')
        with pytest.raises(TypeError, match='grc_ratoi.*the GRC options are grc_ratio'):
            timm.create_model(name, grc_ratoi=0.25, device='meta')
        with pytest.raises(TypeError, match='either grc_config or grc_ratio'):
            timm.create_model(name, grc_config=GrcConfig(), grc_ratio=0.25, device='meta')


def test_options_frozen_eval_input_summary_2d():
    model = _tiny('pvt_v2_b0_grc', grc_eval_update=False, grc_summary_src='input', grc_interp_mode='2d').train()
    with torch.no_grad():
        model(torch.randn(2, 3, 96, 64))  # 2-d resize of the summary to the cache grid
    model.eval()
    caches = grc_caches(model)
    x = torch.randn(3, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(torch.cat([model(x[i:i + 1]) for i in range(3)]), model(x), atol=1e-5, rtol=0)
    assert all(torch.equal(a, b) for a, b in zip(caches, grc_caches(model)))


def test_resize_cache_and_autocast():
    model = _tiny('pvt_v2_b0_grc').train()
    with torch.autocast('cpu', dtype=torch.bfloat16):
        model(torch.randn(2, 3, 64, 64))
    assert all(c.dtype == torch.float32 and c.any() for c in grc_caches(model))
    model.resize_cache(96)
    assert grc_modules(model)[0].cache.shape == (1, 24 * 24, 16)
    assert model(torch.randn(2, 3, 96, 96)).shape == (2, 10)


def test_pvt_v1_token_pool():
    model = timm.create_model('pvt_tiny_grc', global_pool='token', num_classes=10, **TINY['pvt_tiny_grc']).eval()
    assert model(torch.randn(2, 3, 64, 64)).shape == (2, 10)


def _ddp_worker(rank, world, port, path, x):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=world)
    try:
        model = _tiny('pvt_v2_b0_grc', grc_sync_cache=True).train()
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.)
        for step in range(2):
            xs = x[step].chunk(world)[rank]
            ddp(xs).mean().backward()
            opt.step()
            opt.zero_grad()
        torch.save(grc_caches(model), os.path.join(path, f'rank{rank}.pth'))
    finally:
        dist.destroy_process_group()


def test_ddp_sync_cache_equals_global_batch(tmp_path):
    torch.manual_seed(1)
    x = torch.randn(2, 4, 3, 32, 32)
    mp.start_processes(_ddp_worker, args=(2, free_port(), str(tmp_path), x), nprocs=2, join=True,
                       start_method=forkserver())
    model = _tiny('pvt_v2_b0_grc', grc_sync_cache=True).train()
    with torch.no_grad():
        for step in range(2):
            model(x[step])
    single = grc_caches(model)
    r0 = torch.load(tmp_path / 'rank0.pth')
    r1 = torch.load(tmp_path / 'rank1.pth')
    for a, b, c in zip(r0, r1, single):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('batch,hw', [(1, (14, 14)), (3, (11, 13)), (16, (7, 7)), (2, (3, 5))])
def test_positional_conv_fast_paths_equal_grouped_conv(batch, hw):
    # the PE conv runs as 2 depthwise convs on channels-last views (own channel, pair partner): same sum as self.pe
    grc = GatedRecurrentCache(dim=32, num_heads=2, cache_len=hw[0] * hw[1], config=GrcConfig(ratio=0.5))
    torch.nn.init.normal_(grc.pe.bias)
    x = torch.randn(batch, hw[0] * hw[1], 32)
    want = grc.pe(x.transpose(1, 2).reshape(batch, 32, *hw)).flatten(2).transpose(1, 2)
    torch.testing.assert_close(grc._pe(x, list(hw)), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('name', ['pvt_tiny_grc', 'pvt_v2_b0_grc', SWIN_T, VIT_S])
def test_baseline_weights_missing_a_non_grc_key_is_an_error(name, tmp_path):
    # pretrained loading is not strict (GRC keys stay fresh), so each filter checks that nothing else is missing
    kwargs = dict(num_classes=10, **({} if name == 'pvt_v2_b0_grc' else TINY[name]))
    base_kwargs = {k: v for k, v in kwargs.items() if name != 'pvt_v2_b0_grc' or k != 'img_size'}
    state_dict = timm.create_model(name[:-4], **base_kwargs).state_dict()
    dropped = next(k for k in state_dict if k.endswith('attn.proj.weight'))
    del state_dict[dropped]
    torch.save(state_dict, tmp_path / 'base.pth')
    with pytest.raises(CheckpointMismatchError, match=f'lacks non-GRC keys.*{dropped}'):
        timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(tmp_path / 'base.pth')),
                          **kwargs)


@pytest.mark.parametrize('name', ['pvt_tiny_grc', 'pvt_v2_b0_grc', SWIN_T, VIT_S])
def test_another_architectures_checkpoint_is_not_blamed_on_grc(name, tmp_path):
    # a CvT checkpoint holds none of the model's tensors: the error says so, with both names and sample keys
    other = timm.create_model('cvt_13', embed_dims=(16, 32, 32), num_heads=(1, 1, 1), depths=(1, 1, 1))
    torch.save(other.state_dict(), tmp_path / 'cvt.pth')
    kwargs = dict(num_classes=10, **({} if name == 'pvt_v2_b0_grc' else TINY[name]))
    with pytest.raises(CheckpointMismatchError) as e:
        timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(tmp_path / 'cvt.pth')),
                          **kwargs)
    message = str(e.value)
    assert f'does not fit {name}' in message and 'GRC' not in message and len(message) < 1000
    assert 'missing: ' in message and 'not in the model: stages.0' in message


@pytest.mark.parametrize('doc', ['README.md', 'model_cards/pvt_v2_b0_grc.md', f'model_cards/{SWIN_T}.md',
                                 f'model_cards/{VIT_S}.md', 'model_cards/pvt_tiny_grc.md'])
def test_documented_cache_sync_keyword_works(doc):
    text = (Path(__file__).resolve().parents[1] / doc).read_text()
    (keyword,) = re.findall(r'With DDP, `(\w+)=True`', text)
    for name in ('pvt_v2_b0_grc', SWIN_T, VIT_S, 'pvt_tiny_grc'):
        grcs = grc_modules(_tiny(name, **{keyword: True}))
        assert grcs and all(m.sync_cache for m in grcs)


@pytest.mark.parametrize('name', list(TINY))
def test_grc_config_object_equals_grc_keyword_arguments(name):
    # one GrcConfig or the grc_* keywords (create_model, configs/*.yaml) build the same model
    options = dict(ratio=0.25, lam_init=-1.0, summary_src='input', eval_update=False, interp_mode='2d',
                   sync_cache=True)
    if name == SWIN_T:
        options['ratio'] = 0.5  # heads (2, 2, 4, 4) of 32 * 2^i channels: r = 0.25 leaves 8 channels for 4 heads
    by_keywords = _tiny(name, **{f'grc_{k}': v for k, v in options.items()})
    by_config = _tiny(name, grc_config=GrcConfig(**options))
    assert by_keywords.state_dict().keys() == by_config.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(by_keywords.state_dict().values(), by_config.state_dict().values()))
    for m in grc_modules(by_config):
        assert m.cache_dim == int(options['ratio'] * m.dim)
        assert (m.summary_src, m.eval_update, m.interp_mode, m.sync_cache) == ('input', False, '2d', True)
        assert torch.equal(m.lam, torch.full_like(m.lam, -1.0))
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(by_keywords.eval()(x), by_config.eval()(x))


def test_grc_keeps_the_options_of_the_base_attention(tmp_path):
    # the GRC attention is timm's attention as built (here with qk_norm), not a copy rebuilt from a few of its options
    kwargs = dict(TINY[VIT_S], num_classes=10, qk_norm=True)
    base = timm.create_model(VIT_S[:-4], **kwargs)
    model = timm.create_model(VIT_S, **kwargs)
    assert all(isinstance(blk.attn.q_norm, nn.LayerNorm) for blk in model.blocks)
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    assert missing and all('.attn.grc.' in k for k in missing) and not unexpected
    with torch.no_grad():
        for m in grc_modules(model):
            m.lam.fill_(float('-inf'))
            m.pe.weight.zero_()
            m.pe.bias.zero_()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), base.eval()(x), atol=1e-6, rtol=0)  # GRC off: the base model


def test_wrap_attention_with_grc_checks_the_class():
    with pytest.raises(TypeError, match='not a GRC subclass of Attention'):
        wrap_attention_with_grc(TimmAttention(32, 2), SwinGrcWindowAttention, 32, 2, cache_hw=(4, 4))
    attn = wrap_attention_with_grc(TimmAttention(32, 2), VitGrcAttention, 32, 2, cache_hw=(4, 4))
    with pytest.raises(TypeError, match='wrapped once'):
        wrap_attention_with_grc(attn, VitGrcAttention, 32, 2, cache_hw=(4, 4))


@pytest.mark.parametrize('name', list(TINY))
def test_torchscript_matches_eager(name):
    # the self branch is timm's own forward (`self_attention_of`), which TorchScript must compile as a method; two
    # stages (PVT v2-LI in PVT-GRC's): scripting's time grows with the modules it compiles
    model = _tiny(name, **TINY_TWO_STAGE_FAMILIES.get(name, TINY_TWO_STAGE_FAMILIES['pvt_tiny_grc'])).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(torch.jit.script(model)(x), model(x))
