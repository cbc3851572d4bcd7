"""1D long-short attention (Transformer-LS): bidirectional (LRA) and causal (character LM).

Paper: `Long-Short Transformer: Efficient Transformers for Language and Vision` - https://arxiv.org/abs/2107.02192

`LongShortAttention1d` follows NVIDIA/transformer-ls `lra/attention_transformer_ls.py::AttentionLS`: every query
attends, in one joint softmax, to r dynamic-projection keys per head (P = softmax over tokens of Linear(x),
K_bar = LN_G(P LN_L(K))) and to the keys of its segment-wise window (w queries share the w + 2e keys around their
segment, e = max(w // 2, 1)); an optional cls (global) token joins the projected keys and then attends to the
attention outputs of all tokens. Beyond the official code: any length (padded to whole segments, masked, cropped),
finite outputs for all-padding samples.

`CausalLongShortAttention` follows `autoregressive/model_lib/layer.py::ChunkedLSAttention`: query t attends to the W
tokens t-W+1..t (Transformer-XL relative positions, the previous tokens coming from a per-layer cache of M tokens)
and to r dynamic projections of every segment of l tokens that ends before its own segment starts (cache segments
first), with relative segment positions. Beyond the official code: queries are blocked by segment and processed in
chunks, so a query only scores the segments it may see and memory stays bounded (`query_chunk_size`); any length;
an optional masked (not yet filled) cache.

The window core (`span_attention`: joint softmax over [global | window span] keys, a backward that gathers the
spans again) and `projection_weights` are shared with the 2D layer.

Written for lsvision, Apache-2.0.
"""
import math
from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .autocast import autocast_dtype, autocast_off, cast_stacked
from .causal_flex import CausalFlexGeometry, causal_flex_attention
from .local_norm import local_norm_tokens, recompute_local_norm
from .long_short import _HAS_TRITON, local_norm_projection, project_keys_values, projection_weights
from .matmul_attention import scaled_dot_product_attention
from .softmax import mask_value, softmax_fp32
from .span_attention import span_attention, span_attention_local_norm, window_span
from .tuning import CAUSAL_CHECKPOINT_MIN_SCORES

__all__ = ['CAUSAL_KERNELS', 'LongShortAttention1d', 'CausalLongShortAttention', 'FullAttention1d',
           'sinusoid_frequencies', 'sinusoid_positions']

# `CausalLongShortAttention`'s attention kernel: the chunk path, one FlexAttention call, or the one the counts favour
CAUSAL_KERNELS = ('auto', 'chunks', 'flex')

def sinusoid_frequencies(dim: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The Transformer-XL sinusoid frequencies w_k = 10000^(-2k/dim), k < dim/2, computed as the official
    `PositionalEmbedding.inv_freq` is (so that fp32 gives its values bit for bit)."""
    return 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=dtype, device=device) / dim))


def sinusoid_positions(
        positions: torch.Tensor,
        dim: int,
        dtype: torch.dtype = torch.float32,
        freq_offset: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Transformer-XL sinusoids [sin(p w) | cos(p w)] (two halves), w_k = 10000^(-2k/dim): (len(positions), dim).

    Computed in fp32 (fp64 if `dtype` is fp64) and returned in `dtype`.

    Args:
        positions: Positions p (any shape (n,)).
        dim: Channels (even).
        dtype: Output dtype.
        freq_offset: (dim // 2,) added to w_k: a checkpoint's own frequencies minus these (e.g. fp16-rounded ones).
    """
    work = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq = sinusoid_frequencies(dim, work, positions.device)
    if freq_offset is not None:
        inv_freq = inv_freq + freq_offset.to(work)
    angles = positions.to(work)[:, None] * inv_freq[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1).to(dtype)


class LongShortAttention1d(nn.Module):
    """Bidirectional long-short attention over a token sequence, with an optional cls (global) token.

    Parameters map one to one to the official `AttentionLS`: `qkv` = [W_q; W_k; W_v], `dynamic_proj` = dconv_fc,
    `norm_local` = dual_ln_l (LN_L, on K and V), `norm_global` = dual_ln_s (LN_G, on the projected K and V and the
    cls k/v), `proj` = W_o.
    """

    def __init__(
            self,
            dim: int,
            num_heads: int = 2,
            window_size: int = 8,
            dp_rank: int = 32,
            qkv_bias: bool = True,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
            dual_ln_eps: float = 1e-5,
            device=None,
            dtype=None,
    ):
        """
        Args:
            dim: Channels D.
            num_heads: Heads h; head dim D / h.
            window_size: Segment size w (0: no window, dynamic projection only).
            dp_rank: Dynamic projections r per head (0: window only).
            qkv_bias: Bias in the q, k, v Linear.
            attn_drop: Dropout on the joint attention weights.
            proj_drop: Dropout after the output projection.
            dual_ln_eps: Epsilon of LN_L and LN_G.
        """
        dd = {'device': device, 'dtype': dtype}
        super().__init__()
        if dim % num_heads:
            raise ValueError(f'dim {dim} must be divisible by num_heads {num_heads}')
        if window_size < 0 or dp_rank < 0:
            raise ValueError(f'window_size and dp_rank must be >= 0, got {window_size} and {dp_rank}')
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.window_size = window_size
        self.dp_rank = dp_rank
        self.attn_drop = attn_drop
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias, **dd)
        self.dynamic_proj = nn.Linear(dim, num_heads * dp_rank, **dd) if dp_rank > 0 else None
        self.norm_local = nn.LayerNorm(dim, eps=dual_ln_eps, **dd)
        self.norm_global = nn.LayerNorm(dim, eps=dual_ln_eps, **dd)
        self.proj = nn.Linear(dim, dim, **dd)
        self.proj_drop = nn.Dropout(proj_drop)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        """(..., B, n, D) -> (..., B, h, n, d)."""
        return t.unflatten(-1, (self.num_heads, self.head_dim)).transpose(-2, -3)

    def _merge(self, t: torch.Tensor) -> torch.Tensor:
        """(..., B, h, n, d) -> (..., B, n, D)."""
        return t.transpose(-2, -3).flatten(-2)

    def forward(
            self,
            x: torch.Tensor,
            mask: Optional[torch.Tensor] = None,
            cls_token: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """
        Args:
            x: Tokens (B, n, D) (the LN1 output in a block).
            mask: Optional (B, n) key-padding mask, True (or 1) on real tokens.
            cls_token: Optional un-normalized global token (B, 1, D) (official `cls_embed`).

        Returns:
            (B, n, D), or (B, 1 + n, D) with the cls output first when `cls_token` is given. Padded positions hold
            `proj.bias` (their attention output is 0), as in the official code.
        """
        B, n, C = x.shape
        h, d, r, w = self.num_heads, self.head_dim, self.dp_rank, self.window_size
        if r == 0 and w == 0 and cls_token is None:
            raise ValueError('LongShortAttention1d needs dp_rank > 0, window_size > 0 or a cls token')
        valid = None if mask is None else mask.to(torch.bool)
        qkv = F.linear(x, self.qkv.weight, self.qkv.bias).unflatten(-1, (3, C))
        q = qkv[:, :, 0] * d ** -0.5  # scale once, before any product (official)
        norm = self.norm_local  # LN_L over all D on keys and values
        k_raw, v_raw = qkv[:, :, 1], qkv[:, :, 2]
        # training: the dynamic projection and the windows take k and v before LN_L and keep only those (views of the
        # qkv output, which the queries keep anyway); their backward normalizes again (`lsvision.layers.local_norm`)
        recompute_norm = recompute_local_norm(qkv, norm.weight)
        kv = k_norm = v_norm = qkv.new_empty(0)  # kv unused when recomputing, k_norm and v_norm otherwise
        if not recompute_norm:
            kv = self._heads(norm(qkv[:, :, 1:].movedim(2, 0)))  # (2, B, h, n, d)
        elif r > 0 or w > 0:  # LN_L once for the projection and the windows (tokens, kept by neither)
            k_norm, v_norm = local_norm_tokens(k_raw, v_raw, norm.weight, norm.bias, norm.eps)

        # global keys: [cls k/v (without LN_L) | P K, P V], then LN_G over D
        global_kv = []
        kv_cls = None
        if cls_token is not None:
            w_kv = self.qkv.weight[C:]
            b_kv = None if self.qkv.bias is None else self.qkv.bias[C:]
            kv_cls = self._heads(F.linear(cls_token, w_kv, b_kv).unflatten(-1, (2, C)).movedim(2, 0))
            global_kv.append(kv_cls)
        if r > 0:
            proj = projection_weights(self.dynamic_proj(x), h, valid)  # (B, h, r, n)
            if recompute_norm:
                global_kv.append(local_norm_projection(
                    proj, k_norm, v_norm, k_raw, v_raw, norm.weight, norm.bias, norm.eps))
            else:
                proj = proj.to(kv.dtype)
                global_kv.append(project_keys_values(proj, kv[0], kv[1]))
        if global_kv:
            kv_bar = torch.cat(global_kv, dim=3) if len(global_kv) > 1 else global_kv[0]
            kv_bar = self._heads(self.norm_global(self._merge(kv_bar)))  # (2, B, h, g, d)
        else:
            kv_bar = qkv.new_zeros(2, B, h, 0, d)
        dropout_p = self.attn_drop if self.training else 0.
        qh = self._heads(q)  # (B, h, n, d)

        if w > 0:
            pad, span = window_span(w)
            num_seg = (n + w - 1) // w
            # which window keys exist: inside [0, n) and real
            key_ok = torch.zeros(
                B if valid is not None else 1, num_seg * w + 2 * pad, dtype=torch.bool, device=x.device)
            key_ok[:, pad:pad + n] = True if valid is None else valid
            key_ok = key_ok.unfold(1, span, w)  # (B or 1, G, T)
            win_mask = torch.zeros(key_ok.shape, dtype=q.dtype, device=x.device).masked_fill(
                ~key_ok, mask_value(q.dtype))
            # one joint softmax over [global | window span] keys; the backward gathers the spans again
            win_mask = win_mask[:, None, :, None, :]
            if recompute_norm:
                out = span_attention_local_norm(qh, k_norm, v_norm, k_raw, v_raw, norm.weight, norm.bias, norm.eps,
                                                kv_bar, win_mask, w, 1., dropout_p, None)
            else:
                out = span_attention(qh, kv, kv_bar, win_mask, w, 1., dropout_p)
            out = out.transpose(1, 2)
        else:
            out = scaled_dot_product_attention(qh, kv_bar[0], kv_bar[1], dropout_p=dropout_p, scale=1.)
        if valid is not None:
            out = out * valid[:, None, :, None].to(out.dtype)  # padded queries: attention output 0 (official)

        if cls_token is not None:
            # the cls query attends to its own (un-LN_G-ed) k/v and to the attention outputs C of all tokens
            q_cls = self._heads(F.linear(cls_token, self.qkv.weight[:C],
                                         None if self.qkv.bias is None else self.qkv.bias[:C])) * d ** -0.5
            cls_keys = torch.cat([kv_cls[0], out], dim=2)
            cls_values = torch.cat([kv_cls[1], out], dim=2)
            cls_mask = None
            if valid is not None:
                cls_mask = torch.zeros(B, 1, 1, 1 + n, dtype=q.dtype, device=x.device)
                cls_mask[:, 0, 0, 1:] = cls_mask[:, 0, 0, 1:].masked_fill(~valid, mask_value(q.dtype))
            cls_out = scaled_dot_product_attention(q_cls, cls_keys, cls_values, attn_mask=cls_mask, scale=1.)
            out = torch.cat([cls_out, out], dim=2)
        x = self.proj(self._merge(out))
        return self.proj_drop(x)


class FullAttention1d(nn.Module):
    """Full (quadratic) multi-head attention with the same interface as `LongShortAttention1d`: the counterpart.

    A cls token, if given, is prepended as one more (un-normalized) token; padded keys are masked.
    """

    def __init__(self, dim: int, num_heads: int = 2, qkv_bias: bool = True, attn_drop: float = 0.,
                 proj_drop: float = 0., device=None, dtype=None):
        dd = {'device': device, 'dtype': dtype}
        super().__init__()
        if dim % num_heads:
            raise ValueError(f'dim {dim} must be divisible by num_heads {num_heads}')
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.attn_drop = attn_drop
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias, **dd)
        self.proj = nn.Linear(dim, dim, **dd)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None,
                cls_token: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Same arguments and output layout as `LongShortAttention1d.forward`."""
        if cls_token is not None:
            x = torch.cat([cls_token, x], dim=1)
            if mask is not None:
                mask = torch.cat([mask.new_ones(mask.shape[0], 1), mask], dim=1)
        B, n, C = x.shape
        q, k, v = self.qkv(x).reshape(B, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attn_mask = None if mask is None else mask.to(torch.bool)[:, None, None, :]
        out = scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=self.attn_drop if self.training else 0.)
        if mask is not None:
            out = out * mask.to(out.dtype)[:, None, :, None]
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(B, n, C)))


def segment_positions(query_segment: torch.Tensor, num_vectors: int, dp_rank: int):
    """Relative position rho = r (J - s) - 1 - k of each (query, vector) pair and whether it is hidden.

    Vector m = s * r + k (segment s, rank k) is visible to a query of segment J iff s < J, i.e. rho >= 0.

    Returns:
        rho (Cq, m) int64 (negative where hidden) and the hidden mask (Cq, m).
    """
    rho = dp_rank * query_segment[:, None] - 1 - torch.arange(num_vectors, device=query_segment.device)[None, :]
    return rho, rho < 0


def _causal_chunk(
        x_before: torch.Tensor,
        x_chunk: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        v_weight: torch.Tensor,
        bar_k: torch.Tensor,
        bar_v: torch.Tensor,
        seg_pos: torch.Tensor,
        norm_weight: Optional[torch.Tensor],
        norm_bias: Optional[torch.Tensor],
        norm_eps: float,
        win_pos: torch.Tensor,
        content_bias: torch.Tensor,
        pos_bias: torch.Tensor,
        query_segment: torch.Tensor,
        vector_ok: torch.Tensor,
        dp_rank: int,
        win_index: torch.Tensor,
        win_masked: torch.Tensor,
        dropout_p: float,
) -> torch.Tensor:
    """One chunk of causal long-short attention (queries of whole segments and whole windows).

    q, k and v are projected here from the chunk's tokens (and the W tokens before it), so that with checkpointing
    no full-length q, k or v is kept for the backward pass.

    Args:
        x_before, x_chunk: Input tokens of positions [start - W, start) and [start, start + Cq): (B, W, D), (B, Cq, D).
        q_weight: The query weight with the scale d^-1/2 folded in; k_weight, v_weight: key and value weights.
        bar_k, bar_v: The compressed keys/values the chunk may see (B, h, m, d).
        seg_pos: Segment relative-position embeddings R_c[rho], rho = 0..m-1: (h, m, d).
        norm_weight, norm_bias, norm_eps: LN_L, applied here so that its output is not kept for the backward.
        win_pos: Window relative-position embeddings R_w[delta], delta = 0..W-1: (h, W, d).
        content_bias, pos_bias: u and v (h, 1, d).
        query_segment: (Cq,) concatenated segment J of each query; vector_ok: (m,) False for vectors of empty
            (all-masked) segments; dp_rank: r. The (Cq, m) positions and masks are made here, not kept.
        win_index: (W, 2W) delta of each (query, key) pair of a block; win_masked (B or 1, 1, nb, W, 2W).
    """
    B, Cq, C = x_chunk.shape
    h, m, d = bar_k.shape[1], bar_k.shape[2], bar_k.shape[3]
    W = win_pos.shape[1]
    nb = Cq // W
    q = F.linear(x_chunk, q_weight).unflatten(-1, (h, d)).transpose(1, 2)  # (B, h, Cq, d), scaled
    xw = torch.cat([x_before, x_chunk], dim=1)
    win_k, win_v = (F.layer_norm(F.linear(xw, wt), (C,), norm_weight, norm_bias, norm_eps)
                    .unflatten(-1, (h, d)).transpose(1, 2) for wt in (k_weight, v_weight))  # LN_L: (B, h, W+Cq, d)
    # compressed segments: content + relative segment position, masked to strictly earlier segments
    rho, bar_masked = segment_positions(query_segment, m, dp_rank)
    bar_masked = bar_masked | ~vector_ok
    bar_scores = q @ bar_k.transpose(-1, -2) + torch.gather(
        q @ seg_pos.transpose(-1, -2), -1, rho.clamp(0, max(m - 1, 0)).expand(B, h, Cq, m))
    bar_scores = bar_scores.masked_fill(bar_masked, mask_value(q.dtype))
    # window: blocks of W queries against the 2W keys [block start - W, block end), band t-W+1..t
    keys = win_k.unfold(2, 2 * W, W)  # (B, h, nb, d, 2W)
    q_blocks = q.unflatten(2, (nb, W))
    win_scores = (q_blocks + content_bias[:, None]) @ keys
    rel = ((q + pos_bias) @ win_pos.transpose(-1, -2)).unflatten(2, (nb, W))  # (B, h, nb, W, W) by delta
    win_scores = win_scores + torch.gather(rel, -1, win_index.expand(B, h, nb, W, 2 * W))
    win_scores = win_scores.masked_fill(win_masked, mask_value(q.dtype))
    scores = torch.cat([bar_scores.unflatten(2, (nb, W)), win_scores], dim=-1)
    attn = softmax_fp32(scores, -1)
    attn = F.dropout(attn, p=dropout_p, training=dropout_p > 0)
    out = attn[..., :m].flatten(2, 3) @ bar_v
    out = out + (attn[..., m:] @ win_v.unfold(2, 2 * W, W).transpose(-1, -2)).flatten(2, 3)
    return out.transpose(1, 2)  # (B, Cq, h, d): the chunks concatenate straight into token order


class _CausalLayout(NamedTuple):
    """The tokens of one `CausalLongShortAttention` call: [left pad | cache | x | right pad] (N = Mp + Lp)."""
    x: torch.Tensor  # the current tokens (B, L, C)
    pre: torch.Tensor  # left pad and cache (B, Mp, C), whole segments, at least W tokens
    x_cur: torch.Tensor  # x right-padded to whole blocks (B, Lp, C)
    valid: torch.Tensor  # (N,) the real tokens (the masked-cache extension masks cache tokens too)
    Mp: int
    Lp: int
    chunk: int  # queries per chunk, a multiple of lcm(W, l)
    real_from: int  # valid is True on positions [real_from, Mp + len(x))


class CausalLongShortAttention(nn.Module):
    """Causal long-short attention with a cache of the previous M tokens (Transformer-LS char-LM).

    Parameters map to the official `ChunkedLSAttention`: proj_query/key/val/out -> q/k/v/proj (no bias),
    dconv_1 -> dynamic_proj, r_net -> r_net, r_net_chunk -> r_net_chunk, r_w_bias -> content_bias (u),
    r_r_bias -> pos_bias (v), dual_ln_win -> norm_local (LN_L), dual_ln_dproj -> norm_global (LN_G).
    """

    def __init__(
            self,
            dim: int,
            num_heads: int = 8,
            window_size: int = 512,
            segment_size: int = 16,
            dp_rank: int = 1,
            compress_hidden_cache: bool = True,
            query_chunk_size: Optional[int] = 128,
            checkpoint_chunks: Optional[bool] = None,
            attn_kernel: str = 'auto',
            attn_drop: float = 0.,
            proj_drop: float = 0.,
            pos_drop: float = 0.,
            dual_ln_eps: float = 1e-5,
            device=None,
            dtype=None,
    ):
        """
        Args:
            dim: Channels D.
            num_heads: Heads h.
            window_size: W: query t sees the tokens t-W+1..t directly.
            segment_size: l: tokens per dynamic-projection segment.
            dp_rank: r: projections per segment and head.
            compress_hidden_cache: Cache segments average the hidden states and then project (official, True) or
                project and then average like the current segments (False).
            query_chunk_size: Queries per chunk (rounded up to a multiple of lcm(W, l)); each chunk scores only the
                segments its queries may see. None: one chunk, every query scores every segment (official design).
            checkpoint_chunks: Recompute each chunk in the backward pass instead of storing its scores (bounded
                memory at the price of one more chunk forward). None: only when the scores of all chunks together
                would exceed `tuning.CAUSAL_CHECKPOINT_MIN_SCORES` (2^24 elements, 64 MB in fp32).
            attn_kernel: 'auto' (the default): one FlexAttention call for all queries (`causal_flex`) on CUDA at
                inference (with Triton, without attention dropout), which launches a few kernels a layer where the
                chunk path launches a dozen a chunk; else the chunk path. 'chunks': always the chunk path; 'flex':
                always FlexAttention, training included on CUDA (its position terms then take gradients through the
                score_mod and are kept for the backward: batch x heads x queries x (vectors + W) values a layer); on
                the CPU forward only, for checks.
            attn_drop: Dropout on the attention weights.
            proj_drop: Dropout after the output projection.
            pos_drop: Dropout on the window sinusoids (official: the model's embedding dropout).
            dual_ln_eps: Epsilon of LN_L and LN_G.
        """
        dd = {'device': device, 'dtype': dtype}
        super().__init__()
        if dim % num_heads or dim % 2:
            raise ValueError(f'dim {dim} must be even and divisible by num_heads {num_heads}')
        if min(window_size, segment_size, dp_rank) < 1:
            raise ValueError('window_size, segment_size and dp_rank must be >= 1')
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.window_size = window_size
        self.segment_size = segment_size
        self.dp_rank = dp_rank
        self.compress_hidden_cache = compress_hidden_cache
        self.query_chunk_size = query_chunk_size
        self.checkpoint_chunks = checkpoint_chunks
        if attn_kernel not in CAUSAL_KERNELS:
            raise ValueError(f'attn_kernel must be one of {CAUSAL_KERNELS}, got {attn_kernel!r}')
        self.attn_kernel = attn_kernel
        self.attn_drop = attn_drop
        self.q = nn.Linear(dim, dim, bias=False, **dd)
        self.k = nn.Linear(dim, dim, bias=False, **dd)
        self.v = nn.Linear(dim, dim, bias=False, **dd)
        self.dynamic_proj = nn.Linear(dim, num_heads * dp_rank, **dd)
        self.r_net = nn.Linear(dim, dim, bias=False, **dd)
        self.r_net_chunk = nn.Linear(dim, dim, **dd)
        self.content_bias = nn.Parameter(torch.zeros(num_heads, self.head_dim, **dd))
        self.pos_bias = nn.Parameter(torch.zeros(num_heads, self.head_dim, **dd))
        self.norm_local = nn.LayerNorm(dim, eps=dual_ln_eps, **dd)
        self.norm_global = nn.LayerNorm(dim, eps=dual_ln_eps, **dd)
        self.proj = nn.Linear(dim, dim, bias=False, **dd)
        self.proj_drop = nn.Dropout(proj_drop)
        self.pos_drop = nn.Dropout(pos_drop)
        nn.init.normal_(self.content_bias, std=0.02)
        nn.init.normal_(self.pos_bias, std=0.02)
        # the checkpoint's sinusoid frequencies minus 10000^(-2k/D): zero unless a checkpoint stored rounded ones
        # (fairseq --fp16 saves them in fp16) that its model ran with. An offset rather than the frequencies, so that
        # casting the layer to fp16/bf16 does not round the frequencies (phase errors grow with the position).
        self.register_buffer('pos_freq_offset', torch.zeros(dim // 2, **dd))

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        # state_dicts saved before the offset existed ran with the exact frequencies: offset zero
        state_dict.setdefault(prefix + 'pos_freq_offset', torch.zeros_like(self.pos_freq_offset))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        """(B, n, D) -> (B, h, n, d)."""
        return t.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)

    def forward(
            self,
            x: torch.Tensor,
            cache: Optional[torch.Tensor] = None,
            cache_valid_len: Optional[int] = None,
    ) -> torch.Tensor:
        """
        Args:
            x: Current tokens (B, L, D) (LN1 output in a block), positions 0..L-1.
            cache: LN1 of the previous M raw layer inputs (B, M, D), positions -M..-1, or None (no cache).
            cache_valid_len: None: every cache token is real (official; a zero initial cache is attended too).
                k: only the last k cache tokens are real, the rest are masked (the masked-cache extension, which
                also allows M < W and M % l != 0).

        Returns:
            (B, L, D).
        """
        B, L, C = x.shape
        layout = self._layout(x, cache, cache_valid_len)
        bar_k, bar_v, seg_valid = self._segment_keys_values(x, layout)
        win_pos, seg_pos = self._relative_positions(bar_k.shape[2], x.device, x.dtype)
        if self._uses_flex(x):
            out = self._attend_flex(layout, bar_k, bar_v, win_pos, seg_pos)
        else:
            out = self._attend_chunks(layout, bar_k, bar_v, seg_valid, win_pos, seg_pos)  # (B, Lp, h, d)
        out = out[:, :L].reshape(B, L, C)
        return self.proj_drop(self.proj(out))

    def _uses_flex(self, x: torch.Tensor) -> bool:
        """Whether this call runs `_attend_flex`: 'flex', or 'auto' on CUDA with Triton at inference (no autograd
        recording, no attention dropout). 'auto' trains on the chunk path: FlexAttention's backward through the
        position terms (learnable biases, atomic adds) has not been timed on a GPU (`make gpu-check`)."""
        if self.attn_kernel == 'auto':
            dropout = self.attn_drop > 0 and self.training
            return x.device.type == 'cuda' and _HAS_TRITON and not torch.is_grad_enabled() and not dropout
        return self.attn_kernel == 'flex'

    def _attend_flex(self, layout: '_CausalLayout', bar_k: torch.Tensor, bar_v: torch.Tensor,
                     win_pos: torch.Tensor, seg_pos: torch.Tensor) -> torch.Tensor:
        """All queries in one FlexAttention call (`causal_flex`): keys [segment vectors | the W tokens before x, x],
        the position terms one matmul each, all in one dtype (autocast's: FlexAttention has no autocast rule; LN_L on
        that dtype accumulates in fp32). Returns (B, Lp, h, d), as `_attend_chunks`."""
        h, d, W, C = self.num_heads, self.head_dim, self.window_size, self.dim
        if self.training and self.attn_drop > 0:
            raise ValueError("attn_kernel='flex' has no attention dropout: call model.eval(), or use 'chunks'")
        x_cur, Mp = layout.x_cur, layout.Mp
        dtype = autocast_dtype(x_cur)
        norm = self.norm_local
        with autocast_off(x_cur.device.type):
            w_qkv, w_norm, biases = cast_stacked(
                [[self.q.weight, self.k.weight, self.v.weight], [norm.weight, norm.bias],
                 [self.content_bias, self.pos_bias]], dtype)
            # q, k, v of the window tokens, positions Mp - W .. Mp + Lp - 1, in one product (q of the first W unused)
            tokens = torch.cat([layout.pre[:, Mp - W:], x_cur], dim=1).to(dtype)
            qkv = F.linear(tokens, w_qkv.flatten(0, 1)).unflatten(-1, (3, C))
            q = self._heads(qkv[:, W:, 0] * d ** -0.5)  # (B, h, Lp, d), scaled
            kv = F.layer_norm(qkv[:, :, 1:], (C,), w_norm[0], w_norm[1], norm.eps)  # LN_L
            kv = kv.unflatten(-1, (h, d)).permute(2, 0, 3, 1, 4)  # (2, B, h, W + Lp, d)
            keys = torch.cat([bar_k.to(dtype), kv[0]], dim=2)
            values = torch.cat([bar_v.to(dtype), kv[1]], dim=2)
            seg_scores = q @ seg_pos.to(dtype).transpose(-1, -2)  # (B, h, Lp, vectors)
            win_scores = (q + biases[1][:, None]) @ win_pos.to(dtype).transpose(-1, -2)  # (B, h, Lp, W)
            key_bias = (kv[0] @ biases[0][:, :, None]).squeeze(-1)  # u . k: (B, h, W + Lp)
            geo = CausalFlexGeometry(
                num_queries=layout.Lp, num_vectors=bar_k.shape[2], window=W, offset=Mp, segment=self.segment_size,
                rank=self.dp_rank, real_from=layout.real_from, real_to=Mp + layout.x.shape[1])
            out = causal_flex_attention(q, keys, values, seg_scores, key_bias, win_scores, geo)
        return out.transpose(1, 2)

    def _layout(self, x: torch.Tensor, cache: Optional[torch.Tensor],
                cache_valid_len: Optional[int]) -> '_CausalLayout':
        """The token layout [left pad | cache | x | right pad] and which of its tokens are real.

        Whole segments, at least W tokens before position 0, current segments aligned at 0, the queries a multiple
        of lcm(W, l) (chunks of whole blocks).
        """
        B, L, C = x.shape
        W, ls = self.window_size, self.segment_size
        M = 0 if cache is None else cache.shape[1]
        if cache is not None and cache_valid_len is None and (M < W or M % ls):
            raise ValueError(
                f'cache of {M} tokens: the official layout needs M >= window_size ({W}) and M % segment_size '
                f'({ls}) == 0; pass cache_valid_len to use the masked-cache extension')
        valid_cache = M if cache_valid_len is None else max(0, min(int(cache_valid_len), M))
        unit = W * ls // math.gcd(W, ls)
        Mp = -(-max(M, W) // ls) * ls
        chunk = -(-L // unit) * unit if self.query_chunk_size is None else -(-self.query_chunk_size // unit) * unit
        Lp = -(-L // unit) * unit
        chunk = min(chunk, Lp)
        # the part before x (left pad, cache) is short and built once; x is copied only when it needs right padding
        pre_parts = [x.new_zeros(B, Mp - M, C)] if Mp > M else []
        if cache is not None:
            pre_parts.append(cache.to(x.dtype))
        pre = torch.cat(pre_parts, dim=1) if len(pre_parts) > 1 else pre_parts[0]  # (B, Mp, C)
        valid = torch.zeros(Mp + Lp, dtype=torch.bool, device=x.device)
        valid[Mp - valid_cache:Mp + L] = True
        x_cur = x if Lp == L else torch.cat([x, x.new_zeros(B, Lp - L, C)], dim=1)  # (B, Lp, C)
        return _CausalLayout(x, pre, x_cur, valid, Mp, Lp, chunk, Mp - valid_cache)

    def _segment_keys_values(self, x: torch.Tensor, layout: '_CausalLayout'
                             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Segment-wise dynamic projection: P = softmax over the l tokens of each segment (fp32), the r keys and
        values of each segment (cache and current), LN_G.

        Returns:
            (bar_k, bar_v) (B, h, S * r, d) ordered (segment, rank), and which segments hold a real token (S,).
        """
        B, L, C = x.shape
        h, d, r, ls = self.num_heads, self.head_dim, self.dp_rank, self.segment_size
        pre, Mp, Lp, valid = layout.pre, layout.Mp, layout.Lp, layout.valid
        num_seg = (Mp + Lp) // ls
        logits = torch.cat([self.dynamic_proj(pre), self.dynamic_proj(x)]
                           + ([x.new_zeros(B, Lp - L, h * r)] if Lp > L else []), dim=1)  # pads: masked below
        logits = logits.masked_fill(~valid[None, :, None], mask_value(logits.dtype))  # exp gives 0
        P = softmax_fp32(logits.reshape(B, num_seg, ls, h, r), dim=2, out_dtype=x.dtype)  # (B, S, l, h, r)
        seg_valid = valid.reshape(num_seg, ls).any(1)
        nsc = Mp // ls
        cur_k, cur_v = self._project_average(P[:, nsc:], layout.x_cur)
        if self.compress_hidden_cache:
            # cache: average the hidden states per head slice, then project (official)
            hid = torch.einsum('bstir,bstid->bsrid', P[:, :nsc], pre.reshape(B, -1, ls, h, d)).flatten(-2)
            old_k, old_v = self.k(hid), self.v(hid)
        else:
            old_k, old_v = self._project_average(P[:, :nsc], pre)
        bar_k = self.norm_global(torch.cat([old_k, cur_k], dim=1))  # (B, S, r, D), LN_G over D
        bar_v = self.norm_global(torch.cat([old_v, cur_v], dim=1))
        return self._heads(bar_k.flatten(1, 2)), self._heads(bar_v.flatten(1, 2)), seg_valid

    def _project_average(self, weights: torch.Tensor, t: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, s, r, D) of segments: (B, s, l, h, r) weights over the tokens t (B, s * l, C).

        sum_tau P_i (t_tau W_i) = (sum_tau P_i t_tau) W_i (k, v have no bias): average the inputs with each head's
        weights, then project with that head's slice: no (B, n, D) intermediate is kept.
        """
        B, C = t.shape[0], t.shape[-1]
        h, d, r, ls = self.num_heads, self.head_dim, self.dp_rank, self.segment_size
        avg = torch.einsum('bstj,bstc->bsjc', weights.flatten(3), t.reshape(B, -1, ls, C))  # (B, s, h*r, C)
        avg = avg.unflatten(2, (h, r))
        wk, wv = self.k.weight.view(h, d, C), self.v.weight.view(h, d, C)
        return (torch.einsum('bsirc,idc->bsrid', avg, wk).flatten(-2),
                torch.einsum('bsirc,idc->bsrid', avg, wv).flatten(-2))

    def _relative_positions(self, n_cv: int, device: torch.device, dtype: torch.dtype
                            ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Position terms (h, W, d) of the window distances 0..W-1 and (h, n_cv, d) of the segment vectors."""
        h, d, W, C = self.num_heads, self.head_dim, self.window_size, self.dim
        sin_w = self.pos_drop(sinusoid_positions(torch.arange(W, device=device), C, dtype, self.pos_freq_offset))
        win_pos = self.r_net(sin_w).reshape(W, h, d).transpose(0, 1)
        seg_pos = self.r_net_chunk(
            sinusoid_positions(torch.arange(n_cv, device=device), C, dtype, self.pos_freq_offset))
        return win_pos, seg_pos.reshape(n_cv, h, d).transpose(0, 1)

    def _attend_chunks(self, layout: '_CausalLayout', bar_k: torch.Tensor, bar_v: torch.Tensor,
                       seg_valid: torch.Tensor, win_pos: torch.Tensor, seg_pos: torch.Tensor) -> torch.Tensor:
        """Attention of the queries chunk by chunk (`_causal_chunk`, checkpointed when the scores are large): each
        chunk scores its window and the segment vectors before its last segment. Returns (B, Lp, h, d)."""
        x = layout.x
        B = x.shape[0]
        h, d, r, W, ls = self.num_heads, self.head_dim, self.dp_rank, self.window_size, self.segment_size
        pre, valid, Mp, Lp, chunk = layout.pre, layout.valid, layout.Mp, layout.Lp, layout.chunk
        n_cv = bar_k.shape[2]
        # window index/mask of one block: query i sees keys j in [i + 1, i + W] (of 2W), delta = i + W - j
        i = torch.arange(W, device=x.device)[:, None]
        j = torch.arange(2 * W, device=x.device)[None, :]
        win_index = (i + W - j).clamp(0, W - 1)
        band = (j >= i + 1) & (j <= i + W)
        vector_seg = torch.arange(n_cv, device=x.device) // r
        u = self.content_bias[:, None].to(x.dtype)
        v = self.pos_bias[:, None].to(x.dtype)
        dropout_p = self.attn_drop if self.training else 0.
        ckpt = self.checkpoint_chunks
        if ckpt is None:
            ckpt = B * h * Lp * (n_cv + 2 * W) > CAUSAL_CHECKPOINT_MIN_SCORES
        use_ckpt = ckpt and torch.is_grad_enabled() and chunk < Lp
        # split (not slice) the input: one backward concatenation instead of a full-size zero gradient per chunk;
        # the W window tokens before a chunk come from the previous piece (or the cache)
        starts = list(range(0, Lp, chunk))
        sizes = [min(chunk, Lp - st) for st in starts]
        x_parts = layout.x_cur.split(sizes, dim=1)
        q_weight = self.q.weight * d ** -0.5  # the scale folded into the weight
        outs = []
        for idx, start in enumerate(starts):
            t = torch.arange(start, start + sizes[idx], device=x.device)
            J = (Mp + t) // ls  # concatenated segment of each query
            # vectors of segments before the chunk's last segment (= r * J[-1], without a host sync)
            m = r * ((Mp + start + sizes[idx] - 1) // ls)
            key_ok = valid[Mp - W + start:Mp + start + sizes[idx]].unfold(0, 2 * W, W)  # (nb, 2W)
            win_masked = ~(band[None] & key_ok[:, None, :])
            args = (
                pre[:, Mp - W:] if idx == 0 else x_parts[idx - 1][:, -W:], x_parts[idx],
                q_weight, self.k.weight, self.v.weight, bar_k[:, :, :m], bar_v[:, :, :m], seg_pos[:, :m],
                self.norm_local.weight, self.norm_local.bias, self.norm_local.eps, win_pos, u, v,
                J, seg_valid[vector_seg[:m]], r, win_index, win_masked[None, None], dropout_p,
            )
            outs.append(checkpoint(_causal_chunk, *args, use_reentrant=False) if use_ckpt else _causal_chunk(*args))
        return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
