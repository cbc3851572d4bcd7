"""ViT / DeiT with GRC-Attention (Cached Transformers), built on timm's VisionTransformer.

Papers:
    * `An Image is Worth 16x16 Words: Transformers for Image Recognition at Scale` - https://arxiv.org/abs/2010.11929
    * `Training data-efficient image transformers & distillation through attention` - https://arxiv.org/abs/2012.12877
    * `Cached Transformers: Improving Transformers with Differentiable Memory Cache` - https://arxiv.org/abs/2312.12742

timm's `VisionTransformer` is built unchanged, then every block's `Attention` is replaced by `VitGrcAttention`, a
subclass that keeps its keys (`attn.qkv/proj`) and adds one `grc` child. (timm calls `issubclass` on `attn_layer`,
so a partial can't be passed; replacing after construction avoids that.) The cache covers the prefix tokens and the
patch grid at the training resolution (1 x 197 x D_m for ViT-S/16 at 224); other token counts (`dynamic_img_size`)
resize the summary to the cache (1-D nearest, or '2d'); `forward_features` passes the patch grid to the PE conv, so
non-square grids work (`forward_intermediates`, timm's own, assumes a square one). No gradient checkpointing. The
forward features are tokens: these are timm "non-standard" models.

Written for lsvision, Apache-2.0.
"""
from functools import partial
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, IMAGENET_INCEPTION_MEAN, IMAGENET_INCEPTION_STD
from timm.layers import Attention
from timm.layers.attention import maybe_add_mask, resolve_self_attn_mask
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models.vision_transformer import VisionTransformer
from timm.models.vision_transformer import checkpoint_filter_fn as _vit_filter_fn

from lsvision.layers import GatedRecurrentCache
from lsvision.layers.export import refuse_legacy_onnx_export

from ._helpers import GrcModelMixin, grc_layer_kwargs, init_linear_trunc_normal, require_non_grc_keys

__all__ = ['VitGrcAttention', 'VisionTransformerGrc']


class VitGrcAttention(Attention):
    """timm multi-head self-attention with a GRC cache (prefix tokens + patch grid) under `grc`."""

    def __init__(
            self,
            dim: int,
            num_heads: int = 8,
            qkv_bias: bool = False,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
            cache_hw: Tuple[int, int] = (14, 14),
            num_prefix_tokens: int = 1,
            grc_cfg: Optional[Dict[str, Any]] = None,
            device=None,
            dtype=None,
    ):
        dd = {'device': device, 'dtype': dtype}
        super().__init__(
            dim, num_heads=num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=proj_drop, **dd)
        self.grc = GatedRecurrentCache(
            dim,
            num_heads,
            cache_len=num_prefix_tokens + cache_hw[0] * cache_hw[1],
            cache_hw=cache_hw,
            num_prefix_tokens=num_prefix_tokens,
            mem_attn_kwargs=dict(qkv_bias=qkv_bias),
            **(grc_cfg or {}),
            **dd,
        )

    def forward_self(
            self,
            x: torch.Tensor,
            attn_mask: Optional[torch.Tensor] = None,
            is_causal: bool = False,
    ) -> torch.Tensor:
        """timm's `Attention.forward`, restated because TorchScript can't call super()."""
        B, N, C = x.shape
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.fused_attn:
            x = F.scaled_dot_product_attention(
                q, k, v,
                attn_mask=attn_mask,
                dropout_p=self.attn_drop.p if self.training else 0.,
                is_causal=is_causal,
            )
        else:
            q = q * self.scale
            attn = q @ k.transpose(-2, -1)
            attn = maybe_add_mask(attn, resolve_self_attn_mask(N, attn, attn_mask, is_causal))
            attn = self.attn_drop(attn.softmax(dim=-1))
            x = attn @ v
        x = self.norm(x.transpose(1, 2).reshape(B, N, self.attn_dim))
        if gate is not None:
            x = x * gate
        return self.proj_drop(self.proj(x))

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
        return self.grc(x, self.forward_self(x, attn_mask, is_causal), feat_size)


class VisionTransformerGrc(GrcModelMixin, VisionTransformer):
    """timm Vision Transformer with GRC-Attention in every block."""

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
            **kwargs: timm `VisionTransformer` arguments (unknown ones raise TypeError there).
        """
        super().__init__(**kwargs)
        dd = {'device': kwargs.get('device'), 'dtype': kwargs.get('dtype')}
        grc_cfg = grc_layer_kwargs(
            grc_ratio, grc_lam_init, grc_summary_src, grc_eval_update, grc_interp_mode, grc_sync_cache)
        grid = tuple(self.patch_embed.grid_size)
        for blk in self.blocks:
            old = blk.attn
            blk.attn = VitGrcAttention(
                old.qkv.in_features,
                num_heads=old.num_heads,
                qkv_bias=old.qkv.bias is not None,
                attn_drop=old.attn_drop.p,
                proj_drop=old.proj_drop.p,
                cache_hw=grid,
                num_prefix_tokens=self.num_prefix_tokens,
                grc_cfg=grc_cfg,
                **dd,
            )
            blk.attn.apply(init_linear_trunc_normal)

    def forward_features(
            self,
            x: torch.Tensor,
            attn_mask: Optional[torch.Tensor] = None,
            is_causal: bool = False,
    ) -> torch.Tensor:
        """timm's `VisionTransformer.forward_features`, with the patch grid passed to every GRC attention, so that
        non-square grids (`dynamic_img_size=True`) work. The block's two residual steps are timm's `Block.forward`,
        restated to pass the grid (TorchScript can't call super())."""
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
    return build_model_with_cfg(
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
