"""PVT v2 with GRC-Attention (Cached Transformers), built on timm's PVT v2.

Papers:
    * `PVT v2: Improved Baselines with Pyramid Vision Transformer` - https://arxiv.org/abs/2106.13797
    * `Cached Transformers: Improving Transformers with Differentiable Memory Cache` - https://arxiv.org/abs/2312.12742

timm's `PyramidVisionTransformerV2` is built unchanged, then every block's attention becomes a
`PvtV2GrcAttention` (`wrap_attention_with_grc`): timm's `pvt_v2.Attention` as built, with its parameter names
(`attn.q/kv/proj/sr/norm`), plus one `grc` child (`attn.grc.*`: cache buffer, gates, memory SRA on the cache grid,
mixing logits, PE conv). timm `pvt_v2_*` weights therefore load with only `attn.grc.*` keys missing:
`timm.create_model('pvt_v2_b2_grc', pretrained=True, pretrained_cfg_overlay=dict(file='pvt_v2_b2.pth'))`.
The authors published no PVT v2 integration; the memory branch reuses the stage's sr ratio (or linear SRA for
`_li`) on the cache grid, as their PVT v1 code does. GRC models do not support gradient checkpointing.

Written for lsvision, Apache-2.0.
"""
from typing import Any, Dict, List, Optional, Tuple, Type, Union

import torch
import torch.nn as nn

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import LayerNorm
from timm.models import generate_default_cfgs, register_model
from timm.models.pvt_v2 import Attention as PvtV2Attention
from timm.models.pvt_v2 import PyramidVisionTransformerV2
from timm.models.pvt_v2 import checkpoint_filter_fn as _pvt_v2_filter_fn

from lsvision.layers import GrcConfig, self_attention_of, wrap_attention_with_grc

from ._helpers import GrcModelMixin, check_image_input, require_non_grc_keys
from ._pretrained import build_model

__all__ = ['PvtV2GrcAttention', 'PyramidVisionTransformerV2Grc']


class PvtV2GrcAttention(PvtV2Attention):
    """timm PVT v2 (linear) SRA, run as is, with a GRC cache over the stage's patch grid under `grc`.

    Made from a built `pvt_v2.Attention` by `wrap_attention_with_grc`.
    """

    self_attention = self_attention_of(PvtV2Attention)

    def forward(self, x: torch.Tensor, feat_size: List[int]) -> torch.Tensor:
        return self.grc(x, self.self_attention(x, feat_size), feat_size)


def _grid_sizes(img_size: Tuple[int, int], num_stages: int) -> List[Tuple[int, int]]:
    """Patch grid of each stage: overlapping embeds k7/s4/p3, then k3/s2/p1."""
    h, w = (img_size[0] + 6 - 7) // 4 + 1, (img_size[1] + 6 - 7) // 4 + 1
    sizes = [(h, w)]
    for _ in range(num_stages - 1):
        h, w = (h + 2 - 3) // 2 + 1, (w + 2 - 3) // 2 + 1
        sizes.append((h, w))
    return sizes


class PyramidVisionTransformerV2Grc(GrcModelMixin, PyramidVisionTransformerV2):
    """timm PVT v2 with GRC-Attention in every block."""

    def __init__(
            self,
            img_size: Union[int, Tuple[int, int]] = 224,
            in_chans: int = 3,
            num_classes: int = 1000,
            global_pool: str = 'avg',
            depths: Tuple[int, ...] = (3, 4, 6, 3),
            embed_dims: Tuple[int, ...] = (64, 128, 256, 512),
            num_heads: Tuple[int, ...] = (1, 2, 4, 8),
            sr_ratios: Tuple[int, ...] = (8, 4, 2, 1),
            mlp_ratios: Tuple[float, ...] = (8., 8., 4., 4.),
            qkv_bias: bool = True,
            linear: bool = False,
            drop_rate: float = 0.,
            proj_drop_rate: float = 0.,
            attn_drop_rate: float = 0.,
            drop_path_rate: float = 0.,
            norm_layer: Type[nn.Module] = LayerNorm,
            grc_config: Optional[GrcConfig] = None,
            device=None,
            dtype=None,
            **kwargs: Any,
    ):
        """
        Args:
            img_size: Training resolution: sizes the GRC caches (stage grids 56/28/14/7 at 224).
            grc_config: The GRC options (`lsvision.layers.GrcConfig`), or the same as `grc_*` keyword arguments
                (`grc_ratio=0.25`, ...).

        The other arguments are timm's `PyramidVisionTransformerV2`'s.
        """
        dd = {'device': device, 'dtype': dtype}
        grc_config = GrcConfig.from_kwargs(grc_config, kwargs)
        super().__init__(
            in_chans=in_chans,
            num_classes=num_classes,
            global_pool=global_pool,
            depths=depths,
            embed_dims=embed_dims,
            num_heads=num_heads,
            sr_ratios=sr_ratios,
            mlp_ratios=mlp_ratios,
            qkv_bias=qkv_bias,
            linear=linear,
            drop_rate=drop_rate,
            proj_drop_rate=proj_drop_rate,
            attn_drop_rate=attn_drop_rate,
            drop_path_rate=drop_path_rate,
            norm_layer=norm_layer,
            **kwargs,  # other timm arguments; unknown ones raise TypeError there
            **dd,
        )
        img_size = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
        self.min_input_size = 32
        for stage, dim, grid in zip(self.stages, embed_dims, _grid_sizes(img_size, len(depths))):
            for blk in stage.blocks:
                attn = blk.attn
                linear_attn = attn.pool is not None
                sr_ratio = attn.sr.stride[0] if attn.sr is not None and not linear_attn else 1
                wrap_attention_with_grc(
                    attn, PvtV2GrcAttention, dim, attn.num_heads, cache_hw=grid, config=grc_config,
                    mem_attn_kwargs=dict(qkv_bias=attn.q.bias is not None, sr_ratio=sr_ratio, linear_attn=linear_attn),
                    init_fn=self._init_weights)

    @torch.jit.ignore
    def set_input_size(self, img_size: Optional[Union[int, Tuple[int, int]]] = None) -> None:
        """Make `img_size` the native input size: the GRC caches are resized to its stage grids (PVT v2 itself has
        no position embeddings: any size runs)."""
        if img_size is not None:
            self.resize_cache(img_size)

    @torch.jit.ignore
    def resize_cache(self, img_size: Union[int, Tuple[int, int]]) -> None:
        """Resize every cache (bilinear over its grid) to the stage grids of a new training resolution."""
        img_size = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
        grids = _grid_sizes(img_size, len(self.stages))
        for i, stage in enumerate(self.stages):
            for blk in stage.blocks:
                blk.attn.grc.resize_cache(grids[i])

    def forward_intermediates(
            self,
            x: torch.Tensor,
            indices: Optional[Union[int, List[int]]] = None,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = 'NCHW',
            intermediates_only: bool = False,
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """timm's PVT v2 forward_intermediates, with an input check."""
        check_image_input(x, self.in_chans, self.min_input_size)
        return super().forward_intermediates(
            x,
            indices=indices,
            norm=norm,
            stop_early=stop_early,
            output_fmt=output_fmt,
            intermediates_only=intermediates_only,
        )

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        check_image_input(x, self.in_chans, self.min_input_size)
        x = self.patch_embed(x)
        return self.stages(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def checkpoint_filter_fn(state_dict: Dict[str, torch.Tensor], model: nn.Module) -> Dict[str, torch.Tensor]:
    """timm's PVT v2 filter (official or timm layout); then every key except `attn.grc.*` must be present.

    GRC keys absent from a baseline checkpoint stay fresh (zero caches); timm reports them as missing.
    """
    for key in ('model', 'state_dict'):
        if key in state_dict and isinstance(state_dict[key], dict):
            state_dict = state_dict[key]
    return require_non_grc_keys(_pvt_v2_filter_fn(state_dict, model), model)


def _create_pvt2_grc(variant: str, pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformerV2Grc:
    out_indices = kwargs.pop('out_indices', (0, 1, 2, 3))
    return build_model(
        PyramidVisionTransformerV2Grc,
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
        'crop_pct': 0.9, 'interpolation': 'bicubic', 'fixed_input_size': False,
        'mean': IMAGENET_DEFAULT_MEAN, 'std': IMAGENET_DEFAULT_STD,
        'first_conv': 'patch_embed.proj', 'classifier': 'head',
        'license': 'apache-2.0', 'paper_ids': 'arXiv:2312.12742',
        'paper_name': 'Cached Transformers: Improving Transformers with Differentiable Memory Cache',
        'origin_url': 'https://github.com/annosubmission/GRC-Cache',
        **kwargs,
    }


default_cfgs = generate_default_cfgs({
    'pvt_v2_b0_grc.untrained': _cfg(),
    'pvt_v2_b1_grc.untrained': _cfg(),
    'pvt_v2_b2_grc.untrained': _cfg(),
    'pvt_v2_b3_grc.untrained': _cfg(),
    'pvt_v2_b4_grc.untrained': _cfg(),
    'pvt_v2_b5_grc.untrained': _cfg(),
    'pvt_v2_b2_li_grc.untrained': _cfg(),
})

_DIMS = (64, 128, 320, 512)
_HEADS = (1, 2, 5, 8)


@register_model
def pvt_v2_b0_grc(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformerV2Grc:
    """PVT v2-B0 with GRC-Attention (r=0.5) in every block."""
    model_args = dict(depths=(2, 2, 2, 2), embed_dims=(32, 64, 160, 256), num_heads=_HEADS)
    return _create_pvt2_grc('pvt_v2_b0_grc', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def pvt_v2_b1_grc(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformerV2Grc:
    """PVT v2-B1 with GRC-Attention (r=0.5) in every block."""
    model_args = dict(depths=(2, 2, 2, 2), embed_dims=_DIMS, num_heads=_HEADS)
    return _create_pvt2_grc('pvt_v2_b1_grc', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def pvt_v2_b2_grc(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformerV2Grc:
    """PVT v2-B2 with GRC-Attention (r=0.5) in every block (paper: 82.0 -> 82.6 top-1)."""
    model_args = dict(depths=(3, 4, 6, 3), embed_dims=_DIMS, num_heads=_HEADS)
    return _create_pvt2_grc('pvt_v2_b2_grc', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def pvt_v2_b3_grc(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformerV2Grc:
    """PVT v2-B3 with GRC-Attention (r=0.5) in every block (paper: 83.2 -> 83.7 top-1)."""
    model_args = dict(depths=(3, 4, 18, 3), embed_dims=_DIMS, num_heads=_HEADS)
    return _create_pvt2_grc('pvt_v2_b3_grc', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def pvt_v2_b4_grc(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformerV2Grc:
    """PVT v2-B4 with GRC-Attention (r=0.5) in every block (paper: 83.6 -> 84.1 top-1)."""
    model_args = dict(depths=(3, 8, 27, 3), embed_dims=_DIMS, num_heads=_HEADS)
    return _create_pvt2_grc('pvt_v2_b4_grc', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def pvt_v2_b5_grc(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformerV2Grc:
    """PVT v2-B5 with GRC-Attention (r=0.5) in every block."""
    model_args = dict(depths=(3, 6, 40, 3), embed_dims=_DIMS, num_heads=_HEADS, mlp_ratios=(4, 4, 4, 4))
    return _create_pvt2_grc('pvt_v2_b5_grc', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def pvt_v2_b2_li_grc(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformerV2Grc:
    """PVT v2-B2-Li (linear SRA) with GRC-Attention (r=0.5) in every block."""
    model_args = dict(depths=(3, 4, 6, 3), embed_dims=_DIMS, num_heads=_HEADS, linear=True)
    return _create_pvt2_grc('pvt_v2_b2_li_grc', pretrained=pretrained, **dict(model_args, **kwargs))
