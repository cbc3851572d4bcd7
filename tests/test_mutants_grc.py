"""Tests written to kill mutants of the GRC layer (`lsvision/layers/grc.py`) that survived `tests/test_grc.py`
(docs/testing.md, "Mutation testing"): the reparameterized (folded) eval path, gates without biases and the '2d'
summary resize, each against `tests/grc_reference.py` (spec grc.md restated from the parameters) in fp64.
"""
import pytest
import torch
import torch.nn.functional as F
from grc_reference import grc_reference
from test_grc import _reference_case

from timm.models import reparameterize_model

from lsvision.layers import GatedRecurrentCache, GrcConfig

CASES = ['vit', 'vit_input_frozen_eval', 'pvt_v1_sr', 'pvt_v2_linear', 'swin']


def _perturbed(case):
    """The reference case's layer in fp64, off its init: perturbed weights, mixing logits away from 0, a random
    cache."""
    attn, run, self_ref, train_steps, eval_calls = _reference_case(case)
    attn = attn.double()
    grc = attn.grc
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(torch.randn_like(p) * 0.2)
        grc.lam.normal_()
        grc.cache.normal_()
    return attn, run, self_ref, train_steps, eval_calls


@pytest.mark.parametrize('case', CASES)
def test_reparameterized_eval_matches_spec_reference_fp64(case):
    """The folded layer (gate terms of the frozen cache, mixing weights, PE filters, gathered position bias,
    patch-major reduction) gives the spec's eval output, computed from the unfolded layer's parameters."""
    attn, run, self_ref, _, eval_calls = _perturbed(case)
    attn.eval()
    folded = reparameterize_model(attn)
    assert folded.grc.reparameterized and folded.grc.gate_weight is not None
    grc = attn.grc
    p = grc.num_prefix_tokens
    for batch, hw in eval_calls:
        x = torch.randn(batch, p + hw[0] * hw[1], 32, dtype=torch.float64)
        want, _ = grc_reference(grc, x, self_ref(attn, x, hw), hw, grc.cache, training=False)
        with torch.no_grad():
            torch.testing.assert_close(run(folded, x, hw), want, rtol=0, atol=1e-10)
    assert torch.equal(folded.grc.cache, grc.cache)


@pytest.mark.parametrize('case', ['vit', 'pvt_v1_sr'])
def test_gates_without_biases_match_spec_reference_fp64(case):
    """Gate Linears without biases (the layer's bias-free matmul branch): train output and stored cache, then the
    folded eval output, against the reference."""
    attn, run, self_ref, train_steps, _ = _perturbed(case)
    grc = attn.grc
    for layer in (grc.linear_reset, grc.linear_update, grc.linear_candidate):
        layer.bias = None
    attn.train()
    p = grc.num_prefix_tokens
    batch, hw = train_steps[1]
    x = torch.randn(batch, p + hw[0] * hw[1], 32, dtype=torch.float64)
    before = grc.cache.clone()
    with torch.no_grad():
        out = run(attn, x, hw)
        want, stored = grc_reference(grc, x, self_ref(attn, x, hw), hw, before, training=True)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-10)
    torch.testing.assert_close(grc.cache, stored, rtol=0, atol=5e-7)
    attn.eval()
    folded = reparameterize_model(attn)
    with torch.no_grad():
        want, _ = grc_reference(grc, x, self_ref(attn, x, hw), hw, grc.cache, training=False)
        torch.testing.assert_close(run(folded, x, hw), want, rtol=0, atol=1e-10)


@pytest.mark.parametrize('prefix', [0, 1])
def test_2d_summary_resize_matches_spec_reference_fp64(prefix):
    """interp_mode='2d' on a grid other than the cache's: the stored update is the spec's, from the summary resized
    bilinearly over the patch grid (align_corners=False) with the prefix tokens kept. D_m = 16 = the cache's patch
    count, so that a test of the summary's length against the wrong axis would pass a wrong-length summary on."""
    torch.manual_seed(0)
    grc = GatedRecurrentCache(32, 2, cache_len=prefix + 16, cache_hw=(4, 4), num_prefix_tokens=prefix,
                              config=GrcConfig(interp_mode='2d')).double().train()
    with torch.no_grad():
        for p in grc.parameters():
            p.add_(torch.randn_like(p) * 0.2)
        grc.cache.normal_()
    before = grc.cache.clone()
    B, hw = 3, (5, 6)
    x = torch.randn(B, prefix + hw[0] * hw[1], 32, dtype=torch.float64)
    o_self = torch.randn_like(x)
    with torch.no_grad():
        grc(x, o_self, list(hw))
    grid = o_self[:, prefix:].transpose(1, 2).reshape(B, 32, *hw)
    resized = F.interpolate(grid, size=(4, 4), mode='bilinear', align_corners=False).flatten(2).transpose(1, 2)
    o_resized = torch.cat([o_self[:, :prefix], resized], dim=1)
    # the stored update depends on the summary and the cache only; x here only feeds the output, not compared
    x_cache_grid = torch.randn_like(o_resized)
    _, stored = grc_reference(grc, x_cache_grid, o_resized, (4, 4), before, training=True)
    torch.testing.assert_close(grc.cache, stored, rtol=0, atol=5e-7)


def _layer(dim_ratio: float, prefix: int, **config) -> GatedRecurrentCache:
    """A GRC layer (D = 32, 2 heads, 4x4 cache grid) in fp64, off its init, with a random cache."""
    torch.manual_seed(0)
    grc = GatedRecurrentCache(32, 2, cache_len=prefix + 16, cache_hw=(4, 4), num_prefix_tokens=prefix,
                              config=GrcConfig(ratio=dim_ratio, **config)).double()
    with torch.no_grad():
        for p in grc.parameters():
            p.add_(torch.randn_like(p) * 0.2)
        grc.lam.normal_()
        grc.cache.normal_()
    return grc


def _folded(grc: GatedRecurrentCache) -> GatedRecurrentCache:
    """A folded copy of the layer (timm's reparameterize_model folds the children of the module it is given)."""
    folded = reparameterize_model(torch.nn.ModuleDict({'grc': grc}))['grc']
    assert folded.reparameterized and folded.gate_weight is not None and folded.mix_weight is not None
    return folded


@pytest.mark.parametrize('ratio', [0.25, 0.5])
@pytest.mark.parametrize('prefix', [0, 1])
def test_layer_matches_spec_reference_fp64(ratio, prefix):
    """The layer on its own, at caching ratio 0.25 (the grouped PE conv, 4 channels a group) and 0.5 (the PE's two
    depthwise filters), with and without a prefix token, its grid inferred as a square (no feat_size): train output
    and stored cache, eval output, folded eval output."""
    grc = _layer(ratio, prefix).train()
    x = torch.randn(3, prefix + 16, 32, dtype=torch.float64)
    o_self = torch.randn_like(x)
    before = grc.cache.clone()
    with torch.no_grad():
        out = grc(x, o_self)
    want, stored = grc_reference(grc, x, o_self, (4, 4), before, training=True)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-10)
    torch.testing.assert_close(grc.cache, stored, rtol=0, atol=5e-7)
    grc.eval()
    want, _ = grc_reference(grc, x, o_self, (4, 4), grc.cache, training=False)
    with torch.no_grad():
        torch.testing.assert_close(grc(x, o_self), want, rtol=0, atol=1e-10)
        torch.testing.assert_close(_folded(grc)(x, o_self), want, rtol=0, atol=1e-10)


def test_layer_errors_say_what_is_wrong():
    grc = _layer(0.5, 1)
    x = torch.randn(2, 16, 32, dtype=torch.float64)  # 15 patch tokens after the prefix token
    with pytest.raises(ValueError, match=r'output .*\[2, 16, 16\].* must match its input .*\[2, 16, 32\]'):
        grc(x, x[..., :16])
    with pytest.raises(ValueError, match='^pass feat_size: 15 patch tokens are not a square grid'):
        grc(x, x)
    with pytest.raises(ValueError, match=r'^16 tokens != 1 prefix \+ 3x4 patches'):
        grc(x, x, [3, 4])


def test_legacy_onnx_export_is_refused_naming_the_layer(tmp_path):
    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.grc = GatedRecurrentCache(32, 2, cache_len=16, cache_hw=(4, 4)).eval()

        def forward(self, x):
            return self.grc(x, x, [4, 4])

    with pytest.raises(RuntimeError, match='^GatedRecurrentCache cannot be exported by the legacy'):
        torch.onnx.export(Wrapped(), (torch.randn(1, 16, 32),), str(tmp_path / 'm.onnx'), dynamo=False)


def test_eval_graph_keeps_the_cache_it_read():
    """An eval forward with autograd on reads a copy of the cache: a train forward that stores a new cache before
    that graph's backward changes neither the backward's success nor the gradients (of the gates' weights, whose
    backward reads the cache)."""
    grc = _layer(0.5, 0).eval()
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    o_self = torch.randn(2, 16, 32, dtype=torch.float64, requires_grad=True)
    inputs = [o_self] + list(grc.parameters())
    expected = torch.autograd.grad(grc(x, o_self).square().sum(), inputs)
    out = grc(x, o_self)
    grc.train()
    with torch.no_grad():
        grc(torch.randn_like(x), torch.randn_like(x))  # stores a new cache in place
    for got, want in zip(torch.autograd.grad(out.square().sum(), inputs), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize('prefix', [0, 1])
@pytest.mark.parametrize('folded', [False, True])
def test_autocast_output_has_the_self_branch_dtype(prefix, folded):
    """Under CPU bf16 autocast (fp32 input, bf16 self-attention output, as in the models) the layer returns bf16,
    within 2e-2 of the output's scale from the fp32 output."""
    grc = GatedRecurrentCache(32, 2, cache_len=prefix + 16, cache_hw=(4, 4), num_prefix_tokens=prefix).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in grc.parameters():
            p.add_(torch.randn_like(p) * 0.2)
        grc.cache.normal_()
    layer = _folded(grc) if folded else grc
    x = torch.randn(2, prefix + 16, 32)
    o_self = torch.randn(2, prefix + 16, 32)
    with torch.no_grad():
        want = grc(x, o_self)
        with torch.autocast('cpu', dtype=torch.bfloat16):
            got = layer(x, o_self.bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0, atol=2e-2 * want.abs().max().item())


def test_square_grid_is_inferred_after_several_prefix_tokens():
    """Without feat_size the patch grid is the square of the tokens after the prefix: 4 prefix tokens + 3x3."""
    grc = GatedRecurrentCache(32, 2, cache_len=13, cache_hw=(3, 3), num_prefix_tokens=4).double().eval()
    x, o_self = torch.randn(2, 13, 32, dtype=torch.float64), torch.randn(2, 13, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(grc(x, o_self), grc(x, o_self, [3, 3]), rtol=0, atol=0)
