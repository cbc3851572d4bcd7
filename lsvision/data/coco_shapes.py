"""COCO shapes: a small COCO-format instance segmentation dataset generated locally, the data of `make demo-detect`.

Each image holds 1-4 non-overlapping objects (one image in twenty: none) of three classes (square, circle,
triangle) in random colours on a noisy background. The masks are exact: a polygon's pixels are what pycocotools
rasterizes from the polygon written to the annotation file (squares, triangles), a circle's are the disc written as
a compressed RLE, and the image is painted from those same masks, so the ground truth is the drawing. Train images
are JPEG files and val images PNG files, with `annotations/instances_{train,val}.json` in COCO's layout (bbox xywh,
area, iscrowd 0):

    <root>/train/000001.jpg ...   <root>/val/000001.png ...   <root>/annotations/instances_train.json ...
"""
import json
import os
import shutil
from typing import Any, Dict, List, Tuple

import numpy as np
from PIL import Image
from pycocotools import mask as mask_utils

from ._cache import building, publish

__all__ = ['SHAPE_CLASSES', 'generate_coco_shapes', 'default_coco_shapes_root', 'generate_semantic_shapes']

SHAPE_CLASSES = ('square', 'circle', 'triangle')
_VERSION = 1  # bump when the generated data changes, so that cached trees are rebuilt


def default_coco_shapes_root() -> str:
    """Cache directory of the generated tree: $LSVISION_CACHE or ~/.cache/lsvision, then `coco_shapes`."""
    cache = os.environ.get('LSVISION_CACHE') or os.path.join(os.path.expanduser('~'), '.cache', 'lsvision')
    return os.path.join(cache, 'coco_shapes')


def _polygon(kind: str, cx: float, cy: float, r: float, angle: float) -> List[float]:
    """A square or triangle of circumradius `r` around (cx, cy), turned by `angle`, as COCO's flat [x, y, ...]."""
    corners = 4 if kind == 'square' else 3
    t = angle + np.arange(corners) * 2 * np.pi / corners
    return np.stack([cx + r * np.cos(t), cy + r * np.sin(t)], 1).round(2).reshape(-1).tolist()


def _disc(cx: float, cy: float, r: float, height: int, width: int) -> np.ndarray:
    yy, xx = np.mgrid[:height, :width]
    return ((xx + 0.5 - cx) ** 2 + (yy + 0.5 - cy) ** 2 <= r * r).astype(np.uint8)


def _object(rng: np.random.RandomState, height: int, width: int, min_size: int, max_size: int
            ) -> Tuple[int, Any, np.ndarray]:
    """One object: (category id, COCO segmentation, its exact mask)."""
    category = int(rng.randint(len(SHAPE_CLASSES))) + 1
    r = rng.uniform(min_size, max_size) / 2
    cx, cy = rng.uniform(r, width - r), rng.uniform(r, height - r)
    if SHAPE_CLASSES[category - 1] == 'circle':
        mask = _disc(cx, cy, r, height, width)
        rle = mask_utils.encode(np.asfortranarray(mask))
        return category, {'size': rle['size'], 'counts': rle['counts'].decode('ascii')}, mask
    poly = _polygon(SHAPE_CLASSES[category - 1], cx, cy, r, rng.uniform(0, np.pi))
    mask = mask_utils.decode(mask_utils.merge(mask_utils.frPyObjects([poly], height, width)))
    return category, [poly], mask


def _image(rng: np.random.RandomState, image_id: int, height: int, width: int, max_objects: int,
           sizes: Tuple[int, int]) -> Tuple[np.ndarray, List[Dict[str, Any]]]:
    """An image and its annotations (without ids): objects placed where they do not touch earlier ones."""
    pixels = rng.randint(0, 60, size=(height, width, 3)) + rng.randint(0, 120, size=(1, 1, 3))
    taken = np.zeros((height, width), dtype=bool)
    annotations = []
    for _ in range(0 if rng.rand() < 0.05 else rng.randint(1, max_objects + 1)):  # a few images have none
        for _try in range(20):
            category, segmentation, mask = _object(rng, height, width, *sizes)
            grown = np.zeros_like(taken)  # a margin of 2 pixels keeps objects apart
            ys, xs = np.nonzero(mask)
            if len(ys) == 0:
                continue
            grown[max(ys.min() - 2, 0):ys.max() + 3, max(xs.min() - 2, 0):xs.max() + 3] = True
            if not (grown & taken).any():
                break
        else:
            continue
        taken |= grown
        pixels[mask.astype(bool)] = rng.randint(100, 256, size=3)
        rle = mask_utils.encode(np.asfortranarray(mask))
        x, y, w, h = mask_utils.toBbox(rle).tolist()
        annotations.append(dict(image_id=image_id, category_id=category, segmentation=segmentation,
                                area=float(mask_utils.area(rle)), bbox=[x, y, w, h], iscrowd=0))
    return pixels.astype(np.uint8), annotations


def _write_split(root: str, split: str, count: int, rng: np.random.RandomState, height: int, width: int,
                 max_objects: int, sizes: Tuple[int, int]) -> str:
    extension = 'jpg' if split == 'train' else 'png'
    os.makedirs(os.path.join(root, split))
    images, annotations = [], []
    for image_id in range(1, count + 1):
        pixels, objects = _image(rng, image_id, height, width, max_objects, sizes)
        file_name = f'{image_id:06d}.{extension}'
        Image.fromarray(pixels).save(os.path.join(root, split, file_name), **({'quality': 95} if extension == 'jpg'
                                                                               else {}))
        images.append(dict(id=image_id, file_name=file_name, height=height, width=width))
        for obj in objects:
            annotations.append(dict(id=len(annotations) + 1, **obj))
    categories = [dict(id=i + 1, name=name, supercategory='shape') for i, name in enumerate(SHAPE_CLASSES)]
    path = os.path.join(root, 'annotations', f'instances_{split}.json')
    with open(path, 'w') as f:
        json.dump(dict(images=images, annotations=annotations, categories=categories), f)
    return path


def generate_coco_shapes(root: str = '', num_train: int = 400, num_val: int = 50,
                         image_size: Tuple[int, int] = (128, 128), max_objects: int = 4,
                         object_sizes: Tuple[int, int] = (16, 56), seed: int = 0) -> Dict[str, str]:
    """Writes the dataset (once: a tree of the same settings is reused) and returns its paths.

    Args:
        root: Where to write it ('' = `default_coco_shapes_root()`).
        num_train: Train images.
        num_val: Val images.
        image_size: (height, width) of every image.
        max_objects: Most objects per image (an image may hold none).
        object_sizes: Smallest and largest object diameter in pixels.
        seed: Fixes every image and annotation.

    Returns:
        `train_images`, `train_annotations`, `val_images`, `val_annotations`: the folders and instance files.
    """
    root = os.path.abspath(root or default_coco_shapes_root())
    settings = dict(version=_VERSION, num_train=num_train, num_val=num_val, image_size=list(image_size),
                    max_objects=max_objects, object_sizes=list(object_sizes), seed=seed)
    paths = {f'{split}_images': os.path.join(root, split) for split in ('train', 'val')}
    paths.update({f'{split}_annotations': os.path.join(root, 'annotations', f'instances_{split}.json')
                  for split in ('train', 'val')})
    stamp = os.path.join(root, 'settings.json')
    with building(root):  # another process generating the same tree: wait for it, then reuse it
        if os.path.isfile(stamp):
            with open(stamp) as f:
                if json.load(f) == settings:
                    return paths
        with publish(root, '.coco_shapes-') as tmp:  # built aside, then moved: never half a tree
            os.makedirs(os.path.join(tmp, 'annotations'))
            rng = np.random.RandomState(seed)
            height, width = image_size
            for split, count in (('train', num_train), ('val', num_val)):
                _write_split(tmp, split, count, rng, height, width, max_objects, tuple(object_sizes))
            with open(os.path.join(tmp, 'settings.json'), 'w') as f:
                json.dump(settings, f)
    return paths



def generate_semantic_shapes(root: str = '', num_train: int = 400, num_val: int = 50,
                             image_size: Tuple[int, int] = (128, 128), max_objects: int = 4,
                             object_sizes: Tuple[int, int] = (16, 56), seed: int = 0) -> Dict[str, Any]:
    """The COCO shapes (same arguments as `generate_coco_shapes`) as semantic segmentation data, the data of
    `make demo-segment`: an image / mask folder pair per split, each mask a PNG of the class of every pixel (0 the
    background, 1-3 the shapes: the instance masks painted with their category id; objects never overlap), and
    `classes.txt`:

        <root>/images/{train,val}/000001.{jpg,png} ...   <root>/masks/{train,val}/000001.png ...   <root>/classes.txt

    Written once (a tree of the same settings is reused), under `default_coco_shapes_root()` + '_semantic' by
    default.

    Returns:
        `root` and `classes` (background first).
    """
    root = os.path.abspath(root or default_coco_shapes_root() + '_semantic')
    settings = dict(version=_VERSION, num_train=num_train, num_val=num_val, image_size=list(image_size),
                    max_objects=max_objects, object_sizes=list(object_sizes), seed=seed)
    classes = ['background', *SHAPE_CLASSES]
    stamp = os.path.join(root, 'settings.json')
    with building(root):
        if os.path.isfile(stamp):
            with open(stamp) as f:
                if json.load(f) == settings:
                    return dict(root=root, classes=classes)
        with publish(root, '.semantic_shapes-') as tmp:
            coco = generate_coco_shapes(os.path.join(tmp, 'coco'), **{k: v for k, v in settings.items()
                                                                        if k != 'version'})
            for split in ('train', 'val'):
                _write_semantic_split(tmp, split, coco[f'{split}_images'], coco[f'{split}_annotations'])
            shutil.rmtree(os.path.join(tmp, 'coco'))
            os.remove(os.path.join(tmp, 'coco.lock'))  # generate_coco_shapes' lock beside its tree
            with open(os.path.join(tmp, 'classes.txt'), 'w') as f:
                f.write('\n'.join(classes) + '\n')
            with open(os.path.join(tmp, 'settings.json'), 'w') as f:
                json.dump(settings, f)
    return dict(root=root, classes=classes)


def _write_semantic_split(root: str, split: str, image_dir: str, annotations: str) -> None:
    with open(annotations) as f:
        data = json.load(f)
    os.makedirs(os.path.join(root, 'masks', split))
    shutil.move(image_dir, os.path.join(root, 'images', split))
    by_image: Dict[int, List[Dict[str, Any]]] = {}
    for ann in data['annotations']:
        by_image.setdefault(ann['image_id'], []).append(ann)
    for image in data['images']:
        h, w = image['height'], image['width']
        semantic = np.zeros((h, w), dtype=np.uint8)
        for ann in by_image.get(image['id'], []):
            seg = ann['segmentation']
            rle = mask_utils.merge(mask_utils.frPyObjects(seg, h, w)) if isinstance(seg, list) else \
                dict(size=seg['size'], counts=seg['counts'].encode('ascii'))
            semantic[mask_utils.decode(rle).astype(bool)] = ann['category_id']
        name = os.path.splitext(image['file_name'])[0] + '.png'
        Image.fromarray(semantic).save(os.path.join(root, 'masks', split, name))
