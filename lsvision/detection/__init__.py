"""Detection and instance segmentation on lsvision backbones, on torchvision's detectors.

`mask_rcnn('cvt_ls_13', num_classes=81)` returns torchvision's `MaskRCNN` with an FPN over the backbone's timm
`features_only` levels (also `faster_rcnn`, `retinanet`, and `backbone_with_fpn` for a detector of one's own).
Under DDP, a training loop averages the GRC caches after every optimizer step:
`lsvision.train.all_reduce_grc_caches(grc_layers(model))` (docs/detection.md).
COCO-format data (`CocoInstances`), the COCO metric through pycocotools (`coco_evaluate`) and the training and
evaluation run of `tools/detect.py` (`engine.run`, `evaluate_detector`).
"""
from lsvision.train import all_reduce_grc_caches

from .coco_eval import coco_evaluate, detections_to_coco
from .data import CocoDataError, CocoInstances, collate_detection
from .engine import evaluate_detector
from .models import (
    BackboneWithFPN,
    ExtraLevels,
    backbone_with_fpn,
    create_backbone,
    detector_input_size,
    faster_rcnn,
    grc_layers,
    mask_rcnn,
    retinanet,
)

__all__ = [
    'BackboneWithFPN', 'ExtraLevels', 'all_reduce_grc_caches', 'backbone_with_fpn', 'create_backbone',
    'detector_input_size', 'faster_rcnn', 'grc_layers', 'mask_rcnn', 'retinanet',
    'CocoDataError', 'CocoInstances', 'coco_evaluate', 'collate_detection', 'detections_to_coco', 'evaluate_detector',
]
