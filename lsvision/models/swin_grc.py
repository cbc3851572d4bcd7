"""Swin Transformer with GRC-Attention (Cached Transformers), built on timm's Swin.

Papers:
    * `Swin Transformer: Hierarchical Vision Transformer using Shifted Windows` - https://arxiv.org/abs/2103.14030
    * `Cached Transformers: Improving Transformers with Differentiable Memory Cache` - https://arxiv.org/abs/2312.12742

timm's `SwinTransformer` is built unchanged, then every block's `WindowAttention` is replaced by
`SwinGrcWindowAttention`, a subclass that keeps its keys (`attn.qkv/proj/relative_position_bias_table`) and adds one
`grc` child. The cache has one slot per window position (1 x 49 x D_m), shared by all windows and images; a train
step stores the mean update over the B * nW windows. W-MSA and SW-MSA blocks have their own caches. The memory
branch is a window attention at width D_m with its own relative-position table and no shift mask; the PE conv runs
on each window (zero padding at the window borders). The authors published no Swin integration: this follows the
spec's reading of their `WindowAttention(q, kv, mask)`. `set_input_size` resizes the caches (bilinear over the
window grid) and the memory branch's relative-position tables with the windows. No gradient checkpointing.

Written for lsvision, Apache-2.0.
"""
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import resize_rel_pos_bias_table, to_2tuple
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models.swin_transformer import SwinTransformer, WindowAttention
from timm.models.swin_transformer import checkpoint_filter_fn as _swin_filter_fn

from lsvision.layers import GatedRecurrentCache, GrcMemoryAttention

from ._helpers import GrcModelMixin, grc_layer_kwargs, init_linear_trunc_normal, require_non_grc_keys

__all__ = ['SwinGrcWindowAttention', 'SwinTransformerGrc']


class SwinGrcWindowAttention(WindowAttention):
    """timm W-MSA/SW-MSA with a GRC cache over the window slots under `grc`."""

    def __init__(
            self,
            dim: int,
            num_heads: int,
            head_dim: Optional[int] = None,
            window_size: Tuple[int, int] = (7, 7),
            qkv_bias: bool = True,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
            grc_cfg: Optional[Dict[str, Any]] = None,
            device=None,
            dtype=None,
    ):
        dd = {'device': device, 'dtype': dtype}
        super().__init__(
            dim,
            num_heads=num_heads,
            head_dim=head_dim,
            window_size=window_size,
            qkv_bias=qkv_bias,
            attn_drop=attn_drop,
            proj_drop=proj_drop,
            **dd,
        )
        ws = self.window_size
        self.grc = GatedRecurrentCache(
            dim,
            num_heads,
            cache_len=ws[0] * ws[1],
            cache_hw=ws,
            mem_attn_kwargs=dict(qkv_bias=qkv_bias, window_size=ws),
            **(grc_cfg or {}),
            **dd,
        )

    def set_window_size(self, window_size: Tuple[int, int]) -> None:
        """Resize the window, the cache (bilinear over the slots) and both relative-position tables."""
        window_size = to_2tuple(window_size)
        if window_size == self.window_size:
            return
        super().set_window_size(window_size)
        self.grc.resize_cache(window_size)
        mem = self.grc.mem_attn
        assert isinstance(mem, GrcMemoryAttention)
        old = mem.window_size
        mem.window_size = tuple(window_size)
        with torch.no_grad():
            table = mem.relative_position_bias_table
            mem.relative_position_bias_table = nn.Parameter(
                resize_rel_pos_bias_table(
                    table,
                    new_window_size=window_size,
                    new_bias_shape=((2 * window_size[0] - 1) * (2 * window_size[1] - 1), table.shape[1]),
                    old_window_size=old,
                ),
                requires_grad=table.requires_grad,
            )
        mem.register_buffer('relative_position_index', mem._rel_index(table.device), persistent=False)

    def forward_self(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """timm's `WindowAttention.forward`, restated because TorchScript can't call super()."""
        B_, N, C = x.shape
        qkv = self.qkv(x).reshape(B_, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        if self.fused_attn:
            attn_mask = self._get_rel_pos_bias()
            if mask is not None:
                num_win = mask.shape[0]
                mask = mask.view(1, num_win, 1, N, N).expand(B_ // num_win, -1, self.num_heads, -1, -1)
                attn_mask = attn_mask + mask.reshape(-1, self.num_heads, N, N)
            x = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, dropout_p=self.attn_drop.p if self.training else 0.)
        else:
            q = q * self.scale
            attn = q @ k.transpose(-2, -1)
            attn = attn + self._get_rel_pos_bias()
            if mask is not None:
                num_win = mask.shape[0]
                attn = attn.view(-1, num_win, self.num_heads, N, N) + mask.unsqueeze(1).unsqueeze(0)
                attn = attn.view(-1, self.num_heads, N, N)
            attn = self.attn_drop(self.softmax(attn))
            x = attn @ v
        x = x.transpose(1, 2).reshape(B_, N, -1)
        return self.proj_drop(self.proj(x))

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        ws = self.window_size
        return self.grc(x, self.forward_self(x, mask), [ws[0], ws[1]])


class SwinTransformerGrc(GrcModelMixin, SwinTransformer):
    """timm Swin Transformer with GRC-Attention in every block."""

    def __init__(
            self,
            grc_ratio: float = 0.5,
            grc_lam_init: float = 0.0,
            grc_summary_src: str = 'self',
            grc_eval_update: bool = True,
            grc_interp_mode: str = 'nearest1d',
            grc_sync_cache: bool = False,
            **kwargs: Any,
    ):
        """
        Args:
            grc_ratio: Caching ratio r (cache width r * dim).
            grc_lam_init: Initial mixing logit (0.0 paper, -1.0 authors' code).
            grc_summary_src: Cache update from the self-attention output ('self') or the block input ('input').
            grc_eval_update: In eval, compute the per-sample update from the frozen cache (not stored).
            grc_interp_mode: Summary resizing when the token count differs from the cache: 'nearest1d' or '2d'.
            grc_sync_cache: All-reduce the stored cache update over the process group (DDP).
            **kwargs: timm `SwinTransformer` arguments (unknown ones raise TypeError there).
        """
        super().__init__(**kwargs)
        dd = {'device': kwargs.get('device'), 'dtype': kwargs.get('dtype')}
        grc_cfg = grc_layer_kwargs(
            grc_ratio, grc_lam_init, grc_summary_src, grc_eval_update, grc_interp_mode, grc_sync_cache)
        for layer in self.layers:
            for blk in layer.blocks:
                old = blk.attn
                blk.attn = SwinGrcWindowAttention(
                    old.dim,
                    num_heads=old.num_heads,
                    head_dim=old.qkv.out_features // 3 // old.num_heads,
                    window_size=old.window_size,
                    qkv_bias=old.qkv.bias is not None,
                    attn_drop=old.attn_drop.p,
                    proj_drop=old.proj_drop.p,
                    grc_cfg=grc_cfg,
                    **dd,
                )
                blk.attn.apply(init_linear_trunc_normal)


def checkpoint_filter_fn(state_dict: Dict[str, torch.Tensor], model: nn.Module) -> Dict[str, torch.Tensor]:
    """timm's Swin filter (official or timm layout); then every key except `attn.grc.*` must be present."""
    return require_non_grc_keys(
        _swin_filter_fn(state_dict, model), model, ignore_suffixes=('relative_position_index', 'attn_mask'))


def _create_swin_grc(variant: str, pretrained: bool = False, **kwargs: Any) -> SwinTransformerGrc:
    out_indices = kwargs.pop('out_indices', tuple(range(len(kwargs.get('depths', (1, 1, 3, 1))))))
    return build_model_with_cfg(
        SwinTransformerGrc,
        variant,
        pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        pretrained_strict=False,  # baseline weights: only attn.grc.* missing (checked in checkpoint_filter_fn)
        feature_cfg=dict(flatten_sequential=True, out_indices=out_indices),
        **kwargs,
    )


def _cfg(url: str = '', **kwargs: Any) -> Dict[str, Any]:
    return {
        'url': url, 'num_classes': 1000, 'input_size': (3, 224, 224), 'pool_size': (7, 7),
        'crop_pct': .9, 'interpolation': 'bicubic', 'fixed_input_size': True,
        'mean': IMAGENET_DEFAULT_MEAN, 'std': IMAGENET_DEFAULT_STD,
        'first_conv': 'patch_embed.proj', 'classifier': 'head.fc',
        'license': 'mit', 'paper_ids': 'arXiv:2312.12742',
        'paper_name': 'Cached Transformers: Improving Transformers with Differentiable Memory Cache',
        'origin_url': 'https://github.com/annosubmission/GRC-Cache',
        **kwargs,
    }


default_cfgs = generate_default_cfgs({
    'swin_tiny_patch4_window7_224_grc.untrained': _cfg(),
    'swin_small_patch4_window7_224_grc.untrained': _cfg(),
    'swin_base_patch4_window7_224_grc.untrained': _cfg(),
})


@register_model
def swin_tiny_patch4_window7_224_grc(pretrained: bool = False, **kwargs: Any) -> SwinTransformerGrc:
    """Swin-T with GRC-Attention (r=0.5) in every block (paper: 81.2 -> 82.1 top-1)."""
    model_args = dict(patch_size=4, window_size=7, embed_dim=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24))
    return _create_swin_grc('swin_tiny_patch4_window7_224_grc', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def swin_small_patch4_window7_224_grc(pretrained: bool = False, **kwargs: Any) -> SwinTransformerGrc:
    """Swin-S with GRC-Attention (r=0.5) in every block."""
    model_args = dict(patch_size=4, window_size=7, embed_dim=96, depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24))
    return _create_swin_grc('swin_small_patch4_window7_224_grc', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def swin_base_patch4_window7_224_grc(pretrained: bool = False, **kwargs: Any) -> SwinTransformerGrc:
    """Swin-B with GRC-Attention (r=0.5) in every block."""
    model_args = dict(patch_size=4, window_size=7, embed_dim=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32))
    return _create_swin_grc('swin_base_patch4_window7_224_grc', pretrained=pretrained, **dict(model_args, **kwargs))
