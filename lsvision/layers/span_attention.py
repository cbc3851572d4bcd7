"""Segment-wise window attention over key spans: the core of the 1D and 2D long-short layers and of HSW.

Queries are cut into segments of w positions per axis (w in 1D, w x w in 2D, the map zero-padded to whole segments).
Each segment attends, in one joint softmax, to

  * S shared keys (the dynamic projection, prefix or global tokens), the same for every segment, and
  * the keys of its span: K = w + 2s positions per axis around it (s = max(w // 2, 1) by default, the long-short
    layers' overlapping windows; s = 0 gives non-overlapping windows, K = w, as Swin's), zero-padded at the border;
    the additive `window_mask` (-inf on padded keys, a relative-position bias) acts on these.

Autograd through a gather of the spans keeps the gathered copy for the backward pass: (K / w)^2 ~ 4 copies of every
key and value in 2D, more activation memory than full attention. `span_attention` keeps only what it is given (q, k
and v in their own layout, views of tensors the layer keeps anyway) and, where dropout is on, the dropout mask; its
backward gathers the spans again and runs the attention backward as batched matmuls over the whole batch (P is
recomputed from the scores, as flash attention does), then folds the span gradients back onto the map with a few
strided adds. The shared keys are never copied per segment: their scores, and their part of every product, are one
matmul over all queries. Training runs on fused attention kernels instead where it can (`_use_flash`; CPU's
flash-attention kernels, CUDA's memory-efficient ones, on the spans only; the shared part joins through the
log-sum-exps), which also keep the output and one log-sum-exp per query: in 1D the spans are strided views of the
padded map (nothing gathered); in 2D, blocks of c segments along x (`block_segments`) whose keys are strided views of
one gather of column strips (one copy of (c * w + 2s) / (c * w) times the map, where the segment spans were
(K / w)^2), a band mask keeping each query to its own span; where a span is two segments wide (K = 2w) and a block
one segment, the backward runs by row halves of the spans, so that the kernel's key gradients are twice the map, not
(K / w)^2 = 4 times. Without gradients (inference, TorchScript) the same forward runs with no autograd at all.

Written for lsvision, Apache-2.0.
"""
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from ._private_sdpa import efficient_kernel_takes, fused_attention, fused_attention_backward, fused_kernels_available
from .autocast import autocast_dtype, autocast_off
from .export import captures_graph
from .local_norm import local_norm_tokens
from .matmul_attention import scaled_dot_product_attention

__all__ = ['window_span', 'block_segments', 'span_attention', 'span_attention_local_norm', 'span_window_key_mask']


def window_span(window_size: int, span_pad: Optional[int] = None) -> Tuple[int, int]:
    """Key padding s and key span K = w + 2s of a segment of size w (s = `span_pad`, default max(w // 2, 1))."""
    pad = max(window_size // 2, 1) if span_pad is None else span_pad
    if pad < 0:
        raise ValueError(f'span_pad must be >= 0 (or None for max(w // 2, 1)), got {pad}')
    return pad, window_size + 2 * pad


def span_window_key_mask(
        spatial: List[int],
        window_size: int,
        dtype: torch.dtype,
        device: torch.device,
) -> torch.Tensor:
    """Additive mask of the span keys of every segment: -inf on keys outside the map, 0 elsewhere.

    Args:
        spatial: Map size per axis ([n] or [H, W]).

    Returns:
        (num_segments, K^ndim) mask, segments in row-major order.
    """
    pad, span = window_span(window_size)
    grid = [(n + window_size - 1) // window_size for n in spatial]
    valid = torch.zeros([g * window_size + 2 * pad for g in grid], dtype=torch.bool, device=device)
    if len(spatial) == 1:
        valid[pad:pad + spatial[0]] = True
        valid = valid.unfold(0, span, window_size)
    else:
        valid[pad:pad + spatial[0], pad:pad + spatial[1]] = True
        valid = valid.unfold(0, span, window_size).unfold(1, span, window_size)
    num_segments = 1
    for g in grid:
        num_segments *= g
    valid = valid.reshape(num_segments, -1)
    return torch.zeros(valid.shape, dtype=dtype, device=device).masked_fill(~valid, float('-inf'))


def _grid(spatial: List[int], window_size: int) -> List[int]:
    return [(n + window_size - 1) // window_size for n in spatial]


def _tile_queries(t: torch.Tensor, window_size: int) -> torch.Tensor:
    """(B, h, *spatial, d) map -> (B, h, num_segments, w^ndim, d) segments (zero-padded to whole segments)."""
    B, h, d = t.shape[0], t.shape[1], t.shape[-1]
    spatial = list(t.shape[2:-1])
    ws = window_size
    grid = _grid(spatial, ws)
    if len(spatial) == 1:
        if grid[0] * ws != spatial[0]:
            t = F.pad(t, (0, 0, 0, grid[0] * ws - spatial[0]))
        return t.reshape(B, h, grid[0], ws, d)
    if grid[0] * ws != spatial[0] or grid[1] * ws != spatial[1]:
        t = F.pad(t, (0, 0, 0, grid[1] * ws - spatial[1], 0, grid[0] * ws - spatial[0]))
    t = t.reshape(B, h, grid[0], ws, grid[1], ws, d).permute(0, 1, 2, 4, 3, 5, 6)
    return t.reshape(B, h, grid[0] * grid[1], ws * ws, d)


def _untile(t: torch.Tensor, spatial: List[int], window_size: int) -> torch.Tensor:
    """(B, h, num_segments, w^ndim, d) segments -> (B, *spatial, h, d) tokens (cropped to the map)."""
    B, h, d = t.shape[0], t.shape[1], t.shape[-1]
    ws = window_size
    grid = _grid(spatial, ws)
    if len(spatial) == 1:
        out = t.reshape(B, h, grid[0] * ws, d).transpose(1, 2)
        return out[:, :spatial[0]] if grid[0] * ws != spatial[0] else out
    out = t.reshape(B, h, grid[0], grid[1], ws, ws, d).permute(0, 2, 4, 3, 5, 1, 6)
    out = out.reshape(B, grid[0] * ws, grid[1] * ws, h, d)
    if grid[0] * ws != spatial[0] or grid[1] * ws != spatial[1]:
        out = out[:, :spatial[0], :spatial[1]]
    return out


def _tokens_to_segments(t: torch.Tensor, window_size: int) -> torch.Tensor:
    """(B, *spatial, h, d) tokens -> (B, h, num_segments, w^ndim, d): the inverse layout of `_untile`."""
    return _tile_queries(t.movedim(-2, 1), window_size)


def _gather_keys(kv: torch.Tensor, kv_shared: torch.Tensor, window_size: int, span_pad: Optional[int] = None
                 ) -> torch.Tensor:
    """Keys and values of every segment, [shared (S) | span (K^ndim)], each part written once into one buffer.

    Args:
        kv: (2, B, h, *spatial, d) keys and values of the map.
        kv_shared: (2, B, h, S, d).
        span_pad: Key padding s of the span (`window_span`).

    Returns:
        (2, B, h, num_segments, S + K^ndim, d).
    """
    _, B, h = kv.shape[:3]
    d = kv.shape[-1]
    spatial = list(kv.shape[3:-1])
    ws = window_size
    pad, span = window_span(ws, span_pad)
    grid = _grid(spatial, ws)
    S = kv_shared.shape[3]
    if len(spatial) == 1:
        padded = F.pad(kv, (0, 0, pad, grid[0] * ws + pad - spatial[0]))
        num_segments, num_span = grid[0], span
        tiles = padded.unfold(3, span, ws).transpose(-1, -2)  # (2, B, h, G, K, d)
    else:
        padded = F.pad(kv, (0, 0, pad, grid[1] * ws + pad - spatial[1], pad, grid[0] * ws + pad - spatial[0]))
        num_segments, num_span = grid[0] * grid[1], span * span
        tiles = padded.unfold(3, span, ws).unfold(4, span, ws).permute(0, 1, 2, 3, 4, 6, 7, 5)  # (2,B,h,gy,gx,K,K,d)
    keys = kv.new_empty(2, B, h, num_segments, S + num_span, d)
    if S > 0:
        keys[:, :, :, :, :S] = kv_shared[:, :, :, None]
    keys[:, :, :, :, S:].view(tiles.shape).copy_(tiles)
    return keys


def _gather_spans(kv: torch.Tensor, window_size: int, span_pad: Optional[int] = None) -> torch.Tensor:
    """Keys and values of every segment's span only, (2, B, h, num_segments, K^ndim, d): the shared keys are used
    as they lie, one matmul over all queries."""
    return _gather_keys(kv, kv.new_empty(kv.shape[:3] + (0, kv.shape[-1])), window_size, span_pad)


def _fold_axis(t: torch.Tensor, dim: int, window_size: int, length: int, pad: int) -> torch.Tensor:
    """Sum the span gradients of one axis back onto it: dims (dim, dim + 1) = (segment, span offset) -> `length`.

    Span offset k of segment i sits at padded position i * w + k, i.e. in block i + k // w; each w-wide piece of the
    span is one strided add. The padding (s before, the rest after) is cropped.
    """
    G, K = t.shape[dim], t.shape[dim + 1]
    pieces = (K + window_size - 1) // window_size
    shape = list(t.shape)
    shape[dim:dim + 2] = [G + pieces - 1, window_size]
    out = t.new_empty(shape)
    # the first piece is whole (K >= w) and covers blocks 0..G-1: a copy, so only the last blocks need zeros
    out.narrow(dim, 0, G).copy_(t.narrow(dim + 1, 0, window_size))
    out.narrow(dim, G, pieces - 1).zero_()
    for j in range(1, pieces):
        n = min(window_size, K - j * window_size)
        out.narrow(dim, j, G).narrow(dim + 1, 0, n).add_(t.narrow(dim + 1, j * window_size, n))
    return out.flatten(dim, dim + 1).narrow(dim, pad, length)


def _add_blocks(target: torch.Tensor, blocks: torch.Tensor, row_step: int, col_step: int) -> None:
    """Add overlapping blocks onto a map, in place: block (y, x) of `blocks` (B, h, nx, gy, R, Wc, d) onto rows
    y * row_step + [0, R) and columns x * col_step + [0, Wc) of `target` (B, h, rows, cols, d, any strides; at least
    (gy - 1) * row_step + R rows and (nx - 1) * col_step + Wc columns). Blocks that overlap go in different adds: with
    m = ceil(R / row_step) (and likewise for columns), the blocks whose indices agree mod m do not overlap, so each of
    the m x m' groups is one strided add (into windows of the map, `unfold`), with no intermediate copy."""
    nx, gy, R, Wc = blocks.shape[2:6]
    my, mx = -(-R // row_step), -(-Wc // col_step)
    for ry in range(min(my, gy)):
        ny = len(range(ry, gy, my))
        rows = target.narrow(2, ry * row_step, (ny - 1) * my * row_step + R).unfold(2, R, my * row_step)
        for rx in range(min(mx, nx)):
            n = len(range(rx, nx, mx))
            region = rows.narrow(3, rx * col_step, (n - 1) * mx * col_step + Wc).unfold(3, Wc, mx * col_step)
            # (B, h, ny, n, d, R, Wc) -> (B, h, ny, R, n, Wc, d), the blocks' (B, h, n, ny, R, Wc, d) with n, ny swapped
            region.permute(0, 1, 2, 5, 3, 6, 4).add_(blocks[:, :, rx::mx, ry::my].permute(0, 1, 3, 4, 2, 5, 6))


def _padded_token_map(like: torch.Tensor, B: int, h: int, rows: int, cols: int) -> torch.Tensor:
    """Zeros laid out as tokens (B, rows, cols, h, d), seen heads first: (B, h, rows, cols, d), the layout of the
    key and value gradients that LN_L's backward reads."""
    return like.new_zeros(B, rows, cols, h, like.shape[-1]).permute(0, 3, 1, 2, 4)


def _fold_blocks(blocks: torch.Tensor, spatial: List[int], pad: int, row_step: int, col_step: int) -> torch.Tensor:
    """Sum blocks (B, h, nx, gy, R, Wc, d) of key or value gradients, block (y, x) at padded rows y * row_step + [0, R)
    and columns x * col_step + [0, Wc), onto a zeroed padded token map (`_add_blocks`), then crop the padding (s =
    `pad` before each axis): (B, h, *spatial, d), a heads-first view of a token map (B, H', W', h, d), the layout LN_L's
    backward reads."""
    B, h, nx, gy, R, Wc = blocks.shape[:6]
    out = _padded_token_map(blocks, B, h, (gy - 1) * row_step + R, (nx - 1) * col_step + Wc)
    _add_blocks(out, blocks, row_step, col_step)
    return out[:, :, pad:pad + spatial[0], pad:pad + spatial[1]]


def _fold_spans(grad_span: torch.Tensor, spatial: List[int], window_size: int, span_pad: Optional[int] = None
                ) -> torch.Tensor:
    """The adjoint of the span gather for keys or values: (B, h, num_segments, K^ndim, d) span gradients -> map
    (B, h, *spatial, d); in 2D a heads-first view of a padded token map (B, H', W', h, d), as `_fold_block_keys`."""
    B, h, d = grad_span.shape[0], grad_span.shape[1], grad_span.shape[-1]
    ws = window_size
    pad, span = window_span(ws, span_pad)
    grid = _grid(spatial, ws)
    if len(spatial) == 1:
        return _fold_axis(grad_span, 2, ws, spatial[0], pad)
    # segment (y, x)'s span holds padded rows y * w + [0, K) and columns x * w + [0, K): blocks of one segment
    return _fold_blocks(grad_span.reshape(B, h, grid[0], grid[1], span, span, d).transpose(2, 3), spatial, pad, ws, ws)


# The fixed cost of one kernel block in `block_segments`, in query-key pairs of work (head dim 64): the CPU flash
# kernels' forward + backward spend ~20 us a block on 2 cores, the time of ~720 pairs (fit to CvT-LS's stage-3 windows
# over c = 1..gx at 224 px batch 8 and 384 px batch 2)
_BLOCK_COST_PAIRS = 720


def block_segments(window_size: int, grid_x: int, span_pad: Optional[int] = None) -> int:
    """Segments per block (c) along x in the 2D training path on the fused kernels.

    A block of c segments holds w x c * w queries; its keys are K rows x Wc = c * w + 2s columns, against the K x K that
    each query sees, so wider blocks waste key work, while every block costs the kernel a fixed overhead
    (`_BLOCK_COST_PAIRS`), and the segments that pad the last block cost as much as real ones. The width is the c in
    1..gx with the least estimated work, nx * (overhead + w * c * w * K * Wc) over the nx = ceil(gx / c) blocks of a
    row (ties: the narrower). CvT-LS's stage-3 window attention forward + backward on 2 cores, kernels and layouts: 224
    px batch 8 (w = 2, gx = 7) c = 7 21 ms against 28 ms for c = 4 (the earlier rule, at least 16 queries, padding one
    segment) and 44 ms for c = 1; 384 px batch 2 (w = 3, gx = 8) c = 2 15 ms, c = 4 17 ms, c = 8 19 ms, c = 1 21 ms.
    Larger windows (w >= 4) keep c = 1.

    Args:
        window_size: Segment size w.
        grid_x: Segments across the map, gx.
        span_pad: Key padding s of the span (`window_span`).
    """
    pad, span = window_span(window_size, span_pad)

    def work(c: int) -> int:
        pairs = window_size * c * window_size * span * (c * window_size + 2 * pad)  # queries x keys of a block
        return -(-grid_x // c) * (_BLOCK_COST_PAIRS + pairs)

    return min(range(1, max(grid_x, 1) + 1), key=work)


def _block_grid(spatial: List[int], window_size: int, span_pad: Optional[int], segments_per_block: int
                ) -> Tuple[int, int, int, int, int]:
    """(gy, gx, number of x blocks, padded rows Hp, block key columns Wc) of a 2D map in blocks of c segments."""
    pad, _ = window_span(window_size, span_pad)
    gy, gx = _grid(spatial, window_size)
    c = segments_per_block
    return gy, gx, (gx + c - 1) // c, gy * window_size + 2 * pad, c * window_size + 2 * pad


def _map_to_blocks(t: torch.Tensor, window_size: int, segments_per_block: int) -> torch.Tensor:
    """(B, h, H, W, d) map -> (B * h * nx, gy, w * c * w, d): the queries of every block, x blocks outer, rows of
    segments inner, each block's queries in row-major order (zero-padded to whole blocks)."""
    B, h, H, W, d = t.shape
    ws, c = window_size, segments_per_block
    gy, gx = _grid([H, W], ws)
    nx = (gx + c - 1) // c
    if gy * ws != H or nx * c * ws != W:
        t = F.pad(t, (0, 0, 0, nx * c * ws - W, 0, gy * ws - H))
    t = t.reshape(B, h, gy, ws, nx, c * ws, d).permute(0, 1, 4, 2, 3, 5, 6)
    return t.reshape(B * h * nx, gy, ws * c * ws, d)


def _blocks_to_tokens(t: torch.Tensor, B: int, h: int, spatial: List[int], window_size: int,
                      segments_per_block: int) -> torch.Tensor:
    """The inverse of `_map_to_blocks`, to tokens: (B * h * nx, gy, w * c * w, d) -> (B, H, W, h, d) (cropped)."""
    ws, c, d = window_size, segments_per_block, t.shape[-1]
    gy, gx = _grid(spatial, ws)
    nx = (gx + c - 1) // c
    out = t.reshape(B, h, nx, gy, ws, c * ws, d).permute(0, 3, 4, 2, 5, 1, 6).reshape(B, gy * ws, nx * c * ws, h, d)
    if gy * ws != spatial[0] or nx * c * ws != spatial[1]:
        out = out[:, :spatial[0], :spatial[1]]
    return out


def _gather_block_keys(k: torch.Tensor, v: torch.Tensor, window_size: int, span_pad: Optional[int],
                       segments_per_block: int) -> torch.Tensor:
    """Keys and values of every block as strided views of one column gather: (2, B * h * nx, gy, K * Wc, d).

    The (zero-padded) map is cut into x blocks of Wc = c * w + 2s columns (a copy, (c * w + 2s) / (c * w) times the
    map, the only one: the strips are read straight from k and v, and only the padding is zero-filled); within an x
    block, the K rows of the keys of each row of segments are contiguous, so the row axis needs no copy: consecutive
    segment rows are views w rows apart (overlapping).

    Args:
        k, v: (B, h, H, W, d) keys and values, any strides (e.g. heads-first views of token maps).
    """
    B, h, H, W, d = k.shape
    ws, c = window_size, segments_per_block
    pad, span = window_span(ws, span_pad)
    gy, gx, nx, Hp, Wc = _block_grid([H, W], ws, span_pad, c)
    step = c * ws
    columns = k.new_empty(2, B, h, nx, Hp, Wc, d)
    columns[:, :, :, :, :pad].zero_()
    columns[:, :, :, :, pad + H:].zero_()
    rows = columns[:, :, :, :, pad:pad + H]  # (2, B, h, nx, H, Wc, d)
    # strip j holds map columns j * step - pad + [0, Wc): strips first..last lie inside the map, one strided copy
    first, last = -(-pad // step), (W + pad - Wc) // step
    edges = [j for j in range(nx) if j < first or j > last]
    for i, t in enumerate((k, v)):
        if last >= first:
            inner = t.narrow(3, first * step - pad, (last - first) * step + Wc).unfold(3, Wc, step)  # (B,h,H,n,d,Wc)
            rows[i, :, :, first:last + 1].copy_(inner.permute(0, 1, 3, 2, 5, 4))
        for j in edges:  # strips that reach into the padding
            lo, hi = max(0, pad - j * step), min(Wc, W + pad - j * step)
            strip = rows[i, :, :, j]  # (B, h, H, Wc, d)
            strip[:, :, :, :lo].zero_()
            strip[:, :, :, max(lo, hi):].zero_()
            if hi > lo:
                strip[:, :, :, lo:hi].copy_(t[:, :, :, j * step - pad + lo:j * step - pad + hi])
    size = (2, B * h * nx, gy, span * Wc, d)
    return columns.as_strided(size, (B * h * nx * Hp * Wc * d, Hp * Wc * d, ws * Wc * d, d, 1))


def _fold_block_keys(grad: torch.Tensor, B: int, h: int, spatial: List[int], window_size: int,
                     span_pad: Optional[int], segments_per_block: int) -> torch.Tensor:
    """The adjoint of `_gather_block_keys` for keys or values: (B * h * nx, gy, K * Wc, d) -> (B, h, H, W, d), a
    heads-first view of a padded token map (B, H', W', h, d), the layout LN_L's backward reads."""
    ws, c, d = window_size, segments_per_block, grad.shape[-1]
    pad, span = window_span(ws, span_pad)
    gy, gx, nx, Hp, Wc = _block_grid(spatial, ws, span_pad, c)
    # block (y, x) holds padded rows y * w + [0, K) and padded columns x * c * w + [0, Wc)
    return _fold_blocks(grad.reshape(B, h, nx, gy, span, Wc, d), spatial, pad, ws, c * ws)


def _block_mask(window_mask: Optional[torch.Tensor], B: int, h: int, spatial: List[int], window_size: int,
                span_pad: Optional[int], segments_per_block: int, dtype: torch.dtype, device: torch.device
                ) -> Optional[torch.Tensor]:
    """The span mask in the block layout: (B * h * nx, gy, w * c * w or 1, K * Wc) for the flash kernel, or None.

    Each query sees, of its block's K x Wc keys, only its own segment's K x K span, with `window_mask`'s values
    (broadcastable to (B, h, num_segments, w^2, K^2)); -inf elsewhere. The queries of the segments that pad the last
    x block see every key (0), so that no row is all -inf; their outputs are dropped and their gradients are zero.
    """
    ws, c = window_size, segments_per_block
    pad, span = window_span(ws, span_pad)
    gy, gx, nx, Hp, Wc = _block_grid(spatial, ws, span_pad, c)
    if window_mask is None:
        if c == 1:
            return None
        window_mask = torch.zeros(1, 1, 1, 1, 1, dtype=dtype, device=device)
    m = window_mask.to(dtype)
    while m.dim() < 5:
        m = m[None]
    Bm, hm, Lm = m.shape[0], m.shape[1], m.shape[3]
    qw = ws if Lm > 1 else 1  # query rows (and columns) of a segment that the mask tells apart
    m = m.expand(Bm, hm, gy * gx, Lm, span * span).reshape(Bm * hm, gy, gx, qw, qw, span, span)
    if nx * c != gx:  # the segments that pad the last x block
        m = F.pad(m, (0, 0, 0, 0, 0, 0, 0, 0, 0, nx * c - gx))
    m = m.reshape(Bm * hm, gy, nx, c, qw, qw, span, span).permute(0, 2, 1, 4, 3, 5, 6, 7)  # (M, nx, gy, qy, c, qx..)
    # with c > 1 the band differs by query column, so the mask has every query of the block
    qb = ws if c > 1 or qw > 1 else 1
    m = m.expand(Bm * hm, nx, gy, qb, c, qb, span, span)
    # segment t's span keys are the columns t * w + [0, K) of its block rows of Wc: with each segment's K columns
    # padded with -inf to Wc + w and the c segments laid end to end, column j of segment t lands at t * (Wc + w) + j =
    # t * Wc + (t * w + j), so cutting that line into rows of Wc places every band (one pad and one cut for any c)
    rows = F.pad(m.permute(0, 1, 2, 3, 5, 6, 4, 7), (0, Wc + ws - span), value=float('-inf'))  # (.., c, Wc + w)
    rows = rows.reshape(rows.shape[:6] + (c * (Wc + ws),))[..., :c * Wc].reshape(rows.shape[:6] + (c, Wc))
    out = rows.permute(0, 1, 2, 3, 6, 4, 5, 7)  # (M, nx, gy, qy, c, qx, K, Wc)
    if nx * c != gx:
        out[:, -1, :, :, gx - (nx - 1) * c:] = 0.
    L = qb * c * qb
    out = out.reshape(Bm, hm, nx, gy, L, span * Wc).expand(B, h, nx, gy, L, span * Wc)
    return out.reshape(B * h * nx, gy, L, span * Wc)


def _strided_spans_1d(k: torch.Tensor, v: torch.Tensor, window_size: int, span_pad: Optional[int]) -> torch.Tensor:
    """Keys and values of every 1D segment's span as strided views of the zero-padded map, (2, B * h, G, K, d):
    consecutive spans overlap, w positions apart, and nothing is gathered (k and v, (B, h, n, d) of any strides, are
    copied once into the padded map)."""
    B, h, n, d = k.shape
    pad, span = window_span(window_size, span_pad)
    G = _grid([n], window_size)[0]
    length = (G - 1) * window_size + span
    padded = k.new_empty(2, B, h, length, d)
    padded[:, :, :, :pad].zero_()
    padded[:, :, :, pad + n:].zero_()
    padded[0, :, :, pad:pad + n] = k
    padded[1, :, :, pad:pad + n] = v
    return padded.as_strided((2, B * h, G, span, d), (B * h * length * d, length * d, window_size * d, d, 1))


def _flash_queries(t: torch.Tensor, window_size: int, segments_per_block: int) -> torch.Tensor:
    """(B, h, *spatial, d) map -> the flash kernel's queries: (B * h * nx, gy, w * c * w, d) blocks in 2D
    (`_map_to_blocks`), (B * h, G, w, d) segments in 1D."""
    if t.dim() == 5:
        return _map_to_blocks(t, window_size, segments_per_block)
    q_t = _tile_queries(t, window_size)
    return q_t.reshape(q_t.shape[0] * q_t.shape[1], q_t.shape[2], q_t.shape[3], q_t.shape[4])


def _flash_to_tokens(t: torch.Tensor, B: int, h: int, spatial: List[int], window_size: int,
                     segments_per_block: int) -> torch.Tensor:
    """The inverse of `_flash_queries`, to tokens (B, *spatial, h, d)."""
    if len(spatial) == 2:
        return _blocks_to_tokens(t, B, h, spatial, window_size, segments_per_block)
    return _untile(t.reshape(B, h, t.shape[1], t.shape[2], t.shape[3]), spatial, window_size)


def _flash_keys(k: torch.Tensor, v: torch.Tensor, window_size: int, span_pad: Optional[int],
                segments_per_block: int) -> torch.Tensor:
    """Keys and values (B, h, *spatial, d) each, any strides, in the layout of `_flash_queries`:
    (2, B * h * nx, gy, K * Wc, d) or (2, B * h, G, K, d)."""
    if k.dim() == 5:
        return _gather_block_keys(k, v, window_size, span_pad, segments_per_block)
    return _strided_spans_1d(k, v, window_size, span_pad)


def _flash_fold(grad: torch.Tensor, B: int, h: int, spatial: List[int], window_size: int, span_pad: Optional[int],
                segments_per_block: int) -> torch.Tensor:
    """The adjoint of `_flash_keys` for keys or values: -> (B, h, *spatial, d)."""
    if len(spatial) == 2:
        return _fold_block_keys(grad, B, h, spatial, window_size, span_pad, segments_per_block)
    return _fold_spans(grad.reshape(B, h, grad.shape[1], grad.shape[2], grad.shape[3]), spatial, window_size, span_pad)


def _flash_attn_mask(window_mask: Optional[torch.Tensor], B: int, h: int, spatial: List[int], window_size: int,
                     span_pad: Optional[int], segments_per_block: int, dtype: torch.dtype, device: torch.device
                     ) -> Optional[torch.Tensor]:
    """`window_mask` in the layout of `_flash_queries` (None: no mask)."""
    if len(spatial) == 2:
        return _block_mask(window_mask, B, h, spatial, window_size, span_pad, segments_per_block, dtype, device)
    if window_mask is None:
        return None
    m = window_mask.to(dtype)
    while m.dim() < 5:
        m = m[None]
    G = _grid(spatial, window_size)[0]
    m = m.expand(B, h, G, m.shape[3], m.shape[4])
    return m.reshape(B * h, G, m.shape[3], m.shape[4])


def _row_halves_apply(spatial: List[int], window_size: int, span_pad: Optional[int], segments_per_block: int
                      ) -> bool:
    """Whether the 2D flash backward runs on the two row halves of the spans (`_SpanAttention._row_halves_backward`):
    blocks of one segment whose span is two segments high and wide (K = 2w, s = w / 2: CvT-LS's stages 1 and 2)."""
    if len(spatial) != 2 or segments_per_block != 1:
        return False
    _, span = window_span(window_size, span_pad)
    return span == 2 * window_size


def _full_mask(window_mask: Optional[torch.Tensor], num_shared: int, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """[0 on the shared keys | window_mask] over all keys, (..., S + K^ndim)."""
    if window_mask is None:
        return None
    return F.pad(window_mask.to(dtype), (num_shared, 0))


def _segment_matmul(a_shared: torch.Tensor, a_span: torch.Tensor, b_shared: torch.Tensor, b_span: torch.Tensor
                    ) -> torch.Tensor:
    """[a_shared | a_span] @ [b_shared; b_span] per segment, the shared part as one matmul over all segments.

    a_*: (B, h, n, L, S) and (B, h, n, L, K); b_*: (B, h, S, d) (the same for every segment) and (B, h, n, K, d).
    Returns (B, h, n, L, d).
    """
    out = torch.matmul(a_span, b_span)
    if b_shared.shape[-2] > 0:
        B, h, n, L, S = a_shared.shape
        out += torch.matmul(a_shared.reshape(B, h, n * L, S), b_shared).view(out.shape)
    return out


def _scores_softmax(q_t: torch.Tensor, k_shared: torch.Tensor, k_span: torch.Tensor, mask: Optional[torch.Tensor],
                    scale: float) -> torch.Tensor:
    """softmax(q [k_shared; k_span]^T * scale + mask) in fp32 (fp64 stays fp64): (B, h, n, L, S + K^ndim).

    The scores against the shared keys (the same for every segment) are one matmul over all queries, instead of a
    copy of the shared keys in every segment's keys.

    Args:
        q_t: Segments of queries (B, h, n, L, d).
        k_shared: (B, h, S, d).
        k_span: (B, h, n, K^ndim, d).
        mask: Additive mask over [shared | span] keys, broadcastable to the scores, or None.
    """
    B, h, n, L, d = q_t.shape
    scores = torch.matmul(q_t, k_span.transpose(-1, -2))
    S = k_shared.shape[-2]
    if S > 0:
        shared = torch.matmul(q_t.reshape(B, h, n * L, d), k_shared.transpose(-1, -2)).view(B, h, n, L, S)
        scores = torch.cat([shared, scores], dim=-1)
    if scores.dtype in (torch.float16, torch.bfloat16):
        scores = scores.float()
    scores.mul_(scale)
    if mask is not None:
        scores.add_(mask)
    return scores.softmax(dim=-1)


def _flash_mask(mask: Optional[torch.Tensor], h: int, n: int) -> Optional[torch.Tensor]:
    """A (B or 1, h, n, L or 1, S + K^ndim) mask as (B or 1, h * n, L or 1, S + K^ndim), the flash kernel's layout."""
    if mask is None:
        return None
    mask = mask.expand(mask.shape[0], h, n, mask.shape[-2], mask.shape[-1])
    return mask.reshape(mask.shape[0], h * n, mask.shape[-2], mask.shape[-1])


def _span_forward(
        q: torch.Tensor,
        kv: torch.Tensor,
        kv_shared: torch.Tensor,
        window_mask: Optional[torch.Tensor],
        window_size: int,
        scale: float,
        dropout_p: float,
        span_pad: Optional[int] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The attention itself (no autograd needed). Returns the output (B, *spatial, h, d) and the dropout keep-mask
    (None without dropout)."""
    spatial = list(q.shape[2:-1])
    q_t = _tile_queries(q, window_size)
    num_shared = kv_shared.shape[3]
    mask = _full_mask(window_mask, num_shared, q.dtype)
    B, h, n, L, d = q_t.shape
    keep: Optional[torch.Tensor] = None
    # segments of at most 16 queries run as batched matmuls on CPU: SDPA's flash kernel costs a few microseconds per
    # (batch x head x segment) block, which dominates when a block is 4 queries against ~20 keys (w = 2: 2.4 ms
    # against 0.6 ms, CvT-LS stage 3 at 384 px on 2 cores); with dropout the matmul path keeps the dropout mask
    if dropout_p == 0. and (q.device.type != 'cpu' or L > 16):
        keys = _gather_keys(kv, kv_shared, window_size, span_pad)
        out = scaled_dot_product_attention(
            q_t.reshape(B, h * n, L, d), keys[0].reshape(B, h * n, -1, d), keys[1].reshape(B, h * n, -1, d),
            attn_mask=_flash_mask(mask, h, n), scale=scale).reshape(B, h, n, L, d)
    else:
        span = _gather_spans(kv, window_size, span_pad)
        attn = _scores_softmax(q_t, kv_shared[0], span[0], mask, scale)
        if dropout_p > 0.:
            keep = torch.rand_like(attn) >= dropout_p
            attn = attn * keep / (1. - dropout_p)
        attn = attn.to(q.dtype)
        out = _segment_matmul(attn[..., :num_shared], attn[..., num_shared:], kv_shared[1], span[1])
    return _untile(out, spatial, window_size), keep


def _join_shared(q_rows: torch.Tensor, kv_shared: torch.Tensor, out_span: torch.Tensor, lse_span: torch.Tensor,
                 scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Join the span attention (output and log-sum-exp of every query, from the flash kernel) with the attention to
    the shared keys into the joint softmax's output and log-sum-exp.

    Args:
        q_rows: Queries (B, h, R, d), in any order.
        kv_shared: (2, B, h, S, d), S > 0.
        out_span: (B, h, R, d); lse_span: (B, h, R), in the order of q_rows.

    Returns:
        The joint output (B, h, R, d) in the dtype of q and log-sum-exp (B, h, R) in lse_span's dtype.
    """
    scores = torch.matmul(q_rows, kv_shared[0].transpose(-1, -2)).to(lse_span.dtype)
    scores.mul_(scale)
    lse_shared = torch.logsumexp(scores, dim=-1)
    lse = torch.logaddexp(lse_span, lse_shared)
    attn = scores.sub_(lse[..., None]).exp_()  # joint weights of the shared keys
    out = torch.matmul(attn.to(q_rows.dtype), kv_shared[1])
    # + the span output, weighted by its share of the joint softmax
    out = out.to(lse.dtype).addcmul_(out_span.to(lse.dtype), (lse_span - lse).exp_()[..., None])
    return out.to(q_rows.dtype), lse


def _use_flash(q: torch.Tensor, window_size: int, dropout_p: float, needs_mask_grad: bool) -> bool:
    """Whether a training step runs on fused attention kernels that keep one log-sum-exp per query (forward and
    backward without a score buffer): without dropout (the CPU kernel has none), without a gradient for the mask
    (neither kernel gives one), in 2D on blocks of segments (`block_segments`, widths by estimated work), in 1D for
    segments of more than 16 queries (on CPU, segments of 16 and 4 queries took 1.25-1.9x the time of the
    batched-matmul backward on 2 cores; not yet measured on CUDA, so the same rule). CPU runs its flash kernels; CUDA
    the memory-efficient ones where they take the dtype and head dim (`efficient_kernel_takes`; float64 stays with
    the batched matmuls there); neither where the installed torch changed their schemas (`_private_sdpa`)."""
    if dropout_p != 0. or needs_mask_grad or (q.dim() == 4 and window_size <= 16):
        return False
    if q.device.type == 'cuda' and not efficient_kernel_takes(q.dtype, q.shape[-1]):
        return False
    return fused_kernels_available(q.device.type)


def _heads(tokens: torch.Tensor, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, *spatial, h * d) tokens -> (B, h, *spatial, d), a view where the dtype is already `dtype`."""
    return tokens.unflatten(-1, (num_heads, tokens.shape[-1] // num_heads)).movedim(-2, 1).to(dtype)


class _SpanAttention(torch.autograd.Function):
    """`span_attention` with a backward that recomputes the gathered spans instead of keeping them.

    With `kv` None, the keys and values are `k_norm`, `v_norm` = LN_L(k_raw), LN_L(v_raw) as tokens
    (`span_attention_local_norm`): only the raw ones are kept, and the backward normalizes them again.
    """

    @staticmethod
    def forward(ctx, q, kv, kv_shared, window_mask, window_size: int, scale: float, dropout_p: float,
                span_pad: Optional[int], k_norm, v_norm, k_raw, v_raw, norm_weight, norm_bias, norm_eps: float):
        ctx.window_size, ctx.scale, ctx.dropout_p, ctx.span_pad = window_size, scale, dropout_p, span_pad
        needs_mask_grad = window_mask is not None and window_mask.requires_grad
        ctx.flash = _use_flash(q, window_size, dropout_p, needs_mask_grad)
        ctx.local_norm, ctx.norm_eps = kv is None, norm_eps
        kv_saved = kv  # None with the local norm: the raw keys and values are kept instead
        if kv is None:
            k, v = _heads(k_norm, q.shape[1], q.dtype), _heads(v_norm, q.shape[1], q.dtype)
        else:
            k, v = kv[0], kv[1]
        ctx.q_shape = q.shape
        raw = (k_raw, v_raw, norm_weight, norm_bias)
        if ctx.flash:
            # the fused kernel (`fused_attention`) keeps the log-sum-exp of every query's scores: its backward
            # recomputes P blockwise from it, without a (queries x keys) buffer. It runs on the spans only (in 2D, on
            # blocks of segments whose keys are strided views of one column gather); the shared keys are scored once
            # over all queries, and the two parts join through their log-sum-exps (the joint softmax, exactly)
            spatial = list(q.shape[2:-1])
            B, h, d = q.shape[0], q.shape[1], q.shape[-1]
            # blocks of c segments along x in 2D (1D runs on segments)
            c = ctx.segments_per_block = block_segments(
                window_size, _grid(spatial, window_size)[1], span_pad) if len(spatial) == 2 else 1
            q_f = _flash_queries(q, window_size, c)
            keys = _flash_keys(k, v, window_size, span_pad, c)
            out, lse = fused_attention(q_f, keys[0], keys[1], _flash_attn_mask(
                window_mask, B, h, spatial, window_size, span_pad, c, q.dtype, q.device), scale)
            del keys
            if kv_shared.shape[3] > 0:
                rows = (B, h, q_f.numel() // (B * h * d))
                lse_q = lse[..., :q_f.shape[-2]]  # the kernel's own buffer: the joint log-sum-exp goes back in it
                out, lse_joint = _join_shared(q_f.reshape(rows + (d,)), kv_shared, out.reshape(rows + (d,)),
                                              lse_q.reshape(rows), scale)
                lse_q.copy_(lse_joint.view(lse_q.shape))
            out = _flash_to_tokens(out.reshape(q_f.shape), B, h, spatial, window_size, c)
            # the queries are kept in the kernel's layout (q itself is kept by nothing else, so no more memory); the
            # output as returned: the output projection keeps the same storage for its own backward
            ctx.save_for_backward(q_f, kv_saved, kv_shared, window_mask, *raw, out, lse)
            return out
        out, keep = _span_forward(q, torch.stack([k, v]) if kv is None else kv, kv_shared, window_mask, window_size,
                                  scale, dropout_p, span_pad)
        ctx.save_for_backward(q, kv_saved, kv_shared, window_mask, *raw, keep)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        with autocast_off(grad_out.device.type):
            saved = ctx.saved_tensors
            q, kv, kv_shared, window_mask, k_raw, v_raw, norm_weight, norm_bias = saved[:8]  # q: in blocks if flash
            if kv is None:  # LN_L again, as in forward
                k, v = local_norm_tokens(k_raw, v_raw, norm_weight, norm_bias, ctx.norm_eps)
                k, v = _heads(k, ctx.q_shape[1], q.dtype), _heads(v, ctx.q_shape[1], q.dtype)
            else:
                k, v = kv[0], kv[1]
            # the spans are all the backward needs of k and v: recomputed ones are freed before the attention
            # backward, and the spans go in a list that the backward empties, so that it can free them when done
            spans = [_flash_keys(k, v, ctx.window_size, ctx.span_pad, ctx.segments_per_block) if ctx.flash
                     else _gather_spans(torch.stack([k, v]) if kv is None else kv, ctx.window_size, ctx.span_pad)]
            del k, v, kv
            if ctx.flash:
                grad_q, grad_k, grad_v, grad_shared = _SpanAttention._flash_backward(
                    ctx, grad_out, q, spans, kv_shared, window_mask, saved[8], saved[9])
                grad_mask = None
            else:
                grad_q, grad_k, grad_v, grad_shared, grad_mask = _SpanAttention._backward(
                    ctx, grad_out, q, spans, kv_shared, window_mask, saved[8])
            grad_kv = grad_k_norm = grad_v_norm = None
            if ctx.local_norm:  # as tokens, the normalized keys' and values' layout
                grad_k_norm, grad_v_norm = grad_k.movedim(1, -2).flatten(-2), grad_v.movedim(1, -2).flatten(-2)
            else:
                grad_kv = torch.stack([grad_k, grad_v])
        return (grad_q, grad_kv, grad_shared, grad_mask, None, None, None, None, grad_k_norm, grad_v_norm,
                None, None, None, None, None)

    @staticmethod
    def _flash_backward(ctx, grad_out, q_f, spans: List[torch.Tensor], kv_shared, window_mask, out, lse):
        """The flash path's backward, given the queries in the flash layout (`_flash_queries`, as saved) and the keys
        and values in it (popped from `spans`, from `_flash_keys`): gradients of q, the map's k and v, and the shared
        keys."""
        keys = spans.pop()
        ws, span_pad, scale, c = ctx.window_size, ctx.span_pad, ctx.scale, ctx.segments_per_block
        spatial = list(ctx.q_shape[2:-1])
        B, h, d = ctx.q_shape[0], ctx.q_shape[1], ctx.q_shape[-1]
        num_shared = kv_shared.shape[3]
        go = _flash_queries(grad_out.to(q_f.dtype).movedim(-2, 1), ws, c)
        out_f = _flash_queries(out.movedim(-2, 1), ws, c)
        # with the joint log-sum-exp and output, the kernel's P and rowsum(dO * O) are those of the joint softmax:
        # its gradients of the span keys and its part of dq are exact
        if _row_halves_apply(spatial, ws, span_pad, c):
            grad_q, grad_k, grad_v = _SpanAttention._row_halves_backward(ctx, go, q_f, keys, window_mask, out_f, lse)
        else:
            grad_q, grad_k, grad_v = fused_attention_backward(
                go, q_f, keys[0], keys[1], _flash_attn_mask(window_mask, B, h, spatial, ws, span_pad, c, q_f.dtype,
                                                            q_f.device), out_f, lse, scale)
            grad_k = _flash_fold(grad_k, B, h, spatial, ws, span_pad, c)
            grad_v = _flash_fold(grad_v, B, h, spatial, ws, span_pad, c)
        del keys
        grad_shared = kv_shared.new_zeros(kv_shared.shape)
        if num_shared > 0:
            # the shared keys' part: P = exp(s - lse), dS = P (dP - rowsum(dO * O)), as matmuls over all queries
            rows = (B, h, q_f.numel() // (B * h * d))
            q_rows, go_rows = q_f.reshape(rows + (d,)), go.reshape(rows + (d,))
            lse = lse[..., :q_f.shape[-2]].reshape(rows)
            attn = torch.matmul(q_rows, kv_shared[0].transpose(-1, -2)).to(lse.dtype).mul_(scale)
            attn = attn.sub_(lse[..., None]).exp_()  # (B, h, R, S)
            delta = (go_rows * out_f.reshape(rows + (d,))).sum(-1, keepdim=True, dtype=lse.dtype)
            grad_scores = torch.matmul(go_rows, kv_shared[1].transpose(-1, -2)).to(lse.dtype)
            grad_scores = grad_scores.sub_(delta).mul_(attn).mul_(scale).to(q_f.dtype)
            grad_q = grad_q.reshape(rows + (d,)) + torch.matmul(grad_scores, kv_shared[0])
            grad_shared[0] = torch.matmul(grad_scores.transpose(-1, -2), q_rows)
            grad_shared[1] = torch.matmul(attn.to(q_f.dtype).transpose(-1, -2), go_rows)
        grad_q = _flash_to_tokens(grad_q.reshape(q_f.shape), B, h, spatial, ws, c).movedim(-2, 1)
        return grad_q, grad_k, grad_v, grad_shared

    @staticmethod
    def _row_halves_backward(ctx, go, q_f, keys, window_mask, out_f, lse):
        """The span keys' part of the 2D flash backward for spans two segments wide (`_row_halves_apply`), one kernel
        call per row half of the spans. On whole spans (K x K keys a segment, from `_gather_block_keys`) the kernel
        returns key and value gradients in that layout, each key 4 times over, on top of the map's own; half a of
        segment (i, j)'s span is rows (i + a) * w.. of column strip j, a slice of the same gather, and no row of
        a strip serves two segments within a half, so each call's gradients are twice the map and are added onto it
        in place (`_add_blocks`). With the joint log-sum-exp and output, each call's P is the joint softmax's on its
        keys: its key gradients are exact and the calls' dq parts sum to the spans'.

        Args:
            keys: The keys and values of the blocks (`_gather_block_keys` with c = 1), (2, B * h * gx, gy, K * K, d).

        Returns:
            dq in the flash layout, and the map's dk and dv: (B, h, H, W, d) views of padded token-layout maps (B,
            H', W', h, d), the layout LN_L's backward reads.
        """
        ws, span_pad, scale = ctx.window_size, ctx.span_pad, ctx.scale
        spatial = list(ctx.q_shape[2:-1])
        B, h, d = ctx.q_shape[0], ctx.q_shape[1], ctx.q_shape[-1]
        pad, span = window_span(ws, span_pad)
        gy, gx = _grid(spatial, ws)
        mask = _flash_attn_mask(window_mask, B, h, spatial, ws, span_pad, 1, q_f.dtype, q_f.device)
        # the map's gradients, padded as the gather pads the keys: half a of block (y, x) holds padded rows
        # (y + a) * w + [0, w) and columns x * w + [0, 2w)
        grad_kv = [_padded_token_map(keys, B, h, (gy + 1) * ws, (gx + 1) * ws) for _ in range(2)]
        grad_q = None
        for a in range(2):
            rows_a = slice(a * ws * span, (a + 1) * ws * span)  # the half's keys: rows a * w.. of the K x K span
            half_mask = None if mask is None else mask[..., rows_a]
            gq, gk, gv = fused_attention_backward(go, q_f, keys[0, :, :, rows_a], keys[1, :, :, rows_a], half_mask,
                                                    out_f, lse, scale)
            grad_q = gq if grad_q is None else grad_q.add_(gq)
            for target, g in zip(grad_kv, (gk, gv)):
                _add_blocks(target.narrow(2, a * ws, gy * ws), g.reshape(B, h, gx, gy, ws, span, d), ws, ws)
            del gq, gk, gv
        grad_k, grad_v = (t[:, :, pad:pad + spatial[0], pad:pad + spatial[1]] for t in grad_kv)
        return grad_q, grad_k, grad_v

    @staticmethod
    def _backward(ctx, grad_out, q, spans: List[torch.Tensor], kv_shared, window_mask, keep):
        """The batched-matmul backward, given the gathered spans (popped from `spans`): gradients of q, the map's k
        and v, the shared keys and the mask."""
        span = spans.pop()
        grad_out = grad_out.to(q.dtype)
        ws, scale, dropout_p, span_pad = ctx.window_size, ctx.scale, ctx.dropout_p, ctx.span_pad
        spatial = list(q.shape[2:-1])
        dtype = q.dtype
        q_t = _tile_queries(q, ws)
        B, h, n, L, d = q_t.shape
        num_shared = kv_shared.shape[3]
        attn = _scores_softmax(q_t, kv_shared[0], span[0], _full_mask(window_mask, num_shared, dtype), scale)  # P
        go = _tokens_to_segments(grad_out, ws)  # (B, h, n, L, d)
        attn_used = (attn if keep is None else attn * keep / (1. - dropout_p)).to(dtype)
        # the shared keys' part of every product is one matmul over all queries (their rows: n * L)
        go_rows = go.reshape(B, h, n * L, d)
        grad_v = torch.matmul(attn_used[..., num_shared:].transpose(-1, -2), go)
        grad_v_shared = torch.matmul(attn_used[..., :num_shared].reshape(B, h, n * L, num_shared).transpose(-1, -2),
                                     go_rows)
        del attn_used
        # dS = P * (dP - rowsum(P * dP)), dP the gradient of the (pre-dropout) weights
        grad_attn = torch.matmul(go, span[1].transpose(-1, -2))
        if num_shared > 0:
            grad_attn = torch.cat([torch.matmul(go_rows, kv_shared[1].transpose(-1, -2)).view(
                B, h, n, L, num_shared), grad_attn], dim=-1)
        if grad_attn.dtype != attn.dtype:
            grad_attn = grad_attn.to(attn.dtype)
        if keep is not None:
            grad_attn = grad_attn * keep / (1. - dropout_p)
        grad_attn.sub_((grad_attn * attn).sum(-1, keepdim=True)).mul_(attn)
        del attn
        grad_mask = None
        if window_mask is not None and ctx.needs_input_grad[3]:
            grad_mask = grad_attn[..., num_shared:]
            # sum over the dims the mask was broadcast along
            lead = grad_mask.dim() - window_mask.dim()
            if lead > 0:
                grad_mask = grad_mask.sum(dim=list(range(lead)))
            dims = [i for i in range(window_mask.dim()) if window_mask.shape[i] == 1 and grad_mask.shape[i] != 1]
            if dims:
                grad_mask = grad_mask.sum(dim=dims, keepdim=True)
            # a copy: without a broadcast dim to sum, grad_mask is a view of grad_attn, scaled in place below
            grad_mask = grad_mask.to(window_mask.dtype, copy=True)
        grad_scores = grad_attn.mul_(scale).to(dtype)
        grad_scores_shared, grad_scores = grad_scores[..., :num_shared], grad_scores[..., num_shared:]
        grad_q = _segment_matmul(grad_scores_shared, grad_scores, kv_shared[0], span[0])
        grad_k = torch.matmul(grad_scores.transpose(-1, -2), q_t)
        grad_k_shared = torch.matmul(grad_scores_shared.reshape(B, h, n * L, num_shared).transpose(-1, -2),
                                     q_t.reshape(B, h, n * L, d))
        del grad_scores, grad_scores_shared, span
        grad_k = _fold_spans(grad_k, spatial, ws, span_pad)
        grad_v = _fold_spans(grad_v, spatial, ws, span_pad)
        grad_shared = torch.stack([grad_k_shared, grad_v_shared])
        grad_q = _untile(grad_q, spatial, ws).movedim(-2, 1)  # (B, h, *spatial, d)
        return grad_q, grad_k, grad_v, grad_shared, grad_mask


def span_attention(
        q: torch.Tensor,
        kv: torch.Tensor,
        kv_shared: torch.Tensor,
        window_mask: Optional[torch.Tensor],
        window_size: int,
        scale: float,
        dropout_p: float = 0.,
        span_pad: Optional[int] = None,
) -> torch.Tensor:
    """Segment-wise window attention of a 1D or 2D map to [shared keys | its key span], one joint softmax.

    Args:
        q: Queries (B, h, *spatial, d), spatial = (n,) or (H, W); any strides (views are not copied for backward).
        kv: Keys and values of the map (2, B, h, *spatial, d).
        kv_shared: Keys and values every segment sees (2, B, h, S, d); S may be 0.
        window_mask: Additive mask of the span keys, broadcastable to (B, h, num_segments, w^ndim, K^ndim) with
            the segments in row-major order (-inf on padded keys, a bias; it may require grad), or None.
        window_size: Segment size w per axis.
        scale: Score scale.
        dropout_p: Dropout on the joint attention weights (pass 0 in eval).
        span_pad: Keys s on each side of a segment's span, K = w + 2s (None: max(w // 2, 1), the overlapping
            windows of long-short attention; 0: non-overlapping windows, K = w).

    Returns:
        Outputs (B, *spatial, h, d) (token order with the heads last, ready for the output projection).
        Softmax in fp32 for fp16/bf16 inputs.
    """
    if torch.jit.is_scripting():
        return _span_forward(q, kv, kv_shared, window_mask, window_size, scale, dropout_p, span_pad)[0]
    # a captured graph (torch.export, torch.jit.trace as fvcore runs it) takes the plain forward (`captures_graph`)
    needs_grad = torch.is_grad_enabled() and not captures_graph() and (
        q.requires_grad or kv.requires_grad or kv_shared.requires_grad
        or (window_mask is not None and window_mask.requires_grad))
    if not needs_grad:
        return _span_forward(q, kv, kv_shared, window_mask, window_size, scale, dropout_p, span_pad)[0]
    # one dtype for every input (under autocast, its dtype): the backward runs outside autocast
    dtype = autocast_dtype(q)
    q, kv, kv_shared = q.to(dtype), kv.to(dtype), kv_shared.to(dtype)
    with autocast_off(q.device.type):
        return _SpanAttention.apply(q, kv, kv_shared, window_mask, window_size, scale, dropout_p, span_pad,
                                    None, None, None, None, None, None, 0.)


@torch.jit.unused  # training only (TorchScript runs `span_attention`)
def span_attention_local_norm(
        q: torch.Tensor,
        k_norm: torch.Tensor,
        v_norm: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        norm_weight: Optional[torch.Tensor],
        norm_bias: Optional[torch.Tensor],
        norm_eps: float,
        kv_shared: torch.Tensor,
        window_mask: Optional[torch.Tensor],
        window_size: int,
        scale: float,
        dropout_p: float = 0.,
        span_pad: Optional[int] = None,
) -> torch.Tensor:
    """`span_attention` of the keys and values after a LayerNorm over their channels (LN_L), for training.

    The same as ``span_attention(q, k_norm, v_norm heads first, ...)``, but autograd keeps k and v, the keys and values
    before the norm (in the long-short layers, views of the q, k, v projections that are kept anyway), instead of the
    normalized ones: the backward normalizes them again (`lsvision.layers.local_norm`) and returns the gradients of
    `k_norm` and `v_norm`, for LN_L's own backward.

    Args:
        q: Queries (B, h, *spatial, d).
        k_norm, v_norm: LN_L(k), LN_L(v) (`local_norm.local_norm_tokens`, in k's dtype), (B, *spatial, h * d).
        k, v: Keys and values before LN_L, as tokens (B, *spatial, h * d); any strides.
        norm_weight, norm_bias, norm_eps: LN_L's parameters.
        Others: as `span_attention`.

    Returns:
        Outputs (B, *spatial, h, d).
    """
    dtype = autocast_dtype(q)
    with autocast_off(q.device.type):
        return _SpanAttention.apply(q.to(dtype), None, kv_shared.to(dtype), window_mask, window_size, scale,
                                    dropout_p, span_pad, k_norm, v_norm, k, v, norm_weight, norm_bias, norm_eps)
