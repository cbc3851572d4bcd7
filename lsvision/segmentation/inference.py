"""Whole-image and sliding-window inference of a segmentor, and its mIoU on a split (one or several processes).

`slide_inference` is mmsegmentation's `EncoderDecoder.slide_inference`: windows of `crop_size` every `stride`
pixels, the last window of a row or column moved back to end at the image's edge (and a window larger than the image
shrunk to it), each window's logits added into the image's, and each pixel's sum divided by the number of windows
over it. A window that covers the image is the whole image, so the two modes then agree exactly.

`evaluate_segmentor` scores every image once: each process takes a contiguous shard of the split (batch 1, every
image at its own size), predicts, resizes the logits bilinearly to the label's size, and adds the argmax into a
confusion matrix; the matrices of all processes are summed (`lsvision.eval.segmentation`), so two processes give the
numbers of one.
"""
import contextlib
import logging
import time
from datetime import timedelta
from typing import Any, Dict, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data

from ..eval.distributed import DatasetShard, all_gather, rank_and_world, shard_range
from ..eval.segmentation import SegmentationMetric
from ..runtime import ProgressClock
from .data import SegmentationDataset
from .models import IGNORE_INDEX

__all__ = ['whole_inference', 'slide_inference', 'predict', 'evaluate_segmentor']

_logger = logging.getLogger('segment')


def whole_inference(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The logits (N, C, H, W) of normalized images (N, 3, H, W), in one forward."""
    return model(images).float()


def slide_inference(model: nn.Module, images: torch.Tensor, crop_size: Sequence[int], stride: Sequence[int]
                    ) -> torch.Tensor:
    """The logits (N, C, H, W) of normalized images from overlapping windows (mmsegmentation's slide mode).

    Args:
        model: A segmentor (logits at its input's size).
        images: Normalized images (N, 3, H, W).
        crop_size: (height, width) of a window.
        stride: (height, width) steps between windows.
    """
    (h_crop, w_crop), (h_stride, w_stride) = crop_size, stride
    if min(h_crop, w_crop, h_stride, w_stride) < 1:
        raise ValueError(f'slide inference needs positive crop_size and stride, got {crop_size} and {stride}')
    n, _, h, w = images.shape
    h_grids = max(h - h_crop + h_stride - 1, 0) // h_stride + 1
    w_grids = max(w - w_crop + w_stride - 1, 0) // w_stride + 1
    logits: Optional[torch.Tensor] = None
    count = images.new_zeros((1, 1, h, w))
    for i in range(h_grids):
        for j in range(w_grids):
            y2, x2 = min(i * h_stride + h_crop, h), min(j * w_stride + w_crop, w)
            y1, x1 = max(y2 - h_crop, 0), max(x2 - w_crop, 0)
            out = model(images[:, :, y1:y2, x1:x2]).float()
            if logits is None:
                logits = out.new_zeros((n, out.shape[1], h, w))
            logits[:, :, y1:y2, x1:x2] += out
            count[:, :, y1:y2, x1:x2] += 1
    return logits / count


def predict(model: nn.Module, images: torch.Tensor, mode: str = 'whole', crop_size: Sequence[int] = (512, 512),
            stride: Sequence[int] = (341, 341), out_size: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Logits of normalized images by `mode` ('whole' or 'slide'), resized bilinearly to `out_size` (H, W) if given
    (the label's size when the images were rescaled for the test)."""
    if mode == 'whole':
        logits = whole_inference(model, images)
    elif mode == 'slide':
        logits = slide_inference(model, images, crop_size, stride)
    else:
        raise ValueError(f"inference mode must be 'whole' or 'slide', got {mode!r}")
    if out_size is not None and tuple(logits.shape[-2:]) != tuple(out_size):
        logits = F.interpolate(logits, size=tuple(out_size), mode='bilinear', align_corners=False)
    return logits


@torch.no_grad()
def evaluate_segmentor(model: nn.Module, dataset: SegmentationDataset, device: torch.device, mode: str = 'whole',
                       crop_size: Sequence[int] = (512, 512), stride: Sequence[int] = (341, 341), workers: int = 0,
                       autocast: Any = None, log_every: int = 0, log_every_s: Optional[float] = None
                       ) -> Dict[str, Any]:
    """aAcc, mIoU, mAcc and per-class IoU / Acc of a segmentor on a split (`lsvision.eval.segmentation`), the same
    on every process; rank 0 logs its progress every `log_every` images or `log_every_s` seconds."""
    model.eval()
    indices = shard_range(len(dataset))
    # a generator of its own: the loader's seed is not drawn from the global stream, which training continues
    loader = torch.utils.data.DataLoader(DatasetShard(dataset, indices), batch_size=1, num_workers=workers,
                                         generator=torch.Generator())
    metric = SegmentationMetric(dataset.num_classes, IGNORE_INDEX, dataset.class_names)
    t0, clock = time.perf_counter(), ProgressClock(log_every, log_every_s)
    for step, (image, label) in enumerate(loader):
        with autocast or contextlib.nullcontext():
            logits = predict(model, image.to(device, non_blocking=True), mode, crop_size, stride, label.shape[-2:])
        metric.update(logits.argmax(1).cpu(), label)
        if rank_and_world()[0] == 0 and clock.due(step + 1):
            rate = (step + 1) / (time.perf_counter() - t0)
            _logger.info(f'eval: {step + 1}/{len(indices)} images of this process, {rate:.2f} img/s, ETA '
                         f'{timedelta(seconds=round((len(indices) - step - 1) / rate))}')
    empty = SegmentationMetric(dataset.num_classes, IGNORE_INDEX, dataset.class_names)
    return empty.merge(all_gather(metric)).result()  # every process's counts, summed: the split's
