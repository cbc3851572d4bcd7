"""Span attention's training path on fused attention kernels: forward and backward without a score buffer.

The fused kernels (`_private_sdpa.fused_attention*`: CPU's flash-attention kernels, CUDA's memory-efficient ones) keep
one log-sum-exp per query; their backward recomputes the weights blockwise from it. They run on the spans only, in
the layout of `span_blocks` (2D: blocks of segments whose keys are strided views of one column gather; 1D: segments
whose spans are strided views of the padded map). The shared keys are scored once over all queries, and the two parts
join through their log-sum-exps, the joint softmax exactly (`_join_shared`). Where a span is two segments wide
(K = 2w) and a block one segment, the backward runs by row halves of the spans (`_row_halves_backward`), so that
the kernel's key gradients are twice the map, not (K / w)^2 = 4 times.

Written for lsvision, Apache-2.0.
"""
from typing import List, NamedTuple, Optional, Tuple

import torch

from ._private_sdpa import efficient_kernel_takes, fused_attention, fused_attention_backward, fused_kernels_available
from .span_blocks import (
    _flash_attn_mask,
    _flash_fold,
    _flash_keys,
    _flash_queries,
    _flash_to_tokens,
    _row_halves_apply,
    block_segments,
)
from .span_segments import _add_blocks, _grid, _padded_token_map, window_span
from .tuning import SPAN_1D_MATMUL_MAX_WINDOW


class FlashLayout(NamedTuple):
    """What the flash backward needs of the forward's shapes: the queries' shape (B, h, *spatial, d), the segment
    size w, the span's key padding s (None: the default), the segments per 2D block c (1 in 1D) and the score scale."""
    q_shape: torch.Size
    window_size: int
    span_pad: Optional[int]
    segments_per_block: int
    scale: float


def _use_flash(q: torch.Tensor, window_size: int, dropout_p: float, needs_mask_grad: bool) -> bool:
    """Whether a training step runs on fused attention kernels that keep one log-sum-exp per query (forward and
    backward without a score buffer): without dropout (the CPU kernel has none), without a gradient for the mask
    (neither kernel gives one), in 2D on blocks of segments (`block_segments`, widths by estimated work), in 1D for
    segments of more than `tuning.SPAN_1D_MATMUL_MAX_WINDOW` queries. CPU runs its flash kernels; CUDA the
    memory-efficient ones where they take the dtype and head dim (`efficient_kernel_takes`; float64 stays with the
    batched matmuls there); neither where the installed torch changed their schemas (`_private_sdpa`)."""
    if dropout_p != 0. or needs_mask_grad or (q.dim() == 4 and window_size <= SPAN_1D_MATMUL_MAX_WINDOW):
        return False
    if q.device.type == 'cuda' and not efficient_kernel_takes(q.dtype, q.shape[-1]):
        return False
    return fused_kernels_available(q.device.type)


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


def _flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_shared: torch.Tensor,
                   window_mask: Optional[torch.Tensor], window_size: int, scale: float, span_pad: Optional[int]
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, FlashLayout]:
    """The joint attention on the fused kernel: the span part in the layout of `span_blocks`, the shared keys joined
    through the log-sum-exps.

    Args:
        q: Queries (B, h, *spatial, d); k, v: keys and values of the map, the same shape, any strides.
        Others: as `span_attention.span_attention`.

    Returns:
        The output (B, *spatial, h, d), the queries in the kernel's layout and the joint log-sum-exp of each query
        (both for the backward), and the layout.
    """
    spatial = list(q.shape[2:-1])
    B, h, d = q.shape[0], q.shape[1], q.shape[-1]
    # blocks of c segments along x in 2D (1D runs on segments)
    c = block_segments(window_size, _grid(spatial, window_size)[1], span_pad) if len(spatial) == 2 else 1
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
    return out, q_f, lse, FlashLayout(q.shape, window_size, span_pad, c, scale)


def _flash_backward(layout: FlashLayout, grad_out: torch.Tensor, q_f: torch.Tensor, spans: List[torch.Tensor],
                    kv_shared: torch.Tensor, window_mask: Optional[torch.Tensor], out: torch.Tensor, lse: torch.Tensor
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The flash path's backward, given the queries in the flash layout (`_flash_queries`, as saved) and the keys
    and values in it (popped from `spans`, from `_flash_keys`): gradients of q, the map's k and v, and the shared
    keys."""
    keys = spans.pop()
    ws, span_pad, scale, c = layout.window_size, layout.span_pad, layout.scale, layout.segments_per_block
    spatial = list(layout.q_shape[2:-1])
    B, h, d = layout.q_shape[0], layout.q_shape[1], layout.q_shape[-1]
    num_shared = kv_shared.shape[3]
    go = _flash_queries(grad_out.to(q_f.dtype).movedim(-2, 1), ws, c)
    out_f = _flash_queries(out.movedim(-2, 1), ws, c)
    # with the joint log-sum-exp and output, the kernel's P and rowsum(dO * O) are those of the joint softmax:
    # its gradients of the span keys and its part of dq are exact
    if _row_halves_apply(spatial, ws, span_pad, c):
        grad_q, grad_k, grad_v = _row_halves_backward(layout, go, q_f, keys, window_mask, out_f, lse)
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


def _row_halves_backward(layout: FlashLayout, go: torch.Tensor, q_f: torch.Tensor, keys: torch.Tensor,
                         window_mask: Optional[torch.Tensor], out_f: torch.Tensor, lse: torch.Tensor
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
    ws, span_pad, scale = layout.window_size, layout.span_pad, layout.scale
    spatial = list(layout.q_shape[2:-1])
    B, h, d = layout.q_shape[0], layout.q_shape[1], layout.q_shape[-1]
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
