"""The COCO metric (lsvision.detection.coco_eval): hand-built cases with known AP, each equal to pycocotools run
directly on the same files, and torchvision outputs turned into COCO results."""
import contextlib
import io
import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import pytest
import torch
from pycocotools import mask as mask_utils
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from lsvision.detection.coco_eval import STAT_NAMES, coco_evaluate, detections_to_coco
from lsvision.detection.data import load_coco

H, W = 100, 120
# two objects in image 1 (a 40 x 30 medium one, a 10 x 10 small one), one in image 2, a crowd region in image 2
GT = [dict(id=1, image_id=1, category_id=5, bbox=[10, 10, 40, 30]),
      dict(id=2, image_id=1, category_id=5, bbox=[70, 60, 10, 10]),
      dict(id=3, image_id=2, category_id=9, bbox=[20, 20, 50, 40]),
      dict(id=4, image_id=2, category_id=5, bbox=[80, 0, 40, 40], iscrowd=1)]


def _mask(bbox: List[float]) -> np.ndarray:
    x, y, w, h = (int(v) for v in bbox)
    mask = np.zeros((H, W), np.uint8)
    mask[y:y + h, x:x + w] = 1
    return mask


def _rle(bbox: List[float]) -> Dict[str, Any]:
    rle = mask_utils.encode(np.asfortranarray(_mask(bbox)))
    return {'size': rle['size'], 'counts': rle['counts'].decode('ascii')}


def _write_gt(path: Path) -> Path:
    annotations = [dict(a, iscrowd=a.get('iscrowd', 0), area=float(a['bbox'][2] * a['bbox'][3]),
                        segmentation=_rle(a['bbox'])) for a in GT]
    data = dict(images=[dict(id=i, file_name=f'{i}.png', height=H, width=W) for i in (1, 2)],
                annotations=annotations, categories=[dict(id=5, name='a'), dict(id=9, name='b')])
    path.write_text(json.dumps(data))
    return path


def _det(image_id: int, category_id: int, bbox: List[float], score: float) -> Dict[str, Any]:
    return dict(image_id=image_id, category_id=category_id, bbox=bbox, score=score, segmentation=_rle(bbox))


def _pycocotools(gt_file: Path, detections: List[Dict[str, Any]], iou_type: str,
                 image_ids: Optional[List[int]] = None) -> List[float]:
    """pycocotools as its own README runs it, on the files."""
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(gt_file))
        dt = gt.loadRes(json.loads(json.dumps(detections)))
        evaluator = COCOeval(gt, dt, iou_type)
        if image_ids is not None:
            evaluator.params.imgIds = image_ids
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    return evaluator.stats.tolist()


PERFECT = [_det(a['image_id'], a['category_id'], a['bbox'], 0.9) for a in GT if not a.get('iscrowd')]
CASES = {
    # every object found: AP 1 in each area range that has objects (no large ones: -1)
    'perfect': (PERFECT, 1.0),
    # one of category 5's two objects missed: precision 1 up to recall 0.5, then nothing: 51 of COCO's 101 recall
    # points -> 51/101 for category 5, 1 for category 9
    'miss': (PERFECT[1:], (51 / 101 + 1) / 2),
    # a duplicate of a found object with a lower score: a false positive after every true one, AP stays 1
    'duplicate': (PERFECT + [_det(1, 5, [11, 11, 40, 30], 0.5)], 1.0),
    # a false positive scored above everything in category 9: precision 1/2 at its only recall -> AP 1/2 there
    'false positive first': (PERFECT + [_det(2, 9, [0, 70, 20, 20], 0.95)], (1 + 0.5) / 2),
    # detections on the crowd region are ignored, whatever their score (COCO's iscrowd semantics)
    'on a crowd region': (PERFECT + [_det(2, 5, [82, 2, 30, 30], 0.99), _det(2, 5, [85, 5, 20, 20], 0.98)], 1.0),
}


@pytest.mark.parametrize('case', sorted(CASES))
def test_known_ap_equals_pycocotools(tmp_path, case):
    gt_file = _write_gt(tmp_path / 'gt.json')
    detections, expected_ap = CASES[case]
    ours = coco_evaluate(load_coco(str(gt_file)), detections)
    for iou_type in ('bbox', 'segm'):
        assert ours[iou_type]['AP'] == pytest.approx(expected_ap, abs=1e-12)
        assert [ours[iou_type][name] for name in STAT_NAMES] == _pycocotools(gt_file, detections, iou_type)
    assert ours['bbox']['APl'] == -1  # no large object
    assert ours['bbox']['summary'].count('Average Precision') == 6


def test_scored_images_and_empty_detections(tmp_path):
    gt_file = _write_gt(tmp_path / 'gt.json')
    gt = load_coco(str(gt_file))
    detections = [d for d in PERFECT if d['image_id'] == 2]
    ours = coco_evaluate(gt, detections, iou_types=('bbox',), image_ids=[2])
    assert ours['bbox']['AP'] == pytest.approx(1.0)  # image 1's objects are not scored
    assert [ours['bbox'][n] for n in STAT_NAMES] == _pycocotools(gt_file, detections, 'bbox', image_ids=[2])
    assert coco_evaluate(gt, detections, iou_types=('bbox',))['bbox']['AP'] < 1  # all images: misses count
    nothing = coco_evaluate(gt, [])  # pycocotools' loadRes cannot read []: no detection scores 0
    assert nothing['bbox']['AP'] == 0 and nothing['segm']['AP50'] == 0 and nothing['bbox']['APl'] == -1
    with pytest.raises(ValueError, match='not scored, e.g. image_id .1.'):
        coco_evaluate(gt, PERFECT, image_ids=[2])
    no_masks = [{k: v for k, v in d.items() if k != 'segmentation'} for d in PERFECT]
    with pytest.raises(ValueError, match=r"iou_types=\('bbox',\)"):
        coco_evaluate(gt, no_masks)
    assert coco_evaluate(gt, no_masks, iou_types=('bbox',))['bbox']['AP'] == pytest.approx(1.0)  # the hint works


def test_torchvision_outputs_to_coco_results():
    masks = torch.zeros(2, 1, H, W)
    masks[0, 0, 10:40, 10:50] = 0.9
    masks[0, 0, 0:5, 0:5] = 0.5  # not above the threshold
    masks[1, 0, 60:70, 70:80] = 0.7
    output = dict(boxes=torch.tensor([[10., 10., 50., 40.], [70., 60., 80., 70.]]), scores=torch.tensor([0.9, 0.4]),
                  labels=torch.tensor([2, 1]), masks=masks)
    results = detections_to_coco(output, 7, category_ids=[5, 9])
    assert [r['category_id'] for r in results] == [9, 5] and [r['image_id'] for r in results] == [7, 7]
    assert results[0]['bbox'] == [10., 10., 40., 30.] and results[1]['score'] == pytest.approx(0.4)
    decoded = mask_utils.decode({'size': [H, W], 'counts': results[0]['segmentation']['counts'].encode()})
    assert np.array_equal(decoded, _mask([10, 10, 40, 30]))
    json.dumps(results)  # COCO's result file format
    boxes_only = detections_to_coco({k: v for k, v in output.items() if k != 'masks'}, 7, [5, 9])
    assert 'segmentation' not in boxes_only[0]
