"""Semantic segmentation metrics as mmsegmentation counts them: aAcc, mIoU, mAcc and per-class IoU and accuracy.

mmsegmentation (`mmseg/core/evaluation/metrics.py`: `intersect_and_union`, `total_area_to_metrics`; 1.x:
`IoUMetric`) drops the pixels labelled `ignore_index` from both the label and the prediction, then counts per class
the intersection (pixels predicted and labelled c), the prediction and label areas, and their union, summed over the
whole split (not averaged per image). Then, per class, IoU = intersection / union and Acc = intersection / label
area; a class with union 0 (neither in any label nor in any prediction) has IoU NaN, a class in no label has Acc NaN,
and mIoU / mAcc are the means over the other classes (`np.nanmean`); aAcc = total intersection / total labelled
pixels. Here the counts are a confusion matrix (label x prediction, int64), whose diagonal, row and column sums are
those areas; adding the matrices of several processes (or images) gives the split's, exactly.

Knows no model: it takes label maps.
"""
import math
from typing import Any, Dict, List, Optional, Sequence

import torch

__all__ = ['SegmentationMetric', 'intersect_and_union', 'metrics_from_areas']


def intersect_and_union(pred: torch.Tensor, label: torch.Tensor, num_classes: int, ignore_index: int = 255
                        ) -> Dict[str, torch.Tensor]:
    """Per-class areas of one prediction against its label (mmsegmentation's `intersect_and_union`).

    Args:
        pred: Predicted classes, any shape, values in [0, num_classes).
        label: The label map of the same shape: classes, or `ignore_index` for pixels not counted.
        num_classes: Classes counted.
        ignore_index: The label of pixels left out.

    Returns:
        int64 tensors (num_classes,): `intersect`, `union`, `pred_area`, `label_area`.
    """
    return _areas(confusion_matrix(pred, label, num_classes, ignore_index))


def confusion_matrix(pred: torch.Tensor, label: torch.Tensor, num_classes: int, ignore_index: int = 255
                     ) -> torch.Tensor:
    """(num_classes, num_classes) int64 counts of (label, predicted class) over the pixels not labelled
    `ignore_index`; a label or prediction outside [0, num_classes) elsewhere is an error."""
    if pred.shape != label.shape:
        raise ValueError(f'the prediction has shape {tuple(pred.shape)} and the label {tuple(label.shape)}: a '
                         'prediction is scored against a label map of its own size')
    keep = label != ignore_index
    pred, label = pred[keep].long(), label[keep].long()
    for what, values in (('label', label), ('prediction', pred)):
        if values.numel() and (values.min() < 0 or values.max() >= num_classes):
            bad = values[(values < 0) | (values >= num_classes)].unique()[:5].tolist()
            raise ValueError(f'{what} values {bad} are outside the {num_classes} classes 0..{num_classes - 1} '
                             f'(and not the ignore index {ignore_index})')
    counts = torch.bincount(label * num_classes + pred, minlength=num_classes * num_classes)
    return counts.reshape(num_classes, num_classes).cpu()


def _areas(matrix: torch.Tensor) -> Dict[str, torch.Tensor]:
    intersect = matrix.diagonal().clone()
    label_area, pred_area = matrix.sum(1), matrix.sum(0)
    return dict(intersect=intersect, union=pred_area + label_area - intersect, pred_area=pred_area,
                label_area=label_area)


def _nanmean(values: List[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else float('nan')


def metrics_from_areas(intersect: torch.Tensor, union: torch.Tensor, label_area: torch.Tensor,
                       class_names: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """aAcc, mIoU, mAcc and the per-class IoU and Acc from areas summed over a split (mmsegmentation's
    `total_area_to_metrics` and its nan-means), as fractions; NaN where mmsegmentation has NaN.

    Returns:
        `aAcc`, `mIoU`, `mAcc`, `IoU` and `Acc` (lists, one value a class), `classes` (names), `pixels` (labelled
        pixels counted) and `classes_scored` (classes with a finite IoU, the ones mIoU averages).
    """
    inter, union, label_area = (t.double() for t in (intersect, union, label_area))
    iou = (inter / union).tolist()  # 0 / 0 = NaN: a class in no label and no prediction
    acc = (inter / label_area).tolist()
    total = float(label_area.sum())
    names = list(class_names) if class_names is not None else [str(i) for i in range(len(iou))]
    return dict(aAcc=float(inter.sum()) / total if total else float('nan'), mIoU=_nanmean(iou), mAcc=_nanmean(acc),
                IoU=iou, Acc=acc, classes=names, pixels=int(total),
                classes_scored=sum(not math.isnan(v) for v in iou))


class SegmentationMetric:
    """Accumulates predictions and labels over a split; `result()` gives mmsegmentation's numbers.

    Args:
        num_classes: Classes counted.
        ignore_index: The label of pixels left out.
        class_names: Names for the per-class values (default: the class indices).
    """

    def __init__(self, num_classes: int, ignore_index: int = 255, class_names: Optional[Sequence[str]] = None):
        self.num_classes, self.ignore_index = num_classes, ignore_index
        self.class_names = list(class_names) if class_names is not None else None
        self.matrix = torch.zeros(num_classes, num_classes, dtype=torch.int64)
        self.images = 0

    def update(self, pred: torch.Tensor, label: torch.Tensor) -> None:
        """Adds predicted classes and their label map (one image or a batch of the same shape)."""
        self.matrix += confusion_matrix(pred, label, self.num_classes, self.ignore_index)
        self.images += 1 if pred.dim() <= 2 else pred.shape[0]

    def merge(self, others: Sequence['SegmentationMetric']) -> 'SegmentationMetric':
        """The sum of this and `others` (every process's counts: the split's)."""
        out = SegmentationMetric(self.num_classes, self.ignore_index, self.class_names)
        for m in (self, *others):
            out.matrix += m.matrix
            out.images += m.images
        return out

    def result(self) -> Dict[str, Any]:
        areas = _areas(self.matrix)
        return dict(metrics_from_areas(areas['intersect'], areas['union'], areas['label_area'], self.class_names),
                    images=self.images)
