"""Attention as batched matmuls + softmax, for the small blocks where it beats F.scaled_dot_product_attention on CPU.

SDPA's CPU flash kernel costs a few microseconds per (batch x head x query block) and, for blocks of a few dozen
queries, does not speed up with more threads; batched matmuls do. The layers pick this path by device and layer shape
only, where they measured it faster on the 2-core CPU (long-short segments of at most 16 queries, Swin's 49-slot
window memory attention of GRC), never by thread count, so that a model's rounding does not change with it.

`scaled_dot_product_attention` is the layers' and models' one call of F.scaled_dot_product_attention: under
torch.jit.trace it writes the same math out as two torch.matmul, since fvcore (which traces, as timm's benchmark.py
runs it) has no handle for SDPA and would count attention as zero FLOPs.

Written for lsvision, Apache-2.0.
"""
from typing import Optional

import torch
import torch.nn.functional as F

from .softmax import softmax_fp32

__all__ = ['matmul_attention', 'scaled_dot_product_attention']


def matmul_attention(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor,
        dropout_p: float = 0.,
        scale: Optional[float] = None,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v with batched matmuls; the same math as F.scaled_dot_product_attention.

    Args:
        q: Queries (B, n, L, d).
        k: Keys (B, n, S, d).
        v: Values (B, n, S, dv).
        mask: Additive mask broadcastable to (B, n, L, S), with its query dimension 1 or L.
        dropout_p: Dropout on the attention weights (pass 0 in eval).
        scale: Score scale; d^-1/2 if None.

    Returns:
        (B, n, L, dv). Softmax in fp32 for fp16/bf16 inputs.
    """
    if not torch.jit.is_scripting() and torch.jit.is_tracing():
        return _traced_attention(q, k, v, mask, dropout_p, False, scale)
    B, n, L, d = q.shape
    S = k.shape[2]
    # the mask broadcasts over the queries inside baddbmm; only its batch dimension is materialized
    attn = torch.baddbmm(
        mask.expand(B, n, mask.shape[-2], S).reshape(B * n, mask.shape[-2], S),
        q.reshape(B * n, L, d),
        k.reshape(B * n, S, d).transpose(1, 2),
        alpha=d ** -0.5 if scale is None else scale,
    )
    attn = softmax_fp32(attn)
    if dropout_p > 0.:
        attn = F.dropout(attn, p=dropout_p)
    return torch.bmm(attn, v.reshape(B * n, S, v.shape[-1])).reshape(B, n, L, v.shape[-1])


def scaled_dot_product_attention(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: Optional[torch.Tensor] = None,
        dropout_p: float = 0.,
        is_causal: bool = False,
        scale: Optional[float] = None,
) -> torch.Tensor:
    """F.scaled_dot_product_attention (same arguments); under torch.jit.trace, the same math as two torch.matmul.

    fvcore's FlopCountAnalysis traces the model and has no handle for SDPA: through SDPA, attention would count zero
    FLOPs with fvcore as timm's benchmark.py calls it; through torch.matmul, its own handle counts it.
    """
    if not torch.jit.is_scripting() and torch.jit.is_tracing():
        return _traced_attention(q, k, v, attn_mask, dropout_p, is_causal, scale)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)


def _traced_attention(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: Optional[torch.Tensor],
        dropout_p: float,
        is_causal: bool,
        scale: Optional[float],
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v as torch.matmul (fvcore's handle counts them); a boolean mask (or
    `is_causal`) keeps the keys where it is True, as in SDPA (-inf elsewhere, SDPA's semantics: a row with no key
    left is NaN there too). Softmax in fp32 for fp16/bf16 inputs."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if is_causal:
        L, S = q.shape[-2], k.shape[-2]
        mask = torch.ones(L, S, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float('-inf')) if mask.dtype == torch.bool else scores + mask
    attn = softmax_fp32(scores)
    if dropout_p > 0.:
        attn = F.dropout(attn, p=dropout_p)
    return torch.matmul(attn, v)
