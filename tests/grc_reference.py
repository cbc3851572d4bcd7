"""A plain re-statement of GRC-Attention (spec grc.md §1.2), for tests: the layer's parameters as tensors, the
arithmetic written out here with torch.nn.functional, in whatever dtype they come (the tests use fp64).

Nothing here calls a module of the layer under test: the self branches (timm's MHSA and Swin window attention, PVT's
spatial-reduction attention), the gates, the candidate, the update, the batch-mean store, the memory attention, the
per-head mixing and the PE conv are each restated from the spec, reading only `weight`/`bias`-style tensors and
plain attributes (heads, eps, the cache grid).
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from reference_attention import layer_norm


def _linear(t: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    return F.linear(t, layer.weight, layer.bias)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + bias) v per head: (B, N, C) queries, (B, M, C) keys and values -> (B, N, C)."""
    B, N, C = q.shape
    d = C // heads

    def split(t):
        return t.reshape(B, t.shape[1], heads, d).transpose(1, 2)

    scores = split(q) @ split(k).transpose(-1, -2) * d ** -0.5
    if bias is not None:
        scores = scores + bias
    return (scores.softmax(-1) @ split(v)).transpose(1, 2).reshape(B, N, C)


def _reduce(t: torch.Tensor, hw: Tuple[int, int], prefix: int, attn: torch.nn.Module) -> torch.Tensor:
    """PVT's spatial reduction of a key/value source (B, prefix + h*w, C): the grid through the SR conv (kernel =
    stride = sr) and LN, or (linear SRA) adaptive average pool to 7x7, 1x1 conv, LN, GELU; prefix tokens kept."""
    if getattr(attn, 'sr', None) is None:
        return t
    B, _, C = t.shape
    grid = t[:, prefix:].transpose(1, 2).reshape(B, C, hw[0], hw[1])
    linear = getattr(attn, 'pool', None) is not None
    if linear:
        grid = F.adaptive_avg_pool2d(grid, 7)
    sr = attn.sr
    grid = F.conv2d(grid, sr.weight, sr.bias, stride=sr.stride)
    grid = layer_norm(grid.flatten(2).transpose(1, 2), attn.norm)
    if linear:
        grid = F.gelu(grid)
    return torch.cat([t[:, :prefix], grid], dim=1)


def swin_rel_pos_bias(table: torch.Tensor, window: Tuple[int, int]) -> torch.Tensor:
    """(1, heads, n, n) bias of an n = wh*ww window: table[(dy + wh - 1) * (2 ww - 1) + dx + ww - 1] for the offset
    (dy, dx) of query minus key."""
    wh, ww = window
    ys, xs = torch.meshgrid(torch.arange(wh), torch.arange(ww), indexing='ij')
    ys, xs = ys.reshape(-1), xs.reshape(-1)
    idx = (ys[:, None] - ys[None, :] + wh - 1) * (2 * ww - 1) + xs[:, None] - xs[None, :] + ww - 1
    return table[idx].permute(2, 0, 1).unsqueeze(0)


def vit_self_attention(attn: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """timm's ViT MHSA: fused qkv Linear (rows q | k | v), scale d^-0.5, proj (no qk-norm)."""
    assert isinstance(attn.q_norm, torch.nn.Identity) and isinstance(attn.k_norm, torch.nn.Identity)
    q, k, v = (F.linear(x, w, b) for w, b in zip(attn.qkv.weight.chunk(3), attn.qkv.bias.chunk(3)))
    return _linear(_attention(q, k, v, attn.num_heads), attn.proj)


def pvt_self_attention(attn: torch.nn.Module, x: torch.Tensor, feat_size: Tuple[int, int],
                       prefix: int = 0) -> torch.Tensor:
    """PVT v1 / v2 spatial-reduction attention: q from x; k, v from the reduced x (kv Linear, rows k | v); proj."""
    q = _linear(x, attn.q)
    k, v = _linear(_reduce(x, feat_size, prefix, attn), attn.kv).chunk(2, dim=-1)
    return _linear(_attention(q, k, v, attn.num_heads), attn.proj)


def swin_self_attention(attn: torch.nn.Module, x: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """timm's Swin window attention on (B * nW, n, C) windows: fused qkv, relative-position bias, the (nW, n, n)
    shift mask of window i added to every image's window i; proj."""
    q, k, v = (F.linear(x, w, b) for w, b in zip(attn.qkv.weight.chunk(3), attn.qkv.bias.chunk(3)))
    bias = swin_rel_pos_bias(attn.relative_position_bias_table, attn.window_size)
    if mask is not None:
        nw = mask.shape[0]
        bias = (bias + mask[:, None]).repeat(x.shape[0] // nw, 1, 1, 1)  # window b * nW + i gets mask i
    return _linear(_attention(q, k, v, attn.num_heads, bias), attn.proj)


def memory_attention(mem: torch.nn.Module, x_slice: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Step 7: the memory branch, the self branch's kind at width D_m: q from the input slice, k and v from the
    per-sample cache (PVT: reduced on the cache grid, prefix slots kept; Swin: its own relative-position bias)."""
    q = _linear(x_slice, mem.q)
    kv_src = cache if mem.sr is None else _reduce(cache, mem.cache_hw, mem.num_prefix_tokens, mem)
    k, v = _linear(kv_src, mem.kv).chunk(2, dim=-1)
    bias = None
    if mem.relative_position_bias_table is not None:
        bias = swin_rel_pos_bias(mem.relative_position_bias_table, mem.window_size)
    return _linear(_attention(q, k, v, mem.num_heads, bias), mem.proj)


def per_sample_update(grc: torch.nn.Module, cache: torch.Tensor, S: torch.Tensor, training: bool) -> torch.Tensor:
    """Spec §1.2 steps 3-5: each sample's updated cache C_t (B, T_m, D_m) from the cache (1, T_m, D_m), broadcast
    over the batch, and the summary S (B, T_m, D_m); in eval without `eval_update` the cache itself."""
    # 3. gates on [cache, summary]
    P = cache.expand(S.shape[0], -1, -1)
    g_r = torch.sigmoid(_linear(torch.cat([P, S], dim=-1), grc.linear_reset))
    g_u = torch.sigmoid(_linear(torch.cat([P, S], dim=-1), grc.linear_update))
    # 4. candidate LN(GELU(W_c [g_r * P, S]))
    cand = layer_norm(F.gelu(_linear(torch.cat([g_r * P, S], dim=-1), grc.linear_candidate)), grc.norm_candidate)
    # 5. update, per sample
    if not training and not grc.eval_update:
        return P  # the paper's "used directly" option
    return g_u * cand + (1 - g_u) * P


def mixed_output(grc: torch.nn.Module, x: torch.Tensor, o_self: torch.Tensor, C_t: torch.Tensor) -> torch.Tensor:
    """Spec §1.2 steps 7-8: the memory branch (queries from the first D_m channels of x, keys and values from each
    sample's C_t), right-padded with zeros to D/H a head, mixed per head with o_self (B, T, D) by sigmoid(lambda)."""
    B, T, D = x.shape
    dm, H = grc.cache_dim, grc.num_heads
    o_mem = memory_attention(grc.mem_attn, x[..., :dm], C_t)
    w = torch.sigmoid(grc.lam).view(1, 1, H, 1)
    o_mem = torch.cat([o_mem.view(B, T, H, dm // H), o_mem.new_zeros(B, T, H, (D - dm) // H)], dim=-1)
    return (w * o_mem + (1 - w) * o_self.view(B, T, H, D // H)).reshape(B, T, D)


def grc_reference(
        grc: torch.nn.Module,
        x: torch.Tensor,
        o_self: torch.Tensor,
        feat_size: Tuple[int, int],
        cache: torch.Tensor,
        training: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Spec §1.2 steps 2-10 on the attention input x and the self-branch output o_self (B, T, D), from `cache`
    (1, T_m, D_m). Returns the block output O (B, T, D) and the cache after the call: the detached batch mean of
    the per-sample update in training, `cache` itself in eval (steps 3-5 still run per sample, nothing is stored)."""
    B, T, D = x.shape
    dm, p, T_m = grc.cache_dim, grc.num_prefix_tokens, grc.cache_len
    # 2. summary: the first D_m channels of the self-attention output, 1-D nearest resize over the sequence to T_m
    S = (o_self if grc.summary_src == 'self' else x)[..., :dm]
    if T != T_m:
        assert grc.interp_mode == 'nearest1d'
        S = F.interpolate(S.transpose(1, 2), size=T_m, mode='nearest').transpose(1, 2)
    # 3-5. gates, candidate, per-sample update
    C_t = per_sample_update(grc, cache, S, training)
    # 6. store the batch mean, detached, in training only
    new_cache = C_t.detach().mean(0, keepdim=True) if training else cache
    # 7-8. memory branch and per-head mix
    out = mixed_output(grc, x, o_self, C_t)
    # 9. PE: grouped 3x3 conv (groups = D_m) on the patch tokens of X; prefix tokens get none
    grid = x[:, p:].transpose(1, 2).reshape(B, D, feat_size[0], feat_size[1])
    pe = F.conv2d(grid, grc.pe.weight, grc.pe.bias, padding=1, groups=dm).flatten(2).transpose(1, 2)
    out = torch.cat([out[:, :p], out[:, p:] + pe], dim=1)
    return out, new_cache


def full_attention_1d(attn: torch.nn.Module, x: torch.Tensor, mask: Optional[torch.Tensor] = None,
                      cls_token: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`FullAttention1d` restated: the cls token (if any) prepended as a real token, fused qkv (rows q | k | v),
    softmax(q k^T / sqrt(d)) over the real keys, padded queries' attention output 0, then proj."""
    if cls_token is not None:
        x = torch.cat([cls_token, x], dim=1)
        if mask is not None:
            mask = torch.cat([mask.new_ones(mask.shape[0], 1), mask], dim=1)
    B, n, C = x.shape
    valid = torch.ones(B, n, dtype=torch.bool) if mask is None else mask.bool()
    q, k, v = (F.linear(x, w, b) for w, b in zip(attn.qkv.weight.chunk(3), attn.qkv.bias.chunk(3)))
    h = attn.num_heads
    bias = torch.zeros(B, 1, 1, n, dtype=x.dtype).masked_fill(~valid[:, None, None, :], float('-inf'))
    out = _attention(q, k, v, h, bias) * valid[..., None]
    return _linear(out, attn.proj)


def sequence_summary(src: torch.Tensor, valid: torch.Tensor, prefix: int, seq_len: int) -> torch.Tensor:
    """The 1D summary, one sample at a time: the prefix tokens as they are, then only the real tokens (in order),
    resized to `seq_len` slots by nearest: slot i takes real token floor(i * L / seq_len) (fp64 floor: exact for
    these sizes). A sample without real tokens gets zeros (it is left out of the cache)."""
    rows = []
    for b in range(src.shape[0]):
        real = src[b, prefix:][valid[b]]
        if len(real):
            idx = torch.floor(torch.arange(seq_len, dtype=torch.float64) * len(real) / seq_len).long()
            seq = real[idx]
        else:
            seq = src.new_zeros(seq_len, src.shape[-1])
        rows.append(torch.cat([src[b, :prefix], seq]))
    return torch.stack(rows)


def grc_sequence_reference(
        grc: torch.nn.Module,
        x: torch.Tensor,
        o_self: torch.Tensor,
        mask: Optional[torch.Tensor],
        cache: torch.Tensor,
        training: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """GRC-Attention on a padded token sequence (`GatedRecurrentCache1d`): spec §1.2 steps 3-8 as in `grc_reference`,
    with the 1D summary (`sequence_summary`: real tokens only), samples without real tokens kept out of the update
    (their C_t is the cache) and of the stored mean, and a 1D PE (kernel 3, groups D_m) on the sequence tokens with
    the pad tokens zeroed. x, o_self: (B, prefix + n, D); mask (B, n), True on real tokens; cache (1, prefix + T_m,
    D_m). Returns the output (B, prefix + n, D) and the cache after the call."""
    B, T, D = x.shape
    dm, p = grc.cache_dim, grc.num_prefix_tokens
    valid = torch.ones(B, T - p, dtype=torch.bool) if mask is None else mask.bool()
    has_tokens = valid.any(1)
    S = sequence_summary((o_self if grc.summary_src == 'self' else x)[..., :dm], valid, p, grc.seq_len)
    C_t = torch.where(has_tokens[:, None, None], per_sample_update(grc, cache, S, training), cache)
    new_cache = cache
    if training and has_tokens.any():
        new_cache = C_t.detach()[has_tokens].mean(0, keepdim=True)
    out = mixed_output(grc, x, o_self, C_t)
    seq = (x[:, p:] * valid[..., None]).transpose(1, 2)
    pe = F.conv1d(seq, grc.pe.weight, grc.pe.bias, padding=1, groups=dm).transpose(1, 2)
    return torch.cat([out[:, :p], out[:, p:] + pe], dim=1), new_cache
