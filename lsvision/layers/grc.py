"""GRC-Attention: the Gated Recurrent Cache of `Cached Transformers`.

Paper: `Cached Transformers: Improving Transformers with Differentiable Memory Cache` (AAAI 2024,
https://arxiv.org/abs/2312.12742). Authors' code: annosubmission/GRC-Cache (`core/GRC_Attention.py`).

A GRC block keeps a cache C (a persistent buffer, 1 x T_m x D_m, D_m = r * D) beside a self-attention. With X the
attention input and o_self = SelfAttn(X) (run unchanged, projection included):

    S   = o_self[..., :D_m]                  (summary; 'input' takes X[..., :D_m]), resized to T_m tokens if T != T_m
    P   = C broadcast over the batch
    g_r = sigmoid(W_r [P, S]),  g_u = sigmoid(W_u [P, S])
    C~  = LN(GELU(W_c [g_r * P, S]))
    C_t = g_u * C~ + (1 - g_u) * P            (per sample; in train mode the batch mean is stored, detached)
    o_mem = MemAttn(q = X[..., :D_m], kv = C_t)   (same attention kind as the self branch, width D_m)
    O   = sigmoid(lam_h) * [o_mem^h, 0] + (1 - sigmoid(lam_h)) * o_self^h   (per head, o_mem zero-padded)
    O  += PE(X)                              (grouped 3x3 conv on the patch tokens, groups = D_m)

`GatedRecurrentCache` is everything after the self branch: it takes (X, o_self) and so wraps any self-attention.
Its options are one `GrcConfig`. The backbones (PVT v1, PVT v2, Swin, ViT) are wired one way: the model is built
with its own attention, then `wrap_attention_with_grc` turns each block's attention into a GRC attention in place.
The module keeps its parameters and their names and gains one `grc` child (`attn.grc.*`), so baseline weights load
with only GRC keys missing. Its class becomes a subclass that adds only a forward: the unchanged self-attention
(`self_attention_of`: the base class's own forward) followed by `grc`. `GrcAttention` is a generic wrapper for user
code (self branch under `attn.attn`). `GrcMemoryAttention` is the memory branch (plain MHSA, PVT spatial reduction
or linear SRA on the cache grid, Swin relative position bias over the window slots). `GatedRecurrentCache1d` is the
same layer for padded token sequences (the 1D encoders of `lsvision.sequence`): only the real tokens are resized into
the cache, and the PE is a 1D conv; `attach_grc` wires it (or any GRC layer) into an attention the same way.

Written for lsvision, Apache-2.0.
"""
import dataclasses
import functools
import math
import types
from typing import Any, Callable, Dict, List, Optional, Tuple, Type

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from timm.layers import register_notrace_module, trunc_normal_, use_fused_attn

from .export import refuse_legacy_onnx_export
from .matmul_attention import matmul_attention, scaled_dot_product_attention
from .reparam import FoldableModule
from .softmax import softmax_fp32
from .tuning import GRC_MATMUL_MAX_SCORES

__all__ = [
    'GatedRecurrentCache', 'GatedRecurrentCache1d', 'GrcAttention', 'GrcConfig', 'GrcMemoryAttention', 'attach_grc',
    'grc_dims', 'self_attention_of', 'wrap_attention_with_grc',
]


def grc_dims(dim: int, num_heads: int, ratio: float, pe: bool = True) -> int:
    """Cache width D_m = int(ratio * dim); raises unless D_m % num_heads == 0 and dim % D_m == 0.

    Without the PE conv (`pe=False`: its groups = D_m are what needs dim % D_m == 0) D_m is the largest multiple of
    num_heads not above ratio * dim (the same D_m wherever int(ratio * dim) is such a multiple), so each memory head
    has int(ratio * dim / num_heads) channels, e.g. Transformer-XL base (D 410, 10 heads, r 0.5): D_m = 200.
    """
    if not pe:
        cache_dim = num_heads * int(ratio * dim / num_heads)
        if cache_dim <= 0 or cache_dim > dim:
            raise ValueError(f'GRC cache width {cache_dim} (ratio {ratio}, dim {dim}, num_heads {num_heads}: '
                             f'ratio * dim / num_heads channels per head) must be in [1, dim]; pick another grc_ratio')
        return cache_dim
    cache_dim = int(ratio * dim)
    if cache_dim <= 0 or cache_dim % num_heads or dim % cache_dim:
        raise ValueError(
            f'GRC cache width int({ratio} * {dim}) = {cache_dim} must be > 0, divisible by num_heads={num_heads} '
            f'and divide dim={dim}; pick another grc_ratio')
    return cache_dim


@dataclasses.dataclass(frozen=True)
class GrcConfig:
    """The options of a GRC-Attention layer, the same for every block of a model: where the Cached
    Transformers paper (arXiv:2312.12742, Eqs. 4-5) and the authors' code differ, each reading is an option.

    The models take it as `grc_config`, or as the `grc_*` keyword arguments (`grc_ratio`, `grc_lam_init`, ...:
    the field names with a `grc_` prefix), which `timm.create_model` and the training configs pass.

    Args:
        ratio: Caching ratio r: the cache width D_m = int(r * D).
        lam_init: Initial mixing logits (paper 0.0 -> sigmoid 0.5; the authors' code -1.0).
        summary_src: Source of the cache update, 'self' (self-attention output, authors' code) or 'input'
            (the attention input, the paper's text).
        eval_update: In eval, compute the per-sample update from the frozen cache (authors' code); False
            attends to the frozen cache as is (the paper's "used directly").
        interp_mode: How the summary is resized when T != T_m: 'nearest1d' (authors' code: nearest over the
            flattened token sequence) or '2d' (bilinear on the patch grid, prefix tokens kept).
        sync_cache: All-reduce (mean) the stored update over the default process group at every forward, so every
            rank stores the global-batch mean. False keeps DDP's default buffer broadcast from rank 0.
    """

    ratio: float = 0.5
    lam_init: float = 0.0
    summary_src: str = 'self'
    eval_update: bool = True
    interp_mode: str = 'nearest1d'
    sync_cache: bool = False

    def __post_init__(self) -> None:
        if self.summary_src not in ('self', 'input'):
            raise ValueError(f"GRC summary_src must be 'self' or 'input', got {self.summary_src!r}")
        if self.interp_mode not in ('nearest1d', '2d'):
            raise ValueError(f"GRC interp_mode must be 'nearest1d' or '2d', got {self.interp_mode!r}")

    @classmethod
    def from_kwargs(cls, config: Optional['GrcConfig'], kwargs: Dict[str, Any], prefix: str = 'grc_') -> 'GrcConfig':
        """`config`, or the config made of the `prefix` + field entries of a model's `kwargs` (`grc_ratio`, ...).

        The `prefix` entries are taken out of `kwargs`; the others stay for the backbone.

        Raises:
            TypeError: A `prefix` entry that names no field, or both `config` and `prefix` entries.
        """
        fields = {prefix + f.name: f.name for f in dataclasses.fields(cls)}
        given = {k: kwargs.pop(k) for k in [k for k in kwargs if k.startswith(prefix)]}
        unknown = sorted(set(given) - set(fields))
        if unknown:
            raise TypeError(f'unexpected keyword argument(s) {", ".join(unknown)}; the GRC options are '
                            f'{", ".join(fields)}')
        if config is not None and given:
            raise TypeError(f'pass either grc_config or {", ".join(sorted(given))}, not both')
        return config if config is not None else cls(**{fields[k]: v for k, v in given.items()})

def _cat_bias(
        a: Optional[torch.Tensor], b: Optional[torch.Tensor], c: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if a is None or b is None:
        return None
    if c is None:
        return torch.cat([a, b])
    return torch.cat([a, b, c])


class GrcMemoryAttention(FoldableModule):
    """Memory branch: queries from the input slice, keys/values from the (per-sample) cache.

    The same attention kind as the self branch at width D_m: q (D_m->D_m), kv (D_m->2 D_m), proj (D_m->D_m), plus
    PVT's spatial reduction (conv k=s=sr + LN) or linear SRA (pool 7, 1x1 conv, LN, GELU) applied to the cache
    grid, or a Swin relative-position-bias table over the window slots. Prefix (cls) cache slots skip the reduction.
    """

    fused_attn: torch.jit.Final[bool]

    def __init__(
            self,
            dim: int,
            num_heads: int,
            cache_hw: Optional[Tuple[int, int]] = None,
            num_prefix_tokens: int = 0,
            qkv_bias: bool = True,
            sr_ratio: int = 1,
            linear_attn: bool = False,
            window_size: Optional[Tuple[int, int]] = None,
            norm_eps: float = 1e-5,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
            device=None,
            dtype=None,
    ):
        dd = {'device': device, 'dtype': dtype}
        super().__init__()
        assert dim % num_heads == 0, f'dim {dim} must be divisible by num_heads {num_heads}'
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.cache_hw = tuple(cache_hw) if cache_hw is not None else None
        self.num_prefix_tokens = num_prefix_tokens
        self.attn_drop = attn_drop
        self.q = nn.Linear(dim, dim, bias=qkv_bias, **dd)
        self.kv = nn.Linear(dim, dim * 2, bias=qkv_bias, **dd)
        self.proj = nn.Linear(dim, dim, **dd)
        self.proj_drop = nn.Dropout(proj_drop)
        self.pool = None
        self.sr = None
        self.norm = None
        self.act = None
        if linear_attn:
            self.pool = nn.AdaptiveAvgPool2d(7)
            self.sr = nn.Conv2d(dim, dim, kernel_size=1, stride=1, **dd)
            self.norm = nn.LayerNorm(dim, eps=norm_eps, **dd)
            self.act = nn.GELU()
        elif sr_ratio > 1:
            self.sr = nn.Conv2d(dim, dim, kernel_size=sr_ratio, stride=sr_ratio, **dd)
            self.norm = nn.LayerNorm(dim, eps=norm_eps, **dd)
        if (self.sr is not None) and self.cache_hw is None:
            raise ValueError('spatial reduction on the cache needs cache_hw')
        self.window_size = tuple(window_size) if window_size is not None else None
        # SDPA also for the window memory branch (timm's self branch asks for it only as 'experimental'); small windows
        # on CPU run as batched matmuls instead (see `attend`)
        self.fused_attn = use_fused_attn()
        self.matmul_max_scores = GRC_MATMUL_MAX_SCORES
        if self.window_size is not None:
            wh, ww = self.window_size
            self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * wh - 1) * (2 * ww - 1), num_heads, **dd))
            trunc_normal_(self.relative_position_bias_table, std=.02)
            self.register_buffer('relative_position_index', self._rel_index(device), persistent=False)
        else:
            self.relative_position_bias_table = None
            self.relative_position_index = None
        self.sr_ratio = sr_ratio
        # set by `reparameterize`: the gathered (1, heads, n, n) bias, the patch-major reduction weight and its bias
        self.register_buffer('rel_pos_bias', None)
        self.register_buffer('sr_patch_weight', None)
        self.register_buffer('sr_patch_bias', None)

    def _rel_index(self, device=None) -> torch.Tensor:
        wh, ww = self.window_size
        coords = torch.stack(torch.meshgrid(
            torch.arange(wh, device=device), torch.arange(ww, device=device), indexing='ij')).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0)
        rel[:, :, 0] += wh - 1
        rel[:, :, 1] += ww - 1
        return rel[:, :, 0] * (2 * ww - 1) + rel[:, :, 1]

    def _patch_reduce_applies(self) -> bool:
        """Whether the spatial reduction is a conv with kernel = stride = s over a grid that s divides (PVT)."""
        sr, hw = self.sr, self.cache_hw
        if self.pool is not None or sr is None or hw is None:
            return False
        s = sr.stride[0]
        return s == self.sr_ratio and sr.kernel_size == (s, s) and sr.stride == (s, s) and sr.padding == (0, 0) \
            and hw[0] % s == 0 and hw[1] % s == 0

    def _reduce(self, kv: torch.Tensor) -> torch.Tensor:
        if self.sr is None and self.sr_patch_weight is None:
            return kv
        B, _, C = kv.shape
        hw = self.cache_hw
        assert hw is not None
        p = self.num_prefix_tokens
        grid = kv[:, p:]
        if self.sr_patch_weight is not None:  # reparameterized: the weight in patch-major order, stored
            reduced = self._patch_reduce(grid, self.sr_patch_weight, self.sr_patch_bias)
        else:
            assert self.sr is not None
            grid = grid.transpose(1, 2).reshape(B, C, hw[0], hw[1])
            if self.pool is not None:
                grid = self.pool(grid)
            reduced = self.sr(grid).flatten(2).transpose(1, 2)
        assert self.norm is not None
        grid = self.norm(reduced)
        if self.act is not None:
            grid = self.act(grid)
        return grid if p == 0 else torch.cat([kv[:, :p], grid], dim=1)

    def _patch_reduce(self, grid: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """The kernel = stride = s reduction of the cache grid (B, h*w, C) as one matmul (reparameterized layers).

        A conv with kernel = stride = s maps each non-overlapping s x s patch linearly: on a patch-major copy of the
        tokens it is one (B*h*w/s^2, s*s*C) x (s*s*C, C) matmul, 1.1-2.5x faster on CPU than the conv on the
        transposed grid (which needs a layout copy too). Same math and FLOPs as the conv (tested).
        """
        B, _, C = grid.shape
        hw = self.cache_hw
        assert hw is not None
        s = self.sr_ratio
        h, w = hw[0] // s, hw[1] // s
        patches = grid.reshape(B, h, s, w, s, C).permute(0, 1, 3, 2, 4, 5).reshape(B * h * w, s * s * C)
        return F.linear(patches, weight.to(grid.dtype), None if bias is None else bias.to(grid.dtype)).view(
            B, h * w, C)

    def _gather_rel_pos_bias(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """The (1, heads, n, n) relative-position bias of the window slots, gathered from the table (contiguous: the
        SDPA mask reads it once per window batch)."""
        if self.rel_pos_bias is not None:  # reparameterized: gathered once
            return self.rel_pos_bias.to(dtype)
        assert self.relative_position_bias_table is not None and self.relative_position_index is not None
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(n, n, -1)
        return bias.permute(2, 0, 1).unsqueeze(0).to(dtype).contiguous()

    @torch.no_grad()
    def reparameterize(self) -> None:
        """Gather the window relative-position bias once and store the kernel = stride reduction conv's weight in
        patch-major order (one matmul, see `_patch_reduce`); the table and the conv go. Inference-only afterwards.

        Called by `timm.models.reparameterize_model`.
        """
        if self.reparameterized:
            return
        ws = self.window_size
        if self.relative_position_bias_table is not None and ws is not None:
            n = ws[0] * ws[1]
            table = self.relative_position_bias_table
            self.register_buffer('rel_pos_bias', self._gather_rel_pos_bias(n, table.dtype).clone())
            self.relative_position_bias_table = None
            self.relative_position_index = None
        if self._patch_reduce_applies():
            sr = self.sr
            assert sr is not None
            w = sr.weight
            self.register_buffer('sr_patch_weight', w.permute(0, 2, 3, 1).reshape(w.shape[0], -1).clone())
            self.register_buffer('sr_patch_bias', None if sr.bias is None else sr.bias.clone())
            self.sr = None
        self._set_reparameterized()

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """x: (B, T, D_m) queries' source, cache: (B, T_m, D_m). Returns (B, T, D_m)."""
        B, N, C = x.shape
        # 2-D: a channel slice of a contiguous (B, T, D) input then goes to the matmul as is, without a copy
        q = self.q(x.reshape(B * N, C)).reshape(B, N, self.num_heads, self.head_dim).transpose(1, 2)
        kv = self.kv(self._reduce(cache)).reshape(B, -1, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        k, v = kv.unbind(0)
        bias: Optional[torch.Tensor] = None
        ws = self.window_size
        if (self.rel_pos_bias is not None or self.relative_position_bias_table is not None) and ws is not None:
            n = ws[0] * ws[1]
            if N != n or k.shape[2] != n:
                raise ValueError(f'window memory attention expects {n} queries and cache slots, got {N} and '
                                 f'{k.shape[2]}')
            bias = self._gather_rel_pos_bias(n, q.dtype)
        x = self.attend(q, k, v, bias)
        # contiguous, then a view: torch.export's fake SDPA output has other strides, and its reshape became a view
        x = self.proj(x.transpose(1, 2).contiguous().view(B, N, C))
        return self.proj_drop(x)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """softmax(q k^T * scale + bias) v for (B, heads, N, head_dim) queries against the cache's keys and values.

        One kernel per device and layer: window memory attention with small windows (Swin: 49 slots, head dim 16) runs
        as batched matmuls + softmax (`matmul_attention`) on CPU, where SDPA's flash kernel costs a few microseconds
        per (window x head) block and does not speed up with a second thread (the matmuls were 1.4-1.6x faster than
        SDPA on 2 cores at Swin-T's shapes, 0.8-0.9x on one thread); everything else through SDPA. Both give the same
        output (tested).
        """
        dropout_p = self.attn_drop if self.training else 0.
        if bias is not None and q.device.type == 'cpu' and q.shape[2] * k.shape[2] <= self.matmul_max_scores:
            return matmul_attention(q, k, v, bias, dropout_p, self.scale)
        if self.fused_attn:
            return scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p, scale=self.scale)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        if bias is not None:
            attn = attn + bias
        attn = F.dropout(softmax_fp32(attn), self.attn_drop, self.training)
        return attn @ v


@register_notrace_module  # stateful, shape-dependent: a leaf for torch.fx
class GatedRecurrentCache(FoldableModule):
    """The GRC part of a GRC-Attention block (the paper's Eqs. 4-5 as the authors' code computes them): cache,
    gates, memory attention, mixing, PE.

    Call it with the attention input X (B, T, D) and the self-attention output o_self (B, T, D); it returns the
    mixed output (B, T, D). The cache update is stored (batch mean, detached) only in train mode; in eval the
    per-sample update is computed from the frozen cache and never stored (`eval_update=False` skips it and
    attends to the frozen cache directly, the paper's "used directly" reading).
    """

    def __init__(
            self,
            dim: int,
            num_heads: int,
            cache_len: int,
            cache_hw: Optional[Tuple[int, int]] = None,
            num_prefix_tokens: int = 0,
            config: Optional[GrcConfig] = None,
            mem_attn_layer: Optional[Callable[..., nn.Module]] = None,
            mem_attn_kwargs: Optional[dict] = None,
            norm_eps: float = 1e-5,
            pe: bool = True,
            device=None,
            dtype=None,
    ):
        """
        Args:
            dim: Width D of the wrapped attention.
            num_heads: Heads H of the wrapped attention (the memory branch uses the same number).
            cache_len: Cache length T_m (tokens at the training resolution, prefix tokens included).
            cache_hw: Patch grid of the cache (T_m = num_prefix_tokens + h * w); needed by spatial reduction and the
                '2d' interpolation.
            num_prefix_tokens: Prefix (cls) tokens at the front of the sequence and of the cache.
            config: The GRC options (`GrcConfig`; its defaults when None).
            mem_attn_layer: Memory attention class (default GrcMemoryAttention), built with width D_m.
            mem_attn_kwargs: Extra kwargs for the memory attention (qkv_bias, sr_ratio, linear_attn, window_size...).
            norm_eps: Epsilon of the candidate LayerNorm.
            pe: Add the PE conv's output (step 9); False leaves it out (a layer without PE, e.g. in a causal model,
                where a conv over neighbours would see the next token).
        """
        dd = {'device': device, 'dtype': dtype}
        super().__init__()
        config = config or GrcConfig()
        cache_dim = grc_dims(dim, num_heads, config.ratio, pe)
        if cache_hw is not None and num_prefix_tokens + cache_hw[0] * cache_hw[1] != cache_len:
            raise ValueError(f'cache_len {cache_len} != num_prefix_tokens {num_prefix_tokens} + grid {cache_hw}')
        if config.interp_mode == '2d' and cache_hw is None:
            raise ValueError("interp_mode='2d' needs cache_hw")
        self.dim = dim
        self.num_heads = num_heads
        self.cache_dim = cache_dim
        self.cache_len = cache_len
        self.cache_hw = tuple(cache_hw) if cache_hw is not None else None
        self.num_prefix_tokens = num_prefix_tokens
        # plain attributes (TorchScript reads them; the training loop turns sync_cache off)
        self.summary_src = config.summary_src
        self.eval_update = config.eval_update
        self.interp_mode = config.interp_mode
        self.sync_cache = config.sync_cache

        self.linear_reset = nn.Linear(2 * cache_dim, cache_dim, **dd)
        self.linear_update = nn.Linear(2 * cache_dim, cache_dim, **dd)
        self.linear_candidate = nn.Linear(2 * cache_dim, cache_dim, **dd)
        self.norm_candidate = nn.LayerNorm(cache_dim, eps=norm_eps, **dd)
        self.act = nn.GELU()
        mem_attn_layer = mem_attn_layer or GrcMemoryAttention
        self.mem_attn = mem_attn_layer(
            cache_dim,
            num_heads,
            cache_hw=cache_hw,
            num_prefix_tokens=num_prefix_tokens,
            **(mem_attn_kwargs or {}),
            **dd,
        )
        self.lam = nn.Parameter(torch.full((num_heads,), float(config.lam_init), **dd))
        self.pe = self._build_pe(dim, cache_dim, device, dtype) if pe else None
        self.register_buffer('cache', torch.zeros(1, cache_len, cache_dim, device=device, dtype=torch.float32))
        # set by `reparameterize` (see there); None in a layer that trains
        for name in ('gate_weight', 'gate_bias', 'candidate_cache_weight', 'mix_weight', 'pe_weight_own',
                     'pe_weight_pair', 'pe_bias'):
            self.register_buffer(name, None)

    @staticmethod
    def _build_pe(dim: int, groups: int, device=None, dtype=None) -> nn.Module:
        """The PE conv (step 9): 3x3 over the patch grid, groups = D_m."""
        return nn.Conv2d(dim, dim, 3, stride=1, padding=1, groups=groups, device=device, dtype=dtype)

    def extra_repr(self) -> str:
        return (f'dim={self.dim}, cache=({self.cache_len}, {self.cache_dim}), summary_src={self.summary_src!r}, '
                f'eval_update={self.eval_update}, interp_mode={self.interp_mode!r}, sync_cache={self.sync_cache}')

    @torch.no_grad()
    def reset_cache(self) -> None:
        """Zero the cache (e.g. before fine-tuning on a new task, as the paper does for COCO)."""
        self._check_not_reparameterized('reset_cache')
        self.cache.zero_()

    def _check_not_reparameterized(self, what: str) -> None:
        if self.reparameterized:
            raise RuntimeError(
                f'{what}: this GRC layer was reparameterized (timm.models.reparameterize_model), its gate terms hold '
                'the frozen cache; change the cache of the model you passed to reparameterize_model, then call '
                'reparameterize_model again')

    @torch.no_grad()
    def resize_cache(self, new_hw: Tuple[int, int]) -> None:
        """Resize the cache to a new patch grid: bilinear over the grid, prefix slots kept. Updates T_m and cache_hw.

        Only for layers whose cache is a patch grid (PVT); the memory attention's reduction must fit the new grid.
        """
        self._check_not_reparameterized('resize_cache')
        if self.cache_hw is None:
            raise ValueError('resize_cache needs a layer built with cache_hw')
        new_hw = (int(new_hw[0]), int(new_hw[1]))
        sr = getattr(self.mem_attn, 'sr', None)
        if isinstance(sr, nn.Conv2d) and sr.stride[0] > 1 and min(new_hw) < sr.stride[0]:
            raise ValueError(f'cache grid {new_hw} is smaller than the spatial reduction {sr.stride[0]}')
        if new_hw == self.cache_hw:
            return
        cache = self.cache
        p = self.num_prefix_tokens
        grid = cache[:, p:].transpose(1, 2).reshape(1, self.cache_dim, *self.cache_hw)
        grid = F.interpolate(grid.float(), size=new_hw, mode='bilinear', align_corners=False)
        new = torch.cat([cache[:, :p].float(), grid.flatten(2).transpose(1, 2)], dim=1).to(cache.dtype)
        self.cache = new.contiguous()  # a new tensor of a new shape: re-registers the buffer
        self.cache_hw = new_hw
        self.cache_len = new.shape[1]
        if hasattr(self.mem_attn, 'cache_hw'):
            self.mem_attn.cache_hw = new_hw

    def _resize_summary(self, s: torch.Tensor, feat_size: Optional[List[int]]) -> torch.Tensor:
        if s.shape[1] == self.cache_len:
            return s
        hw = self.cache_hw
        if self.interp_mode == 'nearest1d' or feat_size is None or hw is None:
            return F.interpolate(s.transpose(1, 2), size=self.cache_len).transpose(1, 2)
        p = self.num_prefix_tokens
        B, _, C = s.shape
        grid = s[:, s.shape[1] - feat_size[0] * feat_size[1]:].transpose(1, 2).reshape(B, C, feat_size[0],
                                                                                        feat_size[1])
        grid = F.interpolate(grid, size=hw, mode='bilinear', align_corners=False)
        return torch.cat([s[:, :p], grid.flatten(2).transpose(1, 2)], dim=1)

    def _gate_weights(self) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
        """Summary halves [W_rS; W_uS; W_cS] (3 D_m x D_m), their biases, cache halves [W_rP; W_uP] (2 D_m x D_m)."""
        dm = self.cache_dim
        w_r, w_u, w_c = self.linear_reset.weight, self.linear_update.weight, self.linear_candidate.weight
        w_s = torch.cat([w_r[:, dm:], w_u[:, dm:], w_c[:, dm:]], dim=0)
        b_s = _cat_bias(self.linear_reset.bias, self.linear_update.bias, self.linear_candidate.bias)
        return w_s, b_s, torch.cat([w_r[:, :dm], w_u[:, :dm]], dim=0)

    def _pe_filters(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """The PE conv (2 channels per group) as 2 depthwise filters (D, 1, 3, 3): own channel, pair partner."""
        G, D = self.cache_dim, self.dim
        w = self.pe.weight.view(G, 2, 2, 3, 3)  # (group, out, in, 3, 3)
        w_own = torch.diagonal(w, dim1=1, dim2=2).permute(0, 3, 1, 2).reshape(D, 1, 3, 3)
        w_pair = torch.diagonal(w.flip(2), dim1=1, dim2=2).permute(0, 3, 1, 2).reshape(D, 1, 3, 3)
        return w_own, w_pair

    @torch.no_grad()
    def reparameterize(self) -> None:
        """Compute the terms of an eval forward that depend only on the parameters and the frozen cache, once.

        In eval the cache is frozen, so the cache halves of the reset and update gates, [W_rP; W_uP] C, are the same
        for every sample; with the gate biases they become one per-token term `gate_bias` (1, T_m, 3 D_m) beside the
        fused summary halves `gate_weight` [W_rS; W_uS; W_cS] (3 D_m, D_m) and the candidate's cache half
        `candidate_cache_weight` W_cP (D_m, D_m); the mixing weights sigmoid(lam) become `mix_weight` (heads, 1),
        and the PE conv with 2 channels per group (r = 0.5) its two depthwise filters (see `_pe`). The gate Linears,
        `lam` and (r = 0.5) `pe` go. Called by `timm.models.reparameterize_model`; afterwards the layer is
        inference-only (`train()`, `reset_cache` and `resize_cache` raise).
        """
        if self.reparameterized:
            return
        dm = self.cache_dim
        w_s, b_s, w_p = self._gate_weights()
        cache = self.cache.to(w_p.dtype)
        ru = F.linear(cache, w_p)  # (1, T_m, 2 D_m)
        gate_bias = torch.cat([ru, ru.new_zeros(ru.shape[:-1] + (dm,))], dim=-1)
        if b_s is not None:
            gate_bias += b_s
        self.gate_weight = w_s.clone()
        self.gate_bias = gate_bias
        self.candidate_cache_weight = self.linear_candidate.weight[:, :dm].clone()
        self.mix_weight = torch.sigmoid(self.lam).view(self.num_heads, 1).clone()
        self.linear_reset = None
        self.linear_update = None
        self.linear_candidate = None
        self.lam = None
        if self.dim == 2 * self.cache_dim and isinstance(self.pe, nn.Conv2d):
            pe = self.pe
            assert pe is not None
            self.pe_weight_own, self.pe_weight_pair = (w.clone() for w in self._pe_filters())
            self.pe_bias = None if pe.bias is None else pe.bias.clone()
            self.pe = None
        self._set_reparameterized()

    def update(self, cache: torch.Tensor, summary: torch.Tensor) -> torch.Tensor:
        """Per-sample GRU-style update: cache (B or 1, T_m, D_m) and summary (B, T_m, D_m) -> C_t (B, T_m, D_m).

        Same math as `W [P, S]` on the concatenation, with each gate weight split into its cache and summary halves:
        the three summary halves run as one matmul on the summary as it lies (a channel slice: no copy), and the
        cache halves of W_r and W_u act on the batch-independent cache once (not once per sample); reparameterized,
        that product and the biases are one stored per-token term. No concatenated or expanded copies of the
        activations are made.
        """
        B, T, dm = summary.shape
        # [W_rS; W_uS; W_cS] S: (B * T_m, 3 D_m); the reshape is a view of a channel slice
        summary2d = summary.reshape(B * T, dm)
        if self.gate_weight is None:
            w_s, b_s, w_p = self._gate_weights()
            s3 = F.linear(summary2d, w_s) if b_s is None else torch.addmm(b_s, summary2d, w_s.t())
            # + [W_rP; W_uP] C: (1 or B, T_m, 2 D_m)
            gates = torch.sigmoid_(s3[:, :2 * dm].view(B, T, 2 * dm) + F.linear(cache, w_p))
            w_cp = self.linear_candidate.weight[:, :dm]
        else:
            # reparameterized: [W_rP; W_uP] C of the frozen cache and all biases are one per-token term (1, T_m,
            # 3 D_m), added in place: no bias copy before the matmul and no new tensor for the gates
            s3 = torch.mm(summary2d, self.gate_weight.to(summary.dtype).t())
            s3.view(B, T, 3 * dm).add_(self.gate_bias.to(summary.dtype))
            gates = torch.sigmoid_(s3[:, :2 * dm]).view(B, T, 2 * dm)
            w_cp = self.candidate_cache_weight.to(summary.dtype)
        g_r, g_u = gates[..., :dm], gates[..., dm:]
        # W_cP (g_r * C) + (W_cS S + b_c)
        cand = torch.addmm(s3[:, 2 * dm:], (g_r * cache).reshape(B * T, dm), w_cp.t())
        cand = self.norm_candidate(self.act(cand.view(B, T, dm)))
        # under CUDA autocast LayerNorm returns float32 while the cache is bf16/fp16, and a float32 cache (an explicit
        # state) meets bf16/fp16 gates: lerp needs one dtype
        return torch.lerp(cache, cand.to(cache.dtype), g_u.to(cache.dtype))  # = g_u * cand + (1 - g_u) * cache

    @torch.jit.unused
    def _all_reduce_mean(self, x: torch.Tensor) -> torch.Tensor:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            x = x.clone()
            dist.all_reduce(x)
            x = x / dist.get_world_size()
        return x

    @torch.no_grad()
    def _store(self, new_cache: torch.Tensor, keep: Optional[torch.Tensor] = None) -> None:
        """Store the batch mean of the per-sample update (all-reduced with `sync_cache`); `keep` (B,) bool: average
        only these samples (the others leave no trace; none kept: the cache stays). Tensor methods only: TorchScript
        compiles this through `no_grad`'s wrapper, which does not see this module's `torch`."""
        new = new_cache.detach().float()
        if keep is None:
            new = new.mean(0, keepdim=True)
        else:
            # no host sync: a weighted mean, and the old cache where no sample is kept
            w = keep.to(new.dtype).view(-1, 1, 1)
            kept = w.sum()
            new = ((new * w).sum(0, keepdim=True) / kept.clamp(min=1.)).where(kept > 0, self.cache)
        if self.sync_cache:
            new = self._all_reduce_mean(new)
        self.cache.copy_(new)

    def forward(
            self,
            x: torch.Tensor,
            o_self: torch.Tensor,
            feat_size: Optional[List[int]] = None,
    ) -> torch.Tensor:
        """
        Args:
            x: Attention input (B, T, D), T = num_prefix_tokens + H * W.
            o_self: Self-attention output (B, T, D).
            feat_size: (H, W) of the patch tokens; inferred as square when None.
        """
        refuse_legacy_onnx_export('GatedRecurrentCache')
        B, T, D = x.shape
        if o_self.shape != x.shape:
            raise ValueError(f'self-attention output {o_self.shape} must match its input {x.shape}')
        if D != self.dim:
            raise ValueError(f'GRC layer built for width {self.dim}, got input of width {D}')
        p = self.num_prefix_tokens
        if feat_size is None:
            side = int(math.sqrt(T - p))
            if side * side != T - p:
                raise ValueError(f'pass feat_size: {T - p} patch tokens are not a square grid')
            feat_size = [side, side]
        if p + feat_size[0] * feat_size[1] != T:
            raise ValueError(f'{T} tokens != {p} prefix + {feat_size[0]}x{feat_size[1]} patches')
        dm = self.cache_dim
        src = o_self if self.summary_src == 'self' else x
        summary = self._resize_summary(src[..., :dm], feat_size)

        cache = self._updated_cache(summary, B)
        o_mem = self.mem_attn(x[..., :dm], cache)
        pe = None if self.pe is None and self.pe_weight_own is None else self._pe(x[:, p:], feat_size)
        return self._mix(o_self, o_mem, pe)

    def _updated_cache(self, summary: torch.Tensor, batch_size: int,
                       keep: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Steps 3-6: the per-sample cache C_t (B, T_m, D_m) from the stored cache and the summary (B, T_m, D_m); in
        train mode its batch mean is stored. `keep` (B,) bool: samples whose update may be stored (others get the
        stored cache as C_t)."""
        # clone: the buffer is written in place below (train) while this step's graph still uses its value; without
        # a graph or a store (eval, no grad) the buffer is read as is
        cache = self.cache.to(dtype=summary.dtype, copy=self.training or torch.is_grad_enabled())
        if self.training or self.eval_update:
            new = self.update(cache, summary)
            if keep is not None:
                new = torch.where(keep.view(-1, 1, 1), new, cache)
            if self.training:
                self._store(new, keep)
            return new
        return cache.expand(batch_size, -1, -1)

    def _mix(self, o_self: torch.Tensor, o_mem: torch.Tensor, pe: Optional[torch.Tensor]) -> torch.Tensor:
        """Step 8-9: O = sigmoid(lam) [o_mem, 0] + (1 - sigmoid(lam)) o_self per head, + `pe` (B, T - prefix, D) on
        the tokens after the prefix (None: a layer without PE)."""
        B, T, D = o_self.shape
        p = self.num_prefix_tokens
        dm = self.cache_dim
        H = self.num_heads
        if self.mix_weight is None:
            w = torch.sigmoid(self.lam).to(o_self.dtype).view(H, 1)
        else:
            w = self.mix_weight.to(o_self.dtype)
        w_self = 1. - w
        # O = w * [o_mem, 0] + (1 - w) * o_self per head (without the zero-padded copy of o_mem), + PE on the patches
        if pe is None:
            out = o_self.reshape(B, T, H, D // H) * w_self
        elif p == 0 and pe.is_contiguous():
            # accumulate into the fresh PE tensor: one pass and no new tensor for (1 - w) * o_self
            out = pe.view(B, T, H, D // H).addcmul_(o_self.reshape(B, T, H, D // H), w_self)
        else:
            out = o_self.reshape(B, T, H, D // H) * w_self
            out.view(B, T, D)[:, p:] += pe
        out[..., :dm // H].addcmul_(o_mem.reshape(B, T, H, dm // H), w)
        return out.view(B, T, D)

    def _pe(self, x: torch.Tensor, feat_size: List[int]) -> torch.Tensor:
        """`self.pe` on patch tokens (B, H*W, D), returned as tokens (B, H*W, D).

        With 2 channels per group (r = 0.5), each output channel sums a 3x3 depthwise filter over its own channel and
        one over its pair partner; oneDNN's grouped kernel is slow on CPU for this shape. So it runs as 2 depthwise
        convs on channels-last views of the token-major input (no layout copies; only the pair-swapped copy of x),
        3-9x faster than the grouped conv. The same sum and FLOPs either way. Traced (FLOP counting, export), a layer
        that trains keeps the grouped conv; a reparameterized one stores the two filters.
        """
        B, N, D = x.shape
        H, W = feat_size
        if self.pe_weight_own is not None:  # reparameterized
            w_own, w_pair, bias = self.pe_weight_own, self.pe_weight_pair, self.pe_bias
        else:
            pe = self.pe
            assert pe is not None
            if self.dim != 2 * self.cache_dim or torch.jit.is_tracing():
                patches = x.transpose(1, 2).reshape(B, D, H, W)
                return pe(patches).flatten(2).transpose(1, 2)
            w_own, w_pair = self._pe_filters()
            bias = pe.bias
        G = self.cache_dim
        x = x.contiguous()
        x2 = x.view(B, N, G, 2)
        x_pair = torch.stack([x2[..., 1], x2[..., 0]], dim=-1)  # each channel's pair partner in its place
        # (B, H*W, D) token-major is (B, D, H, W) channels-last: oneDNN's depthwise kernel reads it as is
        y = F.conv2d(x.view(B, H, W, D).permute(0, 3, 1, 2), w_own.to(x.dtype), bias, padding=1, groups=D)
        y.add_(F.conv2d(x_pair.view(B, H, W, D).permute(0, 3, 1, 2), w_pair.to(x.dtype), None, padding=1, groups=D))
        return y.permute(0, 2, 3, 1).reshape(B, N, D)


@register_notrace_module  # stateful, shape-dependent: a leaf for torch.fx
class GatedRecurrentCache1d(GatedRecurrentCache):
    """The GRC layer for token sequences with padding (1D encoders; the paper's Long ListOps setting, Table 6).

    The same cache, gates, update, store, memory attention and mixing as `GatedRecurrentCache`; what differs is how
    the sequence enters the cache and the PE:

    - Summary: only the real tokens of each sample (`mask`), in order, are resized to the T_m sequence slots of the
      cache: nearest, slot i takes real token floor(i * L / T_m) of the L real tokens (computed exactly in integers;
      `F.interpolate`'s float32 scale picks the previous token for some lengths). Padding never enters the cache,
      and a sample's update does not depend on how much padding surrounds its tokens. A sample without real tokens
      attends to the stored cache and is left out of the stored batch mean. Prefix (cls) tokens have slots of their
      own in front.
    - PE: a 1D conv (kernel 3, groups = D_m) over the tokens after the prefix, with pad tokens zeroed first (to the
      last real token a trailing pad looks like the conv's own zero padding).
    - A sample longer than the cache (more than T_m real tokens) is an error, and so is loading a cache of another
      length (both name the two lengths).

    Padded queries still get outputs (their memory and self terms), which nothing downstream should read: the 1D
    encoders mask padded keys and pool real tokens only.
    """

    def __init__(
            self,
            dim: int,
            num_heads: int,
            seq_len: int,
            num_prefix_tokens: int = 0,
            config: Optional[GrcConfig] = None,
            mem_attn_kwargs: Optional[dict] = None,
            norm_eps: float = 1e-5,
            pe: bool = True,
            device=None,
            dtype=None,
    ):
        """
        Args:
            dim: Width D of the wrapped attention.
            num_heads: Heads H of the wrapped attention (the memory branch uses the same number).
            seq_len: Sequence slots of the cache, T_m (the paper: the model's max length); prefix slots come on top.
            num_prefix_tokens: Prefix (cls) tokens in front of the sequence, each with a cache slot of its own.
            config: The GRC options (`GrcConfig`); `interp_mode` must be 'nearest1d'.
            mem_attn_kwargs: Extra kwargs of the memory attention (`GrcMemoryAttention`: qkv_bias, attn_drop...).
            norm_eps: Epsilon of the candidate LayerNorm.
            pe: Add the 1D PE conv; False for causal models (the conv sees the next token), and then D_m is a
                multiple of num_heads only (see `grc_dims`).
        """
        config = config or GrcConfig()
        if config.interp_mode != 'nearest1d':
            raise ValueError(f"a token sequence has no patch grid: interp_mode must be 'nearest1d', got "
                             f'{config.interp_mode!r}')
        if seq_len < 1:
            raise ValueError(f'GRC cache length must be >= 1, got {seq_len}')
        super().__init__(dim, num_heads, num_prefix_tokens + seq_len, num_prefix_tokens=num_prefix_tokens,
                         config=config, mem_attn_kwargs=mem_attn_kwargs, norm_eps=norm_eps, pe=pe, device=device,
                         dtype=dtype)
        self.seq_len = seq_len

    @staticmethod
    def _build_pe(dim: int, groups: int, device=None, dtype=None) -> nn.Module:
        """The PE conv over the token sequence: kernel 3, groups = D_m."""
        return nn.Conv1d(dim, dim, 3, stride=1, padding=1, groups=groups, device=device, dtype=dtype)

    def resize_cache(self, new_hw: Tuple[int, int]) -> None:
        raise ValueError('a sequence GRC cache has no patch grid to resize; build the model with the cache length '
                         'you need (max_len)')

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        cache = state_dict.get(prefix + 'cache')
        if cache is not None and cache.ndim == 3 and cache.shape[1] != self.cache_len:
            p = self.num_prefix_tokens
            raise ValueError(
                f'{prefix}cache in the checkpoint has T_m = {cache.shape[1] - p} sequence slots (+ {p} prefix), this '
                f'model has T_m = {self.seq_len}: build the model with the cache length of the checkpoint (the 1D '
                f'encoders: max_len={cache.shape[1] - p})')
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _sequence_summary(
            self, src: torch.Tensor, valid: Optional[torch.Tensor]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The summary (B, T_m, D_m) of `src` (B, prefix + n, D_m) and which samples have real tokens ((B,) bool, or
        None without a mask): prefix slots as they are, then the real tokens resized to `seq_len` slots."""
        B, T, dm = src.shape
        p, T_m = self.num_prefix_tokens, self.seq_len
        tokens = src[:, p:]
        n = T - p
        if n < 1:
            raise ValueError('the GRC layer got no sequence tokens (only the prefix)')
        if valid is None:
            counts = torch.full((B,), n, dtype=torch.long, device=src.device)
            order = None
        else:
            counts = valid.sum(1)
            # the real tokens first, in order (stable)
            order = torch.argsort((~valid).to(torch.uint8), dim=1, stable=True)
        if n > T_m:  # only then may a sample have more real tokens than slots (a host sync, only here)
            longest = int(counts.max())
            if longest > T_m:
                raise ValueError(f'a sequence of {longest} real tokens is longer than the GRC cache (T_m = {T_m} '
                                 'slots): truncate it, or build the model with a longer max_len')
        if valid is None and n == T_m:
            summary = tokens
        else:
            src_index = torch.arange(T_m, device=src.device)[None] * counts[:, None] // T_m  # (B, T_m)
            if order is not None:
                src_index = order.gather(1, src_index)
            summary = tokens.gather(1, src_index[..., None].expand(-1, -1, dm))
        if p:
            summary = torch.cat([src[:, :p], summary], dim=1)
        return summary, (None if valid is None else counts > 0)

    def forward(  # type: ignore[override]
            self,
            x: torch.Tensor,
            o_self: torch.Tensor,
            mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """
        Args:
            x: Attention input (B, prefix + n, D): prefix (cls) tokens, then the sequence.
            o_self: Self-attention output (B, prefix + n, D).
            mask: Optional (B, n) mask of the sequence tokens, True (or 1) on real tokens.
        """
        refuse_legacy_onnx_export('GatedRecurrentCache1d')
        B, T, D = x.shape
        if o_self.shape != x.shape:
            raise ValueError(f'self-attention output {o_self.shape} must match its input {x.shape}')
        if D != self.dim:
            raise ValueError(f'GRC layer built for width {self.dim}, got input of width {D}')
        p = self.num_prefix_tokens
        valid = None if mask is None else mask.to(torch.bool)
        if valid is not None and valid.shape != (B, T - p):
            raise ValueError(f'mask {tuple(valid.shape)} must be (batch, sequence tokens) = ({B}, {T - p})')
        dm = self.cache_dim
        src = o_self if self.summary_src == 'self' else x
        summary, keep = self._sequence_summary(src[..., :dm], valid)
        cache = self._updated_cache(summary, B, keep)
        return self._read(x, o_self, cache, valid)

    def _read(self, x: torch.Tensor, o_self: torch.Tensor, cache: torch.Tensor,
              valid: Optional[torch.Tensor]) -> torch.Tensor:
        """Memory branch over `cache` (B or 1, T_m, D_m), the per-head mix and the PE (if any)."""
        o_mem = self.mem_attn(x[..., :self.cache_dim], cache)
        if self.pe is None:
            return self._mix(o_self, o_mem, None)
        seq = x[:, self.num_prefix_tokens:]
        if valid is not None:
            seq = seq * valid[..., None].to(seq.dtype)  # pad tokens enter the PE as zeros
        pe = self.pe(seq.transpose(1, 2)).transpose(1, 2)
        return self._mix(o_self, o_mem, pe)

    # The cache as an explicit state (a stream carried from segment to segment, e.g. a causal LM): the caller keeps
    # the cache, these three steps read and update it, and the layer's buffer is neither read nor written.

    def sequence_summary(self, x: torch.Tensor, o_self: torch.Tensor,
                         mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """What a sequence writes into a cache: its summary (B, T_m, D_m) (prefix slots, then the real tokens of
        `summary_src` resized to T_m, as `forward`) and which samples have real tokens ((B,) bool)."""
        B, T, _ = x.shape
        valid = None if mask is None else mask.to(torch.bool)
        if valid is not None and valid.shape != (B, T - self.num_prefix_tokens):
            raise ValueError(f'mask {tuple(valid.shape)} must be (batch, sequence tokens) = '
                             f'({B}, {T - self.num_prefix_tokens})')
        src = o_self if self.summary_src == 'self' else x
        summary, keep = self._sequence_summary(src[..., :self.cache_dim], valid)
        if keep is None:
            keep = torch.ones(B, dtype=torch.bool, device=x.device)
        return summary, keep

    def _check_state(self, cache: torch.Tensor, batch_size: int) -> None:
        if cache.ndim != 3 or cache.shape[0] not in (1, batch_size) or cache.shape[1:] != (self.cache_len,
                                                                                          self.cache_dim):
            raise ValueError(f'GRC cache state {tuple(cache.shape)} must be (batch {batch_size} or 1, T_m '
                             f"{self.cache_len}, D_m {self.cache_dim}): start a stream from the layer's `cache` "
                             'buffer (expanded to the batch) and pass what `update_state` returned')

    def update_state(self, cache: torch.Tensor, summary: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """The per-sample update C_t = GRC(C_{t-1}, S) of an explicit cache (B or 1, T_m, D_m) by a summary
        (B, T_m, D_m) of `sequence_summary`; samples whose `keep` is False keep their cache. Nothing is stored:
        the caller carries the result. Gradients flow into both inputs and the gate weights (detach to truncate)."""
        self._check_state(cache, summary.shape[0])
        if self.gate_weight is not None:
            raise RuntimeError('update_state: this GRC layer was reparameterized (its gate terms hold the frozen '
                               'buffer); carry explicit caches with the layer as built')
        cache = cache.to(summary.dtype)
        return torch.where(keep.view(-1, 1, 1), self.update(cache, summary), cache)

    def read_state(self, x: torch.Tensor, o_self: torch.Tensor, cache: torch.Tensor,
                   mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The GRC-Attention output with the memory branch over an explicit cache (B or 1, T_m, D_m) as it is (no
        update first): o_mem = MemAttn(x[..., :D_m], cache), the per-head mix with `o_self`, and the PE if the
        layer has one. A causal model reads the cache of the segments before and updates it afterwards."""
        self._check_state(cache, x.shape[0])
        if o_self.shape != x.shape:
            raise ValueError(f'self-attention output {o_self.shape} must match its input {x.shape}')
        valid = None if mask is None else mask.to(torch.bool)
        return self._read(x, o_self, cache.to(x.dtype), valid)


def self_attention_of(attn_cls: type) -> Callable[..., torch.Tensor]:
    """`attn_cls.forward` as a method named `self_attention`, for the GRC subclass of a backbone's attention class.

    The subclass's forward runs `self.self_attention(...)`, the base class's own forward, unchanged (the self branch),
    then its `grc`. A copy of the function under another name instead of `super().forward(...)`: TorchScript cannot
    call super(), and it would compile a plain alias under the name `forward`, which the subclass already defines.
    """
    fn = attn_cls.forward
    method = types.FunctionType(fn.__code__, fn.__globals__, 'self_attention', fn.__defaults__, fn.__closure__)
    functools.update_wrapper(method, fn, assigned=('__module__', '__doc__', '__annotations__'), updated=())
    method.__kwdefaults__ = fn.__kwdefaults__
    method.__qualname__ = f'{attn_cls.__qualname__}.self_attention'
    return method


def wrap_attention_with_grc(
        attn: nn.Module,
        grc_attn_cls: Type[nn.Module],
        dim: int,
        num_heads: int,
        cache_hw: Tuple[int, int],
        config: Optional[GrcConfig] = None,
        num_prefix_tokens: int = 0,
        mem_attn_kwargs: Optional[Dict[str, Any]] = None,
        init_fn: Optional[Callable[[nn.Module], None]] = None,
) -> nn.Module:
    """Turn a block's self-attention into its GRC-Attention in place (every self-attention layer, as the paper's
    App. B), and return it.

    The module keeps its parameters, buffers, their names and every option it was built with (timm's qk_norm, ...),
    so the base model's weights load as they are, and gains a `GatedRecurrentCache` child `grc` whose cache covers
    `num_prefix_tokens` + the `cache_hw` grid. Its class becomes `grc_attn_cls`: a subclass of its class that holds
    no state of its own and only adds a forward, the unchanged self-attention (`self_attention_of`) followed by
    `grc`. Build the model first; the GRC layer's parameters are then initialized by `init_fn` (the model's weight
    init), or by the model's own init when it runs later.

    Args:
        attn: The block's attention module, as the backbone built it.
        grc_attn_cls: The GRC subclass of its class.
        dim: Width D of the attention's input and output.
        num_heads: Heads of the attention (the memory branch has as many).
        cache_hw: The patch grid the cache covers: the stage's grid at the training resolution (Swin: the window).
        config: GRC options (`GrcConfig`); its defaults when None.
        num_prefix_tokens: Prefix (cls) tokens in front of the patch tokens.
        mem_attn_kwargs: Options of the memory attention that follow the self-attention (`GrcMemoryAttention`:
            qkv_bias, sr_ratio, linear_attn, window_size).
        init_fn: Applied to the new GRC layer's modules (e.g. the model's `_init_weights`).
    """
    param = next(attn.parameters())
    grc = GatedRecurrentCache(
        dim,
        num_heads,
        cache_len=num_prefix_tokens + cache_hw[0] * cache_hw[1],
        cache_hw=cache_hw,
        num_prefix_tokens=num_prefix_tokens,
        config=config,
        mem_attn_kwargs=mem_attn_kwargs,
        device=param.device,
        dtype=param.dtype,
    )
    return attach_grc(attn, grc_attn_cls, grc, init_fn)


def attach_grc(
        attn: nn.Module,
        grc_attn_cls: Type[nn.Module],
        grc: GatedRecurrentCache,
        init_fn: Optional[Callable[[nn.Module], None]] = None,
) -> nn.Module:
    """Make `attn` a GRC-Attention in place with a GRC layer built by the caller (`wrap_attention_with_grc` builds
    the patch-grid one; the 1D sequence models a `GatedRecurrentCache1d`): `attn` becomes an instance of
    `grc_attn_cls` (a subclass of its class that only adds a forward) and gains the child `grc`, initialized by
    `init_fn` when given. Returns `attn`."""
    if grc_attn_cls is type(attn) or not issubclass(grc_attn_cls, type(attn)):
        raise TypeError(f'{grc_attn_cls.__name__} is not a GRC subclass of {type(attn).__name__}: pass the GRC class '
                        'made for the attention class the model built (an attention is wrapped once)')
    if init_fn is not None:
        grc.apply(init_fn)
    attn.__class__ = grc_attn_cls  # same object and state, plus the forward that runs `grc`
    attn.grc = grc
    return attn


class GrcAttention(nn.Module):
    """Generic GRC wrapper around any self-attention `attn(x, *args) -> (B, T, D)`, for user code.

    The self branch lives under `attn`, so its keys gain an `attn.` prefix; the lsvision backbones instead keep their
    attention's keys (`wrap_attention_with_grc`).
    """

    def __init__(self, attn: nn.Module, dim: int, num_heads: int, cache_len: int, **grc_kwargs: Any):
        """`grc_kwargs` go to `GatedRecurrentCache` (cache_hw, num_prefix_tokens, config, ...)."""
        super().__init__()
        self.attn = attn
        self.grc = GatedRecurrentCache(dim, num_heads, cache_len, **grc_kwargs)

    def forward(self, x: torch.Tensor, feat_size: Optional[List[int]] = None) -> torch.Tensor:
        if feat_size is None:
            o_self = self.attn(x)
        else:
            o_self = self.attn(x, feat_size)
        return self.grc(x, o_self, feat_size)
