"""ViT / DeiT with GRC-Attention (Cached Transformers), built on timm's VisionTransformer.

Papers:
    * `An Image is Worth 16x16 Words: Transformers for Image Recognition at Scale` - https://arxiv.org/abs/2010.11929
    * `Training data-efficient image transformers & distillation through attention` - https://arxiv.org/abs/2012.12877
    * `Cached Transformers: Improving Transformers with Differentiable Memory Cache` - https://arxiv.org/abs/2312.12742

timm's `VisionTransformer` is built unchanged, then every block's `Attention` becomes a `VitGrcAttention`
(`wrap_attention_with_grc`): timm's attention as built (qk_norm and the other options kept), with its keys
(`attn.qkv/proj`), plus one `grc` child. (timm calls `issubclass` on `attn_layer`, so a partial can't be passed;
wrapping after construction avoids that.) The cache covers the prefix tokens and the
patch grid at the training resolution (1 x 197 x D_m for ViT-S/16 at 224); other token counts (`dynamic_img_size`)
resize the summary to the cache (1-D nearest, or '2d'); `forward_features` passes the patch grid to the PE conv, so
non-square grids work (`forward_intermediates`, timm's own, assumes a square one). No gradient checkpointing. The
forward features are tokens: these are timm "non-standard" models.

Written for lsvision, Apache-2.0.
"""
from functools import partial
from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, IMAGENET_INCEPTION_MEAN, IMAGENET_INCEPTION_STD
from timm.layers import Attention
from timm.models import generate_default_cfgs, register_model
from timm.models.vision_transformer import VisionTransformer
from timm.models.vision_transformer import checkpoint_filter_fn as _vit_filter_fn

from lsvision.layers import GrcConfig, self_attention_of, wrap_attention_with_grc
from lsvision.layers.export import refuse_legacy_onnx_export

from ._helpers import GrcModelMixin, check_image_input, init_linear_trunc_normal, require_non_grc_keys
from ._pretrained import build_model

# the input check is a leaf of torch.fx graphs here too (timm's forward, whose globals fx patches, is in timm)
torch.fx.wrap('check_image_input')

__all__ = ['VitGrcAttention', 'VisionTransformerGrc']


class VitGrcAttention(Attention):
    """timm multi-head self-attention, run as is, with a GRC cache (prefix tokens + patch grid) under `grc`.

    Made from a built `Attention` by `wrap_attention_with_grc`.
    """

    self_attention = self_attention_of(Attention)

    def forward(
            self,
            x: torch.Tensor,
            attn_mask: Optional[torch.Tensor] = None,
            is_causal: bool = False,
            feat_size: Optional[List[int]] = None,
    ) -> torch.Tensor:
        """`feat_size` (H, W) of the patch grid; None: a square grid (timm's blocks pass none)."""
        refuse_legacy_onnx_export('VitGrcAttention')  # before timm's self branch, which that exporter cannot trace
        # masks apply to the self branch only; the memory branch attends to every cache slot
        return self.grc(x, self.self_attention(x, attn_mask, is_causal), feat_size)


class VisionTransformerGrc(GrcModelMixin, VisionTransformer):
    """timm Vision Transformer with GRC-Attention in every block."""

    def __init__(self, grc_config: Optional[GrcConfig] = None, **kwargs: Any):
        """
        Args:
            grc_config: The GRC options (`lsvision.layers.GrcConfig`), or the same as `grc_*` keyword arguments
                (`grc_ratio=0.25`, ...).
            **kwargs: timm `VisionTransformer` arguments (unknown ones raise TypeError there).
        """
        grc_config = GrcConfig.from_kwargs(grc_config, kwargs)
        super().__init__(**kwargs)
        for blk in self.blocks:
            attn = blk.attn
            wrap_attention_with_grc(
                attn, VitGrcAttention, attn.qkv.in_features, attn.num_heads,
                cache_hw=tuple(self.patch_embed.grid_size), config=grc_config,
                num_prefix_tokens=self.num_prefix_tokens, mem_attn_kwargs=dict(qkv_bias=attn.qkv.bias is not None),
                init_fn=init_linear_trunc_normal)

    def forward_features(
            self,
            x: torch.Tensor,
            attn_mask: Optional[torch.Tensor] = None,
            is_causal: bool = False,
    ) -> torch.Tensor:
        """timm's `VisionTransformer.forward_features`, with the patch grid passed to every GRC attention, so that
        non-square grids (`dynamic_img_size=True`) work: the PE conv needs the grid, which the token count does not
        give. timm's `Block.forward` has no argument that could carry it, so its two residual steps are restated
        here (the one restated piece of timm in the GRC models). Inputs are checked first (a wrong channel count or a
        non-image tensor is explained; timm's patch embedding explains a wrong size)."""
        check_image_input(x, self.patch_embed.proj.in_channels, self.patch_embed.patch_size[0])
        x = self.patch_embed(x)
        if self.dynamic_img_size:
            feat_size = [x.shape[1], x.shape[2]]  # (B, H, W, C) with a dynamic size
        else:
            feat_size = [self.patch_embed.grid_size[0], self.patch_embed.grid_size[1]]
        x = self._pos_embed(x)
        x = self.patch_drop(x)
        x = self.norm_pre(x)
        for blk in self.blocks:
            x = x + blk.drop_path1(blk.ls1(blk.attn(blk.norm1(x), attn_mask, is_causal, feat_size)))
            x = x + blk.drop_path2(blk.ls2(blk.mlp(blk.norm2(x))))
        return self.norm(x)


def checkpoint_filter_fn(
        state_dict: Dict[str, torch.Tensor],
        model: nn.Module,
        adapt_layer_scale: bool = False,
) -> Dict[str, torch.Tensor]:
    """timm's ViT filter (official or timm layout); then every key except `attn.grc.*` must be present."""
    return require_non_grc_keys(_vit_filter_fn(state_dict, model, adapt_layer_scale=adapt_layer_scale), model)


def _create_vit_grc(variant: str, pretrained: bool = False, **kwargs: Any) -> VisionTransformerGrc:
    out_indices = kwargs.pop('out_indices', 3)
    return build_model(
        VisionTransformerGrc,
        variant,
        pretrained,
        pretrained_filter_fn=partial(checkpoint_filter_fn, adapt_layer_scale=variant.startswith('deit')),
        pretrained_strict=False,  # baseline weights: only attn.grc.* missing (checked in checkpoint_filter_fn)
        feature_cfg=dict(out_indices=out_indices, feature_cls='getter'),
        **kwargs,
    )


def _cfg(url: str = '', **kwargs: Any) -> Dict[str, Any]:
    return {
        'url': url, 'num_classes': 1000, 'input_size': (3, 224, 224), 'pool_size': None,
        'crop_pct': .9, 'interpolation': 'bicubic', 'fixed_input_size': True,
        'mean': IMAGENET_INCEPTION_MEAN, 'std': IMAGENET_INCEPTION_STD,
        'first_conv': 'patch_embed.proj', 'classifier': 'head',
        'license': 'apache-2.0', 'paper_ids': 'arXiv:2312.12742',
        'paper_name': 'Cached Transformers: Improving Transformers with Differentiable Memory Cache',
        'origin_url': 'https://github.com/annosubmission/GRC-Cache',
        **kwargs,
    }


default_cfgs = generate_default_cfgs({
    'vit_small_patch16_224_grc.untrained': _cfg(),
    'deit_small_patch16_224_grc.untrained': _cfg(
        mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD, crop_pct=.875),
})


@register_model
def vit_small_patch16_224_grc(pretrained: bool = False, **kwargs: Any) -> VisionTransformerGrc:
    """ViT-S/16 with GRC-Attention (r=0.5) in every block (paper: 79.9 -> 81.3 top-1)."""
    model_args = dict(patch_size=16, embed_dim=384, depth=12, num_heads=6)
    return _create_vit_grc('vit_small_patch16_224_grc', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def deit_small_patch16_224_grc(pretrained: bool = False, **kwargs: Any) -> VisionTransformerGrc:
    """DeiT-S/16 with GRC-Attention (r=0.5) in every block (same architecture as ViT-S/16)."""
    model_args = dict(patch_size=16, embed_dim=384, depth=12, num_heads=6)
    return _create_vit_grc('deit_small_patch16_224_grc', pretrained=pretrained, **dict(model_args, **kwargs))
