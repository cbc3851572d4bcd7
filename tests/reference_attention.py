"""Dense references of lsvision's attention layers, written for clarity, not speed.

Each reference takes a fast-path module and recomputes its output with plain full attention over all keys
and an explicit mask that says which keys each query may see.
"""
from typing import Tuple

import torch
import torch.nn.functional as F

from lsvision.layers import LongShortAttention2d


def dense_long_short_attention_2d(
        attn: LongShortAttention2d,
        x: torch.Tensor,
        feat_size: Tuple[int, int],
) -> torch.Tensor:
    """Long-short attention as masked full attention over [projected (r) | all patches (Np) | prefix (g)] keys.

    A patch query at (y, x) in segment (i, j) = (y // w, x // w) sees the patch keys in rows [i*w - s, (i+1)*w + s)
    and columns [j*w - s, (j+1)*w + s), every projected key and every prefix key. Prefix queries see the prefix keys
    and the attention outputs of all patches.
    """
    B, N, C = x.shape
    H, W = feat_size
    num_patches = H * W
    g = N - num_patches
    h, d, r, w = attn.num_heads, attn.head_dim, attn.dp_rank, attn.window_size
    s = max(w // 2, 1)

    def heads(t):  # (B, n, C) -> (B, h, n, d)
        return t.reshape(B, -1, h, d).transpose(1, 2)

    q, k, v = attn.qkv(x, feat_size, g).unbind(0)
    k, v = attn.norm_local(k), attn.norm_local(v)
    logits = attn.dynamic_proj(x[:, g:], feat_size)  # (B, Np, h*r)
    P = logits.transpose(1, 2).reshape(B, h, r, num_patches).softmax(-1)
    k_bar = heads(attn.norm_global((P @ heads(k[:, g:])).transpose(1, 2).reshape(B, r, C)))
    v_bar = heads(attn.norm_global((P @ heads(v[:, g:])).transpose(1, 2).reshape(B, r, C)))

    q_p = heads(q[:, g:]) * d ** -0.5
    keys = torch.cat([k_bar, heads(k[:, g:]), heads(k[:, :g])], dim=2)
    values = torch.cat([v_bar, heads(v[:, g:]), heads(v[:, :g])], dim=2)
    scores = q_p @ keys.transpose(-1, -2)  # (B, h, Np, r + Np + g)

    # which patch keys each patch query may see, and the window relative-position bias
    ys, xs = torch.meshgrid(torch.arange(H), torch.arange(W), indexing='ij')
    ys, xs = ys.reshape(-1), xs.reshape(-1)
    row_lo = (ys // w) * w - s
    col_lo = (xs // w) * w - s
    allowed = (
        (ys[None, :] >= row_lo[:, None]) & (ys[None, :] < row_lo[:, None] + w + 2 * s)
        & (xs[None, :] >= col_lo[:, None]) & (xs[None, :] < col_lo[:, None] + w + 2 * s)
    )  # (Np queries, Np keys)
    patch_bias = torch.zeros(h, num_patches, num_patches)
    if attn.rel_pos_table is not None:
        sp = w // 2
        drow = ys[:, None] - ys[None, :]
        dcol = xs[:, None] - xs[None, :]
        idx = (drow + sp + w - 1) * (w + 2 * sp) + (dcol + sp + w - 1)
        idx = idx.clamp(0, attn.rel_pos_table.shape[0] - 1)  # outside the window: masked anyway
        patch_bias = attn.rel_pos_table[idx].permute(2, 0, 1)
    patch_bias = patch_bias.masked_fill(~allowed, float('-inf'))
    bias = torch.cat([torch.zeros(h, num_patches, r), patch_bias, torch.zeros(h, num_patches, g)], dim=-1)
    out = (scores + bias).softmax(-1) @ values  # (B, h, Np, d)

    if g > 0:
        q_c = heads(q[:, :g]) * d ** -0.5
        cls_keys = torch.cat([heads(k[:, :g]), out], dim=2)
        cls_values = torch.cat([heads(v[:, :g]), out], dim=2)
        cls_out = (q_c @ cls_keys.transpose(-1, -2)).softmax(-1) @ cls_values
        out = torch.cat([cls_out, out], dim=2)
    return F.linear(out.transpose(1, 2).reshape(B, N, C), attn.proj.weight, attn.proj.bias)
