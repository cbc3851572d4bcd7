"""Causal 1D long-short attention as one FlexAttention call: the CUDA path of `CausalLongShortAttention`.

The chunk path (`long_short_1d._causal_chunk`) walks the queries chunk by chunk, a dozen kernels or more a chunk. Here
every query attends, in one `torch.nn.attention.flex_attention` call, to the keys ``[segment vectors | window tokens]``:

  * segment vector j (r per segment, cache segments first) is visible to query t iff its segment ends before the
    query's own segment starts (``j < r J(t)``, J the query's segment in the cache-then-current layout) and holds a
    real token; its score is ``q . k_bar_j + q . R_c[rho]``, ``rho = r J(t) - 1 - j`` (`segment_positions`);
  * window token p is visible to query t iff it is one of the W tokens t-W+1..t and real; its score is
    ``(q + u) . k_p + (q + v) . R_w[t - p]`` (Transformer-XL's relative positions, as the official
    `autoregressive/model_lib/layer.py::ChunkedLSAttention`).

The position terms are read by the `score_mod` from tensors made by one matmul each (``q R_c^T``: queries x
vectors, ``(q + v) R_w^T``: queries x W; ``u . k``: one per key); the visibility is a `mask_mod` of positions only.
The `BlockMask` depends on the layout alone (lengths, window, segment, rank, which positions are real) and is cached
per layout and device: it is built by evaluating the mask a few query blocks at a time, never on the whole grid.

In training (`attn_kernel='flex'`) the position tensors take gradients through the `score_mod` (FlexAttention's
learnable biases: Inductor accumulates them with atomic adds) and are kept for the backward, queries x (vectors + W)
values a layer; the layer's default ('auto') trains on the chunk path until a GPU has timed this one. On CUDA the
call runs compiled (`span_flex._run_flex`); on the CPU it runs eagerly, forward only (FlexAttention has no CPU
backward), to check it against the chunk path; its gradients are checked there with FlexAttention's math on the whole
grid (tests/test_causal_flex.py) and on a GPU by tests/test_cuda.py.

Written for lsvision, Apache-2.0.
"""
from typing import Callable, NamedTuple, Optional, Tuple

import torch

from . import span_flex

__all__ = ['CausalFlexGeometry', 'causal_flex_attention', 'causal_flex_block_mask', 'causal_flex_mask_mod',
           'causal_flex_score_mod']

# mask entries evaluated at a time while building a BlockMask
_MASK_CHUNK = 1 << 24


class CausalFlexGeometry(NamedTuple):
    """Where the queries and keys of one call lie, in the layer's concatenated layout [left pad | cache | x | pad]."""
    num_queries: int  # Lp: the current tokens, padded to whole blocks; query t sits at position offset + t
    num_vectors: int  # the segment vectors, r per segment of the whole layout
    window: int  # W; window key i sits at position offset - W + i (i < W + Lp)
    offset: int  # Mp: the tokens before the current ones (left pad and cache)
    segment: int  # l: tokens per segment
    rank: int  # r: vectors per segment
    real_from: int  # positions [real_from, real_to) are real tokens
    real_to: int

    @property
    def num_keys(self) -> int:
        return self.num_vectors + self.window + self.num_queries


def causal_flex_mask_mod(geo: CausalFlexGeometry, device: Optional[torch.device] = None) -> Callable:
    """The `mask_mod`: a vector iff of a segment before the query's that holds a real token; a window token iff one of
    the W up to the query and real. Which positions are real is read from two tensors (on `device`), not closed over
    as numbers: compiled FlexAttention guards on the numbers a mask_mod closes over, and a cache that fills token by
    token (generation) would recompile it at every step."""
    nv, W, off, ls, r = geo.num_vectors, geo.window, geo.offset, geo.segment, geo.rank
    lo, hi = (torch.tensor(v, device=device) for v in (geo.real_from, geo.real_to))

    def mask_mod(b, h, q_idx, kv_idx):
        seg = kv_idx // r
        vector = (kv_idx < nv) & (seg < (off + q_idx) // ls) & ((seg + 1) * ls > lo) & (seg * ls < hi)
        pos = off - W + kv_idx - nv  # the window key's position
        delta = off + q_idx - pos
        window = (kv_idx >= nv) & (delta >= 0) & (delta < W) & (pos >= lo) & (pos < hi)
        return vector | window

    return mask_mod


def causal_flex_score_mod(geo: CausalFlexGeometry, seg_scores: torch.Tensor, key_bias: torch.Tensor,
                          win_scores: torch.Tensor) -> Callable:
    """The `score_mod` adding the position terms: ``seg_scores`` (B, h, Lp, vectors) = q R_c^T at ``rho``;
    ``key_bias`` (B, h, W + Lp) = u . k of each window key; ``win_scores`` (B, h, Lp, W) = (q + v) R_w^T at the
    distance. Indices of hidden keys are clamped (their scores are masked)."""
    nv, W, off, ls, r = geo.num_vectors, geo.window, geo.offset, geo.segment, geo.rank
    last_key = geo.window + geo.num_queries - 1

    def score_mod(score, b, h, q_idx, kv_idx):
        rho = (r * ((off + q_idx) // ls) - 1 - kv_idx).clamp(0, max(nv - 1, 0))
        key = (kv_idx - nv).clamp(0, last_key)
        delta = (q_idx + W - key).clamp(0, W - 1)
        window = score + (key_bias[b, h, key] + win_scores[b, h, q_idx, delta]).to(score.dtype)
        if nv == 0:
            return window
        return torch.where(kv_idx < nv, score + seg_scores[b, h, q_idx, rho].to(score.dtype), window)

    return score_mod


def _visible_counts(geo: CausalFlexGeometry, block_q: int, block_kv: int, device: torch.device) -> torch.Tensor:
    """(query blocks, key blocks): the visible (query, key) pairs of every block pair, the mask evaluated a few query
    blocks at a time."""
    n_qb, n_kb = -(-geo.num_queries // block_q), -(-geo.num_keys // block_kv)
    mask_mod = causal_flex_mask_mod(geo, device)
    keys = torch.arange(n_kb * block_kv, device=device)
    step = max(1, _MASK_CHUNK // (block_q * n_kb * block_kv))
    rows = []
    for first in range(0, n_qb, step):
        queries = torch.arange(first * block_q, min(n_qb, first + step) * block_q, device=device)[:, None]
        visible = mask_mod(0, 0, queries, keys[None]) & (queries < geo.num_queries) & (keys[None] < geo.num_keys)
        rows.append(visible.view(-1, block_q, n_kb, block_kv).sum((1, 3)))
    return torch.cat(rows)


def causal_flex_block_mask(geo: CausalFlexGeometry, block_size: Tuple[int, int], device: torch.device):
    """The `BlockMask` of the layout, cached per layout, block size and device."""
    def build():
        counts = _visible_counts(geo, block_size[0], block_size[1], device)
        return span_flex.block_mask_from_counts(counts, block_size, causal_flex_mask_mod(geo, device),
                                                (geo.num_queries, geo.num_keys))

    return span_flex.cached_block_mask(geo, block_size, device, build)


def causal_flex_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seg_scores: torch.Tensor,
                          key_bias: torch.Tensor, win_scores: torch.Tensor, geo: CausalFlexGeometry,
                          block_size: int = 128) -> torch.Tensor:
    """Causal long-short attention of all queries in one FlexAttention call.

    Args:
        q: Queries (B, h, Lp, d), scaled.
        keys, values: (B, h, vectors + W + Lp, d): the segment vectors (LN_G), then the window tokens (LN_L) of
            positions offset - W .. offset + Lp - 1.
        seg_scores, key_bias, win_scores: The position terms (`causal_flex_score_mod`).
        geo: The layout.
        block_size: The BlockMask block (queries and keys).

    Returns:
        (B, h, Lp, d).
    """
    if keys.shape[2] != geo.num_keys or q.shape[2] != geo.num_queries:
        raise ValueError(f'{q.shape[2]} queries and {keys.shape[2]} keys for a layout of {geo.num_queries} and '
                         f'{geo.num_keys}')
    block_mask = causal_flex_block_mask(geo, (block_size, block_size), q.device)
    score_mod = causal_flex_score_mod(geo, seg_scores, key_bias, win_scores)
    return span_flex._run_flex(q, keys, values, score_mod, block_mask, 1.)
