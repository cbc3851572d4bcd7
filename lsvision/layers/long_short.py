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
import importlib.util
from typing import Callable, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from timm.layers import register_notrace_module, trunc_normal_

from .autocast import autocast_dtype, autocast_off, cast_stacked
from .export import refuse_legacy_onnx_export, training_paths_enabled
from .local_norm import local_norm_tokens, recompute_local_norm
from .reparam import FoldableModule
from .softmax import mask_value, softmax_fp32
from .span_attention import (
    span_attention,
    span_attention_local_norm,
    span_window_key_mask,
    window_span,
)
from .span_flex import FLEX_ORDERS, span_flex_attention
from .tuning import BLOCK_DIAGONAL_MAX_MACS

__all__ = [
    'LongShortAttention2d', 'LinearQkv', 'LinearDynamicProjection',
    'window_span', 'window_rel_pos_table_size', 'window_rel_pos_index', 'window_size_of_rel_pos_table',
    'resize_window_rel_pos_table', 'projection_weights', 'project_keys_values', 'dynamic_projection',
    'SPAN_KERNELS', 'set_span_kernel',
]

# the window attention's kernel: 'span' the span path (`span_attention`: CPU batched matmuls / flash, CUDA
# memory-efficient kernels on blocks of segments), 'flex' one FlexAttention call per layer (`span_flex`), 'auto' the
# flex path where it runs and launches fewer kernels (CUDA, no attention dropout: docs/benchmarks/cuda_counting.md),
# else the span path
SPAN_KERNELS = ('auto', 'span', 'flex')
# FlexAttention compiles its kernels with Triton (bundled with torch's Linux CUDA wheels): 'auto' needs it
_HAS_TRITON = importlib.util.find_spec('triton') is not None


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

    def forward(
            self,
            x: torch.Tensor,
            feat_size: Tuple[int, int],
            num_prefix_tokens: int,
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns q, k, v of the patch tokens, (B, H * W, C) each, and the prefix tokens' q, k, v, (3, B, g, C)."""
        B, N, C = x.shape
        qkv = F.linear(x, self.weight, self.bias).reshape(B, N, 3, C)
        # split, not two slices: its backward is one cat (each slice's would write a zero-filled full gradient)
        prefix, patches = qkv.split([num_prefix_tokens, N - num_prefix_tokens], dim=1)
        q, k, v = patches.unbind(2)
        return q, k, v, prefix.permute(2, 0, 1, 3)


class LinearDynamicProjection(nn.Linear):
    """Dynamic-projection logits from a Linear over the patch tokens (ViL-LS `to_dynamic_projection`)."""

    def __init__(self, dim: int, num_proj: int, device=None, dtype=None):
        super().__init__(dim, num_proj, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


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
    if valid is not None:
        logits = logits.masked_fill(~valid[:, :, None], mask_value(logits.dtype))  # exp gives 0
    return softmax_fp32(logits.transpose(1, 2).reshape(B, num_heads, hr // num_heads, n))


def project_keys_values(proj: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """P @ k and P @ v: (B, h, r, N) weights and (B, h, N, d) keys and values -> (2, B, h, r, d).

    One matmul each: a matmul broadcasting P over keys and values would copy P, and autograd would keep the copy.
    """
    return torch.stack([torch.matmul(proj, k), torch.matmul(proj, v)])


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
    kv_bar = project_keys_values(proj, kv[0], kv[1]).transpose(2, 3).reshape(2, B, r, h * d)
    return norm_global(kv_bar).reshape(2, B, r, h, d).transpose(2, 3)


def _head_slice(i: int, head_dim: int) -> slice:
    return slice(i * head_dim, (i + 1) * head_dim)


def _bmm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out = a @ b for a strided view `out` (a head's slice): BLAS writes it in place; a compiled graph (dynamo takes
    no strided `out=`) copies the product in."""
    if torch.compiler.is_compiling():
        out.copy_(torch.bmm(a, b))
    else:
        torch.bmm(a, b, out=out)


def _block_diagonal_heads(proj: torch.Tensor, channels: int) -> bool:
    """Whether `_LocalNormProjection` runs all heads in one block-diagonal matmul (h times the multiply-adds of the
    per-head products, one matmul instead of h): always on CUDA, on CPU up to `tuning.BLOCK_DIAGONAL_MAX_MACS`."""
    _, h, r, n = proj.shape
    return h > 1 and (proj.device.type != 'cpu' or r * n * channels <= BLOCK_DIAGONAL_MAX_MACS)


class _LocalNormProjection(torch.autograd.Function):
    """P @ k_norm, P @ v_norm, keeping P and the keys and values before LN_L (`local_norm_projection`).

    The normalized keys and values stay tokens, (B, N, C): nothing is copied into a heads-first layout, in forward or
    backward. Each product is either one matmul per head on its channel slice (a strided view that BLAS reads as it
    lies, and that the key gradient is written into), or, where that is cheaper (`_block_diagonal_heads`), one matmul
    for all heads: P of every head (B, h * r, N) against all channels, of which the diagonal blocks (head i's rows, its
    channels) are the products, and a block-diagonal gradient (zero off the diagonal) that gives the exact gradients of
    P and of the keys and values in one matmul each.
    """

    @staticmethod
    def forward(ctx, proj, k_norm, v_norm, k, v, weight, bias, eps: float):
        k_norm, v_norm = k_norm.to(proj.dtype), v_norm.to(proj.dtype)
        B, h, r, N = proj.shape
        C = k_norm.shape[-1]
        d = C // h
        ctx.block_diagonal = _block_diagonal_heads(proj, C)
        ctx.eps = eps
        ctx.save_for_backward(proj, k, v, weight, bias)
        if ctx.block_diagonal:
            full = proj.new_empty(2, B, h * r, C)
            proj_all = proj.reshape(B, h * r, N)
            _bmm_into(proj_all, k_norm, full[0])
            _bmm_into(proj_all, v_norm, full[1])
            # head i's rows against its own channels: (2, B, r, d, h) diagonal, heads first
            return torch.diagonal(full.view(2, B, h, r, h, d), dim1=2, dim2=4).permute(0, 1, 4, 2, 3).contiguous()
        out = proj.new_empty(2, B, h, r, d)
        for i in range(h):
            _bmm_into(proj[:, i], k_norm[..., _head_slice(i, d)], out[0, :, i])
            _bmm_into(proj[:, i], v_norm[..., _head_slice(i, d)], out[1, :, i])
        return out

    @staticmethod
    def backward(ctx, grad_out):
        with autocast_off(grad_out.device.type):
            proj, k, v, weight, bias = ctx.saved_tensors
            grad_out = grad_out.to(proj.dtype)
            k_norm = v_norm = None
            if ctx.needs_input_grad[0]:
                k_norm, v_norm = local_norm_tokens(k, v, weight, bias, ctx.eps)  # as in forward
                k_norm, v_norm = k_norm.to(proj.dtype), v_norm.to(proj.dtype)
            if ctx.block_diagonal:
                grad_proj, grad_norm = _LocalNormProjection._block_diagonal_backward(grad_out, proj, k_norm, v_norm, k)
            else:
                grad_proj, grad_norm = _LocalNormProjection._per_head_backward(grad_out, proj, k_norm, v_norm, k)
            grad_norm = grad_norm.to(k.dtype)  # the normalized keys' dtype (LN_L runs in k's)
        return grad_proj, grad_norm[0], grad_norm[1], None, None, None, None, None

    @staticmethod
    def _per_head_backward(grad_out, proj, k_norm, v_norm, k):
        """Gradients of P (None without `k_norm`) and of the normalized keys and values (2, B, N, C), head by head."""
        h = proj.shape[1]
        d = k.shape[-1] // h
        grad_proj = None
        if k_norm is not None:
            grad_proj = torch.empty_like(proj)
            for i in range(h):
                heads = _head_slice(i, d)
                _bmm_into(grad_out[0, :, i], k_norm[..., heads].transpose(1, 2), grad_proj[:, i])
                grad_proj[:, i].baddbmm_(grad_out[1, :, i], v_norm[..., heads].transpose(1, 2))
        # the gradients of the normalized keys and values, written head by head into token maps
        grad_norm = proj.new_empty((2,) + k.shape)
        for i in range(h):
            proj_t = proj[:, i].transpose(1, 2)  # (B, N, r)
            _bmm_into(proj_t, grad_out[0, :, i], grad_norm[0, ..., _head_slice(i, d)])
            _bmm_into(proj_t, grad_out[1, :, i], grad_norm[1, ..., _head_slice(i, d)])
        return grad_proj, grad_norm

    @staticmethod
    def _block_diagonal_backward(grad_out, proj, k_norm, v_norm, k):
        """As `_per_head_backward`, for all heads at once: the output gradient as a block-diagonal (B, h * r, C)."""
        B, h, r, N = proj.shape
        C = k.shape[-1]
        d = C // h
        grad_full = grad_out.new_zeros(2, B, h, r, h, d)
        torch.diagonal(grad_full, dim1=2, dim2=4).copy_(grad_out.permute(0, 1, 3, 4, 2))
        grad_full = grad_full.view(2, B, h * r, C)
        grad_proj = None
        if k_norm is not None:
            grad_proj = proj.new_empty(B, h * r, N)
            _bmm_into(grad_full[0], k_norm.transpose(1, 2), grad_proj)
            grad_proj = grad_proj.baddbmm_(grad_full[1], v_norm.transpose(1, 2)).view(B, h, r, N)
        grad_norm = proj.new_empty((2,) + k.shape)
        proj_t = proj.reshape(B, h * r, N).transpose(1, 2)  # (B, N, h * r)
        _bmm_into(proj_t, grad_full[0], grad_norm[0])
        _bmm_into(proj_t, grad_full[1], grad_norm[1])
        return grad_proj, grad_norm


@torch.jit.unused  # training only (TorchScript runs the plain path)
def local_norm_projection(
        proj: torch.Tensor,
        k_norm: torch.Tensor,
        v_norm: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        weight: Optional[torch.Tensor],
        bias: Optional[torch.Tensor],
        eps: float,
) -> torch.Tensor:
    """The dynamic projection of the LN_L-normed keys and values, P @ k_norm and P @ v_norm, for training.

    The same as ``proj @ (k_norm, v_norm) heads first``, but autograd keeps P and the keys and values before the norm
    (views of the q, k, v projections, kept anyway), not the normalized ones: the backward normalizes again
    (`lsvision.layers.local_norm`) and returns the gradients of `k_norm` and `v_norm`, for LN_L's own backward.

    Args:
        proj: Projection weights P (B, h, r, N).
        k_norm, v_norm: LN_L(k), LN_L(v) (`local_norm.local_norm_tokens`), (B, N, C).
        k, v: Keys and values before LN_L, (B, N, C); any strides.
        weight, bias, eps: LN_L's parameters.

    Returns:
        (2, B, h, r, d) in the compute dtype (under autocast, its dtype).
    """
    dtype = autocast_dtype(proj)
    with autocast_off(proj.device.type):
        return _LocalNormProjection.apply(proj.to(dtype), k_norm, v_norm, k, v, weight, bias, eps)


@register_notrace_module  # shape arithmetic on the map size: keep it a leaf for torch.fx
class LongShortAttention2d(FoldableModule):
    """Long-short attention over a 2D token map with optional prefix (cls) tokens.

    Input tokens are (B, g + H * W, C): g prefix tokens first, then the map in row-major order. g is inferred
    from the token count and `feat_size`, so any g >= 0 works.

    The q, k, v and projection-logit modules are arguments (the layer knows no model), called as
    `qkv(x, feat_size, num_prefix_tokens) -> (q, k, v, qkv_prefix)` on all tokens (the patch tokens' q, k and v,
    (B, H * W, C) each, and the prefix tokens' stacked, (3, B, g, C): the layer uses the two apart, and separate
    tensors need no slicing, stacking or unbinding, nor their copies in backward) and `dynamic_proj(patches,
    feat_size) -> (B, H * W, h * r)` on the patch tokens. For inference a qkv module may fuse itself with the
    projection-logit module: if it has `fuse_projections(dynamic_proj)` and that returns a module, `reparameterize`
    puts it in their place as `fused_proj`, called as `fused_proj(x, feat_size, num_prefix_tokens) -> (q, k, v,
    qkv_prefix, logits)`. For the CUDA (flex) path it may compute both in one pass: if it has
    `project_with(dynamic_proj, x, feat_size, num_prefix_tokens)` and that returns a tuple (q, k and v stacked as
    (2, B, H * W, C), the prefix tokens' q, k, v, the logits), the layer uses it; None there means the layer calls
    the two modules.
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
            span_kernel: str = 'auto',
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
            span_kernel: The window attention's kernel: 'auto' (the default: the flex path on CUDA with Triton and
                without attention dropout or a window-bias gradient, else the span path), 'span' (the span path,
                `span_attention`) or 'flex' (one FlexAttention call per layer; on the CPU inference only).
                `set_span_kernel` changes it, with the flex path's token order and block size, on a built model.
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
        self.span_kernel = 'auto'
        self.flex_order = 'segment'
        self.flex_block_size = 128
        _set_layer_span_kernel(self, span_kernel, self.flex_order, self.flex_block_size)

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

    def _window_mask(self, feat_size: Tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Additive mask of the window-span keys: (1, h or 1, Gy * Gx, w^2 or 1, K^2).

        `mask_value` on the zero-padded keys, plus the window relative-position bias if the layer has one.
        """
        ws = self.window_size
        mask = span_window_key_mask(list(feat_size), ws, dtype, device)[None, None, :, None]  # (1, 1, n, 1, K^2)
        if self.rel_pos_table is None:
            return mask
        _, span = window_span(ws)
        idx = window_rel_pos_index(ws, device)
        bias = self.rel_pos_table[idx.reshape(-1)].reshape(ws * ws, span * span, self.num_heads).permute(2, 0, 1)
        return mask + bias.to(dtype)[None, :, None]  # (1, h, n, w^2, K^2)

    def _uses_flex(self, x: torch.Tensor, dropout_p: float) -> bool:
        """Whether this call runs the flex path: `span_kernel='flex'`, or 'auto' on CUDA with Triton, without attention
        dropout and without a gradient for the window bias (the fake device, which the counts and tests run on, gives
        FlexAttention gradients of q, k and v only; the span path is the tested one there)."""
        if torch.jit.is_scripting():
            return False
        if self.span_kernel == 'auto':
            table = self.rel_pos_table
            bias_grad = table is not None and table.requires_grad and torch.is_grad_enabled()
            return x.device.type == 'cuda' and dropout_p == 0. and not bias_grad and _HAS_TRITON
        return self.span_kernel == 'flex'

    @torch.jit.unused  # TorchScript runs the span path
    def _forward_flex(self, x: torch.Tensor, feat_size: Tuple[int, int], dropout_p: float) -> torch.Tensor:
        """The layer with its windows as one FlexAttention call (`span_flex.span_flex_attention`): the CUDA path.

        Written for few kernels and few bytes (the span path is written for the CPU): after the projections it runs
        in one dtype (autocast's, else the input's), LN_L and LN_G on that dtype (the kernels accumulate in fp32, as
        the softmax of the projection weights does), keys and values stacked so that each step serves both, the
        dynamic projection of all heads as one product, and the prefix tokens' update as one SDPA call; no mask or
        bias is materialized. The same math as the span path (tested against it).
        """
        if dropout_p > 0.:
            raise ValueError(f"span_kernel='flex' has no attention dropout (attn_drop={self.attn_drop}): build the "
                             "model with attn_drop=0, or use span_kernel='span'")
        B, N, C = x.shape
        H, W = feat_size
        num_patches = H * W
        g = N - num_patches
        h, d, r = self.num_heads, self.head_dim, self.dp_rank
        # the projections in one pass where the qkv module offers it (CvT-LS's convs: one cast of the map)
        joint = getattr(self.qkv, 'project_with', None) if self.fused_proj is None else None
        projected = joint(self.dynamic_proj, x, feat_size, g) if joint is not None else None
        if projected is not None:
            q, kv, qkv_prefix, logits = projected  # k and v one buffer (2, B, Np, C)
        else:
            q, k, v, qkv_prefix, logits = self.projections(x, feat_size)
            kv = torch.stack([k, v])
        dtype = autocast_dtype(q)  # FlexAttention has no autocast rule: one dtype for all
        norm, norm_g = self.norm_local, self.norm_global
        with autocast_off(x.device.type):
            # LN_L's and LN_G's parameters cast in two kernels (`cast_stacked`), not four
            (ln_w, ln_b), (ng_w, ng_b) = cast_stacked([[norm.weight, norm.bias], [norm_g.weight, norm_g.bias]], dtype)
            proj = torch.softmax(logits.to(dtype), dim=1)  # P over the tokens, (B, Np, h * r)
            kv = F.layer_norm(kv.to(dtype), (C,), ln_w, ln_b, norm.eps)  # (2, B, Np, C)
            # P^T k and P^T v of all heads in one product: its diagonal head blocks are the per-head products (h times
            # their multiply-adds, which are few: one GEMM instead of 2h, and no heads-first copy of k or v); P is
            # copied for keys and values (it is smaller than they are: h * r <= C in every CvT-LS and ViL-LS stage),
            # so that the product reads k and v as they lie and writes their gradient in one piece
            proj_t = proj.transpose(1, 2).expand(2, B, h * r, num_patches).reshape(2 * B, h * r, num_patches)
            prod = torch.bmm(proj_t, kv.reshape(2 * B, num_patches, C)).reshape(2, B, h, r, h, d)
            kv_bar = prod.diagonal(dim1=2, dim2=4).permute(0, 1, 2, 4, 3).reshape(2, B, r, C)
            shared = F.layer_norm(kv_bar, (C,), ng_w, ng_b, norm_g.eps)
            kv_prefix = q_prefix = torch.empty(0)
            if g > 0:
                if qkv_prefix.stride(0) == 0:  # q, k, v of the prefix one tensor (CvT-LS: the tokens themselves)
                    q_prefix = qkv_prefix[0].to(dtype)
                    kv_prefix = F.layer_norm(q_prefix, (C,), ln_w, ln_b, norm.eps).expand(2, B, g, C)
                else:
                    prefix = qkv_prefix.to(dtype)
                    q_prefix = prefix[0]
                    kv_prefix = F.layer_norm(prefix[1:], (C,), ln_w, ln_b, norm.eps)  # (2, B, g, C)
                shared = torch.cat([shared, kv_prefix], dim=2)
            shared = shared.reshape(2, B, r + g, h, d).transpose(2, 3)  # (2, B, h, r + g, d)
            q_map = q.to(dtype).reshape(B, H, W, h, d)
            kv_map = kv.reshape(2, B, H, W, h, d).permute(1, 2, 3, 0, 4, 5)
            flex_args = (shared, self.window_size, d ** -0.5, self.rel_pos_table, self.flex_order,
                         (self.flex_block_size, self.flex_block_size))
            if g > 0:
                out = self._flex_with_prefix(q_map, kv_map, flex_args, q_prefix, kv_prefix)
            else:
                out = span_flex_attention(q_map, kv_map, *flex_args).reshape(B, num_patches, C)
        return self.proj_drop(self.proj(out))

    @torch.jit.unused
    def _flex_with_prefix(self, q_map: torch.Tensor, kv_map: torch.Tensor, flex_args: Tuple, q_prefix: torch.Tensor,
                          kv_prefix: torch.Tensor) -> torch.Tensor:
        """`span_flex_attention` of the patches, then the post-cls update: each prefix query attends to the prefix
        keys and to the patches' attention outputs (one SDPA call). Returns (B, g + Np, C), prefix tokens first.

        Under autograd the patches' outputs are joined to the prefix keys and values by cats (their backward: views
        of the gradient). Without, one buffer holds the prefix keys and then the patches' outputs, which the flex
        call's re-layout writes in place; it serves as the keys (and the values, where the prefix's keys and values
        are one tensor, as CvT-LS's), and then takes the prefix outputs in place of the keys: the layer's output with
        no cat.

        Args:
            q_map: Queries (B, H, W, h, d); kv_map: the map's keys and values (B, H, W, 2, h, d); flex_args: the
                rest of `span_flex_attention`'s arguments.
            q_prefix: Prefix queries (B, g, C); kv_prefix: prefix keys and values after LN_L (2, B, g, C).
        """
        B, H, W, h, d = q_map.shape
        g, C, num_patches = q_prefix.shape[1], h * d, H * W
        k_prefix, v_prefix = kv_prefix.unbind(0)
        tracking = torch.is_grad_enabled()
        if tracking:
            patches = span_flex_attention(q_map, kv_map, *flex_args).reshape(B, num_patches, C)
            keys, values = torch.cat([k_prefix, patches], dim=1), torch.cat([v_prefix, patches], dim=1)
        else:
            keys = q_map.new_empty(B, g + num_patches, C)
            span_flex_attention(q_map, kv_map, *flex_args, out=keys[:, g:].view(B, H, W, h, d))
            keys[:, :g] = k_prefix
            values = keys if kv_prefix.stride(0) == 0 else torch.cat([v_prefix, keys[:, g:]], dim=1)
        out_prefix = F.scaled_dot_product_attention(
            q_prefix.reshape(B, g, h, d).transpose(1, 2), keys.reshape(B, g + num_patches, h, d).transpose(1, 2),
            values.reshape(B, g + num_patches, h, d).transpose(1, 2), scale=d ** -0.5)
        out_prefix = out_prefix.transpose(1, 2).reshape(B, g, C)
        if tracking:
            return torch.cat([out_prefix, patches], dim=1)
        values[:, :g] = out_prefix  # the keys (and values) are read: their buffer becomes the output
        return values

    def _prefix_update(self, q_prefix: torch.Tensor, kv_prefix: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Post-cls update: each prefix query attends to the prefix keys and to the attention outputs of all patches.

        In training the patch outputs serve as keys and values as they lie, (B, Np, C) tokens, so that autograd keeps
        no per-head copy of them: the prefix queries go in block-diagonal over the heads, (B, g * h, C), and one matmul
        per product covers every head (h times the multiply-adds of g query rows, which are few). Otherwise (no
        gradients, or a captured graph: `training_paths_enabled`) the products run per head, on a heads-first view of
        the outputs (and FLOP counts see the attention's own multiply-adds).

        Args:
            q_prefix: Prefix queries (B, g, C).
            kv_prefix: Prefix keys and values after LN_L (2, B, h, g, d).
            out: Patch attention outputs (B, Np, C).

        Returns:
            The prefix tokens' attention outputs (B, g, C).
        """
        B, g, C = q_prefix.shape
        h, d = self.num_heads, self.head_dim
        q_heads = q_prefix.reshape(B, g, h, d).transpose(1, 2) * d ** -0.5  # (B, h, g, d)
        scores_prefix = torch.matmul(q_heads, kv_prefix[0].transpose(-1, -2))  # (B, h, g, g)
        block_diagonal = training_paths_enabled()
        if block_diagonal:
            eye = torch.eye(h, dtype=q_heads.dtype, device=q_heads.device)
            q_block = (q_heads.transpose(1, 2)[:, :, :, None] * eye[:, :, None]).reshape(B, g * h, C)
            scores_patch = torch.matmul(q_block, out.transpose(1, 2)).reshape(B, g, h, -1).transpose(1, 2)
        else:
            out_heads = out.reshape(B, -1, h, d).transpose(1, 2)  # (B, h, Np, d)
            scores_patch = torch.matmul(q_heads, out_heads.transpose(-1, -2))
        scores = torch.cat([scores_prefix, scores_patch], dim=-1)  # (B, h, g, g + Np)
        attn = softmax_fp32(scores, out_dtype=q_heads.dtype)
        out_prefix = torch.matmul(attn[..., :g], kv_prefix[1])  # (B, h, g, d)
        if block_diagonal:
            out_patch = torch.matmul(attn[..., g:].transpose(1, 2).reshape(B, g * h, -1), out).reshape(B, g, h, h, d)
            # each head's rows read its own channels: the diagonal blocks
            out_patch = torch.diagonal(out_patch, dim1=2, dim2=3).permute(0, 3, 1, 2)  # (B, h, g, d)
        else:
            out_patch = torch.matmul(attn[..., g:], out.reshape(B, -1, h, d).transpose(1, 2))
        return (out_prefix + out_patch).transpose(1, 2).reshape(B, g, C)

    def projections(
            self,
            x: torch.Tensor,
            feat_size: Tuple[int, int],
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's input projections, before any attention math (`fused_proj` once reparameterized).

        Args:
            x: Tokens (B, g + H * W, C).
            feat_size: Map size (H, W).

        Returns:
            q, k, v of the patch tokens, (B, H * W, C) each; the prefix tokens' q, k, v, (3, B, g, C); the
            dynamic-projection logits of the patch tokens, (B, H * W, h * r).
        """
        num_prefix = x.shape[1] - feat_size[0] * feat_size[1]
        if self.fused_proj is not None:  # reparameterized CvT-LS convs
            return self.fused_proj(x, feat_size, num_prefix)
        q, k, v, qkv_prefix = self.qkv(x, feat_size, num_prefix)
        return q, k, v, qkv_prefix, self.dynamic_proj(x[:, num_prefix:], feat_size)

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
        h, d, r = self.num_heads, self.head_dim, self.dp_rank
        dropout_p = self.attn_drop if self.training else 0.
        if self._uses_flex(x, dropout_p):
            return self._forward_flex(x, feat_size, dropout_p)

        q, k, v, qkv_prefix, logits = self.projections(x, feat_size)
        proj = projection_weights(logits, h)  # P = softmax over tokens (fp32): (B, h, r, Np)
        norm = self.norm_local  # LN_L on keys and values
        q_patch = q.reshape(B, H, W, h, d).permute(0, 3, 1, 2, 4)  # (B, h, H, W, d), a view
        # training: LN_L once for the dynamic projection and the windows, which keep only k and v before LN_L (the
        # outputs of the q, k, v projection, which autograd keeps anyway); their backward normalizes again
        recompute_norm = recompute_local_norm(k, norm.weight)
        if recompute_norm:
            k_norm, v_norm = local_norm_tokens(k, v, norm.weight, norm.bias, norm.eps)
            kv_bar = local_norm_projection(proj, k_norm, v_norm, k, v, norm.weight, norm.bias, norm.eps)
            kv_patch = torch.empty(0)  # unused
        else:
            k_norm = v_norm = torch.empty(0)  # unused
            k, v = norm(k), norm(v)
            # one heads-first copy of the normalized patch keys and values serves the projection and the windows
            kv_patch = torch.stack([k.reshape(B, num_patches, h, d).transpose(1, 2),
                                    v.reshape(B, num_patches, h, d).transpose(1, 2)])
            k_heads, v_heads = kv_patch[0], kv_patch[1]
            proj = proj.to(k_heads.dtype)
            kv_bar = project_keys_values(proj, k_heads, v_heads)  # (2, B, h, r, d)
        # the prefix keys and values after LN_L, heads first: (2, B, h, g, d)
        kv_prefix = norm(qkv_prefix[1:]).reshape(2, B, num_prefix, h, d).transpose(2, 3)
        # LN_G on the projected keys and values
        kv_bar = self.norm_global(kv_bar.transpose(2, 3).reshape(2, B, r, C)).reshape(2, B, r, h, d).transpose(2, 3)
        kv_shared = torch.cat([kv_bar, kv_prefix.to(kv_bar.dtype)], dim=3) if num_prefix > 0 else kv_bar

        # segment-wise windows, one joint softmax over [projected (r) | prefix (g) | window span (K^2)] keys; views
        # of q and kv go in, and the backward gathers the spans again instead of keeping them
        window_mask = self._window_mask(feat_size, q.dtype, q.device)
        if recompute_norm:
            out = span_attention_local_norm(
                q_patch, k_norm.reshape(B, H, W, C), v_norm.reshape(B, H, W, C), k.reshape(B, H, W, C),
                v.reshape(B, H, W, C), norm.weight, norm.bias, norm.eps,
                kv_shared, window_mask, self.window_size, d ** -0.5, dropout_p, None)
        else:
            out = span_attention(q_patch, kv_patch.reshape(2, B, h, H, W, d), kv_shared, window_mask,
                                 self.window_size, d ** -0.5, dropout_p)
        out = out.reshape(B, num_patches, C)

        x = self.proj(out)
        if num_prefix > 0:
            x = torch.cat([self.proj(self._prefix_update(qkv_prefix[0], kv_prefix, out)), x], dim=1)
        x = self.proj_drop(x)
        return x


def _set_layer_span_kernel(layer: LongShortAttention2d, kernel: str, order: str, block_size: int) -> None:
    if kernel not in SPAN_KERNELS:
        raise ValueError(f'span_kernel must be one of {SPAN_KERNELS}, got {kernel!r}')
    if order not in FLEX_ORDERS:
        raise ValueError(f'the flex token order must be one of {FLEX_ORDERS}, got {order!r}')
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f'the flex block size must be a power of two of at least 16, got {block_size}')
    layer.span_kernel, layer.flex_order, layer.flex_block_size = kernel, order, block_size


def set_span_kernel(model: nn.Module, kernel: str, order: str = 'segment', block_size: int = 128) -> int:
    """Choose the window attention kernel of every `LongShortAttention2d` in `model` (the one switch between them).

    Args:
        model: Any module (a CvT-LS or ViL-LS model, a layer).
        kernel: 'auto' (the default): the flex path on CUDA where it runs (Triton installed, no attention dropout,
            no gradient for a window bias), which launches fewer kernels and moves fewer bytes by the counts
            (docs/benchmarks/cuda_counting.md), else the span path; 'span': the span path (`span_attention`), the
            CPU's; 'flex': one FlexAttention call per layer (`span_flex`), on the CPU inference only.
        order: The flex path's token order, 'segment' (segment-major) or 'raster'.
        block_size: The flex path's BlockMask block (queries and keys), a power of two >= 16.

    Returns:
        The number of layers set.
    """
    layers = [m for m in model.modules() if isinstance(m, LongShortAttention2d)]
    for layer in layers:
        _set_layer_span_kernel(layer, kernel, order, block_size)
    return len(layers)
