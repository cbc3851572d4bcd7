"""Blocks of segments for span attention on fused attention kernels (the training path, `span_fused`).

In 2D, a fused kernel call runs one block of c segments along x (`block_segments`: the width of least estimated
work): the block's w x c * w queries (`_map_to_blocks`) against K rows x Wc = c * w + 2s columns of keys, strided
views of one gather of column strips (`_gather_block_keys`; its adjoint `_fold_block_keys`), with a band mask that
keeps each query to its own segment's K x K span (`_block_mask`). In 1D, segments run as they are, their spans
strided views of the padded map (`_strided_spans_1d`). The `_flash_*` functions pick the 1D or the 2D layout.

Written for lsvision, Apache-2.0.
"""
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from .softmax import mask_value
from .span_segments import _fold_blocks, _fold_spans, _grid, _tile_queries, _untile, window_span
from .tuning import SPAN_BLOCK_COST_PAIRS

__all__ = ['block_segments']


def block_segments(window_size: int, grid_x: int, span_pad: Optional[int] = None) -> int:
    """Segments per block (c) along x in the 2D training path on the fused kernels.

    A block of c segments holds w x c * w queries; its keys are K rows x Wc = c * w + 2s columns, against the K x K
    that each query sees, so wider blocks waste key work, while every block costs the kernel a fixed overhead
    (`tuning.SPAN_BLOCK_COST_PAIRS`, with the measurements that chose it), and the segments that pad the last block
    cost as much as real ones. The width is the c in 1..gx with the least estimated work, nx * (overhead + w * c * w *
    K * Wc) over the nx = ceil(gx / c) blocks of a row (ties: the narrower). Larger windows (w >= 4) keep c = 1.

    Args:
        window_size: Segment size w.
        grid_x: Segments across the map, gx.
        span_pad: Key padding s of the span (`window_span`).
    """
    pad, span = window_span(window_size, span_pad)

    def work(c: int) -> int:
        pairs = window_size * c * window_size * span * (c * window_size + 2 * pad)  # queries x keys of a block
        return -(-grid_x // c) * (SPAN_BLOCK_COST_PAIRS + pairs)

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
    (broadcastable to (B, h, num_segments, w^2, K^2)); `mask_value` elsewhere. The queries of the segments that pad the
    last x block see every key (0), so that no row is all masked; their outputs are dropped and their gradients are
    zero.
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
    # padded with the mask value to Wc + w and the c segments laid end to end, column j of segment t lands at
    # t * (Wc + w) + j = t * Wc + (t * w + j), so cutting that line into rows of Wc places every band (one pad and one
    # cut for any c)
    rows = F.pad(m.permute(0, 1, 2, 3, 5, 6, 4, 7), (0, Wc + ws - span), value=mask_value(dtype))  # (.., c, Wc + w)
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
