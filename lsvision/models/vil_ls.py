"""ViL-LS: the multi-scale Vision Longformer (MsViT) with long-short attention.

Papers:
    * `Long-Short Transformer: Efficient Transformers for Language and Vision` - https://arxiv.org/abs/2107.02192
    * `Multi-Scale Vision Longformer: A New Vision Transformer for High-Resolution Image Encoding`
      - https://arxiv.org/abs/2103.15358

Four stages, each a non-overlapping conv patch embedding (Conv2d + LayerNorm), an optional cls token of its own, and
pre-norm transformer layers (attention block + MLP block). ViL-LS uses the 2D long-short attention with a window
relative-position bias in stages 1-2 and full attention with a relative-position bias in stages 3-4, as the official
NVIDIA/transformer-ls `MsViT` does (`imagenet/models/msvit.py` at 1527c5c). The math is the official one, so its
checkpoints load through `checkpoint_filter_fn` (`tools/convert_vil_ls.py` writes them as lsvision safetensors).

Beyond the official code: any input size (non-square, not divisible by the window: the long-short attention pads and
masks; the full-attention bias tables are interpolated to the current map size at run time, and exact at the native
size), `set_input_size`, pure bf16/fp16, the timm feature / intermediates API, and `attn_types` to make any stage
full attention (`('full',) * 4` is the quadratic ViL-style counterpart used for benchmarking).

Follows the math of NVIDIA/transformer-ls (built on microsoft/vision-longformer); written for lsvision from the
paper and that code's behaviour, no upstream code copied. Apache-2.0.
"""
import re
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import (
    calculate_drop_path_rates,
    register_notrace_module,
    to_2tuple,
    trunc_normal_,
)
from timm.models import generate_default_cfgs, register_model

from lsvision.layers import (
    LongShortAttention2d,
    resize_window_rel_pos_table,
    scaled_dot_product_attention,
    window_rel_pos_table_size,
)

from ._checkpoint import check_filtered_keys
from ._hierarchical import ConvEmbed, HierarchicalTransformer, TransformerStage
from ._pretrained import build_model, load_pretrained_file

__all__ = ['VisionLongShortTransformer']

ATTN_TYPES = ('long_short', 'full')


def full_rel_pos_index(feat_size: Tuple[int, int], device: torch.device) -> torch.Tensor:
    """Relative-position index of full attention over an H x W map (row-major tokens): (H*W, H*W).

    idx = (drow + H - 1) * (2W - 1) + (dcol + W - 1), with d = query coord - key coord: the Swin / official layout
    of a ((2H - 1) * (2W - 1), heads) table. `full_rel_pos_bias` computes table[idx] without it.
    """
    H, W = feat_size
    rows = torch.arange(H, device=device)
    cols = torch.arange(W, device=device)
    drow = (rows[:, None] - rows[None, :] + H - 1)[:, None, :, None]  # (H, 1, H, 1)
    dcol = (cols[:, None] - cols[None, :] + W - 1)[None, :, None, :]  # (1, W, 1, W)
    return (drow * (2 * W - 1) + dcol).reshape(H * W, H * W)


def full_rel_pos_bias(table: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
    """table[full_rel_pos_index(feat_size)] as (h, H*W, H*W), from sliding windows of the table: no index, one copy.

    On the offset grid g[h, H - 1 + drow, W - 1 + dcol], the H x W window at (r1, c1) holds the biases of query
    (r1, c1) against the keys in reversed order; flipping the key axes puts them in order.
    """
    H, W = feat_size
    num_heads = table.shape[-1]
    grid = table.reshape(2 * H - 1, 2 * W - 1, num_heads).permute(2, 0, 1).contiguous()
    windows = grid.unfold(1, H, 1).unfold(2, W, 1)  # (h, H, W, H, W): [h, r1, c1, a, b] = grid[h, r1 + a, c1 + b]
    return windows.flip(3, 4).reshape(num_heads, H * W, H * W)


def resize_rel_pos_table(
        table: torch.Tensor,
        src_size: Tuple[int, int],
        dst_size: Tuple[int, int],
) -> torch.Tensor:
    """Resize a full-attention table ((2Hs - 1) * (2Ws - 1), h) to the map size (Hd, Wd) (bicubic on the offset grid).

    Offset 0 stays on offset 0; the table is returned as is when the sizes agree.
    """
    if src_size[0] == dst_size[0] and src_size[1] == dst_size[1]:
        return table
    num_heads = table.shape[-1]
    grid = table.reshape(2 * src_size[0] - 1, 2 * src_size[1] - 1, num_heads).permute(2, 0, 1).unsqueeze(0)
    grid = F.interpolate(
        grid.float(), size=[2 * dst_size[0] - 1, 2 * dst_size[1] - 1], mode='bicubic', align_corners=False)
    return grid[0].permute(1, 2, 0).reshape(-1, num_heads).to(table.dtype)


def _grid_of_table(num_rows: int) -> Tuple[int, int]:
    """Map size (H, H) of a square full-attention table with (2H - 1)^2 rows (the official tables are square)."""
    side = int(round(num_rows ** 0.5))
    if side * side != num_rows or side % 2 == 0:
        raise ValueError(f'a full-attention relative-position table of {num_rows} rows is not (2H - 1)^2 for any H')
    return (side + 1) // 2, (side + 1) // 2


@register_notrace_module  # shape arithmetic on the map size: keep it a leaf for torch.fx
class RelPosAttention(nn.Module):
    """Full multi-head attention with a relative-position bias over a 2D map, plus prefix (cls) token biases.

    The bias of patch queries on patch keys comes from a ((2H - 1) * (2W - 1), h) table (Swin layout) learned for the
    native map size (H, W); at another size the table is interpolated first. With g prefix tokens there are also
    `rel_pos_g2g` (h, g, g), added to prefix -> prefix scores, and `rel_pos_g2l` (2, h, g): [0] is added to every
    prefix -> patch score, [1] to every patch -> prefix score (the official `Attention` with rpe=True).
    """

    def __init__(
            self,
            dim: int,
            num_heads: int = 8,
            feat_size: Tuple[int, int] = (14, 14),
            num_prefix_tokens: int = 1,
            qkv_bias: bool = True,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
            device=None,
            dtype=None,
    ):
        """
        Args:
            dim: Channels C.
            num_heads: Attention heads h; head dim is C / h.
            feat_size: Native map size (H, W), the size the bias table is learned for.
            num_prefix_tokens: Prefix (cls) tokens g in front of the patch tokens.
            qkv_bias: Bias in the fused qkv Linear.
            attn_drop: Dropout on the attention weights.
            proj_drop: Dropout after the output projection.
        """
        dd = {'device': device, 'dtype': dtype}
        super().__init__()
        assert dim % num_heads == 0, f'dim {dim} must be divisible by num_heads {num_heads}'
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.feat_size = to_2tuple(feat_size)
        self.num_prefix_tokens = num_prefix_tokens
        self.attn_drop = attn_drop

        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias, **dd)
        num_rel = (2 * self.feat_size[0] - 1) * (2 * self.feat_size[1] - 1)
        self.rel_pos_table = nn.Parameter(torch.zeros(num_rel, num_heads, **dd))
        if num_prefix_tokens > 0:
            self.rel_pos_g2l = nn.Parameter(torch.zeros(2, num_heads, num_prefix_tokens, **dd))
            self.rel_pos_g2g = nn.Parameter(torch.zeros(num_heads, num_prefix_tokens, num_prefix_tokens, **dd))
        else:
            self.rel_pos_g2l = None
            self.rel_pos_g2g = None
        self.proj = nn.Linear(dim, dim, **dd)
        self.proj_drop = nn.Dropout(proj_drop)
        self.init_weights()

    def init_weights(self) -> None:
        trunc_normal_(self.rel_pos_table, std=.02)
        if self.rel_pos_g2l is not None:
            trunc_normal_(self.rel_pos_g2l, std=.02)
        if self.rel_pos_g2g is not None:
            trunc_normal_(self.rel_pos_g2g, std=.02)

    def set_feat_size(self, feat_size: Tuple[int, int]) -> None:
        """Make `feat_size` the native size: the table is resized (interpolated) once, forward there is exact."""
        feat_size = to_2tuple(feat_size)
        if tuple(feat_size) == tuple(self.feat_size):
            return
        with torch.no_grad():
            table = resize_rel_pos_table(self.rel_pos_table, self.feat_size, feat_size)
        requires_grad = self.rel_pos_table.requires_grad
        self.rel_pos_table = nn.Parameter(table.contiguous(), requires_grad=requires_grad)
        self.feat_size = feat_size

    def rel_pos_bias(self, feat_size: Tuple[int, int], reverse_queries: bool = False) -> torch.Tensor:
        """Additive attention bias over [prefix (g) | patches (H*W)] for an H x W map: (h, g + H*W, g + H*W).

        With `reverse_queries` the patch-query rows come in reversed order. That bias is a sliding-window view of
        the flipped offset grid and costs a single copy; forward uses it with the patch queries reversed.
        """
        H, W = feat_size
        num_patches = H * W
        g = self.num_prefix_tokens
        table = resize_rel_pos_table(self.rel_pos_table, self.feat_size, feat_size)
        grid = table.reshape(2 * H - 1, 2 * W - 1, self.num_heads).permute(2, 0, 1)  # [h, H-1 + dr, W-1 + dc]
        if reverse_queries:
            # query (H-1-i, W-1-j) vs key (r, c): offset (H-1-i-r, W-1-j-c) = flipped grid at (i + r, j + c)
            patch = grid.flip(1, 2).unfold(1, H, 1).unfold(2, W, 1)
        else:
            patch = full_rel_pos_bias(table, feat_size).reshape(self.num_heads, H, W, H, W)
        if g == 0:
            return patch.reshape(self.num_heads, num_patches, num_patches)
        bias = table.new_empty(self.num_heads, g + num_patches, g + num_patches)
        bias[:, g:, g:].view(self.num_heads, H, W, H, W).copy_(patch)
        g2l, g2g = self.rel_pos_g2l, self.rel_pos_g2g
        if g2l is not None and g2g is not None:
            bias[:, :g, :g] = g2g
            bias[:, :g, g:] = g2l[0].unsqueeze(-1).expand(-1, -1, num_patches)
            bias[:, g:, :g] = g2l[1].unsqueeze(1).expand(-1, num_patches, -1)
        return bias

    def forward(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        """
        Args:
            x: Tokens (B, g + H * W, C).
            feat_size: Map size (H, W).

        Returns:
            Tokens (B, g + H * W, C).
        """
        B, N, C = x.shape
        torch._assert(
            N == self.num_prefix_tokens + feat_size[0] * feat_size[1],
            'RelPosAttention: token count is not num_prefix_tokens + H * W')
        g = self.num_prefix_tokens
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        # patch queries in reversed order: their bias is then a window view of the table, built in one copy
        q = torch.cat([q[:, :, :g], q[:, :, g:].flip(2)], dim=2)
        bias = self.rel_pos_bias(feat_size, reverse_queries=True).to(q.dtype).unsqueeze(0)
        x = scaled_dot_product_attention(
            q, k, v, attn_mask=bias, dropout_p=self.attn_drop if self.training else 0.)
        x = torch.cat([x[:, :, :g], x[:, :, g:].flip(2)], dim=2)
        x = x.transpose(1, 2).reshape(B, N, C)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


def _attn_layer(
        attn_type: str,
        num_heads: int,
        feat_size: Tuple[int, int],
        num_prefix_tokens: int,
        window_size: int,
        dp_rank: int,
        qkv_bias: bool,
        attn_drop: float,
        proj_drop: float,
        dual_ln_eps: float,
        span_kernel: str = 'auto',
) -> Callable[..., nn.Module]:
    """The attention of a ViL-LS stage as a `PreNormBlock` `attn_layer`: long-short with the window
    relative-position bias, or full attention with the relative-position bias of the native map size `feat_size`."""
    if attn_type == 'long_short':
        return partial(
            LongShortAttention2d,
            num_heads=num_heads,
            window_size=window_size,
            dp_rank=dp_rank,
            qkv_bias=qkv_bias,
            rel_pos_bias=True,
            attn_drop=attn_drop,
            proj_drop=proj_drop,
            dual_ln_eps=dual_ln_eps,
            span_kernel=span_kernel,
        )
    return partial(
        RelPosAttention,
        num_heads=num_heads,
        feat_size=feat_size,
        num_prefix_tokens=num_prefix_tokens,
        qkv_bias=qkv_bias,
        attn_drop=attn_drop,
        proj_drop=proj_drop,
    )


class VisionLongShortTransformer(HierarchicalTransformer):
    """ViL-LS: multi-scale Vision Longformer with long-short attention (https://arxiv.org/abs/2107.02192)."""

    global_pools = ('avg', '')  # the last stage has no cls token: the official head averages its map

    def __init__(
            self,
            img_size: Union[int, Tuple[int, int]] = 224,
            in_chans: int = 3,
            num_classes: int = 1000,
            global_pool: str = 'avg',
            embed_dims: Tuple[int, ...] = (96, 192, 384, 768),
            depths: Tuple[int, ...] = (1, 4, 16, 1),
            num_heads: Tuple[int, ...] = (3, 3, 6, 12),
            patch_sizes: Tuple[int, ...] = (4, 2, 2, 2),
            attn_types: Tuple[str, ...] = ('long_short', 'long_short', 'full', 'full'),
            num_cls_tokens: Tuple[int, ...] = (1, 1, 1, 0),
            window_sizes: Tuple[int, ...] = (7, 7, 7, 7),
            dp_ranks: Tuple[int, ...] = (8, 8, 8, 8),
            mlp_ratio: float = 4.,
            qkv_bias: bool = True,
            norm_eps: float = 1e-6,
            dual_ln_eps: float = 1e-5,
            drop_rate: float = 0.,
            proj_drop_rate: float = 0.,
            attn_drop_rate: float = 0.,
            drop_path_rate: float = 0.,
            span_kernel: str = 'auto',
            device=None,
            dtype=None,
    ):
        """
        Args:
            img_size: Native input size; it sets the size the full-attention bias tables are learned for (any other
                size also runs, with the tables interpolated).
            in_chans: Input image channels.
            num_classes: Classifier outputs (0 for no classifier).
            global_pool: 'avg' (mean of the normed last map, the official head: the last stage has no cls token) or
                '' (no pooling).
            embed_dims: Channels per stage.
            depths: Transformer layers per stage.
            num_heads: Attention heads per stage.
            patch_sizes: Patch embedding kernel = stride per stage.
            attn_types: 'long_short' or 'full' (full attention with relative-position bias) per stage.
            num_cls_tokens: cls tokens per stage (each stage has its own; dropped between stages).
            window_sizes: Long-short segment size w per stage (ignored by full-attention stages).
            dp_ranks: Long-short dynamic projections r per head, per stage (ignored by full-attention stages).
            mlp_ratio: MLP hidden width over block width.
            qkv_bias: Bias in the qkv Linear layers.
            norm_eps: Epsilon of the block, embedding and final LayerNorms.
            dual_ln_eps: Epsilon of the long-short DualLN pair.
            drop_rate: Dropout before the classifier.
            proj_drop_rate: Dropout after the attention projection and in the MLP.
            attn_drop_rate: Dropout on the attention weights.
            drop_path_rate: Stochastic depth, rising linearly from 0 over all layers; the attention and MLP blocks
                of one layer share a rate.
            span_kernel: The long-short window attention's kernel: 'auto' (the flex path on CUDA where it runs, the
                span path elsewhere), 'span' or 'flex' (`LongShortAttention2d`).
        """
        dd = {'device': device, 'dtype': dtype}
        num_stages = len(depths)
        settings = (embed_dims, num_heads, patch_sizes, attn_types, num_cls_tokens, window_sizes, dp_ranks)
        assert all(len(s) == num_stages for s in settings), 'every per-stage setting needs one entry per stage'
        assert all(t in ATTN_TYPES for t in attn_types), f'attn_types must be from {ATTN_TYPES}, got {attn_types}'
        img_size = to_2tuple(img_size)

        dpr = calculate_drop_path_rates(drop_path_rate, list(depths), stagewise=True)
        stages = []
        feature_info = []
        in_chs = in_chans
        reduction = 1
        for i in range(num_stages):
            reduction *= patch_sizes[i]
            patch_embed = ConvEmbed(in_chs, embed_dims[i], patch_sizes[i], norm_eps=norm_eps, **dd)
            feat_size = (max(img_size[0] // reduction, 1), max(img_size[1] // reduction, 1))
            stages.append(TransformerStage(
                patch_embed,
                embed_dims[i],
                depth=depths[i],
                attn_layer=_attn_layer(
                    attn_types[i],
                    num_heads[i],
                    feat_size,
                    num_cls_tokens[i],
                    window_sizes[i],
                    dp_ranks[i],
                    qkv_bias,
                    attn_drop_rate,
                    proj_drop_rate,
                    dual_ln_eps,
                    span_kernel,
                ),
                num_prefix_tokens=num_cls_tokens[i],
                drop_path=dpr[i],
                mlp_ratio=mlp_ratio,
                proj_drop=proj_drop_rate,
                norm_eps=norm_eps,
                **dd,
            ))
            in_chs = embed_dims[i]
            feature_info.append(dict(num_chs=embed_dims[i], reduction=reduction, module=f'stages.{i}'))

        super().__init__(
            stages,
            feature_info,
            in_chans=in_chans,
            num_classes=num_classes,
            global_pool=global_pool,
            img_size=img_size,
            min_input_size=reduction,  # one token in the last stage
            drop_rate=drop_rate,
            norm_eps=norm_eps,
            **dd,
        )
        self.patch_sizes = tuple(patch_sizes)

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        return {
            n for n, _ in self.named_parameters()
            if n.endswith('cls_token') or n.endswith('rel_pos_table') or '.rel_pos_g2' in n
        }

    @torch.jit.ignore
    def load_pretrained(self, checkpoint_path: str) -> None:
        """timm's `custom_load` hook, for the official files and any other: read `checkpoint_path` (weights_only;
        numpy scalars allowed), convert it (`checkpoint_filter_fn`) and load it; a head of another class count is
        dropped with a warning, as timm does."""
        load_pretrained_file(self, checkpoint_path, checkpoint_filter_fn)

    @torch.jit.ignore
    def set_input_size(self, img_size: Optional[Union[int, Tuple[int, int]]] = None) -> None:
        """Make `img_size` the native input size: the full-attention bias tables are interpolated to its maps once
        (trainable flags kept), so that forward there uses them as they are."""
        if img_size is None:
            return
        self.img_size = to_2tuple(img_size)
        reduction = 1
        for p, stage in zip(self.patch_sizes, self.stages):
            reduction *= p
            feat_size = (max(self.img_size[0] // reduction, 1), max(self.img_size[1] // reduction, 1))
            for blk in stage.blocks:
                if isinstance(blk.attn, RelPosAttention):
                    blk.attn.set_feat_size(feat_size)


def parse_official_arch(arch: str) -> Dict[str, Any]:
    """Constructor kwargs of an official MsViT arch string ('l1,h3,d96,n1,s1,g1,p4,f7,a0,r8_l2,...').

    Fields per stage: h heads, d dim, n layers, s 1 = long-short / 0 = full (sticky: once 0, later stages are full
    too, as in the official `_make_layer`), g cls tokens, p patch size, f window, r dp rank; a must be 0 (relative
    position bias; absolute position embeddings are not supported).
    """
    stages = []
    for part in arch.split('_'):
        fields = {m.group(1): int(m.group(2)) for m in re.finditer(r'([a-z])(\d+)', part)}
        missing = [k for k in 'hdnspgfr' if k not in fields]
        if missing:
            raise ValueError(f'arch stage {part!r} lacks the fields {missing}')
        if fields.get('a', 0) != 0:
            raise ValueError(f'arch stage {part!r} uses an absolute position embedding (a1); only a0 is supported')
        stages.append(fields)
    full = False
    attn_types = []
    for s in stages:
        full = full or s['s'] == 0
        attn_types.append('full' if full else 'long_short')
    return dict(
        embed_dims=tuple(s['d'] for s in stages),
        depths=tuple(s['n'] for s in stages),
        num_heads=tuple(s['h'] for s in stages),
        patch_sizes=tuple(s['p'] for s in stages),
        attn_types=tuple(attn_types),
        num_cls_tokens=tuple(s['g'] for s in stages),
        window_sizes=tuple(s['f'] for s in stages),
        dp_ranks=tuple(s['r'] for s in stages),
    )


# official attention names -> lsvision names (LS layer and full attention)
_ATTN_NAMES = {
    'qkv': 'qkv',
    'proj': 'proj',
    'to_dynamic_projection': 'dynamic_proj',
    'dual_ln_full': 'norm_local',
    'dual_ln_dp': 'norm_global',
    'local_relative_position_bias_table': 'rel_pos_table',
    'g2l_relative_position_bias': 'rel_pos_g2l',
    'g2g_relative_position_bias': 'rel_pos_g2g',
}
_OFFICIAL_KEY = re.compile(r'^layer(\d+)\.(\d+)\.(.+)$')
DROPPED_OFFICIAL_SUFFIXES = ('attn.relative_position_index',)


def official_key_to_lsvision(key: str) -> Optional[str]:
    """lsvision name of an official MsViT state_dict key (no `module.` prefix).

    Returns None for the keys dropped on purpose (the int64 `relative_position_index` buffers, which lsvision
    computes on the fly). Raises KeyError for a key this mapping does not know.
    """
    if key in ('norm.weight', 'norm.bias', 'head.weight', 'head.bias'):
        return key
    m = _OFFICIAL_KEY.match(key)
    if m is None:
        raise KeyError(key)
    stage, idx, rest = int(m.group(1)) - 1, int(m.group(2)), m.group(3)
    prefix = f'stages.{stage}'
    if idx == 0:  # patch embedding
        embed = {'proj.weight': 'patch_embed.proj.weight', 'proj.bias': 'patch_embed.proj.bias',
                 'norm_embed.weight': 'patch_embed.norm.weight', 'norm_embed.bias': 'patch_embed.norm.bias',
                 'cls_token': 'cls_token'}
        if rest not in embed:
            raise KeyError(key)
        return f'{prefix}.{embed[rest]}'
    block = f'{prefix}.blocks.{(idx - 1) // 2}'
    if rest.endswith(DROPPED_OFFICIAL_SUFFIXES) and idx % 2 == 1:
        return None
    if idx % 2 == 1:  # attention block
        if rest in ('norm.weight', 'norm.bias'):
            return f'{block}.norm1.{rest.split(".")[1]}'
        am = re.match(r'^attn\.(\w+?)(\.weight|\.bias)?$', rest)
        if am is None or am.group(1) not in _ATTN_NAMES:
            raise KeyError(key)
        return f'{block}.attn.{_ATTN_NAMES[am.group(1)]}{am.group(2) or ""}'
    if rest in ('norm.weight', 'norm.bias'):  # MLP block
        return f'{block}.norm2.{rest.split(".")[1]}'
    if re.match(r'^mlp\.fc[12]\.(weight|bias)$', rest):
        return f'{block}.{rest}'
    raise KeyError(key)


def official_config(state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """Constructor kwargs (img_size and num_classes included) read off an official MsViT checkpoint or state_dict.

    Raises ValueError when the state_dict is not an official ViL-LS one.
    """
    sd = _unwrap_checkpoint(state_dict)
    stages = sorted({int(m.group(1)) for k in sd if (m := re.match(r'^layer(\d+)\.0\.proj\.weight$', k))})
    if not stages or stages != list(range(1, len(stages) + 1)):
        raise ValueError('not an official MsViT state_dict: no layer1.0.proj.weight (patch embedding) keys found')
    cfg: Dict[str, List[Any]] = {k: [] for k in (
        'embed_dims', 'depths', 'num_heads', 'patch_sizes', 'attn_types', 'num_cls_tokens', 'window_sizes',
        'dp_ranks')}
    img_size = None
    reduction = 1
    for s in stages:
        embed = sd[f'layer{s}.0.proj.weight']
        reduction *= embed.shape[-1]
        tables = sorted(
            (int(m.group(1)), v) for k, v in sd.items()
            if (m := re.match(rf'^layer{s}\.(\d+)\.attn\.local_relative_position_bias_table$', k)))
        if not tables:
            raise ValueError(f'stage {s} has no attention relative-position tables: not a ViL-LS (a0) checkpoint')
        table = tables[0][1]
        cls = sd.get(f'layer{s}.0.cls_token')
        cfg['embed_dims'].append(embed.shape[0])
        cfg['patch_sizes'].append(embed.shape[-1])
        cfg['depths'].append(len(tables))
        cfg['num_heads'].append(table.shape[1])
        cfg['num_cls_tokens'].append(0 if cls is None else cls.shape[1])
        dp = sd.get(f'layer{s}.{tables[0][0]}.attn.to_dynamic_projection.weight')
        if dp is not None:
            window = [w for w in range(1, 65) if window_rel_pos_table_size(w) == table.shape[0]]
            if not window:
                raise ValueError(f'stage {s}: a window table of {table.shape[0]} rows fits no window size')
            cfg['attn_types'].append('long_short')
            cfg['window_sizes'].append(window[0])
            cfg['dp_ranks'].append(dp.shape[0] // table.shape[1])
        else:
            cfg['attn_types'].append('full')
            cfg['window_sizes'].append(None)
            cfg['dp_ranks'].append(None)
            if img_size is None:
                img_size = _grid_of_table(table.shape[0])[0] * reduction
    # full-attention stages ignore w and r: give them the long-short stages' values, as the arch strings do
    ls_window = next((w for w in cfg['window_sizes'] if w is not None), 7)
    ls_rank = next((r for r in cfg['dp_ranks'] if r is not None), 8)
    cfg['window_sizes'] = [ls_window if w is None else w for w in cfg['window_sizes']]
    cfg['dp_ranks'] = [ls_rank if r is None else r for r in cfg['dp_ranks']]
    out: Dict[str, Any] = {k: tuple(v) for k, v in cfg.items()}
    out['img_size'] = img_size or 224
    out['num_classes'] = sd['head.weight'].shape[0] if 'head.weight' in sd else 0
    return out


def _unwrap_checkpoint(state_dict: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """The state_dict inside an official (`net`) or common (`state_dict` / `model`) checkpoint, `module.` stripped."""
    for wrapper in ('net', 'state_dict', 'model'):
        if wrapper in state_dict and isinstance(state_dict[wrapper], dict):
            state_dict = state_dict[wrapper]
            break
    return {k[7:] if k.startswith('module.') else k: v for k, v in state_dict.items()}


def check_official_head(state_dict: Dict[str, Any]) -> None:
    """Refuse an official MsViT checkpoint whose last stage has cls tokens.

    The official head then classifies the normed cls token, while lsvision's ViL-LS always averages the last map
    (`global_pool='avg'`): loaded, such weights would give other logits than the official model.

    Raises:
        ValueError: Naming the last stage's `layer{N}.0.cls_token` key.
    """
    sd = _unwrap_checkpoint(state_dict)
    stages = [int(m.group(1)) for k in sd if (m := re.match(r'^layer(\d+)\.0\.proj\.weight$', k))]
    key = f'layer{max(stages)}.0.cls_token' if stages else None
    if key in sd:
        raise ValueError(
            f"official key '{key}': the last stage has {sd[key].shape[1]} cls token(s), and the official head "
            'classifies the normed cls token. lsvision ViL-LS averages the last map instead (its last stage has no '
            'cls token, as in every released ViL-LS), so these weights cannot give the official outputs and are not '
            'loaded.')


def convert_official_state_dict(
        state_dict: Dict[str, Any],
) -> Tuple[Dict[str, torch.Tensor], List[str], List[str]]:
    """Rename an official MsViT checkpoint / state_dict to lsvision names (no shape changes).

    Returns:
        (converted state_dict, official keys dropped on purpose, official keys this mapping does not know).

    Raises:
        ValueError: The last stage has a cls token (`check_official_head`).
    """
    check_official_head(state_dict)
    out, dropped, unknown = {}, [], []
    for k, v in _unwrap_checkpoint(state_dict).items():
        try:
            new_k = official_key_to_lsvision(k)
        except KeyError:
            unknown.append(k)
            continue
        if new_k is None:
            dropped.append(k)
        else:
            out[new_k] = v
    return out, dropped, unknown


def resize_rel_pos_tables(state_dict: Dict[str, torch.Tensor], model: nn.Module) -> Dict[str, torch.Tensor]:
    """Fit the relative-position tables of an lsvision-layout state_dict to the model.

    Full-attention tables are interpolated to the model's native map sizes; long-short window tables of another
    window size (224 weights, w = 7, in the 384 model, w = 8) are carried over offset by offset
    (`resize_window_rel_pos_table`): exact for every offset with a row of its own, clamped beyond the old span.
    """
    modules = dict(model.named_modules())
    out = dict(state_dict)
    for k, v in state_dict.items():
        if not k.endswith('.attn.rel_pos_table'):
            continue
        attn = modules.get(k[:-len('.rel_pos_table')])
        if attn is None or attn.rel_pos_table.shape == v.shape or v.ndim != 2:
            continue
        if isinstance(attn, RelPosAttention) and v.shape[1] == attn.rel_pos_table.shape[1]:
            out[k] = resize_rel_pos_table(v, _grid_of_table(v.shape[0]), attn.feat_size)
        elif isinstance(attn, LongShortAttention2d):
            out[k] = resize_window_rel_pos_table(v, attn.window_size)
    return out


def checkpoint_filter_fn(state_dict: Dict[str, Any], model: nn.Module) -> Dict[str, torch.Tensor]:
    """Official ViL-LS checkpoint (`model_best.pth`: `net` holds a DDP state_dict) -> lsvision names.

    `optimizer`, `scheduler`, `epoch` and `best_acc` are ignored, the `relative_position_index` buffers dropped.
    lsvision-layout state dicts pass through. In both cases the full-attention bias tables are interpolated when
    their size differs from the model's (e.g. 224 weights in a 384 model), and then every key must fit the model
    (the classifier aside, which timm drops when the class count differs): a KeyError names the ones that do not.
    An official checkpoint whose last stage has a cls token is refused (`check_official_head`).
    """
    state_dict = _unwrap_checkpoint(state_dict)
    source = 'the lsvision ViL-LS checkpoint'
    if not any(k.startswith('stages.') for k in state_dict):
        source = 'the official ViL-LS checkpoint'
        state_dict, _, unknown = convert_official_state_dict(state_dict)
        if unknown:
            raise ValueError(
                f'{len(unknown)} keys of the checkpoint are not ViL-LS (MsViT with relative position bias) keys, '
                f'e.g. {unknown[:5]}; is it a ViL-LS checkpoint of NVIDIA/transformer-ls? '
                'tools/convert_vil_ls.py lists every mismatch.')
    return check_filtered_keys(resize_rel_pos_tables(state_dict, model), model, source)


def _create_vil_ls(variant: str, pretrained: bool = False, **kwargs: Any) -> VisionLongShortTransformer:
    out_indices = kwargs.pop('out_indices', (0, 1, 2, 3))
    if pretrained and kwargs.get('pretrained_cfg_overlay'):
        # a file of one's own goes through load_pretrained too (official .pth files may pickle numpy scalars)
        kwargs['pretrained_cfg_overlay'] = {'custom_load': True, **kwargs['pretrained_cfg_overlay']}
    return build_model(
        VisionLongShortTransformer,
        variant,
        pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(feature_cls='getter', out_indices=out_indices),
        **kwargs,
    )


# the official ImageNet-1k checkpoints linked from the NVIDIA/transformer-ls README, all named model_best.pth: each is
# cached under a name of its own (timm's (url, file name) form); ?dl=1 makes Dropbox serve the file, not a page
OFFICIAL_CHECKPOINTS = {
    'vil_ls_medium': ('https://www.dropbox.com/s/ng14pebstaaydug/model_best.pth?dl=1', 83.8),
    'vil_ls_base': ('https://www.dropbox.com/s/80u5p5eh4txad10/model_best.pth?dl=1', 84.1),
    'vil_ls_medium_384': ('https://www.dropbox.com/s/390tzi2ll3sfibl/model_best.pth?dl=1', 84.4),
}


def _cfg(url: str = '', **kwargs: Any) -> Dict[str, Any]:
    return {
        'url': url, 'num_classes': 1000, 'input_size': (3, 224, 224), 'pool_size': (7, 7),
        'crop_pct': 0.875, 'interpolation': 'bicubic', 'fixed_input_size': False,
        'mean': IMAGENET_DEFAULT_MEAN, 'std': IMAGENET_DEFAULT_STD,
        'first_conv': 'stages.0.patch_embed.proj', 'classifier': 'head',
        'paper_ids': 'arXiv:2107.02192',
        'paper_name': 'Long-Short Transformer: Efficient Transformers for Language and Vision',
        'origin_url': 'https://github.com/NVIDIA/transformer-ls',
        **kwargs,
    }


def _cfg_official(variant: str, **kwargs: Any) -> Dict[str, Any]:
    """The official weights of `variant`: downloaded once to timm's cache as `<variant>.nv_in1k.pth`, read by
    `load_pretrained` (timm's custom_load)."""
    url, top1 = OFFICIAL_CHECKPOINTS[variant]
    return _cfg(
        url=(url, f'{variant}.nv_in1k.pth'),
        custom_load=True,
        description='The official ViL-LS weights of NVIDIA/transformer-ls (ImageNet-1k)',
        notes=(f'Weights: {url.split("?")[0]} (linked from the NVIDIA/transformer-ls README); ImageNet-1k top-1 '
               f'reported by the authors: {top1} %.',),
        **kwargs,
    )


default_cfgs = generate_default_cfgs({
    'vil_ls_medium.nv_in1k': _cfg_official('vil_ls_medium'),
    'vil_ls_base.nv_in1k': _cfg_official('vil_ls_base'),
    'vil_ls_medium_384.nv_in1k': _cfg_official('vil_ls_medium_384', input_size=(3, 384, 384), pool_size=(12, 12)),
})


@register_model
def vil_ls_medium(pretrained: bool = False, **kwargs: Any) -> VisionLongShortTransformer:
    """ViL-LS-Medium at 224, w = 7 (39,799,423 params, 8.72 GFLOPs)."""
    model_args = dict(depths=(1, 4, 16, 1), window_sizes=(7, 7, 7, 7))
    return _create_vil_ls('vil_ls_medium', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vil_ls_base(pretrained: bool = False, **kwargs: Any) -> VisionLongShortTransformer:
    """ViL-LS-Base at 224, w = 7 (55,834,363 params, 13.40 GFLOPs)."""
    model_args = dict(depths=(1, 8, 24, 1), window_sizes=(7, 7, 7, 7))
    return _create_vil_ls('vil_ls_base', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vil_ls_medium_384(pretrained: bool = False, **kwargs: Any) -> VisionLongShortTransformer:
    """ViL-LS-Medium at 384, w = 8 (39,947,653 params, 28.74 GFLOPs)."""
    model_args = dict(img_size=384, depths=(1, 4, 16, 1), window_sizes=(8, 8, 8, 8))
    return _create_vil_ls('vil_ls_medium_384', pretrained=pretrained, **dict(model_args, **kwargs))
