"""The 1D long-short attention layers (bidirectional and causal) against dense references (spec sequence.md §6)."""
import math

import pytest
import torch
from _helpers import perturb
from reference_attention import dense_causal_long_short_attention, dense_long_short_attention_1d

from lsvision.layers import CausalLongShortAttention, LongShortAttention1d, projection_weights


def _mask(B, n, pads, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, n, dtype=torch.bool)
    for b in range(B):
        k = int(torch.randint(0, pads + 1, (1,), generator=g)) if b else pads
        if k:
            mask[b, n - k:] = False
    return mask


@pytest.mark.parametrize('n,w,r,heads,pads', [(64, 8, 32, 2, 13), (48, 16, 2, 2, 5), (40, 1, 1, 2, 7),
                                              (30, 3, 4, 4, 4), (37, 8, 4, 2, 3), (70, 32, 4, 2, 9)])
@pytest.mark.parametrize('with_cls', [False, True])
def test_bidir_matches_dense_reference_fp64(n, w, r, heads, pads, with_cls):
    torch.manual_seed(0)
    C = 16 * heads
    attn = perturb(LongShortAttention1d(C, heads, w, r)).double().eval()
    x = torch.randn(3, n, C, dtype=torch.float64)
    mask = _mask(3, n, pads)
    cls = torch.randn(3, 1, C, dtype=torch.float64) if with_cls else None
    with torch.no_grad():
        fast = attn(x, mask, cls)
        dense = dense_long_short_attention_1d(attn, x, mask, cls)
    assert fast.shape == (3, n + with_cls, C)
    torch.testing.assert_close(fast, dense, rtol=0, atol=1e-10)


@pytest.mark.parametrize('w,span', [(1, 3), (3, 5), (8, 16)])
def test_window_span(w, span):
    """With r = 0, token j changes output i iff j is real and floor(i/w)w - e <= j < floor(i/w)w + w + e."""
    torch.manual_seed(0)
    n = 24
    attn = perturb(LongShortAttention1d(8, 1, w, 0)).double().eval()
    x = torch.randn(1, n, 8, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(1, n, dtype=torch.bool)
    mask[0, 20:] = False
    out = attn(x, mask)
    e = max(w // 2, 1)
    assert w + 2 * e == span
    for i in (0, 5, 11, 19):
        (g,) = torch.autograd.grad(out[0, i].sum(), x, retain_graph=True)
        touched = g[0].abs().sum(-1) > 0
        lo = (i // w) * w - e
        expect = torch.tensor([(lo <= j < lo + span) and j < 20 for j in range(n)])
        assert torch.equal(touched, expect), i


def test_projection_weights_sum_to_one_and_come_from_x():
    torch.manual_seed(0)
    attn = perturb(LongShortAttention1d(16, 2, 4, 3)).eval()
    x = torch.randn(2, 20, 16)
    mask = _mask(2, 20, 6)
    P = projection_weights(attn.dynamic_proj(x), 2, mask)  # (B, h, r, n)
    torch.testing.assert_close(P.sum(-1), torch.ones(2, 2, 3))
    assert (P.masked_select(~mask[:, None, None, :].expand_as(P)) == 0).all()
    # the logits are a Linear of x (not of K): changing W_k leaves P as is
    with torch.no_grad():
        attn.qkv.weight[16:32].normal_()
    torch.testing.assert_close(projection_weights(attn.dynamic_proj(x), 2, mask), P, rtol=0, atol=0)


def test_padding_invariance_any_length_and_all_pad():
    torch.manual_seed(0)
    attn = perturb(LongShortAttention1d(16, 2, 8, 4)).eval()
    x = torch.randn(2, 37, 16)  # 37 % 8 != 0: padded internally
    mask = _mask(2, 37, 9)
    cls = torch.randn(2, 1, 16)
    x2 = x.clone()
    x2[~mask] = torch.randn(int((~mask).sum()), 16) * 100
    with torch.no_grad():
        a, b = attn(x, mask, cls), attn(x2, mask, cls)
    assert a.shape == (2, 38, 16)
    assert torch.equal(a[:, 1:][mask], b[:, 1:][mask]) and torch.equal(a[:, 0], b[:, 0])
    # padded positions hold W_o's bias (their attention output is 0)
    torch.testing.assert_close(a[:, 1:][~mask], attn.proj.bias.expand(int((~mask).sum()), 16))
    with torch.no_grad():
        empty = attn(x, torch.zeros(2, 37, dtype=torch.bool), cls)
    assert torch.isfinite(empty).all()


def test_dual_ln_shared_and_global_norm():
    torch.manual_seed(0)
    D = 64
    attn = LongShortAttention1d(D, 2, 8, 4).eval()
    names = [n for n, _ in attn.named_modules() if isinstance(_, torch.nn.LayerNorm)]
    assert names == ['norm_local', 'norm_global']  # one LN_L for K and V, one LN_G for K_bar, V_bar (and cls)
    x = torch.randn(1, 512, D)
    captured = {}
    attn.norm_global.register_forward_hook(lambda m, i, o: captured.update(inp=i[0], out=o))
    with torch.no_grad():
        attn(x, cls_token=torch.randn(1, 1, D))
    inp, out = captured['inp'], captured['out']
    assert out.shape == (2, 1, 1 + 4, D)  # K_bar and V_bar: the cls token's vector and the r = 4 projections, over D
    var = inp.var(-1, unbiased=False)
    expect = (D * var / (var + 1e-5)).sqrt()
    torch.testing.assert_close(out.norm(dim=-1), expect, rtol=1e-4, atol=1e-4)
    assert (out.norm(dim=-1) >= 0.99 * math.sqrt(D)).all()


@pytest.mark.parametrize('L,M,D,h,ls,r,W', [(32, 32, 32, 2, 4, 1, 8), (32, 16, 32, 4, 4, 2, 16),
                                            (16, 32, 32, 2, 4, 1, 32), (64, 64, 64, 4, 16, 1, 32)])
@pytest.mark.parametrize('chunk', [None, 16])
def test_causal_matches_dense_reference_fp64(L, M, D, h, ls, r, W, chunk):
    torch.manual_seed(0)
    attn = perturb(CausalLongShortAttention(D, h, W, ls, r, query_chunk_size=chunk)).double().eval()
    x = torch.randn(2, L, D, dtype=torch.float64)
    cache = torch.randn(2, M, D, dtype=torch.float64)
    with torch.no_grad():
        fast = attn(x, cache)
        dense = dense_causal_long_short_attention(attn, x, cache)
    torch.testing.assert_close(fast, dense, rtol=0, atol=1e-10)


def test_causal_project_then_average_cache_option():
    torch.manual_seed(0)
    attn = perturb(CausalLongShortAttention(32, 2, 8, 4, 2, compress_hidden_cache=False)).double().eval()
    x, cache = torch.randn(1, 24, 32).double(), torch.randn(1, 16, 32).double()
    with torch.no_grad():
        torch.testing.assert_close(attn(x, cache), dense_causal_long_short_attention(attn, x, cache),
                                   rtol=0, atol=1e-10)


@pytest.mark.parametrize('train', [False, True])
def test_causal_layer_has_no_future_leak(train):
    torch.manual_seed(0)
    attn = perturb(CausalLongShortAttention(32, 4, 8, 4, 2, query_chunk_size=8, attn_drop=0.1, pos_drop=0.1))
    attn.train(train)
    L = 32
    x = torch.randn(2, L, 32, requires_grad=True)
    cache = torch.randn(2, 16, 32, requires_grad=True)
    out = attn(x, cache)
    for t in (0, L // 3, L - 2):
        gx, gc = torch.autograd.grad(out[:, t].sum(), (x, cache), retain_graph=True)
        assert gx[:, t + 1:].abs().max() == 0.0
        assert gx[:, :t + 1].abs().sum(-1).min() > 0 or t < 0
        assert gc.abs().sum() > 0


def test_causal_visibility_and_segment_positions():
    """Query t weighs only window positions t-W+1..t and vectors of segments s < (M+t)//l; rho = r(J-s)-1-k."""
    torch.manual_seed(0)
    M, L, ls, r, W = 8, 8, 4, 2, 4
    from lsvision.layers.long_short_1d import segment_positions
    # M = 8, l = 4: queries t = 0..3 are in concatenated segment J = 2 and see vectors 0..3 (segments 0, 1)
    rho, hidden = segment_positions(torch.tensor([2, 3]), 6, r)
    assert rho[0, :4].tolist() == [3, 2, 1, 0] and hidden[0].tolist() == [False] * 4 + [True] * 2
    # J = 3 (t = 4..7): vectors 0..5 with rho 5..0
    assert rho[1].tolist() == [5, 4, 3, 2, 1, 0] and not hidden[1].any()
    # and through gradients: the window reaches back exactly W - 1 tokens (r = 1, zero LN_G gain: no global path)
    attn2 = perturb(CausalLongShortAttention(16, 2, W, ls, 1)).double().eval()
    with torch.no_grad():
        attn2.norm_global.weight.zero_()
        attn2.norm_global.bias.zero_()
    x = torch.randn(1, L, 16, dtype=torch.float64, requires_grad=True)
    out = attn2(x, torch.randn(1, M, 16).double())
    for t in range(L):
        (g,) = torch.autograd.grad(out[0, t].sum(), x, retain_graph=True)
        touched = (g[0].abs().sum(-1) > 0).nonzero().flatten().tolist()
        assert touched == list(range(max(0, t - W + 1), t + 1)), t


def test_causal_cache_rules():
    attn = CausalLongShortAttention(16, 2, 8, 4, 1)
    x = torch.randn(1, 8, 16)
    with pytest.raises(ValueError, match='masked-cache extension'):
        attn(x, torch.randn(1, 4, 16))  # M < W
    with pytest.raises(ValueError, match='masked-cache extension'):
        attn(x, torch.randn(1, 10, 16))  # M % l != 0
    assert attn(x, torch.randn(1, 10, 16), cache_valid_len=6).shape == (1, 8, 16)
    # a masked cache is ignored: same output as no cache at all
    with torch.no_grad():
        torch.testing.assert_close(attn(x, torch.randn(1, 12, 16), cache_valid_len=0), attn(x, None))
    # any length, and an all-masked start is finite
    assert torch.isfinite(attn(torch.randn(2, 13, 16))).all()


def test_bf16_autocast_close_to_fp32():
    torch.manual_seed(0)
    bidir = perturb(LongShortAttention1d(32, 2, 8, 8)).eval()
    causal = perturb(CausalLongShortAttention(32, 2, 8, 4, 1, query_chunk_size=16)).eval()
    x = torch.randn(2, 64, 32)
    mask = _mask(2, 64, 10)
    cache = torch.randn(2, 16, 32)
    with torch.no_grad():
        ref_b, ref_c = bidir(x, mask, x[:, :1]), causal(x, cache)
        with torch.autocast('cpu', dtype=torch.bfloat16):
            out_b, out_c = bidir(x, mask, x[:, :1]), causal(x, cache)
    for out, ref in ((out_b, ref_b), (out_c, ref_c)):
        assert torch.isfinite(out).all()
        assert (out.float() - ref).abs().max() < 2e-2 * max(1., ref.abs().max().item())
