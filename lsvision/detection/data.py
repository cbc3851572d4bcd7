"""COCO-format instance data (an `instances_*.json` and its image folder) as torchvision detection targets.

`CocoInstances` reads the annotation file with pycocotools and gives, per image, a float image tensor in [0, 1]
(3, H, W) and torchvision's target dict: `boxes` (N, 4) xyxy in pixels, `labels` (N,) int64 in 1..K (the file's
category ids in increasing order; 0 is the background), `masks` (N, H, W) uint8 (from polygons, RLE or compressed
RLE, through pycocotools), `image_id`. The metric reads the annotation file itself (`coco_eval`), so what is done
to the training targets below never changes a score.

Bad input, checked when the dataset is built (every problem named with its image, annotation id and file):
- an image file missing, unreadable, or of another size than the file records; an annotation whose bbox is not
  four numbers, whose category is not among the file's categories, or whose segmentation is a malformed polygon or
  RLE: an error (`CocoDataError`) listing them, unless `skip_bad=True`, which leaves each such image out of training
  and evaluation (the metric is computed over the other images; `left_out` names them);
- crowd annotations (`iscrowd: 1`): not training targets (as torchvision's and mmdetection's COCO recipes); in
  evaluation they are pycocotools' ignore regions;
- degenerate boxes (no width or height inside the image, e.g. a box wholly outside it): not training targets
  (torchvision's detectors refuse them), counted in `stats` and the first few named there (image, annotation id,
  the box as the file gives it); evaluation reads them as pycocotools does;
- images without annotations: kept for evaluation (their detections are false positives); in training they are kept
  as negative images unless `drop_empty=True` (mmdetection's `filter_empty_gt`, which the COCO recipes use);
- categories that do not match the model: `check_num_classes` says which `num_classes` the file needs.
"""
import contextlib
import io
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.utils.data
from PIL import Image, UnidentifiedImageError
from pycocotools import mask as mask_utils
from pycocotools.coco import COCO
from torchvision import tv_tensors
from torchvision.transforms.v2 import functional as TF

from ..eval.distributed import all_gather, shard_range
from ..train.data import derive_seed

__all__ = ['CocoDataError', 'CocoProblem', 'CocoStats', 'CocoInstances', 'load_coco', 'find_problems',
           'collate_detection', 'describe_degenerate_box']

# how many problems an error message lists before it says "and N more"
_LISTED = 8


class CocoDataError(ValueError):
    """An annotation file or image folder that cannot be used as it is; the message names what and how to go on."""


@dataclass
class CocoProblem:
    """One bad input: its kind (`malformed image entry`, `missing image`, `unreadable image`, `size mismatch`,
    `malformed bbox`, `unknown category`, `malformed polygon`, `malformed RLE`), the image, and what is wrong."""
    kind: str
    image_id: int
    file_name: str
    detail: str

    def __str__(self) -> str:
        return f'{self.kind}: image {self.image_id} ({self.file_name}): {self.detail}'


@dataclass
class CocoStats:
    """What the reader kept out of the training targets or the data, by kind."""
    images: int = 0
    annotations: int = 0
    crowd: int = 0
    degenerate_boxes: int = 0
    degenerate_examples: List[Dict[str, Any]] = field(default_factory=list)  # the first _LISTED of them
    empty_images: int = 0
    dropped_empty_images: int = 0
    left_out_images: List[int] = field(default_factory=list)


def describe_degenerate_box(example: Dict[str, Any]) -> str:
    """One entry of `CocoStats.degenerate_examples` in words."""
    return (f"image {example['image_id']} ({example['file_name']}), annotation {example['annotation_id']}: bbox "
            f"{example['bbox']} {example['why']}")


def load_coco(ann_file: str) -> COCO:
    """pycocotools' COCO of an annotation file, without its prints, with a clear error for a missing or bad file."""
    if not os.path.isfile(ann_file):
        raise CocoDataError(f'annotation file not found: {ann_file} (give the instances_*.json of the split)')
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            coco = COCO(ann_file)
    except (ValueError, KeyError, TypeError, AssertionError) as e:
        raise CocoDataError(f'{ann_file} is not a COCO instances file (a JSON object with images, annotations and '
                            f'categories): {type(e).__name__}: {e}') from None
    for key in ('images', 'categories'):
        if not coco.dataset.get(key):
            raise CocoDataError(f'{ann_file} has no {key}: a COCO instances file lists its {key}')
    return coco


def _finite_numbers(values: Any) -> bool:
    return isinstance(values, (list, tuple)) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values)


def _segmentation_problem(segmentation: Any, height: int, width: int) -> Optional[Tuple[str, str]]:
    """(kind, detail) of a segmentation pycocotools cannot turn into a mask of this image, else None."""
    if isinstance(segmentation, list):
        for poly in segmentation:
            if not _finite_numbers(poly) or len(poly) < 6 or len(poly) % 2:
                return 'malformed polygon', ('each polygon must be a flat list [x1, y1, x2, y2, ...] of at least 3 '
                                             f'points; got {str(poly)[:60]}')
        return None if segmentation else ('malformed polygon', 'an empty list of polygons')
    if not isinstance(segmentation, dict) or 'counts' not in segmentation or 'size' not in segmentation:
        return 'malformed RLE', 'a segmentation must be a list of polygons or an RLE {"size": [h, w], "counts": ...}'
    size, counts = segmentation['size'], segmentation['counts']
    if list(size) != [height, width]:
        return 'malformed RLE', f"its size {size} is not the image's [height, width] [{height}, {width}]"
    if isinstance(counts, list):
        if not all(isinstance(c, int) and c >= 0 for c in counts) or sum(counts) != height * width:
            return 'malformed RLE', f'uncompressed counts must be non-negative ints summing to {height} * {width}'
        return None
    if not isinstance(counts, (str, bytes)):
        return 'malformed RLE', f'counts must be a list of ints or a compressed string, not {type(counts).__name__}'
    rle = {'size': [height, width], 'counts': counts.encode('ascii', 'replace') if isinstance(counts, str) else counts}
    try:
        decoded = mask_utils.decode(rle)
    except (ValueError, TypeError) as e:
        return 'malformed RLE', f'compressed counts do not decode: {e}'
    # pycocotools decodes some corrupt strings without an error; a valid one is what encoding its mask gives back
    if mask_utils.encode(np.asfortranarray(decoded))['counts'] != rle['counts']:
        return 'malformed RLE', 'compressed counts do not decode to a mask of the image (pycocotools reads them back ' \
                                'differently)'
    return None


def _annotation_problems(coco: COCO, image: Dict[str, Any], category_ids: set) -> List[CocoProblem]:
    problems = []
    for ann in coco.imgToAnns.get(image['id'], []):
        found = None
        if not _finite_numbers(ann.get('bbox')) or len(ann['bbox']) != 4:
            found = ('malformed bbox', f'bbox must be [x, y, width, height], got {ann.get("bbox")!r}')
        elif ann.get('category_id') not in category_ids:
            found = ('unknown category', f'category_id {ann.get("category_id")!r} is not in the file\'s categories')
        elif 'segmentation' in ann:
            found = _segmentation_problem(ann['segmentation'], image['height'], image['width'])
        if found:
            problems.append(CocoProblem(found[0], image['id'], image.get('file_name', ''),
                                        f'annotation {ann.get("id")}: {found[1]}'))
    return problems


def _image_problem(image: Dict[str, Any], image_dir: str) -> Optional[CocoProblem]:
    name = image.get('file_name', '')
    fields = [k for k in ('file_name', 'height', 'width') if k not in image]
    if fields:
        return CocoProblem('malformed image entry', image['id'], name, f'no {", ".join(fields)} in its entry')
    path = os.path.join(image_dir, name)
    if not os.path.isfile(path):
        return CocoProblem('missing image', image['id'], name, f'no file {path}')
    try:
        with Image.open(path) as im:
            size = im.size
    except (UnidentifiedImageError, OSError) as e:
        return CocoProblem('unreadable image', image['id'], name, f'{path}: {e}')
    if size != (image.get('width'), image.get('height')):
        return CocoProblem('size mismatch', image['id'], name, f'the file is {size[0]} x {size[1]} (width x height), '
                                                               f'the annotation file records {image.get("width")} x '
                                                               f'{image.get("height")}')
    return None


def find_problems(coco: COCO, image_dir: str, image_ids: Sequence[int]) -> List[CocoProblem]:
    """Every bad image and annotation of `image_ids`; under torchrun each process checks a shard of the images
    (their headers only) and all processes get the whole list."""
    category_ids = set(coco.getCatIds())
    mine = []
    for i in shard_range(len(image_ids)):
        image = coco.imgs[image_ids[i]]
        problem = _image_problem(image, image_dir)
        mine.extend([problem] if problem else _annotation_problems(coco, image, category_ids))
    return [p for part in all_gather(mine) for p in part]


def _problems_error(problems: List[CocoProblem], ann_file: str, image_dir: str) -> CocoDataError:
    kinds: Dict[str, int] = {}
    for p in problems:
        kinds[p.kind] = kinds.get(p.kind, 0) + 1
    listed = '\n  '.join(str(p) for p in problems[:_LISTED])
    more = f'\n  ... and {len(problems) - _LISTED} more' if len(problems) > _LISTED else ''
    images = len({p.image_id for p in problems})
    return CocoDataError(
        f'{ann_file} with images in {image_dir}: {len(problems)} problem(s) in {images} image(s) ('
        + ', '.join(f'{n} {k}' for k, n in kinds.items()) + f'):\n  {listed}{more}\n'
        'Fix them, or leave those images out of training and evaluation with --skip-bad-images (skip_bad=True); '
        'the report then names them and the metric covers the other images.')


class CocoInstances(torch.utils.data.Dataset):
    """A COCO-format split as (image, target) pairs for torchvision's detection models.

    Args:
        ann_file: The split's `instances_*.json`.
        image_dir: The folder its `file_name`s are relative to.
        train: Random horizontal flips (p = 0.5, seeded by `seed`, the epoch (`set_epoch`) and the index, so a
            resumed run sees the same flips) and the empty-image rule below.
        skip_bad: Leave images with bad files or annotations out (else a `CocoDataError` lists them).
        drop_empty: In training, leave out images without a non-crowd box (mmdetection's `filter_empty_gt`).
        seed: Seed of the flips.
    """

    def __init__(self, ann_file: str, image_dir: str, train: bool = False, skip_bad: bool = False,
                 drop_empty: bool = False, seed: int = 0):
        if not os.path.isdir(image_dir):
            raise CocoDataError(f'image folder not found: {image_dir} (the folder the file_names of {ann_file} are '
                                'relative to)')
        self.ann_file, self.image_dir, self.train, self.seed, self.epoch = ann_file, image_dir, train, seed, 0
        self.coco = load_coco(ann_file)
        self.category_ids = sorted(self.coco.getCatIds())
        self.class_names = [self.coco.cats[c].get('name', str(c)) for c in self.category_ids]
        self.label_of = {c: i + 1 for i, c in enumerate(self.category_ids)}
        all_ids = sorted(self.coco.getImgIds())
        self.problems = find_problems(self.coco, image_dir, all_ids)
        if self.problems and not skip_bad:
            raise _problems_error(self.problems, ann_file, image_dir)
        bad = {p.image_id for p in self.problems}
        self.stats = CocoStats(left_out_images=sorted(bad))
        self.image_ids = [i for i in all_ids if i not in bad]
        self._count(drop_empty and train)

    def _count(self, drop_empty: bool) -> None:
        kept = []
        for image_id in self.image_ids:
            anns = self.coco.imgToAnns.get(image_id, [])
            crowd = sum(bool(a.get('iscrowd', 0)) for a in anns)
            solid = [a for a in anns if not a.get('iscrowd', 0)]
            boxes = self._boxes(solid, self.coco.imgs[image_id])[1]
            self.stats.annotations += len(anns)
            self.stats.crowd += crowd
            self.stats.degenerate_boxes += len(anns) - crowd - int(boxes.sum())
            for ann in (a for a, has_area in zip(solid, boxes) if not has_area):
                if len(self.stats.degenerate_examples) < _LISTED:
                    self.stats.degenerate_examples.append(self._degenerate(ann, self.coco.imgs[image_id]))
            empty = not boxes.any()
            self.stats.empty_images += empty
            if empty and drop_empty:
                self.stats.dropped_empty_images += 1
            else:
                kept.append(image_id)
        self.image_ids = kept
        self.stats.images = len(kept)

    @staticmethod
    def _degenerate(ann: Dict[str, Any], image: Dict[str, Any]) -> Dict[str, Any]:
        """A box without area inside its image: where it is and why."""
        w, h = ann['bbox'][2:]
        why = ('has no width or height' if w <= 0 or h <= 0 else
               f"lies wholly outside the {image['width']}x{image['height']} image")
        return dict(image_id=image['id'], file_name=image.get('file_name'), annotation_id=ann.get('id'),
                    bbox=list(ann['bbox']), why=why)

    @property
    def num_classes(self) -> int:
        """Classes of a detector for this file: its categories plus the background."""
        return len(self.category_ids) + 1

    def check_num_classes(self, num_classes: int) -> None:
        """Raises CocoDataError unless a model with `num_classes` outputs (background included) fits the file."""
        if num_classes != self.num_classes:
            names = ', '.join(self.class_names[:10]) + (', ...' if len(self.class_names) > 10 else '')
            raise CocoDataError(
                f'{self.ann_file} has {len(self.category_ids)} categories ({names}), so a detector for it has '
                f'num_classes {self.num_classes} (background included), not {num_classes}: pass --num-classes '
                f'{self.num_classes} (or leave it unset to take it from the file)')

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.image_ids)

    @staticmethod
    def _boxes(anns: List[Dict[str, Any]], image: Dict[str, Any]) -> Tuple[np.ndarray, np.ndarray]:
        """The annotations' boxes as xyxy clipped to the image, and which of them have an area."""
        boxes = np.array([a['bbox'] for a in anns], dtype=np.float32).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]
        boxes[:, 0::2] = boxes[:, 0::2].clip(0, image['width'])
        boxes[:, 1::2] = boxes[:, 1::2].clip(0, image['height'])
        return boxes, (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])

    def _read(self, info: Dict[str, Any]) -> torch.Tensor:
        path = os.path.join(self.image_dir, info['file_name'])
        try:
            with Image.open(path) as im:
                rgb = im.convert('RGB')
        except (UnidentifiedImageError, OSError) as e:  # the header was fine when the dataset was built
            raise CocoDataError(f'cannot decode image {info["id"]} ({path}): {e}; replace the file, or remove its '
                                f'entry from {self.ann_file}') from None
        return TF.to_dtype(TF.to_image(rgb), torch.float32, scale=True)

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        image_id = self.image_ids[index]
        info = self.coco.imgs[image_id]
        image = self._read(info)
        anns = [a for a in self.coco.imgToAnns.get(image_id, []) if not a.get('iscrowd', 0)]
        boxes, keep = self._boxes(anns, info)
        anns = [a for a, k in zip(anns, keep) if k]
        height, width = info['height'], info['width']
        masks = np.stack([self.coco.annToMask(a) for a in anns]) if anns else np.zeros((0, height, width), np.uint8)
        target = {
            'boxes': tv_tensors.BoundingBoxes(torch.from_numpy(boxes[keep]), format='XYXY', canvas_size=(height,
                                                                                                         width)),
            'labels': torch.tensor([self.label_of[a['category_id']] for a in anns], dtype=torch.int64),
            'masks': tv_tensors.Mask(torch.from_numpy(masks)),
            'image_id': image_id,
        }
        if self.train and self._flip(index):
            image = TF.horizontal_flip(image)
            target['boxes'] = TF.horizontal_flip(target['boxes'])
            target['masks'] = TF.horizontal_flip(target['masks'])
        target['boxes'] = target['boxes'].as_subclass(torch.Tensor)
        target['masks'] = target['masks'].as_subclass(torch.Tensor)
        return image, target

    def _flip(self, index: int) -> bool:
        generator = torch.Generator().manual_seed(derive_seed(self.seed, self.epoch, index))
        return bool(torch.rand((), generator=generator) < 0.5)


def collate_detection(batch: List[Any]) -> Tuple[List[torch.Tensor], List[Dict[str, Any]]]:
    """A batch as torchvision's detectors take it: a list of images and a list of targets."""
    images, targets = zip(*batch)
    return list(images), list(targets)
