"""The FlexAttention path of the 2D long-short window attention (`lsvision.layers.span_flex`) on the CPU.

FlexAttention runs forward only on the CPU (eager, materializing the scores: small maps here), which is enough to check
what the CUDA kernels will run: the `mask_mod` (span, map border, shared keys), the ViL-LS bias `score_mod`, both token
orders and the BlockMask built from per-block counts, against the dense reference `span_attention_reference`; and the
models with `span_kernel='flex'` against their default path. Gradients and the compiled kernels: tests/test_cuda.py.
"""
import warnings

import pytest
import torch
from _helpers import TINY_FAMILIES, perturb
from test_span_attention import LAYERS
from torch.nn.attention.flex_attention import create_block_mask

import timm

import lsvision  # noqa: F401  (registers the models)
from lsvision.layers import LongShortAttention2d, set_span_kernel, span_attention_reference
from lsvision.layers.long_short import window_rel_pos_index, window_rel_pos_table_size
from lsvision.layers.span_attention import span_window_key_mask, window_span
from lsvision.layers.span_flex import (
    span_flex_attention,
    span_flex_block_mask,
    span_flex_geometry,
    span_flex_mask_mod,
)

pytestmark = pytest.mark.filterwarnings('ignore:flex_attention called without torch.compile')

# (H, W, w, shared keys, order, block size, window bias): the maps the models allow, small: not divisible by w, w = 2
# (CvT-LS stage 3 at 224) and 3 (at 384), the cls stage (shared = r + 1), ViL-LS's w = 7 with its bias
CASES = [
    ((9, 11), 4, 3, 'raster', (16, 32), False),
    ((9, 11), 4, 3, 'segment', (32, 16), False),
    ((12, 12), 3, 5, 'segment', (16, 16), True),
    ((13, 10), 3, 3, 'raster', (16, 16), False),
    ((7, 9), 2, 3, 'segment', (16, 16), True),
    ((15, 16), 7, 9, 'segment', (32, 32), True),
    ((15, 16), 7, 9, 'raster', (64, 16), True),
]


def _inputs(feat_size, w, S, bias, h=2, d=8):
    torch.manual_seed(0)
    B, (H, W) = 2, feat_size
    q = torch.randn(B, h, H, W, d, dtype=torch.float64)
    kv = torch.randn(2, B, h, H, W, d, dtype=torch.float64)
    shared = torch.randn(2, B, h, S, d, dtype=torch.float64)
    table = torch.randn(window_rel_pos_table_size(w), h, dtype=torch.float64) if bias else None
    return q, kv, shared, table


def _reference(q, kv, shared, table, w, scale):
    """`span_attention_reference` with the layer's window mask: padded keys masked, the official bias added."""
    h = q.shape[1]
    mask = span_window_key_mask(list(q.shape[2:4]), w, q.dtype, q.device)[None, None, :, None]
    if table is not None:
        _, span = window_span(w)
        bias = table[window_rel_pos_index(w, q.device).reshape(-1)].reshape(w * w, span * span, h).permute(2, 0, 1)
        mask = mask + bias[None, :, None]
    return span_attention_reference(q, kv, shared, mask, w, scale)


@pytest.mark.parametrize('feat_size,w,S,order,block,bias', CASES)
def test_flex_matches_dense_reference(feat_size, w, S, order, block, bias):
    q, kv, shared, table = _inputs(feat_size, w, S, bias)
    out = span_flex_attention(q.permute(0, 2, 3, 1, 4), kv.permute(1, 3, 4, 0, 2, 5), shared, w, 0.35, table, order,
                              block)
    torch.testing.assert_close(out, _reference(q, kv, shared, table, w, 0.35), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize('feat_size,w,S,order,block,bias', CASES[:4] + CASES[5:6])
def test_block_mask_from_counts_equals_create_block_mask(feat_size, w, S, order, block, bias):
    """The BlockMask built from per-block key counts has the block sets (partial and full, both directions) that
    `create_block_mask` finds by evaluating the mask on every (query, key) pair."""
    geo = span_flex_geometry(feat_size, w, S, order)
    ours = span_flex_block_mask(geo, block, torch.device('cpu'))
    theirs = create_block_mask(span_flex_mask_mod(geo), None, None, geo.num_queries, geo.num_keys, device='cpu',
                               BLOCK_SIZE=block)
    assert ours.shape == theirs.shape and ours.BLOCK_SIZE == theirs.BLOCK_SIZE
    for name in ('kv_num_blocks', 'full_kv_num_blocks', 'q_num_blocks', 'full_q_num_blocks'):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    assert torch.equal(ours.to_dense(), theirs.to_dense())
    assert span_flex_block_mask(geo, block, torch.device('cpu')) is ours  # cached per geometry and device


def test_a_wrong_span_is_caught():
    """The comparison can fail: a mask whose span is one key narrower on each side is off by far more than the
    tolerance (and so is one that forgets the map border)."""
    from torch.nn.attention.flex_attention import flex_attention

    from lsvision.layers.span_flex import _build_block_mask, _from_order, _to_order
    (H, W), w, S = (9, 11), 4, 3
    q, kv, shared, _ = _inputs((H, W), w, S, False)
    ref = _reference(q, kv, shared, None, w, 0.35)
    for order, wrong in (('raster', dict(pad=1)), ('segment', dict(height=H + 2))):
        right = span_flex_geometry((H, W), w, S, order)
        mask = _build_block_mask(right._replace(**wrong), (16, 16), q.device)
        keys, values = torch.cat([_to_order(kv.permute(1, 3, 4, 0, 2, 5), right), shared], 3).unbind(0)
        out = flex_attention(_to_order(q.permute(0, 2, 3, 1, 4), right), keys, values, block_mask=mask, scale=0.35)
        out = _from_order(out, right)
        assert (out - ref).abs().max() > 0.05


@pytest.mark.parametrize('name,order,block', [('cvt_ls_13', 'segment', 128), ('vil_ls_medium', 'raster', 16)])
def test_models_with_flex_kernel_match_default_path(name, order, block):
    """cvt_ls_13 (conv projections, a cls token in stage 3, w = 4 / 2) and ViL-LS (window bias, a cls token in every
    stage) on a non-square input: the flex path gives the default path's outputs, and switching back gives them bit
    for bit."""
    torch.manual_seed(0)
    config = dict(TINY_FAMILIES[name], depths=(1, 1, 1) if name == 'cvt_ls_13' else (1, 1, 1, 1))
    model = perturb(timm.create_model(name, num_classes=5, **config)).eval()
    x = torch.randn(2, 3, 72, 56)
    with torch.no_grad():
        expected = model(x)
        assert set_span_kernel(model, 'flex', order, block) > 0
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
        set_span_kernel(model, 'auto')
        assert torch.equal(model(x), expected)


def test_flex_layer_traces_whole_under_torch_compile():
    """With the flex kernel the layer compiles with fullgraph=True (the BlockMask built inside the graph): no graph
    break from lsvision's code."""
    torch.manual_seed(0)
    attn = perturb(LongShortAttention2d(16, 2, 3, 2, span_kernel='flex', **LAYERS['conv'])).eval()
    x = torch.randn(2, 1 + 10 * 7, 16)
    with torch.no_grad():
        expected = attn(x, (10, 7))
        compiled = torch.compile(attn, fullgraph=True, backend='eager')
        torch.testing.assert_close(compiled(x, (10, 7)), expected, rtol=1e-6, atol=1e-6)


def test_flex_errors_say_what_to_do():
    attn = LongShortAttention2d(16, 2, 2, 2, span_kernel='flex').train()
    x = torch.randn(1, 16, 16)
    with pytest.raises(RuntimeError, match="train on CUDA only.*set_span_kernel\\(model, 'auto'\\)"):
        attn(x, (4, 4))
    assert set_span_kernel(attn, 'auto') == 1  # following the hint, it trains
    attn(x, (4, 4)).sum().backward()
    with torch.no_grad():  # or the flex path without gradients
        set_span_kernel(attn, 'flex')
        attn(x, (4, 4))
    dropout = LongShortAttention2d(16, 2, 2, 2, attn_drop=0.1, span_kernel='flex').train()
    with pytest.raises(ValueError, match='no attention dropout'), torch.no_grad():
        dropout(x, (4, 4))
    with pytest.raises(ValueError, match="span_kernel must be one of \\('auto', 'span', 'flex'\\)"):
        LongShortAttention2d(16, 2, 2, 2, span_kernel='triton')
    with pytest.raises(ValueError, match='token order'):
        set_span_kernel(attn, 'flex', order='column')
    with warnings.catch_warnings(), pytest.raises(ValueError, match='power of two'):
        set_span_kernel(attn, 'flex', block_size=100)


def _dense_flex(q, k, v, score_mod, block_mask, scale):
    """FlexAttention's math, differentiable on the CPU: the mask_mod (and score_mod) evaluated on the whole grid."""
    B, h, L, _ = q.shape
    b, hh, qi, ki = (torch.arange(n).view([-1 if i == j else 1 for j in range(4)])
                     for i, n in enumerate((B, h, L, k.shape[2])))
    scores = q @ k.transpose(-1, -2) * scale
    if score_mod is not None:
        scores = score_mod(scores, b, hh, qi, ki)
    scores = scores.masked_fill(~block_mask.mask_mod(b, hh, qi, ki), float('-inf'))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize('qkv,feat_size,w,prefix,bias,order', [
    ('conv', (7, 9), 3, 1, False, 'segment'),  # CvT-LS: conv projections, a cls token, a map of partial segments
    ('linear', (6, 6), 3, 2, True, 'raster'),  # ViL-LS: linear projections, the window bias, two prefix tokens
    ('conv', (4, 6), 2, 0, False, 'segment'),  # no prefix, whole segments (no padding)
    ('conv', (6, 6), 3, 1, False, 'segment'),  # a cls token, whole segments
])
def test_flex_path_trains_as_the_span_path(monkeypatch, qkv, feat_size, w, prefix, bias, order):
    """The flex path's own code (one dtype, stacked keys and values, the dynamic projection of all heads in one
    product, LN_G, the prefix update as SDPA) gives the span path's outputs and gradients (input and every
    parameter), in training. FlexAttention has no CPU backward, so its call runs as its math on the whole grid."""
    from lsvision.layers import span_flex
    monkeypatch.setattr(span_flex, '_run_flex', _dense_flex)
    torch.manual_seed(0)
    H, W = feat_size
    attn = perturb(LongShortAttention2d(16, 2, w, 3, rel_pos_bias=bias, **LAYERS[qkv]).double()).train()
    x = torch.randn(2, prefix + H * W, 16, dtype=torch.float64)
    weight = torch.randn(2, prefix + H * W, 16, dtype=torch.float64)
    results = []
    for kernel in ('span', 'flex'):
        set_span_kernel(attn, kernel, order, 16)
        attn.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_()
        out = attn(xg, feat_size)
        (out * weight).sum().backward()
        results.append([out, xg.grad] + [p.grad for p in attn.parameters()])
    names = ['output', 'input grad'] + [n for n, _ in attn.named_parameters()]
    for name, flex, span in zip(names, results[1], results[0]):
        torch.testing.assert_close(flex, span, rtol=1e-9, atol=1e-9, msg=name)


@pytest.mark.parametrize('qkv,feat_size,w,prefix,bias,order', [
    ('conv', (8, 8), 4, 1, False, 'segment'),  # whole segments: the outputs re-laid straight into the layer's buffer
    ('conv', (7, 9), 3, 1, False, 'segment'),  # partial segments (padded), a cls token whose q, k, v are one tensor
    ('linear', (6, 6), 3, 2, True, 'raster'),  # separate prefix keys and values, the window bias
    ('linear', (5, 7), 2, 1, False, 'segment'),
    ('conv', (4, 6), 2, 0, False, 'raster'),  # no prefix
])
def test_flex_path_infers_as_the_span_path(qkv, feat_size, w, prefix, bias, order):
    """Without autograd the flex path writes the ordered keys and the outputs into buffers (no cat) and reuses the
    keys' buffer for the layer's output: the span path's outputs still, in every order and prefix layout."""
    torch.manual_seed(0)
    H, W = feat_size
    attn = perturb(LongShortAttention2d(16, 2, w, 3, rel_pos_bias=bias, **LAYERS[qkv]).double()).eval()
    x = torch.randn(2, prefix + H * W, 16, dtype=torch.float64)
    outputs = []
    for kernel in ('span', 'flex'):
        set_span_kernel(attn, kernel, order, 16)
        with torch.no_grad():
            outputs.append(attn(x, feat_size))
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-9, atol=1e-9)


def test_flex_out_is_for_inference_only():
    from lsvision.layers.span_flex import span_flex_attention
    q = torch.randn(1, 4, 4, 2, 8, requires_grad=True)
    kv, shared = torch.randn(1, 4, 4, 2, 2, 8), torch.randn(2, 1, 2, 3, 8)
    with pytest.raises(ValueError, match='for inference'):
        span_flex_attention(q, kv, shared, 2, 0.3, out=torch.empty(1, 4, 4, 2, 8))


@pytest.mark.parametrize('order', ['raster', 'segment'])
def test_ordered_keys_trace_whole_and_give_their_gradients(order):
    """The training path's ordered keys (`_KeysInOrder`: written once into the kernel's buffer, the gradient written
    once in the keys' layout) equal the cat of the ordered copy, gradients included, eagerly and traced whole by
    torch.compile (fullgraph, aot_eager: what a compiled training step runs through autograd)."""
    from lsvision.layers.span_flex import _keys_in_order, _to_order
    torch.manual_seed(0)
    geo = span_flex_geometry((4, 6), 2, 3, order)
    kv_base = torch.randn(2, 2, 4, 6, 2, 8, dtype=torch.float64, requires_grad=True)  # (2, B, H, W, h, d)
    shared = torch.randn(2, 2, 2, 3, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(2, 2, 2, 24 + 3, 8, dtype=torch.float64)

    def loss(fn):
        kv_base.grad = shared.grad = None
        out = fn(kv_base.permute(1, 2, 3, 0, 4, 5), shared, geo)
        (out * weight).sum().backward()
        return out.detach(), kv_base.grad, shared.grad

    expected = loss(lambda kv, s, g: torch.cat([_to_order(kv, g), s], dim=3))
    for fn in (_keys_in_order, torch.compile(_keys_in_order, backend='aot_eager', fullgraph=True)):
        for got, want in zip(loss(fn), expected):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
