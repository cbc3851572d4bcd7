"""2D long-short attention (Transformer-LS).

Paper: `Long-Short Transformer: Efficient Transformers for Language and Vision` - https://arxiv.org/abs/2107.02192

Each patch query attends, in one joint softmax, to
  * r dynamic-projection keys per head: k_bar = LN_G(P @ LN_L(k)), P = softmax over tokens of learned logits,
  * the keys of its segment-wise window: queries are cut into w x w blocks, and all queries of a block share the
    keys of the (w + 2 * (w // 2))^2 span around it (zero padded at the border, padded keys masked),
  * the prefix (cls) keys.
Prefix queries then attend to their own keys and to the attention outputs of all patches ("post-cls" update).

The math follows NVIDIA/transformer-ls `AttentionLS` exactly. Beyond it: any H x W (non-square, not divisible by
w: queries and keys are padded and masked, the output cropped), any number of prefix tokens, and pure bf16/fp16
without autocast. The attention itself runs through `F.scaled_dot_product_attention` with the windows batched.

Written for lsvision, Apache-2.0.
"""
from typing import Callable, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from timm.layers import register_notrace_module, trunc_normal_

from .export import refuse_legacy_onnx_export
from .matmul_attention import matmul_attention
from .reparam import FoldableModule

__all__ = [
    'LongShortAttention2d', 'LinearQkv', 'LinearDynamicProjection',
    'window_span', 'window_rel_pos_table_size', 'window_rel_pos_index', 'window_size_of_rel_pos_table',
    'resize_window_rel_pos_table', 'projection_weights', 'segment_attention', 'dynamic_projection',
    'segment_padding_mask',
]


def window_span(window_size: int) -> Tuple[int, int]:
    """Key padding s and key span K = w + 2s of a segment of size w (s = max(w // 2, 1))."""
    pad = max(window_size // 2, 1)
    return pad, window_size + 2 * pad


def window_rel_pos_table_size(window_size: int) -> int:
    """Rows of the official window relative-position table: 2 (w + s' - 1)(w + 2s' + 1) + 1, s' = w // 2."""
    sp = window_size // 2
    return 2 * (window_size + sp - 1) * (window_size + 2 * sp + 1) + 1


def window_rel_pos_index(window_size: int, device: torch.device) -> torch.Tensor:
    """Official relative-position index of window queries (w^2) against window-span keys (K^2).

    With delta = query coord - key coord per axis, idx = (drow + s' + w - 1) * (w + 2s') + (dcol + s' + w - 1).
    The row multiplier is smaller than the number of column offsets, so distinct offsets can share a row of the
    table (Transformer-LS bug B1); it is reproduced as is so official checkpoints keep their meaning.
    """
    pad, span = window_span(window_size)
    sp = window_size // 2
    q = torch.arange(window_size, device=device)
    k = torch.arange(span, device=device) - pad  # key coords relative to the segment start
    delta = q[:, None] - k[None, :]  # (w, K)
    drow = delta[:, None, :, None]
    dcol = delta[None, :, None, :]
    idx = (drow + sp + window_size - 1) * (window_size + 2 * sp) + (dcol + sp + window_size - 1)
    return idx.reshape(window_size * window_size, span * span)


def window_size_of_rel_pos_table(num_rows: int) -> int:
    """The window size w whose official relative-position table has `num_rows` rows (ValueError if none)."""
    for w in range(1, 257):
        if window_rel_pos_table_size(w) == num_rows:
            return w
    raise ValueError(f'{num_rows} rows is not the size of a long-short window relative-position table')


def resize_window_rel_pos_table(table: torch.Tensor, window_size: int) -> torch.Tensor:
    """Carry a window relative-position table over to another window size, offset by offset.

    Each (row offset, col offset) that the new window uses takes the bias the old table gives that offset, with
    offsets beyond the old span clamped to its edge. Where the official index merges several offsets into one row
    (bug B1), the row takes the value of the first offset in query-major order, so the carried-over bias is exact
    for every offset that has a row of its own.

    Args:
        table: (rows, heads) table of some window size (inferred from the row count).
        window_size: The new window size.

    Returns:
        The (window_rel_pos_table_size(window_size), heads) table.
    """
    src_window = window_size_of_rel_pos_table(table.shape[0])
    if src_window == window_size:
        return table
    device = torch.device('cpu')  # index arithmetic on the CPU, also for tables on the meta device
    src_pad = src_window // 2
    # offsets of every (query, key) pair of the new window, in the order of window_rel_pos_index
    pad, span = window_span(window_size)
    q = torch.arange(window_size, device=device)
    k = torch.arange(span, device=device) - pad
    delta = q[:, None] - k[None, :]
    drow = delta[:, None, :, None].expand(window_size, window_size, span, span).reshape(-1)
    dcol = delta[None, :, None, :].expand(window_size, window_size, span, span).reshape(-1)
    dst_idx = window_rel_pos_index(window_size, device).reshape(-1)
    reach = src_window + src_pad - 1
    src_idx = (
        (drow.clamp(-reach, reach) + src_pad + src_window - 1) * (src_window + 2 * src_pad)
        + dcol.clamp(-reach, reach) + src_pad + src_window - 1
    )
    # first pair (query-major) of every row of the new table
    rows, inverse = torch.unique(dst_idx, return_inverse=True)
    first = torch.full((rows.numel(),), dst_idx.numel(), dtype=torch.long, device=device)
    first = first.scatter_reduce(0, inverse, torch.arange(dst_idx.numel(), device=device), reduce='amin')
    out = table.new_zeros(window_rel_pos_table_size(window_size), table.shape[1])
    out[rows.to(table.device)] = table[src_idx[first].to(table.device)]
    return out


class LinearQkv(nn.Linear):
    """Fused q, k, v Linear over all tokens (ViL-LS). Output rows [0:C] = q, [C:2C] = k, [2C:3C] = v."""

    def __init__(self, dim: int, bias: bool = True, device=None, dtype=None):
        super().__init__(dim, 3 * dim, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, feat_size: Tuple[int, int], num_prefix_tokens: int) -> torch.Tensor:
        """Returns q, k, v stacked: (3, B, N, C)."""
        B, N, C = x.shape
        return F.linear(x, self.weight, self.bias).reshape(B, N, 3, C).permute(2, 0, 1, 3)


class LinearDynamicProjection(nn.Linear):
    """Dynamic-projection logits from a Linear over the patch tokens (ViL-LS `to_dynamic_projection`)."""

    def __init__(self, dim: int, num_proj: int, device=None, dtype=None):
        super().__init__(dim, num_proj, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


# The window attention runs over blocks of samples or segment rows whose gathered keys take about this many bytes.
_CHUNK_BYTES = 8 << 20

# Segments of at most this many queries skip SDPA on CPU: its flash kernel costs a few microseconds per
# (batch x head x segment) block, which dominates when a block is 4 queries against ~20 keys (w = 2: measured 2.4 ms
# against 0.6 ms for the batched matmuls below, for CvT-LS stage 3 at 384 px on 2 cores). Larger segments, and every
# segment on other devices, run through F.scaled_dot_product_attention.
_SMALL_SEGMENT = 16


def segment_attention(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor,
        dropout_p: float = 0.,
        scale: Optional[float] = None,
        small: bool = False,
) -> torch.Tensor:
    """Attention of segment-wise query blocks to their gathered keys (projected + window span [+ prefix]).

    The core shared by the 2D and 1D long-short layers: q (B, n, L, d) against k, v (B, n, S, d) with an additive
    mask broadcastable to (B, n, L, S). Small blocks on CPU run as batched matmuls (see `_SMALL_SEGMENT`), the rest
    through `F.scaled_dot_product_attention`. Softmax in fp32 either way.
    """
    if small and q.device.type == 'cpu':
        return matmul_attention(q, k, v, mask, dropout_p, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)


def projection_weights(
        logits: torch.Tensor,
        num_heads: int,
        valid: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Dynamic-projection weights P = softmax over the tokens of the projection logits, in fp32.

    Args:
        logits: (B, n, h * r) logits, channel = head * r + j (the official layout).
        num_heads: h.
        valid: Optional (B, n) bool, False on padded tokens: they get weight exactly 0. An all-padded row gets
            uniform weights instead of NaN (its outputs are masked downstream anyway).

    Returns:
        P: (B, h, r, n) in the dtype of `logits`; each row sums to 1 over the valid tokens.
    """
    B, n, hr = logits.shape
    dtype = logits.dtype
    if dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if valid is not None:
        logits = logits.masked_fill(~valid[:, :, None], -3.4028234663852886e38)  # fp32 min: exp gives 0
    proj = logits.transpose(1, 2).reshape(B, num_heads, hr // num_heads, n).softmax(dim=-1)
    return proj.to(dtype)


def dynamic_projection(
        kv: torch.Tensor,
        logits: torch.Tensor,
        norm_global: nn.Module,
        valid: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The dynamic projection of any token sequence: k_bar, v_bar = LN_G(P k), LN_G(P v).

    P = softmax over the tokens of the projection logits (fp32 or wider), one row per head and projection; padded
    tokens get weight exactly 0. An all-padded sample gets a uniform P (finite keys) instead of NaN. The projected keys
    of HSW-LS; `LongShortAttention2d` does the same inline (TorchScript takes no module argument).

    Args:
        kv: Keys and values after LN_L, (2, B, h, N, d).
        logits: Projection logits (B, N, h * r), channel = head * r + j.
        norm_global: LN_G over the merged heads (h * d channels), shared by keys and values.
        valid: (B, N) bool, True on real tokens; None if there is no padding.

    Returns:
        Projected keys and values (2, B, h, r, d), in the dtype of `norm_global`'s output.
    """
    _, B, h, N, d = kv.shape
    proj = projection_weights(logits, h, valid).to(kv.dtype)  # (B, h, r, N)
    r = proj.shape[2]
    kv_bar = (proj @ kv).transpose(2, 3).reshape(2, B, r, h * d)
    return norm_global(kv_bar).reshape(2, B, r, h, d).transpose(2, 3)


def segment_padding_mask(
        feat_size: Tuple[int, int],
        window_size: int,
        num_proj: int,
        num_prefix: int,
        repeat: int,
        dtype: torch.dtype,
        device: torch.device,
) -> torch.Tensor:
    """Additive mask of the keys of every segment, [projected (r) | window span (K^2) | prefix (g)].

    -inf on the window keys that fall on the zero padding (outside the H x W map), 0 elsewhere. Segments are in
    row-major order, the whole set repeated `repeat` times (once per head).

    Returns:
        (1, repeat * Gy * Gx, 1, r + K^2 + g) mask.
    """
    H, W = feat_size
    pad, span = window_span(window_size)
    gy, gx = (H + window_size - 1) // window_size, (W + window_size - 1) // window_size
    valid = torch.zeros(gy * window_size + 2 * pad, gx * window_size + 2 * pad, dtype=torch.bool, device=device)
    valid[pad:pad + H, pad:pad + W] = True
    valid = valid.unfold(0, span, window_size).unfold(1, span, window_size).reshape(gy * gx, span * span)
    mask = torch.zeros(repeat, gy * gx, num_proj + span * span + num_prefix, dtype=dtype, device=device)
    mask[:, :, num_proj:num_proj + span * span].masked_fill_(~valid, float('-inf'))
    return mask.reshape(1, repeat * gy * gx, 1, mask.shape[-1])


@register_notrace_module  # shape arithmetic on the map size: keep it a leaf for torch.fx
class LongShortAttention2d(FoldableModule):
    """Long-short attention over a 2D token map with optional prefix (cls) tokens.

    Input tokens are (B, g + H * W, C): g prefix tokens first, then the map in row-major order. g is inferred
    from the token count and `feat_size`, so any g >= 0 works.

    The q, k, v and projection-logit modules are arguments (the layer knows no model), called as
    `qkv(x, feat_size, num_prefix_tokens) -> (3, B, N, C)` on all tokens and `dynamic_proj(patches, feat_size) ->
    (B, H * W, h * r)` on the patch tokens. For inference a qkv module may fuse itself with the projection-logit
    module: if it has `fuse_projections(dynamic_proj)` and that returns a module, `reparameterize` puts it in
    their place as `fused_proj`, called as `fused_proj(x, feat_size, num_prefix_tokens) -> (qkv, logits)`.
    """

    def __init__(
            self,
            dim: int,
            num_heads: int = 8,
            window_size: int = 7,
            dp_rank: int = 8,
            qkv_bias: bool = True,
            qkv_layer: Optional[Callable[..., nn.Module]] = None,
            dp_layer: Callable[..., nn.Module] = LinearDynamicProjection,
            rel_pos_bias: bool = False,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
            dual_ln_eps: float = 1e-5,
            device=None,
            dtype=None,
    ):
        """
        Args:
            dim: Channels C.
            num_heads: Attention heads h; head dim is C / h.
            window_size: Segment size w; each w x w block of queries sees a (w + 2 * (w // 2))^2 key span.
            dp_rank: Dynamic projections r per head.
            qkv_bias: Bias in the default fused qkv Linear (`LinearQkv`); a `qkv_layer` builds its own biases.
            qkv_layer: The q, k, v module, built as `qkv_layer(dim, device=, dtype=)`; None for the fused Linear
                `LinearQkv` (ViL-LS). CvT-LS passes its depthwise-separable convs.
            dp_layer: The projection-logit module, built as `dp_layer(dim, num_heads * dp_rank, device=, dtype=)`:
                a Linear (`LinearDynamicProjection`, ViL-LS) by default. CvT-LS passes its conv projection.
            rel_pos_bias: Add the official window relative-position bias to the window scores.
            attn_drop: Dropout on the joint attention weights of the patch queries.
            proj_drop: Dropout after the output projection.
            dual_ln_eps: Epsilon of the DualLN pair.
        """
        dd = {'device': device, 'dtype': dtype}
        super().__init__()
        assert dim % num_heads == 0, f'dim {dim} must be divisible by num_heads {num_heads}'
        for name, layer in (('qkv_layer', qkv_layer), ('dp_layer', dp_layer)):
            if layer is not None and not callable(layer):
                raise TypeError(
                    f'{name} must be a module class or callable that builds the module, got {layer!r}; the CvT-LS '
                    'convs are lsvision.models.cvt.SepConvQkv and ConvDynamicProjection')
        if qkv_layer is not None and not qkv_bias:
            raise ValueError('qkv_bias=False applies to the default LinearQkv only; pass a qkv_layer that builds '
                             'the biases it wants (e.g. a functools.partial) instead')
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.window_size = window_size
        self.dp_rank = dp_rank
        self.attn_drop = attn_drop
        self.small_segment = window_size * window_size <= _SMALL_SEGMENT
        self.chunk_bytes = _CHUNK_BYTES

        if qkv_layer is None:
            self.qkv = LinearQkv(dim, bias=qkv_bias, **dd)
        else:
            self.qkv = qkv_layer(dim, **dd)
        self.dynamic_proj = dp_layer(dim, num_heads * dp_rank, **dd)
        self.norm_local = nn.LayerNorm(dim, eps=dual_ln_eps, **dd)  # LN_L on k and v
        self.norm_global = nn.LayerNorm(dim, eps=dual_ln_eps, **dd)  # LN_G on the projected k and v
        if rel_pos_bias:
            self.rel_pos_table = nn.Parameter(torch.zeros(window_rel_pos_table_size(window_size), num_heads, **dd))
            trunc_normal_(self.rel_pos_table, std=.02)
        else:
            self.rel_pos_table = None
        self.proj = nn.Linear(dim, dim, **dd)
        self.proj_drop = nn.Dropout(proj_drop)
        self.fused_proj: Optional[nn.Module] = None  # qkv and dynamic_proj fused by `reparameterize`, if they fuse

    @torch.no_grad()
    def reparameterize(self) -> None:
        """Put the fusion of `qkv` and `dynamic_proj` in their place, where the qkv module offers one
        (`qkv.fuse_projections(dynamic_proj)` returns a module: `fused_proj`; `qkv` and `dynamic_proj` become None).
        Layers without one are left to their children.

        Called by `timm.models.reparameterize_model`; afterwards a fused layer is inference-only.
        """
        fuse = getattr(self.qkv, 'fuse_projections', None)
        fused = fuse(self.dynamic_proj) if fuse is not None else None
        if fused is None:
            return
        self.fused_proj = fused
        self.qkv = None
        self.dynamic_proj = None
        self._set_reparameterized()

    def _attention_mask(
            self,
            feat_size: Tuple[int, int],
            num_prefix: int,
            dtype: torch.dtype,
            device: torch.device,
    ) -> torch.Tensor:
        """Additive mask over [projected (r) | window (K^2) | prefix (g)] keys: (1, h * Gy * Gx, 1 or w^2, L).

        -inf on the zero-padded window keys, plus the window relative-position bias if the layer has one.
        """
        h = self.num_heads
        if self.rel_pos_table is None:
            return segment_padding_mask(feat_size, self.window_size, self.dp_rank, num_prefix, h, dtype, device)
        base = segment_padding_mask(feat_size, self.window_size, self.dp_rank, num_prefix, 1, dtype, device)
        ws = self.window_size
        _, span = window_span(ws)
        idx = window_rel_pos_index(ws, device)
        bias = self.rel_pos_table[idx.reshape(-1)].reshape(ws * ws, span * span, h).permute(2, 0, 1)
        bias = F.pad(bias.to(dtype), (self.dp_rank, num_prefix))[:, None]  # (h, 1, w^2, L): 0 on r and g
        num_tiles = base.shape[1]
        return (base + bias).reshape(1, h * num_tiles, ws * ws, base.shape[-1])

    def _window_attention(
            self,
            q_rows: torch.Tensor,
            kv_rows: torch.Tensor,
            kv_bar: torch.Tensor,
            kv_prefix: torch.Tensor,
            mask: torch.Tensor,
            dropout_p: float,
    ) -> torch.Tensor:
        """Attention of a block of segment rows to [projected (r) | window span (K^2) | prefix (g)] keys.

        Args:
            q_rows: Queries of b samples and n segment rows, (b, n, w, gx, w, h, d) (a view of the padded map).
            kv_rows: Zero-padded keys and values of the same rows plus the 2s rows around them,
                (2, b, h, n * w + 2s, gx * w + 2s, d).
            kv_bar: Projected keys and values (2, b, h, r, d).
            kv_prefix: Prefix keys and values (2, b, h, g, d).
            mask: Additive mask (1, h * n * gx, 1 or w^2, r + K^2 + g).

        Returns:
            Outputs (b, n, w, gx, w, h, d), a permuted view.
        """
        b, n, ws, gx, _, h, d = q_rows.shape
        pad, span = window_span(ws)
        r, g = kv_bar.shape[3], kv_prefix.shape[3]
        num_tiles = n * gx
        q_tiles = q_rows.permute(0, 5, 1, 3, 2, 4, 6).reshape(b, h * num_tiles, ws * ws, d)
        # keys and values of every segment in one buffer, each part written once (no concatenation copies); the
        # shared projected and prefix keys as flat rows of r * d and g * d
        tiles = kv_rows.unfold(3, span, ws).unfold(4, span, ws)  # (2, b, h, n, gx, d, K, K)
        kv = kv_rows.new_empty(2 * b * h, num_tiles, r + span * span + g, d)
        kv[:, :, :r].view(2 * b * h, num_tiles, r * d).copy_(
            kv_bar.reshape(2 * b * h, 1, r * d).expand(-1, num_tiles, -1))
        kv[:, :, r:r + span * span].view(2, b, h, n, gx, span, span, d).copy_(tiles.permute(0, 1, 2, 3, 4, 6, 7, 5))
        if g > 0:
            kv[:, :, r + span * span:].view(2 * b * h, num_tiles, g * d).copy_(
                kv_prefix.reshape(2 * b * h, 1, g * d).expand(-1, num_tiles, -1))
        kv = kv.view(2, b, h * num_tiles, r + span * span + g, d)
        out = segment_attention(q_tiles, kv[0], kv[1], mask, dropout_p, small=self.small_segment)
        return out.view(b, h, n, gx, ws, ws, d).permute(0, 2, 4, 3, 5, 1, 6)

    def forward(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        """
        Args:
            x: Tokens (B, g + H * W, C).
            feat_size: Map size (H, W).

        Returns:
            Tokens (B, g + H * W, C).
        """
        refuse_legacy_onnx_export('LongShortAttention2d')
        B, N, C = x.shape
        H, W = feat_size
        num_patches = H * W
        num_prefix = N - num_patches
        torch._assert(num_prefix >= 0, 'LongShortAttention2d: fewer tokens than H * W')
        h, d, r, ws = self.num_heads, self.head_dim, self.dp_rank, self.window_size

        if self.fused_proj is not None:  # reparameterized CvT-LS convs
            qkv, logits = self.fused_proj(x, feat_size, num_prefix)
        else:
            qkv = self.qkv(x, feat_size, num_prefix)  # (3, B, N, C)
            logits = self.dynamic_proj(x[:, num_prefix:], feat_size)
        q = qkv[0]
        kv = self.norm_local(qkv[1:])  # (2, B, N, C): LN_L on keys and values

        # dynamic projection: P = softmax over tokens (fp32), k_bar = LN_G(P k), v_bar = LN_G(P v)
        kv_patch = kv[:, :, num_prefix:].reshape(2, B, num_patches, h, d).transpose(2, 3)  # (2, B, h, Np, d)
        proj = projection_weights(logits, h)  # (B, h, r, Np)
        kv_bar = (proj @ kv_patch).transpose(2, 3).reshape(2, B, r, C)
        kv_bar = self.norm_global(kv_bar).reshape(2, B, r, h, d).transpose(2, 3)  # (2, B, h, r, d)
        kv_prefix = kv[:, :, :num_prefix].reshape(2, B, num_prefix, h, d).transpose(2, 3)

        # segment-wise windows: queries in w x w tiles (map padded to whole segments), keys in K x K spans
        gy, gx = (H + ws - 1) // ws, (W + ws - 1) // ws
        pad, span = window_span(ws)
        q_patch = q[:, num_prefix:].reshape(B, H, W, h, d)
        if H != gy * ws or W != gx * ws:
            q_patch = F.pad(q_patch, (0, 0, 0, 0, 0, gx * ws - W, 0, gy * ws - H))
        q_patch = q_patch.reshape(B, gy, ws, gx, ws, h, d)
        # zero padding: s around the map, plus the rows/cols that complete the last segments
        kv_padded = F.pad(kv_patch.reshape(2, B, h, H, W, d), (0, 0, pad, gx * ws + pad - W, pad, gy * ws + pad - H))
        # additive mask over [dp (r) | window (K^2) | prefix (g)]: -inf on padded keys, window bias if any
        mask = self._attention_mask(feat_size, num_prefix, q.dtype, q.device)
        mq, num_keys = mask.shape[2], mask.shape[3]

        # outputs go straight into the token buffer (B, N, h, d) where the map has whole segments
        tokens = x.new_empty(B, N, h, d)
        if H == gy * ws and W == gx * ws:
            out_map = tokens[:, num_prefix:].view(B, gy, ws, gx, ws, h, d)
        else:
            out_map = x.new_empty(B, gy, ws, gx, ws, h, d)
        # blocks of samples (small maps) or segment rows (large maps) whose gathered keys take at most about
        # `chunk_bytes`: they stay in cache, and glibc does not map (and page-fault) fresh memory for them per call
        sample_bytes = 2 * h * gy * gx * num_keys * d * x.element_size()
        samples = max(1, min(B, self.chunk_bytes // sample_bytes))
        rows = gy if sample_bytes <= self.chunk_bytes else max(1, self.chunk_bytes * gy // sample_bytes)
        dropout_p = self.attn_drop if self.training else 0.
        for s0 in range(0, B, samples):
            s1 = min(B, s0 + samples)
            for y0 in range(0, gy, rows):
                y1 = min(gy, y0 + rows)
                if y1 - y0 == gy:
                    mask_rows = mask
                else:
                    mask_rows = mask.view(mask.shape[0], h, gy, gx, mq, num_keys)[:, :, y0:y1]
                    mask_rows = mask_rows.reshape(mask.shape[0], h * (y1 - y0) * gx, mq, num_keys)
                out_map[s0:s1, y0:y1] = self._window_attention(
                    q_patch[s0:s1, y0:y1],
                    kv_padded[:, s0:s1, :, y0 * ws:y1 * ws + 2 * pad],
                    kv_bar[:, s0:s1],
                    kv_prefix[:, s0:s1],
                    mask_rows,
                    dropout_p,
                )
        if H != gy * ws or W != gx * ws:
            tokens[:, num_prefix:].unflatten(1, (H, W)).copy_(out_map.reshape(B, gy * ws, gx * ws, h, d)[:, :H, :W])

        if num_prefix > 0:
            # post-cls update: prefix queries attend to the prefix keys and to the patches' attention outputs
            out = tokens[:, num_prefix:].transpose(1, 2)  # (B, h, Np, d)
            q_prefix = q[:, :num_prefix].reshape(B, num_prefix, h, d).transpose(1, 2)
            prefix_out = F.scaled_dot_product_attention(
                q_prefix, torch.cat([kv_prefix[0], out], dim=2), torch.cat([kv_prefix[1], out], dim=2))
            tokens[:, :num_prefix] = prefix_out.transpose(1, 2)

        x = self.proj(tokens.reshape(B, N, C))
        x = self.proj_drop(x)
        return x
