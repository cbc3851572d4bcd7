"""Swin Transformer with GRC-Attention (Cached Transformers), built on timm's Swin.

Papers:
    * `Swin Transformer: Hierarchical Vision Transformer using Shifted Windows` - https://arxiv.org/abs/2103.14030
    * `Cached Transformers: Improving Transformers with Differentiable Memory Cache` - https://arxiv.org/abs/2312.12742

timm's `SwinTransformer` is built unchanged, then every block's `WindowAttention` becomes a
`SwinGrcWindowAttention` (`wrap_attention_with_grc`): timm's window attention as built, with its keys
(`attn.qkv/proj/relative_position_bias_table`), plus one `grc` child. The cache has one slot per window position
(1 x 49 x D_m), shared by all windows and images; a train step stores the mean update over the B * nW windows.
W-MSA and SW-MSA blocks have their own caches. The memory branch is a window attention at width D_m with its own
relative-position table and no shift mask; the PE conv runs on each window (zero padding at the window borders). The
authors published no Swin integration: this follows lsvision's reading of their `WindowAttention(q, kv, mask)`.
`set_input_size` resizes the caches (bilinear over the window grid) and the memory branch's relative-position tables
with the windows. No gradient checkpointing.

Written for lsvision, Apache-2.0.
"""
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn as nn

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import resize_rel_pos_bias_table, to_2tuple
from timm.models import generate_default_cfgs, register_model
from timm.models.swin_transformer import SwinTransformer, WindowAttention
from timm.models.swin_transformer import checkpoint_filter_fn as _swin_filter_fn

from lsvision.layers import (
    GrcConfig,
    GrcMemoryAttention,
    self_attention_of,
    wrap_attention_with_grc,
)

from ._helpers import GrcModelMixin, check_image_input, init_linear_trunc_normal, require_non_grc_keys
from ._pretrained import build_model

# the input check is a leaf of torch.fx graphs here too (timm's forward, whose globals fx patches, is in timm)
torch.fx.wrap('check_image_input')

__all__ = ['SwinGrcWindowAttention', 'SwinTransformerGrc']


class SwinGrcWindowAttention(WindowAttention):
    """timm W-MSA/SW-MSA, run as is, with a GRC cache over the window slots under `grc`.

    Made from a built `WindowAttention` by `wrap_attention_with_grc`.
    """

    self_attention = self_attention_of(WindowAttention)

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

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        ws = self.window_size
        return self.grc(x, self.self_attention(x, mask), [ws[0], ws[1]])


class SwinTransformerGrc(GrcModelMixin, SwinTransformer):
    """timm Swin Transformer with GRC-Attention in every block."""

    def __init__(self, grc_config: Optional[GrcConfig] = None, **kwargs: Any):
        """
        Args:
            grc_config: The GRC options (`lsvision.layers.GrcConfig`), or the same as `grc_*` keyword arguments
                (`grc_ratio=0.25`, ...).
            **kwargs: timm `SwinTransformer` arguments (unknown ones raise TypeError there).
        """
        grc_config = GrcConfig.from_kwargs(grc_config, kwargs)
        super().__init__(**kwargs)
        for layer in self.layers:
            for blk in layer.blocks:
                attn = blk.attn
                wrap_attention_with_grc(
                    attn, SwinGrcWindowAttention, attn.dim, attn.num_heads, cache_hw=attn.window_size,
                    config=grc_config,
                    mem_attn_kwargs=dict(qkv_bias=attn.qkv.bias is not None, window_size=attn.window_size),
                    init_fn=init_linear_trunc_normal)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """timm's (restated: TorchScript has no super()), after lsvision's input check (a wrong channel count or a
        non-image tensor is explained; timm's patch embedding explains a wrong size)."""
        check_image_input(x, self.patch_embed.proj.in_channels, self.patch_embed.patch_size[0])
        return self.norm(self.layers(self.patch_embed(x)))


def checkpoint_filter_fn(state_dict: Dict[str, torch.Tensor], model: nn.Module) -> Dict[str, torch.Tensor]:
    """timm's Swin filter (official or timm layout); then every key except `attn.grc.*` must be present."""
    return require_non_grc_keys(
        _swin_filter_fn(state_dict, model), model, ignore_suffixes=('relative_position_index', 'attn_mask'))


def _create_swin_grc(variant: str, pretrained: bool = False, **kwargs: Any) -> SwinTransformerGrc:
    out_indices = kwargs.pop('out_indices', tuple(range(len(kwargs.get('depths', (1, 1, 3, 1))))))
    return build_model(
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
