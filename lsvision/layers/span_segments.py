"""Segments of a 1D or 2D map and the key spans they attend to, for span attention's batched-matmul path.

A map is cut into segments of w positions per axis (w in 1D, w x w in 2D, zero-padded to whole segments); segment i
sees the K = w + 2s positions per axis from i * w - s (`window_span`), zero vectors outside the map. This module
moves tensors between that layout and the map: queries to segments and back (`_tile_queries`, `_untile`), the keys
and values of every span gathered into one buffer (`_gather_keys`, `_gather_spans`), and the adjoint of the gather,
span gradients summed back onto the map with a few strided adds (`_fold_spans`).

Written for lsvision, Apache-2.0.
"""
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from .softmax import mask_value

__all__ = ['window_span', 'span_window_key_mask']


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
    """Additive mask of the span keys of every segment: `mask_value` on keys outside the map, 0 elsewhere.

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
    return torch.zeros(valid.shape, dtype=dtype, device=device).masked_fill(~valid, mask_value(dtype))


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
