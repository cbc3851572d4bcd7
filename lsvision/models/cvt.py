"""CvT: Convolutional vision Transformer, and the model class CvT-LS builds on.

Papers:
    * `CvT: Introducing Convolutions to Vision Transformers` - https://arxiv.org/abs/2103.15808
    * `Long-Short Transformer: Efficient Transformers for Language and Vision` - https://arxiv.org/abs/2107.02192

Three stages, each a convolutional token embedding (Conv2d + LayerNorm) followed by pre-norm transformer blocks;
a cls token joins the last stage only; no position embedding. The attention is pluggable:
    * 'conv': Microsoft's official CvT attention (`cvt_13`, `cvt_21`): q, k, v from depthwise 3x3 conv + BN
      (keys/values at stride 2) and a Linear each, scale C^-0.5 over the full stage width, QuickGELU MLPs.
    * 'long_short': the 2D long-short attention of Transformer-LS (`cvt_ls_*`, registered in cvt_ls.py).

Microsoft's CvT and the CvT-LS paper classify the normed stage-3 cls token: that is the default head
(`global_pool='token'`). As in timm's ViT, `forward_features` returns the normed stage-3 tokens (B, 1 + H*W, C), cls
token first, so `forward == forward_head(forward_features)` for every head; `global_pool='avg'` averages the patch
tokens instead. `forward_intermediates` and `features_only` give the NCHW stage maps.

Adapted from microsoft/CvT (MIT). Written for lsvision, Apache-2.0.
"""
import re
from functools import partial
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import (
    DropPath,
    Mlp,
    QuickGELU,
    register_notrace_module,
    to_2tuple,
)
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model

from lsvision.layers import LongShortAttention2d

from ._checkpoint import check_filtered_keys
from ._hierarchical import HierarchicalStage, HierarchicalTransformer

__all__ = ['ConvVisionTransformer']


class ConvEmbed(nn.Module):
    """Overlapping conv token embedding: Conv2d (bias) then LayerNorm over channels. NCHW in and out."""

    def __init__(
            self,
            in_chs: int,
            dim: int,
            patch_size: int,
            stride: int,
            padding: int,
            norm_eps: float = 1e-5,
            device=None,
            dtype=None,
    ):
        dd = {'device': device, 'dtype': dtype}
        super().__init__()
        self.proj = nn.Conv2d(in_chs, dim, patch_size, stride=stride, padding=padding, **dd)
        self.norm = nn.LayerNorm(dim, eps=norm_eps, **dd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvProjection(nn.Sequential):
    """Depthwise 3x3 conv (no bias) then BatchNorm: Microsoft CvT's `conv_proj_{q,k,v}`."""

    def __init__(self, dim: int, stride: int = 1, device=None, dtype=None):
        dd = {'device': device, 'dtype': dtype}
        super().__init__()
        self.conv = nn.Conv2d(dim, dim, 3, stride=stride, padding=1, groups=dim, bias=False, **dd)
        self.bn = nn.BatchNorm2d(dim, **dd)


@register_notrace_module  # shape arithmetic on the map size: keep it a leaf for torch.fx
class ConvAttention(nn.Module):
    """Microsoft CvT attention: conv projections (keys/values strided), Linear q/k/v, full softmax attention.

    Prefix (cls) tokens skip the conv projection and join q, k and v before the Linear layers. The scale is
    C^-0.5 with C the full stage width, a quirk of the official code that its trained weights depend on.
    """

    def __init__(
            self,
            dim: int,
            num_heads: int,
            qkv_bias: bool = True,
            kv_stride: int = 2,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
            device=None,
            dtype=None,
    ):
        dd = {'device': device, 'dtype': dtype}
        super().__init__()
        self.num_heads = num_heads
        self.scale = dim ** -0.5
        self.attn_drop = attn_drop
        self.conv_proj_q = ConvProjection(dim, 1, **dd)
        self.conv_proj_k = ConvProjection(dim, kv_stride, **dd)
        self.conv_proj_v = ConvProjection(dim, kv_stride, **dd)
        self.proj_q = nn.Linear(dim, dim, bias=qkv_bias, **dd)
        self.proj_k = nn.Linear(dim, dim, bias=qkv_bias, **dd)
        self.proj_v = nn.Linear(dim, dim, bias=qkv_bias, **dd)
        self.proj = nn.Linear(dim, dim, **dd)
        self.proj_drop = nn.Dropout(proj_drop)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], x.shape[1], self.num_heads, -1).transpose(1, 2)

    def forward(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        B, N, C = x.shape
        num_prefix = N - feat_size[0] * feat_size[1]
        prefix = x[:, :num_prefix]
        feat_map = x[:, num_prefix:].reshape(B, feat_size[0], feat_size[1], C).permute(0, 3, 1, 2)  # channels-last

        q = torch.cat([prefix, self.conv_proj_q(feat_map).flatten(2).transpose(1, 2)], dim=1)
        k = torch.cat([prefix, self.conv_proj_k(feat_map).flatten(2).transpose(1, 2)], dim=1)
        v = torch.cat([prefix, self.conv_proj_v(feat_map).flatten(2).transpose(1, 2)], dim=1)
        q = self._split_heads(self.proj_q(q))
        k = self._split_heads(self.proj_k(k))
        v = self._split_heads(self.proj_v(v))
        x = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.attn_drop if self.training else 0., scale=self.scale)
        x = self.proj(x.transpose(1, 2).reshape(B, N, C))
        return self.proj_drop(x)


class CvtBlock(nn.Module):
    """Pre-norm transformer block on (B, g + H*W, C) tokens: attention and MLP, each with its own residual."""

    def __init__(
            self,
            dim: int,
            num_heads: int,
            mlp_ratio: float = 4.,
            qkv_bias: bool = True,
            attn_type: str = 'conv',
            window_size: int = 8,
            dp_rank: int = 16,
            proj_drop: float = 0.,
            attn_drop: float = 0.,
            drop_path: float = 0.,
            act_layer: type = nn.GELU,
            norm_eps: float = 1e-5,
            device=None,
            dtype=None,
    ):
        dd = {'device': device, 'dtype': dtype}
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps, **dd)
        if attn_type == 'long_short':
            self.attn = LongShortAttention2d(
                dim,
                num_heads=num_heads,
                window_size=window_size,
                dp_rank=dp_rank,
                qkv_layer='conv',
                dp_layer='conv',
                attn_drop=attn_drop,
                proj_drop=proj_drop,
                **dd,
            )
        elif attn_type == 'conv':
            self.attn = ConvAttention(
                dim, num_heads=num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=proj_drop, **dd)
        else:
            raise ValueError(f"attn_type must be 'conv' or 'long_short', got {attn_type!r}")
        self.drop_path1 = DropPath(drop_path) if drop_path > 0. else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps, **dd)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=act_layer, drop=proj_drop, **dd)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0. else nn.Identity()

    def forward(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        x = x + self.drop_path1(self.attn(self.norm1(x), feat_size))
        x = x + self.drop_path2(self.mlp(self.norm2(x)))
        return x


class CvtStage(HierarchicalStage):
    """Conv token embedding, optional cls token, then transformer blocks. NCHW in, NCHW out."""

    def __init__(
            self,
            in_chs: int,
            dim: int,
            depth: int,
            num_heads: int,
            patch_size: int,
            patch_stride: int,
            patch_padding: int,
            cls_token: bool = False,
            drop_path: Sequence[float] = (),
            norm_eps: float = 1e-5,
            device=None,
            dtype=None,
            **block_kwargs: Any,
    ):
        dd = {'device': device, 'dtype': dtype}
        super().__init__()
        self.grad_checkpointing = False
        self.patch_embed = ConvEmbed(in_chs, dim, patch_size, patch_stride, patch_padding, norm_eps=norm_eps, **dd)
        self.num_prefix_tokens = 1 if cls_token else 0
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim, **dd)) if cls_token else None
        drop_path = list(drop_path) or [0.] * depth
        self.blocks = nn.ModuleList([
            CvtBlock(dim, num_heads, drop_path=drop_path[i], norm_eps=norm_eps, **block_kwargs, **dd)
            for i in range(depth)
        ])



class ConvVisionTransformer(HierarchicalTransformer):
    """CvT-style hierarchical transformer with pluggable attention (CvT, CvT-LS)."""

    token_features = True  # forward_features keeps the cls token for the papers' head

    def __init__(
            self,
            img_size: Union[int, Tuple[int, int]] = 224,
            in_chans: int = 3,
            num_classes: int = 1000,
            global_pool: str = 'token',
            embed_dims: Tuple[int, ...] = (64, 192, 384),
            depths: Tuple[int, ...] = (1, 2, 10),
            num_heads: Tuple[int, ...] = (1, 3, 6),
            patch_sizes: Tuple[int, ...] = (7, 3, 3),
            patch_strides: Tuple[int, ...] = (4, 2, 2),
            patch_paddings: Tuple[int, ...] = (2, 1, 1),
            cls_token_stages: Tuple[bool, ...] = (False, False, True),
            mlp_ratio: float = 4.,
            qkv_bias: bool = True,
            attn_type: str = 'conv',
            window_sizes: Tuple[int, ...] = (8, 4, 2),
            dp_ranks: Tuple[int, ...] = (64, 16, 4),
            act_layer: str = 'quick_gelu',
            norm_eps: float = 1e-5,
            drop_rate: float = 0.,
            proj_drop_rate: float = 0.,
            attn_drop_rate: float = 0.,
            drop_path_rate: float = 0.,
            device=None,
            dtype=None,
    ):
        """
        Args:
            img_size: Native input size (recorded as `img_size`; CvT has no position embeddings, so any size from
                `min_input_size` up runs, and `set_input_size` only records a new one).
            in_chans: Input image channels.
            num_classes: Classifier outputs (0 for no classifier).
            global_pool: 'token' (the normed cls token: Microsoft's CvT and the CvT-LS paper; needs a cls token in
                the last stage), 'avg' (mean of the normed last-stage patch tokens) or '' (the tokens, no pooling).
            embed_dims: Channels per stage.
            depths: Blocks per stage.
            num_heads: Attention heads per stage.
            patch_sizes: Conv embedding kernel per stage.
            patch_strides: Conv embedding stride per stage.
            patch_paddings: Conv embedding padding per stage.
            cls_token_stages: Which stages prepend a cls token.
            mlp_ratio: MLP hidden width over block width.
            qkv_bias: Bias in the q/k/v Linear layers (attn_type 'conv').
            attn_type: 'conv' (Microsoft CvT) or 'long_short' (Transformer-LS).
            window_sizes: Long-short segment size w per stage.
            dp_ranks: Long-short dynamic projections r per head, per stage.
            act_layer: MLP activation, 'quick_gelu' (Microsoft CvT) or 'gelu'.
            norm_eps: LayerNorm epsilon.
            drop_rate: Dropout before the classifier.
            proj_drop_rate: Dropout after the attention projection and in the MLP.
            attn_drop_rate: Dropout on the attention weights.
            drop_path_rate: Stochastic depth of the last stage, rising linearly from 0 over its blocks (the CvT
                recipe; the other stages have none).
        """
        dd = {'device': device, 'dtype': dtype}
        super().__init__()
        num_stages = len(depths)
        assert global_pool in self.global_pools, f'global_pool must be one of {self.global_pools}, got {global_pool!r}'
        assert global_pool != 'token' or cls_token_stages[-1], (
            "global_pool='token' needs a cls token in the last stage; pass global_pool='avg' to average the map")
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.global_pool = global_pool
        self.num_features = self.head_hidden_size = embed_dims[-1]
        self.drop_rate = drop_rate
        self.min_input_size = 2 ** (num_stages + 1)  # one token in the last stage
        self.img_size = to_2tuple(img_size)
        act = {'quick_gelu': QuickGELU, 'gelu': nn.GELU}[act_layer]

        last_dpr = [x.item() for x in torch.linspace(0, drop_path_rate, depths[-1], device='cpu')]
        stages = []
        in_chs = in_chans
        self.feature_info = []
        reduction = 1
        for i in range(num_stages):
            reduction *= patch_strides[i]
            stages.append(CvtStage(
                in_chs,
                embed_dims[i],
                depth=depths[i],
                num_heads=num_heads[i],
                patch_size=patch_sizes[i],
                patch_stride=patch_strides[i],
                patch_padding=patch_paddings[i],
                cls_token=cls_token_stages[i],
                drop_path=last_dpr if i == num_stages - 1 else (),
                norm_eps=norm_eps,
                mlp_ratio=mlp_ratio,
                qkv_bias=qkv_bias,
                attn_type=attn_type,
                window_size=window_sizes[i],
                dp_rank=dp_ranks[i],
                proj_drop=proj_drop_rate,
                attn_drop=attn_drop_rate,
                act_layer=act,
                **dd,
            ))
            in_chs = embed_dims[i]
            self.feature_info.append(dict(num_chs=embed_dims[i], reduction=reduction, module=f'stages.{i}'))
        self.stages = nn.Sequential(*stages)

        self._build_head_and_init(num_classes, drop_rate, norm_eps, **dd)

    @torch.jit.ignore
    def set_input_size(self, img_size: Optional[Union[int, Tuple[int, int]]] = None) -> None:
        """Make `img_size` the native input size. Nothing in CvT is sized by it (no position embeddings), so this
        only checks and records it."""
        if img_size is None:
            return
        img_size = self._checked_input_size(img_size)
        self.img_size = img_size


def checkpoint_filter_fn(state_dict: Dict[str, torch.Tensor], model: nn.Module) -> Dict[str, torch.Tensor]:
    """Map a Microsoft CvT checkpoint (`stage{i}.blocks.{j}...`, `stage2.cls_token`, `norm`, `head`) to lsvision
    names; lsvision ones pass through. Every key must then fit the model (the classifier aside, which timm drops when
    the class count differs): a KeyError names the ones that do not."""
    if 'state_dict' in state_dict and isinstance(state_dict['state_dict'], dict):
        state_dict = state_dict['state_dict']
    state_dict = {k[len('module.'):] if k.startswith('module.') else k: v for k, v in state_dict.items()}
    if not any(k.startswith('stages.') for k in state_dict):
        state_dict = {re.sub(r'^stage(\d+)\.', r'stages.\1.', k): v for k, v in state_dict.items()}
        source = 'the Microsoft CvT checkpoint'
    else:
        source = 'the lsvision CvT checkpoint'
    return check_filtered_keys(state_dict, model, source)


def _create_cvt(variant: str, pretrained: bool = False, **kwargs: Any) -> ConvVisionTransformer:
    out_indices = kwargs.pop('out_indices', (0, 1, 2))
    return build_model_with_cfg(
        ConvVisionTransformer,
        variant,
        pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(feature_cls='getter', out_indices=out_indices),
        **kwargs,
    )


def _cfg(url: str = '', **kwargs: Any) -> Dict[str, Any]:
    return {
        'url': url, 'num_classes': 1000, 'input_size': (3, 224, 224), 'pool_size': (14, 14),
        'crop_pct': 0.875, 'interpolation': 'bicubic', 'fixed_input_size': False,
        'mean': IMAGENET_DEFAULT_MEAN, 'std': IMAGENET_DEFAULT_STD,
        'first_conv': 'stages.0.patch_embed.proj', 'classifier': 'head',
        'license': 'mit', 'paper_ids': 'arXiv:2103.15808', 'paper_name': 'CvT: Introducing Convolutions to Vision '
        'Transformers', 'origin_url': 'https://github.com/microsoft/CvT',
        **kwargs,
    }


# the released ImageNet-1k checkpoints of microsoft/CvT, by the model they load into (with the documented call)
MICROSOFT_CHECKPOINTS = {
    'cvt_13': 'CvT-13-224x224-IN-1k.pth',
    'cvt_21': 'CvT-21-224x224-IN-1k.pth',
    'cvt_13_384': 'CvT-13-384x384-IN-1k.pth',
    'cvt_21_384': 'CvT-21-384x384-IN-1k.pth',
}

_cfg_384 = partial(_cfg, input_size=(3, 384, 384), pool_size=(24, 24), crop_pct=1.0)  # Microsoft's 384 evaluation

default_cfgs = generate_default_cfgs({
    'cvt_13.untrained': _cfg(),
    'cvt_21.untrained': _cfg(),
    'cvt_13_384.untrained': _cfg_384(),
    'cvt_21_384.untrained': _cfg_384(),
})

_cvt_ms = partial(dict, attn_type='conv', act_layer='quick_gelu')
_CVT_13 = _cvt_ms(embed_dims=(64, 192, 384), num_heads=(1, 3, 6), depths=(1, 2, 10))
_CVT_21 = _cvt_ms(embed_dims=(64, 192, 384), num_heads=(1, 3, 6), depths=(1, 4, 16))


@register_model
def cvt_13(pretrained: bool = False, **kwargs: Any) -> ConvVisionTransformer:
    """CvT-13, Microsoft's official design (19.997M params, 4.585 GFLOPs at 224)."""
    return _create_cvt('cvt_13', pretrained=pretrained, **dict(_CVT_13, **kwargs))


@register_model
def cvt_21(pretrained: bool = False, **kwargs: Any) -> ConvVisionTransformer:
    """CvT-21, Microsoft's official design (31.623M params, 7.206 GFLOPs at 224)."""
    return _create_cvt('cvt_21', pretrained=pretrained, **dict(_CVT_21, **kwargs))


@register_model
def cvt_13_384(pretrained: bool = False, **kwargs: Any) -> ConvVisionTransformer:
    """CvT-13 evaluated at 384 as Microsoft's CvT-13-384x384 (same weights layout as cvt_13, crop_pct 1.0)."""
    return _create_cvt('cvt_13_384', pretrained=pretrained, **{**_CVT_13, 'img_size': 384, **kwargs})


@register_model
def cvt_21_384(pretrained: bool = False, **kwargs: Any) -> ConvVisionTransformer:
    """CvT-21 evaluated at 384 as Microsoft's CvT-21-384x384 (same weights layout as cvt_21, crop_pct 1.0)."""
    return _create_cvt('cvt_21_384', pretrained=pretrained, **{**_CVT_21, 'img_size': 384, **kwargs})
