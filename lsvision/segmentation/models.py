"""Semantic segmentation on lsvision backbones: Semantic FPN (PVT's ADE20K head) and UperNet (Swin's).

Both take the backbone's timm `features_only` levels (`lsvision.detection.create_backbone`: NCHW maps at strides 4,
8, 16 (and 32), at any input size, weights from `pretrained` or a file) and return per-pixel class logits at the
input's size:

* :func:`semantic_fpn`: torchvision's `FeaturePyramidNetwork` over the levels, then the semantic branch of Kirillov
  et al.'s Panoptic FPN (arXiv:1901.02446, Sec. 3 and Fig. 3) as mmsegmentation's `FPNHead`: each level goes through
  log2(stride / 4) conv-norm-ReLU stages, each followed by a 2x bilinear upsampling (one stage without upsampling at
  stride 4), the levels are summed at stride 4, then dropout and a 1x1 classifier. The PVT paper (Sec. 5.3) puts it
  on its backbones for ADE20K.
* :func:`upernet`: mmsegmentation's `UPerHead` (Xiao et al., UPerNet, arXiv:1807.10221), the head of the Swin paper's
  ADE20K results: a pyramid pooling module (PSPNet's: adaptive average pools to 1, 2, 3, 6 cells, 1x1 conv-norm-ReLU,
  upsampled and concatenated with the last level, then a 3x3 conv) on the last level, a top-down FPN with 1x1 lateral
  and 3x3 output conv-norm-ReLUs, every level upsampled to stride 4, concatenated, fused by a 3x3 conv, classified.

The logits are upsampled bilinearly (align_corners=False) to the input's size, where the loss and the metric read
them, as mmsegmentation's `EncoderDecoder`. Swin's patch embedding takes whole patches only: its input is padded at
the bottom and right first and the logits cropped back. The input is normalized as the backbone's classification
input (its timm pretrained cfg's mean and std: `Segmentor.mean`, `Segmentor.std`).

Written for lsvision, Apache-2.0.
"""
import math
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision.ops.feature_pyramid_network import FeaturePyramidNetwork

from ..detection.models import create_backbone, grc_layers, input_multiple, pad_to_multiple

__all__ = ['SEGMENTORS', 'IGNORE_INDEX', 'ConvNormAct', 'SemanticFPNHead', 'UPerHead', 'Segmentor', 'semantic_fpn',
           'upernet', 'grc_layers', 'segmentation_loss']

SEGMENTORS = ('semantic_fpn', 'upernet')
IGNORE_INDEX = 255  # the label of pixels no loss and no metric counts (mmsegmentation's ignore_index)


class ConvNormAct(nn.Sequential):
    """Conv (no bias) - norm - ReLU, mmcv's ConvModule as mmsegmentation's heads use it.

    Args:
        in_channels: Input channels.
        out_channels: Output channels.
        kernel_size: 1 or 3 (padded to keep the size).
        norm: 'bn' (BatchNorm2d; mmsegmentation's configs use SyncBN, which a DDP run converts it to) or 'gn'
            (GroupNorm with 32 groups as Panoptic FPN; fewer, of 4 channels each, in a head narrower than 128).
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3, norm: str = 'bn'):
        if norm not in ('bn', 'gn'):
            raise ValueError(f"norm must be 'bn' or 'gn', got {norm!r}")
        conv = nn.Conv2d(in_channels, out_channels, kernel_size, padding=kernel_size // 2, bias=False)
        nn.init.kaiming_normal_(conv.weight, mode='fan_out', nonlinearity='relu')  # mmcv ConvModule's init
        # GroupNorm: Panoptic FPN's 32 groups of 128 channels; a narrower head keeps 4 channels a group
        norm_layer = nn.BatchNorm2d(out_channels) if norm == 'bn' else nn.GroupNorm(
            math.gcd(32, max(out_channels // 4, 1)), out_channels)
        super().__init__(conv, norm_layer, nn.ReLU(inplace=True))


class _Classifier(nn.Sequential):
    """Dropout2d then a 1x1 conv to the class logits (mmsegmentation's `cls_seg`, init N(0, 0.01))."""

    def __init__(self, channels: int, num_classes: int, dropout: float):
        conv = nn.Conv2d(channels, num_classes, 1)
        nn.init.normal_(conv.weight, std=0.01)
        nn.init.zeros_(conv.bias)
        super().__init__(nn.Dropout2d(dropout) if dropout > 0 else nn.Identity(), conv)


def _resize(x: torch.Tensor, size: Tuple[int, int]) -> torch.Tensor:
    return x if tuple(x.shape[-2:]) == tuple(size) else F.interpolate(x, size=size, mode='bilinear',
                                                                      align_corners=False)


class SemanticFPNHead(nn.Module):
    """The semantic branch of Panoptic FPN (mmsegmentation's `FPNHead`) over levels at `strides`.

    Args:
        in_channels: Channels of each level (the FPN's width for every level).
        strides: Stride of each level, finest first (powers of two times the first).
        num_classes: Classes of the logits.
        channels: Width of the upsampling stages (128 in Panoptic FPN and mmsegmentation).
        dropout: Dropout2d before the classifier.
        norm: 'gn' (Panoptic FPN) or 'bn' (see :class:`ConvNormAct`).
    """

    def __init__(self, in_channels: Sequence[int], strides: Sequence[int], num_classes: int, channels: int = 128,
                 dropout: float = 0.1, norm: str = 'gn'):
        super().__init__()
        self.scale_heads = nn.ModuleList()
        for c, s in zip(in_channels, strides):
            stages: List[nn.Module] = []
            for k in range(max(1, int(math.log2(s) - math.log2(strides[0])))):
                stages.append(ConvNormAct(c if k == 0 else channels, channels, 3, norm))
                if s != strides[0]:
                    stages.append(nn.Upsample(scale_factor=2, mode='bilinear', align_corners=False))
            self.scale_heads.append(nn.Sequential(*stages))
        self.classifier = _Classifier(channels, num_classes, dropout)

    def forward(self, feats: List[torch.Tensor]) -> torch.Tensor:
        out = self.scale_heads[0](feats[0])
        for head, x in zip(self.scale_heads[1:], feats[1:]):  # an odd input size: 2x of a level may miss by a pixel
            out = out + _resize(head(x), out.shape[-2:])
        return self.classifier(out)


class UPerHead(nn.Module):
    """UperNet's head (mmsegmentation's `UPerHead` with PSPNet's pooling module on the last level).

    Args:
        in_channels: Channels of each backbone level, finest first.
        num_classes: Classes of the logits.
        channels: Width of every conv (512 in the Swin ADE20K configs).
        pool_scales: Output cells of the pyramid pooling's adaptive average pools.
        dropout: Dropout2d before the classifier.
        norm: 'bn' (mmsegmentation's SyncBN configs) or 'gn' (see :class:`ConvNormAct`).
    """

    def __init__(self, in_channels: Sequence[int], num_classes: int, channels: int = 512,
                 pool_scales: Sequence[int] = (1, 2, 3, 6), dropout: float = 0.1, norm: str = 'bn'):
        super().__init__()
        last = in_channels[-1]
        self.ppm = nn.ModuleList(nn.Sequential(nn.AdaptiveAvgPool2d(s), ConvNormAct(last, channels, 1, norm))
                                 for s in pool_scales)
        self.bottleneck = ConvNormAct(last + len(pool_scales) * channels, channels, 3, norm)
        self.lateral_convs = nn.ModuleList(ConvNormAct(c, channels, 1, norm) for c in in_channels[:-1])
        self.fpn_convs = nn.ModuleList(ConvNormAct(channels, channels, 3, norm) for _ in in_channels[:-1])
        self.fpn_bottleneck = ConvNormAct(len(in_channels) * channels, channels, 3, norm)
        self.classifier = _Classifier(channels, num_classes, dropout)

    def forward(self, feats: List[torch.Tensor]) -> torch.Tensor:
        top = feats[-1]
        pooled = [_resize(pool(top), top.shape[-2:]) for pool in self.ppm]
        laterals = [conv(x) for conv, x in zip(self.lateral_convs, feats)]
        laterals.append(self.bottleneck(torch.cat([top, *pooled], 1)))
        for i in range(len(laterals) - 1, 0, -1):  # top-down, not in place: each level keeps its own tensor
            laterals[i - 1] = laterals[i - 1] + _resize(laterals[i], laterals[i - 1].shape[-2:])
        outs = [conv(x) for conv, x in zip(self.fpn_convs, laterals)] + [laterals[-1]]
        size = outs[0].shape[-2:]
        return self.classifier(self.fpn_bottleneck(torch.cat([_resize(x, size) for x in outs], 1)))


class Segmentor(nn.Module):
    """A features_only backbone, an optional FPN neck and a decode head: normalized images (N, 3, H, W) in, class
    logits (N, num_classes, H, W) out, for any H and W.

    Args:
        body: The timm features_only model (`lsvision.detection.create_backbone`).
        head: The decode head (its input: the levels, or the neck's levels).
        num_classes: Classes of the logits.
        neck: torchvision's FeaturePyramidNetwork over the levels, or None.
    """

    def __init__(self, body: nn.Module, head: nn.Module, num_classes: int,
                 neck: Optional[FeaturePyramidNetwork] = None):
        super().__init__()
        self.body, self.neck, self.decode_head = body, neck, head
        self.num_classes = num_classes
        self.input_multiple = input_multiple(body)
        self.strides = list(body.feature_info.reduction())
        cfg = getattr(body, 'pretrained_cfg', None) or {}
        self.mean = tuple(cfg.get('mean', (0.485, 0.456, 0.406)))
        self.std = tuple(cfg.get('std', (0.229, 0.224, 0.225)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        padded = pad_to_multiple(x, self.input_multiple)
        feats = self.body(padded)
        if self.neck is not None:
            feats = list(self.neck(OrderedDict((str(i), f) for i, f in enumerate(feats))).values())
        logits = _resize(self.decode_head(feats), padded.shape[-2:])
        return logits[..., :h, :w]


def _levels(body: nn.Module, name: str) -> Tuple[List[int], List[int]]:
    channels, strides = list(body.feature_info.channels()), list(body.feature_info.reduction())
    if strides[0] != 4 or any(b != 2 * a for a, b in zip(strides, strides[1:])):
        raise ValueError(f'{name} gives feature maps at strides {strides}; the segmentation heads take a pyramid '
                         'from stride 4, each level at twice the stride of the one before (a hierarchical backbone)')
    return channels, strides


def semantic_fpn(
        name: str,
        num_classes: int,
        backbone_weights: Optional[str] = None,
        model_kwargs: Optional[Dict[str, Any]] = None,
        fpn_channels: int = 256,
        channels: int = 128,
        dropout: float = 0.1,
        norm: str = 'gn',
) -> Segmentor:
    """Semantic FPN on the backbone of `name` (PVT's ADE20K model: an FPN of `fpn_channels` over every level and
    Panoptic FPN's semantic branch of `channels`).

    Args:
        name: A timm model name with a feature pyramid (every hierarchical lsvision family, timm's own).
        num_classes: Classes to segment (150 for ADE20K, 19 for Cityscapes).
        backbone_weights: None, 'pretrained' or a checkpoint file (`lsvision.detection.create_backbone`).
        model_kwargs: Arguments for `timm.create_model` (sizes, `grc_*` options).
        fpn_channels: The FPN's width (256 in PVT's config).
        channels: The head's width (128).
        dropout: Dropout2d before the classifier (0.1).
        norm: The head's norm: 'gn' (Panoptic FPN) or 'bn'.
    """
    body = create_backbone(name, backbone_weights, model_kwargs)
    in_channels, strides = _levels(body, name)
    neck = FeaturePyramidNetwork(in_channels, fpn_channels)
    head = SemanticFPNHead([fpn_channels] * len(strides), strides, num_classes, channels, dropout, norm)
    return Segmentor(body, head, num_classes, neck)


def upernet(
        name: str,
        num_classes: int,
        backbone_weights: Optional[str] = None,
        model_kwargs: Optional[Dict[str, Any]] = None,
        channels: int = 512,
        pool_scales: Sequence[int] = (1, 2, 3, 6),
        dropout: float = 0.1,
        norm: str = 'bn',
) -> Segmentor:
    """UperNet on the backbone of `name` (Swin's ADE20K model, without its auxiliary FCN head).

    Args:
        name: A timm model name with a feature pyramid.
        num_classes: Classes to segment.
        backbone_weights: None, 'pretrained' or a checkpoint file (`lsvision.detection.create_backbone`).
        model_kwargs: Arguments for `timm.create_model`.
        channels: The head's width (512).
        pool_scales: The pyramid pooling's cells (1, 2, 3, 6).
        dropout: Dropout2d before the classifier (0.1).
        norm: The head's norm: 'bn' (mmsegmentation's) or 'gn'.
    """
    body = create_backbone(name, backbone_weights, model_kwargs)
    in_channels, _ = _levels(body, name)
    return Segmentor(body, UPerHead(in_channels, num_classes, channels, pool_scales, dropout, norm), num_classes)


def segmentation_loss(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Pixel cross-entropy averaged over the labelled pixels (mmsegmentation's CrossEntropyLoss with
    avg_non_ignore=True); 0 (with a gradient) for a batch without a labelled pixel, where a plain mean is NaN."""
    total = F.cross_entropy(logits.float(), target.long(), ignore_index=ignore_index, reduction='sum')
    return total / (target != ignore_index).sum().clamp(min=1)
