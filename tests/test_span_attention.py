"""Training path of long-short attention: gradients against the dense references, the recomputing backward of the
shared span core, its saved tensors, and torch.compile."""
import pytest
import torch
from _helpers import TINY_CVT_TWO_STAGES, perturb, tiny_model
from reference_attention import (
    dense_causal_long_short_attention,
    dense_long_short_attention_1d,
    dense_long_short_attention_2d,
)

import lsvision  # noqa: F401  (registers the models)
from lsvision.layers import CausalLongShortAttention, LongShortAttention1d, LongShortAttention2d
from lsvision.layers import long_short as long_short_module
from lsvision.layers._private_sdpa import efficient_bias
from lsvision.layers.span_attention import _span_forward, block_segments, span_attention, window_span
from lsvision.layers.span_blocks import _fold_block_keys, _gather_block_keys
from lsvision.layers.span_segments import _fold_spans, _gather_spans
from lsvision.models.cvt import ConvDynamicProjection, SepConvQkv

LAYERS = {'linear': {}, 'conv': dict(qkv_layer=SepConvQkv, dp_layer=ConvDynamicProjection)}


def _grads(module: torch.nn.Module, x: torch.Tensor, fn, weight: torch.Tensor):
    """Input and parameter gradients of (fn(x) * weight).sum()."""
    module.zero_grad(set_to_none=True)
    xg = x.clone().requires_grad_()
    (fn(xg) * weight).sum().backward()
    return [xg.grad] + [p.grad for p in module.parameters()]


def _assert_grads_equal(fast, dense, names):
    for name, a, b in zip(names, fast, dense):
        assert a is not None and b is not None, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f'{name}: {m}')


# (H, W), w, r, heads, prefix tokens, qkv/dp layer, window RPE
GRAD_CASES = [
    ((8, 8), 4, 3, 2, 0, 'linear', True),  # square, divisible, no prefix
    ((9, 13), 4, 2, 2, 1, 'conv', False),  # non-square, not divisible by w
    ((5, 11), 3, 5, 2, 2, 'linear', True),  # odd window, two prefix tokens
    ((6, 10), 2, 2, 2, 1, 'conv', True),  # the CvT-LS stage-3 window (small segments)
    ((7, 5), 1, 1, 1, 1, 'linear', False),  # w = 1: span 3 crosses two neighbours
    ((3, 3), 8, 4, 1, 2, 'conv', False),  # map smaller than one window
    ((14, 14), 7, 8, 3, 1, 'linear', True),  # the ViL-LS setting (SDPA forward)
    ((20, 17), 5, 4, 2, 1, 'conv', False),  # segments of 25 queries: CPU flash kernels, forward and backward
    ((16, 16), 8, 6, 1, 0, 'linear', False),  # the CvT-LS stage-1 window (flash)
]


@pytest.mark.parametrize('feat_size,w,r,heads,g,layer,rpe', GRAD_CASES)
def test_2d_gradients_match_dense_reference_fp64(feat_size, w, r, heads, g, layer, rpe):
    torch.manual_seed(0)
    C = heads * 8
    attn = LongShortAttention2d(C, heads, w, r, rel_pos_bias=rpe, **LAYERS[layer])
    attn = perturb(attn, 0.3).double().train()
    x = torch.randn(2, g + feat_size[0] * feat_size[1], C, dtype=torch.float64)
    weight = torch.randn_like(x)
    fast = _grads(attn, x, lambda t: attn(t, feat_size), weight)
    dense = _grads(attn, x, lambda t: dense_long_short_attention_2d(attn, t, feat_size), weight)
    _assert_grads_equal(fast, dense, ['x'] + [n for n, _ in attn.named_parameters()])


@pytest.mark.parametrize('block_diagonal', [False, True])
def test_dynamic_projection_head_paths_match_dense_reference_fp64(monkeypatch, block_diagonal):
    """The dynamic projection's products in training, per head or block-diagonal over the heads
    (`_block_diagonal_heads`, by size): each gives the dense reference's gradients, in 2D (3 heads, a prefix token)
    and 1D (2 heads, padding, cls)."""
    monkeypatch.setattr(long_short_module, 'BLOCK_DIAGONAL_MAX_MACS', 2 ** 40 if block_diagonal else 0)
    assert long_short_module._block_diagonal_heads(torch.empty(1, 3, 2, 10), 24) == block_diagonal
    torch.manual_seed(0)
    attn = perturb(LongShortAttention2d(24, 3, 4, 2, **LAYERS['conv']), 0.3).double().train()
    x = torch.randn(2, 1 + 9 * 13, 24, dtype=torch.float64)
    weight = torch.randn_like(x)
    fast = _grads(attn, x, lambda t: attn(t, (9, 13)), weight)
    dense = _grads(attn, x, lambda t: dense_long_short_attention_2d(attn, t, (9, 13)), weight)
    _assert_grads_equal(fast, dense, ['x'] + [n for n, _ in attn.named_parameters()])
    attn = perturb(LongShortAttention1d(32, 2, 3, 2)).double().train()
    x = torch.randn(3, 37, 32, dtype=torch.float64)
    mask = torch.ones(3, 37, dtype=torch.bool)
    mask[0, 33:] = False
    cls = torch.randn(3, 1, 32, dtype=torch.float64)
    weight = torch.randn(3, 38, 32, dtype=torch.float64)
    fast = _grads(attn, x, lambda t: attn(t, mask, cls), weight)
    dense = _grads(attn, x, lambda t: dense_long_short_attention_1d(attn, t, mask, cls), weight)
    _assert_grads_equal(fast, dense, ['x'] + [n for n, _ in attn.named_parameters()])


@pytest.mark.parametrize('n,w,r,pads,with_cls', [(40, 8, 4, 5, False), (37, 3, 2, 4, True), (21, 1, 1, 3, True),
                                                 (30, 16, 2, 0, False), (50, 20, 3, 7, True)])
def test_1d_bidirectional_gradients_match_dense_reference_fp64(n, w, r, pads, with_cls):
    torch.manual_seed(0)
    attn = perturb(LongShortAttention1d(32, 2, w, r)).double().train()
    x = torch.randn(3, n, 32, dtype=torch.float64)
    mask = torch.ones(3, n, dtype=torch.bool)
    if pads:
        mask[0, n - pads:] = False
        mask[2, n - pads // 2:] = False
    cls = torch.randn(3, 1, 32, dtype=torch.float64) if with_cls else None
    weight = torch.randn(3, n + with_cls, 32, dtype=torch.float64)
    fast = _grads(attn, x, lambda t: attn(t, mask, cls), weight)
    dense = _grads(attn, x, lambda t: dense_long_short_attention_1d(attn, t, mask, cls), weight)
    _assert_grads_equal(fast, dense, ['x'] + [n for n, _ in attn.named_parameters()])


@pytest.mark.parametrize('chunk', [None, 16])
def test_causal_gradients_match_dense_reference_fp64(chunk):
    torch.manual_seed(0)
    attn = perturb(CausalLongShortAttention(32, 2, 8, 4, 2, query_chunk_size=chunk)).double().train()
    x = torch.randn(2, 32, 32, dtype=torch.float64)
    cache = torch.randn(2, 16, 32, dtype=torch.float64)
    weight = torch.randn_like(x)
    fast = _grads(attn, x, lambda t: attn(t, cache), weight)
    dense = _grads(attn, x, lambda t: dense_causal_long_short_attention(attn, t, cache), weight)
    _assert_grads_equal(fast, dense, ['x'] + [n for n, _ in attn.named_parameters()])


GRADCHECK_ATOL, GRADCHECK_RTOL = 1e-8, 1e-6


@pytest.mark.parametrize('spatial,w,dropout,span_pad,S', [
    ((7,), 3, 0., None, 2), ((9,), 2, 0.3, None, 2), ((3, 5), 2, 0., None, 2), ((4, 3), 1, 0.3, None, 2),
    # non-overlapping windows (HSW): K = w, a partial last window, no shared keys
    ((7,), 3, 0., 0, 2), ((7,), 3, 0.3, 0, 0), ((3, 5), 2, 0., 0, 1),
    # segments of more than 16 queries: CPU flash kernels
    ((20,), 17, 0., None, 2), ((6, 5), 5, 0., None, 2), ((9,), 17, 0., 0, 0),
    # 2D blocks of c segments on the flash kernels (`block_segments`): c = 2 (w = 3, 4 segments across), c = 7 with
    # a segment padding the last block (w = 2, 13 segments across, the map cropped), c = 7 (w = 1: one block a row)
    ((5, 11), 3, 0., None, 2), ((4, 25), 2, 0., None, 1), ((3, 7), 1, 0., None, 0),
    # x blocks inside the map and at both edges (w = 2: 6 blocks of 5 segments)
    ((3, 60), 2, 0., None, 1),
    # spans two segments wide (K = 2w), one segment a block: the backward by row halves, the map not divisible by w
    ((9, 10), 4, 0., None, 2),
])
def test_span_attention_gradcheck(spatial, w, dropout, span_pad, S):
    """The recomputing backward against finite differences, every input including the mask and, with dropout, the
    same dropout mask (the RNG is seeded before each call).

    Fast mode: gradcheck compares one random projection of each input's Jacobian (v^T J u) with its finite
    difference, a few forwards a check where the full Jacobian took two per scalar input (8 minutes for this test
    under load). So that a small gradient cannot hide behind a large one in the same projection, keys, values,
    shared keys and shared values are inputs of their own, and the tolerances sit well above fp64's finite-difference
    error here (at most 3e-10 at eps 1e-6) and far below the projections (1e-4 and more)."""
    torch.manual_seed(0)
    B, h, d = 2, 1, 2
    _, span = window_span(w, span_pad)
    grid = 1
    for n in spatial:
        grid *= -(-n // w)
    q = torch.randn(B, h, *spatial, d, dtype=torch.float64, requires_grad=True)
    k, v = (t.requires_grad_() for t in torch.randn(2, B, h, *spatial, d, dtype=torch.float64))
    k_shared, v_shared = (t.requires_grad_() for t in torch.randn(2, B, h, S, d, dtype=torch.float64))
    bias = torch.randn(1, h, 1, w ** len(spatial), span ** len(spatial), dtype=torch.float64, requires_grad=True)
    inputs = (q, k, v, k_shared, v_shared)

    def fn(q, k, v, k_shared, v_shared, bias):
        torch.manual_seed(1)
        return span_attention(q, torch.stack([k, v]), torch.stack([k_shared, v_shared]),
                              bias.expand(1, h, grid, -1, -1), w, 0.7, dropout, span_pad)

    tol = dict(eps=1e-6, atol=GRADCHECK_ATOL, rtol=GRADCHECK_RTOL, fast_mode=True)
    assert torch.autograd.gradcheck(fn, inputs + (bias,), **tol)
    # a mask without a gradient (where segments of more than 16 queries take CPU's flash kernels)
    constant = bias.detach().clone()
    if dropout == 0.:  # and its forward is the plain one's
        plain = _span_forward(q.detach(), torch.stack([k, v]).detach(), torch.stack([k_shared, v_shared]).detach(),
                              constant.expand(1, h, grid, -1, -1), w, 0.7, 0., span_pad)[0]
        torch.testing.assert_close(fn(*inputs, constant), plain, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda *args: fn(*args, constant), inputs, **tol)


def test_block_width_within_the_row_and_without_tiny_or_padded_blocks():
    """`block_segments` keeps a block within a row of segments (1 <= c <= gx), runs large windows (w >= 4) one segment a
    block, and takes CvT-LS's stage-3 windows at 224 px (w = 2, 7 segments across) as whole rows: no segment padding
    the last block and no block of fewer than 16 queries."""
    for w in range(1, 9):
        for gx in range(1, 40):
            c = block_segments(w, gx)
            assert 1 <= c <= gx, (w, gx, c)
            if w >= 4:
                assert c == 1, (w, gx, c)
    c = block_segments(2, 7)
    assert 7 % c == 0 and 2 * c * 2 >= 16, c


@pytest.mark.parametrize('H,W,w,span_pad,c', [
    (5, 11, 3, None, 2), (3, 27, 2, None, 4), (3, 26, 2, None, 7), (6, 40, 8, None, 1), (4, 9, 2, None, 4),
    (7, 7, 1, None, 7), (5, 17, 4, 0, 1),
])
def test_block_key_gather_equals_cutting_the_padded_map(H, W, w, span_pad, c):
    """The 2D flash path's column-strip gather reads k and v with any strides (here heads-first views of token maps,
    as LN_L gives them) and zero-fills only the padding: every block's keys are the K rows x Wc columns of the
    zero-padded map, as cut from it directly, for blocks inside the map, at its edges and padding it."""
    torch.manual_seed(0)
    B, h, d = 2, 3, 4
    pad, span = window_span(w, span_pad)
    k, v = (t.unflatten(-1, (h, d)).movedim(-2, 1) for t in torch.randn(2, B, H, W, h * d))  # (B, h, H, W, d) views
    got = _gather_block_keys(k, v, w, span_pad, c)
    gy, gx = -(-H // w), -(-W // w)
    nx = -(-gx // c)
    step, Wc = c * w, c * w + 2 * pad
    padded = torch.zeros(2, B, h, gy * w + 2 * pad, (nx - 1) * step + Wc, d)
    padded[:, :, :, pad:pad + H, pad:pad + W] = torch.stack([k, v])
    assert got.shape == (2, B * h * nx, gy, span * Wc, d)
    got = got.reshape(2, B, h, nx, gy, span * Wc, d)
    for j in range(nx):
        for y in range(gy):
            expected = padded[:, :, :, y * w:y * w + span, j * step:j * step + Wc].reshape(2, B, h, span * Wc, d)
            assert torch.equal(got[:, :, :, j, y], expected), (j, y)


@pytest.mark.parametrize('H,W,w,span_pad,c', [
    (5, 11, 3, None, 2), (3, 26, 2, None, 7), (6, 40, 8, None, 1), (7, 7, 1, None, 7), (5, 17, 4, 0, 1),
    (9, 13, 2, 3, 2),  # a span three segments high (s > w / 2): blocks overlap two neighbours each way
])
def test_block_key_fold_is_the_adjoint_of_the_gather(H, W, w, span_pad, c):
    """`_fold_block_keys` sums every block's key gradients back onto the map (one strided add per group of blocks that
    do not overlap): it equals autograd's gradient through the gather, for blocks inside the map, at its edges and
    padding it, and its output is laid out as tokens (B, H, W, h, d)."""
    torch.manual_seed(0)
    B, h, d = 2, 3, 4
    k = torch.randn(B, h, H, W, d, dtype=torch.float64, requires_grad=True)
    keys = _gather_block_keys(k, torch.zeros_like(k), w, span_pad, c)[0]
    grad = torch.randn(keys.shape, dtype=torch.float64)
    expected, = torch.autograd.grad(keys, k, grad)
    folded = _fold_block_keys(grad, B, h, [H, W], w, span_pad, c)
    assert folded.movedim(1, -2).stride()[-2:] == (d, 1)  # heads-first view of tokens
    torch.testing.assert_close(folded, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('H,W,w,span_pad', [(5, 11, 3, None), (8, 8, 4, None), (7, 5, 1, None), (5, 7, 2, 0)])
def test_span_fold_is_the_adjoint_of_the_span_gather(H, W, w, span_pad):
    """The batched-matmul path's `_fold_spans` (2D: one strided add per group of segments whose spans do not overlap,
    `_add_blocks`, as the fused path's block fold) equals autograd's gradient through the span gather, and lays the
    map out as tokens (B, H, W, h, d)."""
    torch.manual_seed(0)
    B, h, d = 2, 3, 4
    kv = torch.randn(2, B, h, H, W, d, dtype=torch.float64, requires_grad=True)
    spans = _gather_spans(kv, w, span_pad)
    grad = torch.randn(spans.shape, dtype=torch.float64)
    expected, = torch.autograd.grad(spans, kv, grad)
    folded = _fold_spans(grad[0], [H, W], w, span_pad)
    assert folded.movedim(1, -2).stride()[-2:] == (d, 1)  # heads-first view of tokens
    torch.testing.assert_close(folded, expected[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('shape,stored', [
    ((6, 3, 16, 45), (6, 3, 16, 45)),  # rows of 45: padded to 48 in a copy
    ((6, 3, 16, 45), (6, 3, 1, 45)),  # one row per block, broadcast over the queries
    ((6, 3, 16, 45), (1, 3, 16, 45)),  # broadcast over the batch
    ((6, 3, 16, 64), (6, 3, 16, 64)),  # aligned already: the mask itself
])
def test_efficient_bias_is_the_mask_with_aligned_strides(shape, stored):
    """CUDA's memory-efficient kernel reads its bias with every stride a multiple of 16 elements and a contiguous
    last axis (`efficient_bias`, on any device): the values are the broadcast mask's, broadcast axes stay stride 0
    (no copy per batch or query), and an aligned mask is passed as it is."""
    mask = torch.randn(stored)
    bias = efficient_bias(mask, shape)
    assert bias.shape == shape and torch.equal(bias, mask.expand(shape))
    assert bias.stride(-1) == 1 and all(st % 16 == 0 for st in bias.stride()[:-1]), bias.stride()
    assert [st == 0 for st in bias.stride()] == [n == 1 and m > 1 for n, m in zip(stored, shape)]
    if shape[-1] % 16 == 0 and stored == shape:
        assert bias.data_ptr() == mask.data_ptr()
    assert efficient_bias(None, shape) is None


def test_dropout_drops_the_same_weights_in_forward_and_backward():
    """With dropout, the training output equals the plain forward drawn with the same seed, and some weights drop."""
    torch.manual_seed(0)
    q = torch.randn(1, 2, 6, 6, 4, requires_grad=True)
    kv = torch.randn(2, 1, 2, 6, 6, 4, requires_grad=True)
    shared = torch.randn(2, 1, 2, 3, 4)
    torch.manual_seed(5)
    out = span_attention(q, kv, shared, None, 3, 0.5, 0.5)
    torch.manual_seed(5)
    plain, keep = _span_forward(q.detach(), kv.detach(), shared, None, 3, 0.5, 0.5)
    torch.testing.assert_close(out, plain, rtol=0, atol=0)
    assert keep is not None and 0.3 < keep.float().mean() < 0.7
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(kv.grad).all()


def _saved_storages(fn):
    """Bytes of every distinct storage autograd saves while `fn` runs, largest first."""
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sorted(seen.values(), reverse=True)


def test_backward_keeps_no_gathered_spans():
    """The layer's saved tensors in training: nothing of the size of the gathered spans (about 4 copies of every key
    and value); the window attention keeps only its inputs, where autograd through the gather keeps the spans."""
    torch.manual_seed(0)
    B, C, h, w, r, H, W, g = 2, 32, 2, 4, 4, 16, 16, 1
    attn = LongShortAttention2d(C, h, w, r, **LAYERS['conv']).train()
    x = torch.randn(B, g + H * W, C, requires_grad=True)
    _, saved = _saved_storages(lambda: attn(x, (H, W)))
    pad, span = window_span(w)
    gathered = 2 * B * h * (H // w) * (W // w) * (r + g + span * span) * (C // h) * 4  # bytes, fp32
    assert saved[0] < gathered / 2, (saved[:4], gathered)
    # what autograd keeps for the window attention when it differentiates the gather itself
    q = torch.randn(B, h, H, W, C // h, requires_grad=True)
    kv = torch.randn(2, B, h, H, W, C // h, requires_grad=True)
    shared = torch.randn(2, B, h, r + g, C // h, requires_grad=True)
    _, via_gather = _saved_storages(lambda: _span_forward(q, kv, shared, None, w, 0.5, 0.)[0])
    assert sum(via_gather) > gathered
    # on CPU's flash kernels (2D: blocks of segments, `block_segments`) the window attention keeps its inputs (q and
    # kv are views of what the layer keeps anyway), the output, which the output projection keeps anyway, and one
    # log-sum-exp per query
    for ws in (w, 8):
        _, core = _saved_storages(lambda ws=ws: span_attention(q, kv, shared, None, ws, 0.5, 0.))
        assert sum(core) == (2 * q.numel() + kv.numel() + shared.numel() + q.numel() // q.shape[-1]) * 4
    # the batched-matmul path (1D segments of at most 16 queries) keeps only its inputs
    q1, kv1 = q.flatten(2, 3), kv.flatten(3, 4)
    _, core = _saved_storages(lambda: span_attention(q1, kv1, shared, None, w, 0.5, 0.))
    assert sum(core) == q.numel() * 4 + kv.numel() * 4 + shared.numel() * 4


def test_flash_backward_key_gradients_at_most_twice_the_map():
    """For spans two segments wide (K = 2w, CvT-LS's stages 1 and 2) the fused backward runs by row halves of the
    spans: the kernels' key and value gradients are at most twice the map each, where on whole spans they hold every
    key 4 times (K^2 / w^2), a transient that sat at the top of a training step's memory."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class KernelGradients(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sizes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
                self.sizes.append((out[1].numel(), out[2].numel()))
            return out

    torch.manual_seed(0)
    B, h, H, W, d, w = 2, 2, 16, 24, 8, 8
    q = torch.randn(B, h, H, W, d, requires_grad=True)
    kv = torch.randn(2, B, h, H, W, d, requires_grad=True)
    shared = torch.randn(2, B, h, 3, d, requires_grad=True)
    out = span_attention(q, kv, shared, None, w, 0.5, 0.)
    mode = KernelGradients()
    with mode:
        out.backward(torch.randn_like(out))
    assert mode.sizes and max(max(s) for s in mode.sizes) <= 2 * B * h * H * W * d, mode.sizes


@pytest.mark.parametrize('amp', [False, True])
def test_torch_compile_fullgraph_forward_and_backward_equal_eager(amp):
    """torch.compile(fullgraph=True) of a tiny cvt_ls model, forward and backward, equals eager; also under bf16
    autocast (a memory-format query in a custom backward once broke the graph there and left autocast's state
    changed)."""
    # two stages of one block (a long-short layer without and one with the cls token): compile time grows with the
    # number of layers traced
    model = tiny_model('cvt_ls_13', img_size=64, num_classes=5, **TINY_CVT_TWO_STAGES, window_sizes=(4, 2),
                       dp_ranks=(4, 2)).train()
    x = torch.randn(2, 3, 64, 72)
    compiled = torch.compile(model, fullgraph=True, backend='aot_eager')

    def loss_of(fn):
        with torch.autocast('cpu', dtype=torch.bfloat16, enabled=amp):
            out = fn(x)
        out.float().square().sum().backward()
        return out

    eager_out = loss_of(model)
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    out = loss_of(compiled)
    tol = dict(rtol=2e-2, atol=2e-2) if amp else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, eager_out, **tol)
    tol = dict(rtol=5e-2, atol=5e-2) if amp else dict(rtol=1e-4, atol=1e-5)
    for (name, p), ref in zip(model.named_parameters(), eager_grads):
        torch.testing.assert_close(p.grad, ref, **tol, msg=lambda m, name=name: f'{name}: {m}')


@pytest.mark.parametrize('span_pad', [None, 0])
def test_gradient_of_a_full_shape_mask(span_pad):
    """A mask with no broadcast dim (per sample, head and segment, as HSW's padded and shifted windows) gets the
    gradient of autograd through the plain forward (it was once a view of the score gradient, scaled in place)."""
    torch.manual_seed(0)
    B, h, n, w, d, S = 2, 2, 8, 4, 3, 1
    _, span = window_span(w, span_pad)
    q = torch.randn(B, h, n, d, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(2, B, h, n, d, dtype=torch.float64, requires_grad=True)
    shared = torch.randn(2, B, h, S, d, dtype=torch.float64, requires_grad=True)
    mask = torch.randn(B, h, n // w, w, span, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(B, n, h, d, dtype=torch.float64)
    inputs = (q, kv, shared, mask)
    fast = torch.autograd.grad((span_attention(q, kv, shared, mask, w, 0.6, 0., span_pad) * weight).sum(), inputs)
    plain = torch.autograd.grad((_span_forward(q, kv, shared, mask, w, 0.6, 0., span_pad)[0] * weight).sum(), inputs)
    for a, b in zip(fast, plain):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize('batch,g', [(2, 0), (1, 1)])
def test_layer_keeps_keys_and_values_once(batch, g):
    """The whole 2D layer's saved tensors in training (CvT-LS convs): of map size or larger, only the input map, the
    q, k, v projections (three tensors, nothing stacked) and the attention output. LN_L's normalized keys and values
    are not kept (the projection and the windows renormalize in backward), nor a conv output, nor a copy of P or of
    the patch outputs for the prefix update."""
    torch.manual_seed(0)
    C, h, w, r, H, W = 32, 2, 4, 4, 8, 12
    attn = LongShortAttention2d(C, h, w, r, **LAYERS['conv']).train()
    x = torch.randn(batch, g + H * W, C, requires_grad=True)
    _, saved = _saved_storages(lambda: attn(x, (H, W)))
    token_map = batch * H * W * C * 4  # bytes of one fp32 map
    assert h * r < C // 2  # P is smaller than half a map
    large = [n / token_map for n in saved if n >= token_map // 2]
    # input tokens (with the prefix), then q, k, v and the output
    assert large == pytest.approx([1 + g / (H * W), 1, 1, 1, 1], rel=0.002), large


def assert_layer_trains_under_bf16_autocast(device: torch.device) -> None:
    """Gradients of the 2D layer's training path under bfloat16 autocast on `device` (every custom backward runs
    outside it, in one dtype) are close to float32's, and parameter gradients stay float32."""
    torch.manual_seed(0)
    attn = perturb(LongShortAttention2d(32, 2, 2, 3, **LAYERS['conv'])).to(device).train()
    x = torch.randn(2, 1 + 6 * 10, 32, device=device)
    weight = torch.randn_like(x)
    ref = _grads(attn, x, lambda t: attn(t, (6, 10)), weight)

    def under_autocast(t):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return attn(t, (6, 10)).float()

    grads = _grads(attn, x, under_autocast, weight)
    scale = max(g.norm() for g in ref)
    compared = 0
    for name, a, b in zip(['x'] + [n for n, _ in attn.named_parameters()], grads, ref):
        assert a.dtype == torch.float32, name
        if b.norm() < 1e-4 * scale:
            continue  # zero in exact math (a bias before BatchNorm, or shifting the softmax over tokens): noise
        assert (a - b).norm() <= 0.05 * b.norm() + 1e-6, (name, (a - b).norm().item(), b.norm().item())
        compared += 1
    assert compared >= len(ref) - 6  # all but the q, k, v and projection conv biases


def test_layer_trains_under_bf16_autocast():
    assert_layer_trains_under_bf16_autocast(torch.device('cpu'))


def test_1d_layer_keeps_keys_and_values_once():
    """The 1D bidirectional layer in training keeps no normalized copy of its keys and values (nor a heads-first copy
    for the projection): k and v are kept once, as views of the q, k, v projection."""
    torch.manual_seed(0)
    B, n, C = 2, 40, 32
    attn = LongShortAttention1d(C, 2, 4, 3).train()
    x = torch.randn(B, n, C, requires_grad=True)
    _, saved = _saved_storages(lambda: attn(x))
    token_map = B * n * C * 4  # bytes of one fp32 map
    large = [n / token_map for n in saved if n >= token_map // 2]
    assert large[0] == 3  # the q, k, v projection
    assert sum(large) < 7.5, large  # 13.2 maps when LN_L's output and a heads-first copy of it were kept as well
