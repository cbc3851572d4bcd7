"""Tests written to kill mutants of the span attention core (`lsvision/layers/span_attention.py` and its modules
`span_segments`, `span_blocks`, `span_fused`: forward, the batched-matmul and flash backwards, the shared-key join)
that survived the dense-reference tests of `tests/test_span_attention.py` (docs/testing.md, "Mutation testing").

`span_attention` itself against the library's dense reference, `span_attention_reference` (masked full attention
over the zero-padded map): forward outputs and, by autograd through the reference, the gradients of q, kv, the shared
keys and the mask, in fp64. The reference itself is checked against `dense_span_attention`, a per-query restatement
written here: each query attends to the shared keys and to the K^ndim keys of its segment's span (the segment's
origin minus s, zero vectors outside the map), with the mask entry of its (segment, offset in the segment, key
offset), one softmax. Cheap (tiny maps): the gradcheck tests of test_span_attention.py cover the same paths against
finite differences, too slowly to run for every mutant.
"""
import itertools
from typing import List, Optional, Sequence

import pytest
import torch

from lsvision.layers.span_attention import span_attention, span_attention_reference


def _row_major(index: Sequence[int], sizes: Sequence[int]) -> int:
    flat = 0
    for i, n in zip(index, sizes):
        flat = flat * n + i
    return flat


def _prod(sizes: Sequence[int]) -> int:
    out = 1
    for n in sizes:
        out *= n
    return out


def dense_span_attention(q: torch.Tensor, kv: torch.Tensor, shared: torch.Tensor, mask: Optional[torch.Tensor],
                         w: int, scale: float, span_pad: Optional[int], keep: Optional[torch.Tensor] = None,
                         dropout_p: float = 0.) -> torch.Tensor:
    """q (B, h, *spatial, d), kv (2, B, h, *spatial, d), shared (2, B, h, S, d), mask broadcastable to (B, h,
    segments, w^ndim, K^ndim) -> (B, *spatial, h, d). `keep`: (B, h, segments, w^ndim, S + K^ndim) dropout keep-mask
    of the joint weights (kept weights scaled by 1 / (1 - dropout_p))."""
    B, h, d = q.shape[0], q.shape[1], q.shape[-1]
    spatial: List[int] = list(q.shape[2:-1])
    nd = len(spatial)
    s = max(w // 2, 1) if span_pad is None else span_pad
    K = w + 2 * s
    grid = [-(-n // w) for n in spatial]
    N = _prod(spatial)
    S = shared.shape[3]
    key_index, segment, offset = [], [], []
    for pos in itertools.product(*(range(n) for n in spatial)):
        origin = [p // w * w - s for p in pos]
        keys = []
        for key_offset in itertools.product(range(K), repeat=nd):
            at = [o + k for o, k in zip(origin, key_offset)]
            inside = all(0 <= a < n for a, n in zip(at, spatial))
            keys.append(_row_major(at, spatial) if inside else N)  # N: the zero row appended below
        key_index.append(keys)
        segment.append(_row_major([p // w for p in pos], grid))
        offset.append(_row_major([p % w for p in pos], [w] * nd))
    key_index, segment, offset = torch.tensor(key_index), torch.tensor(segment), torch.tensor(offset)
    zero = q.new_zeros(B, h, 1, d)
    k = torch.cat([kv[0].reshape(B, h, N, d), zero], dim=2)[:, :, key_index]  # (B, h, N, K^nd, d)
    v = torch.cat([kv[1].reshape(B, h, N, d), zero], dim=2)[:, :, key_index]
    qf = q.reshape(B, h, N, d)
    scores = torch.cat([qf @ shared[0].transpose(-1, -2), torch.einsum('bhnd,bhnkd->bhnk', qf, k)], dim=-1) * scale
    if mask is not None:
        m = mask.expand(B, h, _prod(grid), w ** nd, K ** nd)
        scores = scores + torch.cat([scores.new_zeros(B, h, N, S), m[:, :, segment, offset]], dim=-1)
    attn = scores.softmax(-1)
    if keep is not None:
        attn = attn * keep[:, :, segment, offset] / (1. - dropout_p)
    out = attn[..., :S] @ shared[1] + torch.einsum('bhnk,bhnkd->bhnd', attn[..., S:], v)
    return out.transpose(1, 2).reshape(B, *spatial, h, d)


# (spatial, w, span_pad, S): 1D and 2D, overlapping (s = max(w // 2, 1)) and non-overlapping (s = 0) spans, maps that w
# does not divide, segments of more than 16 queries (SDPA / flash kernels), 2D blocks of several segments (w = 3: c = 2;
# w = 2, 13 segments across: c = 7), spans two segments wide (w = 4: the row-halves backward), no shared keys
CASES = [
    ((7,), 3, None, 2), ((9,), 2, None, 1), ((7,), 3, 0, 0), ((20,), 17, None, 2), ((9,), 17, 0, 0),
    ((3, 5), 2, None, 2), ((4, 3), 1, None, 2), ((3, 5), 2, 0, 1), ((6, 5), 5, None, 2),
    ((5, 11), 3, None, 2), ((4, 25), 2, None, 1), ((3, 7), 1, None, 0), ((9, 10), 4, None, 2),
    # one segment a block with non-overlapping spans (K = w): not the row-halves backward
    ((9, 10), 4, 0, 1),
]


def _inputs(spatial, w, span_pad, S, seed=0):
    torch.manual_seed(seed)
    B, h, d = 2, 2, 3
    s = max(w // 2, 1) if span_pad is None else span_pad
    K = w + 2 * s
    grid = _prod([-(-n // w) for n in spatial])
    q = torch.randn(B, h, *spatial, d, dtype=torch.float64)
    kv = torch.randn(2, B, h, *spatial, d, dtype=torch.float64)
    shared = torch.randn(2, B, h, S, d, dtype=torch.float64)
    # per head, segment, query offset and key offset (the batch broadcast)
    mask = torch.randn(1, h, grid, w ** len(spatial), K ** len(spatial), dtype=torch.float64)
    return q, kv, shared, mask


def _grads(out, inputs, weight):
    return torch.autograd.grad((out * weight).sum(), inputs)


@pytest.mark.parametrize('spatial,w,span_pad,S', CASES)
@pytest.mark.parametrize('mask_kind', ['grad', 'constant', 'float32', 'none'])
def test_span_attention_matches_dense_reference_fp64(spatial, w, span_pad, S, mask_kind):
    """Output without autograd, output and gradients with it: with a mask that needs a gradient (the batched-matmul
    backward), a constant one (2D and long 1D segments: the flash kernels and the shared-key join), a constant one
    in float32 (cast to the queries' dtype) and none."""
    q, kv, shared, mask = _inputs(spatial, w, span_pad, S)
    mask = {'grad': mask, 'constant': mask, 'float32': mask.float(), 'none': None}[mask_kind]
    want = span_attention_reference(q, kv, shared, mask, w, 0.7, span_pad)
    with torch.no_grad():
        torch.testing.assert_close(span_attention(q, kv, shared, mask, w, 0.7, 0., span_pad), want, rtol=0,
                                   atol=1e-12)
    inputs = [t.clone().requires_grad_() for t in (q, kv, shared)]
    if mask_kind == 'grad':
        mask = mask.clone().requires_grad_()
        inputs.append(mask)
    out = span_attention(*inputs[:3], mask, w, 0.7, 0., span_pad)
    ref = span_attention_reference(*inputs[:3], mask, w, 0.7, span_pad)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    weight = torch.randn_like(out)
    for name, a, b in zip(['q', 'kv', 'shared', 'mask'], _grads(out, inputs, weight), _grads(ref, inputs, weight)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11, msg=lambda msg, name=name: f'{name}: {msg}')


# the last: segments of 17 queries, where the forward without dropout would take SDPA
@pytest.mark.parametrize('spatial,w,span_pad,S', [((9,), 2, None, 2), ((7,), 3, 0, 0), ((4, 3), 1, None, 2),
                                                  ((20,), 17, None, 2)])
def test_span_attention_dropout_matches_dense_reference_fp64(spatial, w, span_pad, S):
    """With dropout: the joint weights times the keep-mask drawn from the seeded RNG over the (B, h, segments,
    w^ndim, S + K^ndim) weights, scaled by 1 / (1 - p); output and gradients."""
    q, kv, shared, mask = _inputs(spatial, w, span_pad, S)
    inputs = [t.clone().requires_grad_() for t in (q, kv, shared, mask)]
    p = 0.3
    torch.manual_seed(1)
    out = span_attention(*inputs, w, 0.7, p, span_pad)
    s = max(w // 2, 1) if span_pad is None else span_pad
    shape = mask.shape[:4] + (S + (w + 2 * s) ** len(spatial),)
    torch.manual_seed(1)
    keep = torch.rand((q.shape[0],) + shape[1:], dtype=torch.float64) >= p
    ref = span_attention_reference(*inputs, w, 0.7, span_pad, keep=keep, dropout_p=p)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    weight = torch.randn_like(out)
    for name, a, b in zip(['q', 'kv', 'shared', 'mask'], _grads(out, inputs, weight), _grads(ref, inputs, weight)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11, msg=lambda msg, name=name: f'{name}: {msg}')


def test_span_attention_default_is_without_dropout():
    q, kv, shared, mask = _inputs((5, 11), 3, None, 2)
    with torch.no_grad():
        torch.testing.assert_close(span_attention(q, kv, shared, mask, 3, 0.7),
                                   span_attention_reference(q, kv, shared, mask, 3, 0.7, None), rtol=0, atol=1e-12)


def test_span_attention_with_autograd_on_and_no_input_needing_it():
    """Autograd enabled, no input requiring a gradient, no mask (the call of an eval forward outside no_grad)."""
    q, kv, shared, _ = _inputs((5, 11), 3, None, 2)
    out = span_attention(q, kv, shared, None, 3, 0.7)
    assert not out.requires_grad
    torch.testing.assert_close(out, span_attention_reference(q, kv, shared, None, 3, 0.7, None), rtol=0, atol=1e-12)


@pytest.mark.parametrize('spatial,w', [((9,), 2), ((5, 11), 3), ((9, 10), 4)])
def test_span_attention_under_bf16_autocast(spatial, w):
    """float32 inputs under CPU bf16 autocast: computed in bf16 (a bf16 output, float32 gradients of the float32
    inputs), within 2e-2 of the scale of the fp64 reference's output and gradients."""
    q, kv, shared, mask = _inputs(spatial, w, None, 2)
    inputs = [t.float().requires_grad_() for t in (q, kv, shared)]
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = span_attention(*inputs, mask.float(), w, 0.7, 0., None)
    assert out.dtype == torch.bfloat16
    weight = torch.randn(out.shape, dtype=torch.float64)
    grads = torch.autograd.grad((out.double() * weight).sum(), inputs)
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    ref = span_attention_reference(*ref_inputs, mask, w, 0.7, None)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-2 * ref.abs().max().item())
    for a, b in zip(grads, _grads(ref, ref_inputs, weight)):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, rtol=0, atol=2e-2 * b.abs().max().item())


@pytest.mark.parametrize('shape', ['segments', 'full'])
def test_span_attention_mask_gradient_of_other_mask_shapes(shape):
    """A mask that needs a gradient given as (segments, w^ndim, K^ndim) (broadcast over batch and heads) or at the
    full (B, h, segments, w^ndim, K^ndim) shape: its gradient has its own shape, against the reference."""
    for spatial, w in (((9,), 2), ((5, 11), 3)):
        q, kv, shared, mask = _inputs(spatial, w, None, 2)
        mask = mask[0, 0] if shape == 'segments' else mask.expand(2, -1, -1, -1, -1).contiguous()
        inputs = [t.clone().requires_grad_() for t in (q, kv, shared, mask)]
        out = span_attention(*inputs, w, 0.7, 0., None)
        ref = span_attention_reference(*inputs[:3], inputs[3].expand((2, 2) + mask.shape[-3:]), w, 0.7, None)
        weight = torch.randn_like(out)
        for a, b in zip(_grads(out, inputs, weight), _grads(ref, inputs, weight)):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


@pytest.mark.parametrize('spatial,w,span_pad,S', CASES)
def test_library_reference_equals_the_per_query_restatement(spatial, w, span_pad, S):
    """`span_attention_reference` (masked full attention) against `dense_span_attention` (each query's own keys): a
    mask per head, segment and offset, one broadcast over the query offsets, none; with a dropout keep-mask."""
    q, kv, shared, mask = _inputs(spatial, w, span_pad, S)
    for m in (mask, mask[:, :, :, :1], None):
        torch.testing.assert_close(span_attention_reference(q, kv, shared, m, w, 0.7, span_pad),
                                   dense_span_attention(q, kv, shared, m, w, 0.7, span_pad), rtol=0, atol=1e-12)
    keep = torch.rand(mask.shape[:4] + (S + mask.shape[-1],)).expand(2, -1, -1, -1, -1) >= 0.3
    torch.testing.assert_close(span_attention_reference(q, kv, shared, mask, w, 0.7, span_pad, keep, 0.3),
                               dense_span_attention(q, kv, shared, mask, w, 0.7, span_pad, keep, 0.3), rtol=0,
                               atol=1e-12)


@pytest.mark.parametrize('spatial,w', [((9,), 2), ((5, 11), 3)])
def test_reference_tells_a_changed_mask_entry_or_span(spatial, w):
    """The comparisons above can fail: one mask entry changed by 1 or a span one key wider on each side moves the
    reference's output by far more than their tolerance."""
    q, kv, shared, mask = _inputs(spatial, w, None, 2)
    out = span_attention(q, kv, shared, mask, w, 0.7)
    torch.testing.assert_close(span_attention_reference(q, kv, shared, mask, w, 0.7), out, rtol=0, atol=1e-12)
    changed = mask.clone()
    changed[0, 1, 1, 1, 2] += 1.
    assert (span_attention_reference(q, kv, shared, changed, w, 0.7) - out).abs().max() > 1e-3
    s = max(w // 2, 1)
    wider = span_attention_reference(q, kv, shared, None, w, 0.7, span_pad=s + 1)
    assert (wider - span_attention(q, kv, shared, None, w, 0.7)).abs().max() > 1e-3
