"""2D long-short window attention as one FlexAttention call: the CUDA candidate of `LongShortAttention2d`.

The window part of the 2D long-short layer (`span_attention`: every w x w segment of queries attends, in one softmax,
to S shared keys and to the (w + 2s)^2 map keys around it, s = max(w // 2, 1), zero-padded keys masked) is one
`torch.nn.attention.flex_attention` call over the keys ``[LN_L(k) of the map | shared keys]``:

  * a `mask_mod` says which key each query sees: a shared key always; a map key iff it lies inside the map and inside
    the span ``[y0, y0 + w + 2s) x [x0, x0 + w + 2s)`` of the query's segment (``y0 = (y // w) * w - s``), which is the
    zero-padding semantics of the span path (a padded key weighs 0);
  * ViL-LS's window relative-position bias is a `score_mod` that reads the official table at the official index of
    the query-key offset (`long_short.window_rel_pos_index`'s formula, its merged rows included);
  * the `BlockMask` is built from per-block key counts (`BlockMask.from_kv_blocks`), never by evaluating the mask on
    the whole queries x keys grid as `create_block_mask` does (4.3e9 entries for a 256 x 256 map): for every query
    block the number of visible keys in every key block is a product of two small count matrices (queries of each
    segment per query block, visible keys of each segment per key block). It depends on the geometry only (map,
    window, shared keys, token order, block size) and is cached per geometry and device, never per weight: the output
    is a function of the inputs alone.

The token order is a parameter: ``'raster'`` (the map's row-major order: no re-layout, the map as it lies) or
``'segment'`` (segment-major: the map padded to whole segments and each segment's w^2 queries and keys contiguous, so
that more key blocks are entirely visible or entirely hidden). So is the block size. This is the CUDA default
(`LongShortAttention2d(span_kernel='auto')`, where no attention dropout or window-bias gradient rules it out): by the
kernel and byte counts of a step (docs/benchmarks/cuda_counting.md) it launches fewer kernels and moves fewer bytes
than the span path; `make gpu-check` measures both on a GPU (`tools/gpu_check.py`).

On CUDA the call runs compiled (`torch.compile(flex_attention)`, or inlined where the caller is compiled): FlexAttention
without compile materializes the full score matrix. Dynamo compiles it once per shape, and past its recompile limit it
would silently run that dense path; the limit is raised for this call (`FLEX_RECOMPILE_LIMIT`) and hitting it raises.
On the CPU FlexAttention runs forward only (its backward raises in torch 2.14): the CPU keeps the span path, and this
one runs there to check its masks against the dense reference (`span_attention_reference`).

Written for lsvision, Apache-2.0.
"""
from collections import OrderedDict
from typing import Callable, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

__all__ = ['FLEX_ORDERS', 'FLEX_RECOMPILE_LIMIT', 'FlexSpanGeometry', 'span_flex_attention', 'span_flex_block_mask',
           'span_flex_geometry', 'span_flex_mask_mod', 'span_flex_score_mod']

FLEX_ORDERS = ('raster', 'segment')
# compiled FlexAttention shapes per process (each stage's map, batch, dtype, grad mode): dynamo's default of 8 is
# below what one model's training and evaluation reach
FLEX_RECOMPILE_LIMIT = 64


class FlexSpanGeometry(NamedTuple):
    """Where every query and key of one flex call lies. Queries are the map in `order` (segment-major: padded to whole
    segments); keys are the map in the same order, then the `num_shared` shared keys."""
    height: int  # the map H x W
    width: int
    window: int  # segment size w
    pad: int  # s, keys on each side of a segment's span
    order: str
    grid_w: int  # segments per row, ceil(W / w)
    num_queries: int  # L: H * W (raster) or gy * w * gx * w (segment)
    num_shared: int

    @property
    def row_stride(self) -> int:
        """Tokens per map row in raster order."""
        return self.width

    @property
    def num_keys(self) -> int:
        return self.num_queries + self.num_shared

    @property
    def pads(self) -> bool:
        """Whether the token order pads the map (segment order on a map of partial segments)."""
        return self.order == 'segment' and bool(self.height % self.window or self.width % self.window)


def span_flex_geometry(feat_size: Tuple[int, int], window_size: int, num_shared: int, order: str = 'raster'
                       ) -> FlexSpanGeometry:
    """The geometry of one flex call (see `FlexSpanGeometry`)."""
    if order not in FLEX_ORDERS:
        raise ValueError(f'order must be one of {FLEX_ORDERS}, got {order!r}')
    H, W = feat_size
    w = window_size
    gy, gx = -(-H // w), -(-W // w)
    L = H * W if order == 'raster' else gy * w * gx * w
    return FlexSpanGeometry(H, W, w, max(w // 2, 1), order, gx, L, num_shared)


def _coords(geo: FlexSpanGeometry, idx: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Map row and column of token `idx` (any integer tensor) in the geometry's order."""
    w = geo.window
    if geo.order == 'raster':
        return idx // geo.width, idx % geo.width
    seg, off = idx // (w * w), idx % (w * w)
    return (seg // geo.grid_w) * w + off // w, (seg % geo.grid_w) * w + off % w


def span_flex_mask_mod(geo: FlexSpanGeometry) -> Callable:
    """The `mask_mod` of the geometry: shared keys always visible; a map key iff inside the map and inside the span
    of the query's segment."""
    w, s, K = geo.window, geo.pad, geo.window + 2 * geo.pad
    L, S, H, W = geo.num_queries, geo.num_shared, geo.height, geo.width

    def mask_mod(b, h, q_idx, kv_idx):
        qy, qx = _coords(geo, q_idx)
        ky, kx = _coords(geo, kv_idx)
        y0, x0 = (qy // w) * w - s, (qx // w) * w - s
        in_span = (ky >= y0) & (ky < y0 + K) & (kx >= x0) & (kx < x0 + K)
        map_key = (kv_idx < L) & (ky < H) & (kx < W) & in_span
        return map_key | ((kv_idx >= L) & (kv_idx < L + S))

    return mask_mod


def span_flex_score_mod(geo: FlexSpanGeometry, rel_pos_table: torch.Tensor) -> Callable:
    """The `score_mod` adding the window relative-position bias to the map keys' scores: the official table (rows,
    heads) at ``(dy + s' + w - 1) * (w + 2s') + dx + s' + w - 1``, ``d = query - key`` per axis, ``s' = w // 2``
    (`long_short.window_rel_pos_index`; out-of-span offsets are clamped, their keys are masked)."""
    w, L = geo.window, geo.num_queries
    sp = w // 2
    rows = rel_pos_table.shape[0]

    def score_mod(score, b, h, q_idx, kv_idx):
        qy, qx = _coords(geo, q_idx)
        ky, kx = _coords(geo, kv_idx)
        idx = ((qy - ky + sp + w - 1) * (w + 2 * sp) + (qx - kx + sp + w - 1)).clamp(0, rows - 1)
        return torch.where(kv_idx < L, score + rel_pos_table[idx, h].to(score.dtype), score)

    return score_mod


def _visible_counts(geo: FlexSpanGeometry, block_q: int, block_kv: int, device: torch.device) -> torch.Tensor:
    """(query blocks, key blocks) float64: the visible (query, key) pairs of every block pair, as counts.

    Every query of a segment sees the same keys, so the counts are (queries of each segment per query block) @
    (visible keys of each segment per key block); a segment's visible map keys are a rectangle, so the latter is, per
    key block, (segment rows x keys) @ (keys x segment columns). Nothing of size queries x keys is made.
    """
    w, s, K = geo.window, geo.pad, geo.window + 2 * geo.pad
    gy, gx = -(-geo.height // w), geo.grid_w
    L, S = geo.num_queries, geo.num_shared
    n_qb, n_kb = -(-L // block_q), -(-geo.num_keys // block_kv)
    f64 = dict(dtype=torch.float64, device=device)
    # queries of each segment in each query block
    qy, qx = _coords(geo, torch.arange(L, device=device))
    seg = (qy // w) * gx + qx // w
    per_q = torch.zeros(n_qb * gy * gx, **f64)
    per_q.index_add_(0, torch.arange(L, device=device) // block_q * (gy * gx) + seg, torch.ones(L, **f64))
    per_q = per_q.view(n_qb, gy * gx)
    # visible map keys of each segment in each key block: row and column visibility per key
    ky, kx = _coords(geo, torch.arange(n_kb * block_kv, device=device))
    in_map = (torch.arange(n_kb * block_kv, device=device) < L) & (ky < geo.height) & (kx < geo.width)
    lo = torch.arange(gy, device=device)[:, None] * w - s
    rows_visible = ((ky[None] >= lo) & (ky[None] < lo + K) & in_map[None]).to(torch.float64)  # (gy, keys)
    lo = torch.arange(gx, device=device)[:, None] * w - s
    cols_visible = ((kx[None] >= lo) & (kx[None] < lo + K)).to(torch.float64)  # (gx, keys)
    per_k = torch.bmm(rows_visible.view(gy, n_kb, block_kv).transpose(0, 1),
                      cols_visible.view(gx, n_kb, block_kv).permute(1, 2, 0))  # (key blocks, gy, gx)
    counts = per_q @ per_k.reshape(n_kb, gy * gx).T
    # the shared keys: every query sees them
    key = torch.arange(n_kb * block_kv, device=device)
    shared = ((key >= L) & (key < L + S)).to(torch.float64).view(n_kb, block_kv).sum(1)
    return counts + per_q.sum(1, keepdim=True) * shared[None]


def ordered_blocks(blocks: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(1, 1, rows, cols) bool -> the number of True blocks per row and their column indices first (BlockMask's)."""
    dense = blocks.to(torch.int32)
    return dense.sum(-1).to(torch.int32), torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)


def block_mask_from_counts(counts: torch.Tensor, block_size: Tuple[int, int], mask_mod: Callable,
                           seq_lengths: Tuple[int, int]):
    """The `BlockMask` of (query blocks, key blocks) counts of visible pairs: full blocks where every pair is visible,
    partial where some are (`BlockMask.from_kv_blocks`)."""
    from torch.nn.attention.flex_attention import BlockMask
    counts = counts[None, None]
    full = counts == block_size[0] * block_size[1]  # tail blocks (past the sequence) are never full
    kv_num, kv_idx = ordered_blocks((counts > 0) & ~full)
    full_num, full_idx = ordered_blocks(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size, mask_mod=mask_mod,
                                    seq_lengths=seq_lengths)


_BLOCK_MASKS: 'OrderedDict[Tuple, object]' = OrderedDict()
# BlockMasks kept (the least recently used goes first): a cache that fills token by token makes one per step
BLOCK_MASK_CACHE_SIZE = 256


def cached_block_mask(geo: Tuple, block_size: Tuple[int, int], device: torch.device, build: Callable[[], object]):
    """`build()`, cached per geometry (its type too: two layouts may hold the same numbers), block size and device,
    the last `BLOCK_MASK_CACHE_SIZE` used; built inside the graph where the caller is being compiled."""
    if torch.compiler.is_compiling():
        return build()
    key = (type(geo).__name__, geo, block_size, device)
    if key in _BLOCK_MASKS:
        _BLOCK_MASKS.move_to_end(key)
    else:
        _BLOCK_MASKS[key] = build()
        while len(_BLOCK_MASKS) > BLOCK_MASK_CACHE_SIZE:
            _BLOCK_MASKS.popitem(last=False)
    return _BLOCK_MASKS[key]


def _build_block_mask(geo: FlexSpanGeometry, block_size: Tuple[int, int], device: torch.device):
    counts = _visible_counts(geo, block_size[0], block_size[1], device)
    return block_mask_from_counts(counts, block_size, span_flex_mask_mod(geo), (geo.num_queries, geo.num_keys))


def span_flex_block_mask(geo: FlexSpanGeometry, block_size: Tuple[int, int], device: torch.device):
    """The `BlockMask` of the geometry, cached per geometry, block size and device."""
    return cached_block_mask(geo, block_size, device, lambda: _build_block_mask(geo, block_size, device))


def score_mod_tensors(score_mod: Optional[Callable]) -> List[torch.Tensor]:
    """The tensors a `score_mod` closes over: what FlexAttention's kernels read beside q, k and v (and, where they take
    a gradient, what its backward writes)."""
    cells = getattr(score_mod, '__closure__', None) or ()
    return [c.cell_contents for c in cells if isinstance(c.cell_contents, torch.Tensor)]


_COMPILED_FLEX: Optional[Callable] = None


def _compiled_flex() -> Callable:
    global _COMPILED_FLEX
    if _COMPILED_FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX


def _run_flex(q, k, v, score_mod, block_mask, scale: float) -> torch.Tensor:
    """flex_attention, compiled on CUDA: inlined where the caller is compiled, else through one compiled function
    whose recompile limit is `FLEX_RECOMPILE_LIMIT` and fails loudly when hit (instead of dynamo's silent dense
    fallback). Eager elsewhere (the CPU: small checks)."""
    from torch.nn.attention.flex_attention import flex_attention
    if q.device.type == 'cpu' and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise RuntimeError(
            "the FlexAttention paths (span_kernel='flex', attn_kernel='flex') train on CUDA only (FlexAttention has "
            "no backward on the CPU); on the CPU use the default kernel, 'auto' (lsvision.layers.set_span_kernel("
            "model, 'auto') for the 2D layers, attn_kernel='auto' for CausalLongShortAttention), or run the flex "
            "path under torch.no_grad()")
    if torch.compiler.is_compiling() or q.device.type != 'cuda':
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)
    try:
        with torch._dynamo.config.patch(recompile_limit=FLEX_RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True):
            return _compiled_flex()(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)
    except torch._dynamo.exc.FailOnRecompileLimitHit as e:
        raise RuntimeError(
            f'the FlexAttention span path compiled {FLEX_RECOMPILE_LIMIT} shapes in this process and would now fall '
            'back to a dense attention that materializes every score; raise '
            'lsvision.layers.span_flex.FLEX_RECOMPILE_LIMIT, or use fewer input sizes') from e


def _order_view(t: torch.Tensor, geo: FlexSpanGeometry) -> torch.Tensor:
    """(B, H, W, *M, d) token-major map -> its tokens in the geometry's order as a permuted view, (*M[:-1], B, M[-1],
    L, d) in raster order and (*M[:-1], B, M[-1], gy, gx, w, w, d) in segment order (zero-padded segments: the one
    copy a map of partial segments needs)."""
    B, H, W, *mid, d = t.shape
    m = len(mid)
    lead = list(range(3, 2 + m))  # M[:-1], then B, then M[-1] (the heads)
    if geo.order == 'raster':
        return t.reshape(B, H * W, *mid, d).permute([i - 1 for i in lead] + [0, 1 + m, 1, 2 + m])
    w, gx = geo.window, geo.grid_w
    gy = -(-H // w)
    if geo.pads:  # a map of whole segments needs no padding (and no copy for it)
        t = F.pad(t, (0, 0) * (m + 1) + (0, gx * w - W, 0, gy * w - H))
    return t.reshape(B, gy, w, gx, w, *mid, d).permute([i + 2 for i in lead] + [0, 4 + m, 1, 3, 2, 4, 5 + m])


def _to_order(t: torch.Tensor, geo: FlexSpanGeometry) -> torch.Tensor:
    """(B, H, W, *M, d) token-major map -> (*M[:-1], B, M[-1], L, d) tokens in the geometry's order (segment-major:
    zero-padded segments), e.g. queries (B, H, W, h, d) -> (B, h, L, d), keys and values (B, H, W, 2, h, d) ->
    (2, B, h, L, d). One permutation of split views and at most one copy: its backward copies once too."""
    t = _order_view(t, geo)
    lead = t.shape[:len(t.shape) - 2] if geo.order == 'raster' else t.shape[:len(t.shape) - 5]
    return t.reshape(*lead, geo.num_queries, t.shape[-1])


def _write_keys_in_order(kv: torch.Tensor, kv_shared: torch.Tensor, geo: FlexSpanGeometry) -> torch.Tensor:
    """(2, B, h, L + S, d): the map's keys and values written in the geometry's order, then the shared ones, each
    part written once into the buffer the kernel reads."""
    L = geo.num_queries
    out = kv.new_empty(kv_shared.shape[:3] + (L + kv_shared.shape[3], kv_shared.shape[4]))
    ordered = _order_view(kv, geo)
    out[..., :L, :].view(ordered.shape).copy_(ordered)  # the buffer's map part, split as the ordered view is
    out[..., L:, :].copy_(kv_shared)
    return out


class _KeysInOrder(torch.autograd.Function):
    """`_write_keys_in_order` with its backward: the map keys' gradient written once, in the layout of `kv` (so that
    the view ops before it hand a dense gradient back), the shared keys' a view. Where the map is whole segments (or
    in raster order): `_order_view` is then a view that the gradient can be written through."""

    @staticmethod
    def forward(ctx, kv: torch.Tensor, kv_shared: torch.Tensor, geo: FlexSpanGeometry) -> torch.Tensor:
        ctx.geo, ctx.kv_layout = geo, (kv.shape, kv.stride())
        return _write_keys_in_order(kv, kv_shared, geo)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        geo, L = ctx.geo, ctx.geo.num_queries
        grad_kv = None
        if ctx.needs_input_grad[0]:
            # in kv's strides (a permuted view of a dense layout: the gradient of that layout, dense)
            grad_kv = grad.new_empty_strided(*ctx.kv_layout)
            ordered = _order_view(grad_kv, geo)
            ordered.copy_(grad[..., :L, :].view(ordered.shape))
        return grad_kv, grad[..., L:, :], None


def _keys_in_order(kv: torch.Tensor, kv_shared: torch.Tensor, geo: FlexSpanGeometry) -> torch.Tensor:
    """The map's keys and values in the geometry's order, then the shared ones: (2, B, h, L + S, d), each part
    written once into the buffer the kernel reads (a cat of an ordered copy would write the map's keys and values a
    second time). Under autograd through `_KeysInOrder`; where the segment order pads the map, one cat of the padded
    ordered copy (its backward: views of the gradient)."""
    if not (torch.is_grad_enabled() and (kv.requires_grad or kv_shared.requires_grad)):
        return _write_keys_in_order(kv, kv_shared, geo)
    if not geo.pads:
        return _KeysInOrder.apply(kv, kv_shared, geo)
    return torch.cat([_to_order(kv, geo), kv_shared], dim=3)


def _unorder_view(t: torch.Tensor, geo: FlexSpanGeometry) -> torch.Tensor:
    """(B, h, L, d) outputs in the geometry's order -> a permuted view of them in map order: (B, H, W, h, d) in raster
    order, (B, gy, w, gx, w, h, d) in segment order (padded segments included)."""
    B, h, _, d = t.shape
    if geo.order == 'raster':
        return t.reshape(B, h, geo.height, geo.width, d).permute(0, 2, 3, 1, 4)
    w, gx = geo.window, geo.grid_w
    return t.reshape(B, h, -(-geo.height // w), gx, w, w, d).permute(0, 2, 4, 3, 5, 1, 6)


def _from_order(t: torch.Tensor, geo: FlexSpanGeometry) -> torch.Tensor:
    """(B, h, L, d) outputs in the geometry's order -> (B, H, W, h, d), the span path's output layout."""
    t = _unorder_view(t, geo)
    if geo.order == 'raster':
        return t
    B, gy, w, gx, _, h, d = t.shape
    return t.reshape(B, gy * w, gx * w, h, d)[:, :geo.height, :geo.width]


def _from_order_into(t: torch.Tensor, geo: FlexSpanGeometry, out: torch.Tensor) -> torch.Tensor:
    """`_from_order` written into `out` (B, H, W, h, d) (any strides), one copy where the map is whole segments (or
    in raster order), else two."""
    if geo.pads:
        return out.copy_(_from_order(t, geo))
    ordered = _unorder_view(t, geo)
    out.view(ordered.shape).copy_(ordered)  # `out`, split as the ordered view is
    return out


def span_flex_attention(
        q: torch.Tensor,
        kv: torch.Tensor,
        kv_shared: torch.Tensor,
        window_size: int,
        scale: float,
        rel_pos_table: Optional[torch.Tensor] = None,
        order: str = 'raster',
        block_size: Tuple[int, int] = (128, 128),
        out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """2D segment-wise window attention with shared keys (`span_attention` with the long-short span, s = max(w // 2,
    1)) as one FlexAttention call.

    Args:
        q: Queries (B, H, W, h, d), token-major (a view of (B, H * W, C) tokens); any strides.
        kv: The map's keys and values, stacked: (B, H, W, 2, h, d) (after LN_L); any strides (one re-layout serves
            both).
        kv_shared: Keys and values every query sees (2, B, h, S, d) (projected and prefix keys); S may be 0.
        window_size: Segment size w.
        scale: Score scale.
        rel_pos_table: The official window relative-position table (rows, h) of window `window_size`, added to the
            map keys' scores; None: no bias.
        order: Token order of queries and map keys: 'raster' or 'segment' (segment-major).
        block_size: (query, key) block of the BlockMask and the kernel's sparsity.
        out: Optional (B, H, W, h, d) tensor (any strides, e.g. a view of a larger buffer) the outputs are written
            into, which saves the caller a copy; without autograd (inference) only.

    Returns:
        Outputs (B, H, W, h, d), as `span_attention`'s. No dropout (pass attention dropout 0).
    """
    if out is not None and torch.is_grad_enabled() and any(t.requires_grad for t in (q, kv, kv_shared)):
        raise ValueError('span_flex_attention(out=...) is for inference: call it without out= under autograd')
    H, W = q.shape[1:3]
    geo = span_flex_geometry((H, W), window_size, kv_shared.shape[3], order)
    block_mask = span_flex_block_mask(geo, tuple(block_size), q.device)
    score_mod = None if rel_pos_table is None else span_flex_score_mod(geo, rel_pos_table)
    keys, values = _keys_in_order(kv, kv_shared, geo).unbind(0)  # (B, h, L + S, d) each
    ordered = _run_flex(_to_order(q, geo), keys, values, score_mod, block_mask, scale)
    return _from_order(ordered, geo) if out is None else _from_order_into(ordered, geo, out)
