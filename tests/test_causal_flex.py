"""Causal 1D long-short attention as one FlexAttention call (`lsvision.layers.causal_flex`): against the chunk path on
the CPU (inference), its BlockMask against `create_block_mask`'s, and the kernel 'auto' takes on the fake CUDA device
(and what that saves, counted)."""
import copy

import pytest
import torch
from fake_cuda import FAKE_CUDA, KernelCounter, assert_grads_like_params, cuda_autocast, fake_cuda, run_backward
from reference_attention import dense_causal_long_short_attention
from torch.nn.attention.flex_attention import create_block_mask

from lsvision.fake_cuda import gpu_attention_kernels
from lsvision.layers import CausalLongShortAttention
from lsvision.layers.causal_flex import CausalFlexGeometry, causal_flex_block_mask, causal_flex_mask_mod
from lsvision.measure_cuda import count_step

pytestmark = pytest.mark.filterwarnings('ignore:flex_attention called without torch.compile')

# (L, M, cache_valid_len, W, l, r, query_chunk_size, compress_hidden_cache)
CASES = [
    (64, 0, None, 16, 4, 1, 32, True),  # no cache: the left pad masked, whole blocks
    (50, 32, None, 16, 8, 2, 16, True),  # a cache, x padded to whole blocks, two vectors a segment
    (70, 24, 10, 16, 4, 1, None, False),  # a partly filled cache (masked), segments projected then averaged
    (40, 48, None, 8, 4, 2, 8, True),
    (1, 32, None, 8, 4, 1, 8, True),  # one token (generation), its own segment not yet complete
]


def _layer(W: int, ls: int, r: int, chunk, compress: bool) -> CausalLongShortAttention:
    torch.manual_seed(0)
    layer = CausalLongShortAttention(32, 4, window_size=W, segment_size=ls, dp_rank=r, query_chunk_size=chunk,
                                     compress_hidden_cache=compress).double().eval()
    with torch.no_grad():  # biases u and v, LN_L and LN_G away from their initial values
        for p in (layer.content_bias, layer.pos_bias, layer.norm_local.weight, layer.norm_local.bias,
                  layer.norm_global.weight, layer.norm_global.bias):
            p.add_(torch.randn_like(p) * 0.5)
    return layer


@pytest.mark.parametrize('L,M,valid,W,ls,r,chunk,compress', CASES)
def test_flex_path_infers_as_the_chunk_path(L, M, valid, W, ls, r, chunk, compress):
    layer = _layer(W, ls, r, chunk, compress)
    x = torch.randn(2, L, 32, dtype=torch.float64)
    cache = torch.randn(2, M, 32, dtype=torch.float64) if M else None
    outs = {}
    with torch.no_grad():
        for kernel in ('chunks', 'flex'):
            layer.attn_kernel = kernel
            outs[kernel] = layer(x, cache, valid)
    torch.testing.assert_close(outs['flex'], outs['chunks'], rtol=1e-10, atol=1e-10)


def test_flex_path_equals_the_dense_reference():
    """The official layout (a full cache of whole segments, at least W tokens): one softmax over every vector and
    token, masked (tests/reference_attention.py)."""
    layer = _layer(16, 4, 2, 32, True)
    layer.attn_kernel = 'flex'
    x = torch.randn(2, 64, 32, dtype=torch.float64)
    cache = torch.randn(2, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x, cache), dense_causal_long_short_attention(layer, x, cache),
                                   rtol=1e-10, atol=1e-10)


def test_a_wrong_window_is_caught():
    """The comparison can fail: a window one token shorter (the oldest key hidden) is off by far more than the
    tolerance."""
    from lsvision.layers import causal_flex, span_flex
    layer = _layer(16, 4, 1, 32, True)
    x = torch.randn(2, 64, 32, dtype=torch.float64)
    with torch.no_grad():
        layer.attn_kernel = 'chunks'
        ref = layer(x)
        layer.attn_kernel = 'flex'
        mask_mod = causal_flex.causal_flex_mask_mod
        try:
            causal_flex.causal_flex_mask_mod = lambda geo, device=None: _narrower(mask_mod(geo, device), geo)
            span_flex._BLOCK_MASKS.clear()
            out = layer(x)
        finally:
            causal_flex.causal_flex_mask_mod = mask_mod
            span_flex._BLOCK_MASKS.clear()
    assert (out - ref).abs().max() > 1e-3


def _narrower(mask_mod, geo: CausalFlexGeometry):
    def narrower(b, h, q_idx, kv_idx):
        oldest = geo.offset + q_idx - (geo.offset - geo.window + kv_idx - geo.num_vectors) == geo.window - 1
        return mask_mod(b, h, q_idx, kv_idx) & ~((kv_idx >= geo.num_vectors) & oldest)
    return narrower


@pytest.mark.parametrize('geo,block', [
    (CausalFlexGeometry(64, 32, 16, 32, 4, 1, 16, 96), 16),
    (CausalFlexGeometry(48, 40, 16, 32, 8, 2, 20, 75), 16),  # a partly real cache, a padded x, tail blocks
    (CausalFlexGeometry(256, 128, 64, 256, 8, 2, 0, 500), 32),
])
def test_block_mask_equals_create_block_mask(geo, block):
    ours = causal_flex_block_mask(geo, (block, block), torch.device('cpu'))
    theirs = create_block_mask(causal_flex_mask_mod(geo), None, None, geo.num_queries, geo.num_keys, device='cpu',
                               BLOCK_SIZE=block)
    for name in ('kv_num_blocks', 'full_kv_num_blocks', 'q_num_blocks', 'full_q_num_blocks'):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    assert torch.equal(ours.to_dense(), theirs.to_dense())
    assert causal_flex_block_mask(geo, (block, block), torch.device('cpu')) is ours  # cached per layout


@pytest.mark.parametrize('L,M,valid,W,ls,r,chunk,compress', [CASES[1], CASES[2]])
def test_flex_path_trains_as_the_chunk_path(monkeypatch, L, M, valid, W, ls, r, chunk, compress):
    """The flex path's gradients (input, cache and every parameter, through the position terms its score_mod reads)
    are the chunk path's. FlexAttention has no CPU backward, so its call runs as its math on the whole grid."""
    from test_span_flex import _dense_flex

    from lsvision.layers import span_flex
    monkeypatch.setattr(span_flex, '_run_flex', _dense_flex)
    layer = _layer(W, ls, r, chunk, compress).train()
    x = torch.randn(2, L, 32, dtype=torch.float64)
    cache = torch.randn(2, M, 32, dtype=torch.float64)
    weight = torch.randn(2, L, 32, dtype=torch.float64)
    results = []
    for kernel in ('chunks', 'flex'):
        layer.attn_kernel = kernel
        layer.zero_grad(set_to_none=True)
        xg, cg = x.clone().requires_grad_(), cache.clone().requires_grad_()
        out = layer(xg, cg, valid)
        (out * weight).sum().backward()
        results.append([out, xg.grad, cg.grad] + [p.grad for p in layer.parameters()])
    names = ['output', 'x grad', 'cache grad'] + [n for n, _ in layer.named_parameters()]
    for name, flex, chunks in zip(names, results[1], results[0]):
        torch.testing.assert_close(flex, chunks, rtol=1e-9, atol=1e-9, msg=name)


def test_a_filling_cache_changes_no_number_the_mask_closes_over(monkeypatch):
    """Generation fills the cache token by token: the real positions move at every step. Compiled FlexAttention
    guards on the numbers a mask_mod closes over, so they must not move (the positions are tensors); the BlockMasks
    of the steps are kept up to `BLOCK_MASK_CACHE_SIZE`, the most recently used."""
    from lsvision.layers import span_flex
    geo = CausalFlexGeometry(64, 32, 16, 32, 4, 1, 16, 96)
    steps = [geo._replace(real_from=geo.real_from - i) for i in range(5)]

    def numbers(fn):
        return [c.cell_contents for c in fn.__closure__ if isinstance(c.cell_contents, (int, float))]

    assert len({tuple(numbers(causal_flex_mask_mod(g))) for g in steps}) == 1
    monkeypatch.setattr(span_flex, 'BLOCK_MASK_CACHE_SIZE', 3)
    span_flex._BLOCK_MASKS.clear()
    masks = [causal_flex_block_mask(g, (16, 16), torch.device('cpu')) for g in steps]
    assert len(span_flex._BLOCK_MASKS) == 3
    assert causal_flex_block_mask(steps[-1], (16, 16), torch.device('cpu')) is masks[-1]
    assert causal_flex_block_mask(steps[0], (16, 16), torch.device('cpu')) is not masks[0]  # evicted, built again
    span_flex._BLOCK_MASKS.clear()


def test_flex_trains_on_cuda_only_and_auto_keeps_the_chunks_on_the_cpu():
    layer = _layer(8, 4, 1, 8, True).train()
    x = torch.randn(2, 16, 32, dtype=torch.float64, requires_grad=True)
    layer(x).sum().backward()  # 'auto' on the CPU: the chunk path, which trains
    layer.attn_kernel = 'flex'
    with pytest.raises(RuntimeError, match="train on CUDA only.*attn_kernel='auto' for CausalLongShortAttention"):
        layer(x)
    with pytest.raises(ValueError, match="attn_kernel must be one of \\('auto', 'chunks', 'flex'\\), got 'fused'"):
        CausalLongShortAttention(32, 4, attn_kernel='fused')


def test_fake_cuda_inference_is_one_flex_call_and_launches_fewer_kernels():
    """On CUDA at inference 'auto' runs one FlexAttention call a layer (no chunk loop: no window gather), under bf16
    autocast in bf16; counted, it launches a fraction of the chunk path's kernels at 1k tokens."""
    torch.manual_seed(0)
    layer = CausalLongShortAttention(64, 4, window_size=64, segment_size=16, query_chunk_size=128)
    fake = copy.deepcopy(layer)
    with fake_cuda(), torch.compiler.set_stance('force_eager'), torch.no_grad():
        fake = fake.to(FAKE_CUDA).eval()
        with KernelCounter() as ops, cuda_autocast(torch.bfloat16):
            out = fake(torch.randn(2, 1024, 64, device=FAKE_CUDA), torch.randn(2, 256, 64, device=FAKE_CUDA))
    assert out.shape == (2, 1024, 64) and out.dtype == torch.bfloat16
    assert ops.calls['flex_attention'] == 1 and ops.dtypes['flex_attention'] == {torch.bfloat16}
    assert ops.count('gather.default') == 0, ops.attention_ops()
    kernels = {}
    for kernel in ('auto', 'chunks'):
        layer.attn_kernel = kernel
        cost = count_step(layer, lambda: [torch.randn(2, 1024, 64), torch.randn(2, 256, 64)], train=False)
        kernels[kernel] = cost.total()['kernels']
        if kernel == 'auto':
            flex = cost.by('op')['flex_attention']
    assert kernels['auto'] * 5 < kernels['chunks'], kernels
    # the call reads q, k, v and its score_mod's position terms; writes the output and two per-query statistics
    B, h, Lp, d, W, vectors = 2, 4, 1024, 16, 64, (256 + 1024) // 16
    bf16 = 2
    read = B * h * d * (Lp + 2 * (vectors + W + Lp)) * bf16 + B * h * (Lp * (vectors + W) + W + Lp) * bf16
    assert flex['bytes'] == read + B * h * Lp * (d * bf16 + 2 * 4), flex


def test_fake_cuda_training_is_one_flex_call_with_the_position_gradients():
    """In training 'flex' runs one FlexAttention call and its backward (which gives the position terms' gradients:
    every parameter gets one), a fraction of the chunk path's kernels; 'auto' trains on the chunk path."""
    torch.manual_seed(0)
    layer = CausalLongShortAttention(64, 4, window_size=64, segment_size=16, query_chunk_size=128, attn_kernel='flex')
    fake = copy.deepcopy(layer)
    with fake_cuda(), torch.compiler.set_stance('force_eager'), gpu_attention_kernels():
        fake = fake.to(FAKE_CUDA).train()
        with KernelCounter() as ops:
            with cuda_autocast(torch.bfloat16):
                out = fake(torch.randn(2, 1024, 64, device=FAKE_CUDA), torch.randn(2, 256, 64, device=FAKE_CUDA))
            run_backward(out.float().square().mean())
        assert_grads_like_params(fake)
    assert ops.calls['flex_attention'] == 1 and ops.calls['flex_attention_backward.default'] == 1, ops.calls
    assert ops.count('gather') == 0, ops.attention_ops()

    def kernels(kernel: str) -> dict:
        layer.attn_kernel = kernel
        cost = count_step(layer, lambda: [torch.randn(2, 1024, 64), torch.randn(2, 256, 64)], train=True,
                          optimizer=False)
        return cost.by('op')

    flex, chunks = kernels('flex'), kernels('chunks')
    assert sum(v['kernels'] for v in flex.values()) * 5 < sum(v['kernels'] for v in chunks.values())
    assert kernels('auto') == chunks
