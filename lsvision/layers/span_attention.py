"""Segment-wise window attention over key spans: the core of the 1D and 2D long-short layers and of HSW.

Queries are cut into segments of w positions per axis (w in 1D, w x w in 2D, the map zero-padded to whole segments).
Each segment attends, in one joint softmax, to

  * S shared keys (the dynamic projection, prefix or global tokens), the same for every segment, and
  * the keys of its span: K = w + 2s positions per axis around it (s = max(w // 2, 1) by default, the long-short
    layers' overlapping windows; s = 0 gives non-overlapping windows, K = w, as Swin's), zero-padded at the border;
    the additive `window_mask` (`softmax.mask_value` on padded keys, a relative-position bias) acts on these.

`span_attention_reference` states this math as masked full attention (written for clarity; the fast paths are tested
against it). `span_attention` computes it without a (queries x all keys) buffer:

  * Autograd through a gather of the spans would keep the gathered copy for the backward pass: (K / w)^2 ~ 4 copies
    of every key and value in 2D. `_SpanAttention` keeps only what it is given (q, k and v in their own layout, views
    of tensors the layer keeps anyway) and, where dropout is on, the dropout mask; its backward gathers the spans
    again (`span_segments`) and runs the attention backward as batched matmuls over the whole batch (P recomputed
    from the scores, as flash attention does), then folds the span gradients back onto the map with a few strided
    adds. The shared keys are never copied per segment: their scores, and their part of every product, are one
    matmul over all queries.
  * Training runs on fused attention kernels instead where it can (`span_fused`: CPU's flash-attention kernels,
    CUDA's memory-efficient ones, on the spans only, in 2D on blocks of segments, `span_blocks`; the shared part
    joins through the log-sum-exps).
  * Without gradients (inference, TorchScript) the same forward runs with no autograd at all (`_span_forward`).

The size thresholds that pick these paths are in `tuning`, with the measurements that chose them.

Written for lsvision, Apache-2.0.
"""
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from .autocast import autocast_dtype, autocast_off
from .export import training_paths_enabled
from .local_norm import local_norm_tokens
from .matmul_attention import scaled_dot_product_attention
from .softmax import softmax_dtype
from .span_blocks import _flash_keys, block_segments
from .span_fused import _flash_backward, _flash_forward, _use_flash
from .span_segments import (
    _fold_spans,
    _gather_keys,
    _gather_spans,
    _grid,
    _tile_queries,
    _tokens_to_segments,
    _untile,
    span_window_key_mask,
    window_span,
)
from .tuning import SPAN_MATMUL_MAX_QUERIES

__all__ = ['window_span', 'block_segments', 'span_attention', 'span_attention_local_norm', 'span_window_key_mask',
           'span_attention_reference']


def span_attention_reference(
        q: torch.Tensor,
        kv: torch.Tensor,
        kv_shared: torch.Tensor,
        window_mask: Optional[torch.Tensor],
        window_size: int,
        scale: float,
        span_pad: Optional[int] = None,
        keep: Optional[torch.Tensor] = None,
        dropout_p: float = 0.,
) -> torch.Tensor:
    """`span_attention` as masked full attention, written for clarity, not speed (fp64 gives a tight reference).

    Every query attends, in one softmax, to the S shared keys and to every position of the zero-padded map (s before
    each axis, whole segments + s after; zero keys and values outside the map). The additive mask holds, on the K^ndim
    keys of the query's span, `window_mask`'s entry (segment, query offset in the segment, key offset in the span),
    and -inf on every other map key: those are no keys of this query at all (a finite value would let them in where
    `window_mask` masks the whole span, as for the padded queries of the 1D layer).

    Args:
        keep: Dropout keep-mask of the joint weights, (B, h, num_segments, w^ndim, S + K^ndim) (`_span_forward`'s),
            the kept weights scaled by 1 / (1 - dropout_p); None: no dropout.
        Others: as `span_attention`.

    Returns:
        Outputs (B, *spatial, h, d).
    """
    B, h, d = q.shape[0], q.shape[1], q.shape[-1]
    spatial = list(q.shape[2:-1])
    ws, S = window_size, kv_shared.shape[3]
    pad, span = window_span(ws, span_pad)
    grid = _grid(spatial, ws)
    segment, offset, key_offset, in_span = _span_structure(grid, ws, pad, span, q.device)
    key_offset = key_offset.clamp(0, span ** len(spatial) - 1)  # outside the span: any entry, masked below
    queries = F.pad(q, [0, 0] + [p for n, g in zip(spatial[::-1], grid[::-1]) for p in (0, g * ws - n)])
    keys = F.pad(kv, [0, 0] + [p for n, g in zip(spatial[::-1], grid[::-1]) for p in (pad, g * ws + pad - n)])
    queries, keys = queries.reshape(B, h, -1, d), keys.reshape(2, B, h, -1, d)
    scores = torch.cat([queries @ kv_shared[0].transpose(-1, -2), queries @ keys[0].transpose(-1, -2)], -1) * scale
    m = q.new_zeros(1) if window_mask is None else window_mask
    m = m.reshape((1,) * (5 - m.dim()) + m.shape)
    m = m.expand(m.shape[0], m.shape[1], len(segment) // ws ** len(spatial), ws ** len(spatial), span ** len(spatial))
    map_mask = m[:, :, segment[:, None], offset[:, None], key_offset].masked_fill(~in_span, float('-inf'))
    attn = (scores + F.pad(map_mask, (S, 0))).softmax(-1)
    if keep is not None:
        keep_shared = keep[:, :, segment, offset, :S]
        keep_span = keep[:, :, segment[:, None], offset[:, None], S + key_offset]
        attn = attn * torch.cat([keep_shared, keep_span], -1) / (1. - dropout_p)
    out = attn @ torch.cat([kv_shared[1], keys[1]], 2)  # (B, h, queries of whole segments, d)
    out = out.reshape([B, h] + [g * ws for g in grid] + [d])[(slice(None), slice(None)) + tuple(map(slice, spatial))]
    return out.movedim(1, -2)


def _span_structure(grid: List[int], window_size: int, pad: int, span: int, device: torch.device
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For every query of the map padded to whole segments (row-major) and every key of the zero-padded map: the
    query's segment and offset in it (row-major), the key's offset in the query's span (row-major over K^ndim, where
    it lies in the span) and whether it does, per axis combined: (Q,), (Q,), (Q, keys), (Q, keys)."""
    segment = offset = key_offset = in_span = None
    for g in grid:
        query = torch.arange(g * window_size, device=device)
        key = torch.arange(g * window_size + 2 * pad, device=device)
        axis_offset = key[None] - (query // window_size * window_size)[:, None]  # key p's offset in query's span
        axis_in = (axis_offset >= 0) & (axis_offset < span)
        if segment is None:
            segment, offset, key_offset, in_span = query // window_size, query % window_size, axis_offset, axis_in
        else:  # the earlier axes outer
            segment = (segment[:, None] * g + query[None] // window_size).flatten()
            offset = (offset[:, None] * window_size + query[None] % window_size).flatten()
            key_offset = (key_offset[:, None, :, None] * span + axis_offset[None, :, None]).flatten(0, 1).flatten(1)
            in_span = (in_span[:, None, :, None] & axis_in[None, :, None]).flatten(0, 1).flatten(1)
    return segment, offset, key_offset, in_span


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
    scores = scores.to(softmax_dtype(scores.dtype))  # the scale and the mask in that dtype too
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
        matmul_max_queries: int = SPAN_MATMUL_MAX_QUERIES,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The attention itself (no autograd needed). Returns the output (B, *spatial, h, d) and the dropout keep-mask
    (None without dropout). `matmul_max_queries` is `tuning.SPAN_MATMUL_MAX_QUERIES` (an argument: TorchScript reads
    no module-level int)."""
    spatial = list(q.shape[2:-1])
    q_t = _tile_queries(q, window_size)
    num_shared = kv_shared.shape[3]
    mask = _full_mask(window_mask, num_shared, q.dtype)
    B, h, n, L, d = q_t.shape
    keep: Optional[torch.Tensor] = None
    # small segments run as batched matmuls on CPU (SDPA's flash kernel costs a few microseconds per block); with
    # dropout the matmul path keeps the dropout mask
    if dropout_p == 0. and (q.device.type != 'cpu' or L > matmul_max_queries):
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
            # the fused kernels keep the log-sum-exp of every query's scores, not a (queries x keys) buffer
            # (`span_fused`); the queries are kept in the kernel's layout (q itself is kept by nothing else, so no
            # more memory); the output as returned: the output projection keeps the same storage for its own backward
            out, q_f, lse, ctx.layout = _flash_forward(q, k, v, kv_shared, window_mask, window_size, scale, span_pad)
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
            spans = [_flash_keys(k, v, ctx.window_size, ctx.span_pad, ctx.layout.segments_per_block) if ctx.flash
                     else _gather_spans(torch.stack([k, v]) if kv is None else kv, ctx.window_size, ctx.span_pad)]
            del k, v, kv
            if ctx.flash:
                grad_q, grad_k, grad_v, grad_shared = _flash_backward(
                    ctx.layout, grad_out, q, spans, kv_shared, window_mask, saved[8], saved[9])
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
            the segments in row-major order (`mask_value` on padded keys, a bias; it may require grad), or None.
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
    # a captured graph (torch.export, torch.jit.trace as fvcore runs it) takes the plain forward
    needs_grad = training_paths_enabled() and (
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
