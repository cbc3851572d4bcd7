"""Attention as batched matmuls + softmax, for the small blocks where it beats F.scaled_dot_product_attention on CPU.

SDPA's CPU flash kernel costs a few microseconds per (batch x head x query block) and, for blocks of a few dozen
queries, does not speed up with more threads; batched matmuls do. The layers pick this path by device and layer shape
only, where they measured it faster on the 2-core CPU (long-short segments of at most 16 queries, Swin's 49-slot
window memory attention of GRC), never by thread count, so that a model's rounding does not change with it.

Written for lsvision, Apache-2.0.
"""
from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ['matmul_attention']


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
    B, n, L, d = q.shape
    S = k.shape[2]
    # the mask broadcasts over the queries inside baddbmm; only its batch dimension is materialized
    attn = torch.baddbmm(
        mask.expand(B, n, mask.shape[-2], S).reshape(B * n, mask.shape[-2], S),
        q.reshape(B * n, L, d),
        k.reshape(B * n, S, d).transpose(1, 2),
        alpha=d ** -0.5 if scale is None else scale,
    )
    if attn.dtype in (torch.float16, torch.bfloat16):
        attn = attn.float().softmax(dim=-1).to(q.dtype)
    else:  # fp32 as is, fp64 not truncated
        attn = attn.softmax(dim=-1)
    if dropout_p > 0.:
        attn = F.dropout(attn, p=dropout_p)
    return torch.bmm(attn, v.reshape(B * n, S, v.shape[-1])).reshape(B, n, L, v.shape[-1])
