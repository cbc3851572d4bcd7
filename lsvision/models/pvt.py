"""PVT: Pyramid Vision Transformer (v1), plain and with GRC-Attention (Cached Transformers).

Papers:
    * `Pyramid Vision Transformer: A Versatile Backbone for Dense Prediction without Convolutions`
      - https://arxiv.org/abs/2102.12122
    * `Cached Transformers: Improving Transformers with Differentiable Memory Cache` - https://arxiv.org/abs/2312.12742

Four stages, each a non-overlapping conv patch embedding (patch 4, then 2) with LayerNorm, a learned position
embedding (bilinearly resized for other input sizes) and pre-norm blocks with spatial-reduction attention (SRA).
A cls token joins the last stage only. timm has no PVT v1; the configurations follow whai362/PVT
`classification/pvt.py` (Apache-2.0).

The official PVT classifies from the normed stage-4 cls token: lsvision keeps that head as `global_pool='token'`.
The default is `global_pool='avg'` (mean of the normed stage-4 map) so that `forward_features` returns the NCHW map
of timm's standard contract, with `forward == forward_head(forward_features)`.

`pvt_*_grc` add a GRC cache to every attention block (`attn.grc.*`, see `lsvision.layers.grc`). The authors'
`core/pvt_grc.py` is the reference; its defects (lazy cache buffer, cache grid inferred from the query count) are
fixed here. GRC models do not support gradient checkpointing (the recompute would update the cache twice).

Written for lsvision, Apache-2.0.
"""
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import (
    DropPath,
    Mlp,
    calculate_drop_path_rates,
    register_notrace_function,
    to_2tuple,
)
from timm.models import checkpoint, generate_default_cfgs, register_model

from lsvision.layers import GrcConfig, scaled_dot_product_attention, self_attention_of, wrap_attention_with_grc

from ._checkpoint import check_filtered_keys
from ._helpers import GRC_CHECKPOINT_ERROR, GrcModelMixin, require_non_grc_keys
from ._hierarchical import HierarchicalStage, HierarchicalTransformer
from ._pretrained import build_model

__all__ = ['PyramidVisionTransformer']


@register_notrace_function  # branches on the input size: a leaf for torch.fx
def resample_pos_embed(
        pos_embed: torch.Tensor,
        grid_size: Tuple[int, int],
        new_size: List[int],
        num_prefix_tokens: int = 0,
) -> torch.Tensor:
    """Bilinearly resize the grid part of a (1, g + h*w, C) position embedding to `new_size`; prefix slots kept."""
    if new_size[0] == grid_size[0] and new_size[1] == grid_size[1]:
        return pos_embed
    p = num_prefix_tokens
    grid = pos_embed[:, p:].reshape(1, grid_size[0], grid_size[1], -1).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=(new_size[0], new_size[1]), mode='bilinear', align_corners=False)
    return torch.cat([pos_embed[:, :p], grid.flatten(2).transpose(1, 2)], dim=1)


class PvtAttention(nn.Module):
    """PVT v1 spatial-reduction attention (SRA).

    Keys/values come from the patch grid reduced by a conv (kernel = stride = sr_ratio) and LayerNorm; prefix
    tokens skip the reduction.
    """

    def __init__(
            self,
            dim: int,
            num_heads: int,
            sr_ratio: int = 1,
            qkv_bias: bool = True,
            num_prefix_tokens: int = 0,
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
        self.num_prefix_tokens = num_prefix_tokens
        self.attn_drop = attn_drop
        self.q = nn.Linear(dim, dim, bias=qkv_bias, **dd)
        self.kv = nn.Linear(dim, dim * 2, bias=qkv_bias, **dd)
        self.proj = nn.Linear(dim, dim, **dd)
        self.proj_drop = nn.Dropout(proj_drop)
        if sr_ratio > 1:
            self.sr = nn.Conv2d(dim, dim, kernel_size=sr_ratio, stride=sr_ratio, **dd)
            self.norm = nn.LayerNorm(dim, **dd)
        else:
            self.sr = None
            self.norm = None

    def forward(self, x: torch.Tensor, feat_size: List[int]) -> torch.Tensor:
        B, N, C = x.shape
        q = self.q(x).reshape(B, N, self.num_heads, self.head_dim).transpose(1, 2)
        if self.sr is not None:
            p = self.num_prefix_tokens
            grid = x[:, p:].transpose(1, 2).reshape(B, C, feat_size[0], feat_size[1])
            grid = self.norm(self.sr(grid).flatten(2).transpose(1, 2))
            kv_in = torch.cat([x[:, :p], grid], dim=1) if p > 0 else grid
        else:
            kv_in = x
        kv = self.kv(kv_in).reshape(B, -1, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        k, v = kv.unbind(0)
        x = scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop if self.training else 0.)
        x = self.proj(x.transpose(1, 2).reshape(B, N, C))
        return self.proj_drop(x)


class PvtGrcAttention(PvtAttention):
    """PVT v1 SRA, run as is, with a GRC cache over the stage's prefix tokens and patch grid under `grc`.

    Made from a built `PvtAttention` by `wrap_attention_with_grc`.
    """

    self_attention = self_attention_of(PvtAttention)

    def forward(self, x: torch.Tensor, feat_size: List[int]) -> torch.Tensor:
        return self.grc(x, self.self_attention(x, feat_size), feat_size)


class PvtBlock(nn.Module):
    """Pre-norm block: SRA (+GRC) and MLP, each with its own residual and stochastic depth."""

    def __init__(
            self,
            dim: int,
            num_heads: int,
            mlp_ratio: float = 4.,
            sr_ratio: int = 1,
            qkv_bias: bool = True,
            num_prefix_tokens: int = 0,
            proj_drop: float = 0.,
            attn_drop: float = 0.,
            drop_path: float = 0.,
            norm_eps: float = 1e-6,
            device=None,
            dtype=None,
    ):
        dd = {'device': device, 'dtype': dtype}
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps, **dd)
        self.attn = PvtAttention(
            dim,
            num_heads,
            sr_ratio=sr_ratio,
            qkv_bias=qkv_bias,
            num_prefix_tokens=num_prefix_tokens,
            attn_drop=attn_drop,
            proj_drop=proj_drop,
            **dd,
        )
        self.drop_path1 = DropPath(drop_path) if drop_path > 0. else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps, **dd)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=proj_drop, **dd)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0. else nn.Identity()

    def forward(self, x: torch.Tensor, feat_size: List[int]) -> torch.Tensor:
        x = x + self.drop_path1(self.attn(self.norm1(x), feat_size))
        x = x + self.drop_path2(self.mlp(self.norm2(x)))
        return x


class PatchEmbed(nn.Module):
    """Non-overlapping conv patch embedding + LayerNorm (default eps). NCHW in, NHWC out."""

    def __init__(self, in_chs: int, dim: int, patch_size: int, device=None, dtype=None):
        dd = {'device': device, 'dtype': dtype}
        super().__init__()
        self.proj = nn.Conv2d(in_chs, dim, patch_size, stride=patch_size, **dd)
        self.norm = nn.LayerNorm(dim, **dd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x).permute(0, 2, 3, 1))


class PvtStage(HierarchicalStage):
    """Patch embedding, optional cls token, position embedding, then blocks. NCHW in, NCHW out."""

    def __init__(
            self,
            in_chs: int,
            dim: int,
            depth: int,
            num_heads: int,
            patch_size: int,
            grid_size: Tuple[int, int],
            cls_token: bool = False,
            sr_ratio: int = 1,
            drop_path: Sequence[float] = (),
            pos_drop: float = 0.,
            device=None,
            dtype=None,
            **block_kwargs: Any,
    ):
        dd = {'device': device, 'dtype': dtype}
        super().__init__()
        self.grad_checkpointing = False
        self.grid_size: Tuple[int, int] = (int(grid_size[0]), int(grid_size[1]))
        self.patch_embed = PatchEmbed(in_chs, dim, patch_size, **dd)
        self.num_prefix_tokens = 1 if cls_token else 0
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim, **dd)) if cls_token else None
        num_patches = grid_size[0] * grid_size[1]
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_prefix_tokens + num_patches, dim, **dd))
        self.pos_drop = nn.Dropout(pos_drop)
        drop_path = list(drop_path) or [0.] * depth
        self.blocks = nn.ModuleList([
            PvtBlock(
                dim,
                num_heads,
                sr_ratio=sr_ratio,
                num_prefix_tokens=self.num_prefix_tokens,
                drop_path=drop_path[i],
                **block_kwargs,
                **dd,
            )
            for i in range(depth)
        ])

    def forward_with_prefix(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Returns the output map (B, C, H, W) and the prefix tokens (B, g, C), g = 0 without a cls token."""
        x = self.patch_embed(x)
        B, H, W, C = x.shape
        feat_size = [H, W]
        x = x.reshape(B, H * W, C)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(B, -1, -1), x], dim=1)
        x = self.pos_drop(x + resample_pos_embed(self.pos_embed, self.grid_size, [H, W], self.num_prefix_tokens))
        for blk in self.blocks:
            if self.grad_checkpointing and not torch.jit.is_scripting():
                x = checkpoint(blk, x, feat_size)
            else:
                x = blk(x, feat_size)
        prefix = x[:, :self.num_prefix_tokens]
        x = x[:, self.num_prefix_tokens:].reshape(B, H, W, C).permute(0, 3, 1, 2)
        return x, prefix


class PyramidVisionTransformer(GrcModelMixin, HierarchicalTransformer):
    """PVT v1 (https://arxiv.org/abs/2102.12122), optionally with GRC-Attention in every block."""

    def __init__(
            self,
            img_size: Union[int, Tuple[int, int]] = 224,
            in_chans: int = 3,
            num_classes: int = 1000,
            global_pool: str = 'avg',
            embed_dims: Tuple[int, ...] = (64, 128, 320, 512),
            depths: Tuple[int, ...] = (2, 2, 2, 2),
            num_heads: Tuple[int, ...] = (1, 2, 5, 8),
            mlp_ratios: Tuple[float, ...] = (8., 8., 4., 4.),
            sr_ratios: Tuple[int, ...] = (8, 4, 2, 1),
            patch_size: int = 4,
            qkv_bias: bool = True,
            norm_eps: float = 1e-6,
            drop_rate: float = 0.,
            pos_drop_rate: float = 0.,
            proj_drop_rate: float = 0.,
            attn_drop_rate: float = 0.,
            drop_path_rate: float = 0.,
            grc: bool = False,
            grc_config: Optional[GrcConfig] = None,
            device=None,
            dtype=None,
            **grc_kwargs: Any,
    ):
        """
        Args:
            img_size: Training resolution: sizes the position embeddings and the GRC caches.
            in_chans: Input image channels.
            num_classes: Classifier outputs (0 for no classifier).
            global_pool: 'avg' (mean of the normed stage-4 map), 'token' (normed cls token, the official head) or ''.
            embed_dims: Channels per stage.
            depths: Blocks per stage.
            num_heads: Attention heads per stage.
            mlp_ratios: MLP hidden width over block width, per stage.
            sr_ratios: Spatial reduction of keys/values per stage.
            patch_size: Stage-1 patch size (later stages use 2).
            qkv_bias: Bias in q and kv.
            norm_eps: Block and final LayerNorm epsilon (patch embeddings use 1e-5).
            drop_rate: Dropout before the classifier.
            pos_drop_rate: Dropout after adding the position embedding.
            proj_drop_rate: Dropout after the attention projection and in the MLP.
            attn_drop_rate: Dropout on the attention weights.
            drop_path_rate: Stochastic depth, rising linearly over all blocks.
            grc: Add a GRC cache to every attention block.
            grc_config: The GRC options (`lsvision.layers.GrcConfig`), or the same as `grc_*` keyword arguments
                (`grc_ratio=0.25`, ...).
        """
        dd = {'device': device, 'dtype': dtype}
        num_stages = len(depths)
        img_size = to_2tuple(img_size)
        grc_config = GrcConfig.from_kwargs(grc_config, grc_kwargs)
        if grc_kwargs:
            raise TypeError(f'unexpected keyword argument(s) {", ".join(grc_kwargs)}')

        dpr = calculate_drop_path_rates(drop_path_rate, depths, stagewise=True)
        stages = []
        in_chs = in_chans
        feature_info = []
        reduction = patch_size
        grid = (img_size[0] // patch_size, img_size[1] // patch_size)
        for i in range(num_stages):
            if i > 0:
                reduction *= 2
                grid = (grid[0] // 2, grid[1] // 2)
            stages.append(PvtStage(
                in_chs,
                embed_dims[i],
                depth=depths[i],
                num_heads=num_heads[i],
                patch_size=patch_size if i == 0 else 2,
                grid_size=grid,
                cls_token=i == num_stages - 1,
                sr_ratio=sr_ratios[i],
                drop_path=dpr[i],
                pos_drop=pos_drop_rate,
                mlp_ratio=mlp_ratios[i],
                qkv_bias=qkv_bias,
                norm_eps=norm_eps,
                proj_drop=proj_drop_rate,
                attn_drop=attn_drop_rate,
                **dd,
            ))
            in_chs = embed_dims[i]
            feature_info.append(dict(num_chs=embed_dims[i], reduction=reduction, module=f'stages.{i}'))
        if grc:
            for stage in stages:
                for blk in stage.blocks:
                    attn = blk.attn
                    sr_ratio = 1 if attn.sr is None else attn.sr.stride[0]
                    wrap_attention_with_grc(  # initialized with the rest of the model below
                        attn, PvtGrcAttention, attn.q.in_features, attn.num_heads, cache_hw=stage.grid_size,
                        config=grc_config, num_prefix_tokens=stage.num_prefix_tokens,
                        mem_attn_kwargs=dict(qkv_bias=attn.q.bias is not None, sr_ratio=sr_ratio))

        super().__init__(
            stages,
            feature_info,
            in_chans=in_chans,
            num_classes=num_classes,
            global_pool=global_pool,
            img_size=img_size,
            min_input_size=patch_size * 2 ** (num_stages - 1) * max(1, max(
                sr // 2 ** (num_stages - 1 - i) for i, sr in enumerate(sr_ratios))),
            drop_rate=drop_rate,
            norm_eps=norm_eps,
            **dd,
        )
        self.grc = grc

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        return {n for n, _ in self.named_parameters() if n.endswith(('cls_token', 'pos_embed'))}

    @torch.jit.ignore
    def set_input_size(self, img_size: Optional[Union[int, Tuple[int, int]]] = None) -> None:
        """Make `img_size` the native input size: each stage's position embedding is resampled to its new grid
        (as forward does for other sizes) and the GRC caches are resized to it (bilinear over the grid)."""
        if img_size is None:
            return
        img_size = self._checked_input_size(img_size)
        patch = self.stages[0].patch_embed.proj.stride[0]
        grid = (img_size[0] // patch, img_size[1] // patch)
        for i, stage in enumerate(self.stages):
            if i > 0:
                grid = (grid[0] // 2, grid[1] // 2)
            with torch.no_grad():
                pos_embed = resample_pos_embed(stage.pos_embed, stage.grid_size, list(grid), stage.num_prefix_tokens)
            stage.pos_embed = nn.Parameter(pos_embed, requires_grad=stage.pos_embed.requires_grad)
            stage.grid_size = grid
            for blk in stage.blocks:
                if isinstance(blk.attn, PvtGrcAttention):
                    blk.attn.grc.resize_cache(grid)
        self.img_size = img_size

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        if enable and self.grc:
            raise RuntimeError(GRC_CHECKPOINT_ERROR)
        HierarchicalTransformer.set_grad_checkpointing(self, enable)  # plain PVT checkpoints (the mixin refuses)


def checkpoint_filter_fn(state_dict: Dict[str, torch.Tensor], model: nn.Module) -> Dict[str, torch.Tensor]:
    """Map an official PVT checkpoint (`patch_embed1`, `pos_embed1`, `block1.0`, `cls_token`) to lsvision names.

    Checkpoints already in lsvision layout pass through; a plain PVT checkpoint loaded into a GRC model leaves only
    the `attn.grc.*` keys missing (zero caches). Every other key must fit the model (the classifier aside, which timm
    drops when the class count differs): a KeyError names the ones that do not, so the GRC models' non-strict load
    never leaves a layer silently fresh.
    """
    for key in ('model', 'state_dict'):
        if key in state_dict and isinstance(state_dict[key], dict):
            state_dict = state_dict[key]
    source = 'the lsvision PVT checkpoint'
    if not any(k.startswith('stages.') for k in state_dict):
        source = 'the official PVT checkpoint'
        last = len(model.stages) - 1
        out = {}
        for k, v in state_dict.items():
            k = re.sub(r'^module\.', '', k)
            k = re.sub(r'^(patch_embed|pos_embed|block)(\d+)',
                       lambda m: f'stages.{int(m.group(2)) - 1}.' + ('blocks' if m.group(1) == 'block' else m.group(1)),
                       k)
            k = re.sub(r'^cls_token$', f'stages.{last}.cls_token', k)
            out[k] = v
        state_dict = out
    if model.grc:  # the check of the other GRC models first: a base checkpoint may lack only `.grc.` keys
        require_non_grc_keys(state_dict, model)
    return check_filtered_keys(state_dict, model, source, optional=('.grc.',))


def _create_pvt(variant: str, pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    out_indices = kwargs.pop('out_indices', (0, 1, 2, 3))
    return build_model(
        PyramidVisionTransformer,
        variant,
        pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        pretrained_strict=False if variant.endswith('_grc') else True,
        feature_cfg=dict(feature_cls='getter', out_indices=out_indices),
        **kwargs,
    )


def _cfg(url: str = '', **kwargs: Any) -> Dict[str, Any]:
    return {
        'url': url, 'num_classes': 1000, 'input_size': (3, 224, 224), 'pool_size': (7, 7),
        'crop_pct': 0.9, 'interpolation': 'bicubic', 'fixed_input_size': False,
        'mean': IMAGENET_DEFAULT_MEAN, 'std': IMAGENET_DEFAULT_STD,
        'first_conv': 'stages.0.patch_embed.proj', 'classifier': 'head',
        'license': 'apache-2.0', 'paper_ids': 'arXiv:2102.12122',
        'paper_name': 'Pyramid Vision Transformer: A Versatile Backbone for Dense Prediction without Convolutions',
        'origin_url': 'https://github.com/whai362/PVT',
        **kwargs,
    }


def _grc_cfg(**kwargs: Any) -> Dict[str, Any]:
    return _cfg(
        paper_ids='arXiv:2312.12742',
        paper_name='Cached Transformers: Improving Transformers with Differentiable Memory Cache',
        origin_url='https://github.com/annosubmission/GRC-Cache',
        **kwargs,
    )


default_cfgs = generate_default_cfgs({
    'pvt_tiny.untrained': _cfg(),
    'pvt_small.untrained': _cfg(),
    'pvt_medium.untrained': _cfg(),
    'pvt_large.untrained': _cfg(),
    'pvt_tiny_grc.untrained': _grc_cfg(),
    'pvt_small_grc.untrained': _grc_cfg(),
    'pvt_medium_grc.untrained': _grc_cfg(),
    'pvt_large_grc.untrained': _grc_cfg(),
})

_PVT_DEPTHS = {'tiny': (2, 2, 2, 2), 'small': (3, 4, 6, 3), 'medium': (3, 4, 18, 3), 'large': (3, 8, 27, 3)}


def _pvt(size: str, grc: bool, pretrained: bool, kwargs: Dict[str, Any]) -> PyramidVisionTransformer:
    model_args = dict(depths=_PVT_DEPTHS[size], grc=grc)
    name = f'pvt_{size}' + ('_grc' if grc else '')
    return _create_pvt(name, pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def pvt_tiny(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """PVT-Tiny (13.23M params, 1.94 GFLOPs at 224)."""
    return _pvt('tiny', False, pretrained, kwargs)


@register_model
def pvt_small(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """PVT-Small (24.49M params, 3.83 GFLOPs at 224)."""
    return _pvt('small', False, pretrained, kwargs)


@register_model
def pvt_medium(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """PVT-Medium (44.21M params, 6.68 GFLOPs at 224)."""
    return _pvt('medium', False, pretrained, kwargs)


@register_model
def pvt_large(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """PVT-Large (61.37M params, 9.85 GFLOPs at 224)."""
    return _pvt('large', False, pretrained, kwargs)


@register_model
def pvt_tiny_grc(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """PVT-Tiny with GRC-Attention (r=0.5) in every block."""
    return _pvt('tiny', True, pretrained, kwargs)


@register_model
def pvt_small_grc(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """PVT-Small with GRC-Attention (r=0.5) in every block."""
    return _pvt('small', True, pretrained, kwargs)


@register_model
def pvt_medium_grc(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """PVT-Medium with GRC-Attention (r=0.5) in every block."""
    return _pvt('medium', True, pretrained, kwargs)


@register_model
def pvt_large_grc(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """PVT-Large with GRC-Attention (r=0.5) in every block."""
    return _pvt('large', True, pretrained, kwargs)
