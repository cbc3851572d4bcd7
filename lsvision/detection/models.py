"""Detectors on lsvision backbones: torchvision's Mask R-CNN, Faster R-CNN and RetinaNet with an FPN over a timm
`features_only` backbone.

The backbone is `timm.create_model(name, features_only=True, feature_cls='getter')`: every family's
`forward_intermediates` gives its stage maps as NCHW at strides 4, 8, 16 (and 32), at any input size. torchvision's
`FeaturePyramidNetwork` turns them into 256-channel levels; extra levels, made by torchvision's two rules (subsampling
as `LastLevelMaxPool`, or a stride-2 conv as `LastLevelP6P7`), bring every backbone to the five levels torchvision's
detectors are configured for, so their default anchors and RoI pools apply unchanged:

* R-CNNs (Mask, Faster): levels '0'-'3' at strides 4-32 and 'pool' at 64, as torchvision's `resnet_fpn_backbone`;
  a three-stage backbone (CvT, CvT-LS: strides 4-16) gets '3' and 'pool' by subsampling.
* RetinaNet: levels 'p3'-'p7' at strides 8-128, as `retinanet_resnet50_fpn`: the stage maps from stride 8, then
  stride-2 convs (three for a three-stage backbone, P6 and P7 otherwise).

Written for lsvision, Apache-2.0.
"""
import os
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision.models.detection import FasterRCNN, MaskRCNN, RetinaNet
from torchvision.models.detection.transform import GeneralizedRCNNTransform
from torchvision.ops.feature_pyramid_network import ExtraFPNBlock, FeaturePyramidNetwork

import timm
from timm.layers import PatchEmbed
from timm.models import model_entrypoint

from lsvision.layers import GatedRecurrentCache
from lsvision.models._helpers import explain_checkpoint_errors
from lsvision.models._pretrained import NoPretrainedWeightsError, model_card
from lsvision.train.weights import file_num_classes, file_tensor_shapes

__all__ = [
    'BackboneWithFPN', 'ExtraLevels', 'backbone_with_fpn', 'create_backbone', 'detector_input_size', 'faster_rcnn',
    'grc_layers', 'input_multiple', 'mask_rcnn', 'pad_to_multiple', 'retinanet',
]

# the detectors' five levels: R-CNNs from stride 4 (torchvision's resnet_fpn_backbone names), RetinaNet from 8
RCNN_LEVELS = ('0', '1', '2', '3', 'pool')
RETINANET_LEVELS = ('p3', 'p4', 'p5', 'p6', 'p7')

# constructor arguments that let a family take any input size (the others take any size as built): timm's Swin checks
# the input against img_size unless strict_img_size=False, which also pads to whole windows and builds the shift mask
# per input (dynamic_mask)
_DYNAMIC_SIZE_KWARGS: Dict[str, Dict[str, Any]] = {
    'timm.models.swin_transformer': dict(strict_img_size=False),
    'lsvision.models.swin_grc': dict(strict_img_size=False),
}


def input_multiple(body: nn.Module) -> Tuple[int, int]:
    """(height, width) that an input of the features_only model `body` must be a multiple of: timm's PatchEmbed
    (Swin) takes only whole patches unless built to pad; (1, 1) for the other families, which take any size."""
    embed = getattr(getattr(body, 'model', body), 'patch_embed', None)
    if isinstance(embed, PatchEmbed) and not embed.dynamic_img_pad:
        return tuple(embed.patch_size)
    return (1, 1)


def pad_to_multiple(x: torch.Tensor, multiple: Tuple[int, int]) -> torch.Tensor:
    """`x` (N, C, H, W) padded with zeros at the bottom and right to a multiple of `multiple` (as
    GeneralizedRCNNTransform's batching pads)."""
    pad_h, pad_w = -x.shape[-2] % multiple[0], -x.shape[-1] % multiple[1]
    return F.pad(x, (0, pad_w, 0, pad_h)) if pad_h or pad_w else x


class ExtraLevels(ExtraFPNBlock):
    """FPN levels beyond the backbone's, each at twice the stride of the one before, by torchvision's rules.

    'pool' subsamples the last level (`max_pool2d` with kernel 1, stride 2: torchvision's `LastLevelMaxPool`);
    'conv' applies a 3x3 stride-2 conv to the last FPN level, with a ReLU before every conv but the first
    (torchvision's `LastLevelP6P7(256, 256)`, whose init it keeps).

    Args:
        names: The names of the new levels, in order (one level per name).
        mode: 'pool' or 'conv'.
        channels: The FPN's channels (for 'conv').
    """

    def __init__(self, names: Sequence[str], mode: str = 'pool', channels: int = 256):
        super().__init__()
        if mode not in ('pool', 'conv'):
            raise ValueError(f"ExtraLevels mode must be 'pool' or 'conv', got {mode!r}")
        self.names = list(names)
        self.mode = mode
        self.convs = nn.ModuleList()
        if mode == 'conv':
            for _ in self.names:
                conv = nn.Conv2d(channels, channels, 3, 2, 1)
                nn.init.kaiming_uniform_(conv.weight, a=1)
                nn.init.constant_(conv.bias, 0)
                self.convs.append(conv)

    def forward(
            self,
            results: List[torch.Tensor],
            x: List[torch.Tensor],
            names: List[str],
    ) -> Tuple[List[torch.Tensor], List[str]]:
        for i, name in enumerate(self.names):
            last = results[-1]
            if self.mode == 'pool':
                results.append(F.max_pool2d(last, kernel_size=1, stride=2, padding=0))
            else:
                results.append(self.convs[i](last if i == 0 else F.relu(last)))
            names.append(name)
        return results, names


class BackboneWithFPN(nn.Module):
    """A timm `features_only` backbone with torchvision's FPN over its levels, as torchvision's detectors take it
    (an `out_channels` attribute; the forward returns an ordered dict of NCHW levels).

    Args:
        body: The timm features_only model (its `feature_info` gives channels and strides).
        level_names: The names of the output levels, backbone levels first, then the extra ones.
        first_stride: The stride of the first backbone level the FPN takes (4, or 8 for RetinaNet).
        extra_mode: How the extra levels are made ('pool' or 'conv', see :class:`ExtraLevels`).
        out_channels: The FPN's channels.
    """

    def __init__(
            self,
            body: nn.Module,
            level_names: Sequence[str] = RCNN_LEVELS,
            first_stride: int = 4,
            extra_mode: str = 'pool',
            out_channels: int = 256,
    ):
        super().__init__()
        strides = list(body.feature_info.reduction())
        channels = list(body.feature_info.channels())
        if first_stride not in strides:
            raise ValueError(f'the backbone has no level at stride {first_stride} (its strides: {strides})')
        self.first_level = strides.index(first_stride)
        taken = len(strides) - self.first_level
        if taken > len(level_names):
            raise ValueError(f'the backbone has {taken} levels from stride {first_stride}, more than the '
                             f'{len(level_names)} level names {list(level_names)}')
        self.body = body
        self.level_names = list(level_names)
        self.fpn = FeaturePyramidNetwork(
            channels[self.first_level:], out_channels,
            extra_blocks=ExtraLevels(self.level_names[taken:], extra_mode, out_channels))
        self.out_channels = out_channels
        self.strides = [first_stride * 2 ** i for i in range(len(self.level_names))]
        self.input_multiple = input_multiple(body)

    def forward(self, x: torch.Tensor) -> 'OrderedDict[str, torch.Tensor]':
        feats = self.body(pad_to_multiple(x, self.input_multiple))[self.first_level:]
        return self.fpn(OrderedDict(zip(self.level_names, feats)))


def _pretrained_error(name: str, module: str) -> NoPretrainedWeightsError:
    """The error for 'pretrained' without released weights, with the two ways on (instead of timm's, which says to
    create the model with pretrained=False)."""
    where = f'{model_card(name)} says where its weights come from' if module.startswith('lsvision.') else \
        f"timm.list_pretrained('{name}*') lists released ones"
    return NoPretrainedWeightsError(
        f"backbone_weights='pretrained': {name} has no released weights ({where}). Pass backbone_weights=None to "
        "start from random weights, or backbone_weights='/path/to/weights' (safetensors, a .pth state dict or a "
        f'tools/train.py checkpoint of {name}).')


def create_backbone(
        name: str,
        backbone_weights: Optional[str] = None,
        model_kwargs: Optional[Dict[str, Any]] = None,
) -> nn.Module:
    """The timm `features_only` model of `name` (NCHW maps of every stage, at any input size), with its weights.

    Args:
        name: A timm model name with feature maps (every hierarchical lsvision family, and timm's own).
        backbone_weights: None (random init), 'pretrained' (the released weights through timm's pretrained tags),
            or a checkpoint file: safetensors, a .pth state dict (lsvision's layout or one the family converts, e.g.
            the authors' files), or a tools/train.py checkpoint (its EMA weights when it has them). For a GRC model
            the file may hold its timm base model (only the `.grc.` tensors start fresh). The classifier is left out.
        model_kwargs: Arguments for `timm.create_model` (sizes for tiny configurations, `grc_*` options, ...).

    Raises:
        NoPretrainedWeightsError: 'pretrained' for a model without released weights.
        FileNotFoundError: A weights path that is not a file.
        CheckpointMismatchError: A file of another architecture or configuration (the family filter's message).
    """
    module = model_entrypoint(name).__module__  # raises timm's unknown-model error for a wrong name
    kwargs = {**_DYNAMIC_SIZE_KWARGS.get(module, {}), **(model_kwargs or {})}
    kwargs.update(features_only=True, feature_cls='getter')
    if backbone_weights is None:
        return timm.create_model(name, **kwargs)
    if backbone_weights == 'pretrained':
        try:
            return timm.create_model(name, pretrained=True, **kwargs)
        except NoPretrainedWeightsError:
            raise _pretrained_error(name, module) from None
        except RuntimeError as e:  # timm's own models: "No pretrained weights exist for ..."
            if 'No pretrained weights exist' not in str(e):
                raise
            raise _pretrained_error(name, module) from None
    path = os.fspath(backbone_weights)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"backbone_weights {path!r} is not a file (working directory {os.getcwd()}); give a checkpoint path, "
            "'pretrained' for released weights, or None for random weights")
    overlay = dict(file=path)
    # the file's head is left out; building the model with the file's class count keeps the family filters from
    # warning that a head of another size is dropped (features_only loads no head either way)
    shapes, _ = file_tensor_shapes(path)
    try:
        classifier = timm.models.get_pretrained_cfg(name).classifier
    except (RuntimeError, AttributeError):
        classifier = None
    classes = file_num_classes(shapes, classifier)
    if classes:
        overlay['num_classes'] = classes
        kwargs.setdefault('num_classes', classes)
    # a file that does not fit: the short message naming both architectures (a tools/train.py checkpoint's `arch`)
    classifier_kwargs = {k: v for k, v in kwargs.items() if k not in ('features_only', 'feature_cls')}
    with explain_checkpoint_errors(name, path, classifier_kwargs):
        return timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, **kwargs)


def backbone_with_fpn(
        name: str,
        backbone_weights: Optional[str] = None,
        model_kwargs: Optional[Dict[str, Any]] = None,
        out_channels: int = 256,
        levels: str = 'rcnn',
) -> BackboneWithFPN:
    """The backbone of `name` (see :func:`create_backbone`) with an FPN, as torchvision's detectors take it.

    Args:
        name: A timm model name with feature maps.
        backbone_weights: None, 'pretrained' or a checkpoint file (see :func:`create_backbone`).
        model_kwargs: Arguments for `timm.create_model`.
        out_channels: The FPN's channels.
        levels: 'rcnn' (levels '0'-'3' and 'pool', strides 4-64) or 'retinanet' ('p3'-'p7', strides 8-128).
    """
    if levels not in ('rcnn', 'retinanet'):
        raise ValueError(f"levels must be 'rcnn' or 'retinanet', got {levels!r}")
    body = create_backbone(name, backbone_weights, model_kwargs)
    if levels == 'rcnn':
        return BackboneWithFPN(body, RCNN_LEVELS, first_stride=4, extra_mode='pool', out_channels=out_channels)
    return BackboneWithFPN(body, RETINANET_LEVELS, first_stride=8, extra_mode='conv', out_channels=out_channels)


def detector_input_size(height: int, width: int) -> Tuple[int, int]:
    """The batch torchvision's `GeneralizedRCNNTransform` makes of one `height` x `width` image when its sizes are
    the image's (min_size = the shorter side, max_size = the longer): kept, then padded to a multiple of 32."""
    transform = GeneralizedRCNNTransform(min(height, width), max(height, width), [0.] * 3, [1.] * 3)
    images, _ = transform([torch.zeros(3, height, width)])
    return tuple(images.tensors.shape[-2:])


def _normalization(backbone: BackboneWithFPN, detector_kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The backbone's own mean and std for the detector's transform, unless given."""
    cfg = getattr(backbone.body, 'pretrained_cfg', None) or {}
    out = dict(detector_kwargs)
    out.setdefault('image_mean', list(cfg.get('mean', (0.485, 0.456, 0.406))))
    out.setdefault('image_std', list(cfg.get('std', (0.229, 0.224, 0.225))))
    return out


def mask_rcnn(
        name: str,
        num_classes: int = 91,
        backbone_weights: Optional[str] = None,
        model_kwargs: Optional[Dict[str, Any]] = None,
        fpn_channels: int = 256,
        **detector_kwargs: Any,
) -> MaskRCNN:
    """torchvision's Mask R-CNN on the backbone of `name` with an FPN (see :func:`backbone_with_fpn`).

    Args:
        name: A timm model name with feature maps.
        num_classes: The class count, background included (torchvision's convention: 81 for COCO's 80).
        backbone_weights: None, 'pretrained' or a checkpoint file (see :func:`create_backbone`).
        model_kwargs: Arguments for `timm.create_model`.
        fpn_channels: The FPN's channels (torchvision's 256; fewer for tiny test configurations).
        **detector_kwargs: Arguments for torchvision's `MaskRCNN` (min_size, max_size, ...); image_mean and
            image_std default to the backbone's.
    """
    backbone = backbone_with_fpn(name, backbone_weights, model_kwargs, fpn_channels)
    return MaskRCNN(backbone, num_classes=num_classes, **_normalization(backbone, detector_kwargs))


def faster_rcnn(
        name: str,
        num_classes: int = 91,
        backbone_weights: Optional[str] = None,
        model_kwargs: Optional[Dict[str, Any]] = None,
        fpn_channels: int = 256,
        **detector_kwargs: Any,
) -> FasterRCNN:
    """torchvision's Faster R-CNN on the backbone of `name` with an FPN; arguments as :func:`mask_rcnn`."""
    backbone = backbone_with_fpn(name, backbone_weights, model_kwargs, fpn_channels)
    return FasterRCNN(backbone, num_classes=num_classes, **_normalization(backbone, detector_kwargs))


def retinanet(
        name: str,
        num_classes: int = 91,
        backbone_weights: Optional[str] = None,
        model_kwargs: Optional[Dict[str, Any]] = None,
        fpn_channels: int = 256,
        **detector_kwargs: Any,
) -> RetinaNet:
    """torchvision's RetinaNet on the backbone of `name` with an FPN at strides 8-128; arguments as
    :func:`mask_rcnn` (`num_classes` as torchvision's RetinaNet counts them)."""
    backbone = backbone_with_fpn(name, backbone_weights, model_kwargs, fpn_channels, levels='retinanet')
    return RetinaNet(backbone, num_classes=num_classes, **_normalization(backbone, detector_kwargs))


def grc_layers(model: nn.Module) -> List[GatedRecurrentCache]:
    """The GRC layers of a detector (or any model), in module order: what a DDP training loop passes to
    `lsvision.train.all_reduce_grc_caches` after every optimizer step ([] for backbones without GRC)."""
    return [m for m in model.modules() if isinstance(m, GatedRecurrentCache)]
