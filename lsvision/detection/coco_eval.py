"""COCO's box and mask AP through pycocotools' COCOeval, and torchvision detections in COCO's result format.

The numbers are COCOeval's own `stats` (AP at IoU .50:.95, AP50, AP75, AP small / medium / large, AR at 1 / 10 /
100 detections, AR small / medium / large), as fractions; -1 where COCOeval defines none (no ground truth in that area
range). The ground truth is the annotation file as pycocotools reads it (crowd regions are its ignore regions); only
the images to score are chosen (`image_ids`: a reader's kept images).
"""
import contextlib
import io
from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np
import torch
from pycocotools import mask as mask_utils
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

__all__ = ['STAT_NAMES', 'IOU_TYPES', 'detections_to_coco', 'coco_evaluate']

# COCOeval.stats in its order (COCOeval.summarize prints them in this order)
STAT_NAMES = ('AP', 'AP50', 'AP75', 'APs', 'APm', 'APl', 'AR1', 'AR10', 'AR100', 'ARs', 'ARm', 'ARl')
# COCOeval's iouType names: box AP and mask AP
IOU_TYPES = ('bbox', 'segm')


def detections_to_coco(output: Mapping[str, torch.Tensor], image_id: int, category_ids: Sequence[int],
                       mask_threshold: float = 0.5) -> List[Dict[str, Any]]:
    """One image's torchvision detections as COCO results (torchvision's COCO recipe: masks binarized at 0.5).

    Args:
        output: A detector's output for one image in its pixel coordinates: `boxes` (N, 4) xyxy, `scores`, `labels`
            (1..K), and `masks` (N, 1, H, W) probabilities for Mask R-CNN.
        image_id: The image's COCO id.
        category_ids: The COCO category id of each label: label l is `category_ids[l - 1]`.
        mask_threshold: Mask probability from which a pixel belongs to the object.
    """
    boxes = output['boxes'].detach().float().cpu()
    boxes = torch.cat([boxes[:, :2], boxes[:, 2:] - boxes[:, :2]], 1).tolist()  # xyxy -> xywh
    scores = output['scores'].detach().float().cpu().tolist()
    labels = output['labels'].detach().cpu().tolist()
    results = [dict(image_id=int(image_id), category_id=int(category_ids[label - 1]), bbox=box, score=score)
               for box, score, label in zip(boxes, scores, labels)]
    if 'masks' in output:
        masks = (output['masks'].detach()[:, 0] > mask_threshold).cpu().numpy().astype(np.uint8)
        for result, mask in zip(results, masks):
            rle = mask_utils.encode(np.asfortranarray(mask))
            result['segmentation'] = {'size': rle['size'], 'counts': rle['counts'].decode('ascii')}
    return results


def _load_results(coco_gt: COCO, detections: List[Dict[str, Any]]) -> COCO:
    """COCO.loadRes, also for no detections at all (which loadRes cannot read): then every AP is 0."""
    if detections:
        return coco_gt.loadRes([dict(d) for d in detections])  # loadRes adds keys to what it is given
    empty = COCO()
    empty.dataset = {'images': list(coco_gt.dataset['images']), 'categories': list(coco_gt.dataset['categories']),
                     'annotations': []}
    empty.createIndex()
    return empty


def coco_evaluate(coco_gt: COCO, detections: List[Dict[str, Any]], iou_types: Sequence[str] = IOU_TYPES,
                  image_ids: Optional[Sequence[int]] = None) -> Dict[str, Dict[str, Any]]:
    """Scores COCO-format detections against `coco_gt` with COCOeval (evaluate, accumulate, summarize).

    Args:
        coco_gt: The ground truth (`pycocotools.coco.COCO` of the annotation file).
        detections: COCO results (`image_id`, `category_id`, `bbox` xywh, `score`, and `segmentation` for 'segm').
        iou_types: 'bbox' (box AP) and / or 'segm' (mask AP).
        image_ids: The images scored (None: all of the file's); detections on other images are an error.

    Returns:
        Per iou type: each of `STAT_NAMES` (a fraction, -1 where undefined) and `summary`, COCOeval's printout.
    """
    for iou_type in iou_types:
        if iou_type not in IOU_TYPES:
            raise ValueError(f'iou type {iou_type!r}: COCOeval scores {IOU_TYPES} (box and mask AP)')
    image_ids = sorted(coco_gt.getImgIds()) if image_ids is None else sorted(image_ids)
    unknown = {d['image_id'] for d in detections} - set(image_ids)
    if unknown:
        raise ValueError(f'detections on {len(unknown)} image(s) that are not scored, e.g. image_id '
                         f'{sorted(unknown)[:5]}: each detection must belong to one of the scored images')
    missing_masks = 'segm' in iou_types and any('segmentation' not in d for d in detections)
    if missing_masks:
        raise ValueError("mask AP ('segm') needs a segmentation in every detection: a model without masks (Faster "
                         "R-CNN, RetinaNet) is scored with iou_types=('bbox',)")
    results: Dict[str, Dict[str, Any]] = {}
    with contextlib.redirect_stdout(io.StringIO()):
        coco_dt = _load_results(coco_gt, detections)
    for iou_type in iou_types:
        evaluator = COCOeval(coco_gt, coco_dt, iou_type)
        evaluator.params.imgIds = image_ids
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            evaluator.evaluate()
            evaluator.accumulate()
            evaluator.summarize()
        stats = {name: float(value) for name, value in zip(STAT_NAMES, evaluator.stats)}
        summary = '\n'.join(line for line in printed.getvalue().splitlines() if line.lstrip().startswith('Average'))
        results[iou_type] = dict(stats, summary=summary)
    return results
