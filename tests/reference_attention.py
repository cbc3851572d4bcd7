"""Dense references of lsvision's attention layers, written for clarity, not speed.

Each reference takes a fast-path module and recomputes its output with plain full attention over all keys
and an explicit mask that says which keys each query may see. The 2D reference reads only the module's parameters
and buffers: its q, k, v projections (ViL-LS Linear, CvT-LS depthwise-separable convs with BatchNorm), projection
logits (Linear, or weight-standardized depthwise + pointwise conv) and LayerNorms are its own arithmetic
(long_short.md §1 and §3.3), not the module's layers.
"""
from typing import Tuple

import torch
import torch.nn.functional as F

from lsvision.layers import LinearDynamicProjection, LinearQkv, LongShortAttention2d
from lsvision.models.cvt import ConvDynamicProjection, SepConvQkv


def layer_norm(t: torch.Tensor, norm: torch.nn.LayerNorm) -> torch.Tensor:
    """LayerNorm over the last axis with `norm`'s weight, bias and eps: (t - mean) / sqrt(biased var + eps)."""
    mean = t.mean(-1, keepdim=True)
    var = (t - mean).square().mean(-1, keepdim=True)
    return (t - mean) / torch.sqrt(var + norm.eps) * norm.weight + norm.bias


def _batch_norm_2d(t: torch.Tensor, bn: torch.nn.BatchNorm2d) -> torch.Tensor:
    """BatchNorm of a (B, C, H, W) map: the batch's statistics (biased variance) in training, else the running ones."""
    if bn.training:
        mean = t.mean((0, 2, 3))
        var = (t - mean[:, None, None]).square().mean((0, 2, 3))
    else:
        mean, var = bn.running_mean, bn.running_var
    scale = bn.weight / torch.sqrt(var + bn.eps)
    return (t - mean[:, None, None]) * scale[:, None, None] + bn.bias[:, None, None]


def _sep_conv(feat_map: torch.Tensor, sep: torch.nn.Module) -> torch.Tensor:
    """CvT-LS SepConv (§3.1): depthwise 3x3 (stride 1, pad 1, bias) -> BatchNorm -> pointwise 1x1 (bias); tokens out."""
    C = feat_map.shape[1]
    y = F.conv2d(feat_map, sep.dw.weight, sep.dw.bias, padding=1, groups=C)
    y = F.conv2d(_batch_norm_2d(y, sep.bn), sep.pw.weight, sep.pw.bias)
    return y.flatten(2).transpose(1, 2)


def _conv_projection_logits(feat_map: torch.Tensor, dp: torch.nn.Module) -> torch.Tensor:
    """CvT-LS projection logits (§3.3): depthwise 3x3 conv with weight standardization (each filter over its 9 taps,
    (w - mean) / sqrt(biased var + 1e-5), bias kept), then a pointwise conv C -> h * r (bias); tokens out."""
    C = feat_map.shape[1]
    w = dp.dw.weight
    mean = w.mean((1, 2, 3), keepdim=True)
    var = (w - mean).square().mean((1, 2, 3), keepdim=True)
    y = F.conv2d(feat_map, (w - mean) / torch.sqrt(var + 1e-5), dp.dw.bias, padding=1, groups=C)
    return F.conv2d(y, dp.pw.weight, dp.pw.bias).flatten(2).transpose(1, 2)


def _qkv_and_logits(
        attn: LongShortAttention2d,
        x: torch.Tensor,
        feat_size: Tuple[int, int],
        g: int,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of all tokens (B, N, C) each, prefix first, and the patch tokens' projection logits (B, Np, h * r)."""
    B, N, C = x.shape
    patches = x[:, g:]
    feat_map = patches.transpose(1, 2).reshape(B, C, feat_size[0], feat_size[1])
    if isinstance(attn.qkv, LinearQkv):  # ViL-LS: one Linear, rows [q | k | v], on every token
        q, k, v = (F.linear(x, w, b) for w, b in zip(attn.qkv.weight.chunk(3), attn.qkv.bias.chunk(3)))
    elif isinstance(attn.qkv, SepConvQkv):  # CvT-LS: a SepConv each on the patch map; prefix q = k = v = its tokens
        prefix = x[:, :g]
        q, k, v = (torch.cat([prefix, _sep_conv(feat_map, sep)], dim=1)
                   for sep in (attn.qkv.q, attn.qkv.k, attn.qkv.v))
    else:
        raise TypeError(f'no reference for the q, k, v module {type(attn.qkv).__name__} (a reparameterized layer?)')
    dp = attn.dynamic_proj
    if isinstance(dp, LinearDynamicProjection):
        logits = F.linear(patches, dp.weight, dp.bias)
    elif isinstance(dp, ConvDynamicProjection):
        logits = _conv_projection_logits(feat_map, dp)
    else:
        raise TypeError(f'no reference for the projection-logit module {type(dp).__name__}')
    return q, k, v, logits


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

    q, k, v, logits = _qkv_and_logits(attn, x, feat_size, g)  # all tokens (B, N, C); logits (B, Np, h*r)
    k, v = layer_norm(k, attn.norm_local), layer_norm(v, attn.norm_local)  # LN_L over C, every token
    P = logits.transpose(1, 2).reshape(B, h, r, num_patches).softmax(-1)  # channel head * r + j -> P[head, j]
    k_bar = heads(layer_norm((P @ heads(k[:, g:])).transpose(1, 2).reshape(B, r, C), attn.norm_global))
    v_bar = heads(layer_norm((P @ heads(v[:, g:])).transpose(1, 2).reshape(B, r, C), attn.norm_global))

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


def dense_long_short_attention_1d(attn, x, mask=None, cls_token=None):
    """Bidirectional 1D long-short attention as one masked full attention over [projected (r) | all tokens (n)].

    Query i (segment g = i // w) sees every projected key and the real tokens j with g*w - e <= j < g*w + w + e,
    e = max(w // 2, 1). Padded query rows are zeroed. A cls query sees its own (raw) k/v and the outputs of all
    real tokens.
    """
    B, n, C = x.shape
    h, d, r, w = attn.num_heads, attn.head_dim, attn.dp_rank, attn.window_size
    e = max(w // 2, 1)
    valid = torch.ones(B, n, dtype=torch.bool) if mask is None else mask.bool()
    wq, wk, wv = attn.qkv.weight.chunk(3)
    bq, bk, bv = attn.qkv.bias.chunk(3)

    def heads(t):
        return t.reshape(B, -1, h, d).transpose(1, 2)

    q = heads(F.linear(x, wq, bq)) * d ** -0.5
    k = heads(attn.norm_local(F.linear(x, wk, bk)))
    v = heads(attn.norm_local(F.linear(x, wv, bv)))
    gk, gv = [], []
    if cls_token is not None:
        kc, vc = heads(F.linear(cls_token, wk, bk)), heads(F.linear(cls_token, wv, bv))
        gk.append(kc)
        gv.append(vc)
    if r > 0:
        logits = attn.dynamic_proj(x).masked_fill(~valid[:, :, None], float('-inf'))
        P = logits.softmax(dim=1).transpose(1, 2).reshape(B, h, r, n)
        gk.append(P @ k)
        gv.append(P @ v)
    g = sum(t.shape[2] for t in gk)
    if g:
        def norm_g(t):
            return heads(attn.norm_global(torch.cat(t, 2).transpose(1, 2).reshape(B, g, C)))
        kbar, vbar = norm_g(gk), norm_g(gv)
    else:
        kbar = vbar = k.new_zeros(B, h, 0, d)
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    lo = (i // w) * w - e if w > 0 else torch.full_like(i, n + 1)
    hi = lo + w + 2 * e if w > 0 else lo
    allowed = (j >= lo) & (j < hi)  # (n, n)
    allowed = allowed[None] & valid[:, None, :]  # (B, n, n)
    full_mask = torch.cat([torch.ones(B, n, g, dtype=torch.bool), allowed], dim=-1)[:, None]
    out = F.scaled_dot_product_attention(q, torch.cat([kbar, k], 2), torch.cat([vbar, v], 2),
                                         attn_mask=full_mask, scale=1.)
    out = out * valid[:, None, :, None]
    if cls_token is not None:
        qc = heads(F.linear(cls_token, wq, bq)) * d ** -0.5
        cmask = torch.cat([torch.ones(B, 1, dtype=torch.bool), valid], 1)[:, None, None]
        cls_out = F.scaled_dot_product_attention(qc, torch.cat([kc, out], 2), torch.cat([vc, out], 2),
                                                 attn_mask=cmask, scale=1.)
        out = torch.cat([cls_out, out], 2)
    return attn.proj(out.transpose(1, 2).reshape(B, -1, C))


def _sinusoid(pos, dim):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    a = pos.double()[:, None] * inv[None]
    return torch.cat([a.sin(), a.cos()], -1)


def dense_causal_long_short_attention(attn, x, cache):
    """Causal long-short attention as one softmax over all compressed vectors and all M + L tokens, masked.

    Query t sees the tokens t-W+1..t (content (q+u).k + position (q+v).R_w[t-j]) and the vectors (s, k) of segments
    s < J = (M + t) // l (content q.K_bar + position q.R_c[r (J - s) - 1 - k]). Cache segments average the hidden
    states per head slice and then project (official `compress_hidden_cache`).
    """
    B, L, C = x.shape
    M = cache.shape[1]
    h, d, r, W, ls = attn.num_heads, attn.head_dim, attn.dp_rank, attn.window_size, attn.segment_size
    z = torch.cat([cache, x], 1)
    N = M + L
    ns = N // ls

    def heads(t):
        return t.reshape(B, -1, h, d).transpose(1, 2)

    q = heads(attn.q(x)) * d ** -0.5
    k = heads(attn.norm_local(attn.k(z)))
    v = heads(attn.norm_local(attn.v(z)))
    P = attn.dynamic_proj(z).reshape(B, ns, ls, h, r).softmax(2)
    kb, vb = [], []
    for s in range(ns):
        seg = z[:, s * ls:(s + 1) * ls]  # (B, l, C)
        for kk in range(r):
            w_tok = P[:, s, :, :, kk]  # (B, l, h)
            if attn.compress_hidden_cache and s < M // ls:
                hbar = (w_tok.repeat_interleave(d, dim=2) * seg).sum(1)  # (B, C): head slice i weighted by head i
                kb.append(attn.k(hbar))
                vb.append(attn.v(hbar))
            else:
                kb.append((w_tok.repeat_interleave(d, dim=2) * attn.k(seg)).sum(1))
                vb.append((w_tok.repeat_interleave(d, dim=2) * attn.v(seg)).sum(1))
    kbar = heads(attn.norm_global(torch.stack(kb, 1)))  # (B, h, ns*r, d)
    vbar = heads(attn.norm_global(torch.stack(vb, 1)))
    n_cv = ns * r
    Rw = attn.r_net(_sinusoid(torch.arange(W), C).to(x.dtype)).reshape(W, h, d).transpose(0, 1)  # (h, W, d)
    Rc = attn.r_net_chunk(_sinusoid(torch.arange(n_cv), C).to(x.dtype)).reshape(n_cv, h, d).transpose(0, 1)
    u = attn.content_bias[:, None]
    vv = attn.pos_bias[:, None]

    t = torch.arange(L)[:, None]
    pos = torch.arange(N)[None, :] - M  # key positions
    delta = t - pos
    win_ok = (delta >= 0) & (delta < W)
    win = (q + u) @ k.transpose(-1, -2)
    rel_w = (q + vv) @ Rw.transpose(-1, -2)  # (B, h, L, W)
    win = win + torch.gather(rel_w, -1, delta.clamp(0, W - 1).expand(B, h, L, N))
    J = (M + t) // ls
    s = torch.arange(n_cv)[None, :] // r
    kk = torch.arange(n_cv)[None, :] % r
    seg_ok = s < J
    rho = (r * (J - s) - 1 - kk).clamp(0, n_cv - 1)
    comp = q @ kbar.transpose(-1, -2) + torch.gather(q @ Rc.transpose(-1, -2), -1, rho.expand(B, h, L, n_cv))
    scores = torch.cat([comp.masked_fill(~seg_ok, float('-inf')), win.masked_fill(~win_ok, float('-inf'))], -1)
    A = scores.softmax(-1)
    out = A[..., :n_cv] @ vbar + A[..., n_cv:] @ v
    return attn.proj(out.transpose(1, 2).reshape(B, L, C))
