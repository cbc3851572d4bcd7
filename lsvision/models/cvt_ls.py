"""CvT-LS: CvT with 2D long-short attention (Transformer-LS).

Paper: `Long-Short Transformer: Efficient Transformers for Language and Vision` - https://arxiv.org/abs/2107.02192

No official code exists. The design follows the paper (Table 12, App. E) on the CvT re-implementation it names as
its base: each of q, k, v comes from a depthwise-separable conv (dw 3x3 + BN + pw 1x1), the dynamic projection
logits from a weight-standardized depthwise 3x3 conv and a pointwise conv (h * r outputs, r per head), DualLN,
segment-wise windows, a post-cls update for the stage-3 cls token, no position embedding, GELU MLPs.
Windows and ranks per stage: 224 and 384 use r = (64, 16, 4) with w = (8, 4, 2) and (12, 6, 3); 448 uses
r = (128, 32, 8), w = (16, 8, 4), so every stage has 7 or 8 segments per side at its native size. Any input size
works (maps are padded to whole segments and masked).

Written for lsvision, Apache-2.0.
"""
from typing import Any, Dict

from timm.models import generate_default_cfgs, register_model

from .cvt import ConvVisionTransformer, _cfg, _create_cvt

__all__ = []


def _cfg_ls(**kwargs: Any) -> Dict[str, Any]:
    return _cfg(
        license='apache-2.0',
        paper_ids='arXiv:2107.02192',
        paper_name='Long-Short Transformer: Efficient Transformers for Language and Vision',
        origin_url='https://github.com/NVIDIA/transformer-ls',
        **kwargs,
    )


default_cfgs = generate_default_cfgs({
    'cvt_ls_13.untrained': _cfg_ls(),
    'cvt_ls_17.untrained': _cfg_ls(),
    'cvt_ls_21.untrained': _cfg_ls(),
    'cvt_ls_21s.untrained': _cfg_ls(),
    'cvt_ls_13_384.untrained': _cfg_ls(input_size=(3, 384, 384), pool_size=(24, 24), crop_pct=1.0),
    'cvt_ls_17_384.untrained': _cfg_ls(input_size=(3, 384, 384), pool_size=(24, 24), crop_pct=1.0),
    'cvt_ls_21_384.untrained': _cfg_ls(input_size=(3, 384, 384), pool_size=(24, 24), crop_pct=1.0),
    'cvt_ls_21s_384.untrained': _cfg_ls(input_size=(3, 384, 384), pool_size=(24, 24), crop_pct=1.0),
    'cvt_ls_13_448.untrained': _cfg_ls(input_size=(3, 448, 448), pool_size=(28, 28), crop_pct=1.0),
    'cvt_ls_17_448.untrained': _cfg_ls(input_size=(3, 448, 448), pool_size=(28, 28), crop_pct=1.0),
    'cvt_ls_21_448.untrained': _cfg_ls(input_size=(3, 448, 448), pool_size=(28, 28), crop_pct=1.0),
    'cvt_ls_21s_448.untrained': _cfg_ls(input_size=(3, 448, 448), pool_size=(28, 28), crop_pct=1.0),
})

# (embed_dims, num_heads, depths) of each size; head dim is 64 everywhere
_SIZES = {
    '13': ((64, 192, 384), (1, 3, 6), (1, 2, 10)),
    '17': ((128, 256, 384), (2, 4, 6), (3, 4, 10)),
    '21': ((64, 192, 384), (1, 3, 6), (1, 4, 16)),
    '21s': ((128, 256, 384), (2, 4, 6), (3, 4, 14)),
}
# (window_sizes, dp_ranks) of each native resolution
_RESOLUTIONS = {
    224: ((8, 4, 2), (64, 16, 4)),
    384: ((12, 6, 3), (64, 16, 4)),
    448: ((16, 8, 4), (128, 32, 8)),
}


def _cvt_ls(size: str, resolution: int, pretrained: bool, **kwargs: Any) -> ConvVisionTransformer:
    """A CvT-LS model of `size` with the window sizes and ranks of its `resolution` variant; `img_size` in kwargs
    only sets the native input size, as for any CvT."""
    embed_dims, num_heads, depths = _SIZES[size]
    window_sizes, dp_ranks = _RESOLUTIONS[resolution]
    model_args = dict(
        img_size=resolution,
        embed_dims=embed_dims,
        num_heads=num_heads,
        depths=depths,
        attn_type='long_short',
        window_sizes=window_sizes,
        dp_ranks=dp_ranks,
        act_layer='gelu',
    )
    variant = f'cvt_ls_{size}' + ('' if resolution == 224 else f'_{resolution}')
    return _create_cvt(variant, pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def cvt_ls_13(pretrained: bool = False, **kwargs: Any) -> ConvVisionTransformer:
    return _cvt_ls('13', 224, pretrained, **kwargs)


@register_model
def cvt_ls_17(pretrained: bool = False, **kwargs: Any) -> ConvVisionTransformer:
    return _cvt_ls('17', 224, pretrained, **kwargs)


@register_model
def cvt_ls_21(pretrained: bool = False, **kwargs: Any) -> ConvVisionTransformer:
    return _cvt_ls('21', 224, pretrained, **kwargs)


@register_model
def cvt_ls_21s(pretrained: bool = False, **kwargs: Any) -> ConvVisionTransformer:
    return _cvt_ls('21s', 224, pretrained, **kwargs)


@register_model
def cvt_ls_13_384(pretrained: bool = False, **kwargs: Any) -> ConvVisionTransformer:
    return _cvt_ls('13', 384, pretrained, **kwargs)


@register_model
def cvt_ls_17_384(pretrained: bool = False, **kwargs: Any) -> ConvVisionTransformer:
    return _cvt_ls('17', 384, pretrained, **kwargs)


@register_model
def cvt_ls_21_384(pretrained: bool = False, **kwargs: Any) -> ConvVisionTransformer:
    return _cvt_ls('21', 384, pretrained, **kwargs)


@register_model
def cvt_ls_21s_384(pretrained: bool = False, **kwargs: Any) -> ConvVisionTransformer:
    return _cvt_ls('21s', 384, pretrained, **kwargs)


@register_model
def cvt_ls_13_448(pretrained: bool = False, **kwargs: Any) -> ConvVisionTransformer:
    return _cvt_ls('13', 448, pretrained, **kwargs)


@register_model
def cvt_ls_17_448(pretrained: bool = False, **kwargs: Any) -> ConvVisionTransformer:
    return _cvt_ls('17', 448, pretrained, **kwargs)


@register_model
def cvt_ls_21_448(pretrained: bool = False, **kwargs: Any) -> ConvVisionTransformer:
    return _cvt_ls('21', 448, pretrained, **kwargs)


@register_model
def cvt_ls_21s_448(pretrained: bool = False, **kwargs: Any) -> ConvVisionTransformer:
    return _cvt_ls('21s', 448, pretrained, **kwargs)
