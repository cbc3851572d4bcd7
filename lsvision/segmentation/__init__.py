"""Semantic segmentation on lsvision backbones: Semantic FPN and UperNet (docs/segmentation.md)."""
from .models import (
    IGNORE_INDEX,
    SEGMENTORS,
    Segmentor,
    SemanticFPNHead,
    UPerHead,
    grc_layers,
    segmentation_loss,
    semantic_fpn,
    upernet,
)

__all__ = ['IGNORE_INDEX', 'SEGMENTORS', 'Segmentor', 'SemanticFPNHead', 'UPerHead', 'grc_layers',
           'segmentation_loss', 'semantic_fpn', 'upernet']
