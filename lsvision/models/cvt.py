"""CvT and CvT-LS: the Convolutional vision Transformer, with Microsoft's conv attention or 2D long-short attention.

Papers:
    * `CvT: Introducing Convolutions to Vision Transformers` - https://arxiv.org/abs/2103.15808
    * `Long-Short Transformer: Efficient Transformers for Language and Vision` - https://arxiv.org/abs/2107.02192

Three stages, each a convolutional token embedding (Conv2d + LayerNorm) followed by pre-norm transformer blocks;
a cls token joins the last stage only; no position embedding. The attention is pluggable:
    * 'conv': Microsoft's official CvT attention (`cvt_13`, `cvt_21`): q, k, v from depthwise 3x3 conv + BN
      (keys/values at stride 2) and a Linear each, scale C^-0.5 over the full stage width, QuickGELU MLPs.
    * 'long_short': the 2D long-short attention of Transformer-LS (`cvt_ls_*`) with CvT-LS's conv projections.

CvT-LS has no official code. The design follows the paper (Table 12, App. E) on the CvT re-implementation it names as
its base: each of q, k, v comes from a depthwise-separable conv (dw 3x3 + BN + pw 1x1, `SepConvQkv`), the dynamic
projection logits from a weight-standardized depthwise 3x3 conv and a pointwise conv (h * r outputs, r per head,
`ConvDynamicProjection`), DualLN, segment-wise windows, a post-cls update for the stage-3 cls token, no position
embedding, GELU MLPs. Windows and ranks per stage: 224 and 384 use r = (64, 16, 4) with w = (8, 4, 2) and
(12, 6, 3); 448 uses r = (128, 32, 8), w = (16, 8, 4), so every stage has 7 or 8 segments per side at its native
size. Any input size works (maps are padded to whole segments and masked).

Microsoft's CvT and the CvT-LS paper classify the normed stage-3 cls token: that is the default head
(`global_pool='token'`). As in timm's ViT, `forward_features` returns the normed stage-3 tokens (B, 1 + H*W, C), cls
token first, so `forward == forward_head(forward_features)` for every head; `global_pool='avg'` averages the patch
tokens instead. `forward_intermediates` and `features_only` give the NCHW stage maps.

Adapted from microsoft/CvT (MIT). Written for lsvision, Apache-2.0.
"""
import re
from functools import partial
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import QuickGELU, StdConv2d, register_notrace_module
from timm.models import generate_default_cfgs, register_model

from lsvision.layers import LongShortAttention2d, scaled_dot_product_attention
from lsvision.layers.autocast import autocast_dtype, autocast_off, cast_stacked
from lsvision.layers.export import training_paths_enabled
from lsvision.layers.reparam import FoldableModule
from lsvision.layers.tuning import FUSE_CONVS_MAX_POSITIONS

from ._checkpoint import check_filtered_keys
from ._hierarchical import ConvEmbed, HierarchicalTransformer, TransformerStage
from ._pretrained import build_model

__all__ = ['ConvVisionTransformer', 'SepConvQkv', 'ConvDynamicProjection', 'FusedConvProjections']

ATTN_TYPES = ('conv', 'long_short')


def _map_view(x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
    """(B, H*W, C) tokens, any batch stride (e.g. the patch tokens sliced after prefix tokens) -> (B, C, H, W), a
    channels-last view of them (no copy)."""
    return x.reshape(x.shape[0], feat_size[0], feat_size[1], x.shape[2]).permute(0, 3, 1, 2)


def _dense_map(x: torch.Tensor) -> torch.Tensor:
    """A (B, C, H, W) map as a dense channels-last tensor, the layout oneDNN convs prefer (a copy where it is not
    one already, e.g. a `_map_view` of sliced patch tokens: oneDNN would otherwise copy the non-dense map inside every
    conv and conv backward that reads it)."""
    return x.contiguous(memory_format=torch.channels_last)


def _tokens_to_map(x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
    """(B, H*W, C) -> (B, C, H, W) as a dense channels-last tensor (patch tokens sliced after prefix tokens are
    copied once here)."""
    return _map_view(x.contiguous(), feat_size)


class SepConv2d(FoldableModule):
    """Depthwise 3x3 conv (bias) -> BatchNorm -> pointwise 1x1 conv (bias), as in the CvT-LS base.

    `reparameterize()` folds the BatchNorm (running statistics) into the depthwise conv, for inference.
    """

    def __init__(self, dim: int, device=None, dtype=None):
        dd = {'device': device, 'dtype': dtype}
        super().__init__()
        self.dw = nn.Conv2d(dim, dim, 3, padding=1, groups=dim, **dd)
        self.bn = nn.BatchNorm2d(dim, **dd)
        self.pw = nn.Conv2d(dim, dim, 1, **dd)

    def foldable(self) -> bool:
        """Whether the BatchNorm is (or can be) folded: it has running statistics."""
        return self.reparameterized or (isinstance(self.bn, nn.BatchNorm2d) and self.bn.running_var is not None)

    @torch.no_grad()
    def reparameterize(self) -> None:
        """Fold the BatchNorm into the depthwise conv (`bn` becomes Identity); afterwards the layer is inference-only.

        Called by `timm.models.reparameterize_model`. A BatchNorm without running statistics is kept (nothing folds).
        """
        if self.reparameterized or not self.foldable():
            return
        bn, dw = self.bn, self.dw
        scale = bn.weight.float() * torch.rsqrt(bn.running_var.float() + bn.eps)  # fp32 fold, stored in dw's dtype
        folded = nn.Conv2d(dw.in_channels, dw.out_channels, dw.kernel_size, padding=dw.padding, groups=dw.groups,
                           device=dw.weight.device, dtype=dw.weight.dtype)
        folded.weight.copy_(dw.weight.float() * scale[:, None, None, None])
        dw_bias = dw.bias.float() if dw.bias is not None else torch.zeros_like(scale)
        folded.bias.copy_((dw_bias - bn.running_mean.float()) * scale + bn.bias.float())
        self.dw = folded.requires_grad_(False)
        self.bn = nn.Identity()
        self._set_reparameterized()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) map, channels-last memory (dense, or a `_map_view` of tokens), in; (B, H*W, C) tokens out."""
        if not torch.jit.is_scripting():
            bn = self.bn
            if (training_paths_enabled() and isinstance(bn, nn.BatchNorm2d) and bn.training
                    and bn.track_running_stats and bn.momentum is not None):
                # training: keep only the input map for backward (conv and BatchNorm outputs are recomputed there)
                bn.num_batches_tracked.add_(1)
                # one compute dtype (under autocast, its dtype; BatchNorm's affine and statistics stay as they are)
                dtype = autocast_dtype(x)
                with autocast_off(x.device.type):
                    return _SepConvRecompute.apply(
                        x.to(dtype), self.dw.weight.to(dtype), self.dw.bias.to(dtype), bn.weight, bn.bias,
                        bn.running_mean, bn.running_var, self.pw.weight.flatten(1).to(dtype), self.pw.bias.to(dtype),
                        bn.momentum, bn.eps)
        x = self.bn(self.dw(_dense_map(x))).flatten(2).transpose(1, 2)
        # the 1x1 conv as a Linear on tokens: same math, a plain GEMM on CPU
        return F.linear(x, self.pw.weight.flatten(1), self.pw.bias)


class _SepConvRecompute(torch.autograd.Function):
    """Depthwise 3x3 conv -> BatchNorm (batch statistics; or none) -> pointwise Linear, keeping only the input map for
    backward, as given: a `_map_view` of sliced patch tokens stays a view of the layer's input tokens (which the
    prefix tokens' own path keeps anyway), and the dense copy the convs read is made again in backward (about 0.03 ms
    for a stage-3 map of cvt_ls_13 at 384 px, batch 2, against 1.7 MiB kept per conv input).

    Autograd would keep the conv output (for BatchNorm) and the BatchNorm output (for the pointwise weight): two maps
    per projection, six per CvT-LS layer, where CvT's own strided k and v convs keep a quarter of that; the projection
    logits' conv (no BatchNorm) would keep one more. The backward recomputes them (one depthwise conv and the
    normalization) and runs ATen's own BatchNorm and convolution backward kernels. The running statistics are
    updated once, in forward. With `bn_weight` None there is no BatchNorm (the projection logits' conv).
    """

    @staticmethod
    def forward(ctx, x, dw_weight, dw_bias, bn_weight, bn_bias, running_mean, running_var, pw_weight, pw_bias,
                momentum: float, eps: float):
        z = F.conv2d(_dense_map(x), dw_weight, dw_bias, padding=1, groups=x.shape[1])
        y = z if bn_weight is None else F.batch_norm(
            z, running_mean, running_var, bn_weight, bn_bias, True, momentum, eps)
        ctx.save_for_backward(x, dw_weight, dw_bias, bn_weight, bn_bias, pw_weight)
        ctx.eps = eps
        # the recomputed z has this layout too (same conv, same input); asked here, since torch.compile (dynamo)
        # breaks the graph on a memory-format query in backward and then leaves autocast's state changed
        ctx.z_channels_last = z.is_contiguous(memory_format=torch.channels_last)
        return F.linear(y.flatten(2).transpose(1, 2), pw_weight, pw_bias)

    @staticmethod
    def backward(ctx, grad_out):
        with autocast_off(grad_out.device.type):
            return _SepConvRecompute._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        x, dw_weight, dw_bias, bn_weight, bn_bias, pw_weight = ctx.saved_tensors
        grad_out = grad_out.to(x.dtype)
        B, C, H, W = x.shape
        x = _dense_map(x)
        z = F.conv2d(x, dw_weight, dw_bias, padding=1, groups=C)
        y = z
        if bn_weight is not None:
            y, mean, invstd = torch.ops.aten.native_batch_norm(z, bn_weight, bn_bias, None, None, True, 0., ctx.eps)
        tokens = y.flatten(2).transpose(1, 2)  # (B, H * W, C)
        grad_pw_weight = grad_out.flatten(0, 1).t() @ tokens.flatten(0, 1)
        grad_pw_bias = grad_out.sum((0, 1))
        grad_y = grad_out @ pw_weight  # (B, H * W, C) tokens
        grad_bn_weight = grad_bn_bias = None
        if bn_weight is None:
            grad_z = grad_y.transpose(1, 2).reshape(B, C, H, W)  # channels-last view of the token gradient
            if not ctx.z_channels_last:
                grad_z = grad_z.contiguous()
        elif ctx.z_channels_last:
            # BatchNorm backward on (B, C, H * W, 1) views of the channels-last maps: the same reduction, and ATen's
            # channels-last kernel is 10-20x slower on (1, C, H, W) (41 ms against 2.6 ms for C = 64, 192 x 192)
            grad_z, grad_bn_weight, grad_bn_bias = torch.ops.aten.native_batch_norm_backward(
                grad_y.reshape(B, H * W, 1, C).permute(0, 3, 1, 2),
                z.permute(0, 2, 3, 1).reshape(B, H * W, 1, C).permute(0, 3, 1, 2),
                bn_weight, None, None, mean, invstd, True, ctx.eps, [True, True, True])
            grad_z = grad_z.permute(0, 2, 3, 1).reshape(B, H, W, C).permute(0, 3, 1, 2)
        else:
            # an NCHW z (the conv's choice for some layouts at batch 1): the gradient in the same layout, since ATen's
            # BatchNorm backward gave wrong gradients for an NCHW input with a channels-last gradient at batch 1
            grad_z, grad_bn_weight, grad_bn_bias = torch.ops.aten.native_batch_norm_backward(
                grad_y.transpose(1, 2).reshape(B, C, H, W).contiguous(), z, bn_weight, None, None, mean, invstd,
                True, ctx.eps, [True, True, True])
        grad_x, grad_dw_weight, grad_dw_bias = torch.ops.aten.convolution_backward(
            grad_z, x, dw_weight, [C], [1, 1], [1, 1], [1, 1], False, [0, 0], C,
            [ctx.needs_input_grad[0], True, True])
        return (grad_x, grad_dw_weight, grad_dw_bias, grad_bn_weight, grad_bn_bias, None, None, grad_pw_weight,
                grad_pw_bias, None, None)


def _patch_map_and_prefix_qkv(x: torch.Tensor, feat_size: Tuple[int, int], num_prefix_tokens: int
                              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(B, g + H*W, C) tokens -> the patch tokens as a (B, C, H, W) map view, and the prefix tokens as their own q,
    k and v, (3, B, g, C) (an expanded view: prefix tokens have no conv projection)."""
    # split, not two slices: its backward is one cat (each slice's would write a zero-filled full gradient)
    prefix, patches = x.split([num_prefix_tokens, x.shape[1] - num_prefix_tokens], dim=1)
    return _map_view(patches, feat_size), prefix.expand((3,) + prefix.shape)


def _standardized_weight(conv: StdConv2d, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A StdConv2d's weight as it standardizes it (batch_norm over each filter, biased variance), in `dtype`."""
    w = conv.weight if dtype is None else conv.weight.to(dtype)
    return F.batch_norm(w.reshape(1, conv.out_channels, -1), None, None, training=True, momentum=0.,
                        eps=conv.eps).reshape_as(w)


class SepConvQkv(nn.Module):
    """q, k, v from three depthwise-separable convs over the patch map (CvT-LS).

    Prefix tokens have no conv projection: their q, k and v are the input tokens themselves.
    """

    def __init__(self, dim: int, device=None, dtype=None):
        dd = {'device': device, 'dtype': dtype}
        super().__init__()
        self.q = SepConv2d(dim, **dd)
        self.k = SepConv2d(dim, **dd)
        self.v = SepConv2d(dim, **dd)

    def forward(
            self,
            x: torch.Tensor,
            feat_size: Tuple[int, int],
            num_prefix_tokens: int,
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns q, k, v of the patch tokens, (B, H * W, C) each (separate tensors: nothing is stacked, nor sliced
        in the layer), and the prefix tokens' q, k, v, (3, B, g, C): the prefix tokens themselves (a view)."""
        feat_map, prefix = _patch_map_and_prefix_qkv(x, feat_size, num_prefix_tokens)
        if x.device.type == 'cuda' and self.stacks() and not torch.jit.is_scripting():
            q, k, v = self.forward_stacked(feat_map)
            return q, k, v, prefix
        return self.q(feat_map), self.k(feat_map), self.v(feat_map), prefix

    def stacks(self) -> bool:
        """Whether `forward_stacked` applies: three unfolded convs whose BatchNorms are plain modules."""
        return all(not c.reparameterized and isinstance(c.bn, nn.BatchNorm2d) for c in (self.q, self.k, self.v))

    @torch.jit.unused
    def forward_stacked(self, feat_map: torch.Tensor, dynamic_proj: Optional['ConvDynamicProjection'] = None
                        ) -> Tuple[torch.Tensor, ...]:
        """q, k, v (and the projection logits) for few kernels (the CUDA path): the map cast once for all the
        depthwise convs, every parameter cast in two kernels (`cast_stacked`), BatchNorm in the compute dtype (fp32
        statistics and affine, as autocast runs BatchNorm), and the three pointwise convs as one batched GEMM.
        Autograd keeps each conv's output for its BatchNorm and the stacked normalized maps, where `SepConv2d`'s CPU
        path keeps the input map only and recomputes (a kernel per recomputed op). The same math as the modules' own
        calls (tested).

        Args:
            feat_map: (B, C, H, W) map (any strides, e.g. a `_map_view` of tokens).
            dynamic_proj: The layer's projection-logit conv, run on the same cast map; None: q, k, v only.

        Returns:
            q, k, v as (B, H * W, C) tokens each; with `dynamic_proj`, q, then k and v stacked (2, B, H * W, C) (views
            of one buffer: no copy), then the logits (B, H * W, h * r).
        """
        convs = (self.q, self.k, self.v)
        dtype = autocast_dtype(feat_map)
        B, C, H, W = feat_map.shape
        dw_weights, dw_biases = [c.dw.weight for c in convs], [c.dw.bias for c in convs]
        proj_groups = []
        if dynamic_proj is not None:
            dw_weights.append(_standardized_weight(dynamic_proj.dw))
            dw_biases.append(dynamic_proj.dw.bias)
            proj_groups = [[dynamic_proj.pw.weight.flatten(1)], [dynamic_proj.pw.bias]]
        groups = [dw_weights, dw_biases, [c.pw.weight.flatten(1) for c in convs], [c.pw.bias for c in convs]]
        with autocast_off(feat_map.device.type):
            x = feat_map.to(dtype, memory_format=torch.channels_last)
            # every parameter cast in two kernels, each group a stacked view (unbind: a backward of one stack, not
            # of three slices' zeros)
            dw_weight, dw_bias, weight, bias, *proj = cast_stacked(groups + proj_groups, dtype)
            maps = [F.conv2d(x, w, b, padding=1, groups=C) for w, b in zip(dw_weight.unbind(0), dw_bias.unbind(0))]
            tokens = torch.stack([c.bn(m).flatten(2).transpose(1, 2).reshape(B * H * W, C)
                                  for c, m in zip(convs, maps)])  # (3, BN, C)
            # the three pointwise convs as one batched GEMM: weight (3, C_out, C), bias (3, C_out)
            out = torch.baddbmm(bias[:, None], tokens, weight.transpose(1, 2)).reshape(3, B, H * W, -1)
            if dynamic_proj is None:
                return out.unbind(0)
            logits = F.linear(maps[3].flatten(2).transpose(1, 2), proj[0][0], proj[1][0])
            q, kv = out.split([1, 2])  # split: its backward is one cat (a select's or a slice's would fill zeros)
        return q.squeeze(0), kv, logits

    @torch.jit.unused
    def project_with(self, dynamic_proj: nn.Module, x: torch.Tensor, feat_size: Tuple[int, int],
                     num_prefix_tokens: int) -> Optional[Tuple[torch.Tensor, ...]]:
        """q, k and v stacked (2, B, H * W, C), the prefix tokens' q, k, v and the projection logits in one pass
        (`forward_stacked` with the projection-logit conv), as `LongShortAttention2d`'s CUDA path asks; None where
        that does not apply (not on CUDA, folded convs, another projection module): the layer then calls the two
        modules."""
        if not (x.device.type == 'cuda' and self.stacks() and isinstance(dynamic_proj, ConvDynamicProjection)
                and isinstance(dynamic_proj.dw, StdConv2d)):
            return None
        feat_map, prefix = _patch_map_and_prefix_qkv(x, feat_size, num_prefix_tokens)
        q, kv, logits = self.forward_stacked(feat_map, dynamic_proj)
        return q, kv, prefix, logits

    def fuse_projections(self, dynamic_proj: nn.Module) -> Optional['FusedConvProjections']:
        """These q, k, v convs and the projection conv as one `FusedConvProjections`, for inference.

        The fusion hook `LongShortAttention2d.reparameterize` calls. None (nothing fuses: the children fold what they
        can) when `dynamic_proj` is not a `ConvDynamicProjection` or a BatchNorm has no running statistics.
        """
        if not isinstance(dynamic_proj, ConvDynamicProjection):
            return None
        if not all(c.foldable() for c in (self.q, self.k, self.v)):
            return None
        return FusedConvProjections(self, dynamic_proj)


class ConvDynamicProjection(FoldableModule):
    """Dynamic-projection logits from a weight-standardized depthwise 3x3 conv and a pointwise conv (CvT-LS).

    `reparameterize()` standardizes the depthwise weight once (`dw` becomes a plain conv), for inference.
    """

    def __init__(self, dim: int, num_proj: int, device=None, dtype=None):
        dd = {'device': device, 'dtype': dtype}
        super().__init__()
        self.dw = StdConv2d(dim, dim, 3, padding=1, groups=dim, bias=True, eps=1e-5, **dd)
        self.pw = nn.Conv2d(dim, num_proj, 1, **dd)

    @torch.no_grad()
    def reparameterize(self) -> None:
        """Replace the weight-standardized conv by a plain conv holding the standardized weight (inference-only).

        Called by `timm.models.reparameterize_model`.
        """
        dw = self.dw
        if self.reparameterized or not isinstance(dw, StdConv2d):
            return
        std = _standardized_weight(dw, torch.float32)
        plain = nn.Conv2d(dw.in_channels, dw.out_channels, dw.kernel_size, stride=dw.stride, padding=dw.padding,
                          dilation=dw.dilation, groups=dw.groups, bias=dw.bias is not None,
                          device=dw.weight.device, dtype=dw.weight.dtype)
        plain.weight.copy_(std)
        if dw.bias is not None:
            plain.bias.copy_(dw.bias)
        self.dw = plain.requires_grad_(False)
        self._set_reparameterized()

    def forward(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        """(B, H*W, C) patch tokens (any batch stride) in, (B, H*W, h * r) logits out."""
        feat_map = _map_view(x, feat_size)  # kept as a view in training (see `_SepConvRecompute`)
        if not torch.jit.is_scripting():
            dw = self.dw
            if training_paths_enabled() and isinstance(dw, StdConv2d):
                # training: keep only the input map for backward (the conv output is recomputed there); the
                # standardized weight as StdConv2d computes it
                weight = _standardized_weight(dw)
                dtype = autocast_dtype(feat_map)
                with autocast_off(feat_map.device.type):
                    return _SepConvRecompute.apply(
                        feat_map.to(dtype), weight.to(dtype), dw.bias.to(dtype), None, None, None, None,
                        self.pw.weight.flatten(1).to(dtype), self.pw.bias.to(dtype), 0., 0.)
        x = self.dw(_dense_map(feat_map)).flatten(2).transpose(1, 2)
        return F.linear(x, self.pw.weight.flatten(1), self.pw.bias)  # the 1x1 conv as a GEMM on tokens


class FusedConvProjections(FoldableModule):
    """The CvT-LS q, k, v convs and projection-logit conv of a reparameterized `LongShortAttention2d`, for inference.

    The four depthwise convs (q, k, v with BatchNorm folded in, the projection's standardized conv) read the same
    patch map; their filters are stored concatenated, so on small maps one depthwise conv over four copies of the map
    gives all four outputs (oneDNN spends a fixed ~50-100 us per depthwise conv call on CPU, which dominates on small
    maps); on larger maps (more than `FUSE_CONVS_MAX_POSITIONS` positions, batch included) each filter set runs as
    its own conv, which was faster there. The same math either way (tested). The pointwise convs read their channel
    slice. Built by `SepConvQkv.fuse_projections` (when `LongShortAttention2d.reparameterize`
    calls it); inference-only.
    """

    def __init__(self, qkv: SepConvQkv, dynamic_proj: ConvDynamicProjection):
        super().__init__()
        convs = (qkv.q, qkv.k, qkv.v)
        for c in convs:
            c.reparameterize()
        dynamic_proj.reparameterize()
        if not all(c.reparameterized for c in convs):
            raise ValueError('FusedConvProjections needs q, k, v convs whose BatchNorms have running statistics')
        dws = [c.dw for c in convs] + [dynamic_proj.dw]
        with torch.no_grad():
            self.register_buffer('dw_weight', torch.cat([dw.weight for dw in dws]))  # (4C, 1, 3, 3)
            self.register_buffer('dw_bias', torch.cat([dw.bias for dw in dws]))  # (4C,)
            self.register_buffer('qkv_weight', torch.stack([c.pw.weight.flatten(1) for c in convs]))  # (3, C, C)
            self.register_buffer('qkv_bias', torch.stack([c.pw.bias for c in convs]))  # (3, C)
            self.register_buffer('proj_weight', dynamic_proj.pw.weight.flatten(1).clone())  # (h * r, C)
            self.register_buffer('proj_bias', dynamic_proj.pw.bias.clone())
        self.max_fused_positions = FUSE_CONVS_MAX_POSITIONS
        self._set_reparameterized()

    def forward(
            self,
            x: torch.Tensor,
            feat_size: Tuple[int, int],
            num_prefix_tokens: int,
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns q, k, v of the patch tokens (B, H * W, C) each, the prefix tokens' q, k, v (3, B, g, C; the prefix
        tokens themselves) and the projection logits (B, H * W, h * r)."""
        C = x.shape[2]
        patches = x[:, num_prefix_tokens:]
        prefix = x[:, :num_prefix_tokens]
        prefix_qkv = prefix.expand((3,) + prefix.shape)
        if x.shape[0] * feat_size[0] * feat_size[1] <= self.max_fused_positions:
            maps = F.conv2d(_tokens_to_map(torch.cat([patches, patches, patches, patches], dim=2), feat_size),
                            self.dw_weight, self.dw_bias, padding=1, groups=4 * C)
            maps = maps.flatten(2).transpose(1, 2)  # (B, H * W, 4C) tokens: [q | k | v | projection] channels
            q, k, v = [F.linear(maps[..., i * C:(i + 1) * C], self.qkv_weight[i], self.qkv_bias[i]) for i in range(3)]
            return q, k, v, prefix_qkv, F.linear(maps[..., 3 * C:], self.proj_weight, self.proj_bias)
        feat_map = _tokens_to_map(patches, feat_size)
        q, k, v = [F.linear(self._depthwise(feat_map, i, C), self.qkv_weight[i], self.qkv_bias[i]) for i in range(3)]
        return q, k, v, prefix_qkv, F.linear(self._depthwise(feat_map, 3, C), self.proj_weight, self.proj_bias)

    def _depthwise(self, feat_map: torch.Tensor, i: int, C: int) -> torch.Tensor:
        """The i-th depthwise conv (q, k, v, projection) alone, as tokens (B, H * W, C)."""
        out = F.conv2d(feat_map, self.dw_weight[i * C:(i + 1) * C], self.dw_bias[i * C:(i + 1) * C], padding=1,
                       groups=C)
        return out.flatten(2).transpose(1, 2)


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

    def projections(self, x: torch.Tensor, feat_size: Tuple[int, int]
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v before the attention: (B, N, C) queries and (B, N', C) keys and values (the map strided, N' < N)."""
        num_prefix = x.shape[1] - feat_size[0] * feat_size[1]
        prefix = x[:, :num_prefix]
        feat_map = _tokens_to_map(x[:, num_prefix:], feat_size)
        q = torch.cat([prefix, self.conv_proj_q(feat_map).flatten(2).transpose(1, 2)], dim=1)
        k = torch.cat([prefix, self.conv_proj_k(feat_map).flatten(2).transpose(1, 2)], dim=1)
        v = torch.cat([prefix, self.conv_proj_v(feat_map).flatten(2).transpose(1, 2)], dim=1)
        return self.proj_q(q), self.proj_k(k), self.proj_v(v)

    def forward(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        B, N, C = x.shape
        q, k, v = self.projections(x, feat_size)
        q, k, v = self._split_heads(q), self._split_heads(k), self._split_heads(v)
        x = scaled_dot_product_attention(
            q, k, v, dropout_p=self.attn_drop if self.training else 0., scale=self.scale)
        x = self.proj(x.transpose(1, 2).reshape(B, N, C))
        return self.proj_drop(x)


def _attn_layer(
        attn_type: str,
        num_heads: int,
        qkv_bias: bool,
        window_size: int,
        dp_rank: int,
        attn_drop: float,
        proj_drop: float,
        span_kernel: str = 'auto',
) -> Callable[..., nn.Module]:
    """The attention of a CvT ('conv') or CvT-LS ('long_short') stage, as a `PreNormBlock` `attn_layer`."""
    if attn_type == 'long_short':
        return partial(
            LongShortAttention2d,
            num_heads=num_heads,
            window_size=window_size,
            dp_rank=dp_rank,
            qkv_layer=SepConvQkv,
            dp_layer=ConvDynamicProjection,
            attn_drop=attn_drop,
            proj_drop=proj_drop,
            span_kernel=span_kernel,
        )
    return partial(ConvAttention, num_heads=num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=proj_drop)


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
            span_kernel: str = 'auto',
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
            span_kernel: The long-short window attention's kernel (attn_type 'long_short'): 'auto' (the flex path on
                CUDA, the span path elsewhere), 'span' or 'flex' (`LongShortAttention2d`).
        """
        dd = {'device': device, 'dtype': dtype}
        if attn_type not in ATTN_TYPES:
            raise ValueError(f'attn_type must be one of {ATTN_TYPES}, got {attn_type!r}')
        num_stages = len(depths)
        act = {'quick_gelu': QuickGELU, 'gelu': nn.GELU}[act_layer]

        last_dpr = [x.item() for x in torch.linspace(0, drop_path_rate, depths[-1], device='cpu')]
        stages = []
        feature_info = []
        in_chs = in_chans
        reduction = 1
        for i in range(num_stages):
            reduction *= patch_strides[i]
            patch_embed = ConvEmbed(
                in_chs, embed_dims[i], patch_sizes[i], patch_strides[i], patch_paddings[i], norm_eps=norm_eps, **dd)
            stages.append(TransformerStage(
                patch_embed,
                embed_dims[i],
                depth=depths[i],
                attn_layer=_attn_layer(
                    attn_type, num_heads[i], qkv_bias, window_sizes[i], dp_ranks[i], attn_drop_rate, proj_drop_rate,
                    span_kernel),
                num_prefix_tokens=1 if cls_token_stages[i] else 0,
                drop_path=last_dpr if i == num_stages - 1 else (),
                mlp_ratio=mlp_ratio,
                act_layer=act,
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
            min_input_size=2 ** (num_stages + 1),  # one token in the last stage
            drop_rate=drop_rate,
            norm_eps=norm_eps,
            **dd,
        )

    @torch.jit.ignore
    def set_input_size(self, img_size: Optional[Union[int, Tuple[int, int]]] = None) -> None:
        """Make `img_size` the native input size. Nothing in CvT is sized by it (no position embeddings), so this
        only checks and records it."""
        if img_size is None:
            return
        img_size = self._checked_input_size(img_size)
        self.img_size = img_size


# transformers' CvT port (the Hub's microsoft/cvt-* repositories) -> lsvision names, applied in order
_TRANSFORMERS_RENAMES = (
    (r'^cvt\.encoder\.stages\.(\d+)\.', r'stages.\1.'),
    (r'\.embedding\.convolution_embeddings\.projection\.', '.patch_embed.proj.'),
    (r'\.embedding\.convolution_embeddings\.normalization\.', '.patch_embed.norm.'),
    (r'\.layers\.(\d+)\.', r'.blocks.\1.'),
    (r'\.attention\.attention\.convolution_projection_(q|k|v)\w*\.convolution_projection\.convolution\.',
     r'.attn.conv_proj_\1.conv.'),
    (r'\.attention\.attention\.convolution_projection_(q|k|v)\w*\.convolution_projection\.normalization\.',
     r'.attn.conv_proj_\1.bn.'),
    (r'\.attention\.attention\.projection_(q|k|v)\w*\.', r'.attn.proj_\1.'),
    (r'\.attention\.output\.dense\.', '.attn.proj.'),  # before the MLP's output.dense
    (r'\.intermediate\.dense\.', '.mlp.fc1.'),
    (r'\.output\.dense\.', '.mlp.fc2.'),
    (r'\.layernorm_before\.', '.norm1.'),
    (r'\.layernorm_after\.', '.norm2.'),
    (r'^layernorm\.', 'norm.'),
    (r'^classifier\.', 'head.'),
)


def transformers_key_to_lsvision(key: str) -> str:
    """An lsvision CvT key for a key of transformers' `CvtForImageClassification` (the layout of the Hub's
    microsoft/cvt-* weights), e.g. `cvt.encoder.stages.2.layers.0.attention.attention.projection_query.weight` ->
    `stages.2.blocks.0.attn.proj_q.weight`."""
    for pattern, replacement in _TRANSFORMERS_RENAMES:
        key = re.sub(pattern, replacement, key)
    return key


def checkpoint_filter_fn(state_dict: Dict[str, torch.Tensor], model: nn.Module) -> Dict[str, torch.Tensor]:
    """Map a CvT checkpoint to lsvision names: Microsoft's (`stage{i}.blocks.{j}...`, `norm`, `head`), transformers'
    (the Hub's microsoft/cvt-*: `cvt.encoder.stages.{i}.layers.{j}...`, `layernorm`, `classifier`) or lsvision's.
    Every key must then fit the model (the classifier aside, which timm drops when the class count differs): a
    KeyError names the ones that do not."""
    if 'state_dict' in state_dict and isinstance(state_dict['state_dict'], dict):
        state_dict = state_dict['state_dict']
    state_dict = {k[len('module.'):] if k.startswith('module.') else k: v for k, v in state_dict.items()}
    if any(k.startswith('cvt.encoder.') for k in state_dict):
        state_dict = {transformers_key_to_lsvision(k): v for k, v in state_dict.items()}
        source = 'the transformers-layout CvT checkpoint (Hugging Face Hub)'
    elif not any(k.startswith('stages.') for k in state_dict):
        state_dict = {re.sub(r'^stage(\d+)\.', r'stages.\1.', k): v for k, v in state_dict.items()}
        source = 'the Microsoft CvT checkpoint'
    else:
        source = 'the lsvision CvT checkpoint'
    return check_filtered_keys(state_dict, model, source)


def _create_cvt(variant: str, pretrained: bool = False, **kwargs: Any) -> ConvVisionTransformer:
    out_indices = kwargs.pop('out_indices', (0, 1, 2))
    return build_model(
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


def _cfg_ls(**kwargs: Any) -> Dict[str, Any]:
    return _cfg(
        license='apache-2.0',
        paper_ids='arXiv:2107.02192',
        paper_name='Long-Short Transformer: Efficient Transformers for Language and Vision',
        origin_url='https://github.com/NVIDIA/transformer-ls',
        **kwargs,
    )


_cfg_384 = partial(_cfg, input_size=(3, 384, 384), pool_size=(24, 24), crop_pct=1.0)  # Microsoft's 384 evaluation


def _cfg_hub(repo: str, top1: float, pretrain: str = 'ImageNet-1k', **kwargs: Any) -> Dict[str, Any]:
    """Microsoft's released weights, on the Hugging Face Hub in transformers' layout (converted on load)."""
    cfg = _cfg_384 if '384' in repo else _cfg
    return cfg(
        hf_hub_id=f'microsoft/{repo}',
        license='apache-2.0',  # the license of the Hub repositories
        description=f"Microsoft's CvT weights ({pretrain}, fine-tuned on ImageNet-1k)" if pretrain != 'ImageNet-1k'
        else "Microsoft's CvT weights (ImageNet-1k)",
        notes=(f'Weights: huggingface.co/microsoft/{repo} (converted from microsoft/CvT by Hugging Face); '
               f'ImageNet-1k top-1 reported by the authors: {top1} %.',),
        **kwargs,
    )


default_cfgs = generate_default_cfgs({
    'cvt_13.ms_in1k': _cfg_hub('cvt-13', 81.6),
    'cvt_21.ms_in1k': _cfg_hub('cvt-21', 82.5),
    'cvt_13_384.ms_in1k': _cfg_hub('cvt-13-384', 83.0),
    'cvt_13_384.ms_in22k_ft_in1k': _cfg_hub('cvt-13-384-22k', 83.3, pretrain='ImageNet-22k'),
    'cvt_21_384.ms_in1k': _cfg_hub('cvt-21-384', 83.3),
    'cvt_21_384.ms_in22k_ft_in1k': _cfg_hub('cvt-21-384-22k', 84.9, pretrain='ImageNet-22k'),
    'cvt_w24_384.ms_in22k_ft_in1k': _cfg_hub('cvt-w24-384-22k', 87.7, pretrain='ImageNet-22k'),
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

_cvt_ms = partial(dict, attn_type='conv', act_layer='quick_gelu')
_CVT_13 = _cvt_ms(embed_dims=(64, 192, 384), num_heads=(1, 3, 6), depths=(1, 2, 10))
_CVT_21 = _cvt_ms(embed_dims=(64, 192, 384), num_heads=(1, 3, 6), depths=(1, 4, 16))
_CVT_W24 = _cvt_ms(embed_dims=(192, 768, 1024), num_heads=(3, 12, 16), depths=(2, 2, 20))

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


@register_model
def cvt_w24_384(pretrained: bool = False, **kwargs: Any) -> ConvVisionTransformer:
    """CvT-W24 at 384, Microsoft's wide CvT (277M params), released pre-trained on ImageNet-22k."""
    return _create_cvt('cvt_w24_384', pretrained=pretrained, **{**_CVT_W24, 'img_size': 384, **kwargs})


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
